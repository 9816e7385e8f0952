"""The contract of ``route_topk``: its methods, limits and argument checks.

The selection and weight rule of each method is defined in ``kernels/reference/routing.py``
(the oracle); every face (torch, Triton, FlashInfer) calls :func:`check_routing_args` first.
"""

from __future__ import annotations

import math

import torch

from kernels.spec.tensors import check_tensor, check_top_k

ROUTING_METHODS = ("softmax_topk", "softmax_topk_renorm", "topk_softmax", "sigmoid_topk",
                   "sigmoid_topk_renorm", "deepseek_v3", "llama4")

# 32: the largest k any face supports (FlashInfer's routing kernels cap top_k at 32; our Triton
# kernel unrolls one argmax per slot).
MAX_TOP_K = 32

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The one bit pattern of a NaN routing weight on every face (the quiet NaN torch and Python
# write for float("nan")): the arithmetic of the weights may produce other NaN payloads, and
# faces compare bit for bit.
NAN_WEIGHT_BITS = 0x7FC00000


def check_routing_args(logits, top_k, method, bias=None, num_groups=None, topk_groups=None,
                       routed_scaling=1.0) -> tuple[int, int]:
    """Validate the arguments of ``route_topk`` (shared by all three faces).

    Returns ``(num_groups, topk_groups)`` with the defaults filled in (1 and ``num_groups``:
    one group holding every expert). Raises ValueError/TypeError naming the bad value.
    """
    if method not in ROUTING_METHODS:
        raise ValueError(f"method={method!r} is not one of {ROUTING_METHODS}")
    check_tensor("logits", logits, dtype=LOGIT_DTYPES, ndim=2)
    num_experts = logits.shape[1]
    if num_experts < 1:
        raise ValueError(f"logits must have at least one expert column, got shape "
                         f"{tuple(logits.shape)}")
    check_top_k(top_k, num_experts, limit=MAX_TOP_K, limit_reason="the largest k supported")
    if not isinstance(routed_scaling, (int, float)) or not math.isfinite(routed_scaling):
        raise ValueError(f"routed_scaling={routed_scaling!r} must be a finite number")
    if method == "llama4" and top_k != 1:
        raise ValueError(f"method='llama4' routes each token to one expert: top_k={top_k} "
                         f"must be 1")
    if method != "deepseek_v3":
        for name, value in (("bias", bias), ("num_groups", num_groups),
                            ("topk_groups", topk_groups)):
            if value is not None:
                raise ValueError(f"{name} is used only by method='deepseek_v3'; got {name} with "
                                 f"method={method!r} (pass {name}=None)")
        return 1, 1
    if bias is None:
        raise ValueError("method='deepseek_v3' needs bias: [E] float32, the per-expert "
                         "selection bias (e_score_correction_bias); pass zeros for none")
    check_tensor("bias", bias, dtype=torch.float32, ndim=1, device=logits.device)
    if bias.shape[0] != num_experts:
        raise ValueError(f"bias has {bias.shape[0]} entries but logits have {num_experts} "
                         f"experts")
    groups = 1 if num_groups is None else num_groups
    if not isinstance(groups, int) or groups < 1 or num_experts % groups:
        raise ValueError(f"num_groups={num_groups!r} must be a positive int that divides the "
                         f"number of experts ({num_experts})")
    keep = groups if topk_groups is None else topk_groups
    if not isinstance(keep, int) or not 1 <= keep <= groups:
        raise ValueError(f"topk_groups={topk_groups!r} must be an int in [1, num_groups="
                         f"{groups}]")
    per_group = num_experts // groups
    if groups > 1 and per_group < 2:
        raise ValueError(f"num_groups={groups} leaves {per_group} expert per group; a group's "
                         f"score sums its top 2 experts, so each group needs >= 2 "
                         f"(use fewer groups)")
    if keep * per_group < top_k:
        raise ValueError(f"top_k={top_k} is more than the kept groups hold: topk_groups={keep} "
                         f"x {per_group} experts per group = {keep * per_group}")
    return groups, keep
