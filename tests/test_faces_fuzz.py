"""Differential fuzz of the faces of every op: the torch oracle (``kernels.reference``) against
the Triton launcher (``kernels.<op>``) on random arguments, good and bad.

For every case both faces must either raise the same exception type with the same message, or
return results of the same dtype and shape, bit for bit (NaN payloads included). Shapes include
0, 1, odd sizes and sizes that are not multiples of any tile; inputs come as contiguous tensors
or as views (transposed, every other column or row, a column offset); floats carry zeros of
both signs, infinities, NaNs of both signs and tiny values. One case in three breaks one
argument (a wrong dtype, shape, range or value).

Cases per op: ``FUZZ_CASES`` (default 12, bounded for CI under Triton's interpreter); the seed:
``FUZZ_SEED`` (default 0). On the GPU host run more, e.g.
``FUZZ_CASES=300 python -m pytest tests/test_faces_fuzz.py``; a failing case prints its index
and its own seed, and the same ``FUZZ_SEED`` with ``FUZZ_CASES=<index + 1>`` and ``-k <op>``
replays it.

Left out on purpose: ``fast_math=True`` (a capability, not an argument: the torch face cannot
compute it and says so, the Triton face runs it only on a GPU); NaN and inf router logits
(their order is helper "decode"'s contract); E > 512 in ``route_topk`` (the Triton kernel holds
a row in registers and refuses it, naming the torch face). ``route_topk`` weights are compared
with ``FLOAT_TOLERANCES`` (exp and division differ in the last bit between libdevice and
torch); its ids exactly.
"""

from __future__ import annotations

import os
import random
from typing import Callable

import pytest
import torch

from kernels import gather as triton_gather
from kernels import permute as triton_permute
from kernels import prepare as triton_prepare
from kernels import quantize as triton_quantize
from kernels import reference
from kernels import routing as triton_routing
from kernels.spec import (FLOAT_TOLERANCES, GLOBAL_SCALE_MAX, GLOBAL_SCALE_MIN, ROUTING_METHODS,
                          SCALE_LAYOUTS, swizzled_scale_shape)
from kernels.types import UNUSED, Permutation

CASES = int(os.environ.get("FUZZ_CASES", "12"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))

SPECIALS = (0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-30, 6.0)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Random tensors
# ---------------------------------------------------------------------------------------------

