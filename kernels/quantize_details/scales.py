"""The NVFP4 global scale (a persistent amax pass and a one-program finish) and the scale layout
kernel (swizzle / unswizzle), ``@triton.jit``; the launchers are in ``kernels.quantize``."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.casting import round_to
from kernels.hardware import grid_dependency_prologue
from kernels.quantize_details.formats import (GLOBAL_NUMERATOR, max_nan, scale_offsets)
from kernels.quantize_details.words import load_tile


@triton.jit
def amax_partial_kernel(x_ptr, partial_ptr, num_rows, hidden, stride_row, stride_col,
                        tiles_per_program, BLOCK_ROWS: tl.constexpr, COLS: tl.constexpr,
                        OVERLAP_PREVIOUS: tl.constexpr, PDL: tl.constexpr):
    """Pass 1 of the global scale: program p folds |x| over tiles p, p + P, p + 2P, ... (P = the
    grid) into a register tile and writes its max to partial[p]. No atomics, no zeroed
    workspace, so no fill launches; max is order-independent (deterministic) and propagates
    NaN as torch.amax does. A tile index past the last tile starts past the last row, so its
    load is fully masked. OVERLAP_PREVIOUS: x is read while the kernel before it may still
    run, and the wait comes before the one store (``AmaxLaunch.overlap_previous``)."""
    if not OVERLAP_PREVIOUS:
        grid_dependency_prologue(PDL)
    col_tiles = tl.cdiv(hidden, COLS)
    acc = tl.zeros((BLOCK_ROWS, COLS), tl.float32)
    step = 0
    while step < tiles_per_program:  # (a while loop: the interpreter cannot range() over an arg)
        tile = tl.program_id(0) + step * tl.num_programs(0)
        x = load_tile(x_ptr, (tile // col_tiles) * BLOCK_ROWS, (tile % col_tiles) * COLS,
                      num_rows, hidden, stride_row, stride_col, BLOCK_ROWS, COLS)
        acc = max_nan(acc, tl.abs(x))
        step += 1
    if OVERLAP_PREVIOUS:
        grid_dependency_prologue(PDL)
    tl.store(partial_ptr + tl.program_id(0), tl.reduce(tl.reduce(acc, 1, max_nan), 0, max_nan))


@triton.jit
def global_scale_finish_kernel(partial_ptr, out_ptr, num_partials, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
    """Pass 2 (one program): out = :func:`global_scale_of` the partials."""
    grid_dependency_prologue(PDL)
    tl.store(out_ptr, global_scale_of(partial_ptr, num_partials, BLOCK))


@triton.jit
def global_scale_of(partial_ptr, num_partials, BLOCK: tl.constexpr):
    """amax = max(partial[:num_partials]), read BLOCK at a time; returns 448 * 6 / amax with
    an IEEE division, 1.0 when amax == 0 (or num_partials == 0), a NaN as the canonical one
    (``round_to``). The finish kernel stores it; the fused quantize
    (``nvfp4_quantize_kernel`` with SCALE_FROM_PARTIALS) computes it in every program."""
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    start = 0
    while start < num_partials:
        acc = max_nan(acc, tl.load(partial_ptr + start + offsets,
                                   mask=start + offsets < num_partials, other=0.0))
        start += BLOCK
    amax = tl.reduce(acc, 0, max_nan)
    # amax == 0 gives 1.0 below; dividing by 1 there avoids a division by zero.
    scale = tl.math.div_rn(tl.full((), GLOBAL_NUMERATOR, tl.float32),
                           tl.where(amax == 0, 1.0, amax))
    return round_to(tl.where(amax == 0, 1.0, scale), tl.float32)


@triton.jit
def scale_layout_kernel(src_ptr, dst_ptr, num_rows, num_blocks, padded_blocks,
                        cover_rows, cover_blocks, LAYOUT: tl.constexpr,
                        SWIZZLE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """SWIZZLE: linear [num_rows, num_blocks] -> layout (padding written as 0); else the
    inverse. cover_rows/cover_blocks: the index range the grid covers."""
    grid_dependency_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    inside = (rows < num_rows)[:, None] & (blocks < num_blocks)[None, :]
    covered = (rows < cover_rows)[:, None] & (blocks < cover_blocks)[None, :]
    linear = rows.to(tl.int64)[:, None] * num_blocks + blocks[None, :]
    swizzled = scale_offsets(rows, blocks, padded_blocks, LAYOUT)
    if SWIZZLE:
        values = tl.load(src_ptr + linear, mask=inside, other=0)
        tl.store(dst_ptr + swizzled, values, mask=covered)
    else:
        tl.store(dst_ptr + linear, tl.load(src_ptr + swizzled, mask=inside), mask=inside)
