"""Number formats and scale layouts for the quantize kernels, as ``@triton.jit`` helpers.

All rounding is done in software, so the kernels run on Hopper (SM90) and Blackwell alike, and
on CPU under ``TRITON_INTERPRET=1``:

- e2m1 (round to nearest even, satfinite): :func:`e2m1_magnitude_bits`. Each of the three e2m1
  ranges (steps 0.5, 1, 2) gets its candidate code rounded by one fp32 operation into
  [2^23, 2^24), where the ulp is 1; the code is the smallest candidate, capped at 7: three
  FMA-pipe operations and two integer minima per element (the Hopper integer pipe is half as
  wide as the FP32 one). Kernels are launched with ``enable_fp_fusion=False`` so that
  ``x * scale`` is rounded before those adds (an FMA would round once and break the ties).
- e4m3 (RNE, satfinite): integer rounding of the fp32 bits to 3 mantissa bits and the magic add
  for the subnormal range (:func:`e4m3_code`; :func:`e4m3_round` also returns the value, for the
  NVFP4 block scale).
- e8m0: rounding towards +inf on the exponent bits.
- divisions use ``tl.math.div_rn`` (Triton's ``/`` is approximate on the GPU).

The scale layouts' byte offsets (docs/design.md, "Scale layouts") are split as a row part plus a
block part, so that a program walking along a row computes the row part once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.spec.quant import (E4M3_MAX, FLT_MAX, INV_E2M1_MAX, INV_E4M3_MAX,
                                NVFP4_GLOBAL_NUMERATOR)

# The recipes' numbers as constexprs (a jit function reads only constexpr globals).
INV6 = tl.constexpr(INV_E2M1_MAX)
INV448 = tl.constexpr(INV_E4M3_MAX)
E4M3_MAX_C = tl.constexpr(E4M3_MAX)
FLT_MAX_C = tl.constexpr(FLT_MAX)
GLOBAL_NUMERATOR = tl.constexpr(NVFP4_GLOBAL_NUMERATOR)
E2M1_BITS_BASE = tl.constexpr(0x4B000000)  # the fp32 bits of 2^23
TWO_POW_M127 = tl.constexpr(2.0 ** -127)  # e8m0 code 0 / the inverse of code 254 (subnormal)


@triton.jit
def rcp_approx(x):
    """rcp.approx.ftz.f32, FlashInfer's fast reciprocal (GPU only)."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def e2m1_magnitude_bits(a):
    """e2m1 magnitude code of ``a`` = |y| (fp32 >= +0, inf or NaN; RNE, satfinite), as the
    bits of the fp32 2^23 + code (``E2M1_BITS_BASE + code``; ``e2m1_magnitude`` subtracts).

    The three e2m1 ranges have steps 0.5, 1 and 2, i.e. code 2a below 2, a + 2 in [2, 4] and
    a / 2 + 4 above. Each candidate is rounded by one fp32 operation whose result lies in
    [2^23, 2^24), where the ulp is 1: ``2a + 2^23``, ``a + (2^23 + 2)`` and
    ``a / 2 + (2^23 + 4)`` (the products by 2 and 1/2 are exact, so a separate multiply and
    add round the same as an FMA; the added integers are even, so ties still go to the even
    mantissa). The code is the smallest candidate, capped at 7: 2a <= a + 2 <= a / 2 + 4
    below 2, a + 2 is the smallest in [2, 4] and a / 2 + 4 above 4, and rounding keeps these
    orders. In [2^23, 2^24) the bits grow with the value, so the minimum is taken on the bits;
    inf and NaN bits are larger still (code 7). On a GPU: three FMA-pipe operations and two
    integer min instructions per element."""
    f0 = tl.fma(a, 2.0, 8388608.0).to(tl.int32, bitcast=True)
    f1 = (a + 8388610.0).to(tl.int32, bitcast=True)
    f2 = tl.fma(a, 0.5, 8388612.0).to(tl.int32, bitcast=True)
    return tl.minimum(tl.minimum(tl.minimum(f0, f1), f2), E2M1_BITS_BASE + 7)


@triton.jit
def e2m1_magnitude(a):
    """e2m1 magnitude code (int32 0..7) of ``a`` = |y| (``e2m1_magnitude_bits``)."""
    return e2m1_magnitude_bits(a) - E2M1_BITS_BASE


@triton.jit
def e2m1_code(y):
    """fp32 -> e2m1 code (int32 0..15): RNE, satfinite at 6, sign kept, NaN -> 7 without a
    sign (a GPU's NaN product has none; the interpreter keeps an operand's)."""
    sign = (y.to(tl.int32, bitcast=True) >> 28) & 0x8
    return e2m1_magnitude(tl.abs(y)) | tl.where(y == y, sign, 0)


