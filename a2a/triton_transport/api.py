"""Launchers and public functions of the Triton transport (see the package docstring)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from a2a.config import TransportConfig
from a2a.protocol import MAX_CHUNKS, new_status, raise_on_timeout
from a2a.triton_transport.combine import reduce_kernel, slot_map_kernel
from a2a.triton_transport.layout import (check_state, check_transfer, copy_constants,
                                         nvfp4_row_bytes, tail_rows, transport_chunks,
                                         transport_workspace_bytes)
from a2a.triton_transport.receive import recv_kernel, transfer_kernel
from a2a.triton_transport.send import send_kernel, send_nvfp4_kernel
from kernels.quantize import nvfp4_word_asm
from kernels.quantize_details.words import as_pairs
from kernels.sizes import cdiv, next_power_of_2
from kernels.spec.quant import NVFP4_BLOCK, check_global_scale
from kernels.spec.tensors import check_tensor
from kernels.types import UNUSED, AlltoallPlan

# The configuration of a call that is given none (every default: a2a.config).
DEFAULT_TRANSPORT = TransportConfig()
# Payload dtypes of the quantizing send and of the fused combine.
NVFP4_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Fused combine: token tiles of the reduction (elements per tile: 4 tokens x 1024).
REDUCE_TOKENS, REDUCE_ELEMS, REDUCE_WARPS = 4, 1024, 8


# ---------------------------------------------------------------------------------------------
# Launch steps
# ---------------------------------------------------------------------------------------------

def launch_send(rows, send_cumsum, send_indices, plan, workspace, call_counter, max_programs,
                *, out=None, recv_cumsum=None, recv_indices=None):
    """Launch the send kernel; returns (chunks, the copy-tile constants). With ``out`` (and
    the receive side's cumsum and indices), the local segment is stored straight into its
    output rows (LOCAL_DIRECT), else into our own inbox like the others."""
    ep_size = plan.ep_size
    chunks = transport_chunks(ep_size, max_programs)
    constants = dict(copy_constants(ep_size, rows.shape[1]), LOCAL_DIRECT=out is not None)
    # (out, its cumsum and indices) of the local segment; unused stand-ins without ``out``
    local = ((out, recv_cumsum, recv_indices) if out is not None
             else (rows, send_cumsum, send_indices))
    send_kernel[(ep_size, chunks)](
        rows, send_cumsum, send_indices, workspace, workspace.stride(0), call_counter,
        plan.ep_rank, plan.max_tokens_per_rank, *local, **constants)
    return chunks, constants


def launch_receive(out, out2, recv_cumsum, recv_indices, plan, workspace, call_counter, status,
                   chunks, *, timeout_spins, check, **constants):
    """Launch the receive kernel (grid R x chunks; with ZERO_TAIL the output rows past the
    received ones are spread over its programs), then, with ``check``, raise on a timeout."""
    num_out_rows = out.shape[0]
    recv_kernel[(plan.ep_size, chunks)](
        out, out2, recv_cumsum, recv_indices, workspace, workspace.stride(0), call_counter,
        status, plan.ep_rank, plan.ep_size, plan.max_tokens_per_rank, num_out_rows,
        tail_rows(num_out_rows, plan.ep_size, chunks), timeout_spins, **constants)
    if check:
        raise_on_timeout(status, plan.ep_rank, "transport")


def transfer(rows, out, send_cumsum, send_indices, recv_cumsum, recv_indices, plan, workspace,
             call_counter, status, *, zero_tail, config: TransportConfig, check):
    """One row transfer: a send then a receive kernel, or (``config.overlap``) one launch of
    both (``transfer_kernel``). Returns ``out``."""
    status = new_status(plan.ep_size, rows.device) if status is None else status
    if config.overlap:
        chunks = transport_chunks(plan.ep_size, config.max_programs)
        transfer_kernel[(plan.ep_size, 2 * chunks)](
            rows, send_cumsum, send_indices, out, recv_cumsum, recv_indices, workspace,
            workspace.stride(0), call_counter, status, plan.ep_rank, plan.ep_size,
            plan.max_tokens_per_rank, out.shape[0], tail_rows(out.shape[0], plan.ep_size, chunks),
            config.timeout_spins, ZERO_TAIL=zero_tail,
            **copy_constants(plan.ep_size, rows.shape[1]))
        if check:
            raise_on_timeout(status, plan.ep_rank, "transport")
        return out
    chunks, constants = launch_send(rows, send_cumsum, send_indices, plan, workspace,
                                    call_counter, config.max_programs, out=out,
                                    recv_cumsum=recv_cumsum, recv_indices=recv_indices)
    launch_receive(out, out, recv_cumsum, recv_indices, plan, workspace, call_counter, status,
                   chunks, timeout_spins=config.timeout_spins, check=check,
                   ZERO_TAIL=zero_tail, **constants)
    return out


# ---------------------------------------------------------------------------------------------
# Row transfers
# ---------------------------------------------------------------------------------------------

def triton_dispatch_rows(rows: torch.Tensor, plan: AlltoallPlan, workspace: torch.Tensor, *,
                         call_counter: torch.Tensor, status: Optional[torch.Tensor] = None,
                         check: bool = True,
                         config: TransportConfig = DEFAULT_TRANSPORT) -> torch.Tensor:
    """Send this rank's rows where the plan says (collective: every rank of the workspace).

    rows:          [T, B] uint8 contiguous (a byte view of any payload), T = plan.num_tokens,
                   B % 16 == 0.
    plan:          this rank's :class:`AlltoallPlan`.
    workspace:     [R, words] uint64/int64, this transfer's inbox rows (``layout``),
                   ``words >= transport_workspace_bytes(R, N, B) // 8``, zeroed before its
                   first call; used for dispatches of B-byte rows only.
    call_counter:  [1] int64 on the rows' device, zeroed with the workspace; the kernels read
                   the call number from it and the receive kernel advances it.
    status:        [R] int64 or None: entry s becomes c + 1 when the wait for source s timed
                   out in call c. None: a fresh zeroed one (read when ``check``).
    check:         read the status after the call (one host sync) and raise
                   :class:`~a2a.protocol.TransportTimeout` naming the missing source ranks.
                   False: no host sync (CUDA graphs, benchmarks).
    config:        :class:`~a2a.config.TransportConfig` (grid bound, spin bound, overlap); the
                   same on every rank.
    Returns [N*R, B] uint8: rows by source rank, then the source's send order; rows past
    total_recv are 0 (what ``torch_dispatch_rows`` and ``flashinfer_dispatch_rows`` return).
    """
    check_transfer(rows, plan, workspace, call_counter, status, plan.num_tokens,
                   "dispatch rows")
    out = torch.empty((plan.max_tokens_per_rank * plan.ep_size, rows.shape[1]),
                      dtype=torch.uint8, device=rows.device)
    return transfer(rows, out, plan.send_rank_count_cumsum, plan.send_rank_local_indices,
                    plan.recv_rank_count_cumsum, plan.recv_rank_local_indices, plan, workspace,
                    call_counter, status, zero_tail=True, config=config, check=check)


def triton_combine_rows(rows: torch.Tensor, plan: AlltoallPlan, workspace: torch.Tensor, *,
                        call_counter: torch.Tensor, status: Optional[torch.Tensor] = None,
                        check: bool = True,
                        config: TransportConfig = DEFAULT_TRANSPORT) -> torch.Tensor:
    """Return every received row to its source, scattered by slot (collective).

    rows: [N*R, B] uint8 contiguous, this rank's output per received row (the plan's row
          order; rows past total_recv are not read), B % 16 == 0.
    The other arguments as in :func:`triton_dispatch_rows` (a separate workspace and counter:
    combine's transfers are numbered on their own).
    Returns [T*k, B] uint8: the row returned for (token t, first slot j on the rank that
    computed it) at ``t*k + j``, zeros elsewhere (the caller sums over k with
    ``sum_over_slots``), as ``torch_combine_rows`` and ``flashinfer_combine_rows``.
    """
    check_transfer(rows, plan, workspace, call_counter, status,
                   plan.max_tokens_per_rank * plan.ep_size, "combine rows")
    out = torch.zeros((plan.num_tokens * plan.top_k, rows.shape[1]), dtype=torch.uint8,
                      device=rows.device)
    return transfer(rows, out, plan.recv_rank_count_cumsum, plan.recv_rank_local_indices,
                    plan.send_rank_count_cumsum, plan.backward_recv_rank_local_indices, plan,
                    workspace, call_counter, status, zero_tail=False, config=config,
                    check=check)


# ---------------------------------------------------------------------------------------------
# NVFP4 dispatch with the quantizer in the send kernel
# ---------------------------------------------------------------------------------------------

def triton_dispatch_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, plan: AlltoallPlan,
                          workspace: torch.Tensor, *, call_counter: torch.Tensor,
                          status: Optional[torch.Tensor] = None, check: bool = True,
                          config: TransportConfig = DEFAULT_TRANSPORT
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch with NVFP4 quantization fused into the send (collective).

    Each sent row is read from x once, quantized in registers (the IEEE recipe of
    ``kernels.quantize.quantize_nvfp4``, bit-exact, linear scales) and stored as packed codes
    and scales straight into the destination's inbox, one ``nvfp4_row_bytes(H)`` slot per row;
    the receive kernel splits the slots into the two outputs (the local rows go straight into
    them). One transfer instead of a local quantize pass and two transfers.

    x:            [T, H] bf16/fp16/fp32, T = plan.num_tokens, H % 64 == 0 (the scales of a
                  row are whole 32-bit words).
    global_scale: [1] float32 NVFP4 encode scale on x's device. Its value is not read here
                  (a collective must not raise on one rank alone): ``MoEAlltoall.dispatch``
                  checks it before the ranks agree.
    workspace:    as in :func:`triton_dispatch_rows` for rows of ``nvfp4_row_bytes(H)`` bytes
                  (its own workspace and counter).
    config:       as in :func:`triton_dispatch_rows`; ``config.nvfp4_launch`` is the tile of
                  the quantizing send.
    Returns (packed [N*R, H/2] uint8, two codes per byte, element 2i in the low nibble;
    scales [N*R, H/16] uint8 e4m3 bits, linear), rows by source rank then the source's send
    order, rows past total_recv 0: ``quantize_nvfp4`` of the rows :func:`triton_dispatch_rows`
    would deliver.
    """
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
    check_state(plan, workspace, call_counter, status, row_bytes, x.device)
    ep_size, max_rows = plan.ep_size, plan.max_tokens_per_rank
    status = new_status(ep_size, x.device) if status is None else status
    words, stride_row, in_kind = as_pairs(x)
    chunks = transport_chunks(ep_size, config.max_programs)
    launch = config.nvfp4_launch
    blocks = min(launch.max_blocks, next_power_of_2(hidden // NVFP4_BLOCK))
    block_rows = max(1, launch.tile_elements // NVFP4_BLOCK // blocks)
    constants = copy_constants(ep_size, row_bytes)  # the receive kernel's
    num_out_rows = max_rows * ep_size
    packed = torch.empty((num_out_rows, hidden // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((num_out_rows, hidden // 16), dtype=torch.uint8, device=x.device)
    send_nvfp4_kernel[(ep_size, chunks)](
        words, stride_row, global_scale, plan.send_rank_count_cumsum,
        plan.send_rank_local_indices, workspace, workspace.stride(0), call_counter,
        plan.ep_rank, max_rows, hidden, packed, scales, plan.recv_rank_count_cumsum,
        plan.recv_rank_local_indices, FLAG_WORDS=constants["FLAG_WORDS"], ROW_BYTES=row_bytes,
        MAX_CHUNKS=MAX_CHUNKS, IN_KIND=in_kind,
        WORD_ASM=nvfp4_word_asm(x.device, in_kind, False, stride_row, launch),
        BLOCK_ROWS=block_rows, BLOCKS=blocks, num_warps=launch.num_warps,
        enable_fp_fusion=False)
    launch_receive(packed, scales, plan.recv_rank_count_cumsum, plan.recv_rank_local_indices,
                   plan, workspace, call_counter, status, chunks,
                   timeout_spins=config.timeout_spins, check=check, ZERO_TAIL=True,
                   SPLIT_WORDS=hidden // 8, OUT2_WORDS=hidden // 64, LOCAL_DIRECT=True,
                   **constants)
    return packed, scales


# ---------------------------------------------------------------------------------------------
# Combine with the reduction over k in the receive kernel
# ---------------------------------------------------------------------------------------------

def triton_combine(rows: torch.Tensor, plan: AlltoallPlan, workspace: torch.Tensor, *,
                   dtype: torch.dtype, call_counter: torch.Tensor,
                   status: Optional[torch.Tensor] = None, check: bool = True,
                   config: TransportConfig = DEFAULT_TRANSPORT) -> torch.Tensor:
    """Combine with the reduction over k fused into the receive (collective).

    The rows travel exactly as in :func:`triton_combine_rows` (same workspace layout, flags and
    counter), but instead of scattering them into ``[T*k, B]`` zeros the receive kernel sums,
    per token, the rows of its k slots in slot order in float32 and rounds once to ``dtype``:
    the adds of ``kernels.reduce.sum_slots_in_order``, so the result is bit-identical to
    ``sum_over_slots(triton_combine_rows(...))`` and to the other transports. No ``[T*k, B]``
    buffer is written or read. ``config.overlap`` does not apply (one form).

    rows:  [N*R, B] uint8 contiguous, this rank's output per received row viewed as bytes of
           ``dtype`` (bf16, fp16 or fp32); rows past total_recv are not read.
    Returns [T, B / itemsize] of ``dtype``. A timed-out wait yields zeros (and the status entry
    of every source that was missing, as in :func:`triton_dispatch_rows`).
    """
    check_transfer(rows, plan, workspace, call_counter, status,
                   plan.max_tokens_per_rank * plan.ep_size, "combine rows")
    if dtype not in COMBINE_DTYPES:
        raise ValueError(f"dtype must be one of {COMBINE_DTYPES}, got {dtype}")
    elem_bytes = dtype.itemsize  # divides the row size: check_transfer asks for B % 16 == 0
    ep_size, max_rows = plan.ep_size, plan.max_tokens_per_rank
    num_tokens, top_k = plan.num_tokens, plan.top_k
    device = rows.device
    status = new_status(ep_size, device) if status is None else status
    row_elems = rows.shape[1] // elem_bytes
    # Where slot t*k + j comes back: s * N + i (row i of source s's inbox area) or -1.
    slot_map = torch.empty((max(num_tokens * top_k, 1),), dtype=torch.int32, device=device)
    slot_map_kernel[(1,)](slot_map, plan.send_rank_count_cumsum,
                          plan.backward_recv_rank_local_indices, ep_size, num_tokens * top_k,
                          max_rows, BLOCK_ROWS=1024)
    chunks, constants = launch_send(rows, plan.recv_rank_count_cumsum,
                                    plan.recv_rank_local_indices, plan, workspace, call_counter,
                                    config.max_programs)
    out = torch.empty((num_tokens, row_elems), dtype=dtype, device=device)
    block_elems = min(REDUCE_ELEMS, next_power_of_2(row_elems))
    tiles = cdiv(num_tokens, REDUCE_TOKENS) * cdiv(row_elems, block_elems)
    grid = (max(1, min(tiles, 2 * config.max_programs)),)
    reduce_kernel[grid](
        out, slot_map, workspace, workspace.stride(0), call_counter, status, plan.ep_rank,
        ep_size, max_rows, num_tokens, chunks, config.timeout_spins,
        FLAG_WORDS=constants["FLAG_WORDS"], ROW_ELEMS=row_elems, ELEM_BYTES=elem_bytes,
        TOP_K=top_k, MAX_CHUNKS=MAX_CHUNKS,
        FLAG_BLOCK=next_power_of_2(ep_size * chunks), BLOCK_TOKENS=REDUCE_TOKENS,
        BLOCK_ELEMS=block_elems, num_warps=REDUCE_WARPS)
    if check:
        raise_on_timeout(status, plan.ep_rank, "transport")
    return out


# ---------------------------------------------------------------------------------------------
# Warm-up
# ---------------------------------------------------------------------------------------------

def warmup_transport(device, *, ep_size: int, max_tokens_per_rank: int, row_bytes: int,
                     top_k: int = 1, config: TransportConfig = DEFAULT_TRANSPORT,
                     combine_dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile and load the kernels of dispatch and combine (both combines, the fused one for
    ``combine_dtype``; the one-launch form when ``config.overlap``) for rows of ``row_bytes``
    bytes, without communicating, then synchronize ``device``.

    Runs one dispatch and one combine of an empty plan (no rows) on a private workspace with
    ``timeout_spins=0``. Needed before R simulated ranks on one GPU call concurrently (loading a
    module waits for an idle device; ``a2a.protocol``); harmless elsewhere.
    """
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
    give_up = dataclasses.replace(config, timeout_spins=0)
    rows = torch.zeros((1, row_bytes), dtype=torch.uint8, device=device)
    triton_dispatch_rows(rows, plan, workspace, call_counter=counter, check=False,
                         config=give_up)
    rows = torch.zeros((rows_total, row_bytes), dtype=torch.uint8, device=device)
    triton_combine_rows(rows, plan, workspace, call_counter=counter, check=False,
                        config=give_up)
    triton_combine(rows, plan, workspace, dtype=combine_dtype, call_counter=counter,
                   check=False, config=give_up)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
