"""The cross-rank prepare in Triton: each rank's local plan, then one kernel that pushes what every
destination needs into its row of a peer-mapped workspace, signals it, waits for the other ranks
and builds the receive side of the :class:`~kernels.types.AlltoallPlan`.

The flags, the device-side call counter, the two parities, the bounded waits and the status
buffer are the device protocol of :mod:`a2a.protocol`; this module adds its data layout and
the exchange kernel.

The workspace
-------------
``workspace [R, words]`` int64/uint64: row q is rank q's inbox (``a2a.protocol``). Rank q's
row, in 64-bit words then 32-bit words::

    flags   [R, MAX_CHUNKS] int64   flag[s, c]: last call whose chunk c source s has delivered,
                                    as c + 1 (0 = never)
    arrivals int64 (+1 pad)         this rank's exchange programs that have read c (local)
    regions [2, R] x region         parity p = c % 2, source s:
        count   int32 (+3 pad)      rows s sends to q in this call
        hist    [S] int32 (padded)  s's expert_counts (chunk 0 writes it)
        ids     [N, k] int32        s's k ids of each row it sends to q, in send order
        weights [N, k] fp32 bits    the same rows' k weights

One call c: the grid is (R, C); program (q, chunk) first SENDS chunk ``chunk`` of this rank's
segment for destination q (plain stores of count, rows and, for chunk 0, hist into q's region
(p, me), then :func:`~a2a.protocol.publish_flag`), then RECEIVES chunk ``chunk`` of what
source q sent here: it waits until flag[s, chunk] of our row is >= c + 1 for every source s
(the counts of all sources give the row offsets; source q's flag also covers the rows it
copies) and writes the plan. Every program counts itself in before the counter moves on
(:func:`~a2a.protocol.advance_call`).

Why a source gets at most one call ahead (flag c + 2): it may finish call c + 1, which needs
our call-c+1 flag, published before we wait. Why two parities suffice: source s writes
region (p, s) again only in call c + 2; to start it, it must have finished call c + 1, which
waited for our call-c+1 flag, published only by our call-c+1 kernel, which starts after our
call-c kernel (same stream) finished reading region (p, s).

Timeout: on a timed-out wait a program takes the missing sources' counts as 0 and records
them in the status buffer; the launcher raises :class:`~a2a.protocol.PrepareTimeout` naming the
ranks when ``check=True``.

Compilation, warm-up and host syncs: the first call of each configuration (N, R, k, S,
max_programs, with_expert_counts) compiles the kernels. Nothing compiled depends on T or on
the rank (T, the ranks and the row stride are not specialised; every constexpr comes from the
configuration), so R simulated ranks on one GPU call :func:`warmup_prepare` once per
configuration before they call concurrently (``a2a.protocol``, "Co-residency"). With
``check=False`` and ``check_ids=False`` the call has no host sync at all (the fast path,
CUDA-graph capturable): only caching-allocator allocations and three launches.
``check_ids=True`` reads the local plan's device-side id check before the exchange (one sync;
a bad id raises before anything is sent), ``check=True`` reads the status after it (one sync).

Co-residency: receivers spin while the send programs of the same launch on other ranks run, so
every program of the exchange kernel must be resident at once (on one GPU per rank:
R * C <= ``PrepareConfig.max_programs``, 128 by default, fits H200's 132 SMs; with R simulated
ranks on one GPU, all R * R * C programs must fit, which the tests ensure with a small
``max_programs``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from a2a.config import PrepareConfig
from a2a.protocol import (MAX_CHUNKS, PrepareTimeout, advance_call, arrivals_address,
                          check_call_counter, check_status, check_workspace, flag_address,
                          new_status, publish_flag, raise_on_timeout, record_timeouts,
                          wait_for_flags)
from kernels.prepare import carve, launch_local_plan, raise_on_bad_ids
from kernels.sizes import cdiv, next_power_of_2, round_up
from kernels.spec.prepare import check_prepare_inputs
from kernels.spec.tensors import check_tensor
from kernels.types import UNUSED, AlltoallPlan

__all__ = ["PrepareTimeout", "exchange_chunks", "prepare_workspace_words", "triton_prepare",
           "warmup_prepare"]

# The UNUSED marker as a compile-time constant (a jit function reads only constexpr globals).
UNUSED_ID = tl.constexpr(UNUSED)

# At least this many send-order rows per chunk: fewer makes the flag traffic dominate.
MIN_CHUNK_ROWS = 64
# Rows copied per step (a [BLOCK_ROWS, k] tile of ids and of weights).
BLOCK_ROWS = 64
# Header of a region: the count, padded to 16 bytes.
HEADER_INTS = 4
# The arrivals word after the flags, padded to 16 bytes (2 int64 words).
ARRIVAL_WORDS = 2
NUM_WARPS = 4


# Values that change from call to call or from rank to rank (or are often 1, which Triton would
# otherwise turn into a constant), and the workspace row stride (so that warmup's private
# workspace picks the same variant), are not specialized: one compiled kernel per configuration.
@triton.jit(do_not_specialize=["ws_row_stride", "ep_rank", "ep_size", "max_tokens", "num_rows",
                               "chunk_rows", "tail_rows", "timeout_spins"])
def _exchange_kernel(ws_ptr, ws_row_stride, topk_ids_ptr, topk_weights_ptr, send_cumsum_ptr,
                     send_indices_ptr, local_hist_ptr, recv_cumsum_ptr, recv_local_ptr,
                     recv_ids_ptr, recv_weights_ptr, expert_counts_ptr, status_ptr,
                     counter_ptr, ep_rank, ep_size, num_slots, slots_per_rank, max_tokens,
                     num_rows, chunk_rows, tail_rows, timeout_spins,
                     flags_ints, region_ints, hist_off, ids_off, weights_off,
                     TOP_K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr,
                     S_PAD: tl.constexpr, MAX_CHUNKS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     WITH_COUNTS: tl.constexpr):
    peer = tl.program_id(0)       # destination when sending, source when receiving
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    ws32 = ws_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    row_stride32 = ws_row_stride.to(tl.int64) * 2  # the workspace stride is in 64-bit words
    cols = tl.arange(0, K_PAD)
    col_ok = cols < TOP_K
    call = tl.load(counter_ptr)
    parity = call % 2
    advance_call(counter_ptr, arrivals_address(ws64, ws_row_stride, ep_rank, ep_size,
                                               MAX_CHUNKS), call)

    # ---- send: chunk `chunk` of this rank's rows for destination `peer` -------------------
    seg_end = tl.load(send_cumsum_ptr + peer)
    seg_start = tl.load(send_cumsum_ptr + peer - 1, mask=peer > 0, other=0)
    count = seg_end - seg_start
    region = (ws32 + peer.to(tl.int64) * row_stride32 + flags_ints
              + (parity * ep_size + ep_rank).to(tl.int64) * region_ints)
    tl.store(region, count)  # every chunk writes the same count: its flag then covers it
    if WITH_COUNTS:
        if chunk == 0:
            slots = tl.arange(0, S_PAD)
            hist = tl.load(local_hist_ptr + slots, mask=slots < num_slots)
            tl.store(region + hist_off + slots, hist, mask=slots < num_slots)
    row_begin = chunk * chunk_rows
    row_end = tl.minimum(row_begin + chunk_rows, count)
    for row0 in range(row_begin, row_end, BLOCK_ROWS):
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < row_end
        token = tl.load(send_indices_ptr + seg_start + rows, mask=row_ok, other=0)
        tile_ok = row_ok[:, None] & col_ok[None, :]
        source = token[:, None] * TOP_K + cols[None, :]
        ids = tl.load(topk_ids_ptr + source, mask=tile_ok)
        weights = tl.load(topk_weights_ptr + source, mask=tile_ok)
        target = rows[:, None] * TOP_K + cols[None, :]
        tl.store(region + ids_off + target, ids, mask=tile_ok)
        tl.store(region + weights_off + target, weights.to(tl.int32, bitcast=True),
                 mask=tile_ok)
    # Every thread's stores above happen before the flag.
    publish_flag(flag_address(ws64, ws_row_stride, peer, ep_rank, chunk, MAX_CHUNKS), call)

    # ---- receive: chunk `chunk` of what source `peer` sent here ----------------------------
    my_row32 = ws32 + ep_rank.to(tl.int64) * row_stride32
    sources = tl.arange(0, R_PAD)
    source_ok = sources < ep_size
    arrived = wait_for_flags(flag_address(ws64, ws_row_stride, ep_rank, sources, chunk,
                                          MAX_CHUNKS), source_ok, call + 1, timeout_spins)
    tl.debug_barrier()  # the acquiring thread's view before any thread reads the data
    record_timeouts(status_ptr, sources, call, source_ok & (arrived == 0))
    regions = my_row32 + flags_ints + (parity * ep_size + sources).to(tl.int64) * region_ints
    counts = tl.load(regions, mask=source_ok & (arrived != 0), other=0, cache_modifier=".cg")
    counts = tl.minimum(tl.maximum(counts, 0), max_tokens)  # never trust a count blindly
    recv_end = tl.cumsum(counts, axis=0)
    recv_start = recv_end - counts
    total = tl.sum(counts, axis=0)
    my_start = tl.sum(tl.where(sources == peer, recv_start, 0), axis=0)
    my_count = tl.sum(tl.where(sources == peer, counts, 0), axis=0)
    if (peer == 0) & (chunk == 0):
        tl.store(recv_cumsum_ptr + sources, recv_end, mask=source_ok)
    region = my_row32 + flags_ints + (parity * ep_size + peer).to(tl.int64) * region_ints
    if WITH_COUNTS:
        if chunk == 0:
            slots = tl.arange(0, S_PAD)
            peer_arrived = tl.sum(tl.where(sources == peer, arrived.to(tl.int32), 0), axis=0)
            hist_ok = (slots < num_slots) & (peer_arrived != 0)
            hist = tl.load(region + hist_off + slots, mask=hist_ok, other=0,
                           cache_modifier=".cg")
            tl.store(expert_counts_ptr + peer * num_slots + slots, hist, mask=slots < num_slots)
    row_begin = chunk * chunk_rows
    row_end = tl.minimum(row_begin + chunk_rows, my_count)
    for row0 in range(row_begin, row_end, BLOCK_ROWS):
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < row_end
        tile_ok = row_ok[:, None] & col_ok[None, :]
        source = rows[:, None] * TOP_K + cols[None, :]
        ids = tl.load(region + ids_off + source, mask=tile_ok, other=0, cache_modifier=".cg")
        bits = tl.load(region + weights_off + source, mask=tile_ok, other=0,
                       cache_modifier=".cg")
        owned = (ids >= 0) & ((ids // slots_per_rank) == ep_rank)  # C division: -1 // n = 0
        out_rows = my_start + rows
        target = out_rows[:, None] * TOP_K + cols[None, :]
        tl.store(recv_ids_ptr + target, tl.where(owned, ids, num_slots), mask=tile_ok)
        tl.store(recv_weights_ptr + target, bits.to(tl.float32, bitcast=True), mask=tile_ok)
        tl.store(recv_local_ptr + out_rows, out_rows, mask=row_ok)

    # ---- padding rows [total, N*R): ids S, weights 0, indices UNUSED; spread over programs --
    program = peer * num_chunks + chunk
    tail_begin = tl.maximum(program * tail_rows, total)
    tail_end = tl.minimum(program * tail_rows + tail_rows, num_rows)
    for row0 in range(tail_begin, tail_end, BLOCK_ROWS):
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < tail_end
        tile_ok = row_ok[:, None] & col_ok[None, :]
        target = rows[:, None] * TOP_K + cols[None, :]
        tl.store(recv_ids_ptr + target, tl.full((BLOCK_ROWS, K_PAD), 0, tl.int32) + num_slots,
                 mask=tile_ok)
        tl.store(recv_weights_ptr + target, tl.zeros((BLOCK_ROWS, K_PAD), tl.float32),
                 mask=tile_ok)
        tl.store(recv_local_ptr + rows, tl.full((BLOCK_ROWS,), UNUSED_ID, tl.int32), mask=row_ok)


def _region_ints(max_tokens_per_rank: int, top_k: int, slot_count: int) -> tuple[int, ...]:
    """(region_ints, hist_off, ids_off, weights_off) in 32-bit words, 16-byte aligned."""
    def align(n):  # int32 words -> multiple of 4 (16 bytes)
        return round_up(n, 4)
    hist_off = HEADER_INTS
    ids_off = hist_off + align(slot_count)
    weights_off = ids_off + align(max_tokens_per_rank * top_k)
    region = weights_off + align(max_tokens_per_rank * top_k)
    return region, hist_off, ids_off, weights_off


def prepare_workspace_words(ep_size: int, max_tokens_per_rank: int, top_k: int,
                            num_experts: int, slot_count: Optional[int] = None) -> int:
    """64-bit words each rank's workspace row needs for :func:`triton_prepare`.

    ep_size R, max_tokens_per_rank N, top_k k, num_experts E (slot_count S, default E):
    ``R * MAX_CHUNKS`` flag words, 2 words of arrivals, two parities of R regions of
    ``16 + 4*S + 8*N*k`` bytes (rounded up to 16). E.g. R = 8, N = 8192, k = 8, S = 256: ~8.4 MiB.
    """
    slots = num_experts if slot_count is None else slot_count
    region, *_ = _region_ints(max_tokens_per_rank, top_k, slots)
    # flags, arrivals + pad, 2 parities x R regions (2 * region int32 = region words)
    return ep_size * MAX_CHUNKS + ARRIVAL_WORDS + ep_size * region


def exchange_chunks(ep_size: int, max_tokens_per_rank: int, max_programs: int) -> int:
    """C, the chunks per (source, destination): the exchange grid is (R, C). Every rank must
    get the same C, i.e. use the same ``PrepareConfig.max_programs``."""
    by_rows = cdiv(max(max_tokens_per_rank, 1), MIN_CHUNK_ROWS)
    return max(1, min(MAX_CHUNKS, max_programs // ep_size, by_rows))


class ExchangeConfig(NamedTuple):
    """Launch constants of one configuration; see :func:`exchange_config`."""

    words: int        # prepare_workspace_words
    chunks: int       # C
    chunk_rows: int   # send-order rows per chunk
    tail_rows: int    # padding rows per program
    region: int       # _region_ints
    hist_off: int
    ids_off: int
    weights_off: int
    k_pad: int
    r_pad: int
    s_pad: int
    pieces: tuple     # one int32 buffer for the receive side (kernels.prepare.carve)


@functools.lru_cache(maxsize=64)
def exchange_config(ep_size: int, max_tokens: int, top_k: int, slots: int,
                    max_programs: int) -> ExchangeConfig:
    """The exchange's launch constants for R, N, k, S, max_programs (cached: pure function)."""
    chunks = exchange_chunks(ep_size, max_tokens, max_programs)
    region, hist_off, ids_off, weights_off = _region_ints(max_tokens, top_k, slots)
    rows = max_tokens * ep_size
    # recv_cumsum, recv_local, recv_ids, recv_weights (fp32 bits), expert_counts, and an int64
    # status [R] that nobody reads (used when check=False and no status is given)
    pieces, _ = carve((ep_size, rows, rows * top_k, rows * top_k, ep_size * slots, 2 * ep_size))
    return ExchangeConfig(
        words=prepare_workspace_words(ep_size, max_tokens, top_k, slots, slots), chunks=chunks,
        chunk_rows=cdiv(max(max_tokens, 1), chunks),
        tail_rows=cdiv(max_tokens * ep_size, ep_size * chunks), region=region,
        hist_off=hist_off, ids_off=ids_off, weights_off=weights_off,
        k_pad=next_power_of_2(top_k), r_pad=next_power_of_2(ep_size),
        s_pad=next_power_of_2(slots), pieces=pieces)


