"""The receive side of the Triton transport: wait for each (source, chunk) flag, copy the rows
out of our inbox, and move the call counter on (``a2a.protocol``).

``recv_kernel``      grid (R, C): program (s, chunk) waits (bounded spin, acquire, system
                     scope) until ``flag[s, chunk]`` of our row is >= c + 1, a CTA barrier, then
                     copies chunk ``chunk`` of area[s][parity] (L2 reads, ``.cg``) to output
                     rows ``recv_indices[recv_start(s) + i]``; it ends the call (every program
                     counts itself in, the last one advances the counter).
``transfer_kernel``  send and receive of one transfer in one launch (``TransportConfig.overlap``),
                     grid (R, 2C), the send programs first: the receive programs copy each
                     chunk out as it arrives while this rank's sends still run.

Receive programs wait only for other ranks' send programs, never for their own rank's, so on
one GPU per rank any grid works.
"""

from __future__ import annotations

import triton
import triton.language as tl

from a2a.protocol import (advance_call, arrivals_address, flag_address, record_timeouts,
                          wait_for_flag)
from a2a.triton_transport.layout import chunk_range, chunk_rows
from a2a.triton_transport.send import send_chunk


@triton.jit(do_not_specialize=["ep_rank", "ep_size", "max_rows", "num_out_rows", "tail_rows",
                               "timeout_spins"])
