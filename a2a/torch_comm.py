"""The portable prepare and transport over torch.distributed collectives.

Runs on any process group: gloo with CPU tensors (the multi-rank tests), NCCL with GPU tensors
(the cross-node fallback and the baseline of the benchmarks). The local half of the prepare is
the plain-torch oracle ``kernels.reference.local_send_plan``; the exchange is

1. one ``all_gather`` of ``[send_counts (R) | expert_counts (S)]`` (every rank learns what it
   receives from whom, and the load statistics);
2. one ``all_to_all_single`` of the sent rows' k expert ids (foreign ids masked to S) and k
   weights, packed as ``[rows, 2k]`` int32 (the weights' float32 bits).

The transport moves rows with ``all_to_all_single`` using the plan's counts (read to the host:
one sync per call) and works on bytes, so every dtype moves bit-exactly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from kernels import reference
from kernels.types import UNUSED, AlltoallPlan


def _splits(cumsum_a: torch.Tensor, cumsum_b: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per-rank counts of two inclusive cumsums, read to the host in one sync."""
    both = torch.cat([cumsum_a, cumsum_b]).tolist()
    ep_size = cumsum_a.numel()

    def counts(cumsum):
        return [end - start for start, end in zip([0] + cumsum[:-1], cumsum)]
    return counts(both[:ep_size]), counts(both[ep_size:])


def torch_prepare(topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                  group: Optional[dist.ProcessGroup], num_experts: int, max_tokens_per_rank: int,
                  slot_count: int) -> AlltoallPlan:
    """Every rank's :class:`AlltoallPlan` through torch.distributed (collective over ``group``).

    topk_ids:     [T, k] int32, slot ids in ``[0, S]`` (S = padding): checked by the caller,
                  or mapped to S when unchecked (``MoEAlltoall.prepare``; a negative id would
                  index rows from the end here).
    topk_weights: [T, k] float32, the routing weights.
    group:        the EP process group (None = the default group); R = its size.
    num_experts:  E; max_tokens_per_rank: N >= T on every rank; slot_count: S.
    Returns this rank's plan, equal field for field to ``reference.simulate_alltoall``'s (send
    segments in ascending token order, received rows by source rank then send order).
    """
    ep_size = dist.get_world_size(group)
    ep_rank = dist.get_rank(group)
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    local = reference.local_send_plan(topk_ids, num_experts, ep_size,
                                      max_tokens_per_rank=max_tokens_per_rank,
                                      slot_count=slot_count, check_ids=False)

    # 1. Counts: row q of the table is rank q's [send counts | expert counts].
    mine = torch.cat([local.send_counts, local.expert_counts]).to(torch.int32)
    table = [torch.empty_like(mine) for _ in range(ep_size)]
    dist.all_gather(table, mine, group=group)
    table = torch.stack(table)                                  # [R, R + S]
    recv_counts = table[:, ep_rank].contiguous()                # [R], from each source
    expert_counts = table[:, ep_size:].contiguous()             # [R, S]
    send_cumsum = local.send_rank_count_cumsum
    recv_cumsum = torch.cumsum(recv_counts, 0, dtype=torch.int32)
    send_splits, recv_splits = _splits(send_cumsum, recv_cumsum)
    total_send, total_recv = sum(send_splits), sum(recv_splits)

    # 2. The sent rows' ids (masked to the destination's own) and weights, as [rows, 2k] int32.
    tokens = local.send_rank_local_indices[:total_send].long()
    destination = torch.repeat_interleave(
        torch.arange(ep_size, device=device), local.send_counts.long(), output_size=total_send)
    ids = topk_ids[tokens]
    owned = ids.long() // (slot_count // ep_size) == destination[:, None]
    masked = torch.where(owned, ids, torch.full_like(ids, slot_count))
    payload = torch.cat([masked, topk_weights[tokens].view(torch.int32)], dim=1).contiguous()
    received = torch.empty((total_recv, 2 * top_k), dtype=torch.int32, device=device)
    dist.all_to_all_single(received, payload, recv_splits, send_splits, group=group)

    rows = max_tokens_per_rank * ep_size
    recv_ids = torch.full((rows, top_k), slot_count, dtype=torch.int32, device=device)
    recv_ids[:total_recv] = received[:, :top_k]
    recv_weights = torch.zeros((rows, top_k), dtype=torch.float32, device=device)
    recv_weights[:total_recv] = received[:, top_k:].view(torch.float32)
    recv_local = torch.full((rows,), UNUSED, dtype=torch.int32, device=device)
    recv_local[:total_recv] = torch.arange(total_recv, dtype=torch.int32, device=device)
    return AlltoallPlan(
        send_rank_count_cumsum=send_cumsum,
        send_rank_local_indices=local.send_rank_local_indices,
        backward_recv_rank_local_indices=local.backward_recv_rank_local_indices,
        recv_rank_count_cumsum=recv_cumsum,
        recv_rank_local_indices=recv_local,
        recv_expert_ids=recv_ids,
        recv_weights=recv_weights,
        expert_counts=expert_counts,
        ep_rank=ep_rank, ep_size=ep_size, max_tokens_per_rank=max_tokens_per_rank,
        num_tokens=num_tokens, top_k=top_k, slot_count=slot_count)


def torch_dispatch_rows(rows: torch.Tensor, plan: AlltoallPlan,
                        group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Send this rank's rows where the plan says (collective over ``group``).

    rows: [T, C] contiguous, any dtype (C * itemsize bytes per row).
    Returns [N*R, C] of the same dtype: rows by source rank, then the source's send order;
    rows past total_recv are 0.
    """
    send_splits, recv_splits = _splits(plan.send_rank_count_cumsum, plan.recv_rank_count_cumsum)
    total_send, total_recv = sum(send_splits), sum(recv_splits)
    sent = rows.index_select(0, plan.send_rank_local_indices[:total_send])
    out = torch.empty((plan.max_tokens_per_rank * plan.ep_size, rows.shape[1]),
                      dtype=rows.dtype, device=rows.device)
    out[total_recv:].zero_()
    dist.all_to_all_single(out[:total_recv], sent, recv_splits, send_splits, group=group)
    return out


def torch_combine_rows(rows: torch.Tensor, plan: AlltoallPlan,
                       group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Return every received row to its source, scattered by slot (collective over ``group``).

    rows: [N*R, C] contiguous, this rank's output for each row it received (plan's row order);
          rows past total_recv are not read.
    Returns [T*k, C] of the same dtype: the row returned for (token t, first slot j on the
    rank that computed it) at ``t*k + j``, zeros elsewhere (the caller sums over k).
    """
    send_splits, recv_splits = _splits(plan.send_rank_count_cumsum, plan.recv_rank_count_cumsum)
    total_send, total_recv = sum(send_splits), sum(recv_splits)
    back = torch.empty((total_send, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    dist.all_to_all_single(back, rows[:total_recv], send_splits, recv_splits, group=group)
    scattered = torch.zeros((plan.num_tokens * plan.top_k, rows.shape[1]), dtype=rows.dtype,
                            device=rows.device)
    scattered.index_copy_(0, plan.backward_recv_rank_local_indices[:total_send].long(), back)
    return scattered