class Draw:
    """One case's random choices: Python's generator for the arguments, torch's for values."""

    def __init__(self, seed: int, device: torch.device):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device

    def choice(self, options):
        return self.rng.choice(list(options))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def view(self, shape: tuple, make: Callable[[tuple], torch.Tensor]) -> torch.Tensor:
        """A tensor of ``shape`` from ``make(shape) -> contiguous CPU tensor``, as a contiguous
        tensor or as a view of a larger one, on the device."""
        kind = self.choice(["contiguous", "contiguous", "transposed", "column step",
                            "column offset", "row step"])
        if len(shape) == 1:
            kind = self.choice(["contiguous", "step", "offset"])
            if kind == "step":
                return make((2 * shape[0],)).to(self.device)[::2]
            if kind == "offset":
                return make((shape[0] + 3,)).to(self.device)[3:]
            return make(shape).to(self.device)
        rows, cols = shape
        if kind == "transposed":
            return make((cols, rows)).to(self.device).t()
        if kind == "column step":
            return make((rows, 2 * cols)).to(self.device)[:, ::2]
        if kind == "column offset":
            return make((rows, cols + 3)).to(self.device)[:, 3:]
        if kind == "row step":
            return make((2 * rows, cols)).to(self.device)[::2]
        return make(shape).to(self.device)

    def floats(self, shape: tuple, dtype: torch.dtype, *, specials: bool = True,
               scale: float = 3.0) -> torch.Tensor:
        def make(size):
            values = torch.randn(size, generator=self.gen) * scale
            if specials and values.numel() and self.chance(0.7):
                flat = values.view(-1)
                for _ in range(self.rng.randint(1, 4)):
                    flat[self.rng.randrange(flat.numel())] = self.choice(SPECIALS)
                if self.chance(0.3):  # a whole zero (or -0) block
                    flat[:16] = self.choice((0.0, -0.0))
            return values.to(dtype)
        return self.view(shape, make)

    def bytes(self, shape: tuple, dtype=torch.uint8) -> torch.Tensor:
        return self.view(shape, lambda size: torch.randint(0, 256, size, generator=self.gen,
                                                           dtype=torch.uint8).view(dtype))

    def ints(self, shape: tuple, low: int, high: int) -> torch.Tensor:
        """int32 values in [low, high)."""
        return self.view(shape, lambda size: torch.randint(low, high, size, generator=self.gen,
                                                           dtype=torch.int32))

    def index(self, size: int, limit: int, bad: bool) -> torch.Tensor:
        """[size] int32 entries in {UNUSED} U [0, limit), a few out of range when ``bad``."""
        def make(shape):
            values = torch.randint(UNUSED, max(limit, 0), shape, generator=self.gen,
                                   dtype=torch.int32) if limit > 0 else \
                torch.full(shape, UNUSED, dtype=torch.int32)
            if bad and values.numel():
                values.view(-1)[self.rng.randrange(values.numel())] = self.choice(
                    (limit, limit + 1, -2, -(2 ** 31), 2 ** 31 - 1))
            return values
        return self.view((size,), make)

    def routing_ids(self, num_tokens: int, top_k: int, num_ids: int) -> torch.Tensor:
        """[T, k] int32 ids in [0, num_ids] (num_ids = padding)."""
        return self.ints((num_tokens, top_k), 0, num_ids + 1)


# ---------------------------------------------------------------------------------------------
# Comparing two faces
# ---------------------------------------------------------------------------------------------