def triton_prepare(topk_ids: torch.Tensor, topk_weights: torch.Tensor, workspace: torch.Tensor,
                   *, ep_rank: int, ep_size: int, num_experts: int, max_tokens_per_rank: int,
                   slot_count: Optional[int] = None, call_counter: torch.Tensor,
                   with_expert_counts: bool = True, config: PrepareConfig = PrepareConfig(),
                   check: bool = True, check_ids: bool = True,
                   status: Optional[torch.Tensor] = None) -> AlltoallPlan:
    """One rank's full prepare over a peer-mapped workspace: three launches (the local plan's
    two and the exchange), no host sync when ``check=False`` and ``check_ids=False`` (the fast
    path, CUDA-graph capturable).

    topk_ids:            [T, k] int32 contiguous, slot ids in ``[0, S]`` (S = padding).
    topk_weights:        [T, k] float32 contiguous, routing weights.
    workspace:           [R, words] int64 or uint64, row r = rank r's inbox, all rows mapped
                         here; ``words >= prepare_workspace_words(...)``; zeroed before call 0.
    ep_rank, ep_size:    this rank r and R.
    num_experts, max_tokens_per_rank, slot_count: E, N (>= T on every rank), S (default E).
    call_counter:        [1] int64 on the device, zeroed with the workspace: the number of
                         this call, read and advanced by the kernel (``a2a.protocol``); every
                         rank makes the same sequence of calls.
    with_expert_counts:  exchange every rank's expert_counts (the plan's [R, S]); else None.
    config:              :class:`~a2a.config.PrepareConfig`: the bound of the exchange grid
                         R * C and of each wait; the same on every rank.
    check:               after the launch, read the status (a host sync) and raise
                         :class:`~a2a.protocol.PrepareTimeout` naming the source ranks that did
                         not arrive. False (fast path, CUDA graphs): pass your own ``status``
                         to check later.
    check_ids:           read the local plan's device-side id range check before the exchange
                         (a host sync) and raise ValueError on an id outside ``[0, S]`` before
                         anything is sent. False: such ids are sent nowhere (as padding).
    status:              [R] int64, zeroed once; entry s becomes c + 1 when a wait for
                         source s timed out in call c. Default: a fresh zeroed tensor when
                         ``check``, else uninitialised words of the output buffer, never read.
    Returns this rank's :class:`AlltoallPlan`, equal to ``simulate_alltoall(...)[ep_rank]``.
    The first call of a configuration compiles: see :func:`warmup_prepare`.
    """
    num_tokens, top_k, max_tokens, slots = check_prepare_inputs(
        topk_ids, num_experts, ep_size, max_tokens_per_rank, slot_count, check_ids=False)
    device = topk_ids.device
    check_tensor("topk_ids", topk_ids, contiguous=True)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2, device=device,
                 contiguous=True)
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids "
                         f"{tuple(topk_ids.shape)}")
    cfg = exchange_config(ep_size, max_tokens, top_k, slots, config.max_programs)
    check_workspace(workspace, ep_size, cfg.words, device, "prepare_workspace_words")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} must be in [0, ep_size={ep_size})")
    check_call_counter(call_counter, device)
    check_status(status, ep_size, device)
    if status is None and check:
        status = new_status(ep_size, device)

    plan, scratch = launch_local_plan(topk_ids, ep_size, max_tokens, slots)
    if check_ids:  # before the exchange: a bad id raises before anything is sent
        raise_on_bad_ids(topk_ids, scratch, ep_size, max_tokens, slots)
    rows = max_tokens * ep_size
    buffer = torch.empty(sum(cfg.pieces), dtype=torch.int32, device=device)
    recv_cumsum, _, recv_local, _, recv_ids, _, recv_weights, _, expert_counts, _, unread, _ \
        = buffer.split(cfg.pieces)
    recv_ids = recv_ids.view(rows, top_k)
    recv_weights = recv_weights.view(torch.float32).view(rows, top_k)
    expert_counts = expert_counts.view(ep_size, slots) if with_expert_counts else None
    if status is None:
        status = unread.view(torch.int64)  # atomic_max on garbage: harmless, never read
    _exchange_kernel[(ep_size, cfg.chunks)](
        workspace, workspace.stride(0), topk_ids, topk_weights, plan.send_rank_count_cumsum,
        plan.send_rank_local_indices, plan.expert_counts, recv_cumsum, recv_local, recv_ids,
        recv_weights, expert_counts if with_expert_counts else recv_cumsum, status,
        call_counter, ep_rank, ep_size, slots, slots // ep_size, max_tokens, rows,
        cfg.chunk_rows, cfg.tail_rows, config.timeout_spins,
        2 * (ep_size * MAX_CHUNKS + ARRIVAL_WORDS), cfg.region, cfg.hist_off, cfg.ids_off,
        cfg.weights_off,
        TOP_K=top_k, K_PAD=cfg.k_pad, R_PAD=cfg.r_pad, S_PAD=cfg.s_pad, MAX_CHUNKS=MAX_CHUNKS,
        BLOCK_ROWS=BLOCK_ROWS, WITH_COUNTS=with_expert_counts, num_warps=NUM_WARPS)
    if check:
        raise_on_timeout(status, ep_rank, "prepare")
    return AlltoallPlan(
        send_rank_count_cumsum=plan.send_rank_count_cumsum,
        send_rank_local_indices=plan.send_rank_local_indices,
        backward_recv_rank_local_indices=plan.backward_recv_rank_local_indices,
        recv_rank_count_cumsum=recv_cumsum, recv_rank_local_indices=recv_local,
        recv_expert_ids=recv_ids, recv_weights=recv_weights, expert_counts=expert_counts,
        ep_rank=ep_rank, ep_size=ep_size, max_tokens_per_rank=max_tokens,
        num_tokens=num_tokens, top_k=top_k, slot_count=slots)


