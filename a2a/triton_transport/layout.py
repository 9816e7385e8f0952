"""Where the Triton transport puts things: the inbox layout and its size, the chunking of a
segment, the copy tiles, and the checks of a transfer's arguments.

Rank q's inbox (row q of ``workspace [R, words]``), for rows of B bytes (B % 16 == 0) and
N = max_tokens_per_rank::

    flags [R, MAX_CHUNKS] int64       flag[s, chunk]: last call whose chunk ``chunk`` source s
                                      delivered, as c + 1 (0 = never; ``a2a.protocol``)
    arrivals int64                    this rank's programs that have read the call number;
                                      flags and arrivals padded to PAD_BYTES
    area  [R][2][N][B] bytes          area[s][p]: the rows s sent in a call of parity p

Both sides split a segment of ``count`` rows into the same C chunks of ``ceil(count / C)``
rows (the sender's count for q equals q's receive count from the sender: the plan says so), so
a receiving program needs just one flag.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from a2a.protocol import MAX_CHUNKS, check_call_counter, check_status, check_workspace
from a2a.workspace import ROW_ALIGN_BYTES, check_row_bytes
from kernels.sizes import cdiv, next_power_of_2
from kernels.spec.tensors import check_tensor
from kernels.types import AlltoallPlan

# Rows move as 32-bit words.
WORD_BYTES = 4
# Flags and row starts are padded to this many bytes (and the row size to a multiple of it, so
# that every workspace's row stride is a multiple of 16 words: one compiled variant).
PAD_BYTES = 128
# Words per copy tile: 4 warps x 32 threads x 32 words, eight 16-byte vectors per thread per
# step (16 KB).
TILE_WORDS = 4096
NUM_WARPS = 4


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

def flag_bytes(ep_size: int) -> int:
    """Bytes of the flags and the arrivals word of an inbox, padded."""
    return round_up(ep_size * MAX_CHUNKS * 8 + 8, PAD_BYTES)


def transport_workspace_bytes(ep_size: int, max_tokens_per_rank: int, row_bytes: int) -> int:
    """Bytes per rank of one Triton-transport workspace (one transfer kind, rows of
    ``row_bytes``): flags ``[R, MAX_CHUNKS]`` int64 and ``[R][2][N]`` rows, rounded up to 128
    bytes. E.g. R = 8, N = 1024, bf16 rows of H = 7168: 235 MB."""
    check_row_bytes("row_bytes", row_bytes)
    return round_up(flag_bytes(ep_size) + ep_size * 2 * max_tokens_per_rank * row_bytes,
                    PAD_BYTES)


def transport_chunks(ep_size: int, max_programs: int) -> int:
    """C, the programs per peer of both kernels (grid (R, C)); the same on every rank."""
    return max(1, min(MAX_CHUNKS, max_programs // ep_size))


def nvfp4_row_bytes(hidden: int) -> int:
    """Bytes of one NVFP4 row in the inbox: H/2 packed codes then H/16 scales, padded to 16."""
    return round_up(hidden // 2 + hidden // 16, ROW_ALIGN_BYTES)


def copy_tile(row_words: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_WORDS) of the copy tiles for rows of ``row_words`` words."""
    block_words = min(next_power_of_2(row_words), TILE_WORDS)
    return max(1, TILE_WORDS // block_words), block_words


def copy_constants(ep_size: int, row_bytes: int) -> dict:
    """Launch constants of the row-copying send and receive kernels for rows of
    ``row_bytes`` bytes."""
    row_words = row_bytes // WORD_BYTES
    block_rows, block_words = copy_tile(row_words)
    return dict(FLAG_WORDS=flag_bytes(ep_size) // WORD_BYTES, ROW_WORDS=row_words,
                MAX_CHUNKS=MAX_CHUNKS, BLOCK_ROWS=block_rows, BLOCK_WORDS=block_words,
                num_warps=NUM_WARPS)


def tail_rows(num_out_rows: int, ep_size: int, chunks: int) -> int:
    """Output rows per receive program (R x chunks of them) for zeroing the output's tail."""
    return cdiv(max(num_out_rows, 1), ep_size * chunks)


# ---------------------------------------------------------------------------------------------
# Checks of a transfer's arguments
# ---------------------------------------------------------------------------------------------

def check_transfer(rows: torch.Tensor, plan: AlltoallPlan, workspace: torch.Tensor,
                   call_counter: torch.Tensor, status: Optional[torch.Tensor],
                   expected_rows: int, what: str) -> int:
    """Validate one transfer's inputs; returns the row size in bytes."""
    check_tensor(what, rows, dtype=torch.uint8, ndim=2, contiguous=True)
    if rows.shape[0] != expected_rows:
        raise ValueError(f"{what} has {rows.shape[0]} rows, expected {expected_rows}")
    check_row_bytes(what, rows.shape[1])
    check_state(plan, workspace, call_counter, status, rows.shape[1], rows.device)
    return rows.shape[1]


def check_state(plan: AlltoallPlan, workspace: torch.Tensor, call_counter: torch.Tensor,
                status: Optional[torch.Tensor], row_bytes: int, device: torch.device) -> None:
    """Validate the workspace (for rows of ``row_bytes``), call counter and status."""
    needed = transport_workspace_bytes(plan.ep_size, plan.max_tokens_per_rank, row_bytes) // 8
    check_workspace(workspace, plan.ep_size, needed, device,
                    f"transport_workspace_bytes for rows of {row_bytes} bytes")
    check_call_counter(call_counter, device)
    check_status(status, plan.ep_size, device)


# ---------------------------------------------------------------------------------------------
# Device side: segments, chunks and the outbox
# ---------------------------------------------------------------------------------------------

@triton.jit
def segment(cumsum_ptr, peer):
    """(start, count) of ``peer``'s segment of an inclusive cumsum."""
    end = tl.load(cumsum_ptr + peer)
    start = tl.load(cumsum_ptr + peer - 1, mask=peer > 0, other=0)
    return start, end - start


@triton.jit
def chunk_bounds(count, chunk, num_chunks):
    """Rows [begin, end) of chunk ``chunk`` when ``count`` rows split into ``num_chunks``."""
    per_chunk = (count + num_chunks - 1) // num_chunks
    begin = chunk * per_chunk
    return begin, tl.minimum(begin + per_chunk, count)


@triton.jit
def chunk_range(cumsum_ptr, peer, chunk, num_chunks):
    """(segment start, chunk rows [begin, end)) of ``peer``'s segment, chunk ``chunk``."""
    seg_start, count = segment(cumsum_ptr, peer)
    begin, end = chunk_bounds(count, chunk, num_chunks)
    return seg_start, begin, end


@triton.jit
def chunk_rows(indices_ptr, seg_start, row0, end, BLOCK_ROWS: tl.constexpr):
    """(rows [row0, +BLOCK_ROWS) of a chunk, which are < end, their int64 entries of the
    index list at seg_start + row)."""
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < end
    return rows, row_ok, tl.load(indices_ptr + seg_start + rows, mask=row_ok,
                                 other=0).to(tl.int64)


@triton.jit
def outbox(ws_ptr, ws_row_stride, peer, ep_rank, call, max_rows, FLAG_WORDS: tl.constexpr,
           ROW_BYTES: tl.constexpr):
    """Byte pointer to area[ep_rank][call % 2] of ``peer``'s inbox (rows of ROW_BYTES)."""
    ws8 = ws_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    return (ws8 + peer.to(tl.int64) * ws_row_stride * 8 + FLAG_WORDS * 4
            + ((ep_rank * 2 + call % 2) * max_rows).to(tl.int64) * ROW_BYTES)
