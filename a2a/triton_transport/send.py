"""The send side of the Triton transport: copy this rank's rows into the peers' inboxes and
publish one flag per chunk (``a2a.protocol``).

``send_kernel``        grid (R, C): program (q, chunk) copies chunk ``chunk`` of this rank's
                       segment for destination q (row ``send_indices[seg_start + i]`` of the
                       input) straight into q's inbox (area[me][parity][i]), then publishes
                       ``flag[me, chunk]`` of q's row with the value c + 1.
``send_nvfp4_kernel``  the same, quantizing on the way: it reads each row of x once, quantizes
                       it to NVFP4 in registers with ``kernels.quantize``'s tile code and stores
                       codes and scales into one ``nvfp4_row_bytes(H)`` slot.

LOCAL_DIRECT: the local segment (q = me) skips the inbox and goes straight to its output rows
(the receive kernel runs after the send on the stream and leaves that segment alone): one copy
instead of two. No send program waits for anything.
"""

from __future__ import annotations

import triton
import triton.language as tl

from a2a.protocol import flag_address, publish_flag
from a2a.triton_transport.layout import chunk_range, chunk_rows, outbox, segment
from kernels.quantize_details.nvfp4 import load_halves, nvfp4_tile


@triton.jit(do_not_specialize=["ep_rank", "max_rows"])
def send_kernel(rows_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, counter_ptr,
                ep_rank, max_rows, out_ptr, recv_cumsum_ptr, recv_indices_ptr,
                FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr,
                MAX_CHUNKS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_WORDS: tl.constexpr, LOCAL_DIRECT: tl.constexpr):
    """Program (destination, chunk): :func:`send_chunk`."""
    send_chunk(rows_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, ep_rank, max_rows,
               out_ptr, recv_cumsum_ptr, recv_indices_ptr, tl.program_id(0), tl.program_id(1),
               tl.num_programs(1), tl.load(counter_ptr), FLAG_WORDS, ROW_WORDS, MAX_CHUNKS,
               BLOCK_ROWS, BLOCK_WORDS, LOCAL_DIRECT)


@triton.jit
def send_chunk(rows_ptr, cumsum_ptr, indices_ptr, ws_ptr, ws_row_stride, ep_rank, max_rows,
               out_ptr, recv_cumsum_ptr, recv_indices_ptr, peer, chunk, num_chunks, call,
               FLAG_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr, MAX_CHUNKS: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
               LOCAL_DIRECT: tl.constexpr):
    """Copy chunk ``chunk`` (of ``num_chunks``) of this rank's segment for destination
    ``peer`` into its inbox in call ``call``, then publish the flag. LOCAL_DIRECT: the local
    segment (peer == ep_rank) goes straight to its output rows (``recv_indices[recv start of
    ep_rank + i]`` of out_ptr), not through our own inbox."""
    rows32 = rows_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    dest = outbox(ws_ptr, ws_row_stride, peer, ep_rank, call, max_rows, FLAG_WORDS,
                  ROW_WORDS * 4).to(tl.pointer_type(tl.int32), bitcast=True)
    local = False
    recv_start = 0
    if LOCAL_DIRECT:
        local = peer == ep_rank
        recv_start = segment(recv_cumsum_ptr, peer)[0]  # used where local
        if local:
            dest = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)

    seg_start, begin, end = chunk_range(cumsum_ptr, peer, chunk, num_chunks)
    for row0 in range(begin, end, BLOCK_ROWS):
        rows, row_ok, source = chunk_rows(indices_ptr, seg_start, row0, end, BLOCK_ROWS)
        target = rows.to(tl.int64)
        if LOCAL_DIRECT:
            target = send_targets(recv_indices_ptr, recv_start, rows, row_ok, local)
        for word0 in tl.static_range(0, ROW_WORDS, BLOCK_WORDS):
            words = word0 + tl.arange(0, BLOCK_WORDS)
            ok = row_ok[:, None] & (words < ROW_WORDS)[None, :]
            values = tl.load(rows32 + source[:, None] * ROW_WORDS + words[None, :], mask=ok)
            tl.store(dest + target[:, None] * ROW_WORDS + words[None, :], values, mask=ok)
    publish_chunk(ws_ptr, ws_row_stride, peer, ep_rank, chunk, call, MAX_CHUNKS)


