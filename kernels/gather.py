"""The row movers around the local expert compute, in Triton, with the signatures of their
oracles in ``kernels.reference.permute``:

``gather_rows``           rows of x (any dtype, e.g. bf16 or packed NVFP4) into the permuted
                          order of a :class:`Permutation` (``kernels.permute``);
``unpermute_and_reduce``  the weighted sum over each token's k slots, back in token order.

Both are deterministic: no atomics, fixed summation order.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels import library, reference
from kernels.casting import round_to
from kernels.hardware import (can_run_ptx, grid_dependency, grid_dependency_prologue,
                              l2_cache_bytes)
from kernels.sizes import cdiv, next_power_of_2
from kernels.spec.permute import (check_gather_inputs, check_gather_values,
                                  check_inverse_values, check_unpermute_inputs,
                                  check_unpermute_tensors)
from kernels.types import UNUSED, Permutation

# UNUSED as a Triton constexpr: a kernel can read only constexpr globals.
UNUSED_ENTRY = tl.constexpr(UNUSED)


# =============================================================================================
# gather_rows: a row gather, moved as 4-byte words
# =============================================================================================

@triton.jit
def _gather_rows_kernel(table_ptr, out_ptr, table2_ptr, out2_ptr, rows_ptr, num_out_rows,
                        num_sources, top_k, row_words, row_words2, col_blocks,
                        TWO_TABLES: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        BLOCK_WORDS: tl.constexpr, PDL: tl.constexpr):
    """``out[p, :] = table[rows[p] // top_k, :]`` for a [BLOCK_ROWS, BLOCK_WORDS] tile; a row
    whose source is UNUSED (or outside [0, num_sources)) is written as zeros. TWO_TABLES:
    column blocks ``>= col_blocks`` gather a second table of the same rows and word type
    (``table2`` into ``out2``, ``row_words2`` words a row), the NVFP4 codes and their scales
    in one launch; else ``table2`` / ``out2`` are never touched (a constexpr branch: Inductor's
    analysis of the stores then does not count ``out2``, which may be ``out`` itself)."""
    grid_dependency_prologue(PDL)
    col_block = tl.program_id(1)
    table, out, width = table_ptr, out_ptr, row_words
    if TWO_TABLES:
        if col_block >= col_blocks:
            table, out, width = table2_ptr, out2_ptr, row_words2
            col_block -= col_blocks
    out_rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    words = col_block * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    row_ok = out_rows < num_out_rows
    word_ok = words < width
    sources = tl.load(rows_ptr + out_rows, mask=row_ok, other=UNUSED_ENTRY)
    source_ok = row_ok & (sources >= 0) & (sources < num_sources)
    tokens = tl.where(source_ok, sources // top_k, 0).to(tl.int64)
    values = tl.load(table + tokens[:, None] * width + words[None, :],
                     mask=source_ok[:, None] & word_ok[None, :], other=0)
    tl.store(out + out_rows.to(tl.int64)[:, None] * width + words[None, :], values,
             mask=row_ok[:, None] & word_ok[None, :])


# Words per program tile: 4096 words = 16 KiB in flight per program (32 words, eight 16-byte
# vectors, per thread at 4 warps); a tile is at most GATHER_TILE_WORDS_PER_ROW wide so that a
# 7168-wide bf16 row (3584 words) splits into 7 full column blocks.
GATHER_TILE_WORDS = 4096
GATHER_TILE_WORDS_PER_ROW = 512


def word_dtype(t: torch.Tensor) -> torch.dtype:
    """The widest of int32/int16/uint8 that divides both the row size and the offset of the
    contiguous 2-D tensor ``t`` in bytes (4-byte words give 16-byte vectors of 4)."""
    row_bytes = t.shape[1] * t.element_size()
    offset_bytes = t.storage_offset() * t.element_size()
    for word in (torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0 and offset_bytes % word.itemsize == 0:
            return word
    return torch.uint8


def as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """The contiguous 2-D ``t`` viewed as [rows, row bytes / word size] ``word``s."""
    row_words = t.shape[1] * t.element_size() // word.itemsize
    # flat first: a contiguous tensor with a size-1 dim may carry any stride there
    return t.reshape(-1).view(torch.uint8).view(word).reshape(t.shape[0], row_words)


def _launch_gather(tables: list[torch.Tensor], rows: torch.Tensor, top_k: int,
                   traced: bool) -> list[torch.Tensor]:
    """The gather of the rows ``rows`` of each contiguous table of ``tables`` (one or two,
    checked arguments), one launch: two tables of one word type share it (the second's
    column blocks after the first's, on the first's tile), else each has its own. ``traced``:
    launch through ``wrap_triton`` (the op's body), else the kernel itself (the eager path)."""
    outs = [torch.empty((rows.numel(), t.shape[1]), dtype=t.dtype, device=t.device)
            for t in tables]
    if rows.numel() == 0 or not any(o.numel() for o in outs):
        return outs
    words = [word_dtype(t) for t in tables]
    if len(tables) == 2 and words[0] != words[1]:
        return [_launch_gather([t], rows, top_k, traced)[0] for t in tables]
    table_words = [as_words(t, words[0]) for t in tables]
    out_words = [o.view(torch.uint8).view(words[0]) for o in outs]
    widths = [int(t.shape[1]) for t in table_words]  # static: a traced width is specialised
    # the tile from the first row width (static), the grid from the row count
    block_words = min(GATHER_TILE_WORDS_PER_ROW, next_power_of_2(max(widths[0], 1)))
    block_rows = GATHER_TILE_WORDS // block_words
    col_blocks = [cdiv(width, block_words) for width in widths]
    grid = (cdiv(rows.numel(), block_rows), sum(col_blocks))
    second = 1 if len(tables) == 2 else 0
    kernel = wrap_triton(_gather_rows_kernel) if traced else _gather_rows_kernel
    kernel[grid](table_words[0], out_words[0], table_words[second], out_words[second], rows,
                 rows.numel(), tables[0].shape[0] * top_k, top_k, widths[0], widths[second],
                 col_blocks[0], TWO_TABLES=second == 1, BLOCK_ROWS=block_rows,
                 BLOCK_WORDS=block_words, num_warps=4, **grid_dependency(rows.device, traced))
    return outs


def _launch_gather_rows(x: torch.Tensor, rows: torch.Tensor, scales: Optional[torch.Tensor],
                        top_k: int, traced: bool) -> list[torch.Tensor]:
    """[out] or [out, out_scales] on checked arguments (copied to contiguous tensors here)."""
    tables = [x.contiguous()] + ([] if scales is None else [scales.contiguous()])
    return _launch_gather(tables, rows.contiguous(), top_k, traced)


def _gather_rows_face(traced: bool):
    def gather_rows_op(x: torch.Tensor, rows: torch.Tensor, scales: Optional[torch.Tensor],
                       top_k: int) -> list[torch.Tensor]:
        """``moe_a2a::gather_rows``: rows [P] int32 (a tensor, not a Permutation) -> [out]
        or [out, out_scales] (a list: an op cannot return an optional tensor)."""
        check_gather_inputs(x, rows, scales, top_k)
        return _launch_gather_rows(x, rows, scales, top_k, traced)
    return gather_rows_op


def _gather_rows_torch(x: torch.Tensor, rows: torch.Tensor, scales: Optional[torch.Tensor],
                       top_k: int) -> list[torch.Tensor]:
    out = reference.gather_rows(x, rows, scales=scales, top_k=top_k, check_values=False)
    return [out] if scales is None else list(out)


def _gather_rows_fake(x, rows, scales, top_k):
    outs = [x.new_empty((rows.shape[0], x.shape[1]))]
    if scales is not None:
        outs.append(scales.new_empty((rows.shape[0], scales.shape[1])))
    return outs


GATHER_ROWS = library.register("gather_rows", triton=_gather_rows_face(True),
                               launch=_gather_rows_face(False), torch_face=_gather_rows_torch,
                               fake=_gather_rows_fake)
library.register_value_check("gather_rows", check_gather_values)


def gather_rows(x: torch.Tensor, rows: Union[torch.Tensor, Permutation], *,
                scales: Optional[torch.Tensor] = None, top_k: Optional[int] = None,
                check_values: bool = True
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Copy the rows of ``x`` into permuted order: ``out[p] = x[rows[p] // top_k]``; equal, byte
    for byte, to ``kernels.reference.gather_rows`` (same arguments, same errors).

    Pass the :class:`Permutation` itself as ``rows`` to gather token rows into expert-major
    order (its ``source_rows`` and ``top_k`` are used); or a tensor of rows with ``top_k``
    (default 1: ``rows`` are token ids).

    Arguments:
        x: [T, W] any dtype and strides (bf16/fp16/fp32 rows, packed NVFP4 uint8 [T, H/2],
            ...); a non-contiguous x is copied to a contiguous tensor first.
        rows: a Permutation, or [P] int32 (any strides), the source of each output row:
            ``UNUSED`` (-1) gives a zero row, otherwise ``[0, T*top_k)``.
        scales: optional [T, Ws] (e.g. NVFP4 scales uint8 [T, H/16], linear layout), gathered
            with the same rows.
        top_k: how many consecutive ``rows`` values map to one row of ``x``; with a
            Permutation leave it out (or pass the permutation's).
        check_values: True: read the range of ``rows`` (one host sync) and raise ValueError
            for an entry neither UNUSED nor in ``[0, T*top_k)``. False: no sync (CUDA graphs);
            such an entry gives a zero row, as on every face.

    Returns:
        out: [P, W] in ``x``'s dtype; or ``(out, out_scales [P, Ws])`` when ``scales`` is given.
    """
    rows, top_k = check_gather_inputs(x, rows, scales, top_k)
    if check_values:
        library.run_value_check("gather_rows", [rows], [x.shape[0], top_k])
    if library.eager_bypass(x, rows, scales):
        outs = _launch_gather_rows(x, rows, scales, top_k, traced=False)
    else:
        outs = GATHER_ROWS.triton(x, rows, scales, top_k)
    return outs[0] if scales is None else (outs[0], outs[1])


# =============================================================================================
# unpermute_and_reduce: weighted sum over each token's k slots
# =============================================================================================

@triton.jit
def _mul_rn(a, b):
    """a * b rounded once to nearest even (``mul.rn.f32``: PTX never contracts an operation
    with an explicit rounding mode into an FMA); GPU only."""
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _add_rn(a, b):
    """a + b rounded once to nearest even (``add.rn.f32``, never contracted); GPU only."""
    return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _unpermute_and_reduce_kernel(expert_out_ptr, inverse_ptr, weights_ptr, out_ptr, num_tokens,
                                 num_rows, hidden, weight_stride_token, weight_stride_slot,
                                 TOP_K: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                                 BLOCK_COLS: tl.constexpr, RN_ASM: tl.constexpr,
                                 LOAD_POLICY: tl.constexpr, PDL: tl.constexpr):
    """``out[t] = sum_j w[t, j] * expert_out[inverse[t*k + j]]`` over the owned slots, j in
    fixed order 0..k-1, float32 accumulation: each slot is one rounded multiply and one
    rounded add, exactly as the oracle computes. RN_ASM (a GPU): the multiply and the add are
    ``mul.rn`` / ``add.rn`` inline PTX, which no compiler fuses into an FMA, so the bits hold
    also where the launch option ``enable_fp_fusion=False`` is not passed on (Inductor compiles
    a registered op's kernels with its own launch options); else (the interpreter) plain
    ``*`` and ``+``, launched with fp fusion off. LOAD_POLICY: the L2 eviction policy of the
    loads of ``expert_out`` ("" or "evict_first", :func:`unpermute_load_policy`; the same
    bits either way). The next kernel launches as the programs exit, not beside them
    (``kernels.hardware``, "Programmatic dependent launch")."""
    grid_dependency_prologue(PDL, LAUNCH_NEXT=False)
    tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    token_ok = tokens < num_tokens
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_TOKENS, BLOCK_COLS], tl.float32)
    for slot in tl.static_range(TOP_K):
        rows = tl.load(inverse_ptr + tokens * TOP_K + slot, mask=token_ok, other=UNUSED_ENTRY)
        owned = token_ok & (rows >= 0) & (rows < num_rows)
        weight = tl.load(weights_ptr + tokens * weight_stride_token + slot * weight_stride_slot,
                         mask=owned, other=0).to(tl.float32)
        values = tl.load(expert_out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
                         mask=owned[:, None] & col_ok[None, :], other=0,
                         eviction_policy=LOAD_POLICY).to(tl.float32)
        if RN_ASM:
            weights = tl.broadcast_to(weight[:, None], [BLOCK_TOKENS, BLOCK_COLS])
            total = _add_rn(acc, _mul_rn(weights, values))
        else:
            total = acc + weight[:, None] * values
        acc = tl.where(owned[:, None], total, acc)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :],
             round_to(acc, out_ptr.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


# Tile [tokens, columns] of UNPERMUTE_TILE elements, at most UNPERMUTE_BLOCK_COLS wide: 512
# columns = 4 bf16 per thread per row at 4 warps; the k slot loads are unrolled, so 2 tokens x
# k=8 slots keep 16 KiB of bf16 rows in flight per program, with 8 fp32 accumulators per
# thread. Narrower rows take more tokens per program. The smaller tile (2048 elements, 1024
# wide, before) gives a decode batch's few tokens four times the programs; a GPU A/B of the
# two at T = 1 to 8192 (H=7168, k=8) found it as fast or faster at every T.
UNPERMUTE_TILE = 1024
UNPERMUTE_BLOCK_COLS = 512

# The un-permute is the last reader of the experts' output: rows of more than
# EVICT_FIRST_MIN_L2S and at most EVICT_FIRST_MAX_L2S times the L2 are loaded evict-first
# (unpermute_load_policy).
EVICT_FIRST_MIN_L2S, EVICT_FIRST_MAX_L2S = 0.5, 4


def unpermute_load_policy(expert_bytes, l2_bytes: int) -> str:
    """The L2 eviction policy of the un-permute's loads of ``expert_bytes`` bytes of expert
    output on a device of ``l2_bytes`` of L2 (0: none to choose, as under the interpreter):
    "evict_first" for more than :data:`EVICT_FIRST_MIN_L2S` and at most
    :data:`EVICT_FIRST_MAX_L2S` times the L2, else the default ("").

    Why: nothing reads the experts' output after the un-permute. Kept at the default priority,
    rows of more than half the L2 push out most of what the next kernels would find there (a
    decode step at T=256, E=256, k=8, H=7168 reads 29 MB of them, with the gathered rows still
    to be written back); evict-first, they are the first lines to go. A smaller output
    displaces less, and there the default policy keeps what the bench's stand-in for the
    GEMMs' output, one buffer read at every replay, finds again in L2 at the next. An output of
    several times the L2 replaces all of it either way: there evict-first loads did not help
    the chain and slowed the un-permute alone (docs/design.md). The same bits either way. A
    symbolic size (a trace with dynamic shapes) takes the default."""
    if l2_bytes <= 0 or isinstance(expert_bytes, torch.SymInt):
        return ""
    if EVICT_FIRST_MIN_L2S * l2_bytes < expert_bytes <= EVICT_FIRST_MAX_L2S * l2_bytes:
        return "evict_first"
    return ""


def _launch_unpermute(expert_out: torch.Tensor, inverse: torch.Tensor,
                      topk_weights: torch.Tensor, traced: bool,
                      load_policy: Optional[str] = None) -> torch.Tensor:
    """The launch on checked tensors (``expert_out`` and ``inverse`` copied to contiguous
    tensors here); ``traced`` as in :func:`_launch_gather`; ``load_policy``: None for
    :func:`unpermute_load_policy`'s (tests pass one to run the other on any device)."""
    num_tokens, top_k = topk_weights.shape
    hidden = int(expert_out.shape[1])  # static: a traced H is specialised
    out = torch.empty((num_tokens, hidden), dtype=expert_out.dtype, device=expert_out.device)
    if out.numel() == 0:
        return out
    expert_out = expert_out.contiguous()
    if load_policy is None:
        load_policy = unpermute_load_policy(expert_out.numel() * expert_out.element_size(),
                                            l2_cache_bytes(expert_out.device))
    block_cols = min(UNPERMUTE_BLOCK_COLS, next_power_of_2(hidden))
    block_tokens = UNPERMUTE_TILE // block_cols
    grid = (cdiv(num_tokens, block_tokens), cdiv(hidden, block_cols))
    kernel = wrap_triton(_unpermute_and_reduce_kernel) if traced else _unpermute_and_reduce_kernel
    kernel[grid](expert_out, inverse.contiguous(), topk_weights, out, num_tokens,
                 expert_out.shape[0], hidden, topk_weights.stride(0), topk_weights.stride(1),
                 TOP_K=top_k, BLOCK_TOKENS=block_tokens, BLOCK_COLS=block_cols,
                 RN_ASM=can_run_ptx(expert_out.device), LOAD_POLICY=load_policy, num_warps=4,
                 enable_fp_fusion=False,
                 **grid_dependency(expert_out.device, traced))
    return out


def _unpermute_face(traced: bool):
    def unpermute_and_reduce_op(expert_out: torch.Tensor, inverse: torch.Tensor,
                                topk_weights: torch.Tensor) -> torch.Tensor:
        """``moe_a2a::unpermute_and_reduce``: the permutation's ``inverse`` [T*k] int32 (P is
        ``expert_out.shape[0]``) -> out [T, H]."""
        check_unpermute_tensors(expert_out, inverse, topk_weights)
        return _launch_unpermute(expert_out, inverse, topk_weights, traced)
    return unpermute_and_reduce_op


def _unpermute_torch(expert_out: torch.Tensor, inverse: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
    check_unpermute_tensors(expert_out, inverse, topk_weights)
    return reference.reduce_slots(expert_out, inverse, topk_weights)


def _unpermute_fake(expert_out, inverse, topk_weights):
    return expert_out.new_empty((topk_weights.shape[0], expert_out.shape[1]))


UNPERMUTE_AND_REDUCE = library.register(
    "unpermute_and_reduce", triton=_unpermute_face(True), launch=_unpermute_face(False),
    torch_face=_unpermute_torch, fake=_unpermute_fake)
library.register_value_check("unpermute_and_reduce", check_inverse_values)


def unpermute_and_reduce(expert_out: torch.Tensor, permutation: Permutation,
                         topk_weights: torch.Tensor, *,
                         check_values: bool = True) -> torch.Tensor:
    """Weighted sum of each token's permuted rows, back in token order; bit-identical to
    ``kernels.reference.unpermute_and_reduce`` (same float32 operations in the same order, the
    same rounding and canonical NaN, the same errors).

    Arguments:
        expert_out: [P, H] bf16/fp16/fp32, any strides (copied to a contiguous tensor when
            not contiguous), one row per permuted row.
        permutation: the :class:`Permutation` the rows were gathered with.
        topk_weights: [T, k] fp32 (bf16/fp16 accepted), any strides, the routing weight of
            each slot.
        check_values: True: read the range of ``permutation.inverse`` (one host sync) and
            raise ValueError for an entry neither UNUSED nor in ``[0, P)``. False: no sync
            (CUDA graphs); such a slot counts as not owned, as on every face.

    Returns:
        out: [T, H] in ``expert_out``'s dtype; a token with no owned slot gives a zero row.
    """
    check_unpermute_inputs(expert_out, permutation, topk_weights)
    if check_values:
        library.run_value_check("unpermute_and_reduce", [permutation.inverse],
                                [permutation.source_rows.numel()])
    inverse = permutation.inverse
    if library.eager_bypass(expert_out, inverse, topk_weights):
        return _launch_unpermute(expert_out, inverse, topk_weights, traced=False)
    return UNPERMUTE_AND_REDUCE.triton(expert_out, inverse, topk_weights)
