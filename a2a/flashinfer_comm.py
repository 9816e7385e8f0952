"""Adapters to FlashInfer's two-sided MNNVL alltoallv (``flashinfer.comm.trtllm_alltoall``).

- :func:`to_flashinfer_info` / :func:`plan_from_flashinfer`: :class:`AlltoallPlan` <->
  FlashInfer's ``MoEAlltoallInfo`` (plus received ids, weights and expert counts), so that its
  ``moe_comm`` can move rows with a Triton-made plan and our transports with its plan;
- :func:`flashinfer_prepare`: its ``moe_prepare`` (the kernel behind
  ``MnnvlMoe.mnnvl_moe_alltoallv_prepare_without_allgather``) on a workspace we own;
- :func:`flashinfer_dispatch_rows` / :func:`flashinfer_combine_rows`: its ``moe_comm`` forward
  and reversed, exactly as ``mnnvl_moe_alltoallv`` / ``mnnvl_moe_alltoallv_combine`` call it.

Facts about FlashInfer's prepare (0.7.2, csrc/trtllm_alltoall_prepare.cu) that the conversion
handles: the order of tokens inside one destination's send segment comes from a block-level
``atomicAdd`` and changes run to run (the plan stays self-consistent: the receiver's ids,
weights and rows all follow that order); its index buffers are ``N * max(R, k)`` long and hold
garbage past the valid prefix; rows of ``recv_weights`` past total_recv are uninitialised.
We write UNUSED / 0 there, so plans compare buffer for buffer.

FlashInfer is imported inside each function; nothing here runs at ``import a2a``.
"""

from __future__ import annotations

from typing import Optional

import torch

from a2a.workspace import check_row_bytes
from kernels.types import UNUSED, AlltoallPlan

# FlashInfer's moe_prepare: expert and slot counts divisible by 4 (it copies the expert
# statistics as int4), 1 <= top_k <= 32 (its warp-tile ballot is at most 32 wide).
EXPERT_COUNT_MULTIPLE = 4
MAX_TOP_K = 32


def check_flashinfer_prepare_limits(num_experts: int, slot_count: int, top_k: int) -> None:
    """Raise ValueError when FlashInfer's ``moe_prepare`` cannot take these sizes."""
    for name, value in (("num_experts", num_experts), ("slot_count", slot_count)):
        if value % EXPERT_COUNT_MULTIPLE:
            raise ValueError(f"{name}={value} must be a multiple of {EXPERT_COUNT_MULTIPLE} for "
                             f"FlashInfer's moe_prepare; use the 'triton' or 'torch' prepare")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k={top_k} must be in [1, {MAX_TOP_K}] for FlashInfer's "
                         f"moe_prepare; use the 'triton' or 'torch' prepare")


def to_flashinfer_info(plan: AlltoallPlan):
    """FlashInfer's ``MoEAlltoallInfo`` for ``plan`` (shares its tensors, no copy).

    ``local_gather_indices`` is None, as ``mnnvl_moe_alltoallv_prepare_without_allgather``
    leaves it; ``local_token_allocation_count`` = N*R, the rows of a dispatch output.
    """
    from flashinfer.comm.trtllm_alltoall import MoEAlltoallInfo
    return MoEAlltoallInfo(
        local_gather_indices=None,
        send_rank_count_cumsum=plan.send_rank_count_cumsum,
        send_rank_local_indices=plan.send_rank_local_indices,
        recv_rank_count_cumsum=plan.recv_rank_count_cumsum,
        recv_rank_local_indices=plan.recv_rank_local_indices,
        backward_recv_rank_local_indices=plan.backward_recv_rank_local_indices,
        local_token_allocation_count=plan.max_tokens_per_rank * plan.ep_size)


def plan_from_flashinfer(info, recv_expert_ids: torch.Tensor, recv_weights: torch.Tensor,
                         expert_counts: Optional[torch.Tensor], *, ep_rank: int, ep_size: int,
                         max_tokens_per_rank: int, num_tokens: int, top_k: int,
                         slot_count: int) -> AlltoallPlan:
    """An :class:`AlltoallPlan` from FlashInfer's prepare outputs (no host sync).

    info:            ``MoEAlltoallInfo``; its index buffers may be longer than N*R
                     (``N * max(R, k)``) and hold anything past their valid prefix.
    recv_expert_ids: [>= N*R, k] int32, received ids (foreign ids = S).
    recv_weights:    [>= N*R, k] float32, received weights; rows past total_recv may be garbage.
    expert_counts:   [R, S] int32 gathered statistics, or None.
    The rest describe the plan (N = max_tokens_per_rank, S = slot_count).
    Returns the plan with the index buffers cut to N*R, UNUSED past the valid prefixes, ids S
    and weights 0 past total_recv. The send order inside a segment stays FlashInfer's.
    """
    rows = max_tokens_per_rank * ep_size
    device = recv_expert_ids.device
    position = torch.arange(rows, dtype=torch.int32, device=device)
    sent = position < info.send_rank_count_cumsum[-1]
    received = position < info.recv_rank_count_cumsum[-1]

    def prefix(values: torch.Tensor, valid: torch.Tensor, fill) -> torch.Tensor:
        values = values[:rows]
        if values.dim() == 2:
            valid = valid[:, None]
        return torch.where(valid, values, torch.full_like(values, fill))

    return AlltoallPlan(
        send_rank_count_cumsum=info.send_rank_count_cumsum,
        send_rank_local_indices=prefix(info.send_rank_local_indices, sent, UNUSED),
        backward_recv_rank_local_indices=prefix(info.backward_recv_rank_local_indices, sent,
                                                UNUSED),
        recv_rank_count_cumsum=info.recv_rank_count_cumsum,
        recv_rank_local_indices=prefix(info.recv_rank_local_indices, received, UNUSED),
        recv_expert_ids=prefix(recv_expert_ids, received, slot_count),
        recv_weights=prefix(recv_weights, received, 0.0),
        expert_counts=expert_counts,
        ep_rank=ep_rank, ep_size=ep_size, max_tokens_per_rank=max_tokens_per_rank,
        num_tokens=num_tokens, top_k=top_k, slot_count=slot_count)