def warmup_prepare(device, *, ep_size: int, num_experts: int, max_tokens_per_rank: int,
                   top_k: int, slot_count: Optional[int] = None,
                   config: PrepareConfig = PrepareConfig(),
                   with_expert_counts=(True, False)) -> None:
    """Compile and load every kernel :func:`triton_prepare` launches for one configuration,
    without communicating, then synchronize ``device``.

    Runs one call per ``with_expert_counts`` value on a private zeroed workspace with
    ``timeout_spins=0`` (the waits give up at once; the result is discarded). Afterwards no
    call of this configuration compiles or loads a module, whatever its T and rank, as long as
    its tensors are 16-byte aligned like fresh allocations. Needed before R simulated ranks on
    one GPU call concurrently (see the module docstring); harmless elsewhere.
    """
    slots = num_experts if slot_count is None else slot_count
    device = torch.device(device)
    ids = torch.full((max_tokens_per_rank, top_k), slots, dtype=torch.int32, device=device)
    weights = torch.zeros((max_tokens_per_rank, top_k), dtype=torch.float32, device=device)
    cfg = exchange_config(ep_size, max_tokens_per_rank, top_k, slots, config.max_programs)
    workspace = torch.zeros((ep_size, cfg.words), dtype=torch.int64, device=device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    give_up = dataclasses.replace(config, timeout_spins=0)
    for counts in with_expert_counts:
        triton_prepare(ids, weights, workspace, ep_rank=0, ep_size=ep_size,
                       num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank,
                       slot_count=slots, call_counter=counter, with_expert_counts=counts,
                       config=give_up, check=False, check_ids=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
