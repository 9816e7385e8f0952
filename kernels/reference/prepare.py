"""The oracle of the prepare: ``local_send_plan`` (what one rank sends where) and an R-rank
simulation of the whole exchange (``simulate_alltoall``, ``simulate_dispatch``,
``simulate_combine``), in plain torch with Python loops for clarity.

Placement is linear over slots: rank(id) = id // (S // R); the id S marks a padding slot that
goes nowhere. Everything here is written per rank with Python loops for clarity; the Triton
kernels (kernels/prepare.py, a2a/triton_prepare.py) must equal it field for field.
"""

from __future__ import annotations

import torch

from kernels.reduce import sum_slots_in_order
from kernels.spec.casting import round_to_dtype
from kernels.spec.prepare import check_prepare_inputs
from kernels.spec.tensors import check_tensor
from kernels.types import UNUSED, AlltoallPlan, LocalSendPlan


def _destination_ranks(topk_ids: torch.Tensor, slots: int, ep_size: int) -> torch.Tensor:
    """[T, k] int64: the rank owning each slot id; ep_size for the padding id S."""
    return topk_ids.long() // (slots // ep_size)


def local_send_plan(topk_ids: torch.Tensor, num_experts: int, ep_size: int, *,
                    max_tokens_per_rank=None, slot_count=None,
                    check_ids: bool = True) -> LocalSendPlan:
    """What this rank sends where, from its own routing alone (no communication).

    topk_ids:            [T, k] int32 (any strides), slot ids in ``[0, S]``; S = padding
                         (sent nowhere).
    num_experts:         E, the number of distinct experts.
    ep_size:             R, the number of ranks; S must be a multiple of R.
    max_tokens_per_rank: N >= T, sizes the index buffers ([N*R]); default T.
    slot_count:          S >= E (E plus redundant expert copies); default E.
    check_ids:           True: range-check the ids (reads them: a host sync) and raise
                         ValueError naming one outside ``[0, S]``. False: nothing is read;
                         such an id is then treated as padding (sent nowhere, not counted),
                         as on every face.
    Returns a :class:`LocalSendPlan`: a token goes once to each distinct rank owning one of its
    ids, ascending token order inside each rank's segment; ``backward_recv_rank_local_indices``
    holds ``token*k + j`` for the first such slot j.
    """
    num_tokens, top_k, max_tokens, slots = check_prepare_inputs(
        topk_ids, num_experts, ep_size, max_tokens_per_rank, slot_count, check_ids=check_ids)
    device = topk_ids.device
    destination = _destination_ranks(topk_ids, slots, ep_size)
    send_indices = torch.full((max_tokens * ep_size,), UNUSED, dtype=torch.int32, device=device)
    backward_indices = torch.full_like(send_indices, UNUSED)
    send_counts = torch.zeros(ep_size, dtype=torch.int32, device=device)
    start = 0
    for rank in range(ep_size):
        hits = destination == rank                           # [T, k]
        tokens = torch.nonzero(hits.any(dim=1)).flatten()    # ascending
        first_slot = hits.int().argmax(dim=1)[tokens]        # first True in each row
        count = tokens.numel()
        send_indices[start:start + count] = tokens.int()
        backward_indices[start:start + count] = (tokens * top_k + first_slot).int()
        send_counts[rank] = count
        start += count
    # Ids outside [0, S) (the padding id S, and with check_ids=False any bad id) are not
    # counted; the rank of an id outside [0, S] is never in [0, R), so it is sent nowhere.
    ids = topk_ids.flatten().long()
    expert_counts = torch.bincount(ids[(ids >= 0) & (ids < slots)], minlength=slots)
    return LocalSendPlan(
        send_counts=send_counts,
        send_rank_count_cumsum=torch.cumsum(send_counts, 0, dtype=torch.int32),
        send_rank_local_indices=send_indices,
        backward_recv_rank_local_indices=backward_indices,
        expert_counts=expert_counts.int())


