"""NVFP4 / MXFP8 / MXFP4 quantization in Triton, bit-exact to ``kernels.reference``.

Same names and arguments as the reference section "NVFP4 / MXFP8 / MXFP4 quantization" (read
its header for the recipes and what FlashInfer does). All rounding is done in software in the
shared helpers below (``_e2m1_code``, ``_e4m3_code``, ``_e8m0_code``), so the kernels run on
Hopper (SM90) and Blackwell alike, and on CPU under ``TRITON_INTERPRET=1``:

- e2m1 (round to nearest even, satfinite): ``_e2m1_magnitude_bits``. Each of the three e2m1
  ranges (steps 0.5, 1, 2) gets its candidate code rounded by one fp32 operation into
  [2^23, 2^24), where the ulp is 1; the code is the smallest candidate, capped at 7. Three
  FMA-pipe operations and two integer minima per element (the Hopper integer pipe is half as
  wide as the FP32 one and was the NVFP4 kernel's bottleneck). Kernels are launched with
  ``enable_fp_fusion=False`` so that ``x * scale`` is rounded before those adds (an FMA would
  round once and break the tie rules).
- e4m3 (RNE, satfinite): integer rounding of the fp32 bits to 3 mantissa bits, the magic add
  for the subnormal range (``_e4m3_code``; ``_e4m3_round`` also returns the value, for the
  NVFP4 block scale). For MXFP8 elements on a GPU ``_HARDWARE_E4M3`` uses
  ``cvt.rn.satfinite.e4m3x2.f32`` (SM89+, the same RNE-satfinite) through inline PTX, one
  instruction per element pair. Not Triton's fp32 -> fp8e4nv cast: on H200 (Triton 3.6) it
  gave wrong codes on the block-reduced scale tensor (whole rows of scales 0x00,
  sign-flipped element codes) and, on the pair tensors of the word-reading kernel, wrong
  MXFP8 bytes. NVFP4 scales always take the software path.
- divisions use ``tl.math.div_rn`` (Triton's ``/`` is approximate on the GPU).

x is read as words of two elements (int32 for bf16/fp16, int64 for fp32; ``_as_pairs``): a
word's two elements become two fp32 values by bit operations, and their two codes one packed
byte (FP4) or one uint16 (MXFP8) at the word's index, so no tensor is split or reshaped. On a
GPU, NVFP4 of bf16/fp16 (IEEE recipe) goes further (``_WORD_ASM``): the block amax is taken on
the packed pairs (``max.NaN.xorsign.abs.bf16x2``), and inline PTX turns 4 words into 4 packed
bytes, signs included (``_e2m1_words``); the portable path computes the same in Triton.

Launch rule (fixed, no autotune; ``python -m bench.tune`` times the alternatives): a program
quantizes a tile of ``BLOCK_ROWS`` rows by ``BLOCKS`` scale blocks, about NVFP4_TILE_ELEMENTS
(NVFP4) or TILE_ELEMENTS (MX, dequantize) elements with up to NVFP4_NUM_WARPS / NUM_WARPS warps
(one scale block per thread at most), smaller for small M (``_tile``); an NVFP4 program then
walks up to NVFP4_STEPS tiles along its rows, loading NVFP4_PREFETCH tiles ahead (``_steps``).
The grid covers rows x blocks, padded to the swizzled tile so that the same programs write the
zero padding of the scales. The packed values are stored with L2 eviction priority
NVFP4_STORE_POLICY ("evict_last"), a hint to keep them in L2 for the op that reads them next (a
transport send, a GEMM). Measured on H200 (``bench.tune``, which times this kernel and
``bench.floor`` both ways): faster when other memory traffic runs between calls (the bench's
L2-flushed timing), the same back to back.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.reference import (E2M1_MAX, E4M3_MAX, FLT_MAX, MX_BLOCK, NVFP4_BLOCK,
                               NVFP4_GLOBAL_NUMERATOR, QUANT_INPUT_DTYPES, SCALE_LAYOUTS,
                               _check_global_scale, _check_layout, _check_quant_input,
                               swizzled_scale_shape)
from kernels.validate import check_tensor

# fp32 constants of the recipes (exact fp32 values of 1/6 and 1/448, rounded to nearest).
INV_E2M1_MAX = float(torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32))
INV_E4M3_MAX = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))
LAYOUT_IDS = {name: i for i, name in enumerate(SCALE_LAYOUTS)}  # constexpr LAYOUT
# Launch rules, from ``python -m bench.tune`` on an H200 ([8192, 7168] bf16, graph replay after
# an L2 flush; runs in bench/results/tune-nvidia-h200-*). NVFP4 (2026-12-01): 2048-element
# tiles (2 rows x 64 blocks) on 4 warps, one block per thread, 8 tiles per program, loading 3
# ahead (T043501: 40.1 us linear; 2 ahead 40.5, 1 ahead 41.2-41.3; 4096 elements on 8 warps:
# 40.6-42.3; 2 blocks per thread: 49-60; a persistent grid, register caps, L2 prefetches,
# evict-first loads, row-group tiles for swizzled scales: slower); packed stores evict_last
# (T062536: 36.5 us linear, 37.1 swizzled). MXFP8 (and the dequantizers) 4096 / 32 / 4:
# 46.7-47.5 us.
NVFP4_TILE_ELEMENTS = 2048
NVFP4_MAX_BLOCKS = 64  # 64 NVFP4 blocks = 1024 columns = 2 KiB of bf16 per row
NVFP4_NUM_WARPS = 4
NVFP4_STEPS = 8  # tiles per program along its rows (unrolled)
NVFP4_PREFETCH = 3  # a program loads the tile this many steps ahead (1, 2 or 3)
NVFP4_MAXNREG = None  # a register cap for the NVFP4 kernel (more warps per SM), or None
# L2 eviction priority of quantize_nvfp4's packed-value stores ("" for the default, see above)
NVFP4_STORE_POLICY = "evict_last"
TILE_ELEMENTS = 4096
MAX_BLOCKS_PER_PROGRAM = 32
NUM_WARPS = 4
# The global-scale pass: a persistent grid of AMAX_PROGRAMS_PER_SM programs per SM, each
# looping over [AMAX_TILE_ROWS, AMAX_TILE_COLS] tiles (16 KiB of bf16 per step, 8 warps: 4
# 16-byte loads per thread in flight), then one tiny program reduces the per-program maxima.
# Two launches, no memset: at [8192, 7168] bf16 the one read of x (117 MB) is ~28 us of HBM.
AMAX_TILE_COLS = 1024
AMAX_TILE_ROWS = 8
AMAX_NUM_WARPS = 8
AMAX_PROGRAMS_PER_SM = 4
AMAX_FINISH_BLOCK = 1024  # the finishing program reads the partials this many at a time
_INTERPRETER_SMS = 4  # stands in for the SM count under TRITON_INTERPRET
# MXFP8 elements: the GPU's cvt.rn.satfinite.e4m3x2.f32 (inline PTX, ``_e4m3_pairs``) on a GPU;
# tests set it to False to check the software path on the GPU too.
_HARDWARE_E4M3 = True
# NVFP4 (IEEE recipe) of bf16/fp16 on a GPU: the word-level inline PTX (``_e2m1_words``,
# ``_words_amax``); tests set it to False to check the portable path on the GPU too.
_WORD_ASM = True
# The same numbers as constexprs, for the kernels.
_INV6 = tl.constexpr(INV_E2M1_MAX)
_INV448 = tl.constexpr(INV_E4M3_MAX)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_FLT_MAX = tl.constexpr(FLT_MAX)
_GLOBAL_NUMERATOR = tl.constexpr(NVFP4_GLOBAL_NUMERATOR)
_E2M1_BITS_BASE = tl.constexpr(0x4B000000)  # the fp32 bits of 2^23
_TWO_POW_M127 = tl.constexpr(2.0 ** -127)  # e8m0 code 0 / the inverse of code 254 (subnormal)


# =============================================================================================
# Shared rounding helpers
# =============================================================================================

@triton.jit
def _rcp_approx(x):
    """rcp.approx.ftz.f32, FlashInfer's fast reciprocal (GPU only)."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _e2m1_magnitude_bits(a):
    """e2m1 magnitude code of ``a`` = |y| (fp32 >= +0, inf or NaN; RNE, satfinite), as the
    bits of the fp32 2^23 + code (``_E2M1_BITS_BASE + code``; ``_e2m1_magnitude`` subtracts).

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
    return tl.minimum(tl.minimum(tl.minimum(f0, f1), f2), _E2M1_BITS_BASE + 7)


@triton.jit
def _e2m1_magnitude(a):
    """e2m1 magnitude code (int32 0..7) of ``a`` = |y| (``_e2m1_magnitude_bits``)."""
    return _e2m1_magnitude_bits(a) - _E2M1_BITS_BASE


@triton.jit
def _e2m1_code(y):
    """fp32 -> e2m1 code (int32 0..15): RNE, satfinite at 6, sign kept, NaN -> 7 | sign."""
    return _e2m1_magnitude(tl.abs(y)) | ((y.to(tl.int32, bitcast=True) >> 28) & 0x8)


@triton.jit
def _e4m3_code(x):
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
def _e4m3_round(x):
    """fp32 -> (float8_e4m3fn bits as int32, their fp32 value): ``_e4m3_code`` and
    ``_e4m3_value`` of it in one pass, for the per-block NVFP4 scale. Normal range: the bits
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
def _with_sign(magnitude, sign_bit):
    """``magnitude`` (fp32, >= +0) negated where ``sign_bit`` (int) is nonzero, on the bits.
    ``-x`` turned -0 into +0 on an H200 with Triton 3.6 (seen; the interpreter kept -0)."""
    bits = magnitude.to(tl.uint32, bitcast=True) | tl.where(sign_bit != 0, 0x80000000, 0).to(
        tl.uint32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(code):
    """float8_e4m3fn bits (int32) -> fp32, exact (0x7F/0xFF -> NaN)."""
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # 2^-9
    value = _with_sign(value, code & 0x80)
    nan = tl.full(code.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where((code & 0x7F) == 0x7F, nan, value)


@triton.jit
def _e8m0_code(s):
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
def _e8m0_inverse(code):
    """2^(127 - code) as fp32 for an e8m0 code (254 -> 2^-127, 255 (NaN) -> 0)."""
    inverse = ((254 - code) << 23).to(tl.float32, bitcast=True)
    inverse = tl.where(code == 254, _TWO_POW_M127, inverse)
    return tl.where(code >= 255, 0.0, inverse)


@triton.jit
def _e8m0_value(code):
    """2^(code - 127) as fp32 for an e8m0 code (0 -> 2^-127 subnormal, 255 -> inf)."""
    return tl.where(code == 0, _TWO_POW_M127, (code << 23).to(tl.float32, bitcast=True))


@triton.jit
def _scale_row_offsets(rows, padded_blocks, LAYOUT: tl.constexpr):
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
def _scale_block_offsets(blocks, LAYOUT: tl.constexpr):
    """The block part (int32) of the scale byte offsets (see ``_scale_row_offsets``)."""
    if LAYOUT == 0:
        return blocks
    elif LAYOUT == 1:
        return (blocks // 4) * 512 + blocks % 4
    else:
        return (blocks // 4) * 32 + blocks % 4


@triton.jit
def _scale_offsets(rows, blocks, padded_blocks, LAYOUT: tl.constexpr):
    """Byte offsets (int64) of scales (rows[:, None], blocks[None, :]) in a layout with
    padded_blocks blocks per row."""
    return (_scale_row_offsets(rows, padded_blocks, LAYOUT)[:, None]
            + _scale_block_offsets(blocks, LAYOUT)[None, :])


@triton.jit
def _load_tile(x_ptr, row_start, col_start, num_rows, hidden, stride_row, stride_col,
               BLOCK_ROWS: tl.constexpr, COLS: tl.constexpr):
    """Rows [row_start, +BLOCK_ROWS) and columns [col_start, +COLS) of x as fp32 (zeros
    outside x)."""
    rows = row_start + tl.arange(0, BLOCK_ROWS)
    cols = col_start + tl.arange(0, COLS)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_row
                + cols[None, :].to(tl.int64) * stride_col, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _source_rows(rows_ptr, rows, num_rows, num_src_rows, HAS_ROWS: tl.constexpr):
    """(int64 rows of x to read, their mask) for output rows ``rows``: the rows themselves, or
    gathered through rows_ptr when HAS_ROWS (an id outside [0, num_src_rows) is masked, i.e.
    reads as a zero row)."""
    row_ok = rows < num_rows
    if HAS_ROWS:
        src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        return src, row_ok & (src >= 0) & (src < num_src_rows)
    return rows.to(tl.int64), row_ok


@triton.jit
def _load_words(row_ptrs, row_ok, block_start, num_blocks, FIRST: tl.constexpr,
                BLOCKS: tl.constexpr, PAIRS: tl.constexpr, WIDTH: tl.constexpr):
    """Words [FIRST, FIRST + WIDTH) of scale blocks [block_start, +BLOCKS) (PAIRS words per
    block) of the rows starting at ``row_ptrs`` ([R] pointers into x read as words of two
    elements: int32 for bf16/fp16, int64 for fp32). Returns (words [R, BLOCKS, WIDTH], their
    int32 offsets [1, BLOCKS, WIDTH] within a row, which are the packed FP4 byte offsets too).
    Masked rows and blocks read zeros.

    A kernel reads a block in parts of WIDTH = 4 words (one 16-byte load): each thread then
    holds whole blocks, so the block reductions, the per-block scale math (done once per
    block, not once per thread sharing it) and the nibble packing need no data exchange."""
    blocks = block_start + tl.arange(0, BLOCKS)
    offsets = (blocks * PAIRS + FIRST)[None, :, None] + tl.arange(0, WIDTH)[None, None, :]
    mask = row_ok[:, None, None] & (blocks < num_blocks)[None, :, None]
    return tl.load(row_ptrs[:, None, None] + offsets, mask=mask, other=0), offsets


@triton.jit
def _unpack_words(w, IN_KIND: tl.constexpr):
    """fp32 (lo, hi): elements 2i and 2i + 1 of words ``w`` (IN_KIND 0: bf16, 1: fp16 pairs
    in an int32; 2: fp32 pairs in an int64)."""
    if IN_KIND == 0:  # bf16: the fp32 bits are the bf16 bits followed by 16 zero bits
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:  # fp16
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # fp32 pairs in an int64
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _pair_amax(lo, hi):
    """Per-block amax of [R, B, W] element pairs: [R, B]. NaN propagates, as in torch.amax
    (``tl.max`` would skip it)."""
    return tl.reduce(_max_nan(tl.abs(lo), tl.abs(hi)), 2, _max_nan)


@triton.jit
def _e2m1_pairs(lo, hi, scale):
    """Packed FP4 bytes of element pairs times ``scale``: element 2i low nibble."""
    return (_e2m1_code(lo * scale) | (_e2m1_code(hi * scale) << 4)).to(tl.uint8)


def _e2m1_words_ptx(in_kind: int) -> str:
    """PTX of ``_e2m1_words`` for bf16 (in_kind 0) or fp16 (1) words: operands $0 (out: 4
    packed FP4 bytes), $1-$4 the words, $5-$8 the block's out_scale, $9-$12 / $13-$16 the
    sign masks of the low / high elements (0x08080808 / 0x80808080, or 0 in a NaN block;
    $9 and $13 stand for all 4 words, which are one block's: see ``_word_asm``).

    Per element: unpack, y = x * scale (mul.rn), the three candidates of
    ``_e2m1_magnitude_bits`` (two fma.rn and one add.rn on |y|), their minimum capped at
    2^23 + 7 (min.s32), and one mad.lo that adds those bits at the nibble's position; the
    2^23 base of all eight is taken off by starting the sum at its negation (mod 2^32). The
    signs are the words' own sign bits (bits 15 and 31): prmt replicates each into a byte
    (selector nibble 8 + byte), two more prmt gather the low and high elements' signs by
    pair, and the masks keep bit 3 / bit 7 of each byte. y = +-0 keeps x's sign; y is NaN
    only when the block's scale is (IEEE recipe), where the mask drops the signs, as the
    GPU's NaN product has none. Integer work: the three min.s32 (two instructions on SM90,
    a 3-input min and the cap) per element and 6 instructions per 8 elements; the rest runs
    on the FMA pipe."""
    base = (-(0x4B000000 * 0x11111111)) % (1 << 32)
    lines = ["{", ".reg .b32 lo, hi, y, f0, f1, f2, c, acc, sa, sb, s;", ".reg .b16 h0, h1;",
             f"mov.b32 acc, {base};"]
    for k in range(4):
        word = f"${1 + k}"
        if in_kind == 0:
            lines += [f"shl.b32 lo, {word}, 16;", f"and.b32 hi, {word}, -65536;"]
        else:
            lines += [f"mov.b32 {{h0, h1}}, {word};", "cvt.f32.f16 lo, h0;", "cvt.f32.f16 hi, h1;"]
        for element, shift in (("lo", 8 * k), ("hi", 8 * k + 4)):
            lines += [f"mul.rn.f32 y, {element}, ${5 + k};", "abs.f32 y, y;",
                      "fma.rn.f32 f0, y, 0f40000000, 0f4B000000;",
                      "add.rn.f32 f1, y, 0f4B000002;",
                      "fma.rn.f32 f2, y, 0f3F000000, 0f4B000004;",
                      "min.s32 c, f0, f1;", "min.s32 c, c, f2;", "min.s32 c, c, 0x4B000007;",
                      f"mad.lo.u32 acc, c, {1 << shift}, acc;"]
    lines += ["prmt.b32 sa, $1, $2, 0xFBD9;", "prmt.b32 sb, $3, $4, 0xFBD9;",
              "prmt.b32 s, sa, sb, 0x5410;", "and.b32 s, s, $9;", "or.b32 acc, acc, s;",
              "prmt.b32 s, sa, sb, 0x7632;", "and.b32 s, s, $13;", "or.b32 $0, acc, s;", "}"]
    return " ".join(lines)


_E2M1_WORDS_PTX = tl.constexpr(_e2m1_words_ptx(0))
_E2M1_WORDS_PTX_F16 = tl.constexpr(_e2m1_words_ptx(1))
_E2M1_WORDS_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 4 + ["f"] * 4 + ["r"] * 8))


@triton.jit
def _e2m1_words(w, scale, sign_lo, sign_hi, IN_KIND: tl.constexpr):
    """[R, B, 4] int32 words of bf16/fp16 pairs times ``scale`` ([R, B, 4] fp32, one value
    per block) -> [R, B, 4] packed FP4 bytes (uint8), by inline PTX (``_e2m1_words_ptx``) on
    each thread's 4 consecutive words; GPU only. ``sign_lo``/``sign_hi``: [R, B, 4] int32
    masks, 0x08080808 / 0x80808080 to keep the signs, 0 in blocks whose scale is NaN."""
    return tl.inline_asm_elementwise(_E2M1_WORDS_PTX if IN_KIND == 0 else _E2M1_WORDS_PTX_F16,
                                     _E2M1_WORDS_CONSTRAINTS, [w, scale, sign_lo, sign_hi],
                                     dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _bf16x2_absmax(a, b):
    """Per 16-bit half: max(|a|, |b|) of bf16 pairs, NaN propagating (sign bits: the xor of
    the inputs', not meaningful)."""
    return tl.inline_asm_elementwise("max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r",
                                     [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _f16x2_absmax(a, b):
    """``_bf16x2_absmax`` for fp16 pairs."""
    return tl.inline_asm_elementwise("max.NaN.xorsign.abs.f16x2 $0, $1, $2;", "=r,r,r",
                                     [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _words_amax(w0, w1, IN_KIND: tl.constexpr):
    """Per-block amax (fp32 [R, B], NaN propagating) of the two [R, B, 4] halves of bf16/fp16
    blocks, reduced on the packed pairs (one instruction per two elements; GPU only)."""
    if IN_KIND == 0:
        m = _bf16x2_absmax(tl.reduce(w0, 2, _bf16x2_absmax), tl.reduce(w1, 2, _bf16x2_absmax))
    else:
        m = _f16x2_absmax(tl.reduce(w0, 2, _f16x2_absmax), tl.reduce(w1, 2, _f16x2_absmax))
    lo, hi = _unpack_words(m, IN_KIND)
    return _max_nan(tl.abs(lo), tl.abs(hi))


# =============================================================================================
# Kernels
# =============================================================================================

@triton.jit
def _nvfp4_quantize_kernel(words_ptr, rows_ptr, global_scale_ptr, out_ptr, scales_ptr,
                           num_rows, num_src_rows, hidden, stride_row,
                           padded_rows, padded_blocks,
                           HAS_ROWS: tl.constexpr, IN_KIND: tl.constexpr,
                           LAYOUT: tl.constexpr, FAST_MATH: tl.constexpr,
                           WORD_ASM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                           BLOCKS: tl.constexpr, STEPS: tl.constexpr,
                           PREFETCH: tl.constexpr, STORE_POLICY: tl.constexpr):
    """A program quantizes BLOCK_ROWS rows over STEPS consecutive tiles of BLOCKS scale blocks
    (unrolled), loading the tile PREFETCH (1, 2 or 3) steps ahead before working on the
    current one, so a thread has loads in flight while it computes."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    block_start = tl.program_id(1) * (BLOCKS * STEPS)
    num_blocks = hidden // 16
    src, row_ok = _source_rows(rows_ptr, rows, num_rows, num_src_rows, HAS_ROWS)
    in_ptrs = words_ptr + src * stride_row
    out_ptrs = out_ptr + rows.to(tl.int64) * (hidden // 2)
    scale_ptrs = scales_ptr + _scale_row_offsets(rows, padded_blocks, LAYOUT)
    global_scale = tl.load(global_scale_ptr)
    # A block of 16 elements is 8 words, read as two halves of 4 (``_load_halves``).
    # cur: this step's tile; ahead / ahead2: the next two (PREFETCH 2 / 3); new: the tile
    # PREFETCH steps ahead, loaded before this step's work
    cur = _load_halves(in_ptrs, row_ok, block_start, num_blocks, BLOCKS)
    if PREFETCH > 1 and STEPS > 1:
        ahead = _load_halves(in_ptrs, row_ok, block_start + BLOCKS, num_blocks, BLOCKS)
    if PREFETCH > 2 and STEPS > 2:
        ahead2 = _load_halves(in_ptrs, row_ok, block_start + 2 * BLOCKS, num_blocks, BLOCKS)
    for step in tl.static_range(STEPS):  # unrolled: no loop-carried register moves
        if step + PREFETCH < STEPS:  # the tile PREFETCH steps ahead, in flight meanwhile
            new = _load_halves(in_ptrs, row_ok, block_start + (step + PREFETCH) * BLOCKS,
                               num_blocks, BLOCKS)
        _nvfp4_tile(cur[0], cur[1], global_scale, out_ptrs, scale_ptrs, rows,
                    block_start + step * BLOCKS, num_rows, num_blocks, padded_rows,
                    padded_blocks, IN_KIND, LAYOUT, FAST_MATH, WORD_ASM, BLOCK_ROWS, BLOCKS,
                    STORE_POLICY)
        if step + 1 < STEPS:
            if PREFETCH == 1:
                cur = new
            elif PREFETCH == 2:
                cur = ahead
                if step + 2 < STEPS:
                    ahead = new
            else:
                cur = ahead
                if step + 2 < STEPS:
                    ahead = ahead2
                if step + 3 < STEPS:
                    ahead2 = new


@triton.jit
def _load_halves(in_ptrs, row_ok, block_start, num_blocks, BLOCKS: tl.constexpr):
    """(words of half 0, words of half 1) of NVFP4 blocks [block_start, +BLOCKS)
    (``_load_words``)."""
    return (_load_words(in_ptrs, row_ok, block_start, num_blocks, 0, BLOCKS, 8, 4)[0],
            _load_words(in_ptrs, row_ok, block_start, num_blocks, 4, BLOCKS, 8, 4)[0])


@triton.jit
def _nvfp4_tile(w0, w1, global_scale, out_ptrs, scale_ptrs, rows,
                block_start, num_rows, num_blocks, padded_rows, padded_blocks,
                IN_KIND: tl.constexpr, LAYOUT: tl.constexpr, FAST_MATH: tl.constexpr,
                WORD_ASM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr,
                STORE_POLICY: tl.constexpr):
    """One tile: the words (``_load_words``, halves 0 and 1 of each block) -> packed codes
    at ``out_ptrs`` (the rows' starts, stored with L2 eviction priority STORE_POLICY) and
    block scales at ``scale_ptrs`` (the rows' parts of the scale offsets in LAYOUT)."""
    if WORD_ASM:  # bf16/fp16, IEEE recipe, on a GPU: the word-level inline PTX
        amax = _words_amax(w0, w1, IN_KIND)  # [BLOCK_ROWS, BLOCKS]
    else:
        lo0, hi0 = _unpack_words(w0, IN_KIND)
        lo1, hi1 = _unpack_words(w1, IN_KIND)
        amax = _max_nan(_pair_amax(lo0, hi0), _pair_amax(lo1, hi1))
    if FAST_MATH:  # FlashInfer's default: sf = e4m3(gs * (a * rcp(6))), 1 / x = rcp(x)
        # rcp.approx(6) == f32(1/6) (test_gpu_rcp_approx_constants_equal_ieee), so the
        # constant stands in for it; only the association differs from the IEEE recipe.
        sf_value = global_scale * (amax * _INV6)
    else:  # IEEE: sf = e4m3(a * (gs * f32(1/6)))
        sf_value = amax * (global_scale * _INV6)
    # The scale is rounded in software: Triton 3.6's hardware fp32 -> e4m3 cast on this
    # block-reduced (sliced-layout) tensor gave wrong codes for fp32 input on H200.
    sf, sf_float = _e4m3_round(sf_value)
    if FAST_MATH:
        # rcp.approx through inline PTX on an element-shaped tensor: on the block-shaped
        # (sliced-layout) tensor the same asm gave run-to-run different results on H200.
        shape: tl.constexpr = (BLOCK_ROWS, BLOCKS, 4)
        sf_elements = tl.broadcast_to(sf_float[:, :, None], shape)
        gs_elements = tl.full(shape, 1.0, tl.float32) * global_scale
        out_scale = _rcp_approx(sf_elements * _rcp_approx(gs_elements))
        out_scale = tl.where(amax[:, :, None] == 0, 0.0, out_scale)
    else:
        decode = tl.math.div_rn(1.0, global_scale)
        out_scale = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32),
                                              sf_float * decode),
                               _FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
        out_scale = tl.where(amax == 0, 0.0, out_scale)[:, :, None]
    # Byte i of a packed row holds elements 2i (low nibble) and 2i + 1: word i of x.
    if WORD_ASM:
        shape: tl.constexpr = (BLOCK_ROWS, BLOCKS, 4)
        signed = (out_scale == out_scale)  # the product by a NaN scale has no sign
        sign_lo = tl.broadcast_to(tl.where(signed, 0x08080808, 0), shape)
        sign_hi = tl.broadcast_to(tl.where(signed, -2139062144, 0), shape)  # 0x80808080
        scale = tl.broadcast_to(out_scale, shape)
        pairs0 = _e2m1_words(w0, scale, sign_lo, sign_hi, IN_KIND)
        pairs1 = _e2m1_words(w1, scale, sign_lo, sign_hi, IN_KIND)
    else:
        pairs0 = _e2m1_pairs(lo0, hi0, out_scale)
        pairs1 = _e2m1_pairs(lo1, hi1, out_scale)
    blocks = block_start + tl.arange(0, BLOCKS)
    in_tile = (rows < num_rows)[:, None, None] & (blocks < num_blocks)[None, :, None]
    # the block's 8 packed bytes as one 8-byte store: [R, B, 4] x 2 -> [R, B, 8] in registers
    packed = tl.reshape(tl.permute(tl.join(pairs0, pairs1), (0, 1, 3, 2)),
                        (BLOCK_ROWS, BLOCKS, 8))
    tl.store(out_ptrs[:, None, None] + (blocks * 8)[None, :, None]
             + tl.arange(0, 8)[None, None, :], packed, mask=in_tile, eviction_policy=STORE_POLICY)
    # Scales: rows up to the padded row count, blocks up to the padded block count; the
    # padding (rows >= num_rows or blocks past H/16) saw only masked zeros, so it stores 0.
    sf_mask = (rows < padded_rows)[:, None] & (blocks < padded_blocks)[None, :]
    _store_bytes(scale_ptrs[:, None] + _scale_block_offsets(blocks, LAYOUT)[None, :], sf,
                 sf_mask, WORD_ASM)


@triton.jit
def _store_bytes(ptrs, values, mask, ASM: tl.constexpr):
    """Store the low bytes of int32 ``values`` at ``ptrs`` where ``mask``. ASM (GPU): by inline
    st.global.b8 in the tensors' own layout; a tl.store of this block-shaped (sliced-layout)
    tensor first moves it through shared memory into a store layout, two barriers each."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b8 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r", [ptrs.to(tl.int64), values, mask.to(tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1)
    else:
        tl.store(ptrs, values.to(tl.uint8), mask=mask)


@triton.jit
def _e4m3_pairs(lo, hi, HARDWARE: tl.constexpr):
    """[.., W] fp32 pairs (no NaN) -> uint16 of their e4m3 bytes (RNE, saturating at +-448),
    element 2i in the low byte. HARDWARE: one cvt.rn.satfinite.e4m3x2.f32 per pair (SM89+),
    the same rounding as the software path."""
    if HARDWARE:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 pair; cvt.rn.satfinite.e4m3x2.f32 pair, $2, $1; cvt.u32.u16 $0, pair; }",
            "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1).to(tl.uint16)
    return (_e4m3_code(lo) | (_e4m3_code(hi) << 8)).to(tl.uint16)


@triton.jit
def _mx_quantize_kernel(words_ptr, out_ptr, scales_ptr, num_rows, hidden, stride_row,
                        IN_KIND: tl.constexpr, FP4: tl.constexpr,
                        HARDWARE_E4M3: tl.constexpr, WORD_ASM: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """FP4: out is [M, H/2] uint8 (byte i = elements 2i, 2i + 1); else out is [M, H/2] uint16
    (the e4m3 bytes of elements 2i, 2i + 1, little-endian). WORD_ASM: bf16/fp16 on a GPU,
    the block amax reduced on the packed pairs (``_words_amax``)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    block_start = tl.program_id(1) * BLOCKS
    num_blocks = hidden // 32
    src, row_ok = _source_rows(words_ptr, rows, num_rows, num_rows, False)
    # A block of 32 elements is 16 words, read as two halves of 8.
    in_ptrs = words_ptr + src * stride_row
    w0, words0 = _load_words(in_ptrs, row_ok, block_start, num_blocks, 0, BLOCKS, 16, 8)
    w1, words1 = _load_words(in_ptrs, row_ok, block_start, num_blocks, 8, BLOCKS, 16, 8)
    lo0, hi0 = _unpack_words(w0, IN_KIND)
    lo1, hi1 = _unpack_words(w1, IN_KIND)
    if WORD_ASM:
        amax = _words_amax(w0, w1, IN_KIND)
    else:
        amax = _max_nan(_pair_amax(lo0, hi0), _pair_amax(lo1, hi1))
    if FP4:  # e8m0(a * f32(1/6)); scale 0 for a zero block, 1 for code 0
        sf = _e8m0_code(amax * _INV6)
        out_scale = tl.where(sf == 0, 1.0, _e8m0_inverse(sf))
        out_scale = tl.where(amax == 0, 0.0, out_scale)[:, :, None]
        pairs0 = _e2m1_pairs(lo0, hi0, out_scale)
        pairs1 = _e2m1_pairs(lo1, hi1, out_scale)
    else:  # e8m0(a * f32(1/448)); code 0 scales by 0; clamp to +-448, NaN -> +448
        sf = _e8m0_code(amax * _INV448)
        out_scale = tl.where(sf == 0, 0.0, _e8m0_inverse(sf))[:, :, None]
        y0, y1, y2, y3 = lo0 * out_scale, hi0 * out_scale, lo1 * out_scale, hi1 * out_scale
        # The e4m3 conversions saturate (+-inf and beyond +-448 give +-448), so of FlashInfer's
        # clamp only NaN -> +448 is left (a NaN or inf element of a NaN block, scaled by 0).
        y0, y1 = _nan_to_e4m3_max(y0, HARDWARE_E4M3), _nan_to_e4m3_max(y1, HARDWARE_E4M3)
        y2, y3 = _nan_to_e4m3_max(y2, HARDWARE_E4M3), _nan_to_e4m3_max(y3, HARDWARE_E4M3)
        pairs0 = _e4m3_pairs(y0, y1, HARDWARE_E4M3)
        pairs1 = _e4m3_pairs(y2, y3, HARDWARE_E4M3)
    out_rows = out_ptr + rows.to(tl.int64)[:, None, None] * (hidden // 2)
    tl.store(out_rows + words0, pairs0, mask=row_ok[:, None, None] & (words0 < hidden // 2))
    tl.store(out_rows + words1, pairs1, mask=row_ok[:, None, None] & (words1 < hidden // 2))
    blocks = block_start + tl.arange(0, BLOCKS)
    tl.store(scales_ptr + rows.to(tl.int64)[:, None] * num_blocks + blocks[None, :],
             sf.to(tl.uint8), mask=row_ok[:, None] & (blocks < num_blocks)[None, :])


@triton.jit
def _nan_to_e4m3_max(y, GPU: tl.constexpr):
    """NaN -> +448, other values unchanged up to 448 (FlashInfer's fminf(y, 448)). GPU: that
    minimum itself, one instruction (min.f32 returns the number when one input is NaN);
    Triton's interpreter propagates NaN through minimum, so there: a select."""
    if GPU:
        return tl.minimum(y, _E4M3_MAX)
    return tl.where(y != y, _E4M3_MAX, y)


@triton.jit
def _amax_partial_kernel(x_ptr, partial_ptr, num_rows, hidden, stride_row, stride_col,
                         tiles_per_program, BLOCK_ROWS: tl.constexpr, COLS: tl.constexpr):
    """Pass 1 of the global scale: program p folds |x| over tiles p, p + P, p + 2P, ... (P = the
    grid) into a register tile and writes its max to partial[p]. No atomics, no zeroed
    workspace, so no fill launches; max is order-independent (deterministic) and propagates
    NaN as torch.amax does. A tile index past the last tile starts past the last row, so its
    load is fully masked."""
    col_tiles = tl.cdiv(hidden, COLS)
    acc = tl.zeros((BLOCK_ROWS, COLS), tl.float32)
    step = 0
    while step < tiles_per_program:  # (a while loop: the interpreter cannot range() over an arg)
        tile = tl.program_id(0) + step * tl.num_programs(0)
        x = _load_tile(x_ptr, (tile // col_tiles) * BLOCK_ROWS, (tile % col_tiles) * COLS,
                       num_rows, hidden, stride_row, stride_col, BLOCK_ROWS, COLS)
        acc = _max_nan(acc, tl.abs(x))
        step += 1
    tl.store(partial_ptr + tl.program_id(0), tl.reduce(tl.reduce(acc, 1, _max_nan), 0, _max_nan))


@triton.jit
def _global_scale_finish_kernel(partial_ptr, out_ptr, num_partials, BLOCK: tl.constexpr):
    """Pass 2 (one program): amax = max(partial[:num_partials]), read BLOCK at a time;
    out = 448 * 6 / amax with an IEEE division, 1.0 when amax == 0 (or num_partials == 0)."""
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    start = 0
    while start < num_partials:
        acc = _max_nan(acc, tl.load(partial_ptr + start + offsets,
                                    mask=start + offsets < num_partials, other=0.0))
        start += BLOCK
    amax = tl.reduce(acc, 0, _max_nan)
    scale = tl.math.div_rn(tl.full((), _GLOBAL_NUMERATOR, tl.float32), amax)
    tl.store(out_ptr, tl.where(amax == 0, 1.0, scale))


@triton.jit
def _scale_layout_kernel(src_ptr, dst_ptr, num_rows, num_blocks, padded_blocks,
                         cover_rows, cover_blocks, LAYOUT: tl.constexpr,
                         SWIZZLE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         BLOCKS: tl.constexpr):
    """SWIZZLE: linear [num_rows, num_blocks] -> layout (padding written as 0); else the
    inverse. cover_rows/cover_blocks: the index range the grid covers."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    inside = (rows < num_rows)[:, None] & (blocks < num_blocks)[None, :]
    covered = (rows < cover_rows)[:, None] & (blocks < cover_blocks)[None, :]
    linear = rows.to(tl.int64)[:, None] * num_blocks + blocks[None, :]
    swizzled = _scale_offsets(rows, blocks, padded_blocks, LAYOUT)
    if SWIZZLE:
        values = tl.load(src_ptr + linear, mask=inside, other=0)
        tl.store(dst_ptr + swizzled, values, mask=covered)
    else:
        tl.store(dst_ptr + linear, tl.load(src_ptr + swizzled, mask=inside), mask=inside)


@triton.jit
def _dequantize_kernel(packed_ptr, scales_ptr, global_scale_ptr, out_ptr, num_rows, hidden,
                       padded_blocks, FORMAT: tl.constexpr, LAYOUT: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """FORMAT 0: NVFP4 (e2m1 * e4m3 * 1/gs), 1: MXFP4 (e2m1 * 2^(c-127)),
    2: MXFP8 (e4m3 * 2^(c-127))."""
    COLS: tl.constexpr = BLOCKS * BLOCK
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    row_ok = (rows < num_rows)[:, None]
    mask = row_ok & (cols < hidden)[None, :]
    # Each element loads its block's scale (element-shaped, L1 hits), so no tensor is reshaped.
    sf = tl.load(scales_ptr + _scale_offsets(rows, cols // BLOCK, padded_blocks, LAYOUT),
                 mask=mask, other=0).to(tl.int32)
    if FORMAT == 2:
        codes = tl.load(packed_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
                        mask=mask, other=0).to(tl.int32)
        values = _e4m3_value(codes)
    else:
        # byte i of a row holds elements 2i (low nibble) and 2i + 1 (high nibble)
        byte = tl.load(packed_ptr + rows.to(tl.int64)[:, None] * (hidden // 2)
                       + (cols // 2)[None, :], mask=mask, other=0).to(tl.int32)
        codes = tl.where((cols % 2 == 0)[None, :], byte & 0xF, byte >> 4)
        magnitude_code = codes & 0x7
        # 0, .5, 1, 1.5, 2, 3, 4, 6: code / 2 below 4, then 3, 4, 6
        magnitude = tl.where(magnitude_code < 5, magnitude_code.to(tl.float32) * 0.5,
                             tl.where(magnitude_code == 5, 3.0,
                                      tl.where(magnitude_code == 6, 4.0, 6.0)))
        values = _with_sign(magnitude, codes & 8)
    if FORMAT == 0:
        decode = tl.math.div_rn(1.0, tl.load(global_scale_ptr))
        out = (values * _e4m3_value(sf)) * decode
    else:
        out = values * _e8m0_value(sf)
    if out_ptr.dtype.element_ty != tl.float32:  # round once, to nearest even, like torch
        out = out.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], out, mask=mask)


# =============================================================================================
# Launchers
# =============================================================================================

def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _can_run_ptx(device: torch.device) -> bool:
    """Whether kernels on ``device`` run compiled (inline PTX works), not interpreted."""
    return device.type == "cuda" and not _interpreting()


def _hardware_e4m3(device: torch.device) -> bool:
    return _HARDWARE_E4M3 and _can_run_ptx(device)


def _word_asm(device: torch.device, in_kind: int, fast_math: bool,
              stride_row: Optional[int] = None) -> bool:
    """Whether a kernel takes the word-level PTX path: bf16/fp16 input (IN_KIND 0/1), the IEEE
    recipe (fast math's inf scales make NaN products inside a block, whose signs that path
    cannot drop per element), on a GPU. ``stride_row`` (NVFP4, in words): a multiple of 16,
    so that Triton knows every row is 16-byte aligned and gives each thread its block's 4
    words in a row; ``_e2m1_words`` takes one block's sign masks for its 4 words, which then
    is right (with fewer words per thread it could mix blocks)."""
    return (_WORD_ASM and in_kind in (0, 1) and not fast_math and _can_run_ptx(device)
            and (stride_row is None or stride_row % 16 == 0))


def _tile(num_rows: int, num_blocks: int, block: int, device: torch.device, *,
          nvfp4: bool = False) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCKS, num_warps) of the launch rule for ``num_rows`` rows of
    ``num_blocks`` blocks: the NVFP4_* (``nvfp4``) or plain tile constants, then, for small
    M, fewer rows per program until the grid has 2 programs per SM (one big tile per SM
    would leave the latency of its serial work), warps shrunk with the tile."""
    tile_elements, max_blocks, num_warps = ((NVFP4_TILE_ELEMENTS, NVFP4_MAX_BLOCKS,
                                             NVFP4_NUM_WARPS) if nvfp4 else
                                            (TILE_ELEMENTS, MAX_BLOCKS_PER_PROGRAM, NUM_WARPS))
    blocks = min(max_blocks, triton.next_power_of_2(max(num_blocks, 1)))
    block_rows = max(1, tile_elements // (blocks * block))
    while (block_rows > 1 and triton.cdiv(num_rows, block_rows) * triton.cdiv(num_blocks, blocks)
           < 2 * _num_sms(device)):
        block_rows //= 2
    # smaller tiles (small M) get fewer warps: one scale block per thread at most
    warps = max(1, min(num_warps, block_rows * blocks // 32))
    return block_rows, blocks, warps


def _register_cap(maxnreg: Optional[int]) -> dict:
    """Launch options capping the registers per thread (ignored by the interpreter)."""
    return {} if maxnreg is None or _interpreting() else {"maxnreg": maxnreg}


def _steps(row_tiles: int, col_tiles: int, device: torch.device) -> int:
    """Tiles per NVFP4 program along its rows: up to NVFP4_STEPS, fewer while the grid would
    have less than 2 programs per SM, then evened out (7 tiles in 2 programs: 4 + 3, not
    5 + 2)."""
    steps = max(1, min(NVFP4_STEPS, col_tiles))
    while steps > 1 and row_tiles * triton.cdiv(col_tiles, steps) < 2 * _num_sms(device):
        steps -= 1
    return triton.cdiv(col_tiles, triton.cdiv(col_tiles, steps)) if col_tiles else 1


def _check_out(name: str, out: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, out, dtype=dtype, device=device, contiguous=True)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(out.shape)}; this call writes {tuple(shape)}")
    return out


# x's dtype -> (IN_KIND of the kernels, the integer dtype of one word of two elements)
_PAIR_VIEWS = {torch.bfloat16: (0, torch.int32), torch.float16: (1, torch.int32),
               torch.float32: (2, torch.int64)}


def _as_pairs(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x [M, H] (H even) viewed as [M, H/2] words of two elements, for ``_load_pairs``:
    (words, row stride in words, IN_KIND). x is copied first when its rows are not runs of
    whole words (column stride != 1, an odd row stride or an odd storage offset)."""
    in_kind, word = _PAIR_VIEWS[x.dtype]
    if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        x = torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
    words = x.view(word)
    return words, words.stride(0), in_kind


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or _interpreting():
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 global encode scale ``448 * 6 / amax(x)``: [1] fp32, 1.0 when amax(x) == 0.

    x: [M, H] bf16/fp16/fp32 (any strides). One read of x by a persistent grid, then one
    single-program reduction; the division is IEEE. Deterministic (max is order-independent).
    """
    check_tensor("x", x, dtype=QUANT_INPUT_DTYPES, ndim=2)
    num_rows, hidden = x.shape
    out = torch.empty(1, dtype=torch.float32, device=x.device)
    cols = min(AMAX_TILE_COLS, triton.next_power_of_2(max(hidden, 1)))
    block_rows = max(AMAX_TILE_ROWS, AMAX_TILE_ROWS * AMAX_TILE_COLS // cols)
    num_tiles = triton.cdiv(num_rows, block_rows) * triton.cdiv(hidden, cols)
    num_programs = min(num_tiles, AMAX_PROGRAMS_PER_SM * _num_sms(x.device))
    partial = torch.empty(max(num_programs, 1), dtype=torch.float32, device=x.device)
    if num_programs:
        _amax_partial_kernel[(num_programs,)](x, partial, num_rows, hidden, x.stride(0),
                                              x.stride(1), triton.cdiv(num_tiles, num_programs),
                                              BLOCK_ROWS=block_rows, COLS=cols,
                                              num_warps=AMAX_NUM_WARPS)
    _global_scale_finish_kernel[(1,)](partial, out, num_programs,
                                      BLOCK=min(AMAX_FINISH_BLOCK,
                                                triton.next_power_of_2(max(num_programs, 1))),
                                      num_warps=4)
    return out


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, *, layout: str = "linear",
                   fast_math: bool = False, out: Optional[torch.Tensor] = None,
                   out_scales: Optional[torch.Tensor] = None,
                   rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize rows of ``x``; bit-exact to ``kernels.reference.quantize_nvfp4``.

    x: [M, H] bf16/fp16/fp32, H % 16 == 0, any strides (read in place when its rows are
        runs of whole element pairs, the usual case; else copied to a contiguous tensor first).
    global_scale: [1] fp32 encode scale on x's device (read by the kernel, no sync).
    layout: "linear", "swizzled_128x4" or "8x4"; the kernel writes this layout directly and
        zeroes its padding.
    fast_math: FlashInfer's default recipe with rcp.approx.ftz.f32 (GPU only).
    out: optional [M', H/2] uint8 buffer; out_scales: optional scale buffer of the layout's
        shape ([M', H/16], or [Mp, Kp] from ``swizzled_scale_shape``), uint8, contiguous.
    rows: optional [M'] int32/int64 row ids: quantize x[rows] (M' = len(rows), else M' = M).
        Ids outside [0, M) are not checked (that would sync); they read as zero rows.
    Returns (packed [M', H/2] uint8, element 2i in the low nibble; scales uint8 e4m3 bits).
    """
    _check_quant_input(x, NVFP4_BLOCK)
    _check_layout(layout)
    _check_global_scale(global_scale, x.device)
    if fast_math and not _can_run_ptx(x.device):
        raise NotImplementedError(
            "fast_math=True needs the GPU instruction rcp.approx.ftz.f32 (inline PTX), which "
            "Triton's interpreter cannot run; use fast_math=False, or a CUDA tensor")
    if rows is not None:
        check_tensor("rows", rows, dtype=(torch.int32, torch.int64), ndim=1, device=x.device,
                     contiguous=True)
    num_src_rows, hidden = x.shape
    num_rows = rows.numel() if rows is not None else num_src_rows
    num_blocks = hidden // NVFP4_BLOCK
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    out = _check_out("out", out, (num_rows, hidden // 2), torch.uint8, x.device)
    out_scales = _check_out("out_scales", out_scales, (padded_rows, padded_blocks), torch.uint8,
                            x.device)
    block_rows, blocks, warps = _tile(padded_rows, padded_blocks, NVFP4_BLOCK, x.device,
                                      nvfp4=True)
    row_tiles, col_tiles = triton.cdiv(padded_rows, block_rows), triton.cdiv(padded_blocks,
                                                                             blocks)
    steps = _steps(row_tiles, col_tiles, x.device)
    grid = (row_tiles, triton.cdiv(col_tiles, steps))
    if grid[0] * grid[1] == 0:
        return out, out_scales
    words, stride_row, in_kind = _as_pairs(x)
    _nvfp4_quantize_kernel[grid](
        words, rows if rows is not None else words, global_scale, out, out_scales,
        num_rows, num_src_rows, hidden, stride_row, padded_rows, padded_blocks,
        HAS_ROWS=rows is not None, IN_KIND=in_kind, LAYOUT=LAYOUT_IDS[layout],
        FAST_MATH=fast_math, WORD_ASM=_word_asm(x.device, in_kind, fast_math, stride_row),
        BLOCK_ROWS=block_rows, BLOCKS=blocks, STEPS=steps, PREFETCH=min(NVFP4_PREFETCH, steps),
        STORE_POLICY=NVFP4_STORE_POLICY, num_warps=warps, **_register_cap(NVFP4_MAXNREG),
        enable_fp_fusion=False)
    return out, out_scales


def _quantize_mx(x: torch.Tensor, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of MXFP4 (values [M, H/2] uint8) or MXFP8 (values [M, H] uint8)."""
    _check_quant_input(x, MX_BLOCK)
    num_rows, hidden = x.shape
    # MXFP8 writes the two e4m3 bytes of each element pair as one uint16.
    pairs = torch.empty((num_rows, hidden // 2), dtype=torch.uint8 if fp4 else torch.uint16,
                        device=x.device)
    scales = torch.empty((num_rows, hidden // MX_BLOCK), dtype=torch.uint8, device=x.device)
    block_rows, blocks, warps = _tile(num_rows, hidden // MX_BLOCK, MX_BLOCK, x.device)
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden // MX_BLOCK, blocks))
    if grid[0] * grid[1]:
        words, stride_row, in_kind = _as_pairs(x)
        _mx_quantize_kernel[grid](words, pairs, scales, num_rows, hidden, stride_row,
                                  IN_KIND=in_kind, FP4=fp4,
                                  HARDWARE_E4M3=_hardware_e4m3(x.device),
                                  WORD_ASM=_word_asm(x.device, in_kind, fast_math=False),
                                  BLOCK_ROWS=block_rows, BLOCKS=blocks, num_warps=warps,
                                  enable_fp_fusion=False)
    return pairs.view(torch.uint8), scales


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize rows of ``x``; bit-exact to ``kernels.reference.quantize_mxfp8``.

    x: [M, H] bf16/fp16/fp32, H % 32 == 0. Returns (values [M, H] float8_e4m3fn,
    scales [M, H/32] uint8 e8m0).
    """
    values, scales = _quantize_mx(x, fp4=False)
    return values.view(torch.float8_e4m3fn), scales


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize rows of ``x``; bit-exact to ``kernels.reference.quantize_mxfp4``.

    x: [M, H] bf16/fp16/fp32, H % 32 == 0. Returns (packed [M, H/2] uint8, element 2i in the
    low nibble; scales [M, H/32] uint8 e8m0).
    """
    return _quantize_mx(x, fp4=True)


def _relayout(src: torch.Tensor, dst: torch.Tensor, layout: str, num_rows: int,
              num_blocks: int, swizzle: bool) -> torch.Tensor:
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    cover_rows, cover_blocks = (padded_rows, padded_blocks) if swizzle else (num_rows,
                                                                             num_blocks)
    block_rows, blocks = 32, 32
    grid = (triton.cdiv(cover_rows, block_rows), triton.cdiv(cover_blocks, blocks))
    if grid[0] * grid[1]:
        _scale_layout_kernel[grid](src, dst, num_rows, num_blocks, padded_blocks, cover_rows,
                                   cover_blocks, LAYOUT=LAYOUT_IDS[layout], SWIZZLE=swizzle,
                                   BLOCK_ROWS=block_rows, BLOCKS=blocks, num_warps=NUM_WARPS)
    return dst


def swizzle_scales(sf: torch.Tensor, layout: str) -> torch.Tensor:
    """Linear block scales [M, K] uint8 -> [Mp, Kp] uint8 in ``layout``, padding zero (see
    ``kernels.reference.swizzle_scales``)."""
    check_tensor("sf", sf, dtype=torch.uint8, ndim=2, contiguous=True)
    _check_layout(layout)
    num_rows, num_blocks = sf.shape
    out = torch.empty(swizzled_scale_shape(num_rows, num_blocks, layout), dtype=torch.uint8,
                      device=sf.device)
    return _relayout(sf, out, layout, num_rows, num_blocks, swizzle=True)


def unswizzle_scales(sf_swizzled: torch.Tensor, layout: str, num_rows: int,
                     num_blocks: int) -> torch.Tensor:
    """[Mp, Kp] (or flat) uint8 scales in ``layout`` -> [num_rows, num_blocks] linear."""
    check_tensor("sf_swizzled", sf_swizzled, dtype=torch.uint8, contiguous=True)
    _check_layout(layout)
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    if sf_swizzled.numel() != padded_rows * padded_blocks:
        raise ValueError(f"sf_swizzled has {sf_swizzled.numel()} bytes; layout={layout!r} with "
                         f"{num_rows} rows and {num_blocks} blocks needs "
                         f"{padded_rows} x {padded_blocks} = {padded_rows * padded_blocks}")
    out = torch.empty((num_rows, num_blocks), dtype=torch.uint8, device=sf_swizzled.device)
    return _relayout(sf_swizzled, out, layout, num_rows, num_blocks, swizzle=False)


def _dequantize(packed, scales, global_scale, layout, dtype, fmt, hidden, block):
    num_rows = packed.shape[0]
    padded_blocks = swizzled_scale_shape(num_rows, hidden // block, layout)[1]
    out = torch.empty((num_rows, hidden), dtype=dtype, device=packed.device)
    block_rows, blocks, warps = _tile(num_rows, hidden // block, block, packed.device)
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden // block, blocks))
    if grid[0] * grid[1]:
        _dequantize_kernel[grid](packed, scales, global_scale, out, num_rows, hidden,
                                 padded_blocks, FORMAT=fmt, LAYOUT=LAYOUT_IDS[layout],
                                 BLOCK_ROWS=block_rows, BLOCKS=blocks, BLOCK=block,
                                 num_warps=warps, enable_fp_fusion=False)
    return out


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     layout: str = "linear", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[M, H/2] uint8 codes, scales in ``layout``, [1] fp32 encode scale -> [M, H] ``dtype``,
    ``(e2m1 * f32(sf)) * (1 / gs)``; bit-exact to the reference."""
    check_tensor("packed", packed, dtype=torch.uint8, ndim=2, contiguous=True)
    check_tensor("scales", scales, dtype=torch.uint8, device=packed.device, contiguous=True)
    _check_layout(layout)
    _check_global_scale(global_scale, packed.device)
    hidden = packed.shape[1] * 2
    if hidden % NVFP4_BLOCK:
        raise ValueError(f"packed has {packed.shape[1]} bytes per row; H = 2 * that must be a "
                         f"multiple of {NVFP4_BLOCK}")
    expected = swizzled_scale_shape(packed.shape[0], hidden // NVFP4_BLOCK, layout)
    if scales.numel() != expected[0] * expected[1]:
        raise ValueError(f"scales has {scales.numel()} bytes; layout={layout!r} needs "
                         f"{expected[0]} x {expected[1]}")
    return _dequantize(packed, scales, global_scale, layout, dtype, 0, hidden, NVFP4_BLOCK)


def _check_mx_scales(scales: torch.Tensor, num_rows: int, hidden: int, device) -> None:
    check_tensor("scales", scales, dtype=torch.uint8, ndim=2, device=device, contiguous=True)
    if tuple(scales.shape) != (num_rows, hidden // MX_BLOCK):
        raise ValueError(f"scales has shape {tuple(scales.shape)}; expected "
                         f"{(num_rows, hidden // MX_BLOCK)} (one e8m0 per {MX_BLOCK} elements)")


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[M, H] float8_e4m3fn (or uint8 bits), [M, H/32] e8m0 -> [M, H] ``dtype``."""
    check_tensor("values", values, dtype=(torch.float8_e4m3fn, torch.uint8), ndim=2,
                 contiguous=True)
    _check_mx_scales(scales, values.shape[0], values.shape[1], values.device)
    return _dequantize(values.view(torch.uint8), scales, scales, "linear", dtype, 2,
                       values.shape[1], MX_BLOCK)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[M, H/2] uint8 codes, [M, H/32] e8m0 -> [M, H] ``dtype``."""
    check_tensor("packed", packed, dtype=torch.uint8, ndim=2, contiguous=True)
    _check_mx_scales(scales, packed.shape[0], packed.shape[1] * 2, packed.device)
    return _dequantize(packed, scales, scales, "linear", dtype, 1, packed.shape[1] * 2,
                       MX_BLOCK)
