"""One contract per op: each case of the reliability issue, on every face that runs here.

Faces: the torch oracle (``kernels.reference``), the Triton launcher (``kernels.<op>``) and the
public stage functions (``a2a.quantize``, ``a2a.permute``) on both of those backends; on a
Blackwell GPU also the FlashInfer adapters. For every case all faces raise the same exception
type with the same message, or all return the same bits. What each case must give is the
behaviour documented in ``kernels.spec`` and the ops' docstrings.
"""

from __future__ import annotations

import functools

import pytest
import torch

from a2a import permute as stage_permute
from a2a import quantize as stage_quantize
from kernels import gather as triton_gather
from kernels import quantize as triton_quantize
from kernels import reference
from kernels.spec import GLOBAL_SCALE_MAX, GLOBAL_SCALE_MIN, SCALE_LAYOUTS, swizzled_scale_shape
from kernels.types import UNUSED


def _stage(fn, backend):
    return functools.partial(fn, backend=backend)


QUANTIZE_FACES = {
    "torch": reference.quantize_nvfp4, "triton": triton_quantize.quantize_nvfp4,
    "stage torch": _stage(stage_quantize.quantize_nvfp4, "torch"),
    "stage triton": _stage(stage_quantize.quantize_nvfp4, "triton"),
}
DEQUANTIZE_FACES = {"torch": reference.dequantize_nvfp4,
                    "triton": triton_quantize.dequantize_nvfp4}
GATHER_FACES = {"torch": reference.gather_rows, "triton": triton_gather.gather_rows,
                "stage torch": _stage(stage_permute.gather_rows, "torch"),
                "stage triton": _stage(stage_permute.gather_rows, "triton")}
UNPERMUTE_FACES = {"torch": reference.unpermute_and_reduce,
                   "triton": triton_gather.unpermute_and_reduce,
                   "stage torch": _stage(stage_permute.unpermute_and_reduce, "torch"),
                   "stage triton": _stage(stage_permute.unpermute_and_reduce, "triton")}


def outcome(fn, *args, **kwargs):
    """("raised", type, message) or ("returned", [(dtype, shape, bytes), ...])."""
    try:
        result = fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the error is the outcome compared
        return ("raised", type(error), str(error))
    parts = result if isinstance(result, tuple) else (result,)
    # a copy of the bytes: a face may return a caller's buffer that the next face rewrites
    return ("returned", [(t.dtype, tuple(t.shape),
                          t.contiguous().reshape(-1).view(torch.uint8).cpu().clone())
                         for t in parts])


def same_on_every_face(faces: dict, *args, **kwargs):
    """Call every face; assert one outcome; return it."""
    results = {name: outcome(fn, *args, **kwargs) for name, fn in faces.items()}
    first_name, first = next(iter(results.items()))
    for name, other in results.items():
        assert other[0] == first[0], f"{name}: {other[:3]} but {first_name}: {first[:3]}"
        if first[0] == "raised":
            assert other[1:] == first[1:], f"{name}: {other[1:]} vs {first_name}: {first[1:]}"
        else:
            assert len(other[1]) == len(first[1])
            for (dtype, shape, bits), (dtype0, shape0, bits0) in zip(other[1], first[1]):
                assert (dtype, shape) == (dtype0, shape0) and torch.equal(bits, bits0), name
    return first


def raises_on_every_face(faces, error, match, *args, **kwargs):
    result = same_on_every_face(faces, *args, **kwargs)
    assert result[0] == "raised" and result[1] is error, result
    assert match in result[2], result[2]
    return result[2]


def _x(num_rows=3, hidden=32, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, hidden, generator=gen) * 3).to(dtype).to(device)


# ---------------------------------------------------------------------------------------------
# The global scale
# ---------------------------------------------------------------------------------------------

BAD_SCALES = [0.0, -0.0, 1e-40, float("nan"), float("inf"), -float("inf"), 3e38, -1.0,
              GLOBAL_SCALE_MIN / 2, GLOBAL_SCALE_MAX * 2]


