"""The Triton transport: dispatch and combine as direct stores into the peers' mapped memory.

Each transfer is two kernels, the same pair for dispatch and combine (they differ only in the
cumsums and index lists they are given, exactly as FlashInfer's ``moe_comm`` is called):

``_send_kernel``  grid (R, C): program (q, chunk) copies chunk ``chunk`` of this rank's
                  segment for destination q (row ``send_indices[seg_start + i]`` of the input)
                  straight into q's inbox (area[me][parity][i]), then publishes
                  ``flag[me, chunk]`` of q's row: a CTA barrier (every thread's stores come
                  first), then one ``atomic_xchg(value = c + 1, sem="release", scope="sys")``.
``_recv_kernel``  grid (R, C): program (s, chunk) waits (bounded spin, acquire, system scope)
                  until ``flag[s, chunk]`` of our row is >= c + 1, a CTA barrier, then copies
                  chunk ``chunk`` of area[s][parity] (L2 reads, ``.cg``) to output rows
                  ``recv_indices[recv_start(s) + i]``.

``_transfer_kernel`` (``OVERLAP``, off by default): both in one launch, grid (R, 2C), the send
                  programs first; the receive programs copy each chunk out as it arrives while
                  this rank's sends still run, and every program of the launch counts itself
                  in before the counter moves on.

``_send_nvfp4_kernel`` (``triton_dispatch_nvfp4``) is a send kernel that quantizes on the way:
it reads each row of x once, quantizes it to NVFP4 in registers with ``kernels.quantize``'s
tile code and stores codes and scales into one ``nvfp4_row_bytes(H)`` slot; the receive kernel
then splits the slots into the two outputs (``SPLIT_WORDS``).

Both sides split a segment of ``count`` rows into the same C chunks of ``ceil(count / C)`` rows
(the sender's count for q equals q's receive count from the sender: the plan says so), so a
receiving program needs just one flag. The local segment (q = me) of ``triton_dispatch_rows``,
``triton_combine_rows`` and ``triton_dispatch_nvfp4`` skips the inbox: the send kernel stores it
straight into its output rows (LOCAL_DIRECT; the receive kernel runs after it on the stream and
leaves that segment alone), one copy instead of two; the fused combine, which reduces straight
from the inbox, keeps the inbox path.

dispatch: send = (send_rank_count_cumsum, send_rank_local_indices), recv =
(recv_rank_count_cumsum, recv_rank_local_indices = identity); output rows past total_recv are
zeroed by the receive kernel (spread over its programs).
combine:  send = (recv_rank_count_cumsum, recv_rank_local_indices), then either
``triton_combine_rows``: recv = (send_rank_count_cumsum, backward_recv_rank_local_indices)
into zeros ``[T*k, B]``, reduced by the caller (``a2a.alltoall.sum_over_slots``); or
``triton_combine`` (what ``MoEAlltoall`` uses): ``_slot_map_kernel`` records where each slot's
row comes back, and ``_reduce_kernel`` waits for every (source, chunk) flag and sums each
token's k slots straight from the inbox, in slot order in float32 (the adds of
``kernels.reduce.sum_slots_in_order``), so the result is bit-identical to the other
transports without the ``[T*k, B]`` buffer.

The workspace
-------------
``workspace [R, words]`` uint64/int64, row q = rank q's inbox, every row addressable here
(``MnnvlWorkspace``; for R simulated ranks on one GPU or in the interpreter, a plain zeroed
tensor). Rank q's row, for rows of B bytes (B % 16 == 0) and N = max_tokens_per_rank::

    flags [R, MAX_CHUNKS] int64       flag[s, chunk]: last call whose chunk ``chunk`` source s
                                      delivered, as c + 1 (0 = never)
    arrivals int64                    this rank's programs that have read the call number
                                      (the receive kernel's, or all of _transfer_kernel's;
                                      local use only; back to 0 after every call); flags
                                      and arrivals padded to 128 bytes
    area  [R][2][N][B] bytes          area[s][p]: the rows s sent in a call of parity p

One workspace carries one kind of transfer (dispatch or combine) of one row size: its calls
are numbered by its own counter.

The call counter lives on the device
------------------------------------
``call_counter`` ([1] int64, local, zeroed with the workspace): both kernels read c from it,
and the receive kernel advances it: each of its programs counts itself in ``arrivals`` after
reading c, and the last one to arrive (every program has then read c) sets the counter to
c + 1 and ``arrivals`` back to 0; the next transfer's kernels run after it on the stream
(with ``OVERLAP`` the one kernel's send programs count themselves in as well). No
call index comes from the host and no extra launch increments it, so a CUDA graph that
captures a transfer stays right at every replay (each replay is a new call). Every rank must
run the same sequence of transfers on a workspace.

Why ``>= c + 1`` and not ``==``: source s's send of call c + 1 needs only its own receive of
call c, which needs our send of call c, which runs before our receive of call c; so s may have
published c + 2 before we look. That value still proves the call-c rows were stored before it
(release covers all earlier stores). It cannot be c + 3: s's send of call c + 2 needs our send
of call c + 1, which runs after our receive of call c.

Why two parities suffice: source s writes area[s][p] again in call c + 2. Its send of call
c + 2 runs after its receive of call c + 1 (same stream), which waited for our call-c+1 flag;
our send of call c + 1 runs after our receive of call c (same stream) finished reading
area[s][p]. So call c + 2's stores cannot overtake our call-c reads.

Timeout: each wait spins at most ``timeout_spins`` times (one system-scope atomic each, well
over 0.1 us: the default is tens of seconds). On timeout the program writes zeros for the
missing rows (it never reads them) and records ``status[s] = max(status[s], c + 1)``;
:func:`raise_on_timeout` (``check=True``: one host sync) raises naming the source ranks. After
a timeout the workspace is stale: make a new one (zeroed, counter 0) on every rank.

Co-residency: no program of the send kernel waits, and receive programs wait only for other
ranks' send kernels. On one GPU per rank nothing has to be co-resident (any grid works). With
R simulated ranks on one GPU, the spinning receive programs of all ranks must leave room for
the send kernels: R * R * C receive programs (or R * 2 * max_programs programs of the fused
combine's reduce kernel) well within what the GPU holds at once (tests use a small
``max_programs``). Compilation waits for the device to be idle, so simulated ranks call
:func:`warmup` first (as for ``a2a.triton_prepare``).

Host syncs: none with ``check=False`` (two launches, one in-place add, caching-allocator
allocations): CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from a2a.triton_prepare import TIMEOUT_SPINS, advance_call, timed_out_sources, wait_for_flags
from kernels.casting import round_to
from kernels.quantize_details.nvfp4 import load_halves, nvfp4_tile
from kernels.spec.tensors import check_tensor
from kernels.types import AlltoallPlan

# Rows move as 32-bit words; a row must be a whole number of 16-byte vectors (as FlashInfer's
# moe_comm requires), so every dtype (bf16, packed nvfp4, scale bytes) moves bit-exactly.
ROW_ALIGN_BYTES = 16
WORD_BYTES = 4
# Chunks per (source, destination) pair: a fixed upper bound so that the flag layout does not
# depend on the launch.
MAX_CHUNKS = 64
# Flags and row starts are padded to this many bytes (and the row size to a multiple of it, so
# that every workspace's row stride is a multiple of 16 words: one compiled variant).
PAD_BYTES = 128
# Default bound on a kernel's grid R * C. NVLink stores need many bytes in flight: a first
# H200 run with 32 programs per peer and 4 KB tiles reached only ~115 GB/s per direction (the
# bench's probe, 64 CTAs x 16 KB, reaches ~355), hence 64 programs per peer at R = 2 (R * C is
# capped here, C at MAX_CHUNKS) and 16 KB tiles.
TRANSPORT_PROGRAMS = 256
# triton_dispatch_rows / triton_combine_rows as one launch of send and receive programs
# (``_transfer_kernel``): received chunks are copied out while this rank still sends, instead
# of by a second kernel after the send. Off until timed against the two-kernel path on 2 GPUs.
OVERLAP = False
# Words per tile: 4 warps x 32 threads x 32 words, eight 16-byte vectors per thread per step.
TILE_WORDS = 4096
NUM_WARPS = 4


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@triton.jit
def _segment(cumsum_ptr, peer):
    """(start, count) of ``peer``'s segment of an inclusive cumsum."""
    end = tl.load(cumsum_ptr + peer)
    start = tl.load(cumsum_ptr + peer - 1, mask=peer > 0, other=0)
    return start, end - start


