"""The fused combine of the Triton transport: the rows travel back exactly as in
``triton_combine_rows`` (same inbox layout, flags and counter), but instead of scattering them
into ``[T*k, B]`` zeros, the receive side sums each token's k slots straight from the inbox.

``slot_map_kernel``  one program: where slot t*k + j comes back (s * N + i: row i of source s's
                     inbox area), or -1.
``reduce_kernel``    waits for every (source, chunk) flag of the call (one vector wait), then,
                     per token, ``acc = 0; acc = acc + float32(row of slot j)`` for j = 0..k-1
                     (absent slots add +0), stored once in the payload dtype: the adds of
                     ``kernels.reduce.sum_slots_in_order``, so the result is bit-identical to
                     the other transports'. It ends the call (``a2a.protocol``).

Co-residency: the reduce programs wait only for other ranks' send programs; with R simulated
ranks on one GPU, R * 2 * max_programs of them spin at once (the grid is at most
2 * max_programs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from a2a.protocol import (advance_call, arrivals_address, flag_address, record_timeouts,
                          wait_for_flags)
from a2a.triton_transport.layout import segment
from kernels.casting import round_to


@triton.jit(do_not_specialize=["ep_size", "num_slots", "max_rows"])
def slot_map_kernel(slot_map_ptr, cumsum_ptr, backward_ptr, ep_size, num_slots, max_rows,
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
        seg_start, count = segment(cumsum_ptr, peer)
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
def reduce_kernel(out_ptr, slot_map_ptr, ws_ptr, ws_row_stride, counter_ptr, status_ptr,
                  ep_rank, ep_size, max_rows, num_tokens, num_chunks, timeout_spins,
                  FLAG_WORDS: tl.constexpr, ROW_ELEMS: tl.constexpr, ELEM_BYTES: tl.constexpr,
                  TOP_K: tl.constexpr, MAX_CHUNKS: tl.constexpr, FLAG_BLOCK: tl.constexpr,
                  BLOCK_TOKENS: tl.constexpr, BLOCK_ELEMS: tl.constexpr):
    """Combine's receive side fused with the reduction over k (grid-stride over token tiles;
    see the module docstring)."""
    call = tl.load(counter_ptr)
    parity = call % 2
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    wsE = ws_ptr.to(out_ptr.dtype, bitcast=True)
    my_row = ep_rank.to(tl.int64) * ws_row_stride  # in 64-bit words
    advance_call(counter_ptr, arrivals_address(ws64, ws_row_stride, ep_rank, ep_size,
                                               MAX_CHUNKS), call)

    # Every (source, chunk) flag of this call: one vector of acquire loads, spun on (bounded).
    lanes = tl.arange(0, FLAG_BLOCK)
    source = lanes // num_chunks
    wanted = lanes < ep_size * num_chunks
    ok = wait_for_flags(flag_address(ws64, ws_row_stride, ep_rank, source, lanes % num_chunks,
                                     MAX_CHUNKS), wanted, call + 1, timeout_spins)
    arrived = tl.min(ok.to(tl.int32), axis=0) != 0
    record_timeouts(status_ptr, source, call, wanted & (ok == 0))
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
