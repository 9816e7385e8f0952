"""The local send plan of the prepare stage in Triton: who sends which token to which rank.

Same signature and result as ``kernels.reference.local_send_plan``; deterministic (ascending
token order inside every rank's segment, no dependence on the order of atomics). Two launches
over blocks of ``BLOCK_T`` tokens:

1. ``_count_kernel``: per block, the number of its tokens sent to each rank and the histogram of
   its slot ids.
2. ``_index_kernel``: every block reads all blocks' counts, takes the exclusive prefix over the
   blocks before it and over the ranks before each rank, and writes its tokens' send and
   backward indices there; it also sums a slice of the histograms and fills the UNUSED tail.

Worked example (R = 2, S = 4 so rank 0 owns ids {0, 1}, k = 2, BLOCK_T = 2, T = 4):
``topk_ids = [[0, 2], [1, 0], [3, 2], [2, 1]]``
- first slot on each rank, [T, R] (k = 2 means none): ``[[0, 1], [0, 2], [2, 0], [1, 0]]``
- pass 1, ``block_counts [blocks, R]``: block 0 (tokens 0, 1) ``[2, 1]``; block 1 ``[1, 2]``
- pass 2, per-rank totals ``[3, 3]``, rank starts ``[0, 3]``; block 1 starts rank 0 after
  block 0's 2 tokens (position 2) and rank 1 after its 1 (position 3 + 1 = 4):
  ``send_rank_local_indices = [0, 1, 3, 0, 2, 3]`` and backward ``[0, 2, 7, 1, 4, 6]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import check_prepare_inputs
from kernels.types import UNUSED, LocalSendPlan

# The UNUSED marker as a compile-time constant (a jit function reads only constexpr globals).
UNUSED_ID = tl.constexpr(UNUSED)


@triton.jit
def _first_slot_on_rank(topk_ids_ptr, tokens, token_mask, ranks, ep_size, slots_per_rank,
                        num_slots, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                        R_PAD: tl.constexpr):
    """[BLOCK_T, R_PAD] int32: the first slot j of each token whose id lives on each rank;
    TOP_K where none does (padding ids, masked tokens and ranks >= ep_size never match)."""
    first = tl.full((BLOCK_T, R_PAD), TOP_K, tl.int32)
    rank_ok = ranks < ep_size
    for j in tl.static_range(TOP_K):
        ids = tl.load(topk_ids_ptr + tokens * TOP_K + j, mask=token_mask, other=num_slots)
        owner = ids // slots_per_rank  # == ep_size for the padding id S
        match = (owner[:, None] == ranks[None, :]) & rank_ok[None, :] & (first == TOP_K)
        first = tl.where(match, j, first)
    return first


@triton.jit
def _count_kernel(topk_ids_ptr, block_counts_ptr, block_hist_ptr, num_tokens, ep_size,
                  slots_per_rank, num_slots, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                  R_PAD: tl.constexpr, S_PAD: tl.constexpr, FLAT: tl.constexpr):
    # After this pass: block_counts[b, r] = tokens of block b sent to rank r;
    # block_hist[b, s] = (token, slot) pairs of block b routed to slot id s.
    block = tl.program_id(0)
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    ranks = tl.arange(0, R_PAD)
    first = _first_slot_on_rank(topk_ids_ptr, tokens, tokens < num_tokens, ranks, ep_size,
                                slots_per_rank, num_slots, TOP_K, BLOCK_T, R_PAD)
    counts = tl.sum((first < TOP_K).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + block * ep_size + ranks, counts, mask=ranks < ep_size)

    pairs = tl.arange(0, FLAT)
    pair_ok = (pairs < BLOCK_T * TOP_K) & (block * BLOCK_T * TOP_K + pairs < num_tokens * TOP_K)
    ids = tl.load(topk_ids_ptr + block * BLOCK_T * TOP_K + pairs, mask=pair_ok, other=0)
    counted = pair_ok & (ids < num_slots)  # the padding id S is not counted
    hist = tl.histogram(tl.where(counted, ids, 0), S_PAD, mask=counted)
    bins = tl.arange(0, S_PAD)
    tl.store(block_hist_ptr + block * num_slots + bins, hist, mask=bins < num_slots)


@triton.jit
def _index_kernel(topk_ids_ptr, block_counts_ptr, block_hist_ptr, send_counts_ptr,
                  send_cumsum_ptr, send_indices_ptr, backward_ptr, expert_counts_ptr,
                  num_tokens, num_blocks, ep_size, slots_per_rank, num_slots, index_len,
                  TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, R_PAD: tl.constexpr,
                  NB_PAD: tl.constexpr, BINS: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                  TAIL_CHUNK: tl.constexpr):
    # After this pass: the LocalSendPlan (send counts and cumsum, send and backward indices
    # with their UNUSED tail, expert_counts).
    block = tl.program_id(0)
    blocks = tl.arange(0, NB_PAD)
    ranks = tl.arange(0, R_PAD)
    rank_ok = ranks < ep_size
    counts = tl.load(block_counts_ptr + blocks[:, None] * ep_size + ranks[None, :],
                     mask=(blocks[:, None] < num_blocks) & rank_ok[None, :], other=0)
    totals = tl.sum(counts, axis=0)                                              # [R_PAD]
    before = tl.sum(tl.where(blocks[:, None] < block, counts, 0), axis=0)        # [R_PAD]
    rank_end = tl.cumsum(totals, axis=0)
    rank_start = rank_end - totals
    if block == 0:
        tl.store(send_counts_ptr + ranks, totals, mask=rank_ok)
        tl.store(send_cumsum_ptr + ranks, rank_end, mask=rank_ok)

    if block < num_blocks:  # programs past num_blocks only fill the tail
        tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
        first = _first_slot_on_rank(topk_ids_ptr, tokens, tokens < num_tokens, ranks, ep_size,
                                    slots_per_rank, num_slots, TOP_K, BLOCK_T, R_PAD)
        hit = (first < TOP_K).to(tl.int32)
        position = rank_start[None, :] + before[None, :] + tl.cumsum(hit, axis=0) - hit
        token_grid = tokens[:, None] + 0 * ranks[None, :]
        tl.store(send_indices_ptr + position, token_grid, mask=hit != 0)
        tl.store(backward_ptr + position, token_grid * TOP_K + first, mask=hit != 0)

    # UNUSED past the total: program p covers [p * TAIL_CHUNK, (p + 1) * TAIL_CHUNK) (the grid
    # has enough programs for index_len; static loop, the interpreter has no runtime ranges).
    total = tl.sum(totals, axis=0)
    for step in tl.static_range(TAIL_CHUNK // TAIL_BLOCK):
        offsets = block * TAIL_CHUNK + step * TAIL_BLOCK + tl.arange(0, TAIL_BLOCK)
        tail_mask = (offsets >= total) & (offsets < index_len)
        tl.store(send_indices_ptr + offsets, tl.full((TAIL_BLOCK,), UNUSED_ID, tl.int32),
                 mask=tail_mask)
        tl.store(backward_ptr + offsets, tl.full((TAIL_BLOCK,), UNUSED_ID, tl.int32),
                 mask=tail_mask)

    # This program's slice of the histogram sum over blocks.
    bins = block * BINS + tl.arange(0, BINS)
    hist = tl.load(block_hist_ptr + blocks[:, None] * num_slots + bins[None, :],
                   mask=(blocks[:, None] < num_blocks) & (bins[None, :] < num_slots), other=0)
    tl.store(expert_counts_ptr + bins, tl.sum(hist, axis=0), mask=bins < num_slots)


# The [BLOCK_T, R_PAD] first-slot tile is the largest register tile: ~4096 elements keeps it
# at 32 int32 registers per thread for 4 warps.
TILE_ELEMENTS = 4096
# Tokens per program: at least 16 (a useful vector), at most 512 (so that T = 8192 still spreads
# over 16+ programs).
MIN_BLOCK_T, MAX_BLOCK_T = 16, 512
# The UNUSED tail: TAIL_BLOCK entries per store (4 per thread of 4 warps: 16-byte stores),
# TAIL_CHUNK entries per program; the index kernel's grid grows to cover N*R / TAIL_CHUNK.
TAIL_BLOCK = 512
TAIL_CHUNK = 4096
NUM_WARPS = 4
# tl.histogram distributes bins over the 32 lanes of a warp: never ask for fewer bins.
HIST_MIN_BINS = 32


def block_tokens(num_tokens: int, ep_size: int) -> int:
    """Tokens per program of the local-plan kernels (a power of two)."""
    by_tile = TILE_ELEMENTS // triton.next_power_of_2(ep_size)
    return max(MIN_BLOCK_T, min(MAX_BLOCK_T, by_tile, triton.next_power_of_2(max(num_tokens, 1))))


def local_send_plan(topk_ids: torch.Tensor, num_experts: int, ep_size: int, *,
                    max_tokens_per_rank=None, slot_count=None,
                    check_ids: bool = True) -> LocalSendPlan:
    """What this rank sends where, from its own routing alone (Triton; no communication).

    topk_ids:            [T, k] int32 contiguous, slot ids in ``[0, S]``; S = padding.
    num_experts:         E, the number of distinct experts.
    ep_size:             R, the number of ranks; S must be a multiple of R.
    max_tokens_per_rank: N >= T, sizes the index buffers ([N*R]); default T.
    slot_count:          S >= E (E plus redundant expert copies); default E.
    check_ids:           range-check the ids first (reads them: one host sync on a GPU);
                         pass False under CUDA-graph capture when the ids are known good.
    Returns a :class:`LocalSendPlan` equal field for field to the reference's: ascending token
    ids per destination segment, ``token*k + first slot`` backward indices, UNUSED tails,
    ``expert_counts [S]``. Two launches of ``cdiv(T, BLOCK_T)`` programs.
    """
    num_tokens, top_k, max_tokens, slots = check_prepare_inputs(
        topk_ids, num_experts, ep_size, max_tokens_per_rank, slot_count, check_ids=check_ids)
    if not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous (call .contiguous() first); strides "
                         f"{topk_ids.stride()}")
    device = topk_ids.device
    block_t = block_tokens(num_tokens, ep_size)
    num_blocks = max(1, triton.cdiv(num_tokens, block_t))
    block_counts = torch.empty((num_blocks, ep_size), dtype=torch.int32, device=device)
    block_hist = torch.empty((num_blocks, slots), dtype=torch.int32, device=device)
    send_counts = torch.empty(ep_size, dtype=torch.int32, device=device)
    send_cumsum = torch.empty(ep_size, dtype=torch.int32, device=device)
    send_indices = torch.empty(max_tokens * ep_size, dtype=torch.int32, device=device)
    backward = torch.empty_like(send_indices)
    expert_counts = torch.empty(slots, dtype=torch.int32, device=device)
    common = dict(TOP_K=top_k, BLOCK_T=block_t, R_PAD=triton.next_power_of_2(ep_size),
                  num_warps=NUM_WARPS)
    _count_kernel[(num_blocks,)](
        topk_ids, block_counts, block_hist, num_tokens, ep_size, slots // ep_size, slots,
        S_PAD=max(HIST_MIN_BINS, triton.next_power_of_2(slots)),
        FLAT=triton.next_power_of_2(block_t * top_k), **common)
    index_programs = max(num_blocks, triton.cdiv(max_tokens * ep_size, TAIL_CHUNK))
    _index_kernel[(index_programs,)](
        topk_ids, block_counts, block_hist, send_counts, send_cumsum, send_indices, backward,
        expert_counts, num_tokens, num_blocks, ep_size, slots // ep_size, slots,
        max_tokens * ep_size, NB_PAD=triton.next_power_of_2(num_blocks),
        BINS=triton.next_power_of_2(triton.cdiv(slots, num_blocks)), TAIL_BLOCK=TAIL_BLOCK,
        TAIL_CHUNK=TAIL_CHUNK, **common)
    return LocalSendPlan(send_counts=send_counts, send_rank_count_cumsum=send_cumsum,
                         send_rank_local_indices=send_indices,
                         backward_recv_rank_local_indices=backward, expert_counts=expert_counts)
