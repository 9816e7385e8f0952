"""``permute_by_expert`` in Triton: (token, slot) pairs -> expert-major order
(:class:`Permutation`), a stable, atomic-free counting sort, with the signature of its oracle in
``kernels.reference.permute``. The rows move with ``kernels.gather``.

Determinism: no pass depends on the order of atomics; the same input gives bit-identical
output on every run (the histogram's shared-memory atomics add integers, whose sum does not
depend on their order).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.spec.permute import check_permute_inputs, permutation_capacity
from kernels.spec.tensors import check_expert_ids
from kernels.types import UNUSED, Permutation

# UNUSED as a Triton constexpr: a kernel can read only constexpr globals.
UNUSED_ENTRY = tl.constexpr(UNUSED)


# =============================================================================================
# permute_by_expert: a three-pass counting sort
# =============================================================================================
#
# Worked example (BLOCK_PAIRS = 4 here for the picture; 256 in the launcher):
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
#   block's pairs of expert e up to this one: the column cumsum of the one-hot matrix
#   [BLOCK_PAIRS, E_local], read at the pair's own column.
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
                                EXPERT_BINS: tl.constexpr):
    """Pass 1: ``block_counts[b, e]`` = owned pairs of local expert e among block b's pairs;
    ``block_id_range[b] = (min, max)`` of block b's global ids (the device-side range check);
    and ``source_rows[p] = UNUSED`` over the program's stretch (the grid covers all P >= T*k
    entries). An id outside the local range -- including an out-of-range one -- is not owned."""
    block = tl.program_id(0)
    pairs = block * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    tl.store(source_rows_ptr + pairs, tl.full([BLOCK_PAIRS], UNUSED_ENTRY, tl.int32),
             mask=pairs < capacity)
    if block < num_blocks:
        valid = pairs < num_pairs
        ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=0)
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
                        SCAN_BLOCKS: tl.constexpr, EXPERT_CHUNK: tl.constexpr):
    """Pass 2: for one chunk of experts, an exclusive scan of ``block_counts`` down the blocks
    (``block_starts``); the column totals are ``expert_counts``. Program 0 also reduces
    ``block_id_range`` into ``id_range = (min(0, smallest id), max(0, largest id))`` (0 is a
    valid id, so the range check is unchanged; no pairs give (0, 0))."""
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
                        align, BLOCK_PAIRS: tl.constexpr, EXPERT_CHUNK: tl.constexpr):
    """Pass 3: the place of each pair of the block, chunk of experts by chunk; writes
    ``source_rows`` and ``inverse`` (and ``expert_offsets`` from program 0)."""
    block = tl.program_id(0)
    pairs = block * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    valid = pairs < num_pairs
    local = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1) - first_expert
    owned = valid & (local >= 0) & (local < num_local_experts)
    local = tl.where(owned, local, -1)               # matches no expert column
    place = tl.zeros([BLOCK_PAIRS], tl.int32)
    segment_end = tl.full([], 0, tl.int32)           # padded rows of the earlier chunks
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
        hit = (local[:, None] == experts[None, :]).to(tl.int32)    # [BLOCK_PAIRS, EXPERT_CHUNK]
        rank = tl.cumsum(hit, axis=0)
        place += tl.sum(hit * (offsets[None, :] + starts[None, :] + rank - 1), axis=1)
        first += EXPERT_CHUNK
    if block == 0:
        tl.store(expert_offsets_ptr + num_local_experts, segment_end)
    tl.store(source_rows_ptr + place, pairs, mask=owned)
    tl.store(inverse_ptr + pairs, tl.where(owned, place, UNUSED_ENTRY), mask=valid)


# Pairs per block of passes 1 and 3: T=8192, k=8 gives 256 blocks, about two per SM of an H200.
# Pass 3's one-hot tile [BLOCK_PAIRS, EXPERT_CHUNK] is 32 int32 per thread at 8 warps.
BLOCK_PAIRS = 256
EXPERT_CHUNK = 32
PLACE_WARPS = 8
# Pass 2 tile [SCAN_BLOCKS, EXPERT_CHUNK]: 4096 int32, 32 per thread at 4 warps; T*k = 65536
# takes two steps down the blocks.
SCAN_BLOCKS = 128
# tl.histogram keeps at least one bin per lane of a warp.
MIN_HISTOGRAM_BINS = 32


def _pieces(*sizes: int) -> list[int]:
    """Sizes rounded up to whole 128-byte stretches of int32, so that every view cut from one
    allocation starts 16-byte aligned (Triton specialises pointers on that)."""
    return [-(-size // 32) * 32 for size in sizes]


def _launch_permute(topk_ids: torch.Tensor, num_experts: int, first_expert: int,
                    num_local_experts: int, align: int, check_ids: bool) -> Permutation:
    """The three passes on checked arguments (everything but the id range). Two allocations
    (the results, one scratch buffer), three launches; with ``check_ids`` one host read of
    the id range after the launches."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    capacity = permutation_capacity(num_pairs, num_local_experts, align)
    num_blocks = triton.cdiv(num_pairs, BLOCK_PAIRS)

    # Results: views of one int32 allocation.
    sizes = (capacity, num_local_experts, num_local_experts + 1, num_pairs)
    padded = _pieces(*sizes)
    results = torch.empty(sum(padded), dtype=torch.int32, device=device)
    source_rows, expert_counts, expert_offsets, inverse = (
        piece[:size] for piece, size in zip(torch.split(results, padded), sizes))
    # Scratch: block_counts / block_starts [num_blocks, E_local], block_id_range [num_blocks, 2],
    # id_range [2].
    sizes = (num_blocks * num_local_experts, num_blocks * num_local_experts, 2 * num_blocks, 2)
    padded = _pieces(*sizes)
    scratch = torch.empty(sum(padded), dtype=torch.int32, device=device)
    block_counts, block_starts, block_id_range, id_range = torch.split(scratch, padded)

    fill_blocks = triton.cdiv(capacity, BLOCK_PAIRS)      # capacity >= num_pairs
    if fill_blocks > 0:
        bins = max(MIN_HISTOGRAM_BINS, triton.next_power_of_2(num_local_experts))
        _count_block_experts_kernel[(fill_blocks,)](
            topk_ids, block_counts, block_id_range, source_rows, num_pairs, num_blocks,
            capacity, first_expert, num_local_experts, BLOCK_PAIRS=BLOCK_PAIRS,
            EXPERT_BINS=bins, num_warps=4)
    _scan_blocks_kernel[(triton.cdiv(num_local_experts, EXPERT_CHUNK),)](
        block_counts, block_starts, expert_counts, block_id_range, id_range, num_blocks,
        num_local_experts, SCAN_BLOCKS=SCAN_BLOCKS, EXPERT_CHUNK=EXPERT_CHUNK, num_warps=4)
    # At least one program, so that expert_offsets is written when there are no pairs.
    _place_pairs_kernel[(max(num_blocks, 1),)](
        topk_ids, block_starts, expert_counts, expert_offsets, source_rows, inverse, num_pairs,
        first_expert, num_local_experts, align, BLOCK_PAIRS=BLOCK_PAIRS,
        EXPERT_CHUNK=EXPERT_CHUNK, num_warps=PLACE_WARPS)
    if check_ids:
        low, high = id_range[:2].tolist()                 # the one host sync
        if low < 0 or high > num_experts:
            # The shared check on the two extremes: the oracle's error, word for word.
            check_expert_ids("topk_ids", torch.tensor([low, high], dtype=torch.int32),
                             num_experts, allow_padding=True)
    return Permutation(source_rows=source_rows, expert_counts=expert_counts,
                       expert_offsets=expert_offsets, inverse=inverse,
                       top_k=topk_ids.shape[1], align=align)


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int, *, first_expert: int = 0,
                      num_local_experts: Optional[int] = None, align: int = 1,
                      check_ids: bool = True) -> Permutation:
    """Expert-major order of the locally owned (token, slot) pairs (see :class:`Permutation`);
    equal, field for field, to ``kernels.reference.permute_by_expert``.

    Arguments:
        topk_ids: [T, k] int32 (any strides), global expert id of each (token, slot);
            ``num_experts`` is the padding id (an unowned slot).
        num_experts: E (or the slot count S), the number of global expert ids.
        first_expert: the first global expert id this rank owns (``ep_rank * E_local``).
        num_local_experts: E_local; default ``num_experts - first_expert``.
        align: pad every expert's segment up to a multiple of this (1 = no padding).
        check_ids: True: the first pass records the smallest and largest id on the device and
            the launcher reads them after the launches (one host sync), raising the oracle's
            ValueError for an id outside ``[0, num_experts]``. False: nothing is read (no
            sync: CUDA graphs, benchmarks); an out-of-range id is then skipped as not owned,
            as the oracle does with ``check_ids=False``.

    Returns:
        :class:`Permutation`: ``source_rows [P]``, ``expert_counts [E_local]``,
        ``expert_offsets [E_local + 1]``, ``inverse [T*k]``, int32 on ``topk_ids``' device,
        ``P = T*k + E_local*(align - 1)``. The four are views of one allocation.
    """
    num_local = check_permute_inputs(topk_ids, num_experts, first_expert, num_local_experts,
                                     align, check_ids=False)
    topk_ids = topk_ids.contiguous()  # any strides, as on every face
    return _launch_permute(topk_ids, num_experts, first_expert, num_local, align, check_ids)