@pytest.mark.parametrize("value", BAD_SCALES)
def test_bad_global_scale_is_refused_everywhere(device, value):
    x = _x(device=device)
    gs = torch.full((1,), value, device=device)
    message = raises_on_every_face(QUANTIZE_FACES, ValueError, "global_scale holds", x, gs)
    assert "[2^-126, 2^126]" in message and "check_values=False" in message
    packed, scales = reference.quantize_nvfp4(x, torch.ones(1, device=device))
    raises_on_every_face(DEQUANTIZE_FACES, ValueError, "global_scale holds", packed, scales, gs)
    # check_values=False: nothing is read, and every face computes the same codes
    same_on_every_face(QUANTIZE_FACES, x, gs, layout="swizzled_128x4", check_values=False)
    same_on_every_face(DEQUANTIZE_FACES, packed, scales, gs, check_values=False)


def test_global_scale_edges_are_accepted(device):
    x = _x(device=device)
    for value in (GLOBAL_SCALE_MIN, GLOBAL_SCALE_MAX, 1.0):
        result = same_on_every_face(QUANTIZE_FACES, x, torch.full((1,), value, device=device))
        assert result[0] == "returned"


def test_global_scale_shape_and_dtype(device):
    x = _x(device=device)
    raises_on_every_face(QUANTIZE_FACES, ValueError, "global_scale must hold 1 element", x,
                         torch.ones(2, device=device))
    raises_on_every_face(QUANTIZE_FACES, TypeError, "global_scale must be float32", x,
                         torch.ones(1, dtype=torch.float64, device=device))


def test_nvfp4_global_scale_special_inputs(device):
    """All zeros (or no elements): 1.0; a NaN: the canonical NaN; an inf: 0 (refused later by
    quantize_nvfp4). The same bits on both faces."""
    faces = {"torch": reference.nvfp4_global_scale,
             "triton": triton_quantize.nvfp4_global_scale,
             "stage torch": _stage(stage_quantize.nvfp4_global_scale, "torch"),
             "stage triton": _stage(stage_quantize.nvfp4_global_scale, "triton")}
    for x, bits in ((torch.zeros(5, 32), 0x3F800000), (torch.zeros(0, 16), 0x3F800000),
                    (-torch.zeros(3, 16), 0x3F800000)):
        result = same_on_every_face(faces, x.to(device))
        assert result[1][0][2].view(torch.int32).item() == bits
    x = _x(device=device)
    x[1, 2] = -float("nan")
    result = same_on_every_face(faces, x)
    assert result[1][0][2].view(torch.int32).item() == 0x7FC00000
    x[1, 2] = float("inf")
    assert same_on_every_face(faces, x)[1][0][2].view(torch.float32).item() == 0.0


# ---------------------------------------------------------------------------------------------
# out= / out_scales=
# ---------------------------------------------------------------------------------------------

def test_out_buffers_must_match_exactly(device):
    x = _x(1, 32, device=device)
    gs = reference.nvfp4_global_scale(x)
    u8 = dict(dtype=torch.uint8, device=device)
    cases = [
        (dict(out_scales=torch.zeros(1, 2, dtype=torch.float8_e4m3fn, device=device)),
         TypeError, "out_scales must be uint8, got float8_e4m3fn"),
        (dict(out_scales=torch.zeros(1, 2, device=device)), TypeError, "out_scales must be"),
        (dict(out=torch.zeros(1, 16, dtype=torch.int8, device=device)), TypeError,
         "out must be uint8, got int8"),
        (dict(out=torch.zeros(8, 32, **u8)), ValueError,
         "out has shape (8, 32); this call writes (1, 16)"),
        (dict(out=torch.zeros(1, 32, **u8)[:, ::2]), ValueError, "out must be contiguous"),
        (dict(out_scales=torch.zeros(2, **u8)), ValueError,
         "out_scales has shape (2,); this call writes (1, 2)"),
        (dict(out_scales=torch.zeros(1, 2, **u8), layout="swizzled_128x4"), ValueError,
         "this call writes (128, 4)"),
    ]
    for kwargs, error, match in cases:
        raises_on_every_face(QUANTIZE_FACES, error, match, x, gs, **kwargs)