def flashinfer_prepare(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       workspace: torch.Tensor, *, ep_rank: int, ep_size: int,
                       max_tokens_per_rank: int, slot_count: int) -> AlltoallPlan:
    """FlashInfer's ``moe_prepare`` on our workspace, converted to an :class:`AlltoallPlan`.

    topk_ids:     [T, k] int32 contiguous, slot ids in ``[0, S]`` (checked by the caller, or
                  mapped to S when unchecked, as ``MoEAlltoall.prepare`` does: FlashInfer
                  sends a negative id to rank 0).
    topk_weights: [T, k] float32 contiguous.
    workspace:    [R, words] uint64, FlashInfer's prepare workspace (zeroed once; its kernels
                  leave it zeroed again), ``a2a.workspace.flashinfer_prepare_workspace_bytes``.
    Collective (every rank of the workspace's group calls it). The statistics are gathered for
    the S slots, so ``expert_counts`` is [R, S].
    """
    from flashinfer.comm.trtllm_alltoall import MoEAlltoallInfo, moe_prepare

    num_tokens, top_k = topk_ids.shape
    local_counts = torch.bincount(topk_ids.flatten().long(), minlength=slot_count + 1)
    local_counts = local_counts[:slot_count].to(torch.int32)
    (recv_ids, recv_weights, send_cumsum, send_indices, recv_cumsum, recv_indices,
     backward_indices, gathered_counts) = moe_prepare(
        topk_ids, topk_weights, local_counts, workspace, max_tokens_per_rank, ep_rank, ep_size,
        slot_count, slot_count, top_k)
    info = MoEAlltoallInfo(None, send_cumsum, send_indices, recv_cumsum, recv_indices,
                           backward_indices, max_tokens_per_rank * ep_size)
    return plan_from_flashinfer(
        info, recv_ids, recv_weights, gathered_counts, ep_rank=ep_rank, ep_size=ep_size,
        max_tokens_per_rank=max_tokens_per_rank, num_tokens=num_tokens, top_k=top_k,
        slot_count=slot_count)


def flashinfer_dispatch_rows(rows: torch.Tensor, plan: AlltoallPlan,
                             workspace: torch.Tensor) -> torch.Tensor:
    """``moe_comm`` forward: send this rank's rows where the plan says (collective).

    rows:      [T, C] contiguous, any dtype, C * itemsize % 16 == 0.
    workspace: [R, words] uint64, FlashInfer's comm workspace.
    Returns [N*R, C] of the same dtype: rows by source rank, then the source's send order;
    rows past total_recv are 0.
    """
    from flashinfer.comm.trtllm_alltoall import moe_comm

    check_row_bytes("dispatch", rows.shape[1] * rows.element_size())
    out = torch.zeros((plan.max_tokens_per_rank * plan.ep_size, rows.shape[1]),
                      dtype=rows.dtype, device=rows.device)
    moe_comm(rows, plan.send_rank_count_cumsum, plan.send_rank_local_indices, out,
             plan.recv_rank_count_cumsum, plan.recv_rank_local_indices, workspace,
             plan.ep_rank, plan.ep_size)
    return out


def flashinfer_combine_rows(rows: torch.Tensor, plan: AlltoallPlan,
                            workspace: torch.Tensor) -> torch.Tensor:
    """``moe_comm`` reversed: return every received row to its source, scattered by slot.

    rows: [N*R, C] contiguous, this rank's output per received row, C * itemsize % 16 == 0.
    Returns [T*k, C]: the returned row at ``t*k + j`` (the plan's backward index), zeros
    elsewhere (the caller sums over k).
    """
    from flashinfer.comm.trtllm_alltoall import moe_comm

    check_row_bytes("combine", rows.shape[1] * rows.element_size())
    scattered = torch.zeros((plan.num_tokens * plan.top_k, rows.shape[1]), dtype=rows.dtype,
                            device=rows.device)
    moe_comm(rows, plan.recv_rank_count_cumsum, plan.recv_rank_local_indices, scattered,
             plan.send_rank_count_cumsum, plan.backward_recv_rank_local_indices, workspace,
             plan.ep_rank, plan.ep_size)
    return scattered