@triton.jit
def _chunk_bounds(count, chunk, num_chunks):
    """Rows [begin, end) of chunk ``chunk`` when ``count`` rows split into ``num_chunks``."""
    per_chunk = (count + num_chunks - 1) // num_chunks
    begin = chunk * per_chunk
    return begin, tl.minimum(begin + per_chunk, count)


@triton.jit
def _chunk_range(cumsum_ptr, peer, chunk, num_chunks):
    """(segment start, chunk rows [begin, end)) of ``peer``'s segment, chunk ``chunk``."""
    seg_start, count = _segment(cumsum_ptr, peer)
    begin, end = _chunk_bounds(count, chunk, num_chunks)
    return seg_start, begin, end


@triton.jit
def _chunk_rows(indices_ptr, seg_start, row0, end, BLOCK_ROWS: tl.constexpr):
    """(rows [row0, +BLOCK_ROWS) of a chunk, which are < end, their int64 entries of the
    index list at seg_start + row)."""
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < end
    return rows, row_ok, tl.load(indices_ptr + seg_start + rows, mask=row_ok,
                                 other=0).to(tl.int64)


@triton.jit(do_not_specialize=["ep_rank", "max_rows"])
def _send_kernel(rows_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, counter_ptr,
                 ep_rank, max_rows, out_ptr, recv_cumsum_ptr, recv_indices_ptr,
                 FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr,
                 MAX_CHUNKS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_WORDS: tl.constexpr, LOCAL_DIRECT: tl.constexpr):
    """Program (destination, chunk): ``_send_chunk``."""
    _send_chunk(rows_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, ep_rank, max_rows,
                out_ptr, recv_cumsum_ptr, recv_indices_ptr, tl.program_id(0), tl.program_id(1),
                tl.num_programs(1), tl.load(counter_ptr), FLAG_WORDS, ROW_WORDS, MAX_CHUNKS,
                BLOCK_ROWS, BLOCK_WORDS, LOCAL_DIRECT)


@triton.jit
def _send_chunk(rows_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, ep_rank, max_rows,
                out_ptr, recv_cumsum_ptr, recv_indices_ptr, peer, chunk, num_chunks, call,
                FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
                LOCAL_DIRECT: tl.constexpr):
    """Copy chunk ``chunk`` (of ``num_chunks``) of this rank's segment for destination
    ``peer`` into its inbox in call ``call``, then publish the flag. LOCAL_DIRECT: the local
    segment (peer == ep_rank) goes straight to its output rows (``recv_indices[recv start of
    ep_rank + i]`` of out_ptr), not through our own inbox."""
    rows32 = rows_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    dest = _outbox(ws_ptr, ws_row_stride, peer, ep_rank, call, max_rows, FLAG_WORDS,
                   ROW_WORDS * 4).to(tl.pointer_type(tl.int32), bitcast=True)
    local = False
    recv_start = 0
    if LOCAL_DIRECT:
        local = peer == ep_rank
        recv_start = _segment(recv_cumsum_ptr, peer)[0]  # used where local
        if local:
            dest = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)

    seg_start, begin, end = _chunk_range(cumsum_ptr, peer, chunk, num_chunks)
    for row0 in range(begin, end, BLOCK_ROWS):
        rows, row_ok, source = _chunk_rows(indices_ptr, seg_start, row0, end, BLOCK_ROWS)
        target = rows.to(tl.int64)
        if LOCAL_DIRECT:
            target = _send_targets(recv_indices_ptr, recv_start, rows, row_ok, local)
        for word0 in tl.static_range(0, ROW_WORDS, BLOCK_WORDS):
            words = word0 + tl.arange(0, BLOCK_WORDS)
            ok = row_ok[:, None] & (words < ROW_WORDS)[None, :]
            values = tl.load(rows32 + source[:, None] * ROW_WORDS + words[None, :], mask=ok)
            tl.store(dest + target[:, None] * ROW_WORDS + words[None, :], values, mask=ok)
    _publish(ws_ptr, ws_row_stride, peer, ep_rank, chunk, call, MAX_CHUNKS)


@triton.jit
def _send_targets(recv_indices_ptr, recv_start, rows, row_ok, local):
    """(int64) rows a send program stores its chunk rows ``rows`` to: the same slots of the
    peer's inbox area, or, for the local segment (``local``: LOCAL_DIRECT), their output rows
    ``recv_indices[recv_start + row]``."""
    placed = tl.load(recv_indices_ptr + recv_start + rows, mask=row_ok & local, other=0)
    return tl.where(local, placed.to(tl.int64), rows.to(tl.int64))


@triton.jit
def _outbox(ws_ptr, ws_row_stride, peer, ep_rank, call, max_rows, FLAG_WORDS: tl.constexpr,
            ROW_BYTES: tl.constexpr):
    """Byte pointer to area[ep_rank][call % 2] of ``peer``'s inbox (rows of ROW_BYTES)."""
    ws8 = ws_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    return (ws8 + peer.to(tl.int64) * ws_row_stride * 8 + FLAG_WORDS * 4
            + ((ep_rank * 2 + call % 2) * max_rows).to(tl.int64) * ROW_BYTES)