@triton.jit
def send_targets(recv_indices_ptr, recv_start, rows, row_ok, local):
    """(int64) rows a send program stores its chunk rows ``rows`` to: the same slots of the
    peer's inbox area, or, for the local segment (``local``: LOCAL_DIRECT), their output rows
    ``recv_indices[recv_start + row]``."""
    placed = tl.load(recv_indices_ptr + recv_start + rows, mask=row_ok & local, other=0)
    return tl.where(local, placed.to(tl.int64), rows.to(tl.int64))


@triton.jit
def publish_chunk(ws_ptr, ws_row_stride, peer, ep_rank, chunk, call, MAX_CHUNKS: tl.constexpr):
    """Set flag[ep_rank, chunk] of ``peer``'s inbox to call + 1 after every thread's stores
    (:func:`a2a.protocol.publish_flag`)."""
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    publish_flag(flag_address(ws64, ws_row_stride, peer, ep_rank, chunk, MAX_CHUNKS), call)


@triton.jit(do_not_specialize=["ep_rank", "max_rows"])
def send_nvfp4_kernel(words_ptr, stride_row, global_scale_ptr, cumsum_ptr, indices_ptr, ws_ptr,
                      ws_row_stride, counter_ptr, ep_rank, max_rows, hidden, packed_ptr,
                      scales_ptr, recv_cumsum_ptr, recv_indices_ptr,
                      FLAG_WORDS: tl.constexpr, ROW_BYTES: tl.constexpr,
                      MAX_CHUNKS: tl.constexpr, IN_KIND: tl.constexpr,
                      WORD_ASM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      BLOCKS: tl.constexpr):
    """:func:`send_kernel` that quantizes on the way: program (q, chunk) reads the rows of its
    chunk (``indices_ptr`` through the cumsum's segment q) from x, quantizes them to NVFP4 in
    registers (``kernels.quantize``'s tile code, IEEE recipe, linear scales) and stores each
    row's packed codes (H/2 bytes) and scales (H/16 bytes) into one ROW_BYTES slot of q's
    inbox, then publishes the flag as :func:`send_kernel` does. The local segment
    (q = ep_rank) goes straight to its rows of the outputs ``packed_ptr`` / ``scales_ptr``
    (LOCAL_DIRECT)."""
    peer = tl.program_id(0)  # destination
    chunk = tl.program_id(1)
    call = tl.load(counter_ptr)
    codes = outbox(ws_ptr, ws_row_stride, peer, ep_rank, call, max_rows, FLAG_WORDS, ROW_BYTES)
    scale_bytes = codes + hidden // 2
    local = peer == ep_rank
    recv_start = segment(recv_cumsum_ptr, peer)[0]  # used where local
    if local:
        codes = packed_ptr
        scale_bytes = scales_ptr
    code_stride = tl.where(local, hidden // 2, ROW_BYTES).to(tl.int64)
    scale_stride = tl.where(local, hidden // 16, ROW_BYTES).to(tl.int64)
    global_scale = tl.load(global_scale_ptr)
    num_blocks = hidden // 16

    seg_start, begin, end = chunk_range(cumsum_ptr, peer, chunk, tl.num_programs(1))
    for row0 in range(begin, end, BLOCK_ROWS):
        rows, row_ok, source = chunk_rows(indices_ptr, seg_start, row0, end, BLOCK_ROWS)
        in_ptrs = words_ptr + source * stride_row
        target = send_targets(recv_indices_ptr, recv_start, rows, row_ok, local)
        for block0 in range(0, num_blocks, BLOCKS):
            w = load_halves(in_ptrs, row_ok, block0, num_blocks, BLOCKS)
            nvfp4_tile(w[0], w[1], global_scale, codes + target * code_stride,
                       scale_bytes + target * scale_stride, rows, block0, end, num_blocks,
                       end, num_blocks, IN_KIND, 0, False, WORD_ASM, BLOCK_ROWS, BLOCKS, "")
    publish_chunk(ws_ptr, ws_row_stride, peer, ep_rank, chunk, call, MAX_CHUNKS)