def test_out_buffers_are_written_and_returned(device):
    x = _x(5, 48, device=device)
    gs = reference.nvfp4_global_scale(x)
    for name, face in QUANTIZE_FACES.items():
        for layout in SCALE_LAYOUTS:
            out = torch.full((5, 24), 0xAB, dtype=torch.uint8, device=device)
            out_scales = torch.full(swizzled_scale_shape(5, 3, layout), 0xAB, dtype=torch.uint8,
                                    device=device)
            packed, scales = face(x, gs, layout=layout, out=out, out_scales=out_scales)
            assert packed is out and scales is out_scales, name
            want = reference.quantize_nvfp4(x, gs, layout=layout)
            assert torch.equal(out, want[0]) and torch.equal(out_scales, want[1]), name


# ---------------------------------------------------------------------------------------------
# rows= of quantize_nvfp4
# ---------------------------------------------------------------------------------------------

def test_quantize_rows_contract(device):
    """int32 only; UNUSED (-1) is a zero row; -2 or M is refused (check_values) or a zero row
    (check_values=False): on every face (once the torch face read -1 as the last row and
    raised IndexError for M)."""
    x = _x(6, 32, device=device)
    gs = reference.nvfp4_global_scale(x)
    zero = torch.zeros(1, 32, dtype=x.dtype, device=device)
    for dtype in (torch.int64, torch.int16):
        raises_on_every_face(QUANTIZE_FACES, TypeError, "rows must be int32",
                             x, gs, rows=torch.zeros(2, dtype=dtype, device=device))
    raises_on_every_face(QUANTIZE_FACES, ValueError, "rows must be 1-D", x, gs,
                         rows=torch.zeros(1, 2, dtype=torch.int32, device=device))
    rows = torch.tensor([5, UNUSED, 0], dtype=torch.int32, device=device)
    result = same_on_every_face(QUANTIZE_FACES, x, gs, rows=rows)
    want = reference.quantize_nvfp4(torch.cat((x[5:6], zero, x[0:1])), gs)
    assert torch.equal(result[1][0][2], want[0].cpu().reshape(-1))
    for bad in (-2, 6, 2**31 - 1):
        bad_rows = torch.tensor([0, bad, UNUSED], dtype=torch.int32, device=device)
        message = raises_on_every_face(QUANTIZE_FACES, ValueError, f"rows holds {bad}, outside "
                                       f"[0, M) = [0, 6) and not UNUSED (-1)", x, gs,
                                       rows=bad_rows)
        assert "check_values=False" in message
        result = same_on_every_face(QUANTIZE_FACES, x, gs, rows=bad_rows, check_values=False,
                                    layout="8x4")
        want = reference.quantize_nvfp4(torch.cat((x[0:1], zero, zero)), gs, layout="8x4")
        assert torch.equal(result[1][1][2], want[1].cpu().reshape(-1))


# ---------------------------------------------------------------------------------------------
# gather_rows and unpermute_and_reduce
# ---------------------------------------------------------------------------------------------

def _permutation(device, num_tokens=10, top_k=2, num_experts=4):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    return reference.permute_by_expert(ids.to(device), num_experts, align=4)


def test_gather_rows_contract(device):
    perm = _permutation(device)
    x = _x(10, 8, torch.float32, device)
    # a wrong top_k: refused with a tensor (rows past T*top_k), impossible with the Permutation
    raises_on_every_face(GATHER_FACES, ValueError, "rows past T*top_k mostly mean a top_k "
                         "smaller than the permutation's", x, perm.source_rows)
    same_on_every_face(GATHER_FACES, x, perm)
    raises_on_every_face(GATHER_FACES, ValueError, "top_k=3 but the permutation was built "
                         "with top_k=2", x, perm, top_k=3)
    raises_on_every_face(GATHER_FACES, TypeError, "rows must be int32, got int64", x,
                         perm.source_rows.long(), top_k=2)
    for bad in (-2, 20, 2**31 - 1):
        rows = torch.tensor([3, bad, UNUSED], dtype=torch.int32, device=device)
        raises_on_every_face(GATHER_FACES, ValueError, f"rows holds {bad}, outside "
                             f"[0, T*top_k) = [0, 20)", x, rows, top_k=2)
        result = same_on_every_face(GATHER_FACES, x, rows, top_k=2, check_values=False)
        out = result[1][0][2].view(torch.float32).reshape(3, 8)
        assert torch.equal(out[0], x[1].cpu()) and not out[1:].any()