@triton.jit
def _publish(ws_ptr, ws_row_stride, peer, ep_rank, chunk, call, MAX_CHUNKS: tl.constexpr):
    """Set flag[ep_rank, chunk] of ``peer``'s inbox to call + 1 after every thread's stores:
    a CTA barrier, then one release store at system scope."""
    tl.debug_barrier()
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    flag = ws64 + peer.to(tl.int64) * ws_row_stride + ep_rank * MAX_CHUNKS + chunk
    tl.atomic_xchg(flag, call + 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["ep_rank", "ep_size", "max_rows", "num_out_rows", "tail_rows",
                               "timeout_spins"])
def _recv_kernel(out_ptr, out2_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride,
                 counter_ptr, status_ptr, ep_rank, ep_size, max_rows, num_out_rows, tail_rows,
                 timeout_spins, FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr,
                 MAX_CHUNKS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_WORDS: tl.constexpr, ZERO_TAIL: tl.constexpr,
                 SPLIT_WORDS: tl.constexpr = 0, OUT2_WORDS: tl.constexpr = 0,
                 LOCAL_DIRECT: tl.constexpr = False):
    """SPLIT_WORDS > 0: words [0, SPLIT_WORDS) of each row go to ``out_ptr`` (rows of
    SPLIT_WORDS words), words [SPLIT_WORDS, +OUT2_WORDS) to ``out2_ptr`` (rows of OUT2_WORDS
    words), the rest of the row (padding) nowhere. LOCAL_DIRECT: the send kernel (earlier on
    this stream) stored our own segment in place; its programs only take part in the call.
    Program (source, chunk): ``_recv_chunk``, after counting itself in (``advance_call``)."""
    call = tl.load(counter_ptr)
    _arrive(ws_ptr, ws_row_stride, counter_ptr, ep_rank, ep_size, call, MAX_CHUNKS)
    _recv_chunk(out_ptr, out2_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, status_ptr,
                ep_rank, ep_size, max_rows, num_out_rows, tail_rows, timeout_spins,
                tl.program_id(0), tl.program_id(1), tl.num_programs(1), call, FLAG_WORDS,
                ROW_WORDS, MAX_CHUNKS, BLOCK_ROWS, BLOCK_WORDS, ZERO_TAIL, SPLIT_WORDS,
                OUT2_WORDS, LOCAL_DIRECT)


@triton.jit
def _arrive(ws_ptr, ws_row_stride, counter_ptr, ep_rank, ep_size, call,
            MAX_CHUNKS: tl.constexpr):
    """``advance_call`` on this rank's arrivals word (after the flags of its inbox row)."""
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    advance_call(counter_ptr, ws64 + ep_rank.to(tl.int64) * ws_row_stride
                 + ep_size * MAX_CHUNKS, call)


@triton.jit
def _recv_chunk(out_ptr, out2_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, status_ptr,
                ep_rank, ep_size, max_rows, num_out_rows, tail_rows, timeout_spins, peer, chunk,
                num_chunks, call, FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr,
                MAX_CHUNKS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
                ZERO_TAIL: tl.constexpr, SPLIT_WORDS: tl.constexpr, OUT2_WORDS: tl.constexpr,
                LOCAL_DIRECT: tl.constexpr):
    """Wait (bounded) for chunk ``chunk`` (of ``num_chunks``) of source ``peer`` in call
    ``call``, copy it from our inbox to its output rows, then zero this program's share of
    the output tail (ZERO_TAIL; the other arguments as in ``_recv_kernel``)."""
    parity = call % 2
    out32 = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    ws32 = ws_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    my_row = ep_rank.to(tl.int64) * ws_row_stride  # in 64-bit words

    # Wait for source `peer`'s chunk (bounded), then let every thread read what it covers.
    flag = ws64 + my_row + peer * MAX_CHUNKS + chunk
    expected = call + 1
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < expected) & (spins < timeout_spins):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        spins += 1
    arrived = seen >= expected
    if seen < expected:
        tl.atomic_max(status_ptr + peer, expected)
    tl.debug_barrier()

    area = (ws32 + my_row * 2 + FLAG_WORDS
            + ((peer * 2 + parity) * max_rows).to(tl.int64) * ROW_WORDS)
    seg_start, begin, end = _chunk_range(cumsum_ptr, peer, chunk, num_chunks)
    if LOCAL_DIRECT:
        end = tl.where(peer == ep_rank, begin, end)
    for row0 in range(begin, end, BLOCK_ROWS):
        rows, row_ok, target = _chunk_rows(indices_ptr, seg_start, row0, end, BLOCK_ROWS)
        for word0 in tl.static_range(0, ROW_WORDS, BLOCK_WORDS):
            words = word0 + tl.arange(0, BLOCK_WORDS)
            ok = row_ok[:, None] & (words < ROW_WORDS)[None, :]
            values = tl.load(area + rows.to(tl.int64)[:, None] * ROW_WORDS + words[None, :],
                             mask=ok & arrived, other=0, cache_modifier=".cg")
            _store_row_words(out32, out2_ptr, target, words, values, ok, ROW_WORDS,
                             SPLIT_WORDS, OUT2_WORDS)

    if ZERO_TAIL:  # output rows [total, num_out_rows), spread over the programs
        total = tl.load(cumsum_ptr + ep_size - 1)
        program = peer * num_chunks + chunk
        tail_begin = tl.maximum(program * tail_rows, total)
        tail_end = tl.minimum(program * tail_rows + tail_rows, num_out_rows)
        for row0 in range(tail_begin, tail_end, BLOCK_ROWS):
            rows = row0 + tl.arange(0, BLOCK_ROWS)
            row_ok = rows < tail_end
            for word0 in tl.static_range(0, ROW_WORDS, BLOCK_WORDS):
                words = word0 + tl.arange(0, BLOCK_WORDS)
                ok = row_ok[:, None] & (words < ROW_WORDS)[None, :]
                _store_row_words(out32, out2_ptr, rows.to(tl.int64), words,
                                 tl.zeros((BLOCK_ROWS, BLOCK_WORDS), tl.int32), ok, ROW_WORDS,
                                 SPLIT_WORDS, OUT2_WORDS)


@triton.jit(do_not_specialize=["ep_rank", "ep_size", "max_rows", "num_out_rows", "tail_rows",
                               "timeout_spins"])
