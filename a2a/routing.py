"""The routing stage: router logits [T, E] -> topk_ids [T, k] int32, topk_weights [T, k] fp32.

``route_topk`` resolves the stage's backend once (``a2a.backends.resolve``) and runs the Triton
kernel (``kernels.routing``), the torch oracle (``kernels.reference``) or FlashInfer's
``fused_topk_deepseek`` (DeepSeek-V3 only; adapter below). All three share one signature and
one contract (the comment block of ``kernels/reference/routing.py``); FlashInfer's face differs
where that block says (sigmoid rounding in near-ties, NaN scores).
"""

from __future__ import annotations

import torch

from a2a.backends import resolve
from kernels import reference
from kernels.spec.routing import check_routing_args

# FlashInfer 0.7.2 fused_topk_deepseek limits (csrc/fused_moe/noAuxTcKernels.cu, kernel
# deepseek_v3_topk_kernel): one CTA per token, 256 threads, one warp per group, a warp-level
# top-k over at most 4 groups x 32 lanes.
FI_MAX_TOP_K = 8                # MaxNumTopExperts
FI_MAX_EXPERTS_GROUPED = 256    # NumDeepseekExperts: the 256 threads of the grouped kernel
FI_MAX_EXPERTS_PER_GROUP = 32   # one warp per group
FI_MAX_GROUPS = 8               # 256 threads / 32 lanes: group scores exist for 8 warps only
FI_MAX_TOPK_GROUPS = 4          # MaxNumTopGroups: the final top-k reads at most 4 groups
FI_MAX_KEPT_EXPERTS = 128       # MaxNumExpertsUnit: experts_per_group * topk_groups


def check_flashinfer_limits(num_experts: int, top_k: int, num_groups: int,
                            topk_groups: int) -> None:
    """Raise ValueError for shapes fused_topk_deepseek cannot route correctly. Some of these it
    checks itself; others (num_groups > 8, topk_groups > 4) it would silently get wrong."""
    way_out = "use backend='triton' or 'torch'"
    if top_k > FI_MAX_TOP_K:
        raise ValueError(f"top_k={top_k}: FlashInfer's fused_topk_deepseek takes top_k <= "
                         f"{FI_MAX_TOP_K}; {way_out}")
    if num_groups == 1:
        # Its n_group = 1 path is unusable: its own check demands topk_group * n_group >= top_k
        # (never true for k > 1), and with E=384, k=1 the kernel hit an illegal memory access
        # (FlashInfer 0.7.2 on H200).
        raise ValueError(f"num_groups=1: FlashInfer's fused_topk_deepseek without groups "
                         f"rejects top_k > 1 and crashed for top_k=1 on H200 (FlashInfer "
                         f"0.7.2); {way_out}")
    per_group = num_experts // num_groups
    limits = [
        (num_experts <= FI_MAX_EXPERTS_GROUPED, f"E={num_experts} <= {FI_MAX_EXPERTS_GROUPED}"),
        (per_group <= FI_MAX_EXPERTS_PER_GROUP,
         f"E/num_groups={per_group} <= {FI_MAX_EXPERTS_PER_GROUP}"),
        (num_groups <= FI_MAX_GROUPS, f"num_groups={num_groups} <= {FI_MAX_GROUPS}"),
        (topk_groups <= FI_MAX_TOPK_GROUPS, f"topk_groups={topk_groups} <= {FI_MAX_TOPK_GROUPS}"),
        (per_group * topk_groups <= FI_MAX_KEPT_EXPERTS,
         f"E/num_groups * topk_groups={per_group * topk_groups} <= {FI_MAX_KEPT_EXPERTS}"),
    ]
    for ok, what in limits:
        if not ok:
            raise ValueError(f"FlashInfer's fused_topk_deepseek needs {what} when groups are "
                             f"dropped; {way_out}")