def test_unpermute_contract(device):
    perm = _permutation(device)
    expert_out = _x(perm.source_rows.numel(), 16, torch.bfloat16, device)
    expert_out[::5, 3] = float("nan")
    weights = torch.rand(10, 2, device=device)
    result = same_on_every_face(UNPERMUTE_FACES, expert_out, perm, weights)
    nan_bits = result[1][0][2].view(torch.int16)
    assert set(nan_bits[torch.isnan(nan_bits.view(torch.bfloat16))].tolist()) == {0x7FC0}
    raises_on_every_face(UNPERMUTE_FACES, ValueError, "topk_weights has k=1 slots but the "
                         "permutation was built with top_k=2", expert_out, perm, weights[:, :1])
    same_on_every_face(UNPERMUTE_FACES, expert_out.t().contiguous().t(), perm, weights.t()
                       .contiguous().t())


# ---------------------------------------------------------------------------------------------
# Dequantizers and scale layouts
# ---------------------------------------------------------------------------------------------

def test_dequantize_refuses_wrong_scale_shapes(device):
    x = _x(4, 64, torch.float32, device)
    values, exponents = reference.quantize_mxfp8(x)
    mx8 = {"torch": reference.dequantize_mxfp8, "triton": triton_quantize.dequantize_mxfp8}
    mx4 = {"torch": reference.dequantize_mxfp4, "triton": triton_quantize.dequantize_mxfp4}
    # once the oracle took scales [M, 1] for [M, 64] values and scaled every block by one
    raises_on_every_face(mx8, ValueError, "scales has shape (4, 1); expected (4, 2)", values,
                         exponents[:, :1])
    packed, exponents4 = reference.quantize_mxfp4(x)
    raises_on_every_face(mx4, ValueError, "scales has shape (4, 1); expected (4, 2)", packed,
                         exponents4[:, :1])
    raises_on_every_face(mx8, TypeError, "dtype=torch.int32 must be one of", values, exponents,
                         dtype=torch.int32)
    packed, scales = reference.quantize_nvfp4(x, reference.nvfp4_global_scale(x),
                                              layout="swizzled_128x4")
    gs = reference.nvfp4_global_scale(x)
    raises_on_every_face(DEQUANTIZE_FACES, ValueError, "scales has shape (256, 2); layout="
                         "'swizzled_128x4' with 4 rows and 4 blocks needs [128, 4] (or flat "
                         "[512])", packed, scales.reshape(256, 2), gs, layout="swizzled_128x4")
    for good in (scales, scales.reshape(-1)):
        same_on_every_face(DEQUANTIZE_FACES, packed, good, gs, layout="swizzled_128x4",
                           dtype=torch.bfloat16)


def test_layouts_take_views(device):
    gen = torch.Generator().manual_seed(2)
    sf = torch.randint(0, 256, (9, 260), generator=gen, dtype=torch.uint8).to(device).t()
    for layout in SCALE_LAYOUTS:
        swizzled = same_on_every_face({"torch": reference.swizzle_scales,
                                       "triton": triton_quantize.swizzle_scales,
                                       "stage torch": _stage(stage_quantize.swizzle_scales,
                                                             "torch"),
                                       "stage triton": _stage(stage_quantize.swizzle_scales,
                                                              "triton")}, sf, layout)
        padded = swizzled_scale_shape(260, 9, layout)
        wide = torch.zeros(padded[0], 2 * padded[1], dtype=torch.uint8, device=device)
        wide[:, ::2] = swizzled[1][0][2].reshape(padded).to(device)
        same_on_every_face({"torch": reference.unswizzle_scales,
                            "triton": triton_quantize.unswizzle_scales}, wide[:, ::2], layout,
                           260, 9)


