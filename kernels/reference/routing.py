"""The oracle of ``route_topk``: router logits [T, E] -> topk_ids [T, k] int32, topk_weights
[T, k] float32, in plain torch (CPU or GPU), written for clarity.
"""

from __future__ import annotations

import torch

from kernels.spec.routing import NAN_WEIGHT_BITS, check_routing_args

# Routing: router logits [T, E] -> topk_ids [T, k] int32, topk_weights [T, k] float32.
#
# Every method selects k experts per token, best first, and returns their weights in fp32
# (bf16/fp16 logits are upcast first, exactly). What is ranked ("the selection score") and how
# the weights are formed:
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
# The selection order, on every face: scores compare as fp32 numbers, except that
#   - NaN is the lowest score, below -inf (any NaN, whatever its sign or payload bits);
#   - -0.0 and +0.0 are equal;
#   - equal scores, NaNs among themselves included, go to the smaller expert id.
# ``_selection_key`` writes this order as integers. So a NaN logit (or a NaN bias) is chosen only
# where fewer than k experts have a number: after every non-NaN one, by ascending id.
#
# Softmax and sigmoid are increasing, so ranking the logits gives the order of the
# probabilities; ranking the logits themselves keeps the ids free of exp rounding (two logits
# far below the maximum both underflow to probability 0 but still differ). DeepSeek-V3 ranks
# the biased sigmoid, so its ids depend on how sigmoid rounds: every face computes it as
# ``1 / (1 + exp(-x))`` with an IEEE division (see ``_sigmoid``).
#
# DeepSeek-V3 ("noaux_tc"): the E experts form ``num_groups`` groups of E/num_groups
# consecutive ids. A group's score is the fp32 sum of its two best biased scores in the
# selection order (the best twice if it occurs twice); it is NaN when one of the two is NaN
# (a group with fewer than two numbers) or when they are +inf and -inf. The best
# ``topk_groups`` groups are kept by the same order (a NaN group score is the lowest; ties go
# to the smaller group index); the k experts are then the best biased scores inside the kept
# groups.
#
# Weights: the formulas above in fp32. A weight that comes out NaN (a NaN logit among the
# chosen, or the softmax of a row holding a NaN, which makes every weight of that row NaN) is
# returned as the one bit pattern ``NAN_WEIGHT_BITS`` (0x7FC00000) on every face.
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
#   - NaN is its highest score, not the lowest: its keys are cub's order-preserving image of
#     the float bits, where the GPU's NaN (0x7FFFFFFF, positive) lies above +inf; a NaN expert
#     is chosen first and a group holding one is kept first (``a2a.routing`` documents this
#     face);
#   - its output weights have the dtype of the logits (bf16 logits give bf16 weights);
#   - its limits: k <= 8; with groups E <= 256, E/num_groups <= 32, num_groups <= 8 (one warp
#     per group, 256 threads), topk_groups <= 4, E/num_groups * topk_groups <= 128; without
#     groups E <= 384 (``a2a.routing`` checks them).

# Below the key of every number (the key of -inf is -0x7F800000).
_NAN_KEY = -(2**31)


def _selection_key(score: torch.Tensor) -> torch.Tensor:
    """int64 keys in the selection order of fp32 ``score`` (larger key = better score): the
    float bits read as sign and magnitude, -0.0 as +0.0, every NaN as ``_NAN_KEY``."""
    bits = torch.where(score == 0, torch.zeros_like(score), score).view(torch.int32).long()
    magnitude = bits & 0x7FFFFFFF
    key = torch.where(bits < 0, -magnitude, magnitude)
    return torch.where(score.isnan(), torch.full_like(key, _NAN_KEY), key)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid as ``1 / (1 + exp(-x))``: the formula the Triton kernel uses (libdevice
    expf and an IEEE division on CUDA), so that DeepSeek-V3 ids match bit for bit there."""
    return 1.0 / (1.0 + torch.exp(-x))


def _ranked(score: torch.Tensor, k: int, allowed=None) -> torch.Tensor:
    """Columns of the k best entries along the last axis of ``score`` [..., n] in the
    selection order, best first, ties to the smaller column (a stable sort keeps equal keys in
    column order). ``allowed`` (bool, like ``score``): only those entries compete; the others
    rank below every score, NaN included."""
    key = _selection_key(score)
    if allowed is not None:
        key = key.masked_fill(~allowed, _NAN_KEY - 1)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


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
        topk_ids: [T, k] int32, expert ids in descending selection score (NaN lowest), ties
            to the smaller id.
        topk_weights: [T, k] float32, the weight of each chosen expert; a NaN weight has the
            bits ``NAN_WEIGHT_BITS``.
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
            top2 = grouped.gather(-1, _ranked(grouped, 2))
            group_scores = top2[..., 0] + top2[..., 1]
            kept = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=x.device)
            kept.scatter_(1, _ranked(group_scores, topk_groups), True)
            kept = kept.repeat_interleave(num_experts // num_groups, dim=1)
            ids = _ranked(biased, top_k, allowed=kept)
        else:
            ids = _ranked(biased, top_k)
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = (weights * routed_scaling).float()
    nan = torch.tensor(NAN_WEIGHT_BITS, dtype=torch.int32, device=x.device).view(torch.float32)
    weights = torch.where(weights.isnan(), nan, weights)
    return ids.to(torch.int32), weights
