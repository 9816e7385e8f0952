"""The MXFP8 / MXFP4 quantize kernel and the dequantize kernel of all three formats
(``@triton.jit``; the launchers are in ``kernels.quantize``)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.casting import round_to
from kernels.hardware import grid_dependency_prologue
from kernels.quantize_details.formats import (INV448, INV6, e4m3_value, e8m0_code,
                                              e8m0_inverse, e8m0_value, max_nan, scale_offsets,
                                              with_sign)
from kernels.quantize_details.words import (e2m1_pairs, e4m3_pairs, load_words,
                                            nan_to_e4m3_max, pair_amax, unpack_words,
                                            word_offsets, words_amax)


@triton.jit
def mx_quantize_kernel(words_ptr, out_ptr, scales_ptr, num_rows, hidden, stride_row,
                       IN_KIND: tl.constexpr, FP4: tl.constexpr,
                       HARDWARE_E4M3: tl.constexpr, WORD_ASM: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """FP4: out is [M, H/2] uint8 (byte i = elements 2i, 2i + 1); else out is [M, H/2] uint16
    (the e4m3 bytes of elements 2i, 2i + 1, little-endian). WORD_ASM: bf16/fp16 on a GPU,
    the block amax reduced on the packed pairs (``words_amax``)."""
    grid_dependency_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    block_start = tl.program_id(1) * BLOCKS
    num_blocks = hidden // 32
    row_ok = rows < num_rows
    # A block of 32 elements is 16 words, read as two halves of 8. The store offsets are
    # computed here, not taken from load_words (see ``word_offsets``).
    in_ptrs = words_ptr + rows.to(tl.int64) * stride_row
    w0 = load_words(in_ptrs, row_ok, block_start, num_blocks, 0, BLOCKS, 16, 8)[0]
    w1 = load_words(in_ptrs, row_ok, block_start, num_blocks, 8, BLOCKS, 16, 8)[0]
    words0 = word_offsets(block_start, 0, BLOCKS, 16, 8)
    words1 = word_offsets(block_start, 8, BLOCKS, 16, 8)
    lo0, hi0 = unpack_words(w0, IN_KIND)
    lo1, hi1 = unpack_words(w1, IN_KIND)
    if WORD_ASM:
        amax = words_amax(w0, w1, IN_KIND)
    else:
        amax = max_nan(pair_amax(lo0, hi0), pair_amax(lo1, hi1))
    if FP4:  # e8m0(a * f32(1/6)); scale 0 for a zero block, 1 for code 0
        sf = e8m0_code(amax * INV6)
        out_scale = tl.where(sf == 0, 1.0, e8m0_inverse(sf))
        out_scale = tl.where(amax == 0, 0.0, out_scale)[:, :, None]
        pairs0 = e2m1_pairs(lo0, hi0, out_scale)
        pairs1 = e2m1_pairs(lo1, hi1, out_scale)
    else:  # e8m0(a * f32(1/448)); code 0 scales by 0; clamp to +-448, NaN -> +448
        sf = e8m0_code(amax * INV448)
        out_scale = tl.where(sf == 0, 0.0, e8m0_inverse(sf))[:, :, None]
        y0, y1, y2, y3 = lo0 * out_scale, hi0 * out_scale, lo1 * out_scale, hi1 * out_scale
        # The e4m3 conversions saturate (+-inf and beyond +-448 give +-448), so of FlashInfer's
        # clamp only NaN -> +448 is left (a NaN or inf element of a NaN block, scaled by 0).
        y0, y1 = nan_to_e4m3_max(y0, HARDWARE_E4M3), nan_to_e4m3_max(y1, HARDWARE_E4M3)
        y2, y3 = nan_to_e4m3_max(y2, HARDWARE_E4M3), nan_to_e4m3_max(y3, HARDWARE_E4M3)
        pairs0 = e4m3_pairs(y0, y1, HARDWARE_E4M3)
        pairs1 = e4m3_pairs(y2, y3, HARDWARE_E4M3)
    out_rows = out_ptr + rows.to(tl.int64)[:, None, None] * (hidden // 2)
    tl.store(out_rows + words0, pairs0, mask=row_ok[:, None, None] & (words0 < hidden // 2))
    tl.store(out_rows + words1, pairs1, mask=row_ok[:, None, None] & (words1 < hidden // 2))
    blocks = block_start + tl.arange(0, BLOCKS)
    tl.store(scales_ptr + rows.to(tl.int64)[:, None] * num_blocks + blocks[None, :],
             sf.to(tl.uint8), mask=row_ok[:, None] & (blocks < num_blocks)[None, :])


@triton.jit
def dequantize_kernel(packed_ptr, scales_ptr, global_scale_ptr, out_ptr, num_rows, hidden,
                      padded_blocks, FORMAT: tl.constexpr, LAYOUT: tl.constexpr,
                      BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    """FORMAT 0: NVFP4 (e2m1 * e4m3 * 1/gs), 1: MXFP4 (e2m1 * 2^(c-127)),
    2: MXFP8 (e4m3 * 2^(c-127))."""
    grid_dependency_prologue(PDL)
    COLS: tl.constexpr = BLOCKS * BLOCK
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    row_ok = (rows < num_rows)[:, None]
    mask = row_ok & (cols < hidden)[None, :]
    # Each element loads its block's scale (element-shaped, L1 hits), so no tensor is reshaped.
    sf = tl.load(scales_ptr + scale_offsets(rows, cols // BLOCK, padded_blocks, LAYOUT),
                 mask=mask, other=0).to(tl.int32)
    if FORMAT == 2:
        codes = tl.load(packed_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
                        mask=mask, other=0).to(tl.int32)
        values = e4m3_value(codes)
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
        values = with_sign(magnitude, codes & 8)
    if FORMAT == 0:
        decode = tl.math.div_rn(1.0, tl.load(global_scale_ptr))
        out = (values * e4m3_value(sf)) * decode
    else:
        out = values * e8m0_value(sf)
    # round once, to nearest even, NaN canonical: kernels.spec.casting's bits on every face
    out = round_to(out, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], out, mask=mask)
