"""Triton NVFP4 / MXFP8 / MXFP4 kernels against the torch oracle, bit-exactly; the a2a stage
functions and FlashInfer adapters (GPU / Blackwell only)."""

import pytest
import torch
import triton

from a2a import quantize as A
from a2a.backends import BackendUnavailable
from kernels import quantize as Q
from kernels import reference as R
from kernels.quantize_details.formats import rcp_approx
from kernels.quantize_details.words import PAIR_VIEWS
from kernels.spec import INV_E2M1_MAX, INV_E4M3_MAX, SCALE_LAYOUTS, swizzled_scale_shape

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _hard_input(num_rows: int, hidden: int, dtype, device) -> torch.Tensor:
    """Random rows plus the cases that break roundings: a zero block, a tiny block whose e4m3
    scale underflows, a block with a huge outlier (saturation), exact e2m1 ties after scaling
    (amax 6 with gs = 1 gives scale 1), negative zeros."""
    x = torch.randn(num_rows, hidden) * 3
    if num_rows >= 4:
        x[0, :16] = 0.0
        x[1, :16] = 1e-4 * torch.randn(16)
        x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
        x[3, :16] = -0.0
        if hidden >= 32:
            x[3, 16:32] = torch.linspace(-7, 7, 16)
    return x.to(dtype).to(device)


def _assert_same(actual, expected):
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,hidden", [(0, 16), (1, 48), (7, 16), (129, 48), (300, 16)])
def test_nvfp4_matches_reference(device, seed, dtype, num_rows, hidden):
    x = _hard_input(num_rows, hidden, dtype, device)
    for global_scale in (R.nvfp4_global_scale(x), torch.ones(1, device=device)):
        for layout in SCALE_LAYOUTS:
            _assert_same(Q.quantize_nvfp4(x, global_scale, layout=layout),
                         R.quantize_nvfp4(x, global_scale, layout=layout))


@pytest.mark.parametrize("num_rows", [127, 128])
def test_nvfp4_rows_at_tile_edges(device, seed, num_rows):
    x = _hard_input(num_rows, 48, torch.bfloat16, device)
    gs = R.nvfp4_global_scale(x)
    for layout in SCALE_LAYOUTS:
        _assert_same(Q.quantize_nvfp4(x, gs, layout=layout),
                     R.quantize_nvfp4(x, gs, layout=layout))


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_scale_matches_reference(device, seed, dtype):
    for shape in [(7, 48), (300, 16), (0, 16)]:
        x = _hard_input(*shape, dtype, device)
        assert torch.equal(Q.nvfp4_global_scale(x), R.nvfp4_global_scale(x))
    assert Q.nvfp4_global_scale(torch.zeros(5, 32, device=device)).tolist() == [1.0]


@pytest.mark.parametrize("dtype,num_rows,hidden", [
    (torch.bfloat16, 0, 16), (torch.bfloat16, 1, 48), (torch.float16, 7, 16),
    (torch.float32, 7, 16), (torch.bfloat16, 40, 32)])
