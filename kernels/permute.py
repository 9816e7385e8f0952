"""``permute_by_expert`` in Triton: (token, slot) pairs -> expert-major order
(:class:`Permutation`), a stable, atomic-free counting sort, with the signature of its oracle in
``kernels.reference.permute``. The rows move with ``kernels.gather``.

Two forms, chosen by a fixed rule from T*k and E_local (:class:`PermuteLaunch`):

- one launch for small batches (decode): every program reads all the ids (T*k int32, a few KB
  from L2), counts and scans them itself, places a slice of the pairs and writes its share of
  the UNUSED padding. Its time is one program's chain, not three launches.
- three launches for large batches (count, scan, place), whose work spreads over the blocks.

Determinism: no pass depends on the order of atomics; the same input gives bit-identical
output on every run (tl.histogram adds integers in shared memory, whose sum does not depend on
their order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels import library, reference
from kernels.hardware import grid_dependency, grid_dependency_prologue
from kernels.sizes import cdiv, next_power_of_2
from kernels.gather import _launch_gather, as_words, word_dtype
from kernels.spec.launch import checked_launch
from kernels.spec.permute import (check_permute_and_gather_inputs, check_permute_inputs,
                                  permutation_capacity)
from kernels.spec.tensors import check_expert_ids
from kernels.spec.values import read_to_host
from kernels.types import UNUSED, Permutation

# UNUSED as a Triton constexpr: a kernel can read only constexpr globals.
UNUSED_ENTRY = tl.constexpr(UNUSED)

# How pass 3 of the three-pass form ranks a pair among its block's earlier pairs of its expert
# (the ``RANK`` constexpr):
RANK_COMPARE = 0     # one compare of the block with itself ([BLOCK, BLOCK])
RANK_ONEHOT = 1      # the column cumsum of a [BLOCK, EXPERT_CHUNK] one-hot tile, chunk by chunk

# tl.histogram keeps at least one bin per lane of a warp.
MIN_HISTOGRAM_BINS = 32
# Elements of the one-launch form's [slice, all pairs] compare: 128 per thread at 8 warps. Past
# it a slice shrinks (to 8 pairs at least) and more programs share the pairs.
SINGLE_COMPARE_TILE = 2**15
# The one-launch form's wide programs (PermuteLaunch.single_wide_warps): from a chunk of this
# many ids, over at most this many histogram bins.
WIDE_CHUNK = 2048
WIDE_BINS = 256


FORMS = ("single", "three_pass")


@checked_launch(positive=("single_max_pairs", "single_programs", "single_fill"),
                powers_of_two=("single_chunk", "block_pairs", "scan_blocks", "expert_chunk"),
                warps=("single_warps", "single_wide_warps", "place_warps"),
                choices={"form": FORMS, "place_rank": (RANK_COMPARE, RANK_ONEHOT)})
class PermuteLaunch:
    """Launch rule of ``permute_by_expert`` (``python -m bench.tune`` times the alternatives and
    records them in bench/results/tune-*.json).

    The form: the one-launch form runs when ``T*k <= single_max_pairs * 512 / max(512, bins)``,
    bins = E_local rounded up to a power of two: every program of it counts all T*k ids into
    ``bins`` bins, whose cost per id grows with the bins. The branch point is where the tune run
    on an H200 saw the three-pass form win (between 2048 and 4096 pairs with align=128, E=256;
    the one-launch form still won at 2048 pairs with E=384). ``form`` forces one ("single",
    "three_pass"; None: the rule).

    One-launch form:
        single_programs: about this many programs place the pairs (one more counts them), in
            slices of a power of two >= 8 pairs; each compares its slice with all T*k ids, so
            about one program per SM of an H200 (132) spreads that work evenly.
        single_warps: warps per program below a chunk of 2048 ids (4: the best of 1, 4, 8
            and 16 in the tune run, at every size the form is chosen for).
        single_wide_warps: warps per program from a chunk of 2048 ids (T*k > 1024) over at
            most 256 bins: each program's [slice, chunk] compare doubles there, and 8 warps
            were faster than 4 on an H200 at T=256 with E=256 (k=8); over 512 bins (E=384) 4
            stayed faster in the tune run.
        single_fill: at most this many UNUSED entries of ``source_rows`` per program: more
            programs where the padding needs them (with align=128 and few tokens,
            ``P = T*k + E_local*127`` is mostly padding).
        single_chunk: the most ids read per step: every program reads all T*k ids in steps
            of ``min(single_chunk, T*k rounded up to a power of two)`` (at least 32 per warp,
            at most the form's most pairs rounded up), so a batch of fewer pairs reads them in
            one narrower step, and the tile depends on T only through that power of two (one
            compiled kernel per power of two up to single_chunk; a symbolic T, traced with
            dynamic shapes, reads single_chunk at a time: one kernel for every T). The slices
            are sized for the form's most pairs. The default, 2048, reads every batch of the
            form in one step: below 1024 pairs the power of two of T*k narrows it (in the tune
            run, tune-nvidia-h200-20261201T152121.json, E=256 k=8, those narrower steps were
            the fastest at every T up to 128), and at T = 256 one step of 2048 was faster
            than two of 1024 (an H200, E=256 k=8, the permutation alone).
    Three-pass form:
        block_pairs: pairs per block of passes 1 and 3 (T=8192, k=8 gives 512 blocks of 128;
            pass 3's [block, block] compare holds block**2 / 256 values per thread at 8 warps,
            which 256 pairs overflows into spills).
        scan_blocks, expert_chunk: pass 2's tile [scan_blocks, expert_chunk]: one program per
            chunk of experts (32 programs for E_local=256), down the blocks in steps of
            scan_blocks (one step at T=8192, k=8); 4 warps hold 4096 values without spilling,
            8192 not.
            expert_chunk is also the chunk of RANK_ONEHOT's tile.
        place_warps: warps per program of pass 3 (4: the best of 4 and 8 in the tune run).
        place_rank: ``RANK_COMPARE`` ([block, block] compare) or ``RANK_ONEHOT``.

    ``overlap_previous``: the caller's promise that the kernel launched just before this op on
    its stream wrote none of ``topk_ids`` (kernels/hardware.py, "Programmatic dependent
    launch"): with PDL, the first launch then reads the ids and computes while that kernel
    still runs, and waits for it only before its first store. A false promise gives a wrong
    permutation, not an error; no effect without PDL; the same bits either way.
    """

    form: Optional[str] = None
    single_max_pairs: int = 2048
    single_programs: int = 128
    single_warps: int = 4
    single_wide_warps: int = 8
    single_fill: int = 2048
    single_chunk: int = 2048
    block_pairs: int = 128
    scan_blocks: int = 512
    expert_chunk: int = 8
    place_warps: int = 4
    place_rank: int = RANK_COMPARE
    overlap_previous: bool = False

    def chooses_single(self, num_pairs: int, num_local_experts: int) -> bool:
        """Whether ``T*k = num_pairs`` pairs over ``num_local_experts`` run the one-launch form."""
        if self.form is not None:
            return self.form == "single"
        return num_pairs <= self.single_limit(num_local_experts)

    def single_limit(self, num_local_experts: int) -> int:
        """The most pairs the rule gives the one-launch form over ``num_local_experts``
        (``single_max_pairs * 512 / max(512, bins)``)."""
        return self.single_max_pairs * 512 // max(512, histogram_bins(num_local_experts))


DEFAULT_PERMUTE = PermuteLaunch()
# The three-pass form as it was before the one-launch form (one-hot ranks in pass 3, blocks of
# 256 pairs, pass 2 on [128, 32] tiles).
ONEHOT_PERMUTE = PermuteLaunch(form="three_pass", place_rank=RANK_ONEHOT, block_pairs=256,
                               scan_blocks=128, expert_chunk=32)


# GatherLaunch.warps: at most 16, the widest launch of the tests and the bench (the rule's
# programs take 8).
MAX_GATHER_WARPS = 16


def _check_gather_warps(launch) -> None:
    if launch.warps > MAX_GATHER_WARPS:
        raise ValueError(f"GatherLaunch.warps={launch.warps} must be at most {MAX_GATHER_WARPS}")


@checked_launch(positive=("programs",), powers_of_two=("slice_pairs",), warps=("warps",),
                extra=_check_gather_warps)
class GatherLaunch:
    """Launch of :func:`permute_and_gather`'s row copies in the one-launch form (the
    three-pass form's batches run :func:`permute_by_expert`, then ``kernels.gather``'s own
    launch).

    slice_pairs: pairs placed by each program, whose rows it then copies (a power of two);
        None: the rule, T*k / ``programs`` rounded up to a power of two, kept in [2, 16].
        Fewer pairs per program give the copies more programs; every program still reads all
        T*k ids (a few KB from L2) and compares its slice with them. On an H100 (the lent
        GPU), E=256 k=8 H=7168, the fused op alone over slices 2 to 16: 2 was the fastest at
        T=16 and 64 (bf16 and NVFP4 rows), 4 and 8 within 3% of each other at T=256 (bf16
        4, NVFP4 8), 16 the slowest everywhere; the rule gives 2, 2 and 8.
    programs: the rule's programs (about two per SM).
    warps: the least warps per program (the permutation's own rule may give more): 4 and 8
        were within a few % of each other in that run, 8 ahead at T=256.
    group_tokens: one load of a token's row serves all the slice's pairs of that token
        (:meth:`copies`: where the slices start at token boundaries or lie inside one
        token), stored once per pair; else a load per pair. With the rule's slices at E=256
        k=8 a program's pairs are one token's (T=256: slice 8) or a quarter of one (slice 2).
    Each copy step moves a [rows, ROW_TILE] tile (rows: the slice's tokens with
    ``group_tokens``, else its pairs), ROW_TILE the row's words rounded up to a power of two,
    at most ROW_WORDS_PER_THREAD words per thread.
    """

    slice_pairs: Optional[int] = None
    programs: int = 256
    warps: int = 8
    group_tokens: bool = True

    def slice_for(self, num_pairs) -> int:
        """The pairs per program for ``num_pairs`` = T*k (an int; a symbolic size while traced
        with dynamic shapes takes the largest slice, static)."""
        if self.slice_pairs is not None:
            return self.slice_pairs
        if isinstance(num_pairs, torch.SymInt):
            return MAX_GATHER_SLICE
        return max(MIN_GATHER_SLICE,
                   min(MAX_GATHER_SLICE, next_power_of_2(cdiv(num_pairs, self.programs))))

    def copies(self, slice_pairs: int, top_k: int) -> int:
        """Pairs of one token in a slice whose row one load serves (``COPIES``): min(slice, k)
        where the slices start at token boundaries or lie inside one token (one divides the
        other) and ``group_tokens``, else 1 (a load per pair)."""
        if self.group_tokens and (slice_pairs % top_k == 0 or top_k % slice_pairs == 0):
            return min(slice_pairs, top_k)
        return 1


DEFAULT_GATHER = GatherLaunch()
# The bounds of GatherLaunch's rule for the pairs per program.
MIN_GATHER_SLICE, MAX_GATHER_SLICE = 2, 16
# Words of a row tile per thread in permute_and_gather's copies (4-byte words: 128 bytes).
ROW_WORDS_PER_THREAD = 32


@dataclass(frozen=True)
class RowCopy:
    """The row tables of one :func:`permute_and_gather` launch (the launchers' argument):
    each table and its output as contiguous 2-D views of words, their widths in words."""

    tables: tuple
    outs: tuple
    widths: tuple
    launch: GatherLaunch

    def row_tile(self, tile_rows: int, warps: int) -> int:
        """Words of a row per copy step: the widest row rounded up to a power of two, at most
        ROW_WORDS_PER_THREAD words per thread over the tile's ``tile_rows`` rows."""
        most = max(1, ROW_WORDS_PER_THREAD * 32 * warps // tile_rows)
        return max(1, min(next_power_of_2(max(max(self.widths), 1)), most))


def histogram_bins(num_local_experts: int) -> int:
    """Bins of the expert histograms: E_local rounded up to a power of two, at least 32."""
    return max(MIN_HISTOGRAM_BINS, next_power_of_2(num_local_experts))


# =============================================================================================
# The one-launch form
# =============================================================================================
#
# Program 0 reads all T*k ids (CHUNK at a time), counts the owned pairs of each local expert
# (tl.histogram), scans the padded counts and stores expert_counts, expert_offsets and the id
# range. Program g >= 1 places the slice of pairs [(g-1)*SLICE, g*SLICE): with
# key(q) = e_q * T*k + q for an owned pair q of local expert e_q, the pairs before pair p in
# expert-major order are the owned q with key(q) < key(p), so
#     place(p) = #{owned q : key(q) < key(p)} + padding(e_p),
# one compare of the slice with each chunk of ids ([SLICE, CHUNK]), summed over the chunks.
# SLICE is static (from the launch config and the form's largest T*k) and CHUNK depends on T
# only through a power of two (PermuteLaunch.single_chunk). padding(e) is the alignment
# rows of the experts before e (0 with align = 1; else each such program also counts and scans
# the ids). Every program then writes UNUSED into rows that are no pair's place, so that no two
# programs write one entry: the padding [start(e) + count(e), start(e + 1)) of experts
# g*FILL_EXPERTS, ... (every G*FILL_EXPERTS-th stretch of experts), and every G-th TAIL_BLOCK of
# the unused tail [expert_offsets[-1], P).
#
# Example (the three-pass example below): counts [3, 1, 3], padded [4, 2, 4], starts [0, 4, 6],
# tail [10, 11). Pair 5 (expert 2): the owned pairs before it in expert-major order are the 3
# of expert 0, the 1 of expert 1 and pair 0 of expert 2, so 5, plus padding(2) = 1 + 1 = 2:
# place 7. Padding rows: 3 (expert 0), 5 (expert 1), 9 (expert 2) and the tail, 10.


@triton.jit
def _store_row_tile(out_ptr, values, places, owned, width, start, ROW_TILE: tl.constexpr,
                    COPIES: tl.constexpr):
    """``values`` (a [rows, ROW_TILE] tile of columns from ``start``) into the rows
    ``places[r, j]`` of ``out`` for every copy j with ``owned[r, j]`` ([rows, COPIES])."""
    cols = start + tl.arange(0, ROW_TILE)
    copy = tl.arange(0, COPIES)
    for j in tl.static_range(COPIES):
        place = tl.sum(tl.where(copy[None, :] == j, places, 0), axis=1).to(tl.int64)
        ok = tl.sum(tl.where((copy[None, :] == j) & owned, 1, 0), axis=1) > 0
        tl.store(out_ptr + place[:, None] * width + cols[None, :], values,
                 mask=ok[:, None] & (cols[None, :] < width))


@triton.jit
def _copy_rows(table_ptr, out_ptr, tokens, places, owned, width, ROW_TILE: tl.constexpr,
               COPIES: tl.constexpr):
    """``out[places[r, j], :] = table[tokens[r], :]`` for every copy j with ``owned[r, j]``
    (int64 tokens; rows of ``width`` elements), ROW_TILE elements of each row at a time. One
    load of a token's row serves its COPIES pairs."""
    wanted = tl.max(owned.to(tl.int32), axis=1) > 0
    start = 0
    while start < width:
        cols = start + tl.arange(0, ROW_TILE)
        values = tl.load(table_ptr + tokens[:, None] * width + cols[None, :],
                         mask=wanted[:, None] & (cols[None, :] < width))
        _store_row_tile(out_ptr, values, places, owned, width, start, ROW_TILE, COPIES)
        start += ROW_TILE


@triton.jit
def _zero_rows(out_ptr, rows, which, width, ROW_TILE: tl.constexpr):
    """Zeros into the rows ``rows[i]`` (int64) of ``out`` with ``which[i]``."""
    start = 0
    while start < width:
        cols = start + tl.arange(0, ROW_TILE)
        tl.store(out_ptr + rows[:, None] * width + cols[None, :],
                 tl.zeros([rows.shape[0], ROW_TILE], out_ptr.dtype.element_ty),
                 mask=which[:, None] & (cols[None, :] < width))
        start += ROW_TILE


@triton.jit
def _permute_single_kernel(topk_ids_ptr, source_rows_ptr, expert_counts_ptr,
                           expert_offsets_ptr, inverse_ptr, id_range_ptr, num_pairs, capacity,
                           first_expert, num_local_experts, align,
                           table_ptr, out_ptr, table2_ptr, out2_ptr, top_k, width, width2,
                           CHUNK: tl.constexpr, SLICE: tl.constexpr, BINS: tl.constexpr,
                           FILL_EXPERTS: tl.constexpr, ALIGN_TILE: tl.constexpr,
                           TAIL_BLOCK: tl.constexpr, OVERLAP_PREVIOUS: tl.constexpr,
                           TABLES: tl.constexpr, ROW_TILE: tl.constexpr,
                           COPIES: tl.constexpr, ZERO_ROWS: tl.constexpr, ZERO_TILE: tl.constexpr,
                           PDL: tl.constexpr):
    if not OVERLAP_PREVIOUS:
        grid_dependency_prologue(PDL)
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    # The slice is loaded first: its load overlaps the ones of all ids.
    mine = (program - 1) * SLICE + tl.arange(0, SLICE)
    mine_valid = (mine >= 0) & (mine < num_pairs)
    my_local = tl.load(topk_ids_ptr + mine, mask=mine_valid, other=0) - first_expert
    my_owned = mine_valid & (my_local >= 0) & (my_local < num_local_experts)
    my_keys = my_local * num_pairs + mine

    # All ids, CHUNK at a time (a tile of a power of two, not of T): program 0
    # counts them (and every program, when the segments are padded) and takes their range;
    # program g >= 1 counts the owned pairs before each of its own in expert-major order.
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], tl.int32)
    owned_total = tl.full([], 0, tl.int32)
    place = tl.zeros([SLICE], tl.int32)
    low = tl.full([], 0, tl.int32)      # (the range of the ids and 0, a valid id)
    high = tl.full([], 0, tl.int32)
    start = 0
    while start < num_pairs:
        pairs = start + tl.arange(0, CHUNK)
        valid = pairs < num_pairs
        ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=0)
        local = ids - first_expert
        owned = valid & (local >= 0) & (local < num_local_experts)
        if ALIGN_TILE > 0:  # align > 1: every program needs the padded segments
            counts += tl.histogram(tl.where(owned, local, 0), BINS, mask=owned)
        else:
            owned_total += tl.sum(owned.to(tl.int32), axis=0)
        if program == 0:
            if ALIGN_TILE == 0:
                counts += tl.histogram(tl.where(owned, local, 0), BINS, mask=owned)
            # (masked pairs read 0, a valid id: they move neither end of the range)
            low = tl.minimum(low, tl.min(ids, axis=0))
            high = tl.maximum(high, tl.max(ids, axis=0))
        else:
            keys = tl.where(owned, local * num_pairs + pairs, 2**30)  # unowned: after all
            place += tl.sum((keys[None, :] < my_keys[:, None]).to(tl.int32), axis=1)
        start += CHUNK
    # (every load is above, every store below: OVERLAP_PREVIOUS waits here)
    if OVERLAP_PREVIOUS:
        grid_dependency_prologue(PDL)
    if ALIGN_TILE > 0:
        padded = (counts + align - 1) // align * align
        starts = tl.cumsum(padded, axis=0) - padded                # expert_offsets[:-1]
        used = tl.sum(padded, axis=0)                              # expert_offsets[-1]
    else:
        starts = tl.cumsum(counts, axis=0) - counts
        used = owned_total
    if program == 0:
        tl.store(expert_counts_ptr + bins, counts, mask=bins < num_local_experts)
        tl.store(expert_offsets_ptr + bins, starts, mask=bins < num_local_experts)
        tl.store(expert_offsets_ptr + num_local_experts, used)
        tl.store(id_range_ptr, low)
        tl.store(id_range_ptr + 1, high)
    else:
        if ALIGN_TILE > 0:
            # the padding rows before each segment: start - owned pairs of earlier experts
            padding = starts - (tl.cumsum(counts, axis=0) - counts)
            place += tl.gather(padding, tl.where(my_owned, my_local, 0), axis=0)
        tl.store(source_rows_ptr + place, mine, mask=my_owned)
        tl.store(inverse_ptr + mine, tl.where(my_owned, place, UNUSED_ENTRY), mask=mine_valid)
        if TABLES > 0:  # permute_and_gather: the slice's rows of the tables to their places
            # the slice's pairs as [token, copy], COPIES pairs of one token per row
            # (GatherLaunch.copies): one load of a token's row serves them all
            tokens = (((program - 1) * SLICE + tl.arange(0, SLICE // COPIES) * COPIES) //
                      top_k).to(tl.int64)
            places = tl.reshape(place, [SLICE // COPIES, COPIES])
            owned_rows = tl.reshape(my_owned, [SLICE // COPIES, COPIES])
            _copy_rows(table_ptr, out_ptr, tokens, places, owned_rows, width, ROW_TILE, COPIES)
            if TABLES == 2:
                _copy_rows(table2_ptr, out2_ptr, tokens, places, owned_rows, width2, ROW_TILE,
                           COPIES)

    if ALIGN_TILE > 0:  # the padding inside the segments
        pad_starts = starts + counts
        pad_lengths = padded - counts
        first = program * FILL_EXPERTS
        while first < num_local_experts:
            experts = first + tl.arange(0, FILL_EXPERTS)
            expert_ok = experts < num_local_experts
            which = tl.where(expert_ok, experts, 0)
            row = tl.gather(pad_starts, which, axis=0)
            length = tl.where(expert_ok, tl.gather(pad_lengths, which, axis=0), 0)
            step = 0
            while step < align - 1:                                # length < align
                cols = step + tl.arange(0, ALIGN_TILE)
                tl.store(source_rows_ptr + row[:, None] + cols[None, :],
                         tl.full([FILL_EXPERTS, ALIGN_TILE], UNUSED_ENTRY, tl.int32),
                         mask=cols[None, :] < length[:, None])
                step += ALIGN_TILE
            first += programs * FILL_EXPERTS
    start = used + program * TAIL_BLOCK
    while start < capacity:
        rows = start + tl.arange(0, TAIL_BLOCK)
        tl.store(source_rows_ptr + rows, tl.full([TAIL_BLOCK], UNUSED_ENTRY, tl.int32),
                 mask=rows < capacity)
        start += programs * TAIL_BLOCK

    if TABLES > 0:  # permute_and_gather: a zero row of each table at every row no pair fills
        # (the rows whose source_rows entry is UNUSED above), ZERO_ROWS rows at a time
        if ALIGN_TILE > 0:
            pad_ends = starts + padded
            pad_from = starts + counts
            first_row = 0               # padding inside the segments, then the tail
        else:
            first_row = used            # the tail only
        start = first_row + program * ZERO_ROWS
        while start < capacity:
            rows = start + tl.arange(0, ZERO_ROWS)
            empty = (rows < capacity) & (rows >= used)
            if ALIGN_TILE > 0:
                # the expert whose padded segment holds the row: ends <= row before it
                segment = tl.sum((pad_ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
                in_range = segment < num_local_experts
                segment_pad = tl.gather(pad_from, tl.where(in_range, segment, 0), axis=0)
                empty = empty | (in_range & (rows >= segment_pad) & (rows < capacity))
            if tl.max(empty.to(tl.int32), axis=0) > 0:
                _zero_rows(out_ptr, rows.to(tl.int64), empty, width, ZERO_TILE)
                if TABLES == 2:
                    _zero_rows(out2_ptr, rows.to(tl.int64), empty, width2, ZERO_TILE)
            start += programs * ZERO_ROWS


# =============================================================================================
# The three-pass form
# =============================================================================================
#
# Worked example (BLOCK_PAIRS = 4 here for the picture; 128 by default):
#   topk_ids = [[2, 0], [2, 1], [0, 2], [5, 0]]  (T=4, k=2), num_experts = 6, first_expert = 0,
#   E_local = 3 (id 5 is another rank's), align = 2, so P = 8 + 3*1 = 11.
#   flat pairs  0  1  2  3 | 4  5  6  7
#   local ids   2  0  2  1 | 0  2  -  0        (- = not owned)
#
# Pass 1, one program per block of pairs (every program also fills its stretch of source_rows
#   with UNUSED, so that padding rows keep UNUSED):
#   block_counts [num_blocks, E_local] = [[1, 1, 2],       pairs of each expert in each block
#                                         [2, 0, 1]]
# Pass 2, one program per chunk of experts; exclusive scan down the blocks:
#   block_starts [num_blocks, E_local] = [[0, 0, 0],       pairs of the expert in earlier blocks
#                                         [1, 1, 2]]
#   expert_counts = [3, 1, 3]                              column totals
# Pass 3, one program per block; every program scans the padded counts ([4, 2, 4] here) into
#   expert_offsets = [0, 4, 6, 10] (program 0 stores them), then places its pairs:
#   place = expert_offsets[e] + block_starts[b, e] + rank - 1, where rank (from 1) counts the
#   block's pairs of expert e up to this one (RANK_COMPARE: a [BLOCK_PAIRS, BLOCK_PAIRS]
#   compare of the block with itself; RANK_ONEHOT: the column cumsum of the one-hot matrix
#   [BLOCK_PAIRS, EXPERT_CHUNK], read at the pair's own column).
#   block 0: experts [2, 0, 2, 1], ranks [1, 1, 2, 1] -> places [6, 0, 7, 4]
#   block 1: experts [0, 2, -, 0], ranks [1, 1, -, 2] -> places [1, 8, -, 2]
#   source_rows = [1, 4, 7, U, 3, U, 0, 2, 5, U, U]        (U = UNUSED)
#   inverse     = [6, 0, 7, 4, 1, 8, U, 2]
#
# Loops over a runtime bound are `while` loops: Triton 3.6's interpreter cannot take a runtime
# int as a `range` bound under numpy >= 2.4 (it calls int() on a 1-element array).


@triton.jit
def _count_block_experts_kernel(topk_ids_ptr, block_counts_ptr, block_id_range_ptr,
                                source_rows_ptr, num_pairs, num_blocks, capacity, first_expert,
                                num_local_experts, BLOCK_PAIRS: tl.constexpr,
                                EXPERT_BINS: tl.constexpr, OVERLAP_PREVIOUS: tl.constexpr,
                                PDL: tl.constexpr):
    """Pass 1: ``block_counts[b, e]`` = owned pairs of local expert e among block b's pairs;
    ``block_id_range[b] = (min, max)`` of block b's global ids (the device-side range check);
    and ``source_rows[p] = UNUSED`` over the program's stretch (the grid covers all P >= T*k
    entries). An id outside the local range -- including an out-of-range one -- is not owned.
    The ids are loaded before the first store (OVERLAP_PREVIOUS waits between them)."""
    if not OVERLAP_PREVIOUS:
        grid_dependency_prologue(PDL)
    block = tl.program_id(0)
    pairs = block * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=0)  # (all masked past num_blocks)
    if OVERLAP_PREVIOUS:
        grid_dependency_prologue(PDL)
    tl.store(source_rows_ptr + pairs, tl.full([BLOCK_PAIRS], UNUSED_ENTRY, tl.int32),
             mask=pairs < capacity)
    if block < num_blocks:
        local = ids - first_expert
        owned = valid & (local >= 0) & (local < num_local_experts)
        counts = tl.histogram(tl.where(owned, local, 0), EXPERT_BINS, mask=owned)
        bins = tl.arange(0, EXPERT_BINS)
        tl.store(block_counts_ptr + block * num_local_experts + bins, counts,
                 mask=bins < num_local_experts)
        # (masked pairs read 0, a valid id: they move neither end of the range)
        tl.store(block_id_range_ptr + 2 * block, tl.min(ids, axis=0))
        tl.store(block_id_range_ptr + 2 * block + 1, tl.max(ids, axis=0))


@triton.jit
def _scan_blocks_kernel(block_counts_ptr, block_starts_ptr, expert_counts_ptr,
                        block_id_range_ptr, id_range_ptr, num_blocks, num_local_experts,
                        SCAN_BLOCKS: tl.constexpr, EXPERT_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Pass 2: for one chunk of experts, an exclusive scan of ``block_counts`` down the blocks
    (``block_starts``); the column totals are ``expert_counts``. Program 0 also reduces
    ``block_id_range`` into ``id_range = (min(0, smallest id), max(0, largest id))`` (0 is a
    valid id, so the range check is unchanged; no pairs give (0, 0))."""
    grid_dependency_prologue(PDL)
    if tl.program_id(0) == 0:
        low = tl.full([], 0, tl.int32)
        high = tl.full([], 0, tl.int32)
        first_block = 0
        while first_block < num_blocks:
            blocks = first_block + tl.arange(0, SCAN_BLOCKS)
            in_range = blocks < num_blocks
            low = tl.minimum(low, tl.min(tl.load(block_id_range_ptr + 2 * blocks,
                                                 mask=in_range, other=0), axis=0))
            high = tl.maximum(high, tl.max(tl.load(block_id_range_ptr + 2 * blocks + 1,
                                                   mask=in_range, other=0), axis=0))
            first_block += SCAN_BLOCKS
        tl.store(id_range_ptr, low)
        tl.store(id_range_ptr + 1, high)
    experts = tl.program_id(0) * EXPERT_CHUNK + tl.arange(0, EXPERT_CHUNK)
    expert_ok = experts < num_local_experts
    totals = tl.zeros([EXPERT_CHUNK], tl.int32)      # pairs in the blocks scanned so far
    first_block = 0
    while first_block < num_blocks:
        blocks = first_block + tl.arange(0, SCAN_BLOCKS)
        mask = (blocks < num_blocks)[:, None] & expert_ok[None, :]
        offsets = blocks[:, None] * num_local_experts + experts[None, :]
        counts = tl.load(block_counts_ptr + offsets, mask=mask, other=0)
        tl.store(block_starts_ptr + offsets, tl.cumsum(counts, axis=0) - counts + totals[None, :],
                 mask=mask)
        totals += tl.sum(counts, axis=0)
        first_block += SCAN_BLOCKS
    tl.store(expert_counts_ptr + experts, totals, mask=expert_ok)


@triton.jit
def _place_pairs_kernel(topk_ids_ptr, block_starts_ptr, expert_counts_ptr, expert_offsets_ptr,
                        source_rows_ptr, inverse_ptr, num_pairs, first_expert, num_local_experts,
                        align, BLOCK_PAIRS: tl.constexpr, EXPERT_CHUNK: tl.constexpr,
                        BINS: tl.constexpr, RANK: tl.constexpr, PDL: tl.constexpr):
    """Pass 3: the place of each pair of the block; writes ``source_rows`` and ``inverse``
    (and ``expert_offsets`` from program 0)."""
    grid_dependency_prologue(PDL)
    block = tl.program_id(0)
    pairs = block * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    valid = pairs < num_pairs
    local = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1) - first_expert
    owned = valid & (local >= 0) & (local < num_local_experts)
    local = tl.where(owned, local, -1)               # matches no expert column
    if RANK == 0:  # RANK_COMPARE: all experts' offsets at once, the rank by one compare
        bins = tl.arange(0, BINS)
        counts = tl.load(expert_counts_ptr + bins, mask=bins < num_local_experts, other=0)
        padded = (counts + align - 1) // align * align
        offsets = tl.cumsum(padded, axis=0) - padded
        if block == 0:
            tl.store(expert_offsets_ptr + bins, offsets, mask=bins < num_local_experts)
            tl.store(expert_offsets_ptr + num_local_experts, tl.sum(padded, axis=0))
        expert = tl.where(owned, local, 0)
        starts = tl.load(block_starts_ptr + block * num_local_experts + expert, mask=owned,
                         other=0)
        within = tl.arange(0, BLOCK_PAIRS)
        earlier = (local[None, :] == local[:, None]) & (within[None, :] < within[:, None])
        place = (tl.gather(offsets, expert, axis=0) + starts
                 + tl.sum(earlier.to(tl.int32), axis=1))
    else:  # RANK_ONEHOT
        place = tl.zeros([BLOCK_PAIRS], tl.int32)
        segment_end = tl.full([], 0, tl.int32)       # padded rows of the earlier chunks
        first = 0
        while first < num_local_experts:
            experts = first + tl.arange(0, EXPERT_CHUNK)
            expert_ok = experts < num_local_experts
            counts = tl.load(expert_counts_ptr + experts, mask=expert_ok, other=0)
            padded = (counts + align - 1) // align * align
            offsets = segment_end + tl.cumsum(padded, axis=0) - padded
            segment_end += tl.sum(padded, axis=0)
            if block == 0:
                tl.store(expert_offsets_ptr + experts, offsets, mask=expert_ok)
            # (program 0 runs even when there are no pairs and no block_starts row to read)
            starts = tl.load(block_starts_ptr + block * num_local_experts + experts,
                             mask=expert_ok & (block * BLOCK_PAIRS < num_pairs), other=0)
            hit = (local[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_PAIRS, CHUNK]
            rank = tl.cumsum(hit, axis=0)
            place += tl.sum(hit * (offsets[None, :] + starts[None, :] + rank - 1), axis=1)
            first += EXPERT_CHUNK
        if block == 0:
            tl.store(expert_offsets_ptr + num_local_experts, segment_end)
    tl.store(source_rows_ptr + place, pairs, mask=owned)
    tl.store(inverse_ptr + pairs, tl.where(owned, place, UNUSED_ENTRY), mask=valid)


def _int32_buffers(sizes: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One int32 allocation per size. Never views of one buffer: an op's outputs may not share
    storage, and a traced body (which Inductor compiles) must not hand its kernels such views.
    A kernel that writes views of one buffer makes the functionalized graph scatter every
    write back into the buffer and cut the views out again, copies that Inductor turns into
    kernels of its own (one of them read past the end of its buffer in the compiled decode
    chain at T=2048, when the three-pass form's scratch was one buffer split in three).
    ``tests.ops_trace --check views`` checks every op body for such views. (Eagerly, separate
    allocations also cost the host less than one allocation cut into pieces.)"""
    return tuple(torch.empty(size, dtype=torch.int32, device=device) for size in sizes)


def single_tile(num_pairs, num_local_experts: int,
                launch: PermuteLaunch) -> tuple[int, int, int]:
    """(CHUNK, SLICE, warps) of the one-launch form for ``num_pairs`` = T*k (an int, or a
    symbolic size while traced with dynamic shapes). The slice from the most pairs the rule
    gives the form (static, not T*k). The chunk: no wider than those pairs nor than T*k
    rounded up to a power of two (a compiled kernel per power of two below
    ``launch.single_chunk``), and at least one id per thread (no replicated layout under the
    histogram). A symbolic T*k keeps the static chunk: one compiled kernel for every T. The
    warps: ``single_wide_warps`` from a chunk of WIDE_CHUNK ids over at most WIDE_BINS bins,
    else ``single_warps``."""
    most = launch.single_limit(num_local_experts)
    widest = min(launch.single_chunk, next_power_of_2(most))
    if not isinstance(num_pairs, torch.SymInt):
        widest = min(widest, next_power_of_2(max(num_pairs, 1)))
    wide = widest >= WIDE_CHUNK and histogram_bins(num_local_experts) <= WIDE_BINS
    warps = launch.single_wide_warps if wide else launch.single_warps
    chunk = max(widest, 32 * warps)
    slice_pairs = max(8, min(next_power_of_2(cdiv(most, launch.single_programs)),
                             SINGLE_COMPARE_TILE // chunk))
    return chunk, slice_pairs, warps


def _launch_single(topk_ids, source_rows, expert_counts, expert_offsets, inverse, id_range,
                   capacity, first_expert, num_local_experts, align, launch: PermuteLaunch,
                   traced: bool, rows: Optional["RowCopy"] = None):
    """The one-launch form; with ``rows`` (:func:`permute_and_gather`) its programs also copy
    the rows of the tables to the places of their pairs and zero the rows no pair fills."""
    num_pairs = topk_ids.numel()
    if num_pairs * num_local_experts >= 2**30:
        raise ValueError(f"T*k={num_pairs} pairs over E_local={num_local_experts} experts are too "
                         f"many for the one-launch form's int32 keys; use "
                         f"PermuteLaunch(form='three_pass') or the default rule")
    chunk, slice_pairs, warps = single_tile(num_pairs, num_local_experts, launch)
    gather = dict(table_ptr=source_rows, out_ptr=source_rows, table2_ptr=source_rows,
                  out2_ptr=source_rows, top_k=1, width=0, width2=0, TABLES=0, ROW_TILE=1,
                  COPIES=1, ZERO_ROWS=1, ZERO_TILE=1)
    if rows is not None:
        slice_pairs = rows.launch.slice_for(num_pairs)
        warps = max(warps, rows.launch.warps)
        chunk = max(chunk, 32 * warps)  # (still at least one id per thread: single_tile)
        second = len(rows.tables) - 1
        copies = rows.launch.copies(slice_pairs, topk_ids.shape[1])
        gather = dict(table_ptr=rows.tables[0], out_ptr=rows.outs[0],
                      table2_ptr=rows.tables[second], out2_ptr=rows.outs[second],
                      top_k=topk_ids.shape[1], width=rows.widths[0], width2=rows.widths[second],
                      TABLES=len(rows.tables),
                      ROW_TILE=rows.row_tile(slice_pairs // copies, warps), COPIES=copies,
                      ZERO_ROWS=slice_pairs,
                      ZERO_TILE=rows.row_tile(slice_pairs, warps))
    programs = torch.sym_max(1 + cdiv(num_pairs, slice_pairs),
                             cdiv(capacity, launch.single_fill))
    # The padding of one expert is < align rows: a tile of ALIGN_TILE columns per expert (0: no
    # padding), FILL_EXPERTS experts of about 32 entries per thread.
    align_tile = min(next_power_of_2(align - 1), 1024) if align > 1 else 0
    fill_experts = max(1, min(next_power_of_2(num_local_experts),
                              32 * 32 * warps // max(align_tile, 1)))
    kernel = wrap_triton(_permute_single_kernel) if traced else _permute_single_kernel
    kernel[(programs,)](
        topk_ids, source_rows, expert_counts, expert_offsets, inverse, id_range, num_pairs,
        capacity, first_expert, num_local_experts, align, **gather, CHUNK=chunk,
        SLICE=slice_pairs, BINS=histogram_bins(num_local_experts), FILL_EXPERTS=fill_experts,
        ALIGN_TILE=align_tile, TAIL_BLOCK=min(1024, next_power_of_2(launch.single_fill)),
        OVERLAP_PREVIOUS=launch.overlap_previous, num_warps=warps,
        **grid_dependency(topk_ids.device, traced))


def _launch_three_pass(topk_ids, source_rows, expert_counts, expert_offsets, inverse, id_range,
                       capacity, first_expert, num_local_experts, align,
                       launch: PermuteLaunch, traced: bool):
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    block_pairs = launch.block_pairs
    num_blocks = cdiv(num_pairs, block_pairs)
    # Scratch: block_counts / block_starts [num_blocks, E_local], block_id_range
    # [num_blocks, 2].
    block_counts, block_starts, block_id_range = _int32_buffers(
        (num_blocks * num_local_experts, num_blocks * num_local_experts, 2 * num_blocks),
        device)

    bins = histogram_bins(num_local_experts)
    pdl = grid_dependency(device, traced)
    fill_blocks = cdiv(capacity, block_pairs)      # capacity >= num_pairs
    count = wrap_triton(_count_block_experts_kernel) if traced else _count_block_experts_kernel
    scan = wrap_triton(_scan_blocks_kernel) if traced else _scan_blocks_kernel
    place = wrap_triton(_place_pairs_kernel) if traced else _place_pairs_kernel
    if fill_blocks > 0:
        count[(fill_blocks,)](
            topk_ids, block_counts, block_id_range, source_rows, num_pairs, num_blocks,
            capacity, first_expert, num_local_experts, BLOCK_PAIRS=block_pairs,
            EXPERT_BINS=bins, OVERLAP_PREVIOUS=launch.overlap_previous, num_warps=4, **pdl)
    scan[(cdiv(num_local_experts, launch.expert_chunk),)](
        block_counts, block_starts, expert_counts, block_id_range, id_range, num_blocks,
        num_local_experts, SCAN_BLOCKS=launch.scan_blocks, EXPERT_CHUNK=launch.expert_chunk,
        num_warps=4, **pdl)
    # At least one program, so that expert_offsets is written when there are no pairs.
    place[(torch.sym_max(num_blocks, 1),)](
        topk_ids, block_starts, expert_counts, expert_offsets, source_rows, inverse, num_pairs,
        first_expert, num_local_experts, align, BLOCK_PAIRS=block_pairs,
        EXPERT_CHUNK=launch.expert_chunk, BINS=bins, RANK=launch.place_rank,
        num_warps=launch.place_warps, **pdl)


def _launch_permute(topk_ids: torch.Tensor, first_expert: int, num_local_experts: int,
                    align: int, launch: PermuteLaunch, traced: bool) -> tuple[torch.Tensor, ...]:
    """The chosen form on checked, contiguous ``topk_ids``: (source_rows, expert_counts,
    expert_offsets, inverse, id_range [2]), five int32 allocations; one or three launches, no
    host read."""
    num_pairs = topk_ids.numel()
    capacity = permutation_capacity(num_pairs, num_local_experts, align)
    outputs = _int32_buffers((capacity, num_local_experts, num_local_experts + 1, num_pairs, 2),
                             topk_ids.device)
    run = (_launch_single if launch.chooses_single(num_pairs, num_local_experts)
           else _launch_three_pass)
    run(topk_ids, *outputs, capacity, first_expert, num_local_experts, align, launch, traced)
    return outputs


def check_id_range(id_range: torch.Tensor, num_experts: int) -> None:
    """The device-read check of ``permute_by_expert`` (its ``check_ids``; one host read): the
    kernels' ``id_range`` [2] (low, high; 0 is in the range) holds no id outside
    ``[0, num_experts]``; raises the oracle's ValueError."""
    low, high = (int(v) for v in read_to_host([id_range]))
    if low < 0 or high > num_experts:
        # The shared check on the two extremes: the oracle's error, word for word.
        check_expert_ids("topk_ids", torch.tensor([low, high], dtype=torch.int32),
                         num_experts, allow_padding=True)


def _check_permute(topk_ids, num_experts, first_expert, num_local_experts, align):
    return check_permute_inputs(topk_ids, num_experts, first_expert, num_local_experts, align,
                                check_ids=False)


def _permute_face(traced: bool):
    def permute_by_expert_op(topk_ids: torch.Tensor, num_experts: int, first_expert: int,
                             num_local_experts: int, align: int, form: Optional[str],
                             single_max_pairs: int, single_programs: int, single_warps: int,
                             single_wide_warps: int, single_fill: int, single_chunk: int,
                             block_pairs: int, scan_blocks: int, expert_chunk: int,
                             place_warps: int, place_rank: int, overlap_previous: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor]:
        """``moe_a2a::permute_by_expert``: the arguments (E_local given), then the fields of
        :class:`PermuteLaunch` -> (source_rows [P], expert_counts [E_local], expert_offsets
        [E_local + 1], inverse [T*k], id_range [2]) int32."""
        _check_permute(topk_ids, num_experts, first_expert, num_local_experts, align)
        launch = PermuteLaunch(form, single_max_pairs, single_programs, single_warps,
                               single_wide_warps, single_fill, single_chunk, block_pairs,
                               scan_blocks, expert_chunk, place_warps, place_rank,
                               overlap_previous)
        return _launch_permute(topk_ids.contiguous(), first_expert, num_local_experts, align,
                               launch, traced)
    library.check_config_parameters(permute_by_expert_op, PermuteLaunch)
    return permute_by_expert_op


def _permute_torch(topk_ids: torch.Tensor, num_experts: int, first_expert: int,
                   num_local_experts: int, align: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:
    perm = reference.permute_by_expert(topk_ids, num_experts, first_expert=first_expert,
                                       num_local_experts=num_local_experts, align=align,
                                       check_ids=False)
    zero = torch.zeros((), dtype=torch.int32, device=topk_ids.device)
    ids = topk_ids.reshape(-1)
    low = torch.minimum(ids.min(), zero) if ids.numel() else zero
    high = torch.maximum(ids.max(), zero) if ids.numel() else zero
    return (perm.source_rows, perm.expert_counts, perm.expert_offsets, perm.inverse,
            torch.stack((low, high)))


def _permute_fake(topk_ids, num_experts, first_expert, num_local_experts, align, *launch):
    num_pairs = topk_ids.numel()
    capacity = permutation_capacity(num_pairs, num_local_experts, align)
    return tuple(topk_ids.new_empty(size) for size in (
        capacity, num_local_experts, num_local_experts + 1, num_pairs, 2))


PERMUTE_BY_EXPERT = library.register("permute_by_expert", triton=_permute_face(True),
                                     launch=_permute_face(False), torch_face=_permute_torch,
                                     fake=_permute_fake)
library.register_value_check("permute_by_expert", check_id_range)


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int, *, first_expert: int = 0,
                      num_local_experts: Optional[int] = None, align: int = 1,
                      check_ids: bool = True,
                      launch: PermuteLaunch = DEFAULT_PERMUTE) -> Permutation:
    """Expert-major order of the locally owned (token, slot) pairs (see :class:`Permutation`);
    equal, field for field, to ``kernels.reference.permute_by_expert``.

    Arguments:
        topk_ids: [T, k] int32 (any strides), global expert id of each (token, slot);
            ``num_experts`` is the padding id (an unowned slot).
        num_experts: E (or the slot count S), the number of global expert ids.
        first_expert: the first global expert id this rank owns (``ep_rank * E_local``).
        num_local_experts: E_local; default ``num_experts - first_expert``.
        align: pad every expert's segment up to a multiple of this (1 = no padding).
        check_ids: True: the kernels record the smallest and largest id on the device and
            the launcher reads them after the launches (one host sync), raising the oracle's
            ValueError for an id outside ``[0, num_experts]``. False: nothing is read (no
            sync: CUDA graphs, benchmarks); an out-of-range id is then skipped as not owned,
            as the oracle does with ``check_ids=False``.
        launch: the launch rule (:class:`PermuteLaunch`); the default is the fixed rule.

    Returns:
        :class:`Permutation`: ``source_rows [P]``, ``expert_counts [E_local]``,
        ``expert_offsets [E_local + 1]``, ``inverse [T*k]``, int32 on ``topk_ids``' device,
        ``P = T*k + E_local*(align - 1)``.
        Runs the registered op ``moe_a2a::permute_by_expert.triton`` (directly in eager mode:
        ``kernels.library``).
    """
    num_local = _check_permute(topk_ids, num_experts, first_expert, num_local_experts, align)
    if library.eager_bypass(topk_ids):
        outputs = _launch_permute(topk_ids.contiguous(), first_expert, num_local, align, launch,
                                  traced=False)
    else:
        outputs = PERMUTE_BY_EXPERT.triton(topk_ids, num_experts, first_expert, num_local,
                                           align, *library.config_fields(launch))
    source_rows, expert_counts, expert_offsets, inverse, id_range = outputs
    if check_ids:
        library.run_value_check("permute_by_expert", [id_range], [num_experts])
    return Permutation(source_rows=source_rows, expert_counts=expert_counts,
                       expert_offsets=expert_offsets, inverse=inverse,
                       top_k=topk_ids.shape[1], align=align)


# =============================================================================================
# permute_and_gather: the permutation and the row gather in one launch
# =============================================================================================

def _launch_permute_and_gather(topk_ids: torch.Tensor, tables: list[torch.Tensor],
                               first_expert: int, num_local_experts: int, align: int,
                               launch: PermuteLaunch, gather_launch: GatherLaunch,
                               traced: bool) -> list[torch.Tensor]:
    """On checked arguments (``topk_ids`` and the tables contiguous): the gathered rows of each
    table ([P, W] in its dtype), then the five buffers of :func:`_launch_permute`. The
    one-launch form moves the rows in its own launch; the three-pass form's batches launch
    ``kernels.gather``'s gather after the permutation."""
    num_pairs = topk_ids.numel()
    if not launch.chooses_single(num_pairs, num_local_experts):
        outputs = _launch_permute(topk_ids, first_expert, num_local_experts, align, launch,
                                  traced)
        return _launch_gather(tables, outputs[0], topk_ids.shape[1], traced) + list(outputs)
    capacity = permutation_capacity(num_pairs, num_local_experts, align)
    outputs = _int32_buffers((capacity, num_local_experts, num_local_experts + 1, num_pairs, 2),
                             topk_ids.device)
    outs = [torch.empty((capacity, t.shape[1]), dtype=t.dtype, device=t.device)
            for t in tables]
    words = [word_dtype(t) for t in tables]
    rows = RowCopy(tables=tuple(as_words(t, w) for t, w in zip(tables, words)),
                   outs=tuple(as_words(o, w) for o, w in zip(outs, words)),
                   widths=tuple(int(t.shape[1] * t.element_size() // w.itemsize)
                                for t, w in zip(tables, words)),
                   launch=gather_launch)
    _launch_single(topk_ids, *outputs, capacity, first_expert, num_local_experts, align, launch,
                   traced, rows=rows)
    return outs + list(outputs)


def _check_permute_and_gather(topk_ids, x, scales, num_experts, first_expert,
                              num_local_experts, align):
    """The checks of ``permute_by_expert`` and of ``gather_rows`` on x and scales (no host
    read). Returns E_local."""
    num_local = _check_permute(topk_ids, num_experts, first_expert, num_local_experts, align)
    check_permute_and_gather_inputs(topk_ids, x, scales)
    return num_local


def _tables(x: torch.Tensor, scales: Optional[torch.Tensor]) -> list[torch.Tensor]:
    return [x.contiguous()] + ([] if scales is None else [scales.contiguous()])


def _permute_and_gather_face(traced: bool):
    def permute_and_gather_op(topk_ids: torch.Tensor, x: torch.Tensor,
                              scales: Optional[torch.Tensor], num_experts: int,
                              first_expert: int, num_local_experts: int, align: int,
                              form: Optional[str], single_max_pairs: int, single_programs: int,
                              single_warps: int, single_wide_warps: int, single_fill: int,
                              single_chunk: int, block_pairs: int, scan_blocks: int,
                              expert_chunk: int, place_warps: int, place_rank: int,
                              overlap_previous: bool, gather_slice_pairs: Optional[int],
                              gather_programs: int, gather_warps: int,
                              gather_group_tokens: bool) -> list[torch.Tensor]:
        """``moe_a2a::permute_and_gather``: the arguments (E_local given), then the fields of
        :class:`PermuteLaunch` and of :class:`GatherLaunch` (prefixed ``gather_``) ->
        [out, (out_scales when ``scales`` is given,) source_rows, expert_counts,
        expert_offsets, inverse, id_range]: the public function's results in its order, the
        id range (the device-read check's) last."""
        _check_permute_and_gather(topk_ids, x, scales, num_experts, first_expert,
                                  num_local_experts, align)
        launch = PermuteLaunch(form, single_max_pairs, single_programs, single_warps,
                               single_wide_warps, single_fill, single_chunk, block_pairs,
                               scan_blocks, expert_chunk, place_warps, place_rank,
                               overlap_previous)
        gather_launch = GatherLaunch(gather_slice_pairs, gather_programs, gather_warps,
                                     gather_group_tokens)
        return _launch_permute_and_gather(topk_ids.contiguous(), _tables(x, scales),
                                          first_expert, num_local_experts, align, launch,
                                          gather_launch, traced)
    library.check_config_parameters(permute_and_gather_op, PermuteLaunch, GatherLaunch,
                                    prefixes=("", "gather_"))
    return permute_and_gather_op


def _permute_and_gather_torch(topk_ids: torch.Tensor, x: torch.Tensor,
                              scales: Optional[torch.Tensor], num_experts: int,
                              first_expert: int, num_local_experts: int, align: int
                              ) -> list[torch.Tensor]:
    _check_permute_and_gather(topk_ids, x, scales, num_experts, first_expert,
                              num_local_experts, align)
    buffers = _permute_torch(topk_ids, num_experts, first_expert, num_local_experts, align)
    perm = Permutation(source_rows=buffers[0], expert_counts=buffers[1],
                       expert_offsets=buffers[2], inverse=buffers[3],
                       top_k=topk_ids.shape[1], align=align)
    gathered = reference.gather_rows(x, perm, scales=scales, check_values=False)
    return ([gathered] if scales is None else list(gathered)) + list(buffers)


def _permute_and_gather_fake(topk_ids, x, scales, num_experts, first_expert, num_local_experts,
                             align, *launch):
    buffers = _permute_fake(topk_ids, num_experts, first_expert, num_local_experts, align)
    capacity = buffers[0].shape[0]
    tables = [x] + ([] if scales is None else [scales])
    return [t.new_empty((capacity, t.shape[1])) for t in tables] + list(buffers)


PERMUTE_AND_GATHER = library.register(
    "permute_and_gather", triton=_permute_and_gather_face(True),
    launch=_permute_and_gather_face(False), torch_face=_permute_and_gather_torch,
    fake=_permute_and_gather_fake)


def permute_and_gather(topk_ids: torch.Tensor, x: torch.Tensor, num_experts: int, *,
                       scales: Optional[torch.Tensor] = None, first_expert: int = 0,
                       num_local_experts: Optional[int] = None, align: int = 1,
                       check_ids: bool = True, launch: PermuteLaunch = DEFAULT_PERMUTE,
                       gather_launch: GatherLaunch = DEFAULT_GATHER) -> tuple:
    """:func:`permute_by_expert` and ``kernels.gather.gather_rows`` of the rows of ``x`` (and
    ``scales``) through it, fused: in the one-launch form (decode batches, the rule of
    ``launch``) every program that places a slice of the pairs also copies their rows to their
    places and zeroes the rows no pair fills, so the rows move in the permutation's own launch;
    larger batches run the two ops one after the other. Equal, buffer for buffer and byte for
    byte, to ``kernels.reference.permute_and_gather`` (the same arguments, the same errors).

    Arguments:
        topk_ids, num_experts, first_expert, num_local_experts, align, check_ids, launch: as
            for :func:`permute_by_expert`; ``launch.overlap_previous`` promises that the
            kernel just before wrote none of ``topk_ids`` (x and scales are read after the
            wait, in any case).
        x: [T, W] any dtype and strides (bf16 rows, packed NVFP4 uint8 [T, H/2], ...), the
            rows of the T tokens of ``topk_ids``.
        scales: optional [T, Ws] (e.g. NVFP4 scales uint8 [T, H/16], linear layout), gathered
            with the same rows.
        gather_launch: the copies' launch (:class:`GatherLaunch`).

    Returns:
        ``(permutation, out)``, or ``(permutation, out, out_scales)`` with ``scales``:
        the :class:`Permutation` of :func:`permute_by_expert` and the gathered rows
        ``out[p] = x[source_rows[p] // k]`` [P, W] (zeros where ``source_rows[p]`` is UNUSED),
        as ``gather_rows(x, permutation, scales=scales)`` returns them.
    """
    num_local = _check_permute_and_gather(topk_ids, x, scales, num_experts, first_expert,
                                          num_local_experts, align)
    if library.eager_bypass(topk_ids, x, scales):
        outputs = _launch_permute_and_gather(topk_ids.contiguous(), _tables(x, scales),
                                             first_expert, num_local, align, launch,
                                             gather_launch, traced=False)
    else:
        outputs = PERMUTE_AND_GATHER.triton(topk_ids, x, scales, num_experts, first_expert,
                                            num_local, align, *library.config_fields(launch),
                                            *library.config_fields(gather_launch))
    source_rows, expert_counts, expert_offsets, inverse, id_range = outputs[-5:]
    if check_ids:
        library.run_value_check("permute_by_expert", [id_range], [num_experts])
    permutation = Permutation(source_rows=source_rows, expert_counts=expert_counts,
                              expert_offsets=expert_offsets, inverse=inverse,
                              top_k=topk_ids.shape[1], align=align)
    return (permutation, *outputs[:-5])
