"""The oracle of ``route_topk``: router logits [T, E] -> topk_ids [T, k] int32, topk_weights
[T, k] float32, in plain torch (CPU or GPU), written for clarity.
"""

from __future__ import annotations

import torch

from kernels.spec.routing import check_routing_args

# Routing: router logits [T, E] -> topk_ids [T, k] int32, topk_weights [T, k] float32.
#
# Every method selects k experts per token, best first, ties to the smaller expert id, and
# returns their weights in fp32 (bf16/fp16 logits are upcast first, exactly). What is ranked
# ("the selection score") and how the weights are formed:
#
#   method               selection score             weight of a chosen expert i
#   softmax_topk         logit                       softmax(logits)[i] (over all E)
#   softmax_topk_renorm  logit                       softmax(logits)[i] / sum over chosen
#   topk_softmax         logit                       softmax over the k chosen logits
#   sigmoid_topk         logit                       sigmoid(logit_i)
#   sigmoid_topk_renorm  logit                       sigmoid(logit_i) / sum over chosen
#   llama4 (k = 1)       logit                       sigmoid(logit_i)
#   deepseek_v3          sigmoid(logit) + bias,      sigmoid(logit_i) / sum over chosen
#                        inside the kept groups
#
# All weights are then multiplied by ``routed_scaling`` (1.0 leaves them unchanged).
#
# Softmax and sigmoid are increasing, so ranking the logits gives the order of the
# probabilities; ranking the logits themselves keeps the ids free of exp rounding (two logits
# far below the maximum both underflow to probability 0 but still differ). DeepSeek-V3 ranks
# the biased sigmoid, so its ids depend on how sigmoid rounds: every face computes it as
# ``1 / (1 + exp(-x))`` with an IEEE division (see ``_sigmoid``).
#
# DeepSeek-V3 ("noaux_tc"): the E experts form ``num_groups`` groups of E/num_groups
# consecutive ids. A group's score is the sum of its two largest biased scores; the best
# ``topk_groups`` groups are kept (group ties go to the smaller group index); the k experts are
# then the best biased scores inside the kept groups.
#
# FlashInfer's fused_topk_deepseek (flashinfer/fused_moe/fused_routing_dsv3.py, CUDA kernel
# deepseek_v3_topk_kernel in csrc/fused_moe/noAuxTcKernels.cu, 0.7.2) computes the same
# selection, with these differences:
#   - sigmoid is ``0.5 * tanhf(0.5 * x) + 0.5``, a few ulp away from ``1 / (1 + exp(-x))``, so
#     rows whose k-th and (k+1)-th biased scores (or whose kept/dropped group scores) lie within
#     a few ulp may choose differently;
#   - the weight is ``s_i * routed_scaling / (sum + 1e-20)`` (scaled before the division, with
#     an epsilon); ours is ``s_i / sum * routed_scaling`` (sum > 0 always: sigmoid > 0 unless a
#     logit is -inf for every chosen expert);
#   - group scores are the same sum of the top-2 biased scores; ties (scores and groups) also go
#     to the smaller index (it packs (value, 65535 - index) keys);
#   - its output weights have the dtype of the logits (bf16 logits give bf16 weights);
#   - its limits: k <= 8; with groups E <= 256, E/num_groups <= 32, num_groups <= 8 (one warp
#     per group, 256 threads), topk_groups <= 4, E/num_groups * topk_groups <= 128; without
#     groups E <= 384 (``a2a.routing`` checks them).
#
# NaN logits are not supported (their order is unspecified in every face).


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid as ``1 / (1 + exp(-x))``: the formula the Triton kernel uses (libdevice
    expf and an IEEE division on CUDA), so that DeepSeek-V3 ids match bit for bit there."""
    return 1.0 / (1.0 + torch.exp(-x))


def _ranked(score: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the k largest entries of each row of ``score`` [T, n], best first, ties to
    the smaller column: a stable sort keeps equal entries in column order."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]


def route_topk(logits: torch.Tensor, top_k: int, method: str, *, bias=None, num_groups=None,
               topk_groups=None, routed_scaling: float = 1.0):
    """Top-k expert routing (plain torch, CPU or GPU).

    Args:
        logits: [T, E] float32, bfloat16 or float16, the router logits.
        top_k: k, experts per token, 1 <= k <= min(E, 32).
        method: one of ``ROUTING_METHODS`` (table above).
        bias: [E] float32, DeepSeek-V3's selection bias; required for ``deepseek_v3`` only.
        num_groups: DeepSeek-V3 expert groups (divides E); default 1.
        topk_groups: DeepSeek-V3 groups kept per token; default ``num_groups`` (all).
        routed_scaling: factor applied to every weight (DeepSeek-V3's routed_scaling_factor).

    Returns:
        topk_ids: [T, k] int32, expert ids in descending selection score, ties to the smaller
            id.
        topk_weights: [T, k] float32, the weight of each chosen expert.
    """
    num_groups, topk_groups = check_routing_args(logits, top_k, method, bias, num_groups,
                                                 topk_groups, routed_scaling)
    x = logits.float()
    num_tokens, num_experts = x.shape
    if method != "deepseek_v3":
        ids = _ranked(x, top_k)
        chosen = x.gather(1, ids)
        if method == "softmax_topk":
            weights = torch.softmax(x, dim=-1).gather(1, ids)
        elif method == "softmax_topk_renorm":
            weights = torch.softmax(x, dim=-1).gather(1, ids)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        elif method == "topk_softmax":
            weights = torch.softmax(chosen, dim=-1)
        elif method == "sigmoid_topk_renorm":
            weights = _sigmoid(chosen)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # sigmoid_topk, llama4
            weights = _sigmoid(chosen)
    else:
        scores = _sigmoid(x)
        biased = scores + bias.float()
        if topk_groups < num_groups:
            grouped = biased.view(num_tokens, num_groups, num_experts // num_groups)
            top2 = torch.sort(grouped, dim=-1, descending=True).values
            group_scores = top2[..., 0] + top2[..., 1]
            kept = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=x.device)
            kept.scatter_(1, _ranked(group_scores, topk_groups), True)
            kept = kept.repeat_interleave(num_experts // num_groups, dim=1)
            biased = biased.masked_fill(~kept, float("-inf"))
        ids = _ranked(biased, top_k)
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling
    return ids.to(torch.int32), weights.float()
