"""The NVFP4 quantize kernel and its tile, shared with the Triton transport's quantizing send
(``@triton.jit``; the launcher is ``kernels.quantize.quantize_nvfp4``)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.hardware import grid_dependency_prologue
from kernels.quantize_details.formats import (FLT_MAX_C, INV6, e4m3_round, max_nan, rcp_approx,
                                              scale_block_offsets, scale_row_offsets)
from kernels.quantize_details.scales import global_scale_of
from kernels.quantize_details.words import (e2m1_pairs, e2m1_words, load_words, pair_amax,
                                            source_rows, store_bytes, unpack_words, words_amax)


@triton.jit
def nvfp4_quantize_kernel(words_ptr, rows_ptr, global_scale_ptr, out_ptr, scales_ptr,
                          num_rows, num_src_rows, hidden, stride_row,
                          padded_rows, padded_blocks, partial_ptr, num_partials,
                          HAS_ROWS: tl.constexpr, IN_KIND: tl.constexpr,
                          LAYOUT: tl.constexpr, FAST_MATH: tl.constexpr,
                          WORD_ASM: tl.constexpr, STORE_ASM: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr, STEPS: tl.constexpr,
                          PREFETCH: tl.constexpr, STORE_POLICY: tl.constexpr,
                          SCALE_FROM_PARTIALS: tl.constexpr, PARTIAL_BLOCK: tl.constexpr,
                          X_READY: tl.constexpr, PDL: tl.constexpr):
    """A program quantizes BLOCK_ROWS rows over STEPS consecutive tiles of BLOCKS scale blocks
    (unrolled), loading the tile PREFETCH (1, 2 or 3) steps ahead before working on the
    current one, so a thread has loads in flight while it computes. STORE_ASM: the block
    scales are stored by inline PTX (``store_bytes``; with WORD_ASM only).
    SCALE_FROM_PARTIALS: the global scale is computed from the amax pass's partials
    (``global_scale_of``) and program (0, 0) writes it to ``global_scale_ptr``; else it is
    read from there. X_READY: the kernel before this one on the stream did not write x (it
    is the op's own global-scale pass, which only read it): the first tiles' loads are issued
    before the wait for that kernel, which comes before the global scale is read."""
    if not X_READY:
        grid_dependency_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    block_start = tl.program_id(1) * (BLOCKS * STEPS)
    num_blocks = hidden // 16
    src, row_ok = source_rows(rows_ptr, rows, num_rows, num_src_rows, HAS_ROWS)
    in_ptrs = words_ptr + src * stride_row
    out_ptrs = out_ptr + rows.to(tl.int64) * (hidden // 2)
    scale_ptrs = scales_ptr + scale_row_offsets(rows, padded_blocks, LAYOUT)
    # A block of 16 elements is 8 words, read as two halves of 4 (``load_halves``).
    # cur: this step's tile; ahead / ahead2: the next two (PREFETCH 2 / 3); new: the tile
    # PREFETCH steps ahead, loaded before this step's work
    cur = load_halves(in_ptrs, row_ok, block_start, num_blocks, BLOCKS)
    if PREFETCH > 1 and STEPS > 1:
        ahead = load_halves(in_ptrs, row_ok, block_start + BLOCKS, num_blocks, BLOCKS)
    if PREFETCH > 2 and STEPS > 2:
        ahead2 = load_halves(in_ptrs, row_ok, block_start + 2 * BLOCKS, num_blocks, BLOCKS)
    if X_READY:
        grid_dependency_prologue(PDL)
    # (after the first tiles' loads are issued: the scale's own loads overlap them)
    if SCALE_FROM_PARTIALS:
        # The global scale's finish in every program (num_partials floats from L2, the
        # global-scale op's amax pass): one launch fewer than the finish kernel then this one.
        global_scale = global_scale_of(partial_ptr, num_partials, PARTIAL_BLOCK)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(global_scale_ptr, global_scale)
    else:
        global_scale = tl.load(global_scale_ptr)
    for step in tl.static_range(STEPS):  # unrolled: no loop-carried register moves
        if step + PREFETCH < STEPS:  # the tile PREFETCH steps ahead, in flight meanwhile
            new = load_halves(in_ptrs, row_ok, block_start + (step + PREFETCH) * BLOCKS,
                              num_blocks, BLOCKS)
        quantize_tile(cur[0], cur[1], global_scale, out_ptrs, scale_ptrs, rows,
                      block_start + step * BLOCKS, num_rows, num_blocks, padded_rows,
                      padded_blocks, IN_KIND, LAYOUT, FAST_MATH, WORD_ASM, STORE_ASM,
                      BLOCK_ROWS, BLOCKS, STORE_POLICY)
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
def load_halves(in_ptrs, row_ok, block_start, num_blocks, BLOCKS: tl.constexpr):
    """(words of half 0, words of half 1) of NVFP4 blocks [block_start, +BLOCKS)
    (``load_words``)."""
    return (load_words(in_ptrs, row_ok, block_start, num_blocks, 0, BLOCKS, 8, 4)[0],
            load_words(in_ptrs, row_ok, block_start, num_blocks, 4, BLOCKS, 8, 4)[0])


@triton.jit
def nvfp4_tile(w0, w1, global_scale, out_ptrs, scale_ptrs, rows,
               block_start, num_rows, num_blocks, padded_rows, padded_blocks,
               IN_KIND: tl.constexpr, LAYOUT: tl.constexpr, FAST_MATH: tl.constexpr,
               WORD_ASM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr,
               STORE_POLICY: tl.constexpr):
    """``quantize_tile`` with the scale store following WORD_ASM (the Triton transport's
    quantizing send)."""
    quantize_tile(w0, w1, global_scale, out_ptrs, scale_ptrs, rows, block_start, num_rows,
                  num_blocks, padded_rows, padded_blocks, IN_KIND, LAYOUT, FAST_MATH, WORD_ASM,
                  WORD_ASM, BLOCK_ROWS, BLOCKS, STORE_POLICY)


@triton.jit
def quantize_tile(w0, w1, global_scale, out_ptrs, scale_ptrs, rows,
                  block_start, num_rows, num_blocks, padded_rows, padded_blocks,
                  IN_KIND: tl.constexpr, LAYOUT: tl.constexpr, FAST_MATH: tl.constexpr,
                  WORD_ASM: tl.constexpr, STORE_ASM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  BLOCKS: tl.constexpr, STORE_POLICY: tl.constexpr):
    """One tile: the words (``load_words``, halves 0 and 1 of each block) -> packed codes
    at ``out_ptrs`` (the rows' starts, stored with L2 eviction priority STORE_POLICY) and
    block scales at ``scale_ptrs`` (the rows' parts of the scale offsets in LAYOUT), by inline
    PTX when STORE_ASM (``store_bytes``: no trip through shared memory; a non-pure asm, which
    Inductor's mutation analysis cannot follow), else by ``tl.store``."""
    if WORD_ASM:  # bf16/fp16, IEEE recipe, on a GPU: the word-level inline PTX
        amax = words_amax(w0, w1, IN_KIND)  # [BLOCK_ROWS, BLOCKS]
    else:
        lo0, hi0 = unpack_words(w0, IN_KIND)
        lo1, hi1 = unpack_words(w1, IN_KIND)
        amax = max_nan(pair_amax(lo0, hi0), pair_amax(lo1, hi1))
    if FAST_MATH:  # FlashInfer's default: sf = e4m3(gs * (a * rcp(6))), 1 / x = rcp(x)
        # rcp.approx(6) == f32(1/6) (test_gpu_rcp_approx_constants_equal_ieee), so the
        # constant stands in for it; only the association differs from the IEEE recipe.
        sf_value = global_scale * (amax * INV6)
    else:  # IEEE: sf = e4m3(a * (gs * f32(1/6)))
        sf_value = amax * (global_scale * INV6)
    # The scale is rounded in software: Triton 3.6's hardware fp32 -> e4m3 cast on this
    # block-reduced (sliced-layout) tensor gave wrong codes for fp32 input on H200.
    sf, sf_float = e4m3_round(sf_value)
    if FAST_MATH:
        # rcp.approx through inline PTX on an element-shaped tensor: on the block-shaped
        # (sliced-layout) tensor the same asm gave run-to-run different results on H200.
        shape: tl.constexpr = (BLOCK_ROWS, BLOCKS, 4)
        sf_elements = tl.broadcast_to(sf_float[:, :, None], shape)
        gs_elements = tl.full(shape, 1.0, tl.float32) * global_scale
        out_scale = rcp_approx(sf_elements * rcp_approx(gs_elements))
        out_scale = tl.where(amax[:, :, None] == 0, 0.0, out_scale)
    else:
        decode = tl.math.div_rn(1.0, global_scale)
        # A zero block's scale is replaced by 0 below; dividing by 1 there instead of by its
        # zero scale keeps the interpreter from warning about a division by zero.
        denominator = tl.where(amax == 0, 1.0, sf_float * decode)
        out_scale = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32),
                                              denominator),
                               FLT_MAX_C, propagate_nan=tl.PropagateNan.ALL)
        out_scale = tl.where(amax == 0, 0.0, out_scale)[:, :, None]
    # Byte i of a packed row holds elements 2i (low nibble) and 2i + 1: word i of x.
    if WORD_ASM:
        shape: tl.constexpr = (BLOCK_ROWS, BLOCKS, 4)
        signed = (out_scale == out_scale)  # the product by a NaN scale has no sign
        sign_lo = tl.broadcast_to(tl.where(signed, 0x08080808, 0), shape)
        sign_hi = tl.broadcast_to(tl.where(signed, -2139062144, 0), shape)  # 0x80808080
        scale = tl.broadcast_to(out_scale, shape)
        pairs0 = e2m1_words(w0, scale, sign_lo, sign_hi, IN_KIND)
        pairs1 = e2m1_words(w1, scale, sign_lo, sign_hi, IN_KIND)
    else:
        pairs0 = e2m1_pairs(lo0, hi0, out_scale)
        pairs1 = e2m1_pairs(lo1, hi1, out_scale)
    blocks = block_start + tl.arange(0, BLOCKS)
    in_tile = (rows < num_rows)[:, None, None] & (blocks < num_blocks)[None, :, None]
    # the block's 8 packed bytes as one 8-byte store: [R, B, 4] x 2 -> [R, B, 8] in registers
    packed = tl.reshape(tl.permute(tl.join(pairs0, pairs1), (0, 1, 3, 2)),
                        (BLOCK_ROWS, BLOCKS, 8))
    tl.store(out_ptrs[:, None, None] + (blocks * 8)[None, :, None]
             + tl.arange(0, 8)[None, None, :], packed, mask=in_tile, eviction_policy=STORE_POLICY)
    # Scales: rows up to the padded row count, blocks up to the padded block count; the
    # padding (rows >= num_rows or blocks past H/16) stores 0 (its masked zeros times a
    # global scale that is not a positive number would give -0 or NaN codes).
    sf = tl.where((rows < num_rows)[:, None] & (blocks < num_blocks)[None, :], sf, 0)
    sf_mask = (rows < padded_rows)[:, None] & (blocks < padded_blocks)[None, :]
    store_bytes(scale_ptrs[:, None] + scale_block_offsets(blocks, LAYOUT)[None, :], sf,
                sf_mask, STORE_ASM)
