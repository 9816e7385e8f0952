"""kernels/hardware.py: what the launchers ask of the machine, here the programmatic dependent
launch (PDL) rule. On a GPU the kernels of the decode chain must be compiled and launched with
it; the chain's bits under it are checked against the oracle by the decode stage's replay tests
(tests/test_bench_decode.py), which capture it with PDL on."""

from __future__ import annotations

import pytest
import torch

from kernels import hardware
from tests.support import pdl_order

CPU = torch.device("cpu")


def test_pdl_is_off_for_cpu_tensors_and_traced_launches():
    assert not hardware.pdl_supported(CPU)
    for traced in (False, True):
        assert hardware.grid_dependency(CPU, traced) == {"PDL": False}


@pytest.mark.gpu
def test_pdl_follows_the_architecture_and_is_off_when_traced():
    device = torch.device("cuda", torch.cuda.current_device())
    hopper_or_later = torch.cuda.get_device_capability(device)[0] >= hardware.PDL_MIN_MAJOR
    assert hardware.pdl_supported(device) is hopper_or_later
    expected = {"PDL": True, "launch_pdl": True} if hopper_or_later else {"PDL": False}
    assert hardware.grid_dependency(device, False) == expected
    assert hardware.grid_dependency(device, True) == {"PDL": False}


@pytest.mark.gpu
def test_the_decode_chains_kernels_are_compiled_and_launched_with_pdl():
    """Every kernel a call of the decode chain launches on an SM90+ GPU (with the permutation
    and the gather fused or not) is a variant with the ``PDL`` constexpr on and Triton's
    ``launch_pdl`` option set, all but the un-permute let the next kernel launch at their
    start, and those the chain lets overlap the kernel before them load before they wait."""
    device = torch.device("cuda", torch.cuda.current_device())
    if not hardware.pdl_supported(device):
        pytest.skip("PDL needs SM90 or later; this GPU launches without it")
    from bench.decode import DEEPSEEK_R1, DecodeChain, decode_inputs, triton_steps
    from kernels import gather, permute, prepare, routing
    from kernels.quantize_details import nvfp4, scales
    kernels = (routing._route_topk_kernel, prepare._single_plan_kernel,
               scales.amax_partial_kernel, nvfp4.nvfp4_quantize_kernel,
               permute._permute_single_kernel, gather._gather_rows_kernel,
               gather._unpermute_and_reduce_kernel)
    early = (scales.amax_partial_kernel, nvfp4.nvfp4_quantize_kernel,
             permute._permute_single_kernel)
    for kernel in kernels:
        kernel.device_caches[device.index][0].clear()
    shape = dict(payload="nvfp4", ep_size=1, tokens=16, **DEEPSEEK_R1)
    inputs = decode_inputs(shape, device)
    # the chain as the bench runs it (the permutation and the gather as one op,
    # permute_and_gather) and with the two ops apart: between them every kernel above launches
    for fused in (True, False):
        DecodeChain(triton_steps(overlap_previous=True, fused=fused), inputs, shape)()
    torch.cuda.synchronize(device)
    for kernel in kernels:
        variants = list(kernel.device_caches[device.index][0].values())
        assert variants, f"{kernel.__name__} was not launched"
        for compiled in variants:
            assert compiled.metadata.launch_pdl, kernel.__name__
            assert "griddepcontrol.wait" in compiled.asm["ptx"], kernel.__name__
            launches_next, loads_first = pdl_order(compiled.asm["ptx"])
            # every kernel lets the next one launch at its start but the un-permute, which
            # lets it launch as it exits (kernels.hardware)
            assert launches_next == (kernel is not gather._unpermute_and_reduce_kernel), \
                kernel.__name__
            # the amax pass and the permutation (overlap_previous) and the quantize (after
            # the op's own amax pass) load before they wait; every other kernel waits first
            assert loads_first == (kernel in early), kernel.__name__
