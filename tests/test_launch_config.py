"""The launch configurations refuse a bad field where they are made (kernels/spec/launch.py):
a wrong type with TypeError, a value out of range with ValueError, each naming the class, the
field and the value; the defaults and every config the library and the bench build are valid;
a config made inside a compiled region traces."""

import dataclasses
import re

import pytest
import torch

from kernels import permute as triton_permute
from kernels import quantize as triton_quantize
from kernels import routing as triton_routing
from kernels.spec.launch import MAX_WARPS, checked_launch

CLASSES = (triton_permute.PermuteLaunch, triton_permute.GatherLaunch,
           triton_quantize.NVFP4Launch, triton_quantize.BlockLaunch,
           triton_quantize.AmaxLaunch, triton_routing.RoutingLaunch)

# (class, field, bad value, error, words of the message)
BAD = [
    (triton_permute.PermuteLaunch, "overlap_previous", 1, TypeError, "must be a bool"),
    (triton_permute.PermuteLaunch, "form", "two_pass", ValueError,
     "must be one of ('single', 'three_pass') or None"),
    (triton_permute.PermuteLaunch, "form", 2, TypeError, "must be None or a str"),
    (triton_permute.PermuteLaunch, "single_programs", 0, ValueError, "must be a positive int"),
    (triton_permute.PermuteLaunch, "single_programs", 64.0, TypeError, "must be an int"),
    (triton_permute.PermuteLaunch, "single_warps", 3, ValueError, "must be a power of two"),
    (triton_permute.PermuteLaunch, "place_warps", 2 * MAX_WARPS, ValueError, "[1, 32]"),
    (triton_permute.PermuteLaunch, "single_chunk", 300, ValueError, "positive power of two"),
    (triton_permute.PermuteLaunch, "block_pairs", 100, ValueError, "positive power of two"),
    (triton_permute.PermuteLaunch, "place_rank", 2, ValueError, "must be one of (0, 1)"),
    (triton_permute.GatherLaunch, "group_tokens", 1, TypeError, "must be a bool"),
    (triton_permute.GatherLaunch, "group_tokens", "no", TypeError, "must be a bool"),
    (triton_permute.GatherLaunch, "slice_pairs", 3, ValueError, "positive power of two"),
    (triton_permute.GatherLaunch, "slice_pairs", True, TypeError, "must be None or an int"),
    (triton_permute.GatherLaunch, "programs", 0, ValueError, "must be a positive int"),
    (triton_permute.GatherLaunch, "warps", 32, ValueError, "must be at most 16"),
    (triton_quantize.NVFP4Launch, "num_warps", 3, ValueError, "power of two in [1, 32]"),
    (triton_quantize.NVFP4Launch, "prefetch", 4, ValueError, "must be one of (1, 2, 3)"),
    (triton_quantize.NVFP4Launch, "store_policy", "evict_never", ValueError, "must be one of"),
    (triton_quantize.NVFP4Launch, "maxnreg", 0, ValueError, "must be a positive int"),
    (triton_quantize.NVFP4Launch, "word_asm", None, TypeError, "must be a bool"),
    (triton_quantize.NVFP4Launch, "ptx", 1, TypeError, "must be None or a bool"),
    (triton_quantize.NVFP4Launch, "num_sms", -1, ValueError, "must be an int >= 0"),
    (triton_quantize.BlockLaunch, "tile_elements", 3000, ValueError, "positive power of two"),
    (triton_quantize.BlockLaunch, "hardware_e4m3", "yes", TypeError, "must be a bool"),
    (triton_quantize.AmaxLaunch, "programs_per_sm", 0, ValueError, "must be a positive int"),
    (triton_quantize.AmaxLaunch, "tile_rows", 6, ValueError, "positive power of two"),
    (triton_quantize.AmaxLaunch, "overlap_previous", 2, TypeError, "must be a bool"),
    (triton_routing.RoutingLaunch, "num_warps", 0, ValueError, "power of two in [1, 32]"),
    (triton_routing.RoutingLaunch, "rows_per_program", 3, ValueError, "positive power of two"),
    (triton_routing.RoutingLaunch, "keys", 7, ValueError, "must be one of (0, 1, 2)"),
    (triton_routing.RoutingLaunch, "group_top2", 2, ValueError, "must be one of (0, 1)"),
]


@pytest.mark.parametrize("cls, field, value, error, words", BAD,
                         ids=[f"{c.__name__}.{f}={v!r}" for c, f, v, _, _ in BAD])
def test_bad_field_is_refused_where_the_config_is_made(cls, field, value, error, words):
    with pytest.raises(error, match=rf"{cls.__name__}\.{field}={re.escape(repr(value))} "
                       rf".*{re.escape(words)}"):
        cls(**{field: value})
    # dataclasses.replace makes a new object: the same check
    with pytest.raises(error):
        dataclasses.replace(cls(), **{field: value})


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_defaults_are_frozen_and_valid(cls):
    config = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, dataclasses.fields(cls)[0].name, None)
    # the registered ops rebuild a config from its fields, in order
    assert cls(*(getattr(config, f.name) for f in dataclasses.fields(cls))) == config


def test_the_library_configs_are_valid():
    """The named configs of the library pass their checks again (dataclasses.replace makes a
    new object, checked as the first was at import) and the rules accept the boundaries."""
    for config in (triton_permute.DEFAULT_PERMUTE, triton_permute.ONEHOT_PERMUTE,
                   triton_permute.DEFAULT_GATHER, triton_quantize.DEFAULT_NVFP4,
                   triton_quantize.DEFAULT_BLOCK, triton_quantize.DEFAULT_AMAX,
                   triton_routing.SPLIT32_ROUTING, triton_routing.PACKED64_ROUTING):
        assert dataclasses.replace(config) == config
    triton_permute.PermuteLaunch(single_warps=1, place_warps=MAX_WARPS, form="single")
    triton_permute.GatherLaunch(slice_pairs=None, warps=16, programs=1)
    triton_quantize.NVFP4Launch(maxnreg=None, prefetch=1, store_policy="", ptx=True, num_sms=0)
    triton_routing.RoutingLaunch(rows_per_program=None)


def test_unknown_rule_field_is_a_definition_error():
    with pytest.raises(TypeError, match=r"no fields \['warp'\]"):
        @checked_launch(warps=("warp",))
        class Broken:
            warps: int = 4


def test_config_made_inside_a_compiled_region_traces():
    def step(x, overlap: bool):
        launch = triton_permute.PermuteLaunch(overlap_previous=overlap, single_programs=64)
        return x + launch.single_programs + triton_quantize.AmaxLaunch(
            overlap_previous=overlap).tile_rows

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.zeros(2), True), step(torch.zeros(2), True))