def test_scale_and_quantize_is_the_two_ops(device, seed, dtype, num_rows, hidden):
    """The fused op's three outputs are the bits of the global scale and the quantize with it,
    on every layout, on the kernel, the stage function (both backends) and the oracle. On the
    linear layout the amax pass's grid is also capped at 1 and at 5 programs (so that each
    quantize program reduces one or several partials, in one or several steps), and the
    three-launch form runs (``finishes_in_quantize`` False)."""
    x = _hard_input(num_rows, hidden, dtype, device)
    gs = R.nvfp4_global_scale(x)
    for layout in SCALE_LAYOUTS:
        expected = R.quantize_nvfp4(x, gs, layout=layout) + (gs,)
        _assert_same(R.scale_and_quantize_nvfp4(x, layout=layout), expected)
        _assert_same(Q.scale_and_quantize_nvfp4(x, layout=layout), expected)
        for backend in ("triton", "torch"):
            for overlap in (False, True):  # (a stream-order promise: the same bits)
                _assert_same(A.scale_and_quantize_nvfp4(x, layout=layout, backend=backend,
                                                        overlap_previous=overlap), expected)
    for backend in ("triton", "torch"):
        _assert_same((A.nvfp4_global_scale(x, overlap_previous=True, backend=backend),),
                     (gs,))
    expected = R.quantize_nvfp4(x, gs) + (gs,)
    for amax_launch in (Q.AmaxLaunch(num_sms=1, programs_per_sm=1, finish_block=2),
                        Q.AmaxLaunch(num_sms=5, programs_per_sm=1, finish_block=2)):
        _assert_same(Q.scale_and_quantize_nvfp4(x, amax_launch=amax_launch), expected)
    # the other form: the finish launch, then the quantize (a config tile of one row and one
    # step has no small-M bucket)
    row_tiles = Q.NVFP4Launch(tile_elements=16, steps=1)
    blocks = hidden // 16
    assert Q.finishes_in_quantize(num_rows, blocks, device, Q.DEFAULT_NVFP4)
    assert not Q.finishes_in_quantize(num_rows, blocks, device, row_tiles)
    _assert_same(Q.scale_and_quantize_nvfp4(x, launch=row_tiles), expected)


@pytest.mark.parametrize("num_rows", [32, 33])
def test_scale_and_quantize_rule_branch_point(device, seed, num_rows):
    """Both sides of ``finishes_in_quantize``: at H=64 the config's tile holds 32 rows, so on
    one SM (``num_sms=1``) 32 rows are one program (the small-M bucket: 2 launches) and 33 are
    two (the config's tile: 3 launches), on the linear layout (the swizzled ones pad the rows
    to 128: 3 launches); every form gives the two ops' bits."""
    x = _hard_input(num_rows, 64, torch.bfloat16, device)
    launch = Q.NVFP4Launch(num_sms=1)
    assert Q.finishes_in_quantize(num_rows, 4, device, launch) == (num_rows == 32)
    gs = R.nvfp4_global_scale(x)
    for layout in SCALE_LAYOUTS:
        _assert_same(Q.scale_and_quantize_nvfp4(x, layout=layout, launch=launch),
                     R.quantize_nvfp4(x, gs, layout=layout) + (gs,))


def test_scale_and_quantize_refuses_what_the_two_ops_refuse(device):
    """A NaN or an inf in x gives a scale quantize_nvfp4 refuses under check_values (the same
    ValueError on both faces, after the launches on Triton); with check_values=False both
    faces give the same bits. A bad layout or H is refused before anything runs."""
    x = _hard_input(6, 32, torch.bfloat16, device)
    for special in (float("nan"), float("inf")):
        bad = x.clone()
        bad[2, 5] = special
        for face in (R.scale_and_quantize_nvfp4, Q.scale_and_quantize_nvfp4):
            with pytest.raises(ValueError, match="global_scale holds"):
                face(bad)
        _assert_same(Q.scale_and_quantize_nvfp4(bad, check_values=False),
                     R.scale_and_quantize_nvfp4(bad, check_values=False))
    for face in (R.scale_and_quantize_nvfp4, Q.scale_and_quantize_nvfp4):
        with pytest.raises(ValueError, match="layout"):
            face(x, layout="blocked")
        with pytest.raises(ValueError, match="multiple of 16"):
            face(x[:, :24])
        with pytest.raises(TypeError):
            face(x.to(torch.int32))
    with pytest.raises(BackendUnavailable, match="global-scale"):
        A.scale_and_quantize_nvfp4(x, backend="flashinfer")