def route_topk_flashinfer(logits: torch.Tensor, top_k: int, method: str, *, bias=None,
                          num_groups=None, topk_groups=None, routed_scaling: float = 1.0):
    """FlashInfer adapter: ``flashinfer.fused_moe.fused_topk_deepseek`` (SM89+), DeepSeek-V3
    only. Same arguments and results as ``kernels.reference.route_topk``.

    fused_topk_deepseek writes into preallocated outputs whose weight dtype is the logits'
    dtype; to return fp32 weights we pass the logits upcast to fp32 (exact for bf16/fp16, so
    the selection is that of the original logits; it costs one cast kernel for bf16 input).
    Its ids come out best first (descending biased score, ties to the smaller id), our order,
    so no re-sorting is needed. Differences from the oracle (sigmoid via tanh, epsilon in the
    normalisation) are listed in ``kernels/reference/routing.py``; ids can differ on rows with
    a near-tie.

    NaN (a NaN logit or bias; this face does not rewrite them, which would cost a kernel per
    call): the kernel compares cub's order-preserving image of the float bits, in which the
    GPU's NaN (0x7FFFFFFF, positive) lies above +inf, so a NaN biased score ranks first (ties
    among NaNs to the smaller id), a group holding one has it among its top two, hence a NaN
    score, and is kept first. Every weight of a row that chose a NaN is NaN (their sum is NaN),
    with the bits the GPU produced (not ``NAN_WEIGHT_BITS``). The torch and Triton faces rank
    NaN lowest instead. Route NaN-free logits here, or use backend='triton' for that order.
    """
    num_groups, topk_groups = check_routing_args(logits, top_k, method, bias, num_groups,
                                                 topk_groups, routed_scaling)
    if method != "deepseek_v3":
        # The switch lets "flashinfer" route any method on SM100+, where FlashInfer has
        # trtllm_gen_routing (bf16 weights, ids rebuilt from its permutation): not wrapped yet.
        raise NotImplementedError(
            f"method={method!r}: the FlashInfer routing adapter wraps only fused_topk_deepseek "
            f"(method='deepseek_v3'); use backend='triton' or 'torch'")
    num_tokens, num_experts = logits.shape
    check_flashinfer_limits(num_experts, top_k, num_groups, topk_groups)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights  # a grid of 0 CTAs is a launch error
    from flashinfer.fused_moe import fused_topk_deepseek

    fused_topk_deepseek(logits.float().contiguous(), bias.contiguous(), num_groups, topk_groups,
                        top_k, float(routed_scaling), weights, ids)
    return ids, weights


def route_topk(logits: torch.Tensor, top_k: int, method: str, *, bias=None, num_groups=None,
               topk_groups=None, routed_scaling: float = 1.0, backend=None):
    """Top-k expert routing on the chosen backend.

    Args:
        logits: [T, E] float32, bfloat16 or float16, the router logits.
        top_k: k, experts per token, 1 <= k <= min(E, 32) (FlashInfer: k <= 8).
        method: one of ``kernels.spec.ROUTING_METHODS``: ``softmax_topk``,
            ``softmax_topk_renorm``, ``topk_softmax``, ``sigmoid_topk``,
            ``sigmoid_topk_renorm``, ``deepseek_v3``, ``llama4``.
        bias: [E] float32, DeepSeek-V3's selection bias; required for ``deepseek_v3`` only.
        num_groups: DeepSeek-V3 expert groups (divides E); default 1.
        topk_groups: DeepSeek-V3 groups kept per token; default ``num_groups`` (all).
        routed_scaling: factor applied to every weight.
        backend: ``"triton"``, ``"flashinfer"``, ``"torch"``, ``"auto"`` or None (the default
            from ``MOE_A2A_BACKENDS``); see ``a2a.backends``.

    Returns:
        topk_ids: [T, k] int32, expert ids in descending selection score, ties to the smaller
            id.
        topk_weights: [T, k] float32, the weight of each chosen expert.
    """
    check_routing_args(logits, top_k, method, bias, num_groups, topk_groups, routed_scaling)
    chosen = resolve("routing", backend, logits.device, method=method)
    if chosen == "triton":
        from kernels.routing import route_topk as run
    elif chosen == "flashinfer":
        run = route_topk_flashinfer
    else:
        run = reference.route_topk
    return run(logits, top_k, method, bias=bias, num_groups=num_groups, topk_groups=topk_groups,
               routed_scaling=routed_scaling)
