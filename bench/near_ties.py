"""Near-ties of DeepSeek-V3 routing: where FlashInfer's fused_topk_deepseek may pick another set.

FlashInfer's sigmoid is ``0.5 * tanh(0.5 x) + 0.5``, a few ulp (ulp(1.0) = 1.2e-7) from the
oracle's ``1 / (1 + exp(-x))``. A row may therefore pick differently only where two candidates
(the k-th and (k+1)-th biased scores inside the kept groups, or the topk_groups-th and next group
scores) lie within :data:`NEAR_TIE` of each other; such rows must stay rare
(:data:`MAX_NEAR_TIE_ROWS`). Shared by the bench's routing check and tests/test_routing.py.
"""

from __future__ import annotations

import torch

# Score gap under which two candidates count as tied (about 80 ulp of 1.0: far above the few ulp
# the two sigmoids differ by, far below the typical gap between neighbouring scores).
NEAR_TIE = 1e-5
# At most this fraction of the rows may pick another set (each one a near-tie).
MAX_NEAR_TIE_ROWS = 0.001


def near_ties(logits: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int,
              topk_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of DeepSeek-V3 routing with a near-tie.

    logits: [T, E] float logits; bias: [E] float32 score-correction bias; top_k, num_groups,
    topk_groups: the routing's parameters (E % num_groups == 0).
    Returns two [T] bool masks: rows with a near-tie at a selection boundary (the k-th vs
    (k+1)-th biased score inside the kept groups, or the topk_groups-th vs next group score),
    where the chosen set may differ; and rows with a near-tie anywhere among the k+1 best, where
    the order inside the set may differ too.
    """
    biased = torch.sigmoid(logits.float()) + bias
    num_tokens, num_experts = biased.shape
    boundary = torch.zeros(num_tokens, dtype=torch.bool, device=biased.device)
    if topk_groups < num_groups:
        group_scores = biased.view(num_tokens, num_groups, num_experts // num_groups).topk(
            2, dim=2).values.sum(dim=2)
        ranked = group_scores.sort(dim=1, descending=True).values
        boundary |= (ranked[:, topk_groups - 1] - ranked[:, topk_groups]).abs() < NEAR_TIE
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_groups, dim=1).indices, True)
        biased = biased.masked_fill(~kept.repeat_interleave(num_experts // num_groups, 1),
                                    float("-inf"))
    ranked = biased.sort(dim=1, descending=True).values[:, :top_k + 1]
    gaps = (ranked[:, :-1] - ranked[:, 1:]).abs() < NEAR_TIE
    boundary |= gaps[:, top_k - 1]
    return boundary, boundary | gaps.any(dim=1)