def test_rows_gather_out_buffers_and_padding(device, seed):
    x = _hard_input(40, 48, torch.bfloat16, device)
    gs = R.nvfp4_global_scale(x)
    rows = torch.tensor([39, 0, 3, 3, 17], dtype=torch.int64, device=device)
    for layout in SCALE_LAYOUTS:
        shape = swizzled_scale_shape(5, 3, layout)
        out = torch.full((5, 24), 0xAB, dtype=torch.uint8, device=device)  # poisoned
        out_scales = torch.full(shape, 0xAB, dtype=torch.uint8, device=device)
        packed, scales = Q.quantize_nvfp4(x, gs, layout=layout, out=out, out_scales=out_scales,
                                          rows=rows.to(torch.int32))
        assert packed.data_ptr() == out.data_ptr() and scales.data_ptr() == out_scales.data_ptr()
        # the reference on the gathered rows; its padding is zero, so ours must be too
        _assert_same((packed, scales), R.quantize_nvfp4(x[rows.cpu()], gs, layout=layout))


def test_non_contiguous_input(device, seed):
    x = _hard_input(16, 96, torch.float16, device)[:, ::2]
    gs = R.nvfp4_global_scale(x)
    _assert_same(Q.quantize_nvfp4(x, gs), R.quantize_nvfp4(x.contiguous(), gs))
    assert torch.equal(Q.nvfp4_global_scale(x), gs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(device, seed, dtype):
    """The kernels read x as words of two elements: views whose rows are runs of whole words
    are read in place, the others (odd row stride or offset, transposed) copied first."""
    big = _hard_input(12, 99, dtype, device)
    views = {"column offset 32": big[:, 32:96], "odd offset and row stride": big[:, 1:65],
             "transposed": _hard_input(32, 16, dtype, device).t(),
             "every other row": big[::2, :64], "one row": big[3:4, 33:97]}
    for name, x in views.items():
        gs = R.nvfp4_global_scale(x)
        assert torch.equal(Q.nvfp4_global_scale(x), gs), name
        for layout in SCALE_LAYOUTS:
            _assert_same(Q.quantize_nvfp4(x, gs, layout=layout),
                         R.quantize_nvfp4(x.contiguous(), gs, layout=layout))
        _assert_same(Q.quantize_mxfp8(x), R.quantize_mxfp8(x.contiguous()))
        _assert_same(Q.quantize_mxfp4(x), R.quantize_mxfp4(x.contiguous()))


def test_saturating_global_scale(device, seed):
    """A global scale far too large for the data: block scales saturate at 448 and the
    scaled elements reach far past 6 (codes saturate at 7)."""
    x = _hard_input(33, 64, torch.float32, device)
    for gs in (1e4, 1e30):
        gs = torch.full((1,), gs, device=device)
        for layout in SCALE_LAYOUTS:
            _assert_same(Q.quantize_nvfp4(x, gs, layout=layout),
                         R.quantize_nvfp4(x, gs, layout=layout))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_input_matches_reference(device, seed, dtype):
    """A NaN element makes its block's amax NaN (as torch.amax), and the global amax (the
    canonical NaN on both faces). A NaN block's codes are all 0x7, whatever the sign bits of
    its NaNs (a GPU's NaN products carry none; the interpreter's and a CPU's do)."""
    x = _hard_input(9, 64, dtype, device)
    x[5, 3] = float("nan")
    x[7, 40] = float("nan")
    x[8, 1], x[8, 18], x[8, 35] = float("inf"), -float("inf"), 1e4
    bits = x.view(torch.int32 if dtype == torch.float32 else torch.int16)
    bits[6, 20] = -1  # a negative NaN (all bits set), in block 1 of row 6
    gs = torch.full((1,), 3.0, device=device)
    assert torch.equal(Q.nvfp4_global_scale(x).view(torch.int32),
                       R.nvfp4_global_scale(x).view(torch.int32))
    assert Q.nvfp4_global_scale(x).view(torch.int32).item() == 0x7FC00000
    for layout in SCALE_LAYOUTS:
        _assert_same(Q.quantize_nvfp4(x, gs, layout=layout),
                     R.quantize_nvfp4(x, gs, layout=layout))
    packed = Q.quantize_nvfp4(x, gs)[0]
    assert (packed[6, 8:16] == 0x77).all() and (packed[5, :8] == 0x77).all()
    _assert_same(Q.quantize_mxfp8(x), R.quantize_mxfp8(x))
    _assert_same(Q.quantize_mxfp4(x), R.quantize_mxfp4(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [0, 7, 129])
def test_mx_match_reference(device, seed, dtype, num_rows):
    x = _hard_input(num_rows, 64, dtype, device)
    _assert_same(Q.quantize_mxfp8(x), R.quantize_mxfp8(x))
    _assert_same(Q.quantize_mxfp4(x), R.quantize_mxfp4(x))


def test_dequantize_and_swizzle_match_reference(device, seed):
    x = _hard_input(130, 64, torch.bfloat16, device)
    gs = R.nvfp4_global_scale(x)
    linear = R.quantize_nvfp4(x, gs)
    for layout in SCALE_LAYOUTS:
        packed, scales = R.quantize_nvfp4(x, gs, layout=layout)
        assert torch.equal(Q.dequantize_nvfp4(packed, scales, gs, layout=layout),
                           R.dequantize_nvfp4(packed, scales, gs, layout=layout))
        # bf16 / fp16 output: rounded on the bits to nearest even (kernels.casting.round_to),
        # so also Triton's interpreter (whose own cast rounds half up) matches bit for bit.
        for dtype in (torch.bfloat16, torch.float16):
            ours = Q.dequantize_nvfp4(packed, scales, gs, layout=layout, dtype=dtype)
            theirs = R.dequantize_nvfp4(packed, scales, gs, layout=layout, dtype=dtype)
            assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
        poisoned = Q.swizzle_scales(linear[1], layout)
        assert torch.equal(poisoned, scales)
        assert torch.equal(Q.unswizzle_scales(scales, layout, 130, 4), linear[1])
    assert torch.equal(Q.dequantize_mxfp8(*R.quantize_mxfp8(x)),
                       R.dequantize_mxfp8(*R.quantize_mxfp8(x)))
    assert torch.equal(Q.dequantize_mxfp4(*R.quantize_mxfp4(x)),
                       R.dequantize_mxfp4(*R.quantize_mxfp4(x)))


def test_errors(device):
    x = torch.zeros(4, 32, dtype=torch.bfloat16, device=device)
    gs = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="H=40"):
        Q.quantize_nvfp4(torch.zeros(4, 40, device=device), gs)
    with pytest.raises(TypeError, match="x must be"):
        Q.quantize_nvfp4(x.to(torch.int32), gs)
    with pytest.raises(ValueError, match="1 element"):
        Q.quantize_nvfp4(x, torch.ones(2, device=device))
    with pytest.raises(ValueError, match="out has shape"):
        Q.quantize_nvfp4(x, gs, out=torch.empty(4, 8, dtype=torch.uint8, device=device))
    with pytest.raises(TypeError, match="out_scales must be"):
        Q.quantize_nvfp4(x, gs, out_scales=torch.empty(4, 2, device=device))
    with pytest.raises(TypeError, match="rows must be"):
        Q.quantize_nvfp4(x, gs, rows=torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="H=48"):
        Q.quantize_mxfp4(torch.zeros(2, 48, device=device))
    if device.type == "cpu":
        with pytest.raises(NotImplementedError, match="rcp.approx"):
            Q.quantize_nvfp4(x, gs, fast_math=True)


def test_stage_function_dispatch(device, seed):
    x = _hard_input(9, 64, torch.bfloat16, device)
    gs = A.nvfp4_global_scale(x, backend="torch")
    for backend in ("triton", "torch", None):
        _assert_same(A.quantize_nvfp4(x, gs, layout="swizzled_128x4", backend=backend),
                     R.quantize_nvfp4(x, gs, layout="swizzled_128x4"))
        _assert_same(A.quantize_mxfp8(x, backend=backend), R.quantize_mxfp8(x))
        _assert_same(A.quantize_mxfp4(x, backend=backend), R.quantize_mxfp4(x))
    if device.type == "cpu":
        with pytest.raises(BackendUnavailable, match="SM100"):
            A.quantize_nvfp4(x, gs, backend="flashinfer")


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 129, 8192])
def test_gpu_large_bit_exact(seed, dtype, num_rows):
    x = _hard_input(num_rows, 7168, dtype, "cuda")
    gs = Q.nvfp4_global_scale(x)
    assert torch.equal(gs, R.nvfp4_global_scale(x))
    for layout in SCALE_LAYOUTS:
        _assert_same(Q.quantize_nvfp4(x, gs, layout=layout),
                     R.quantize_nvfp4(x, gs, layout=layout))
    _assert_same(Q.quantize_mxfp8(x), R.quantize_mxfp8(x))
    _assert_same(Q.quantize_mxfp4(x), R.quantize_mxfp4(x))