def tensors_of(result) -> list:
    """The result as a flat list of tensors and plain values (dataclasses field by field)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [item for part in result for item in tensors_of(part)]
    if hasattr(result, "tensors"):
        fields = result.__dataclass_fields__
        return [item for name in fields for item in tensors_of(getattr(result, name))]
    return [result]


OUTPUT_BUFFERS = ("out", "out_scales")


def run_face(fn, args, kwargs):
    """("returned", the result's items, tensors copied) or ("raised", the exception). Each face
    gets its own copy of the caller's output buffers (same strides), so that one face's writes
    cannot stand in for another's."""
    kwargs = {name: value.clone() if name in OUTPUT_BUFFERS and value is not None else value
              for name, value in kwargs.items()}
    try:
        result = fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the exception is what is compared
        return "raised", error
    return "returned", [item.clone() if isinstance(item, torch.Tensor) else item
                        for item in tensors_of(result)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in order (flat first: a dtype view refuses the odd stride
    a size-1 dim may carry)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(as_bytes(a), as_bytes(b))


def assert_faces_agree(op: str, case: str, torch_face, triton_face, args, kwargs,
                       close: Callable = None) -> None:
    """Both raise the same (type, message), or both return the same bits; ``close(a, b)``
    compares float tensors where bits are not the contract (routing weights)."""
    got = run_face(triton_face, args, kwargs)
    want = run_face(torch_face, args, kwargs)
    where = f"{op}, {case}"
    if got[0] == "raised" or want[0] == "raised":
        assert got[0] == want[0], (f"{where}: the Triton face {got[0]} {got[1]!r} but the torch "
                                   f"face {want[0]} {want[1]!r}")
        assert type(got[1]) is type(want[1]) and str(got[1]) == str(want[1]), (
            f"{where}: different errors:\n  triton: {got[1]!r}\n  torch:  {want[1]!r}")
        return
    ours, theirs = got[1], want[1]
    assert len(ours) == len(theirs), where
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if not isinstance(a, torch.Tensor):
            assert a == b, f"{where}: field {i}: {a!r} != {b!r}"
        elif close is not None and a.is_floating_point():
            assert a.dtype == b.dtype and a.shape == b.shape, where
            close(a, b)
        else:
            assert same_bits(a, b), (f"{where}: output {i} differs ({a.dtype} {tuple(a.shape)} "
                                     f"vs {b.dtype} {tuple(b.shape)})")


# ---------------------------------------------------------------------------------------------
# One random case per op: (description, args, kwargs)
# ---------------------------------------------------------------------------------------------

def case_permute(d: Draw):
    num_experts = d.choice([1, 3, 8, 60])
    top_k = d.rng.randint(1, min(num_experts, 8))
    num_tokens = d.choice([0, 1, 2, 7, 33, 130])
    first = d.rng.randrange(num_experts)
    local = d.choice([None, d.rng.randint(1, num_experts - first)])
    align = d.choice([1, 1, 4, 16])
    ids = d.routing_ids(num_tokens, top_k, num_experts)
    kwargs = dict(first_expert=first, num_local_experts=local, align=align,
                  check_ids=d.chance(0.7))
    bad = d.chance(1 / 3)
    if bad:
        what = d.choice(["id", "dtype", "align", "local", "k"])
        if what == "id" and ids.numel():
            ids = ids.clone()
            ids[d.rng.randrange(num_tokens), d.rng.randrange(top_k)] = d.choice(
                [-1, num_experts + 1, -(2 ** 31)])
        elif what == "dtype":
            ids = ids.long()
        elif what == "align":
            kwargs["align"] = 0
        elif what == "local":
            kwargs["num_local_experts"] = num_experts - first + 1
        elif what == "k":
            ids = d.routing_ids(num_tokens, num_experts + 1, num_experts)
    return f"T={num_tokens} k={ids.shape[1]} E={num_experts} {kwargs} bad={bad}", \
        (ids, num_experts), kwargs


def _permutation(d: Draw, num_tokens: int, top_k: int) -> Permutation:
    num_experts = d.choice([top_k, 8])
    ids = d.routing_ids(num_tokens, top_k, num_experts).contiguous()
    first = d.rng.randrange(num_experts)
    return reference.permute_by_expert(ids, num_experts, first_expert=first,
                                       align=d.choice([1, 4]))


def case_gather(d: Draw):
    num_tokens, top_k = d.choice([0, 1, 5, 9]), d.choice([1, 2, 3])
    dtype = d.choice(list(FLOATS) + [torch.uint8, torch.int8, torch.float8_e4m3fn])
    width = d.choice([0, 1, 3, 7, 16, 33])
    x = d.floats((num_tokens, width), dtype) if dtype in FLOATS else d.bytes((num_tokens, width),
                                                                             dtype)
    kwargs = dict(check_values=d.chance(0.6))
    if d.chance(0.4):
        rows = _permutation(d, num_tokens, top_k)
        if d.chance(0.3):
            kwargs["top_k"] = d.choice([top_k, top_k + 1])
    else:
        rows = d.index(d.choice([0, 1, 6, 20]), num_tokens * top_k, bad=d.chance(0.3))
        kwargs["top_k"] = top_k
    if d.chance(0.4):
        kwargs["scales"] = d.bytes((num_tokens, d.choice([1, 2, 4])))
    if d.chance(0.2):
        what = d.choice(["rows dtype", "scales rows", "top_k", "x rank"])
        if what == "rows dtype":
            rows = d.index(4, num_tokens * top_k, bad=False).long()
        elif what == "scales rows":
            kwargs["scales"] = d.bytes((num_tokens + 1, 2))
        elif what == "top_k":
            kwargs["top_k"] = d.choice([0, -1])
        else:
            x = x.reshape(-1)
    return f"x {dtype} {tuple(x.shape)} rows {type(rows).__name__} {sorted(kwargs)}", \
        (x, rows), kwargs


def case_unpermute(d: Draw):
    num_tokens, top_k = d.choice([0, 1, 4, 11]), d.choice([1, 2, 4])
    perm = _permutation(d, num_tokens, top_k)
    dtype = d.choice(FLOATS)
    hidden = d.choice([0, 1, 5, 24, 40])
    expert_out = d.floats((perm.source_rows.numel(), hidden), dtype)
    weights = d.floats((num_tokens, top_k), d.choice([torch.float32, torch.float32,
                                                      torch.bfloat16]), scale=1.0)
    kwargs = dict(check_values=d.chance(0.6))
    if d.chance(1 / 3):
        what = d.choice(["inverse", "inverse", "rows", "k", "dtype", "weights dtype"])
        if what == "inverse" and perm.inverse.numel():
            inverse = perm.inverse.clone()
            inverse[d.rng.randrange(inverse.numel())] = d.choice(
                [perm.source_rows.numel(), -2, 2 ** 31 - 1])
            perm = Permutation(**{**perm.tensors(), "inverse": inverse}, top_k=perm.top_k,
                               align=perm.align)
        elif what == "rows":
            expert_out = d.floats((perm.source_rows.numel() + 1, hidden), dtype)
        elif what == "k":
            weights = d.floats((num_tokens, top_k + 1), torch.float32)
        elif what == "dtype":
            expert_out = expert_out.to(torch.float64)
        else:
            weights = weights.to(torch.int32)
    return f"T={num_tokens} k={top_k} {dtype} H={hidden} {kwargs}", \
        (expert_out, perm, weights), kwargs


def case_local_send_plan(d: Draw):
    ep_size = d.choice([1, 2, 3, 4])
    num_experts = ep_size * d.choice([1, 2, 5])
    slots = d.choice([None, num_experts + ep_size])
    slot_count = num_experts if slots is None else slots
    top_k = d.rng.randint(1, min(slot_count, 8))
    num_tokens = d.choice([0, 1, 6, 40])
    max_tokens = d.choice([None, num_tokens, num_tokens + 7])
    ids = d.routing_ids(num_tokens, top_k, slot_count)
    kwargs = dict(max_tokens_per_rank=max_tokens, slot_count=slots, check_ids=d.chance(0.6))
    if d.chance(1 / 3):
        what = d.choice(["id", "id", "tokens", "slots", "dtype"])
        if what == "id" and ids.numel():
            ids = ids.clone()
            ids[d.rng.randrange(num_tokens), d.rng.randrange(top_k)] = d.choice(
                [-1, slot_count + 1, 2 ** 31 - 1])
        elif what == "tokens" and num_tokens:
            kwargs["max_tokens_per_rank"] = num_tokens - 1
        elif what == "slots":
            kwargs["slot_count"] = num_experts + 1 if ep_size > 1 else num_experts - 1
        elif what == "dtype":
            ids = ids.long()
    return f"T={num_tokens} k={top_k} E={num_experts} R={ep_size} {kwargs}", \
        (ids, num_experts, ep_size), kwargs


def _global_scale(d: Draw, x: torch.Tensor) -> torch.Tensor:
    kind = d.choice(["oracle", "oracle", "one", "random", "edge", "bad"])
    if kind == "oracle":
        return reference.nvfp4_global_scale(x)
    value = {"one": 1.0, "random": d.rng.uniform(0.01, 1e4),
             "edge": d.choice([GLOBAL_SCALE_MIN, GLOBAL_SCALE_MAX]),
             "bad": d.choice([0.0, -0.0, 1e-40, float("nan"), float("inf"), 3e38, -1.0,
                              GLOBAL_SCALE_MIN / 2])}[kind]
    return torch.full((1,), value, dtype=torch.float32, device=x.device)


def case_quantize_nvfp4(d: Draw):
    num_rows, hidden = d.choice([0, 1, 3, 17, 130]), d.choice([0, 16, 48, 112])
    x = d.floats((num_rows, hidden), d.choice(FLOATS))
    gs = _global_scale(d, x)
    layout = d.choice(SCALE_LAYOUTS)
    kwargs = dict(layout=layout, check_values=d.chance(0.6))
    out_rows = num_rows
    if d.chance(0.4):
        kwargs["rows"] = d.index(d.choice([0, 1, 5, 9]), num_rows, bad=d.chance(0.3))
        out_rows = kwargs["rows"].numel()
    scale_shape = swizzled_scale_shape(out_rows, hidden // 16, layout)
    if d.chance(0.3):
        kwargs["out"] = torch.full((out_rows, hidden // 2), 0xAB, dtype=torch.uint8,
                                   device=d.device)
    if d.chance(0.3):
        kwargs["out_scales"] = torch.full(scale_shape, 0xAB, dtype=torch.uint8, device=d.device)
    if d.chance(0.25):
        what = d.choice(["H", "x dtype", "gs shape", "gs dtype", "layout", "rows dtype",
                         "out dtype", "out shape", "out view", "scales dtype", "scales shape"])
        if what == "H":
            x = d.floats((num_rows, 24), torch.bfloat16)
        elif what == "x dtype":
            x = x.to(torch.float64)
        elif what == "gs shape":
            gs = torch.ones(2, device=d.device)
        elif what == "gs dtype":
            gs = gs.to(torch.float64)
        elif what == "layout":
            kwargs["layout"] = "32x4"
        elif what == "rows dtype":
            kwargs["rows"] = d.index(3, num_rows, bad=False).to(d.choice([torch.int64,
                                                                          torch.int16]))
        elif what == "out dtype":
            kwargs["out"] = torch.zeros((out_rows, hidden // 2), dtype=torch.int8,
                                        device=d.device)
        elif what == "out shape":
            kwargs["out"] = torch.zeros((out_rows + 7, hidden // 2), dtype=torch.uint8,
                                        device=d.device)
        elif what == "out view":
            kwargs["out"] = torch.zeros((hidden // 2, out_rows), dtype=torch.uint8,
                                        device=d.device).t()
        elif what == "scales dtype":
            kwargs["out_scales"] = torch.zeros(scale_shape, dtype=d.choice(
                [torch.float8_e4m3fn, torch.float32, torch.int8]), device=d.device)
        else:
            kwargs["out_scales"] = torch.zeros((scale_shape[0] * scale_shape[1],),
                                               dtype=torch.uint8, device=d.device)
    return f"x {x.dtype} {tuple(x.shape)} gs {gs.tolist()} {sorted(kwargs)}", (x, gs), kwargs


def case_global_scale(d: Draw):
    shape = (d.choice([0, 1, 3, 40]), d.choice([0, 1, 16, 33]))
    x = d.floats(shape, d.choice(FLOATS))
    if d.chance(0.2):
        x = x.to(torch.int32) if d.chance(0.5) else x.reshape(-1)
    return f"x {x.dtype} {tuple(x.shape)}", (x,), {}


def case_scale_and_quantize(d: Draw):
    shape = (d.choice([0, 1, 3, 40]), d.choice([0, 16, 33, 48]))
    x = d.floats(shape, d.choice(FLOATS))
    if d.chance(0.2):
        x = x.to(torch.int32) if d.chance(0.5) else x.reshape(-1)
    kwargs = dict(layout=d.choice(list(SCALE_LAYOUTS) + ["blocked"] * d.chance(0.1)),
                  check_values=d.chance(0.5))
    return f"x {x.dtype} {tuple(x.shape)} {kwargs}", (x,), kwargs


def case_quantize_mx(d: Draw):
    shape = (d.choice([0, 1, 3, 17, 130]), d.choice([0, 32, 96]))
    x = d.floats(shape, d.choice(FLOATS))
    if d.chance(0.2):
        x = d.floats((shape[0], 48), torch.float32) if d.chance(0.5) else x.to(torch.float64)
    return f"x {x.dtype} {tuple(x.shape)}", (x,), {}


def case_dequantize_nvfp4(d: Draw):
    num_rows, hidden = d.choice([0, 1, 3, 17, 130]), d.choice([0, 16, 48, 112])
    layout = d.choice(SCALE_LAYOUTS)
    padded = swizzled_scale_shape(num_rows, hidden // 16, layout)
    packed = d.bytes((num_rows, hidden // 2))
    scales = d.bytes(padded)
    if d.chance(0.2):
        scales = scales.reshape(-1)
    gs = _global_scale(d, packed.float())
    kwargs = dict(layout=layout, dtype=d.choice(FLOATS), check_values=d.chance(0.6))
    if d.chance(0.25):
        what = d.choice(["scales shape", "dtype", "packed dtype", "odd H"])
        if what == "scales shape":
            scales = d.bytes((padded[0] + 1, padded[1]))
        elif what == "dtype":
            kwargs["dtype"] = d.choice([torch.int32, torch.float64])
        elif what == "packed dtype":
            packed = packed.to(torch.int16)
        else:
            packed = d.bytes((num_rows, 12))
    return f"packed {tuple(packed.shape)} scales {tuple(scales.shape)} {kwargs}", \
        (packed, scales, gs), kwargs


def case_dequantize_mx(d: Draw, fp4: bool):
    num_rows, hidden = d.choice([0, 1, 3, 17]), d.choice([0, 32, 96])
    if fp4:
        codes = d.bytes((num_rows, hidden // 2))
    else:
        codes = d.bytes((num_rows, hidden), d.choice([torch.uint8, torch.float8_e4m3fn]))
    scales = d.bytes((num_rows, hidden // 32))
    kwargs = dict(dtype=d.choice(FLOATS))
    if d.chance(0.3):
        what = d.choice(["scales [M, 1]", "scales rows", "dtype", "codes dtype"])
        if what == "scales [M, 1]":
            scales = d.bytes((num_rows, 1))
        elif what == "scales rows":
            scales = d.bytes((num_rows + 1, hidden // 32))
        elif what == "dtype":
            kwargs["dtype"] = torch.int32
        else:
            codes = codes.view(torch.int8)
    return f"codes {codes.dtype} {tuple(codes.shape)} scales {tuple(scales.shape)} {kwargs}", \
        (codes, scales), kwargs


def case_swizzle(d: Draw):
    sf = d.bytes((d.choice([0, 1, 7, 130]), d.choice([0, 1, 3, 9])))
    layout = d.choice(list(SCALE_LAYOUTS) + ["32x4"] * (d.chance(0.1)))
    if d.chance(0.1):
        sf = sf.to(torch.int32)
    return f"sf {tuple(sf.shape)} {layout}", (sf, layout), {}


def case_unswizzle(d: Draw):
    num_rows, num_blocks = d.choice([0, 1, 7, 130]), d.choice([0, 1, 3, 9])
    layout = d.choice(SCALE_LAYOUTS)
    padded = swizzled_scale_shape(num_rows, num_blocks, layout)
    sf = d.bytes(padded)
    if d.chance(0.2):
        sf = sf.reshape(-1)
    if d.chance(0.25):
        what = d.choice(["shape", "rows", "layout"])
        if what == "shape":
            sf = d.bytes((padded[0], padded[1] + 4))
        elif what == "rows":
            num_rows = -1
        else:
            layout = "linear " if d.chance(0.5) else None
    return f"sf {tuple(sf.shape)} {layout} {num_rows}x{num_blocks}", \
        (sf, layout, num_rows, num_blocks), {}


def case_route_topk(d: Draw):
    method = d.choice(ROUTING_METHODS)
    num_experts = d.choice([8, 16, 60, 64])
    top_k = 1 if method == "llama4" else d.rng.randint(1, min(num_experts, 8))
    num_tokens = d.choice([0, 1, 5, 33])
    logits = d.floats((num_tokens, num_experts), d.choice(FLOATS), specials=False)
    if d.chance(0.5):
        logits = (logits.float() * 2).round().to(logits.dtype) / 2  # exact ties
    kwargs = {}
    if method == "deepseek_v3":
        groups = d.choice([1, 2, 4])
        kwargs = dict(bias=(torch.randn(num_experts, generator=d.gen) * 0.05).to(d.device),
                      num_groups=groups, topk_groups=d.rng.randint(1, groups),
                      routed_scaling=d.choice([1.0, 2.5]))
        if kwargs["topk_groups"] * num_experts // groups < top_k:
            kwargs["topk_groups"] = groups
    if d.chance(0.25):
        what = d.choice(["k", "method", "bias", "scaling"])
        if what == "k":
            top_k = num_experts + 1
        elif what == "method":
            method = "softmax"
        elif what == "bias":
            kwargs["bias"] = torch.zeros(num_experts + 1, device=d.device)
        else:
            kwargs["routed_scaling"] = float("nan")
    return f"{method} T={num_tokens} E={num_experts} k={top_k} {logits.dtype}", \
        (logits, top_k, method), kwargs


def _routing_close(a, b):
    torch.testing.assert_close(a, b, **FLOAT_TOLERANCES[torch.float32])


# op name -> (case maker, torch face, Triton face, compare floats with a tolerance)
OPS = {
    "permute_by_expert": (case_permute, reference.permute_by_expert,
                          triton_permute.permute_by_expert, None),
    "gather_rows": (case_gather, reference.gather_rows, triton_gather.gather_rows, None),
    "unpermute_and_reduce": (case_unpermute, reference.unpermute_and_reduce,
                             triton_gather.unpermute_and_reduce, None),
    "local_send_plan": (case_local_send_plan, reference.local_send_plan,
                        triton_prepare.local_send_plan, None),
    "quantize_nvfp4": (case_quantize_nvfp4, reference.quantize_nvfp4,
                       triton_quantize.quantize_nvfp4, None),
    "nvfp4_global_scale": (case_global_scale, reference.nvfp4_global_scale,
                           triton_quantize.nvfp4_global_scale, None),
    "scale_and_quantize_nvfp4": (case_scale_and_quantize, reference.scale_and_quantize_nvfp4,
                                 triton_quantize.scale_and_quantize_nvfp4, None),
    "quantize_mxfp8": (case_quantize_mx, reference.quantize_mxfp8,
                       triton_quantize.quantize_mxfp8, None),
    "quantize_mxfp4": (case_quantize_mx, reference.quantize_mxfp4,
                       triton_quantize.quantize_mxfp4, None),
    "dequantize_nvfp4": (case_dequantize_nvfp4, reference.dequantize_nvfp4,
                         triton_quantize.dequantize_nvfp4, None),
    "dequantize_mxfp8": (lambda d: case_dequantize_mx(d, fp4=False), reference.dequantize_mxfp8,
                         triton_quantize.dequantize_mxfp8, None),
    "dequantize_mxfp4": (lambda d: case_dequantize_mx(d, fp4=True), reference.dequantize_mxfp4,
                         triton_quantize.dequantize_mxfp4, None),
    "swizzle_scales": (case_swizzle, reference.swizzle_scales, triton_quantize.swizzle_scales,
                       None),
    "unswizzle_scales": (case_unswizzle, reference.unswizzle_scales,
                         triton_quantize.unswizzle_scales, None),
    "route_topk": (case_route_topk, reference.route_topk, triton_routing.route_topk,
                   _routing_close),
}


@pytest.mark.parametrize("op", list(OPS))
def test_faces_agree(device, op):
    make_case, torch_face, triton_face, close = OPS[op]
    for index in range(CASES):
        seed = SEED * 1_000_003 + list(OPS).index(op) * 10_007 + index
        case, args, kwargs = make_case(Draw(seed, device))
        assert_faces_agree(op, f"case {index} (seed {seed}): {case}", torch_face, triton_face,
                           args, kwargs, close)