@triton.jit
def e4m3_code(x):
    """fp32 -> float8_e4m3fn bits (int32 0..255): RNE, satfinite at 448, NaN -> 0x7F."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal (>= 2^-6): round the bits to 3 mantissa bits (ties to even), rebias 127 -> 7
    normal = tl.minimum(((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960, 126)
    # subnormal: a multiple of 2^-9; |x| * 512 rounded to an integer by the 2^23 magic add
    magnitude = a.to(tl.float32, bitcast=True)
    subnormal = (magnitude * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a < 0x3C800000, subnormal, normal) | sign  # 0x3C800000 = 2^-6
    return tl.where(a > 0x7F800000, 0x7F, code)


@triton.jit
def e4m3_round(x):
    """fp32 -> (float8_e4m3fn bits as int32, their fp32 value): ``e4m3_code`` and
    ``e4m3_value`` of it in one pass, for the per-block NVFP4 scale. Normal range: the bits
    rounded to 3 mantissa bits (ties to even), capped at 448's bits, give the value (mantissa
    cleared) and the code (rebias); subnormal range (< 2^-6): |x| + 2^14, whose ulp is the
    e4m3 step 2^-9, counts the code in its low bits and minus 2^14 is the value."""
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    rounded = tl.minimum(a + 0x7FFFF + ((a >> 20) & 1), 0x43E00000)  # 0x43E00000 = 448
    sum_small = tl.abs(x) + 16384.0
    small = a < 0x3C800000  # 2^-6
    code = tl.where(small, sum_small.to(tl.int32, bitcast=True) - 0x46800000,
                    (rounded >> 20) - 960)
    normal = (rounded & -1048576).to(tl.float32, bitcast=True)  # mantissa cleared
    value = tl.where(small, sum_small - 16384.0, normal).to(tl.int32, bitcast=True)
    value = (value | (bits & -2147483648)).to(tl.float32, bitcast=True)  # x's sign
    nan = a > 0x7F800000
    return (tl.where(nan, 0x7F, code | ((bits >> 24) & 0x80)),
            tl.where(nan, x, value))


@triton.jit
def with_sign(magnitude, sign_bit):
    """``magnitude`` (fp32, >= +0) negated where ``sign_bit`` (int) is nonzero, on the bits.
    ``-x`` turned -0 into +0 on an H200 with Triton 3.6 (seen; the interpreter kept -0)."""
    bits = magnitude.to(tl.uint32, bitcast=True) | tl.where(sign_bit != 0, 0x80000000, 0).to(
        tl.uint32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(code):
    """float8_e4m3fn bits (int32) -> fp32, exact (0x7F/0xFF -> NaN)."""
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # 2^-9
    value = with_sign(value, code & 0x80)
    nan = tl.full(code.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where((code & 0x7F) == 0x7F, nan, value)


@triton.jit
def e8m0_code(s):
    """Non-negative fp32 -> e8m0 code (int32): round towards +inf, 0 for s <= 2^-127,
    satfinite 254, NaN -> 255."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    code = exponent + (mantissa != 0).to(tl.int32)
    code = tl.where(exponent == 0, (mantissa > 0x400000).to(tl.int32), code)
    code = tl.minimum(code, 254)
    return tl.where(bits > 0x7F800000, 255, code)


@triton.jit
def e8m0_inverse(code):
    """2^(127 - code) as fp32 for an e8m0 code (254 -> 2^-127, 255 (NaN) -> 0)."""
    inverse = ((254 - code) << 23).to(tl.float32, bitcast=True)
    inverse = tl.where(code == 254, TWO_POW_M127, inverse)
    return tl.where(code >= 255, 0.0, inverse)


@triton.jit
def e8m0_value(code):
    """2^(code - 127) as fp32 for an e8m0 code (0 -> 2^-127 subnormal, 255 -> inf)."""
    return tl.where(code == 0, TWO_POW_M127, (code << 23).to(tl.float32, bitcast=True))


@triton.jit
def max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def scale_row_offsets(rows, padded_blocks, LAYOUT: tl.constexpr):
    """The row part (int64) of the byte offsets of scales in a layout with padded_blocks blocks
    per row (the formulas of kernels.reference.scale_offsets, split as row part + block
    part, so that a program walking along a row computes the row part once)."""
    rows = rows.to(tl.int64)
    if LAYOUT == 0:  # linear
        return rows * padded_blocks
    elif LAYOUT == 1:  # swizzled_128x4
        return ((rows // 128) * (padded_blocks // 4) * 512 + (rows % 32) * 16
                + ((rows % 128) // 32) * 4)
    else:  # 8x4
        return (rows // 8) * (padded_blocks // 4) * 32 + (rows % 8) * 4


@triton.jit
def scale_block_offsets(blocks, LAYOUT: tl.constexpr):
    """The block part (int32) of the scale byte offsets (see ``scale_row_offsets``)."""
    if LAYOUT == 0:
        return blocks
    elif LAYOUT == 1:
        return (blocks // 4) * 512 + blocks % 4
    else:
        return (blocks // 4) * 32 + blocks % 4


@triton.jit
def scale_offsets(rows, blocks, padded_blocks, LAYOUT: tl.constexpr):
    """Byte offsets (int64) of scales (rows[:, None], blocks[None, :]) in a layout with
    padded_blocks blocks per row."""
    return (scale_row_offsets(rows, padded_blocks, LAYOUT)[:, None]
            + scale_block_offsets(blocks, LAYOUT)[None, :])
