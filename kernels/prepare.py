"""The local send plan of the prepare stage in Triton: who sends which token to which rank.

Same signature and result as ``kernels.reference.local_send_plan``; deterministic (ascending
token order inside every rank's segment, no dependence on the order of atomics). Two launches
over blocks of ``BLOCK_T`` tokens (one where a single block holds every token, below):

1. ``_count_kernel``: per block, the number of its tokens sent to each rank, the histogram of
   its slot ids, and the flat position of its first id outside ``[0, S]`` (the device-side
   range check).
2. ``_index_kernel``: every block reads all blocks' counts, takes the exclusive prefix over the
   blocks before it and over the ranks before each rank, and writes its tokens' send and
   backward indices there; it also sums a slice of the histograms, fills the UNUSED tail, and
   program 0 reduces the range check to one int32 (``NO_BAD_POSITION`` when all ids are good).

Where one block holds N = max_tokens_per_rank tokens (N <= BLOCK_T: up to 512 tokens for
R <= 8, the decode batches), ``_single_plan_kernel`` does both passes in one launch: the block's
counts are the per-rank totals, so no program needs another's (one launch less in a decode
step).

Worked example (R = 2, S = 4 so rank 0 owns ids {0, 1}, k = 2, BLOCK_T = 2, T = 4):
``topk_ids = [[0, 2], [1, 0], [3, 2], [2, 1]]``
- first slot on each rank, [T, R] (k = 2 means none): ``[[0, 1], [0, 2], [2, 0], [1, 0]]``
- pass 1, ``block_counts [blocks, R]``: block 0 (tokens 0, 1) ``[2, 1]``; block 1 ``[1, 2]``
- pass 2, per-rank totals ``[3, 3]``, rank starts ``[0, 3]``; block 1 starts rank 0 after
  block 0's 2 tokens (position 2) and rank 1 after its 1 (position 3 + 1 = 4):
  ``send_rank_local_indices = [0, 1, 3, 0, 2, 3]`` and backward ``[0, 2, 7, 1, 4, 6]``.

Fast path and compilation
-------------------------
``check_ids=False`` is the fast path: no host sync at all (CUDA-graph capturable), ids outside
``[0, S]`` are treated as padding (sent nowhere, not counted). ``check_ids=True`` reads the
device-side range check after the launch (one host sync) and raises naming the bad id.

Every constexpr and every specialised integer argument is derived from the configuration
``(N = max_tokens_per_rank, R, k, S)`` only, never from T (T and the block count are
``do_not_specialize``): one compiled variant per configuration serves every T, so a call never
compiles or loads a CUDA module in the middle of a run of calls with changing T. The first call
of a configuration compiles (and loading a module waits for the device to be idle).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kernels import library, reference
from kernels.hardware import grid_dependency, grid_dependency_prologue
from kernels.sizes import cdiv, next_power_of_2, round_up
from kernels.spec.prepare import check_prepare_inputs
from kernels.spec.tensors import check_expert_ids
from kernels.spec.values import read_to_host
from kernels.types import UNUSED, LocalSendPlan

# The UNUSED marker as a compile-time constant (a jit function reads only constexpr globals).
UNUSED_ID = tl.constexpr(UNUSED)
# The range check's "no bad id": larger than any flat position token * k + j in int32.
NO_BAD_POSITION = 2**31 - 1
NO_BAD_ID = tl.constexpr(NO_BAD_POSITION)


@triton.jit
def _first_slot_step(first, ids, slot, ranks, ep_size, slots_per_rank, TOP_K: tl.constexpr):
    """One slot of the first-slot tile ([BLOCK_T, R_PAD] int32: the first slot j of each token
    whose id lives on each rank; TOP_K where none does): ``first`` updated with slot ``slot``,
    whose ids [BLOCK_T] the kernel loaded (padding and out-of-range ids, masked tokens and ranks
    >= ep_size never match). The kernels load the ids themselves and pass the values: a helper
    given the ids' pointer, whose result feeds a store address, would make Inductor's mutation
    analysis count topk_ids as written."""
    # == ep_size for the padding id S; ids < 0 (C division truncates -1 // n to 0) go nowhere
    owner = tl.where(ids >= 0, ids // slots_per_rank, ep_size)
    match = (owner[:, None] == ranks[None, :]) & (ranks < ep_size)[None, :] & (first == TOP_K)
    return tl.where(match, slot, first)


@triton.jit
def _fill_tail(send_indices_ptr, backward_ptr, program, total, index_len,
               TAIL_BLOCK: tl.constexpr, TAIL_CHUNK: tl.constexpr):
    """UNUSED past the ``total`` sent entries of both index buffers: program p covers
    [p * TAIL_CHUNK, (p + 1) * TAIL_CHUNK) (the grid has enough programs for index_len; a
    static loop: the interpreter has no runtime ranges)."""
    for step in tl.static_range(TAIL_CHUNK // TAIL_BLOCK):
        offsets = program * TAIL_CHUNK + step * TAIL_BLOCK + tl.arange(0, TAIL_BLOCK)
        tail_mask = (offsets >= total) & (offsets < index_len)
        tl.store(send_indices_ptr + offsets, tl.full((TAIL_BLOCK,), UNUSED_ID, tl.int32),
                 mask=tail_mask)
        tl.store(backward_ptr + offsets, tl.full((TAIL_BLOCK,), UNUSED_ID, tl.int32),
                 mask=tail_mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _count_kernel(topk_ids_ptr, scratch_ptr, num_tokens, ep_size, slots_per_rank, num_slots,
                  hist_offset, bad_offset, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                  R_PAD: tl.constexpr, S_PAD: tl.constexpr, FLAT: tl.constexpr, PDL: tl.constexpr):
    grid_dependency_prologue(PDL)
    # After this pass (scratch, int32): [0, blocks * R) block_counts[b, r] = tokens of block b
    # sent to rank r; hist_offset + [blocks, S) block_hist[b, s] = (token, slot) pairs of block b
    # routed to slot id s; bad_offset + b = flat position of block b's first id outside [0, S].
    block = tl.program_id(0)
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    ranks = tl.arange(0, R_PAD)
    first = tl.full((BLOCK_T, R_PAD), TOP_K, tl.int32)
    for j in tl.static_range(TOP_K):
        ids = tl.load(topk_ids_ptr + tokens * TOP_K + j, mask=tokens < num_tokens,
                      other=num_slots)
        first = _first_slot_step(first, ids, j, ranks, ep_size, slots_per_rank, TOP_K)
    counts = tl.sum((first < TOP_K).to(tl.int32), axis=0)
    tl.store(scratch_ptr + block * ep_size + ranks, counts, mask=ranks < ep_size)

    pairs = tl.arange(0, FLAT)
    positions = block * (BLOCK_T * TOP_K) + pairs
    pair_ok = (pairs < BLOCK_T * TOP_K) & (positions < num_tokens * TOP_K)
    ids = tl.load(topk_ids_ptr + positions, mask=pair_ok, other=0)
    in_range = (ids >= 0) & (ids <= num_slots)
    counted = pair_ok & in_range & (ids < num_slots)  # the padding id S is not counted
    hist = tl.histogram(tl.where(counted, ids, 0), S_PAD, mask=counted)
    bins = tl.arange(0, S_PAD)
    tl.store(scratch_ptr + hist_offset + block * num_slots + bins, hist, mask=bins < num_slots)
    first_bad = tl.min(tl.where(pair_ok & (in_range == 0), positions, NO_BAD_ID), axis=0)
    tl.store(scratch_ptr + bad_offset + block, first_bad)


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _index_kernel(topk_ids_ptr, scratch_ptr, send_counts_ptr, send_cumsum_ptr,
                  send_indices_ptr, backward_ptr, expert_counts_ptr, num_tokens, num_blocks,
                  ep_size, slots_per_rank, num_slots, index_len, hist_offset, bad_offset,
                  error_offset, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                  R_PAD: tl.constexpr, NB_PAD: tl.constexpr, BINS: tl.constexpr,
                  TAIL_BLOCK: tl.constexpr, TAIL_CHUNK: tl.constexpr, PDL: tl.constexpr):
    grid_dependency_prologue(PDL)
    # After this pass: the LocalSendPlan (send counts and cumsum, send and backward indices
    # with their UNUSED tail, expert_counts) and scratch[error_offset] = first bad position.
    block = tl.program_id(0)
    blocks = tl.arange(0, NB_PAD)
    block_ok = blocks < num_blocks
    ranks = tl.arange(0, R_PAD)
    rank_ok = ranks < ep_size
    counts = tl.load(scratch_ptr + blocks[:, None] * ep_size + ranks[None, :],
                     mask=block_ok[:, None] & rank_ok[None, :], other=0)
    totals = tl.sum(counts, axis=0)                                              # [R_PAD]
    before = tl.sum(tl.where(blocks[:, None] < block, counts, 0), axis=0)        # [R_PAD]
    rank_end = tl.cumsum(totals, axis=0)
    rank_start = rank_end - totals
    if block == 0:
        tl.store(send_counts_ptr + ranks, totals, mask=rank_ok)
        tl.store(send_cumsum_ptr + ranks, rank_end, mask=rank_ok)
        bad = tl.load(scratch_ptr + bad_offset + blocks, mask=block_ok, other=NO_BAD_ID)
        tl.store(scratch_ptr + error_offset, tl.min(bad, axis=0))

    if block < num_blocks:  # programs past num_blocks only fill the tail and the histogram
        tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
        first = tl.full((BLOCK_T, R_PAD), TOP_K, tl.int32)
        for j in tl.static_range(TOP_K):
            ids = tl.load(topk_ids_ptr + tokens * TOP_K + j, mask=tokens < num_tokens,
                          other=num_slots)
            first = _first_slot_step(first, ids, j, ranks, ep_size, slots_per_rank, TOP_K)
        hit = (first < TOP_K).to(tl.int32)
        position = rank_start[None, :] + before[None, :] + tl.cumsum(hit, axis=0) - hit
        token_grid = tokens[:, None] + 0 * ranks[None, :]
        tl.store(send_indices_ptr + position, token_grid, mask=hit != 0)
        tl.store(backward_ptr + position, token_grid * TOP_K + first, mask=hit != 0)

    _fill_tail(send_indices_ptr, backward_ptr, block, tl.sum(totals, axis=0), index_len,
               TAIL_BLOCK, TAIL_CHUNK)

    # This program's slice of the histogram sum over blocks (the grid covers S in BINS steps).
    bins = block * BINS + tl.arange(0, BINS)
    hist = tl.load(scratch_ptr + hist_offset + blocks[:, None] * num_slots + bins[None, :],
                   mask=block_ok[:, None] & (bins[None, :] < num_slots), other=0)
    tl.store(expert_counts_ptr + bins, tl.sum(hist, axis=0), mask=bins < num_slots)


@triton.jit(do_not_specialize=["num_tokens"])
def _single_plan_kernel(topk_ids_ptr, scratch_ptr, send_counts_ptr, send_cumsum_ptr,
                        send_indices_ptr, backward_ptr, expert_counts_ptr, num_tokens, ep_size,
                        slots_per_rank, num_slots, index_len, error_offset,
                        TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, R_PAD: tl.constexpr,
                        S_PAD: tl.constexpr, FLAT: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                        TAIL_CHUNK: tl.constexpr, PDL: tl.constexpr):
    grid_dependency_prologue(PDL)
    # Both passes in one launch, for a configuration whose one block holds every token
    # (N <= BLOCK_T): that block's counts are the per-rank totals, so no program waits for
    # another's. Program 0 writes the plan, the histogram and the range-check word
    # scratch[error_offset]; every program fills its stretch of the UNUSED tail.
    program = tl.program_id(0)
    tokens = tl.arange(0, BLOCK_T)
    ranks = tl.arange(0, R_PAD)
    rank_ok = ranks < ep_size
    first = tl.full((BLOCK_T, R_PAD), TOP_K, tl.int32)
    for j in tl.static_range(TOP_K):
        ids = tl.load(topk_ids_ptr + tokens * TOP_K + j, mask=tokens < num_tokens,
                      other=num_slots)
        first = _first_slot_step(first, ids, j, ranks, ep_size, slots_per_rank, TOP_K)
    hit = (first < TOP_K).to(tl.int32)
    totals = tl.sum(hit, axis=0)                                                 # [R_PAD]
    rank_end = tl.cumsum(totals, axis=0)
    if program == 0:
        position = (rank_end - totals)[None, :] + tl.cumsum(hit, axis=0) - hit
        token_grid = tokens[:, None] + 0 * ranks[None, :]
        tl.store(send_indices_ptr + position, token_grid, mask=hit != 0)
        tl.store(backward_ptr + position, token_grid * TOP_K + first, mask=hit != 0)
        tl.store(send_counts_ptr + ranks, totals, mask=rank_ok)
        tl.store(send_cumsum_ptr + ranks, rank_end, mask=rank_ok)
        pairs = tl.arange(0, FLAT)
        pair_ok = pairs < num_tokens * TOP_K
        flat_ids = tl.load(topk_ids_ptr + pairs, mask=pair_ok, other=0)
        in_range = (flat_ids >= 0) & (flat_ids <= num_slots)
        counted = pair_ok & in_range & (flat_ids < num_slots)  # the padding id S is not counted
        bins = tl.arange(0, S_PAD)
        tl.store(expert_counts_ptr + bins,
                 tl.histogram(tl.where(counted, flat_ids, 0), S_PAD, mask=counted),
                 mask=bins < num_slots)
        tl.store(scratch_ptr + error_offset,
                 tl.min(tl.where(pair_ok & (in_range == 0), pairs, NO_BAD_ID), axis=0))
    _fill_tail(send_indices_ptr, backward_ptr, program, tl.sum(totals, axis=0), index_len,
               TAIL_BLOCK, TAIL_CHUNK)


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
# The one-launch kernel's warps from its flat pair tile (FLAT = BLOCK_T * k, a power of two):
# its histogram, prefix sums and stores of every pair run in one program, and from 2048 pairs
# (T = 256 at k = 8) 8 warps finish them sooner than 4; below that 4 were faster (an H200,
# E=256 k=8 R=1 at T = 16, 64 and 256).
SINGLE_WIDE_PAIRS = 2048
SINGLE_WIDE_WARPS = 8
# tl.histogram distributes bins over the 32 lanes of a warp: never ask for fewer bins.
HIST_MIN_BINS = 32


def block_tokens(max_tokens: int, ep_size: int) -> int:
    """Tokens per program of the local-plan kernels (a power of two), from N = max_tokens (not
    from T: the compiled kernels must not depend on T)."""
    by_tile = TILE_ELEMENTS // next_power_of_2(ep_size)
    return max(MIN_BLOCK_T, min(MAX_BLOCK_T, by_tile, next_power_of_2(max(max_tokens, 1))))


class PlanConfig(NamedTuple):
    """Launch constants of one configuration (N, R, k, S); see :func:`plan_config`."""

    block_t: int          # BLOCK_T
    index_programs: int   # grid of the index kernel (covers the blocks, the tail and S)
    r_pad: int
    s_pad: int            # histogram bins
    flat: int             # BLOCK_T * k, padded
    nb_pad: int           # max blocks (cdiv(N, BLOCK_T)), padded
    bins: int             # expert_counts entries per index program
    hist_offset: int      # scratch layout in int32 words (each part 16-byte aligned)
    bad_offset: int
    error_offset: int
    pieces: tuple         # one int32 buffer split into the outputs and the scratch, see below
    single: bool          # one block holds N tokens: one launch (_single_plan_kernel)
    single_warps: int     # warps of that launch (SINGLE_WIDE_PAIRS)


def carve(sizes) -> tuple[tuple[int, ...], int]:
    """Split sizes (int32 words) of one buffer holding the parts ``sizes`` one after the other,
    each starting 16 bytes aligned: ``(part, pad, part, pad, ...)``, and their sum. One
    allocation and one ``split`` cost less host time than an allocation per part."""
    pieces = []
    for size in sizes:
        pieces += [size, -size % 4]
    return tuple(pieces), sum(pieces)


def static_config(max_tokens, ep_size: int, top_k, slots: int) -> PlanConfig:
    """:func:`plan_config` of values that may be traced sizes (``torch.SymInt``, e.g. k while
    an op is traced with every size dynamic): each is specialized to its int first (the
    configuration is static by design; a traced graph then guards on it)."""
    return plan_config(int(max_tokens), int(ep_size), int(top_k), int(slots))


@functools.lru_cache(maxsize=64)
def plan_config(max_tokens: int, ep_size: int, top_k: int, slots: int) -> PlanConfig:
    """The launch constants of ``local_send_plan`` for N, R, k, S (cached: pure function)."""
    def align(n):  # int32 words -> multiple of 4 (16 bytes)
        return round_up(n, 4)
    block_t = block_tokens(max_tokens, ep_size)
    flat = next_power_of_2(block_t * top_k)
    max_blocks = max(1, cdiv(max_tokens, block_t))
    index_programs = max(max_blocks, cdiv(max_tokens * ep_size, TAIL_CHUNK))
    hist_offset = align(max_blocks * ep_size)
    bad_offset = hist_offset + align(max_blocks * slots)
    error_offset = bad_offset + align(max_blocks)
    # send_counts, send_cumsum, send_indices, backward, expert_counts, scratch
    pieces, _ = carve((ep_size, ep_size, max_tokens * ep_size, max_tokens * ep_size, slots,
                       error_offset + 1))
    return PlanConfig(
        block_t=block_t, index_programs=index_programs, r_pad=next_power_of_2(ep_size),
        s_pad=max(HIST_MIN_BINS, next_power_of_2(slots)),
        flat=flat,
        nb_pad=next_power_of_2(max_blocks),
        bins=next_power_of_2(cdiv(slots, index_programs)),
        hist_offset=hist_offset, bad_offset=bad_offset, error_offset=error_offset,
        pieces=pieces, single=max_blocks == 1,
        single_warps=SINGLE_WIDE_WARPS if flat >= SINGLE_WIDE_PAIRS else NUM_WARPS)


def _plan_kernels(topk_ids: torch.Tensor, plan: LocalSendPlan, scratch: torch.Tensor,
                  ep_size: int, max_tokens: int, slots: int, traced: bool) -> None:
    """The launches into ``plan``'s tensors and ``scratch`` (contiguous, validated
    ``topk_ids``): one where a single block holds N tokens (``PlanConfig.single``), else two;
    ``traced``: through ``wrap_triton`` (the op's body), else the kernels."""
    num_tokens, top_k = topk_ids.shape
    cfg = static_config(max_tokens, ep_size, top_k, slots)
    num_blocks = torch.sym_max(1, cdiv(num_tokens, cfg.block_t))
    slots_per_rank = slots // ep_size
    pdl = grid_dependency(topk_ids.device, traced)
    if cfg.single:  # every T <= N is one block: its counts are the totals
        single = wrap_triton(_single_plan_kernel) if traced else _single_plan_kernel
        single[(cfg.index_programs,)](
            topk_ids, scratch, plan.send_counts, plan.send_rank_count_cumsum,
            plan.send_rank_local_indices, plan.backward_recv_rank_local_indices,
            plan.expert_counts, num_tokens, ep_size, slots_per_rank, slots,
            max_tokens * ep_size, cfg.error_offset, TOP_K=top_k, BLOCK_T=cfg.block_t,
            R_PAD=cfg.r_pad, S_PAD=cfg.s_pad, FLAT=cfg.flat, TAIL_BLOCK=TAIL_BLOCK,
            TAIL_CHUNK=TAIL_CHUNK, num_warps=cfg.single_warps, **pdl)
        return
    count = wrap_triton(_count_kernel) if traced else _count_kernel
    index = wrap_triton(_index_kernel) if traced else _index_kernel
    count[(num_blocks,)](
        topk_ids, scratch, num_tokens, ep_size, slots_per_rank, slots, cfg.hist_offset,
        cfg.bad_offset, TOP_K=top_k, BLOCK_T=cfg.block_t, R_PAD=cfg.r_pad, S_PAD=cfg.s_pad,
        FLAT=cfg.flat, num_warps=NUM_WARPS, **pdl)
    index[(cfg.index_programs,)](
        topk_ids, scratch, plan.send_counts, plan.send_rank_count_cumsum,
        plan.send_rank_local_indices, plan.backward_recv_rank_local_indices,
        plan.expert_counts, num_tokens, num_blocks, ep_size, slots_per_rank, slots,
        max_tokens * ep_size, cfg.hist_offset, cfg.bad_offset, cfg.error_offset, TOP_K=top_k,
        BLOCK_T=cfg.block_t, R_PAD=cfg.r_pad, NB_PAD=cfg.nb_pad, BINS=cfg.bins,
        TAIL_BLOCK=TAIL_BLOCK, TAIL_CHUNK=TAIL_CHUNK, num_warps=NUM_WARPS, **pdl)


def launch_local_plan(topk_ids: torch.Tensor, ep_size: int, max_tokens: int,
                      slots: int) -> tuple[LocalSendPlan, torch.Tensor]:
    """The launches, on already validated inputs (no host sync); the plan's tensors and the
    scratch are views of one int32 allocation.

    Returns the plan and the int32 scratch whose word ``plan_config(...).error_offset`` holds
    the flat position of the first id outside ``[0, S]`` (``NO_BAD_POSITION`` if none); read it
    with :func:`raise_on_bad_ids`.
    """
    cfg = plan_config(max_tokens, ep_size, topk_ids.shape[1], slots)
    buffer = torch.empty(sum(cfg.pieces), dtype=torch.int32, device=topk_ids.device)
    send_counts, _, send_cumsum, _, send_indices, _, backward, _, expert_counts, _, scratch, _ \
        = buffer.split(cfg.pieces)
    plan = LocalSendPlan(send_counts=send_counts, send_rank_count_cumsum=send_cumsum,
                         send_rank_local_indices=send_indices,
                         backward_recv_rank_local_indices=backward, expert_counts=expert_counts)
    _plan_kernels(topk_ids, plan, scratch, ep_size, max_tokens, slots, traced=False)
    return plan, scratch


def _plan_sizes(max_tokens: int, ep_size: int, slots: int) -> tuple[int, ...]:
    """The sizes of the plan's five tensors (LocalSendPlan's field order)."""
    return (ep_size, ep_size, max_tokens * ep_size, max_tokens * ep_size, slots)


def _error_word(scratch: torch.Tensor, cfg: PlanConfig) -> torch.Tensor:
    """The range check's word of ``scratch`` as a [1] view."""
    return scratch[cfg.error_offset:cfg.error_offset + 1]


def check_plan_ids(topk_ids: torch.Tensor, error: torch.Tensor, slots: int) -> None:
    """The device-read check of ``local_send_plan`` (its ``check_ids``; one host read): the
    kernels' range-check word ``error`` [1] (the flat position of the first id outside
    ``[0, S]``, ``NO_BAD_POSITION`` if none); raises ValueError naming that id."""
    position = int(read_to_host([error])[0])
    if position != NO_BAD_POSITION:
        check_expert_ids("topk_ids", topk_ids, slots, allow_padding=True)  # names the id
        bad = int(topk_ids.reshape(-1)[position])
        raise ValueError(f"topk_ids holds expert id {bad} outside [0, {slots}] ({slots} = "
                         f"padding) at flat position {position}")


def raise_on_bad_ids(topk_ids: torch.Tensor, scratch: torch.Tensor, ep_size: int,
                     max_tokens: int, slots: int) -> None:
    """Read the device-side range check of :func:`launch_local_plan` (one host sync) and raise
    ValueError naming an id outside ``[0, S]`` if there is one."""
    cfg = plan_config(max_tokens, ep_size, topk_ids.shape[1], slots)
    check_plan_ids(topk_ids, _error_word(scratch, cfg), slots)


def _check_plan(topk_ids, num_experts, ep_size, max_tokens_per_rank, slot_count):
    """The shared checks; returns (N, S)."""
    _, _, max_tokens, slots = check_prepare_inputs(
        topk_ids, num_experts, ep_size, max_tokens_per_rank, slot_count, check_ids=False)
    return max_tokens, slots


def _plan_face(traced: bool):
    def local_send_plan_op(topk_ids: torch.Tensor, num_experts: int, ep_size: int,
                           max_tokens_per_rank: int, slot_count: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor, torch.Tensor]:
        """``moe_a2a::local_send_plan`` (N and S given) -> the LocalSendPlan's five tensors in
        field order, then the range-check word [1] int32 (``check_plan_ids``)."""
        max_tokens, slots = _check_plan(topk_ids, num_experts, ep_size, max_tokens_per_rank,
                                        slot_count)
        topk_ids = topk_ids.contiguous()  # the kernels read flat positions token * k + j
        cfg = static_config(max_tokens, ep_size, topk_ids.shape[1], slots)
        # separate allocations: an op's outputs may not share storage
        plan = LocalSendPlan(*(torch.empty(size, dtype=torch.int32, device=topk_ids.device)
                               for size in _plan_sizes(max_tokens, ep_size, slots)))
        scratch = torch.empty(cfg.error_offset + 1, dtype=torch.int32, device=topk_ids.device)
        _plan_kernels(topk_ids, plan, scratch, ep_size, max_tokens, slots, traced)
        return (*plan.tensors().values(), _error_word(scratch, cfg))
    return local_send_plan_op


def _plan_torch(topk_ids: torch.Tensor, num_experts: int, ep_size: int,
                max_tokens_per_rank: int, slot_count: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor]:
    plan = reference.local_send_plan(topk_ids, num_experts, ep_size,
                                     max_tokens_per_rank=max_tokens_per_rank,
                                     slot_count=slot_count, check_ids=False)
    flat = topk_ids.reshape(-1)
    bad = (flat < 0) | (flat > slot_count)
    positions = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    first_bad = torch.where(bad, positions, NO_BAD_POSITION).min() if flat.numel() else None
    # the word at the op's offset of its scratch (the fake's layout)
    cfg = static_config(max_tokens_per_rank, ep_size, topk_ids.shape[1], slot_count)
    error = _error_word(torch.full((cfg.error_offset + 1,), NO_BAD_POSITION, dtype=torch.int32,
                                   device=topk_ids.device), cfg)
    if first_bad is not None:
        error.copy_(first_bad.reshape(1))
    return (*plan.tensors().values(), error)


def _plan_fake(topk_ids, num_experts, ep_size, max_tokens_per_rank, slot_count):
    cfg = static_config(max_tokens_per_rank, ep_size, topk_ids.shape[1], slot_count)
    sizes = _plan_sizes(max_tokens_per_rank, ep_size, slot_count)
    return (*(topk_ids.new_empty(size) for size in sizes),
            _error_word(topk_ids.new_empty(cfg.error_offset + 1), cfg))


LOCAL_SEND_PLAN = library.register("local_send_plan", triton=_plan_face(True),
                                   launch=_plan_face(False), torch_face=_plan_torch,
                                   fake=_plan_fake)
library.register_value_check("local_send_plan", check_plan_ids)


def local_send_plan(topk_ids: torch.Tensor, num_experts: int, ep_size: int, *,
                    max_tokens_per_rank=None, slot_count=None,
                    check_ids: bool = True) -> LocalSendPlan:
    """What this rank sends where, from its own routing alone (Triton; no communication).

    topk_ids:            [T, k] int32 (any strides: copied to a contiguous tensor when not),
                         slot ids in ``[0, S]``; S = padding.
    num_experts:         E, the number of distinct experts.
    ep_size:             R, the number of ranks; S must be a multiple of R.
    max_tokens_per_rank: N >= T, sizes the index buffers ([N*R]) and picks the compiled
                         variant (one per N, R, k, S; T only sizes the grid); default T (pass
                         it under ``torch.compile`` with a dynamic T: it must be an int).
    slot_count:          S >= E (E plus redundant expert copies); default E.
    check_ids:           True: read the kernels' device-side range check after the launch (one
                         host sync) and raise ValueError naming an id outside ``[0, S]``.
                         False: the fast path (no host sync, CUDA-graph capturable); ids
                         outside ``[0, S]`` are then treated as padding.
    Returns a :class:`LocalSendPlan` equal field for field to the reference's: ascending token
    ids per destination segment, ``token*k + first slot`` backward indices, UNUSED tails,
    ``expert_counts [S]``. Two launches (one where N <= BLOCK_T), no host sync when
    ``check_ids=False``. Runs the registered op ``moe_a2a::local_send_plan.triton``
    (directly in eager mode: ``kernels.library``).
    """
    max_tokens, slots = _check_plan(topk_ids, num_experts, ep_size, max_tokens_per_rank,
                                    slot_count)
    if library.eager_bypass(topk_ids):
        topk_ids = topk_ids.contiguous()  # the kernels read flat positions token * k + j
        plan, scratch = launch_local_plan(topk_ids, ep_size, max_tokens, slots)
        error = _error_word(scratch, plan_config(max_tokens, ep_size, topk_ids.shape[1], slots))
    else:
        *fields, error = LOCAL_SEND_PLAN.triton(topk_ids, num_experts, ep_size, max_tokens,
                                                slots)
        plan = LocalSendPlan(*fields)
    if check_ids:
        library.run_value_check("local_send_plan", [topk_ids, error], [slots])
    return plan