# ---------------------------------------------------------------------------------------------
# FlashInfer adapters (Blackwell; the swizzle adapter runs on SM90 too)
# ---------------------------------------------------------------------------------------------

@pytest.mark.sm100
def test_sm100_flashinfer_quantize_has_the_same_contract(seed):
    pytest.importorskip("flashinfer")
    faces = {"triton": _stage(stage_quantize.quantize_nvfp4, "triton"),
             "flashinfer": _stage(stage_quantize.quantize_nvfp4, "flashinfer")}
    x = _x(130, 64, device="cuda")
    gs = reference.nvfp4_global_scale(x)
    for value in BAD_SCALES:
        raises_on_every_face(faces, ValueError, "global_scale holds", x,
                             torch.full((1,), value, device="cuda"))
    raises_on_every_face(faces, TypeError, "out_scales must be uint8", x, gs,
                         out_scales=torch.zeros(130, 4, dtype=torch.float8_e4m3fn,
                                                device="cuda"))
    raises_on_every_face(faces, ValueError, "out has shape (8, 32)", x, gs,
                         out=torch.zeros(8, 32, dtype=torch.uint8, device="cuda"))
    rows = torch.tensor([129, UNUSED, 0, 7, 7], dtype=torch.int32, device="cuda")
    raises_on_every_face(faces, ValueError, "rows holds 130", x, gs,
                         rows=torch.tensor([130], dtype=torch.int32, device="cuda"))
    for layout in SCALE_LAYOUTS:
        out = torch.empty(5, 32, dtype=torch.uint8, device="cuda")
        same_on_every_face(faces, x.t().contiguous().t(), gs, layout=layout, rows=rows, out=out)
        same_on_every_face(faces, x[:, 16:48], gs, layout=layout)  # a column slice
    raises_on_every_face({"flashinfer": faces["flashinfer"]}, TypeError,
                         "FlashInfer's quantizers take bfloat16 or float16", x.float(), gs)
    mx = {"triton": _stage(stage_quantize.quantize_mxfp8, "triton"),
          "flashinfer": _stage(stage_quantize.quantize_mxfp8, "flashinfer")}
    same_on_every_face(mx, x.t().contiguous().t())


@pytest.mark.gpu
def test_gpu_flashinfer_swizzle_has_the_same_contract(seed):
    pytest.importorskip("flashinfer")
    faces = {"triton": _stage(stage_quantize.swizzle_scales, "triton"),
             "flashinfer": _stage(stage_quantize.swizzle_scales, "flashinfer")}
    sf = torch.randint(0, 256, (9, 300), dtype=torch.uint8, device="cuda").t()
    same_on_every_face(faces, sf, "swizzled_128x4")
    raises_on_every_face(faces, TypeError, "sf must be uint8", sf.int(), "swizzled_128x4")
    raises_on_every_face(faces, ValueError, "layout='32x4' is not one of", sf, "32x4")


@pytest.mark.gpu
def test_gpu_check_values_off_captures_and_on_names_the_way_out(seed):
    """check_values=False: the Triton quantize, gather and un-permute capture in a CUDA graph
    and replay to the eager result; check_values=True inside a capture raises, naming the
    keyword."""
    x = _x(130, 64, device="cuda")
    gs = reference.nvfp4_global_scale(x)
    perm = _permutation("cuda", num_tokens=130)
    rows = torch.tensor([129, UNUSED, 0, 7], dtype=torch.int32, device="cuda")
    expert_out = _x(perm.source_rows.numel(), 64, device="cuda")
    weights = torch.rand(130, 2, device="cuda")
    ops = {"quantize": lambda check: triton_quantize.quantize_nvfp4(
               x, gs, rows=rows, layout="swizzled_128x4", check_values=check),
           "gather": lambda check: (triton_gather.gather_rows(x, perm, check_values=check),),
           "unpermute": lambda check: (triton_gather.unpermute_and_reduce(
               expert_out, perm, weights, check_values=check),)}
    for name, op in ops.items():
        want = op(True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op(False)  # warm-up (compiles) off the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                got = op(False)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b), name
        with pytest.raises(RuntimeError, match="pass check_values=False inside the capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
                op(True)