def recv_kernel(out_ptr, out2_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride,
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
    Program (source, chunk): :func:`recv_chunk`, after counting itself in (``advance_call``)."""
    call = tl.load(counter_ptr)
    arrive(ws_ptr, ws_row_stride, counter_ptr, ep_rank, ep_size, call, MAX_CHUNKS)
    recv_chunk(out_ptr, out2_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, status_ptr,
               ep_rank, ep_size, max_rows, num_out_rows, tail_rows, timeout_spins,
               tl.program_id(0), tl.program_id(1), tl.num_programs(1), call, FLAG_WORDS,
               ROW_WORDS, MAX_CHUNKS, BLOCK_ROWS, BLOCK_WORDS, ZERO_TAIL, SPLIT_WORDS,
               OUT2_WORDS, LOCAL_DIRECT)


@triton.jit
def arrive(ws_ptr, ws_row_stride, counter_ptr, ep_rank, ep_size, call,
           MAX_CHUNKS: tl.constexpr):
    """``advance_call`` on this rank's arrivals word (after the flags of its inbox row)."""
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    advance_call(counter_ptr, arrivals_address(ws64, ws_row_stride, ep_rank, ep_size,
                                               MAX_CHUNKS), call)


@triton.jit
def recv_chunk(out_ptr, out2_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, status_ptr,
               ep_rank, ep_size, max_rows, num_out_rows, tail_rows, timeout_spins, peer, chunk,
               num_chunks, call, FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr,
               MAX_CHUNKS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
               ZERO_TAIL: tl.constexpr, SPLIT_WORDS: tl.constexpr, OUT2_WORDS: tl.constexpr,
               LOCAL_DIRECT: tl.constexpr):
    """Wait (bounded) for chunk ``chunk`` (of ``num_chunks``) of source ``peer`` in call
    ``call``, copy it from our inbox to its output rows, then zero this program's share of
    the output tail (ZERO_TAIL; the other arguments as in :func:`recv_kernel`)."""
    parity = call % 2
    out32 = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    ws32 = ws_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    my_row = ep_rank.to(tl.int64) * ws_row_stride  # in 64-bit words

    # Wait for source `peer`'s chunk (bounded), then let every thread read what it covers.
    arrived = wait_for_flag(flag_address(ws64, ws_row_stride, ep_rank, peer, chunk, MAX_CHUNKS),
                            call + 1, timeout_spins)
    record_timeouts(status_ptr, peer, call, arrived == 0)
    tl.debug_barrier()

    area = (ws32 + my_row * 2 + FLAG_WORDS
            + ((peer * 2 + parity) * max_rows).to(tl.int64) * ROW_WORDS)
    seg_start, begin, end = chunk_range(cumsum_ptr, peer, chunk, num_chunks)
    if LOCAL_DIRECT:
        end = tl.where(peer == ep_rank, begin, end)
    for row0 in range(begin, end, BLOCK_ROWS):
        rows, row_ok, target = chunk_rows(indices_ptr, seg_start, row0, end, BLOCK_ROWS)
        for word0 in tl.static_range(0, ROW_WORDS, BLOCK_WORDS):
            words = word0 + tl.arange(0, BLOCK_WORDS)
            ok = row_ok[:, None] & (words < ROW_WORDS)[None, :]
            values = tl.load(area + rows.to(tl.int64)[:, None] * ROW_WORDS + words[None, :],
                             mask=ok & arrived, other=0, cache_modifier=".cg")
            store_row_words(out32, out2_ptr, target, words, values, ok, ROW_WORDS,
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
                store_row_words(out32, out2_ptr, rows.to(tl.int64), words,
                                tl.zeros((BLOCK_ROWS, BLOCK_WORDS), tl.int32), ok, ROW_WORDS,
                                SPLIT_WORDS, OUT2_WORDS)


@triton.jit
def store_row_words(out32, out2_ptr, target, words, values, ok, ROW_WORDS: tl.constexpr,
                    SPLIT_WORDS: tl.constexpr, OUT2_WORDS: tl.constexpr):
    """Store words ``words`` of rows ``target`` (int64) of the received rows: into one output
    of ROW_WORDS-word rows, or (SPLIT_WORDS > 0) split between two (:func:`recv_kernel`)."""
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


@triton.jit(do_not_specialize=["ep_rank", "ep_size", "max_rows", "num_out_rows", "tail_rows",
                               "timeout_spins"])
def transfer_kernel(rows_ptr, send_cumsum_ptr, send_indices_ptr, out_ptr, recv_cumsum_ptr,
                    recv_indices_ptr, ws_ptr, ws_row_stride, counter_ptr, status_ptr, ep_rank,
                    ep_size, max_rows, num_out_rows, tail_rows, timeout_spins,
                    FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr,
                    MAX_CHUNKS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                    BLOCK_WORDS: tl.constexpr, ZERO_TAIL: tl.constexpr):
    """Send and receive of one transfer in one launch (``TransportConfig.overlap``), grid
    (R, 2C): programs (q, c < C) are :func:`~a2a.triton_transport.send.send_kernel`'s
    (destination q, chunk c), LOCAL_DIRECT; programs (s, C + c) are :func:`recv_kernel`'s
    (source s, chunk c), which copy each chunk as soon as it arrives, while this rank's sends
    still run. Every program counts itself in before the counter moves on (so no send program
    can read the next call's number). Send programs come first in the launch order (lower
    block ids), so the spinning receive programs can never hold back a send they wait for."""
    num_chunks = tl.num_programs(1) // 2
    peer = tl.program_id(0)
    call = tl.load(counter_ptr)
    arrive(ws_ptr, ws_row_stride, counter_ptr, ep_rank, ep_size, call, MAX_CHUNKS)
    if tl.program_id(1) < num_chunks:
        send_chunk(rows_ptr, send_cumsum_ptr, send_indices_ptr, ws_ptr, ws_row_stride,
                   ep_rank, max_rows, out_ptr, recv_cumsum_ptr, recv_indices_ptr, peer,
                   tl.program_id(1), num_chunks, call, FLAG_WORDS, ROW_WORDS, MAX_CHUNKS,
                   BLOCK_ROWS, BLOCK_WORDS, True)
    else:
        recv_chunk(out_ptr, out_ptr, recv_cumsum_ptr, recv_indices_ptr, ws_ptr, ws_row_stride,
                   status_ptr, ep_rank, ep_size, max_rows, num_out_rows, tail_rows,
                   timeout_spins, peer, tl.program_id(1) - num_chunks, num_chunks, call,
                   FLAG_WORDS, ROW_WORDS, MAX_CHUNKS, BLOCK_ROWS, BLOCK_WORDS, ZERO_TAIL, 0,
                   0, True)
