"""Golden tests of the NVFP4 / MXFP8 / MXFP4 oracle in kernels/reference.py, worked by hand."""

import pytest
import torch

from kernels import reference as R
from kernels.spec import E2M1_VALUES, SCALE_LAYOUTS


def _e2m1(values):
    return R.e2m1_code(torch.tensor(values, dtype=torch.float32)).tolist()


def test_e2m1_ties_round_to_even():
    # value -> nearest e2m1 magnitude, ties to the even code (codes 0..7 = 0,.5,1,1.5,2,3,4,6)
    assert _e2m1([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) == [0, 2, 2, 4, 4, 6, 6]
    assert _e2m1([0.26, 0.74, 1.26, 2.49, 2.51, 4.99, 5.01]) == [1, 1, 3, 4, 5, 6, 7]
    assert _e2m1([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]) == list(range(8))


def test_e2m1_grid_is_the_table():
    # the oracle builds the e2m1 magnitudes on the device from the codes (no host copy)
    assert R.e2m1_value(torch.arange(16, dtype=torch.uint8)).tolist() == (
        list(E2M1_VALUES) + [-v for v in E2M1_VALUES])


@pytest.mark.gpu
def test_oracle_quantizers_capture_in_a_cuda_graph(seed):
    """The oracle copies nothing from the host, so the bench can graph-time it (and its
    torch.compile form) with check_values=False: a captured call replays to the eager
    result, rows= and out= included."""
    x = (torch.randn(300, 256, device="cuda") * 3).to(torch.bfloat16)
    rows = torch.tensor([299, -1, 0, 7, 400], dtype=torch.int32, device="cuda")
    out = torch.empty(5, 128, dtype=torch.uint8, device="cuda")
    ops = {"global_scale": lambda: (R.nvfp4_global_scale(x),),
           "nvfp4": lambda: R.quantize_nvfp4(x, R.nvfp4_global_scale(x),
                                             layout="swizzled_128x4", check_values=False),
           "nvfp4 rows": lambda: R.quantize_nvfp4(x, R.nvfp4_global_scale(x), rows=rows,
                                                  out=out, check_values=False),
           "mxfp8": lambda: R.quantize_mxfp8(x), "mxfp4": lambda: R.quantize_mxfp4(x)}
    for name, op in ops.items():
        want = op()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op()  # warm-up off the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                got = op()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b), name


def test_e2m1_saturates_and_keeps_sign():
    assert _e2m1([6.0, 6.5, 100.0, float("inf")]) == [7, 7, 7, 7]
    assert _e2m1([-6.5, -float("inf"), -0.75, -0.0, -0.1]) == [15, 15, 10, 8, 8]


def test_e4m3_matches_torch_cast_when_clamped():
    # torch's float8_e4m3fn cast rounds to nearest even but overflows to NaN, so clamp first.
    bits = torch.arange(0, 0x7F800000, 2053, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x, -x])
    expected = torch.clamp(x, -448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(R.e4m3_code(x), expected)


def test_e4m3_golden():
    x = torch.tensor([448.0, 464.0, 1e30, float("inf"), 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10,
                      2.0 ** -6, 1.0, 1.0625, 1.1875, float("nan")])
    # 464 ties between 448 and (non-finite) 480: satfinite gives 448 = 0x7E; 2^-10 ties to 0;
    # 3*2^-10 ties between 1 and 2 (x 2^-9) -> 2; 1.0625 ties between 1 and 1.125 -> 1.0 (0x38);
    # 1.1875 ties between 1.125 and 1.25 -> 1.25 (0x3A)
    assert R.e4m3_code(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 1, 0, 2, 8, 0x38, 0x38, 0x3A,
                                       0x7F]


def test_e8m0_rounds_up():
    x = torch.tensor([0.0, 1.0, 1.0000001, 0.75, 2.0 ** -127, 1.5 * 2.0 ** -127, 3e38,
                      float("inf")])
    assert R.e8m0_code(x).tolist() == [0, 127, 128, 127, 0, 1, 254, 254]


def _block(values, repeat=1):
    return torch.tensor(values * repeat, dtype=torch.float32).reshape(1, -1)


def test_nvfp4_block_by_hand():
    # gs = 1: amax 6 -> sf = e4m3(6 * f32(1/6)) = 1.0 (0x38); out_scale = 1; codes as e2m1.
    x = _block([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, -0.75, -6.0, 0, 0, 0, 0, 0])
    packed, sf = R.quantize_nvfp4(x, torch.ones(1))
    assert sf.tolist() == [[0x38]]
    # element 2i is the low nibble: (0.25 -> 0, 0.75 -> 2) -> 0x20, ...
    assert packed.tolist() == [[0x20, 0x42, 0x64, 0x76, 0xA8, 0x0F, 0x00, 0x00]]


def test_nvfp4_zero_block_and_underflow():
    x = torch.zeros(1, 32)
    x[0, 16:] = 1e-6  # amax * gs / 6 = 1.7e-7 < 2^-10: the e4m3 scale underflows to 0
    packed, sf = R.quantize_nvfp4(x, torch.ones(1))
    assert sf.tolist() == [[0, 0]]
    # zero block: out_scale 0, codes 0; underflowed block: out_scale = FLT_MAX, 1e-6 * FLT_MAX
    # saturates to 6 (code 7): FlashInfer's IEEE recipe does the same.
    assert packed[0, :8].tolist() == [0] * 8
    assert packed[0, 8:].tolist() == [0x77] * 8


def test_nvfp4_global_scale_and_zero_input():
    x = torch.tensor([[1.0, -2.0] * 8])
    assert R.nvfp4_global_scale(x).tolist() == [1344.0]
    assert R.nvfp4_global_scale(torch.zeros(3, 16)).tolist() == [1.0]
    packed, sf = R.quantize_nvfp4(-torch.zeros(2, 16), R.nvfp4_global_scale(torch.zeros(2, 16)))
    assert sf.abs().sum() == 0 and packed.tolist() == [[0x88] * 8] * 2  # -0.0 keeps its sign


def test_scale_layout_128x4_on_130x8():
    sf = torch.arange(130 * 8, dtype=torch.int64).reshape(130, 8)
    swz = R.swizzle_scales((sf % 251 + 1).to(torch.uint8), "swizzled_128x4")
    assert swz.shape == (256, 8)
    flat = swz.reshape(-1)
    # (m, kb) = (0, 0) -> 0; (1, 0) -> 16; (32, 0) -> 4; (0, 5) -> 512 + 1; (129, 7) ->
    # 1 * (8/4) * 512 + 1 * 512 + 1 * 16 + 0 * 4 + 3 = 1555
    for (m, kb), offset in {(0, 0): 0, (1, 0): 16, (32, 0): 4, (0, 5): 513,
                            (129, 7): 1555, (127, 3): 31 * 16 + 3 * 4 + 3}.items():
        assert flat[offset] == sf[m, kb] % 251 + 1
    assert int((flat != 0).sum()) == 130 * 8  # padding (rows 130..255) is zero
    assert torch.equal(R.unswizzle_scales(swz, "swizzled_128x4", 130, 8),
                       (sf % 251 + 1).to(torch.uint8))


def test_scale_layout_8x4():
    sf = (torch.arange(9 * 6) % 250 + 1).to(torch.uint8).reshape(9, 6)
    swz = R.swizzle_scales(sf, "8x4")
    assert swz.shape == (16, 8)
    flat = swz.reshape(-1)
    # (m, kb) -> (m//8)*(8/4)*32 + (kb//4)*32 + (m%8)*4 + kb%4
    for (m, kb), offset in {(0, 0): 0, (1, 0): 4, (0, 5): 33, (8, 0): 64, (8, 5): 97,
                            (7, 3): 31}.items():
        assert flat[offset] == sf[m, kb]
    assert int((flat != 0).sum()) == 9 * 6


def test_mx_scales_by_hand():
    # MXFP8: amax 448 -> 448 * f32(1/448) rounds to exactly 1 -> code 127; amax 449 -> 128
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 32] = 448.0, 449.0
    values, sf = R.quantize_mxfp8(x)
    assert sf.tolist() == [[127, 128]]
    # 224.5 -> 224
    assert values.view(torch.uint8)[0, 0] == 0x7E and values.view(torch.uint8)[0, 32] == 0x76
    # MXFP4: amax 6 -> code 127 (scale 1); amax 6.5 -> code 128 (scale 1/2): 6.5/2 = 3.25 -> 3
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 32] = 6.0, 6.5
    packed, sf = R.quantize_mxfp4(x)
    assert sf.tolist() == [[127, 128]]
    assert packed[0, 0] == 0x07 and packed[0, 16] == 0x05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error_bounds(dtype, seed):
    x = (torch.randn(33, 64) * torch.logspace(-1, 1, 33)[:, None]).to(dtype)
    xf = x.float()
    gs = R.nvfp4_global_scale(x)
    for layout in SCALE_LAYOUTS:
        back = R.dequantize_nvfp4(*R.quantize_nvfp4(x, gs, layout=layout), gs, layout=layout)
        amax = xf.reshape(33, -1, 16).abs().amax(-1, keepdim=True)
        # half the top e2m1 step (1 of the 6 units of sf ~ amax/6), sf rounded by <= 1/16;
        # rows within 2 decades of amax(x), so no block scale underflows
        bound = (amax / 6 * (17 / 16) * 1.001).expand(-1, -1, 16).reshape(33, 64)
        assert ((back - xf).abs() <= bound + 1e-30).all()
    back8 = R.dequantize_mxfp8(*R.quantize_mxfp8(x))
    assert ((back8 - xf).abs() <= xf.abs() * 2.0 ** -4 + 2.0 ** -120).all()
    back4 = R.dequantize_mxfp4(*R.quantize_mxfp4(x))
    amax32 = xf.reshape(33, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32)
    assert ((back4 - xf).abs() <= amax32.reshape(33, 64) * 0.25).all()


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="H=24"):
        R.quantize_nvfp4(torch.zeros(2, 24), torch.ones(1))
    with pytest.raises(TypeError, match="x must be"):
        R.quantize_nvfp4(torch.zeros(2, 16, dtype=torch.int32), torch.ones(1))
    with pytest.raises(ValueError, match="1 element"):
        R.quantize_nvfp4(torch.zeros(2, 16), torch.ones(2))
    with pytest.raises(TypeError, match="global_scale"):
        R.quantize_nvfp4(torch.zeros(2, 16), torch.ones(1, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="rcp.approx"):
        R.quantize_nvfp4(torch.zeros(2, 16), torch.ones(1), fast_math=True)
    with pytest.raises(ValueError, match="layout"):
        R.quantize_nvfp4(torch.zeros(2, 16), torch.ones(1), layout="32x4")
    with pytest.raises(ValueError, match="H=48"):
        R.quantize_mxfp8(torch.zeros(2, 48))