@pytest.mark.gpu
def test_gpu_software_e4m3_path(seed):
    software = Q.BlockLaunch(hardware_e4m3=False)
    x = _hard_input(300, 7168, torch.bfloat16, "cuda")
    gs = R.nvfp4_global_scale(x)
    _assert_same(Q.quantize_nvfp4(x, gs), R.quantize_nvfp4(x, gs))
    _assert_same(Q.quantize_mxfp8(x, launch=software), R.quantize_mxfp8(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_portable_nvfp4_path(seed, dtype):
    """NVFP4 of bf16/fp16 takes the word-level PTX path on a GPU; the portable path (the one
    the interpreter runs) must agree there too, NaN blocks included."""
    x = _hard_input(300, 7168, dtype, "cuda")
    x[7, 100], x[9, 5] = float("nan"), -float("inf")
    gs = torch.full((1,), 3.0, device="cuda")
    kind, stride = PAIR_VIEWS[dtype][0], x.shape[1] // 2
    portable = Q.NVFP4Launch(word_asm=False)
    assert Q.nvfp4_word_asm(x.device, kind, False, stride, Q.DEFAULT_NVFP4)
    assert not Q.nvfp4_word_asm(x.device, kind, False, 24, Q.DEFAULT_NVFP4)  # H = 48: unaligned
    assert not Q.nvfp4_word_asm(x.device, kind, False, stride, portable)
    for layout in SCALE_LAYOUTS:
        theirs = R.quantize_nvfp4(x, gs, layout=layout)
        _assert_same(Q.quantize_nvfp4(x, gs, layout=layout), theirs)
        _assert_same(Q.quantize_nvfp4(x, gs, layout=layout, launch=portable), theirs)


@pytest.mark.gpu
def test_gpu_deterministic(seed):
    x = _hard_input(4096, 7168, torch.bfloat16, "cuda")
    first = (Q.nvfp4_global_scale(x),) + Q.quantize_nvfp4(x, Q.nvfp4_global_scale(x),
                                                          layout="swizzled_128x4")
    for _ in range(3):
        again = (Q.nvfp4_global_scale(x),) + Q.quantize_nvfp4(x, Q.nvfp4_global_scale(x),
                                                              layout="swizzled_128x4")
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_gpu_fast_math_close_to_ieee(seed):
    """rcp.approx has <= 1 ulp error, so the fast recipe's scale input and out_scale differ
    from the IEEE ones by a few ulp: a scale code may differ only where its input lies within
    4 ulp of an e4m3 rounding boundary, and an element code only where x * out_scale lies
    within 4 ulp of an e2m1 boundary (recomputed here from the IEEE values)."""
    x = _hard_input(512, 7168, torch.bfloat16, "cuda")
    gs = R.nvfp4_global_scale(x)
    fast_packed, fast_sf = Q.quantize_nvfp4(x, gs, fast_math=True)
    again_packed, again_sf = Q.quantize_nvfp4(x, gs, fast_math=True)
    assert torch.equal(fast_packed, again_packed) and torch.equal(fast_sf, again_sf)
    ieee_packed, ieee_sf = Q.quantize_nvfp4(x, gs)
    amax = x.float().reshape(512, -1, 16).abs().amax(-1)
    sf_in = amax * (gs * torch.tensor(1 / 6, device="cuda"))
    near = (R.e4m3_code(sf_in * (1 + 2 ** -21)) != R.e4m3_code(sf_in * (1 - 2 ** -21)))
    assert torch.equal(fast_sf[~near], ieee_sf[~near])
    assert (fast_sf != ieee_sf).float().mean() < 1e-3
    same_sf = (fast_sf == ieee_sf).repeat_interleave(8, dim=1)
    diff = (fast_packed != ieee_packed) & same_sf
    assert diff.float().mean() < 1e-3


@pytest.mark.gpu
def test_gpu_rcp_approx_constants_equal_ieee():
    """Our MX reference uses f32(1/6) and f32(1/448) where FlashInfer uses rcp.approx.ftz;
    they must be equal for bit-exactness."""
    import triton
    import triton.language as tl

    @triton.jit
    def rcp_kernel(x_ptr, y_ptr):
        offsets = tl.arange(0, 2)
        tl.store(y_ptr + offsets, rcp_approx(tl.load(x_ptr + offsets)))

    x = torch.tensor([6.0, 448.0], device="cuda")
    y = torch.empty(2, device="cuda")
    rcp_kernel[(1,)](x, y)
    assert y.tolist() == [INV_E2M1_MAX, INV_E4M3_MAX]


@pytest.mark.gpu
def test_gpu_swizzle_matches_flashinfer(seed):
    pytest.importorskip("flashinfer")
    sf = torch.randint(0, 256, (300, 448), dtype=torch.uint8, device="cuda")
    ours = A.swizzle_scales(sf, "swizzled_128x4", backend="triton")
    theirs = A.swizzle_scales(sf, "swizzled_128x4", backend="flashinfer")
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, R.swizzle_scales(sf, "swizzled_128x4"))


@pytest.mark.gpu
def test_gpu_flashinfer_quantize_refused_below_sm100():
    major = torch.cuda.get_device_capability()[0]
    if major >= 10:
        pytest.skip("Blackwell runs FlashInfer's quantize; nothing to refuse")
    x = torch.zeros(4, 32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(BackendUnavailable, match="SM100"):
        A.quantize_nvfp4(x, torch.ones(1, device="cuda"), backend="flashinfer")
    with pytest.raises(BackendUnavailable, match="SM100"):
        A.quantize_mxfp8(x, backend="flashinfer")


@pytest.mark.sm100
@pytest.mark.parametrize("fast_math", [False, True])
@pytest.mark.parametrize("layout", SCALE_LAYOUTS)
def test_sm100_nvfp4_matches_flashinfer(seed, fast_math, layout):
    x = torch.randn(300, 7168, device="cuda").to(torch.bfloat16)
    gs = Q.nvfp4_global_scale(x)
    _assert_same(A.quantize_nvfp4(x, gs, layout=layout, fast_math=fast_math, backend="triton"),
                 A.quantize_nvfp4(x, gs, layout=layout, fast_math=fast_math,
                                  backend="flashinfer"))


@pytest.mark.sm100
def test_sm100_mx_match_flashinfer(seed):
    x = torch.randn(300, 7168, device="cuda").to(torch.bfloat16)
    _assert_same(A.quantize_mxfp8(x, backend="triton"), A.quantize_mxfp8(x, backend="flashinfer"))
    _assert_same(A.quantize_mxfp4(x, backend="triton"), A.quantize_mxfp4(x, backend="flashinfer"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 2048])
def test_dequantize_is_bit_exact_at_full_width(device, rows):
    # Bits, not values: code 8 (e2m1 -0) and 0x80 (e4m3 -0) decode to -0.0. A kernel that
    # negated with `-x` wrote +0.0 there on an H200 (equal as values, 3% of the bf16 bits
    # differed at H = 7168), which the bench's bit-exact layer check caught.
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 7168, generator=generator).to(torch.bfloat16).to(device)
    gs = R.nvfp4_global_scale(x)
    packed, scales = R.quantize_nvfp4(x, gs)
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        assert torch.equal(Q.dequantize_nvfp4(packed, scales, gs, dtype=dtype).view(bits),
                           R.dequantize_nvfp4(packed, scales, gs, dtype=dtype).view(bits))
    for quantize, dequantize in (("quantize_mxfp8", "dequantize_mxfp8"),
                                 ("quantize_mxfp4", "dequantize_mxfp4")):
        values, exponents = getattr(R, quantize)(x)
        assert torch.equal(getattr(Q, dequantize)(values, exponents).view(torch.int32),
                           getattr(R, dequantize)(values, exponents).view(torch.int32))


def test_dequantize_keeps_negative_zero(device):
    # e2m1 code 8 is -0 (the high nibble here), e4m3 scale 0x38 is 1.0: every path writes -0.0.
    packed = torch.full((1, 8), 0x80, dtype=torch.uint8, device=device)
    scales = torch.full((1, 1), 0x38, dtype=torch.uint8, device=device)
    gs = torch.ones(1, device=device)
    out = Q.dequantize_nvfp4(packed, scales, gs)
    assert torch.equal(out.view(torch.int32), R.dequantize_nvfp4(packed, scales, gs)
                       .view(torch.int32))
    assert bool(torch.signbit(out[0, 1::2]).all()) and not bool(torch.signbit(out[0, ::2]).any())


@pytest.mark.parametrize("max_blocks,steps,prefetch",
                         [(1, 2, 1), (2, 3, 2), (1, 8, 2), (1, 1, 2), (2, 3, 1), (1, 8, 3),
                          (2, 3, 3), (1, 4, 3)])
def test_nvfp4_programs_walk_several_tiles(device, seed, max_blocks, steps, prefetch):
    """A program quantizes several column tiles in turn, loading 1, 2 or 3 tiles ahead; an
    uneven split leaves masked steps past the last block. Tiny tiles, and no minimum grid size
    (0 stand-in SMs: the launch rule keeps all the steps), make that happen here."""
    launch = Q.NVFP4Launch(max_blocks=max_blocks, steps=steps, prefetch=prefetch, num_sms=0)
    col_tiles = triton.cdiv(7, max_blocks)
    assert Q.nvfp4_tile_shape(1, 7, device, launch)[3] == triton.cdiv(
        col_tiles, triton.cdiv(col_tiles, min(steps, col_tiles)))
    x = _hard_input(37, 112, torch.bfloat16, device)  # 7 blocks per row
    gs = R.nvfp4_global_scale(x)
    rows = torch.tensor([36, 0, 5, 5, 17, 30, 2, 9, 11], dtype=torch.int32, device=device)
    for layout in SCALE_LAYOUTS:
        _assert_same(Q.quantize_nvfp4(x, gs, layout=layout, launch=launch),
                     R.quantize_nvfp4(x, gs, layout=layout))
        _assert_same(Q.quantize_nvfp4(x, gs, layout=layout, rows=rows, launch=launch),
                     R.quantize_nvfp4(x[rows.long()], gs, layout=layout))


def test_steps_rule():
    """Tiles per program, in two buckets of M (a traced M compiles once per bucket): the
    config's rows and up to ``steps`` column tiles, spread evenly, where that grid has 2
    programs per SM (4 stand-in SMs on CPU: 8 programs); else one row and one tile."""
    cpu = torch.device("cpu")
    rule = Q.DEFAULT_NVFP4
    tile_rows = rule.tile_elements // (rule.max_blocks * 16)
    # 7 column tiles of 64 blocks: 8 steps would be 7 (one program per row of tiles)
    assert Q.nvfp4_tile_shape(2048, 7 * 64, cpu, rule) == (tile_rows, 64, rule.num_warps, 7)
    # 7 tiles in at most 8 steps over 64 rows: 32 programs of 2 rows and 7 tiles
    assert Q.nvfp4_tile_shape(64, 7 * 64, cpu, rule)[3] == 7
    # 2 rows: one program per row and tile (14 programs), not 2 x 7 tiles (1 program)
    assert Q.nvfp4_tile_shape(2, 7 * 64, cpu, rule)[::3] == (1, 1)
    assert Q.nvfp4_tile_shape(100, 64, cpu, rule)[3] == 1  # one tile: one step
    assert Q.nvfp4_tile_shape(1, 0, cpu, rule)[3] == 1
    # uneven: 10 tiles in at most 8 steps are 2 programs of 5, not 8 + 2
    assert Q.nvfp4_tile_shape(2048, 10 * 64, cpu, rule)[3] == 5


def test_launch_rule_shrinks_tiles_for_small_m():
    """Large M: the configured NVFP4 tile. Small M: fewer rows per program until the grid has
    2 programs per SM, with warps shrunk alike (a thread per scale block at most)."""
    cpu = torch.device("cpu")  # 4 stand-in SMs here (kernels.hardware): at least 8 programs
    nvfp4, mx = Q.DEFAULT_NVFP4, Q.DEFAULT_BLOCK
    rows, blocks, warps = Q.tile_shape(8192, 448, 16, cpu, nvfp4)
    assert (rows * blocks * 16, blocks, warps) == (nvfp4.tile_elements, nvfp4.max_blocks,
                                                   nvfp4.num_warps)
    rows, blocks, warps = Q.tile_shape(2, 8, 16, cpu, nvfp4)  # 2 rows of 8 blocks
    assert (rows, blocks, warps) == (1, 8, 1)
    rows, blocks, warps = Q.tile_shape(16, 448, 16, cpu, nvfp4)
    assert 16 // rows * -(-448 // blocks) >= 8 and warps == max(1, rows * blocks // 32)
    rows, blocks, warps = Q.tile_shape(8192, 224, 32, cpu, mx)  # MX: the block tile
    assert (rows * blocks * 32, warps) == (mx.tile_elements, mx.num_warps)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stage_dequantizers_and_unswizzle(device, seed, backend):
    """a2a.quantize exposes the dequantizers and the unswizzle with the oracle's bits; the
    switch refuses FlashInfer for them with its reason."""
    x = _hard_input(9, 64, torch.bfloat16, device)
    gs = R.nvfp4_global_scale(x)
    packed, scales = R.quantize_nvfp4(x, gs, layout="swizzled_128x4")
    got = A.dequantize_nvfp4(packed, scales, gs, layout="swizzled_128x4", backend=backend)
    _assert_same((got,), (R.dequantize_nvfp4(packed, scales, gs, layout="swizzled_128x4"),))
    linear = A.unswizzle_scales(scales, "swizzled_128x4", 9, 4, backend=backend)
    _assert_same((linear,), (R.unswizzle_scales(scales, "swizzled_128x4", 9, 4),))
    values, mx_scales = R.quantize_mxfp8(x)
    _assert_same((A.dequantize_mxfp8(values, mx_scales, backend=backend),),
                 (R.dequantize_mxfp8(values, mx_scales),))
    codes, mx_scales = R.quantize_mxfp4(x)
    _assert_same((A.dequantize_mxfp4(codes, mx_scales, dtype=torch.bfloat16, backend=backend),),
                 (R.dequantize_mxfp4(codes, mx_scales, dtype=torch.bfloat16),))
    with pytest.raises(BackendUnavailable, match="no standalone dequantizer"):
        A.dequantize_mxfp4(codes, mx_scales, backend="flashinfer")