def _segment(cumsum: torch.Tensor, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s segment from an inclusive cumsum."""
    end = int(cumsum[rank])
    return (int(cumsum[rank - 1]) if rank > 0 else 0), end


def simulate_alltoall(topk_ids_per_rank: list, topk_weights_per_rank: list, num_experts: int,
                      max_tokens_per_rank: int, slot_count=None, *,
                      with_expert_counts: bool = True) -> list[AlltoallPlan]:
    """Every rank's full prepare result, all R ranks in one process (the exchange's oracle).

    topk_ids_per_rank:     R tensors [T_r, k] int32, rank r's slot ids in ``[0, S]``.
    topk_weights_per_rank: R tensors [T_r, k] float32, rank r's routing weights.
    num_experts, max_tokens_per_rank (N >= every T_r), slot_count (S, default E): as in
    :func:`local_send_plan`; R = len(topk_ids_per_rank).
    with_expert_counts:    fill ``expert_counts [R, S]`` (else None).
    Returns R :class:`AlltoallPlan` s. Receiver q's rows are ordered by source rank, then in
    the source's send order (ascending token); ``recv_expert_ids`` keeps only ids that q owns
    (others -> S), rows past total_recv are all S; ``recv_weights`` are unmasked, padding rows 0.
    """
    ep_size = len(topk_ids_per_rank)
    if len(topk_weights_per_rank) != ep_size:
        raise ValueError(f"got {ep_size} topk_ids tensors but {len(topk_weights_per_rank)} "
                         f"topk_weights tensors; pass one of each per rank")
    local = [local_send_plan(ids, num_experts, ep_size, max_tokens_per_rank=max_tokens_per_rank,
                             slot_count=slot_count) for ids in topk_ids_per_rank]
    slots = num_experts if slot_count is None else slot_count
    slots_per_rank = slots // ep_size
    top_k = topk_ids_per_rank[0].shape[1]
    for rank, (ids, weights) in enumerate(zip(topk_ids_per_rank, topk_weights_per_rank)):
        check_tensor(f"topk_weights_per_rank[{rank}]", weights, dtype=torch.float32, ndim=2)
        if weights.shape != ids.shape or ids.shape[1] != top_k:
            raise ValueError(f"rank {rank}: topk_ids {tuple(ids.shape)} and topk_weights "
                             f"{tuple(weights.shape)} must both be [T_r, {top_k}]")
    expert_counts = torch.stack([p.expert_counts for p in local]) if with_expert_counts else None
    rows = max_tokens_per_rank * ep_size
    plans = []
    for receiver in range(ep_size):
        device = topk_ids_per_rank[receiver].device
        recv_ids = torch.full((rows, top_k), slots, dtype=torch.int32, device=device)
        recv_weights = torch.zeros((rows, top_k), dtype=torch.float32, device=device)
        recv_counts = torch.zeros(ep_size, dtype=torch.int32, device=device)
        row = 0
        for source in range(ep_size):
            start, end = _segment(local[source].send_rank_count_cumsum, receiver)
            tokens = local[source].send_rank_local_indices[start:end].long()
            ids = topk_ids_per_rank[source][tokens]
            owned = (ids.long() // slots_per_rank) == receiver
            foreign = torch.full_like(ids, slots)
            recv_ids[row:row + tokens.numel()] = torch.where(owned, ids, foreign)
            recv_weights[row:row + tokens.numel()] = topk_weights_per_rank[source][tokens]
            recv_counts[source] = tokens.numel()
            row += tokens.numel()
        recv_local = torch.full((rows,), UNUSED, dtype=torch.int32, device=device)
        recv_local[:row] = torch.arange(row, dtype=torch.int32, device=device)
        mine = local[receiver]
        plans.append(AlltoallPlan(
            send_rank_count_cumsum=mine.send_rank_count_cumsum,
            send_rank_local_indices=mine.send_rank_local_indices,
            backward_recv_rank_local_indices=mine.backward_recv_rank_local_indices,
            recv_rank_count_cumsum=torch.cumsum(recv_counts, 0, dtype=torch.int32),
            recv_rank_local_indices=recv_local,
            recv_expert_ids=recv_ids,
            recv_weights=recv_weights,
            expert_counts=None if expert_counts is None else expert_counts.to(device),
            ep_rank=receiver, ep_size=ep_size, max_tokens_per_rank=max_tokens_per_rank,
            num_tokens=topk_ids_per_rank[receiver].shape[0], top_k=top_k, slot_count=slots))
    return plans


def simulate_dispatch(x_per_rank: list, plans: list) -> list:
    """Move every rank's token rows to the ranks that need them (the dispatch's oracle).

    x_per_rank: R tensors [T_r, *row_shape], rank r's token rows (any dtype).
    plans:      the R :class:`AlltoallPlan` s of one prepare (``simulate_alltoall``).
    Returns R tensors [N*R, *row_shape]: receiver q's row i is the row the plan says it
    receives at i (by source rank, then the source's send order); rows past total_recv are 0.
    """
    ep_size = len(plans)
    out = []
    for receiver in range(ep_size):
        x = x_per_rank[receiver]
        recv = torch.zeros((plans[receiver].max_tokens_per_rank * ep_size, *x.shape[1:]),
                           dtype=x.dtype, device=x.device)
        for source in range(ep_size):
            send_start, send_end = _segment(plans[source].send_rank_count_cumsum, receiver)
            recv_start, recv_end = _segment(plans[receiver].recv_rank_count_cumsum, source)
            assert send_end - send_start == recv_end - recv_start, "plans disagree on a count"
            tokens = plans[source].send_rank_local_indices[send_start:send_end].long()
            recv[recv_start:recv_end] = x_per_rank[source][tokens].to(x.device)
        out.append(recv)
    return out


def simulate_combine(expert_out_per_rank: list, plans: list) -> list:
    """Return every received row to its source and reduce over k (the combine's oracle).

    expert_out_per_rank: R tensors [N*R, H], receiver q's pre-reduced output for each row it
                         received (row order of its plan); rows past total_recv are ignored.
    plans:               the R :class:`AlltoallPlan` s of one prepare.
    Returns R tensors [T_r, H] of the same dtype: source r scatters each returned row into
    zeros [T_r*k, H] at ``backward_recv_rank_local_indices`` and sums over k in slot order in
    float32 (:func:`sum_slots_in_order`), rounded once to the dtype (nearest even, every NaN the
    canonical one: ``kernels.spec.casting``, as the Triton transport's fused combine writes);
    at most min(R, k) of the k rows are nonzero.
    """
    ep_size = len(plans)
    out = []
    for source in range(ep_size):
        plan = plans[source]
        like = expert_out_per_rank[source]
        scattered = torch.zeros((plan.num_tokens * plan.top_k, like.shape[1]),
                                dtype=like.dtype, device=like.device)
        for receiver in range(ep_size):
            send_start, send_end = _segment(plan.send_rank_count_cumsum, receiver)
            recv_start, recv_end = _segment(plans[receiver].recv_rank_count_cumsum, source)
            slots = plan.backward_recv_rank_local_indices[send_start:send_end].long()
            scattered[slots] = expert_out_per_rank[receiver][recv_start:recv_end].to(like.device)
        summed = sum_slots_in_order(scattered.reshape(plan.num_tokens, plan.top_k, like.shape[1]))
        out.append(round_to_dtype(summed, like.dtype))
    return out
