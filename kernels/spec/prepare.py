"""The contract of ``local_send_plan`` and the cross-rank prepare: the limits and argument
checks every face shares."""

from __future__ import annotations

import torch

from kernels.spec.tensors import check_expert_ids, check_tensor, check_top_k

# FlashInfer's moe_prepare supports 1 <= top_k <= 32 (its warp-tile ballot is at most 32 wide).
PREPARE_MAX_TOP_K = 32


def check_prepare_inputs(topk_ids: torch.Tensor, num_experts: int, ep_size: int,
                         max_tokens_per_rank=None, slot_count=None, *,
                         check_ids: bool = True) -> tuple[int, int, int, int]:
    """Validate the arguments every face of ``local_send_plan`` takes; return ``(T, k, N, S)``.

    ``check_ids`` reads ``topk_ids`` to range-check it (a host sync on a GPU); a caller that
    already knows its ids are in ``[0, S]`` (e.g. under CUDA-graph capture) may skip it.
    """
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    num_tokens, top_k = topk_ids.shape
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size={ep_size!r} must be a positive int")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive int")
    slots = num_experts if slot_count is None else slot_count
    if not isinstance(slots, int) or slots < num_experts:
        raise ValueError(f"slot_count={slot_count!r} must be an int >= num_experts={num_experts} "
                         f"(slots are experts plus redundant copies); leave it None for S = E")
    if slots % ep_size != 0:
        raise ValueError(f"slot_count={slots} must be a multiple of ep_size={ep_size} (linear "
                         f"placement gives every rank S // R slots)")
    max_tokens = num_tokens if max_tokens_per_rank is None else max_tokens_per_rank
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank!r} must be an int >= 0")
    if num_tokens > max_tokens:
        raise ValueError(f"topk_ids has {num_tokens} tokens but max_tokens_per_rank="
                         f"{max_tokens}; raise max_tokens_per_rank (it sizes every buffer)")
    check_top_k(top_k, slots, limit=PREPARE_MAX_TOP_K, limit_reason="FlashInfer's moe_prepare")
    if check_ids:
        check_expert_ids("topk_ids", topk_ids, slots, allow_padding=True)
    return num_tokens, top_k, max_tokens, slots