def _transfer_kernel(rows_ptr, send_cumsum_ptr, send_indices_ptr, out_ptr, recv_cumsum_ptr,
                     recv_indices_ptr, ws_ptr, ws_row_stride, counter_ptr, status_ptr, ep_rank,
                     ep_size, max_rows, num_out_rows, tail_rows, timeout_spins,
                     FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr,
                     MAX_CHUNKS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     BLOCK_WORDS: tl.constexpr, ZERO_TAIL: tl.constexpr):
    """Send and receive of one transfer in one launch (``OVERLAP``), grid (R, 2C): programs
    (q, c < C) are ``_send_kernel``'s (destination q, chunk c), LOCAL_DIRECT; programs
    (s, C + c) are ``_recv_kernel``'s (source s, chunk c), which copy each chunk as soon as it
    arrives, while this rank's sends still run. Every program counts itself in before the
    counter moves on (so no send program can read the next call's number). Send programs come
    first in the launch order (lower block ids), so the spinning receive programs can never
    hold back a send they wait for."""
    num_chunks = tl.num_programs(1) // 2
    peer = tl.program_id(0)
    call = tl.load(counter_ptr)
    _arrive(ws_ptr, ws_row_stride, counter_ptr, ep_rank, ep_size, call, MAX_CHUNKS)
    if tl.program_id(1) < num_chunks:
        _send_chunk(rows_ptr, send_cumsum_ptr, send_indices_ptr, ws_ptr, ws_row_stride,
                    ep_rank, max_rows, out_ptr, recv_cumsum_ptr, recv_indices_ptr, peer,
                    tl.program_id(1), num_chunks, call, FLAG_WORDS, ROW_WORDS, MAX_CHUNKS,
                    BLOCK_ROWS, BLOCK_WORDS, True)
    else:
        _recv_chunk(out_ptr, out_ptr, recv_cumsum_ptr, recv_indices_ptr, ws_ptr, ws_row_stride,
                    status_ptr, ep_rank, ep_size, max_rows, num_out_rows, tail_rows,
                    timeout_spins, peer, tl.program_id(1) - num_chunks, num_chunks, call,
                    FLAG_WORDS, ROW_WORDS, MAX_CHUNKS, BLOCK_ROWS, BLOCK_WORDS, ZERO_TAIL, 0,
                    0, True)


@triton.jit
def _store_row_words(out32, out2_ptr, target, words, values, ok, ROW_WORDS: tl.constexpr,
                     SPLIT_WORDS: tl.constexpr, OUT2_WORDS: tl.constexpr):
    """Store words ``words`` of rows ``target`` (int64) of the received rows: into one output
    of ROW_WORDS-word rows, or (SPLIT_WORDS > 0) split between two (``_recv_kernel``)."""
    if SPLIT_WORDS == 0:
        tl.store(out32 + target[:, None] * ROW_WORDS + words[None, :], values, mask=ok)
    else:
        out2 = out2_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        first = (words < SPLIT_WORDS)[None, :]
        second = ((words >= SPLIT_WORDS) & (words < SPLIT_WORDS + OUT2_WORDS))[None, :]
        tl.store(out32 + target[:, None] * SPLIT_WORDS + words[None, :], values,
                 mask=ok & first)
        tl.store(out2 + target[:, None] * OUT2_WORDS + (words - SPLIT_WORDS)[None, :], values,
                 mask=ok & second)


@triton.jit(do_not_specialize=["ep_rank", "max_rows"])
def _send_nvfp4_kernel(words_ptr, stride_row, global_scale_ptr, cumsum_ptr, indices_ptr, ws_ptr,
                       ws_row_stride, counter_ptr, ep_rank, max_rows, hidden, packed_ptr,
                       scales_ptr, recv_cumsum_ptr, recv_indices_ptr,
                       FLAG_WORDS: tl.constexpr, ROW_BYTES: tl.constexpr,
                       MAX_CHUNKS: tl.constexpr, IN_KIND: tl.constexpr,
                       WORD_ASM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                       BLOCKS: tl.constexpr):
    """``_send_kernel`` that quantizes on the way: program (q, chunk) reads the rows of its
    chunk (``indices_ptr`` through the cumsum's segment q) from x, quantizes them to NVFP4 in
    registers (``kernels.quantize``'s tile code, IEEE recipe, linear scales) and stores each
    row's packed codes (H/2 bytes) and scales (H/16 bytes) into one ROW_BYTES slot of q's
    inbox, then publishes the flag as ``_send_kernel`` does. The local segment (q = ep_rank)
    goes straight to its rows of the outputs ``packed_ptr`` / ``scales_ptr`` (LOCAL_DIRECT of
    ``_send_kernel``)."""
    peer = tl.program_id(0)  # destination
    chunk = tl.program_id(1)
    call = tl.load(counter_ptr)
    codes = _outbox(ws_ptr, ws_row_stride, peer, ep_rank, call, max_rows, FLAG_WORDS, ROW_BYTES)
    scale_bytes = codes + hidden // 2
    local = peer == ep_rank
    recv_start = _segment(recv_cumsum_ptr, peer)[0]  # used where local
    if local:
        codes = packed_ptr
        scale_bytes = scales_ptr
    code_stride = tl.where(local, hidden // 2, ROW_BYTES).to(tl.int64)
    scale_stride = tl.where(local, hidden // 16, ROW_BYTES).to(tl.int64)
    global_scale = tl.load(global_scale_ptr)
    num_blocks = hidden // 16

    seg_start, begin, end = _chunk_range(cumsum_ptr, peer, chunk, tl.num_programs(1))
    for row0 in range(begin, end, BLOCK_ROWS):
        rows, row_ok, source = _chunk_rows(indices_ptr, seg_start, row0, end, BLOCK_ROWS)
        in_ptrs = words_ptr + source * stride_row
        target = _send_targets(recv_indices_ptr, recv_start, rows, row_ok, local)
        for block0 in range(0, num_blocks, BLOCKS):
            w = load_halves(in_ptrs, row_ok, block0, num_blocks, BLOCKS)
            nvfp4_tile(w[0], w[1], global_scale, codes + target * code_stride,
                       scale_bytes + target * scale_stride, rows, block0, end, num_blocks,
                       end, num_blocks, IN_KIND, 0, False, WORD_ASM, BLOCK_ROWS, BLOCKS, "")
    _publish(ws_ptr, ws_row_stride, peer, ep_rank, chunk, call, MAX_CHUNKS)


@triton.jit(do_not_specialize=["ep_size", "num_slots", "max_rows"])
def _slot_map_kernel(slot_map_ptr, cumsum_ptr, backward_ptr, ep_size, num_slots, max_rows,
                     BLOCK_ROWS: tl.constexpr):
    """One program: ``slot_map[:num_slots] = -1``, then for row i of this rank's send segment
    to peer s, ``slot_map[backward[i]] = s * N + i`` (where the row comes back in the combine
    inbox). One launch, no separate fill: the barrier orders the fill before the scatter."""
    offsets = tl.arange(0, BLOCK_ROWS)
    start = 0
    while start < num_slots:  # (while loops: the interpreter cannot range() over an argument)
        tl.store(slot_map_ptr + start + offsets, -1, mask=start + offsets < num_slots)
        start += BLOCK_ROWS
    tl.debug_barrier()
    peer = 0
    while peer < ep_size:
        seg_start, count = _segment(cumsum_ptr, peer)
        row0 = 0
        while row0 < count:
            rows = row0 + offsets
            ok = rows < count
            slot = tl.load(backward_ptr + seg_start + rows, mask=ok, other=0)
            tl.store(slot_map_ptr + slot, peer * max_rows + rows, mask=ok)
            row0 += BLOCK_ROWS
        peer += 1


@triton.jit(do_not_specialize=["ep_rank", "ep_size", "max_rows", "num_tokens", "num_chunks",
                               "timeout_spins"])
def _reduce_kernel(out_ptr, slot_map_ptr, ws_ptr, ws_row_stride, counter_ptr, status_ptr,
                   ep_rank, ep_size, max_rows, num_tokens, num_chunks, timeout_spins,
                   FLAG_WORDS: tl.constexpr, ROW_ELEMS: tl.constexpr, ELEM_BYTES: tl.constexpr,
                   TOP_K: tl.constexpr, MAX_CHUNKS: tl.constexpr, FLAG_BLOCK: tl.constexpr,
                   BLOCK_TOKENS: tl.constexpr, BLOCK_ELEMS: tl.constexpr):
    """Combine's receive side fused with the reduction over k (grid-stride over token tiles).

    Waits (bounded) until every source's every chunk of this call has arrived, then for each
    token t: ``acc = 0; acc = acc + float32(row of slot j)`` for j = 0..k-1 (absent slots add
    +0), stored once in the payload dtype: the adds of ``reference.sum_slots_in_order``.
    """
    call = tl.load(counter_ptr)
    parity = call % 2
    expected = call + 1
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    wsE = ws_ptr.to(out_ptr.dtype, bitcast=True)
    my_row = ep_rank.to(tl.int64) * ws_row_stride  # in 64-bit words
    advance_call(counter_ptr, ws64 + my_row + ep_size * MAX_CHUNKS, call)

    # Every (source, chunk) flag of this call: one vector of acquire loads, spun on (bounded).
    lanes = tl.arange(0, FLAG_BLOCK)
    source = lanes // num_chunks
    wanted = lanes < ep_size * num_chunks
    ok = wait_for_flags(ws64 + my_row + source * MAX_CHUNKS + lanes % num_chunks, wanted,
                        expected, timeout_spins)
    arrived = tl.min(ok.to(tl.int32), axis=0) != 0
    tl.atomic_max(status_ptr + source, expected, mask=wanted & (ok == 0))
    tl.debug_barrier()

    # Row i of source s in this call's inbox, in payload elements from the workspace start.
    area = my_row * (8 // ELEM_BYTES) + FLAG_WORDS * (4 // ELEM_BYTES)
    tokens0 = tl.arange(0, BLOCK_TOKENS)
    elems0 = tl.arange(0, BLOCK_ELEMS)
    tiles_per_row = (ROW_ELEMS + BLOCK_ELEMS - 1) // BLOCK_ELEMS
    num_tiles = tl.cdiv(num_tokens, BLOCK_TOKENS) * tiles_per_row
    tile = tl.program_id(0)
    while tile < num_tiles:
        tokens = (tile // tiles_per_row) * BLOCK_TOKENS + tokens0
        elems = (tile % tiles_per_row) * BLOCK_ELEMS + elems0
        token_ok = tokens < num_tokens
        elem_ok = elems < ROW_ELEMS
        acc = tl.zeros((BLOCK_TOKENS, BLOCK_ELEMS), tl.float32)
        for slot in tl.static_range(TOP_K):
            where = tl.load(slot_map_ptr + tokens.to(tl.int64) * TOP_K + slot, mask=token_ok,
                            other=-1)
            src = where // max_rows
            row = ((src * 2 + parity) * max_rows + where % max_rows).to(tl.int64)
            present = (where >= 0) & arrived
            values = tl.load(wsE + area + row[:, None] * ROW_ELEMS + elems[None, :],
                             mask=present[:, None] & elem_ok[None, :], other=0.0,
                             cache_modifier=".cg")
            acc = acc + values.to(tl.float32)
        tl.store(out_ptr + tokens.to(tl.int64)[:, None] * ROW_ELEMS + elems[None, :],
                 round_to(acc, out_ptr.dtype.element_ty),
                 mask=token_ok[:, None] & elem_ok[None, :])
        tile += tl.num_programs(0)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def _flag_bytes(ep_size: int) -> int:
    """Bytes of the flags and the arrivals word (module docstring), padded."""
    return _round_up(ep_size * MAX_CHUNKS * 8 + 8, PAD_BYTES)


def transport_workspace_bytes(ep_size: int, max_tokens_per_rank: int, row_bytes: int) -> int:
    """Bytes per rank of one Triton-transport workspace (one transfer kind, rows of
    ``row_bytes``): flags ``[R, MAX_CHUNKS]`` int64 and ``[R][2][N]`` rows, rounded up to 128
    bytes. E.g. R = 8, N = 1024, bf16 rows of H = 7168: 235 MB."""
    check_row_bytes("row_bytes", row_bytes)
    return _round_up(_flag_bytes(ep_size) + ep_size * 2 * max_tokens_per_rank * row_bytes,
                     PAD_BYTES)


def transport_chunks(ep_size: int, max_programs: int = TRANSPORT_PROGRAMS) -> int:
    """C, the programs per peer of both kernels (grid (R, C)); the same on every rank."""
    return max(1, min(MAX_CHUNKS, max_programs // ep_size))


def check_row_bytes(name: str, row_bytes: int) -> None:
    """Raise ValueError unless rows of ``row_bytes`` bytes are a positive multiple of 16."""
    if row_bytes <= 0 or row_bytes % ROW_ALIGN_BYTES:
        raise ValueError(f"{name}: rows of {row_bytes} bytes; the Triton transport moves rows of "
                         f"a positive multiple of {ROW_ALIGN_BYTES} bytes: pad the hidden size "
                         f"or use the 'torch' transport")


def _tile(row_words: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_WORDS) of the copy tiles for rows of ``row_words`` words."""
    block_words = min(triton.next_power_of_2(row_words), TILE_WORDS)
    return max(1, TILE_WORDS // block_words), block_words


def _check_common(rows: torch.Tensor, plan: AlltoallPlan, workspace: torch.Tensor,
                  call_counter: torch.Tensor, status: Optional[torch.Tensor],
                  expected_rows: int, what: str) -> int:
    """Validate one transfer's inputs; returns the row size in bytes."""
    check_tensor(what, rows, dtype=torch.uint8, ndim=2, contiguous=True)
    if rows.shape[0] != expected_rows:
        raise ValueError(f"{what} has {rows.shape[0]} rows, expected {expected_rows}")
    check_row_bytes(what, rows.shape[1])
    _check_state(plan, workspace, call_counter, status, rows.shape[1], rows.device)
    return rows.shape[1]


def _check_state(plan: AlltoallPlan, workspace: torch.Tensor, call_counter: torch.Tensor,
                 status: Optional[torch.Tensor], row_bytes: int, device: torch.device) -> None:
    """Validate the workspace (for rows of ``row_bytes``), call counter and status."""
    check_tensor("workspace", workspace, dtype=(torch.int64, torch.uint64), ndim=2,
                 device=device)
    needed = transport_workspace_bytes(plan.ep_size, plan.max_tokens_per_rank, row_bytes) // 8
    if workspace.shape[0] != plan.ep_size or workspace.shape[1] < needed \
            or workspace.stride(1) != 1:
        raise ValueError(f"workspace must be [ep_size={plan.ep_size}, >= {needed}] with unit "
                         f"column stride (transport_workspace_bytes for rows of {row_bytes} "
                         f"bytes); got shape {tuple(workspace.shape)} strides "
                         f"{workspace.stride()}")
    check_tensor("call_counter", call_counter, dtype=torch.int64, ndim=1, device=device)
    if call_counter.numel() != 1:
        raise ValueError(f"call_counter must have 1 entry, got {call_counter.numel()}")
    if status is not None:
        check_tensor("status", status, dtype=torch.int64, ndim=1, device=device)
        if status.numel() != plan.ep_size:
            raise ValueError(f"status must have ep_size={plan.ep_size} entries, got "
                             f"{status.numel()}")


def _copy_constants(ep_size: int, row_bytes: int) -> dict:
    """Launch constants of the row-copying send and receive kernels for rows of
    ``row_bytes`` bytes."""
    row_words = row_bytes // WORD_BYTES
    block_rows, block_words = _tile(row_words)
    return dict(FLAG_WORDS=_flag_bytes(ep_size) // WORD_BYTES, ROW_WORDS=row_words,
                MAX_CHUNKS=MAX_CHUNKS, BLOCK_ROWS=block_rows, BLOCK_WORDS=block_words,
                num_warps=NUM_WARPS)


def _new_status(status: Optional[torch.Tensor], plan: AlltoallPlan,
                device: torch.device) -> torch.Tensor:
    """``status``, or a fresh zeroed [R] int64 one."""
    if status is None:
        status = torch.zeros(plan.ep_size, dtype=torch.int64, device=device)
    return status


def _send(rows, send_cumsum, send_indices, plan, workspace, call_counter, max_programs, *,
          out=None, recv_cumsum=None, recv_indices=None):
    """Launch the send kernel; returns (chunks, the copy-tile constants). With ``out`` (and
    the receive side's cumsum and indices), the local segment is stored straight into its
    output rows (LOCAL_DIRECT), else into our own inbox like the others."""
    ep_size = plan.ep_size
    chunks = transport_chunks(ep_size, max_programs)
    constants = dict(_copy_constants(ep_size, rows.shape[1]), LOCAL_DIRECT=out is not None)
    # (out, its cumsum and indices) of the local segment; unused stand-ins without ``out``
    local = ((out, recv_cumsum, recv_indices) if out is not None
             else (rows, send_cumsum, send_indices))
    _send_kernel[(ep_size, chunks)](
        rows, send_cumsum, send_indices, workspace, workspace.stride(0), call_counter,
        plan.ep_rank, plan.max_tokens_per_rank, *local, **constants)
    return chunks, constants


def _tail_rows(num_out_rows: int, plan: AlltoallPlan, chunks: int) -> int:
    """Output rows per receive program (R x chunks of them) for zeroing the output's tail."""
    return triton.cdiv(max(num_out_rows, 1), plan.ep_size * chunks)


def _receive(out, out2, recv_cumsum, recv_indices, plan, workspace, call_counter, status,
             chunks, *, timeout_spins, check, **constants):
    """Launch the receive kernel (grid R x chunks; with ZERO_TAIL the output rows past the
    received ones are spread over its programs), then, with ``check``, raise on a timeout."""
    num_out_rows = out.shape[0]
    _recv_kernel[(plan.ep_size, chunks)](
        out, out2, recv_cumsum, recv_indices, workspace, workspace.stride(0), call_counter,
        status, plan.ep_rank, plan.ep_size, plan.max_tokens_per_rank, num_out_rows,
        _tail_rows(num_out_rows, plan, chunks), timeout_spins, **constants)
    if check:
        raise_on_timeout(status, plan.ep_rank)


def _transfer(rows, out, send_cumsum, send_indices, recv_cumsum, recv_indices, plan, workspace,
              call_counter, status, *, zero_tail, timeout_spins, max_programs, check):
    status = _new_status(status, plan, rows.device)
    if OVERLAP:
        chunks = transport_chunks(plan.ep_size, max_programs)
        _transfer_kernel[(plan.ep_size, 2 * chunks)](
            rows, send_cumsum, send_indices, out, recv_cumsum, recv_indices, workspace,
            workspace.stride(0), call_counter, status, plan.ep_rank, plan.ep_size,
            plan.max_tokens_per_rank, out.shape[0], _tail_rows(out.shape[0], plan, chunks),
            timeout_spins, ZERO_TAIL=zero_tail, **_copy_constants(plan.ep_size, rows.shape[1]))
        if check:
            raise_on_timeout(status, plan.ep_rank)
        return out
    chunks, constants = _send(rows, send_cumsum, send_indices, plan, workspace, call_counter,
                              max_programs, out=out, recv_cumsum=recv_cumsum,
                              recv_indices=recv_indices)
    _receive(out, out, recv_cumsum, recv_indices, plan, workspace, call_counter, status,
             chunks, timeout_spins=timeout_spins, check=check, ZERO_TAIL=zero_tail,
             **constants)
    return out


def triton_dispatch_rows(rows: torch.Tensor, plan: AlltoallPlan, workspace: torch.Tensor, *,
                         call_counter: torch.Tensor, status: Optional[torch.Tensor] = None,
                         check: bool = True, timeout_spins: int = TIMEOUT_SPINS,
                         max_programs: int = TRANSPORT_PROGRAMS) -> torch.Tensor:
    """Send this rank's rows where the plan says (collective: every rank of the workspace).

    rows:          [T, B] uint8 contiguous (a byte view of any payload), T = plan.num_tokens,
                   B % 16 == 0.
    plan:          this rank's :class:`AlltoallPlan`.
    workspace:     [R, words] uint64/int64, this transfer's inbox rows (module docstring),
                   ``words >= transport_workspace_bytes(R, N, B) // 8``, zeroed before its
                   first call; used for dispatches of B-byte rows only.
    call_counter:  [1] int64 on the rows' device, zeroed with the workspace; the kernels read
                   the call number from it and the receive kernel advances it.
    status:        [R] int64 or None: entry s becomes c + 1 when the wait for source s timed
                   out in call c. None: a fresh zeroed one (read when ``check``).
    check:         read the status after the call (one host sync) and raise
                   :class:`TransportTimeout` naming the missing source ranks. False: no host
                   sync (CUDA graphs, benchmarks).
    timeout_spins: bound of each wait; max_programs: bound of the grid R * C (same on all ranks).
    Returns [N*R, B] uint8: rows by source rank, then the source's send order; rows past
    total_recv are 0 (what ``torch_dispatch_rows`` and ``flashinfer_dispatch_rows`` return).
    """
    _check_common(rows, plan, workspace, call_counter, status, plan.num_tokens, "dispatch rows")
    out = torch.empty((plan.max_tokens_per_rank * plan.ep_size, rows.shape[1]),
                      dtype=torch.uint8, device=rows.device)
    return _transfer(rows, out, plan.send_rank_count_cumsum, plan.send_rank_local_indices,
                     plan.recv_rank_count_cumsum, plan.recv_rank_local_indices, plan,
                     workspace, call_counter, status, zero_tail=True,
                     timeout_spins=timeout_spins, max_programs=max_programs, check=check)


def triton_combine_rows(rows: torch.Tensor, plan: AlltoallPlan, workspace: torch.Tensor, *,
                        call_counter: torch.Tensor, status: Optional[torch.Tensor] = None,
                        check: bool = True, timeout_spins: int = TIMEOUT_SPINS,
                        max_programs: int = TRANSPORT_PROGRAMS) -> torch.Tensor:
    """Return every received row to its source, scattered by slot (collective).

    rows: [N*R, B] uint8 contiguous, this rank's output per received row (the plan's row
          order; rows past total_recv are not read), B % 16 == 0.
    The other arguments as in :func:`triton_dispatch_rows` (a separate workspace and counter:
    combine's transfers are numbered on their own).
    Returns [T*k, B] uint8: the row returned for (token t, first slot j on the rank that
    computed it) at ``t*k + j``, zeros elsewhere (the caller sums over k with
    ``sum_over_slots``), as ``torch_combine_rows`` and ``flashinfer_combine_rows``.
    """
    _check_common(rows, plan, workspace, call_counter, status,
                  plan.max_tokens_per_rank * plan.ep_size, "combine rows")
    out = torch.zeros((plan.num_tokens * plan.top_k, rows.shape[1]), dtype=torch.uint8,
                      device=rows.device)
    return _transfer(rows, out, plan.recv_rank_count_cumsum, plan.recv_rank_local_indices,
                     plan.send_rank_count_cumsum, plan.backward_recv_rank_local_indices, plan,
                     workspace, call_counter, status, zero_tail=False,
                     timeout_spins=timeout_spins, max_programs=max_programs, check=check)


# NVFP4 dispatch with the quantizer in the send kernel: steps of NVFP4_SEND_TILE scale blocks
# (up to NVFP4_SEND_BLOCKS per row, the rest in rows) on 4 warps, i.e. 16 KB of bf16 per step,
# four blocks per thread: the byte-row send kernel's tile size (a first guess; not yet timed).
NVFP4_SEND_BLOCKS, NVFP4_SEND_TILE, NVFP4_SEND_WARPS = 64, 512, 4
NVFP4_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def nvfp4_row_bytes(hidden: int) -> int:
    """Bytes of one NVFP4 row in the inbox: H/2 packed codes then H/16 scales, padded to 16."""
    return _round_up(hidden // 2 + hidden // 16, ROW_ALIGN_BYTES)


def triton_dispatch_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, plan: AlltoallPlan,
                          workspace: torch.Tensor, *, call_counter: torch.Tensor,
                          status: Optional[torch.Tensor] = None, check: bool = True,
                          timeout_spins: int = TIMEOUT_SPINS,
                          max_programs: int = TRANSPORT_PROGRAMS
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch with NVFP4 quantization fused into the send (collective).

    Each sent row is read from x once, quantized in registers (the IEEE recipe of
    ``kernels.quantize.quantize_nvfp4``, bit-exact, linear scales) and stored as packed codes
    and scales straight into the destination's inbox, one ``nvfp4_row_bytes(H)`` slot per row;
    the receive kernel splits the slots into the two outputs (the local rows go straight into
    them). One transfer instead of a local quantize pass and two transfers.

    x:            [T, H] bf16/fp16/fp32, T = plan.num_tokens, H % 64 == 0 (the scales of a
                  row are whole 32-bit words).
    global_scale: [1] float32 NVFP4 encode scale on x's device.
    workspace:    as in :func:`triton_dispatch_rows` for rows of ``nvfp4_row_bytes(H)`` bytes
                  (its own workspace and counter).
    Returns (packed [N*R, H/2] uint8, two codes per byte, element 2i in the low nibble;
    scales [N*R, H/16] uint8 e4m3 bits, linear), rows by source rank then the source's send
    order, rows past total_recv 0: ``quantize_nvfp4`` of the rows :func:`triton_dispatch_rows`
    would deliver.
    """
    from kernels.quantize import DEFAULT_NVFP4, nvfp4_word_asm
    from kernels.quantize_details.words import as_pairs
    from kernels.spec.quant import check_global_scale
    check_tensor("x", x, dtype=NVFP4_DTYPES, ndim=2)
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows, expected plan.num_tokens={plan.num_tokens}")
    hidden = x.shape[1]
    if hidden % 64 or hidden == 0:
        raise ValueError(f"x has H={hidden} columns; the fused NVFP4 dispatch needs H % 64 == 0 "
                         f"(its scale rows, H/16 bytes, move as whole 32-bit words): quantize "
                         f"first and dispatch codes and scales as two transfers instead")
    check_global_scale(global_scale, x.device)
    row_bytes = nvfp4_row_bytes(hidden)
    _check_state(plan, workspace, call_counter, status, row_bytes, x.device)
    ep_size, max_rows = plan.ep_size, plan.max_tokens_per_rank
    status = _new_status(status, plan, x.device)
    words, stride_row, in_kind = as_pairs(x)
    chunks = transport_chunks(ep_size, max_programs)
    blocks = min(NVFP4_SEND_BLOCKS, triton.next_power_of_2(hidden // 16))
    block_rows = max(1, NVFP4_SEND_TILE // blocks)
    constants = _copy_constants(ep_size, row_bytes)  # the receive kernel's
    num_out_rows = max_rows * ep_size
    packed = torch.empty((num_out_rows, hidden // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((num_out_rows, hidden // 16), dtype=torch.uint8, device=x.device)
    _send_nvfp4_kernel[(ep_size, chunks)](
        words, stride_row, global_scale, plan.send_rank_count_cumsum,
        plan.send_rank_local_indices, workspace, workspace.stride(0), call_counter,
        plan.ep_rank, max_rows, hidden, packed, scales, plan.recv_rank_count_cumsum,
        plan.recv_rank_local_indices, FLAG_WORDS=constants["FLAG_WORDS"], ROW_BYTES=row_bytes,
        MAX_CHUNKS=MAX_CHUNKS, IN_KIND=in_kind,
        WORD_ASM=nvfp4_word_asm(x.device, in_kind, False, stride_row, DEFAULT_NVFP4),
        BLOCK_ROWS=block_rows, BLOCKS=blocks, num_warps=NVFP4_SEND_WARPS, enable_fp_fusion=False)
    _receive(packed, scales, plan.recv_rank_count_cumsum, plan.recv_rank_local_indices, plan,
             workspace, call_counter, status, chunks, timeout_spins=timeout_spins, check=check,
             ZERO_TAIL=True, SPLIT_WORDS=hidden // 8, OUT2_WORDS=hidden // 64,
             LOCAL_DIRECT=True, **constants)
    return packed, scales


# Fused combine: token tiles of the reduction (elements per tile: 4 tokens x 1024).
REDUCE_TOKENS, REDUCE_ELEMS, REDUCE_WARPS = 4, 1024, 8
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_combine(rows: torch.Tensor, plan: AlltoallPlan, workspace: torch.Tensor, *,
                   dtype: torch.dtype, call_counter: torch.Tensor,
                   status: Optional[torch.Tensor] = None, check: bool = True,
                   timeout_spins: int = TIMEOUT_SPINS,
                   max_programs: int = TRANSPORT_PROGRAMS) -> torch.Tensor:
    """Combine with the reduction over k fused into the receive (collective).

    The rows travel exactly as in :func:`triton_combine_rows` (same workspace layout, flags and
    counter), but instead of scattering them into ``[T*k, B]`` zeros the receive kernel sums,
    per token, the rows of its k slots in slot order in float32 and rounds once to ``dtype``:
    the adds of ``kernels.reduce.sum_slots_in_order``, so the result is bit-identical to
    ``sum_over_slots(triton_combine_rows(...))`` and to the other transports. No ``[T*k, B]``
    buffer is written or read.

    rows:  [N*R, B] uint8 contiguous, this rank's output per received row viewed as bytes of
           ``dtype`` (bf16, fp16 or fp32); rows past total_recv are not read.
    Returns [T, B / itemsize] of ``dtype``. A timed-out wait yields zeros (and the status entry
    of every source that was missing, as in :func:`triton_dispatch_rows`).
    """
    _check_common(rows, plan, workspace, call_counter, status,
                  plan.max_tokens_per_rank * plan.ep_size, "combine rows")
    if dtype not in COMBINE_DTYPES:
        raise ValueError(f"dtype must be one of {COMBINE_DTYPES}, got {dtype}")
    elem_bytes = dtype.itemsize  # divides the row size: _check_common asks for B % 16 == 0
    ep_size, max_rows = plan.ep_size, plan.max_tokens_per_rank
    num_tokens, top_k = plan.num_tokens, plan.top_k
    device = rows.device
    status = _new_status(status, plan, device)
    row_elems = rows.shape[1] // elem_bytes
    # Where slot t*k + j comes back: s * N + i (row i of source s's inbox area) or -1.
    slot_map = torch.empty((max(num_tokens * top_k, 1),), dtype=torch.int32, device=device)
    _slot_map_kernel[(1,)](slot_map, plan.send_rank_count_cumsum,
                           plan.backward_recv_rank_local_indices, ep_size, num_tokens * top_k,
                           max_rows, BLOCK_ROWS=1024)
    chunks, constants = _send(rows, plan.recv_rank_count_cumsum, plan.recv_rank_local_indices,
                              plan, workspace, call_counter, max_programs)
    out = torch.empty((num_tokens, row_elems), dtype=dtype, device=device)
    block_elems = min(REDUCE_ELEMS, triton.next_power_of_2(row_elems))
    tiles = triton.cdiv(num_tokens, REDUCE_TOKENS) * triton.cdiv(row_elems, block_elems)
    grid = (max(1, min(tiles, 2 * max_programs)),)
    _reduce_kernel[grid](
        out, slot_map, workspace, workspace.stride(0), call_counter, status, plan.ep_rank,
        ep_size, max_rows, num_tokens, chunks, timeout_spins,
        FLAG_WORDS=constants["FLAG_WORDS"], ROW_ELEMS=row_elems, ELEM_BYTES=elem_bytes,
        TOP_K=top_k, MAX_CHUNKS=MAX_CHUNKS,
        FLAG_BLOCK=triton.next_power_of_2(ep_size * chunks), BLOCK_TOKENS=REDUCE_TOKENS,
        BLOCK_ELEMS=block_elems, num_warps=REDUCE_WARPS)
    if check:
        raise_on_timeout(status, plan.ep_rank)
    return out


def warmup(device, *, ep_size: int, max_tokens_per_rank: int, row_bytes: int, top_k: int = 1,
           max_programs: int = TRANSPORT_PROGRAMS,
           combine_dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile and load the kernels of dispatch and combine (both combines, the fused one for
    ``combine_dtype``) for rows of ``row_bytes`` bytes, without communicating, then
    synchronize ``device``.

    Runs one dispatch and one combine of an empty plan (no rows) on a private workspace with
    ``timeout_spins=0``. Needed before R simulated ranks on one GPU call concurrently (loading a
    module waits for an idle device; see the module docstring); harmless elsewhere.
    """
    from kernels.types import UNUSED
    device = torch.device(device)
    rows_total = max_tokens_per_rank * ep_size
    zeros = torch.zeros(ep_size, dtype=torch.int32, device=device)
    unused = torch.full((rows_total,), UNUSED, dtype=torch.int32, device=device)
    plan = AlltoallPlan(
        send_rank_count_cumsum=zeros, send_rank_local_indices=unused,
        backward_recv_rank_local_indices=unused, recv_rank_count_cumsum=zeros,
        recv_rank_local_indices=unused,
        recv_expert_ids=torch.zeros((rows_total, top_k), dtype=torch.int32, device=device),
        recv_weights=torch.zeros((rows_total, top_k), dtype=torch.float32, device=device),
        expert_counts=None, ep_rank=0, ep_size=ep_size, max_tokens_per_rank=max_tokens_per_rank,
        num_tokens=1, top_k=top_k, slot_count=ep_size)
    words = transport_workspace_bytes(ep_size, max_tokens_per_rank, row_bytes) // 8
    workspace = torch.zeros((ep_size, words), dtype=torch.int64, device=device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    rows = torch.zeros((1, row_bytes), dtype=torch.uint8, device=device)
    triton_dispatch_rows(rows, plan, workspace, call_counter=counter, check=False,
                         timeout_spins=0, max_programs=max_programs)
    rows = torch.zeros((rows_total, row_bytes), dtype=torch.uint8, device=device)
    triton_combine_rows(rows, plan, workspace, call_counter=counter, check=False,
                        timeout_spins=0, max_programs=max_programs)
    triton_combine(rows, plan, workspace, dtype=combine_dtype, call_counter=counter,
                   check=False, timeout_spins=0, max_programs=max_programs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TransportTimeout(RuntimeError):
    """Some source ranks did not deliver their rows within the spin bound."""


def raise_on_timeout(status: torch.Tensor, ep_rank: int) -> None:
    """Raise :class:`TransportTimeout` naming the source ranks whose rows did not arrive
    (``timed_out_sources``: a host sync)."""
    missing, calls = timed_out_sources(status)
    if missing:
        raise TransportTimeout(
            f"rank {ep_rank}: source rank(s) {missing} did not deliver their rows within "
            f"timeout_spins (transfer call(s) {calls}; did every rank run the same sequence of "
            f"dispatch/combine calls on this workspace?). The workspace is now stale: make a "
            f"new one on every rank.")
