"""The plain-torch oracle of every op: written for clarity, runs on CPU or GPU.

Tests compare the Triton kernels and the FlashInfer adapters against these functions: index
outputs exactly, NVFP4/MX codes and scales bit-exactly, floats with a per-dtype tolerance. The
public names and signatures here are the ones the other two faces of each op share.

Sections: routing, permutation, prepare (local plan and an R-rank simulation of the
all-to-all), NVFP4 / MXFP8 / MXFP4 quantization.
"""

from __future__ import annotations

import torch

from kernels.types import UNUSED, AlltoallPlan, LocalSendPlan, Permutation
from kernels.validate import check_expert_ids, check_tensor, check_top_k


# =============================================================================================
# Routing
# =============================================================================================

import math  # noqa: E402

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

ROUTING_METHODS = ("softmax_topk", "softmax_topk_renorm", "topk_softmax", "sigmoid_topk",
                   "sigmoid_topk_renorm", "deepseek_v3", "llama4")

# 32: the largest k any face supports (FlashInfer's routing kernels cap top_k at 32; our Triton
# kernel unrolls one argmax per slot).
MAX_TOP_K = 32

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


# =============================================================================================
# Permutation
# =============================================================================================

# Imports of this section.
from typing import Optional, Union  # noqa: E402


def _local_expert_count(num_experts: int, first_expert: int,
                        num_local_experts: Optional[int], align: int) -> int:
    """Check the local expert range and the alignment; return ``E_local``.

    Shared by every face of ``permute_by_expert`` so that all of them refuse the same calls.
    """
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive int")
    if not isinstance(first_expert, int) or not 0 <= first_expert < num_experts:
        raise ValueError(f"first_expert={first_expert!r} must be an int in [0, {num_experts})")
    if num_local_experts is None:
        num_local_experts = num_experts - first_expert
    if not isinstance(num_local_experts, int) or num_local_experts < 1:
        raise ValueError(f"num_local_experts={num_local_experts!r} must be a positive int")
    if first_expert + num_local_experts > num_experts:
        raise ValueError(f"local experts [{first_expert}, {first_expert + num_local_experts}) "
                         f"run past num_experts={num_experts}; lower num_local_experts to "
                         f"{num_experts - first_expert} or less")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align={align!r} must be a positive int (1 = no padding)")
    return num_local_experts


def _permutation_capacity(num_pairs: int, num_local_experts: int, align: int) -> int:
    """``P = T*k + E_local*(align - 1)``: the most permuted rows any routing can need."""
    capacity = num_pairs + num_local_experts * (align - 1)
    if capacity >= 2**31:
        raise ValueError(f"T*k + E_local*(align-1) = {capacity} permuted rows do not fit the "
                         f"int32 index buffers; split the batch")
    return capacity


def _check_permute_inputs(topk_ids: torch.Tensor, num_experts: int, first_expert: int,
                          num_local_experts: Optional[int], align: int, *,
                          check_ids: bool = True) -> int:
    """All checks of ``permute_by_expert`` (the id range one, with ``check_ids``, reads the
    tensor: a host sync on a GPU). Returns ``E_local``."""
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    local = _local_expert_count(num_experts, first_expert, num_local_experts, align)
    check_top_k(topk_ids.shape[1], num_experts)
    if check_ids:
        check_expert_ids("topk_ids", topk_ids, num_experts, allow_padding=True)
    _permutation_capacity(topk_ids.numel(), local, align)
    return local


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int, *, first_expert: int = 0,
                      num_local_experts: Optional[int] = None, align: int = 1,
                      check_ids: bool = True) -> Permutation:
    """Expert-major order of the locally owned (token, slot) pairs (see :class:`Permutation`).

    Arguments:
        topk_ids: [T, k] int32, global expert id of each (token, slot); ``num_experts`` is the
            padding id (an unowned slot, e.g. FlashInfer's masked receive ids).
        num_experts: E (or the slot count S), the number of global expert ids.
        first_expert: the first global expert id this rank owns (``ep_rank * E_local``).
        num_local_experts: E_local, the number of experts owned; default
            ``num_experts - first_expert``.
        align: pad every expert's segment up to a multiple of this (1 = no padding), e.g. the
            grouped GEMM's tile height.

    Returns:
        :class:`Permutation` with ``source_rows [P]``, ``expert_counts [E_local]``,
        ``expert_offsets [E_local + 1]``, ``inverse [T*k]`` (int32, on ``topk_ids``' device),
        ``P = T*k + E_local*(align - 1)``.

    Raises ValueError for an id < 0 or > ``num_experts`` (naming it; only with ``check_ids``,
    the default: with ``check_ids=False`` nothing is read and such an id is skipped as not
    owned, like any id outside the local range), a local range past ``num_experts``,
    ``align < 1`` or ``k > num_experts``; TypeError for non-int32 ids.
    """
    num_local = _check_permute_inputs(topk_ids, num_experts, first_expert, num_local_experts,
                                      align, check_ids=check_ids)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    capacity = _permutation_capacity(num_pairs, num_local, align)

    local = topk_ids.reshape(-1).long() - first_expert
    owned = (local >= 0) & (local < num_local)
    # Sort key: the local expert, with every unowned pair sent past the last one. A stable sort
    # keeps the flat order t*k + j inside each expert.
    key = torch.where(owned, local, torch.full_like(local, num_local))
    order = torch.argsort(key, stable=True)

    counts = torch.bincount(local[owned], minlength=num_local)
    padded = (counts + align - 1) // align * align
    offsets = torch.zeros(num_local + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    unpadded_starts = torch.cumsum(counts, 0) - counts   # where each expert starts in `order`

    owned_pairs = order[:int(counts.sum())]              # owned pairs, expert-major
    expert = key[owned_pairs]
    rank_in_expert = torch.arange(owned_pairs.numel(), device=device) - unpadded_starts[expert]
    position = offsets[expert] + rank_in_expert

    source_rows = torch.full((capacity,), UNUSED, dtype=torch.int32, device=device)
    source_rows[position] = owned_pairs.to(torch.int32)
    inverse = torch.full((num_pairs,), UNUSED, dtype=torch.int32, device=device)
    inverse[owned_pairs] = position.to(torch.int32)
    return Permutation(source_rows=source_rows, expert_counts=counts.to(torch.int32),
                       expert_offsets=offsets.to(torch.int32), inverse=inverse,
                       top_k=topk_ids.shape[1], align=align)


def _check_gather_inputs(x: torch.Tensor, rows: torch.Tensor, scales: Optional[torch.Tensor],
                         top_k: int) -> None:
    """Shape, dtype and device checks of ``gather_rows`` (no value checks: no host sync)."""
    check_tensor("x", x, ndim=2)
    check_tensor("rows", rows, dtype=torch.int32, ndim=1, device=x.device)
    if scales is not None:
        check_tensor("scales", scales, ndim=2, device=x.device)
        if scales.shape[0] != x.shape[0]:
            raise ValueError(f"scales has {scales.shape[0]} rows but x has {x.shape[0]}; "
                             f"pass the scales of x in the linear layout [T, H/16]")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be a positive int (1 = rows are token ids)")


def gather_rows(x: torch.Tensor, rows: torch.Tensor, *, scales: Optional[torch.Tensor] = None,
                top_k: int = 1) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Copy the rows of ``x`` into permuted order: ``out[p] = x[rows[p] // top_k]``.

    Pass ``rows = permutation.source_rows`` (flat pair indices ``t*k + j``) with
    ``top_k = permutation.top_k`` to gather token rows into expert-major order; ``top_k=1``
    (the default) reads ``rows`` as token ids.

    Arguments:
        x: [T, W] any dtype, e.g. bf16 hidden rows [T, H] or packed NVFP4 codes uint8 [T, H/2].
        rows: [P] int32, the source of each output row: ``UNUSED`` (-1) gives a zero row,
            otherwise a value in ``[0, T*top_k)``.
        scales: optional [T, Ws] (e.g. NVFP4 block scales uint8 [T, H/16], linear layout),
            gathered with the same rows.
        top_k: how many consecutive ``rows`` values map to one row of ``x``.

    Returns:
        out: [P, W] in ``x``'s dtype; or ``(out, out_scales [P, Ws])`` when ``scales`` is given.
    """
    _check_gather_inputs(x, rows, scales, top_k)
    limit = x.shape[0] * top_k
    used = rows != UNUSED
    bad = used & ((rows < 0) | (rows >= limit))
    if bool(bad.any()):
        raise ValueError(f"rows holds {int(rows[bad][0])}, outside [0, {limit}) = [0, T*top_k) "
                         f"and not UNUSED ({UNUSED})")
    sources = rows[used].long() // top_k

    def gather(table: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((rows.numel(), table.shape[1]), dtype=table.dtype, device=table.device)
        out[used] = table[sources]
        return out

    return gather(x) if scales is None else (gather(x), gather(scales))


# Dtypes the un-permute reduces (it accumulates in float32 and casts back).
UNPERMUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_unpermute_inputs(expert_out: torch.Tensor, permutation: Permutation,
                            topk_weights: torch.Tensor) -> None:
    """Shape, dtype and device checks of ``unpermute_and_reduce`` (no host sync)."""
    check_tensor("expert_out", expert_out, dtype=UNPERMUTE_DTYPES, ndim=2)
    if not isinstance(permutation, Permutation):
        raise TypeError(f"permutation must be a Permutation (from permute_by_expert), got "
                        f"{type(permutation).__name__}")
    check_tensor("permutation.inverse", permutation.inverse, dtype=torch.int32, ndim=1,
                 device=expert_out.device)
    check_tensor("topk_weights", topk_weights, dtype=UNPERMUTE_DTYPES, ndim=2,
                 device=expert_out.device)
    capacity = permutation.source_rows.numel()
    if expert_out.shape[0] != capacity:
        raise ValueError(f"expert_out has {expert_out.shape[0]} rows but the permutation has "
                         f"P={capacity} (pass the full [P, H] output of the expert compute)")
    if topk_weights.shape[1] != permutation.top_k:
        raise ValueError(f"topk_weights has k={topk_weights.shape[1]} slots but the permutation "
                         f"was built with top_k={permutation.top_k}")
    if topk_weights.numel() != permutation.inverse.numel():
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} does not match the "
                         f"permutation's T*k={permutation.inverse.numel()} pairs")


def unpermute_and_reduce(expert_out: torch.Tensor, permutation: Permutation,
                         topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's permuted rows, back in token order.

    ``out[t] = sum_j w[t, j] * expert_out[inverse[t*k + j]]`` over the owned slots, j = 0..k-1
    in that order, accumulated in float32 (one rounded multiply, then one rounded add, per
    slot; unowned slots are skipped), then cast to ``expert_out``'s dtype. A token with no owned
    slot gives a zero row.

    Arguments:
        expert_out: [P, H] bf16/fp16/fp32, one row per permuted row (the expert compute's output
            in the order of ``permutation.source_rows``; padding rows are never read).
        permutation: the :class:`Permutation` the rows were gathered with.
        topk_weights: [T, k] fp32 (bf16/fp16 accepted), the routing weight of each slot.

    Returns:
        out: [T, H] in ``expert_out``'s dtype.
    """
    _check_unpermute_inputs(expert_out, permutation, topk_weights)
    num_tokens, top_k = topk_weights.shape
    inverse = permutation.inverse.reshape(num_tokens, top_k).long()
    acc = torch.zeros((num_tokens, expert_out.shape[1]), dtype=torch.float32,
                      device=expert_out.device)
    for j in range(top_k):
        owned = inverse[:, j] >= 0
        terms = topk_weights[owned, j].float()[:, None] * expert_out[inverse[owned, j]].float()
        acc[owned] = acc[owned] + terms
    return acc.to(expert_out.dtype)


# =============================================================================================
# Prepare
# =============================================================================================

# Placement is linear over slots: rank(id) = id // (S // R); the id S marks a padding slot that
# goes nowhere. Everything here is written per rank with Python loops for clarity; the Triton
# kernels (kernels/prepare.py, a2a/triton_prepare.py) must equal it field for field.

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


def _destination_ranks(topk_ids: torch.Tensor, slots: int, ep_size: int) -> torch.Tensor:
    """[T, k] int64: the rank owning each slot id; ep_size for the padding id S."""
    return topk_ids.long() // (slots // ep_size)


def local_send_plan(topk_ids: torch.Tensor, num_experts: int, ep_size: int, *,
                    max_tokens_per_rank=None, slot_count=None,
                    check_ids: bool = True) -> LocalSendPlan:
    """What this rank sends where, from its own routing alone (no communication).

    topk_ids:            [T, k] int32, slot ids in ``[0, S]``; S = padding (sent nowhere).
    num_experts:         E, the number of distinct experts.
    ep_size:             R, the number of ranks; S must be a multiple of R.
    max_tokens_per_rank: N >= T, sizes the index buffers ([N*R]); default T.
    slot_count:          S >= E (E plus redundant expert copies); default E.
    check_ids:           range-check the ids (reads them).
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
    expert_counts = torch.bincount(topk_ids.flatten().long(), minlength=slots + 1)[:slots]
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
    float32 (:func:`sum_slots_in_order`), rounded once to the dtype; at most min(R, k) of the k
    rows are nonzero.
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
        out.append(summed.to(like.dtype))
    return out


def sum_slots_in_order(rows: torch.Tensor) -> torch.Tensor:
    """Combine's reduction over k, defined as one fixed order: ``[T, k, H]`` -> ``[T, H]``
    float32, ``acc = 0; acc = acc + float32(rows[:, j])`` for j = 0, 1, ..., k-1 (a left fold
    from +0, one float32 rounding per add). Every transport and every kernel that reduces over
    k repeats exactly these adds, so results are bit-identical on any device (torch.sum's own
    order is an implementation detail that differs between CPU and GPU)."""
    acc = torch.zeros((rows.shape[0], rows.shape[2]), dtype=torch.float32, device=rows.device)
    for slot in range(rows.shape[1]):
        acc = acc + rows[:, slot].float()
    return acc


# =============================================================================================
# NVFP4 / MXFP8 / MXFP4 quantization
# =============================================================================================

# Numbers in this section (bit-exact, see design.md "NVFP4"):
#   e4m3 (float8_e4m3fn): bias 7, 3 mantissa bits, max 448, no inf; code 0x7F/0xFF is NaN.
#   e2m1: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} for codes 0..7, bit 3 the sign.
#   e8m0: code c means 2^(c - 127); 255 is NaN.
# Every conversion rounds to nearest, ties to even, and saturates to the largest finite value
# ("satfinite"). Signs are kept, so -0.0 and negative values that round to zero give e2m1 code
# 0x8, as the hardware conversion does.
#
# What FlashInfer 0.7.2 does (read in csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh
# and cpp/kernels/quantization.cu; facts, not code):
# - NVFP4, FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1: sf = e4m3(amax * (gs * f32(1/6))), 0 when
#   amax == 0; out_scale = fminf(1 / (f32(sf) * (1 / gs)), FLT_MAX) with IEEE divisions, 0 when
#   amax == 0; codes = cvt.rn.satfinite.e2m1x2.f32(x * out_scale). Default ("fast math"): the
#   same with rcp.approx.ftz.f32 for 1/6, 1/gs and the outer reciprocal, and no FLT_MAX clamp.
#   The variable is read with getenv on every launch (not cached, not at JIT time; both recipes
#   are compiled into the same module) and must be exactly "1".
# - MXFP8 (cvt_warp_fp16_to_mxfp8): s = amax * rcp.approx(448); code = e8m0 of s rounded towards
#   +inf, satfinite; out_scale = 1 / 2^(code-127), but 0 when that power is 0 under the module's
#   flush-to-zero (code 0); values clamped to +-448 (fminf/fmaxf, so NaN becomes +448) and then
#   converted with cvt.rn.satfinite to e4m3.
# - MXFP4 (fp4_quantize with sf_vec_size=32, sf_use_ue8m0=True): s = amax * rcp.approx(6); code
#   as above; out_scale = 0 when amax == 0, 1 when code == 0 (exp2f_rcp's special case), else
#   2^(127 - code); codes = cvt.rn.satfinite.e2m1x2.f32(x * out_scale).
# - All these modules are built with -use_fast_math (flush-to-zero). We keep subnormals, so we
#   agree with FlashInfer unless a block amax, 1/gs or f32(sf) * (1/gs) is below 2^-126; and we use
#   f32(1/6), f32(1/448) where FlashInfer uses rcp.approx (a GPU test checks they are equal).
# - Swizzled scale layouts (get_sf_out_offset_128x4 / _8x4): the formulas in design.md; the
#   padding is written as zeros. fp4_quantize returns swizzled scales as [Mp, Kp] uint8,
#   block_scale_interleave returns the same bytes flat, [Mp * Kp].

E2M1_MAX = 6.0  # largest e2m1 magnitude
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
NVFP4_BLOCK = 16  # elements per NVFP4 scale
MX_BLOCK = 32  # elements per MX (e8m0) scale
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX  # gs = 448 * 6 / amax(x)
FLT_MAX = 3.4028234663852886e38
SCALE_LAYOUTS = ("linear", "swizzled_128x4", "8x4")
# Row tile of each swizzled layout (the number of rows it pads to); both pad blocks to 4.
LAYOUT_ROW_TILE = {"swizzled_128x4": 128, "8x4": 8}
LAYOUT_BLOCK_TILE = 4
QUANT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_grid(device: torch.device) -> torch.Tensor:
    """_E2M1_VALUES as an fp32 tensor on ``device``, computed there from the codes (exponent
    e = code >> 1, mantissa m = code & 1: m / 2 for e == 0, else 2^(e-1) * (1 + m / 2)), not
    copied from the host, so that the oracle stays capturable in a CUDA graph (compiled too)."""
    code = torch.arange(8, device=device)
    exponent, mantissa = (code >> 1).to(torch.float32), (code & 1).to(torch.float32)
    return torch.where(exponent == 0, mantissa * 0.5,
                       torch.exp2(exponent - 1) * (1.0 + mantissa * 0.5))


def _f32(value: float, device: torch.device) -> torch.Tensor:
    """fp32(value) as a 0-d tensor filled on ``device`` (no host-to-device copy)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _check_quant_input(x: torch.Tensor, block: int) -> None:
    check_tensor("x", x, dtype=QUANT_INPUT_DTYPES, ndim=2)
    if x.shape[1] % block:
        raise ValueError(f"x has H={x.shape[1]} columns; H must be a multiple of {block} "
                         f"(one scale per {block} elements); pad the hidden size")


def _check_layout(layout: str) -> None:
    if layout not in SCALE_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {SCALE_LAYOUTS}")


def _check_global_scale(global_scale: torch.Tensor, device: torch.device) -> None:
    check_tensor("global_scale", global_scale, dtype=torch.float32, device=device)
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale must hold 1 element, got shape "
                         f"{tuple(global_scale.shape)}; pass nvfp4_global_scale(x)")


def _round_to_grid(magnitude: torch.Tensor, mantissa_bits: int, min_exponent: int,
                   max_value: float) -> torch.Tensor:
    """Round non-negative fp32 ``magnitude`` to the nearest value (ties to even) of a binary
    format with ``mantissa_bits`` and smallest normal exponent ``min_exponent``, saturating at
    ``max_value`` (NaN stays NaN). Exact: the quantum is a power of two, so scaling by it is
    exact and torch.round (half to even) does the rounding."""
    _, exponent = torch.frexp(magnitude)  # magnitude = f * 2^exponent, f in [0.5, 1)
    exponent = torch.clamp(exponent - 1, min=min_exponent)  # floor(log2), at least emin
    quantum_exponent = exponent - mantissa_bits
    quantum_exponent = quantum_exponent.to(torch.float32)
    rounded = torch.ldexp(torch.round(torch.ldexp(magnitude, -quantum_exponent)),
                          quantum_exponent)
    return torch.where(rounded > max_value, torch.full_like(rounded, max_value), rounded)


def e4m3_code(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn bits (uint8), round to nearest even, satfinite (|x| > 448 and
    +-inf give +-448); NaN gives 0x7F."""
    x = x.to(torch.float32)
    magnitude = _round_to_grid(x.abs(), mantissa_bits=3, min_exponent=-6, max_value=E4M3_MAX)
    _, exponent = torch.frexp(magnitude)
    exponent = exponent - 1  # floor(log2) of the rounded magnitude
    normal = magnitude >= 2.0 ** -6
    # normal: (exponent + 7) << 3 | mantissa; subnormal: magnitude / 2^-9 (0..7)
    mantissa = torch.where(normal, torch.ldexp(magnitude, -exponent.to(torch.float32)) * 8 - 8,
                           magnitude * 512)
    code = torch.where(normal, (exponent + 7) * 8, torch.zeros_like(exponent)) + mantissa.to(
        torch.int32)
    code = torch.where(torch.signbit(x), code | 0x80, code)
    code = torch.where(torch.isnan(x), torch.full_like(code, 0x7F), code)
    return code.to(torch.uint8)


def e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bits (uint8) -> fp32 (exact)."""
    return code.view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 code (uint8, 0..15), round to nearest even, satfinite (|x| > 6 and +-inf
    give +-6); the sign bit is kept (-0.0 -> 0x8); NaN gives 0x7 with NaN's sign bit."""
    x = x.to(torch.float32)
    magnitude = _round_to_grid(x.abs(), mantissa_bits=1, min_exponent=0, max_value=E2M1_MAX)
    magnitude = torch.where(torch.isnan(x), torch.full_like(magnitude, E2M1_MAX), magnitude)
    grid = _e2m1_grid(x.device)
    code = torch.searchsorted(grid, magnitude.contiguous())  # exact match: the grid index
    code = torch.where(torch.signbit(x), code | 0x8, code)
    return code.to(torch.uint8)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """e2m1 code (uint8, low 4 bits) -> fp32 (exact)."""
    grid = _e2m1_grid(code.device)
    code = code.to(torch.int64) & 0xF
    magnitude = grid[code & 0x7]
    return torch.where(code >= 8, -magnitude, magnitude)


def e8m0_code(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> e8m0 code (uint8): the smallest c with 2^(c-127) >= x (rounding
    towards +inf), 0 for x <= 2^-127 (and x == 0), satfinite 254 above 2^127; NaN gives 255."""
    x = x.to(torch.float32)
    _, exponent = torch.frexp(x)  # x = f * 2^exponent, f in [0.5, 1)
    is_power_of_two = torch.ldexp(torch.ones_like(x), (exponent - 1).to(torch.float32)) == x
    ceil_log2 = torch.where(is_power_of_two, exponent - 1, exponent)
    code = torch.clamp(ceil_log2 + 127, 0, 254)
    code = torch.where(x == 0, torch.zeros_like(code), code)
    code = torch.where(torch.isinf(x), torch.full_like(code, 254), code)
    code = torch.where(torch.isnan(x), torch.full_like(code, 255), code)
    return code.to(torch.uint8)


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """e8m0 code (uint8) -> fp32 2^(code-127) (exact; 2^-127 is an fp32 subnormal)."""
    return torch.ldexp(torch.ones(code.shape, dtype=torch.float32, device=code.device),
                       code.to(torch.float32) - 127)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[M, H] codes (uint8 < 16) -> [M, H/2] bytes; element 2i in the low nibble of byte i."""
    pairs = codes.reshape(codes.shape[0], codes.shape[1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[M, H/2] bytes -> [M, H] codes; the inverse of ``_pack_nibbles``."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return codes.reshape(packed.shape[0], packed.shape[1] * 2)


def _block_amax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as fp32 [M, H/block, block] and its per-block amax [M, H/block]."""
    blocks = x.to(torch.float32).reshape(x.shape[0], x.shape[1] // block, block)
    return blocks, blocks.abs().amax(dim=-1)


def swizzled_scale_shape(num_rows: int, num_blocks: int, layout: str) -> tuple[int, int]:
    """[Mp, Kp] of the scale buffer of ``layout``: [M, H/16] for "linear"; for the swizzled
    layouts rows padded to 128 (or 8) and blocks to 4 (FlashInfer's fp4_quantize shape)."""
    _check_layout(layout)
    if layout == "linear":
        return num_rows, num_blocks
    return (_round_up(num_rows, LAYOUT_ROW_TILE[layout]),
            _round_up(num_blocks, LAYOUT_BLOCK_TILE))


def scale_offsets(rows: torch.Tensor, blocks: torch.Tensor, padded_blocks: int,
                  layout: str) -> torch.Tensor:
    """Byte offset of scale (row, block) in a ``layout`` buffer with ``padded_blocks`` (Kp)
    blocks per row, int64, broadcasting ``rows`` against ``blocks``:
    128x4: (m//128)*(Kp/4)*512 + (kb//4)*512 + (m%32)*16 + ((m%128)//32)*4 + kb%4;
    8x4:   (m//8)*(Kp/4)*32 + (kb//4)*32 + (m%8)*4 + kb%4; linear: m*Kp + kb."""
    rows, blocks = rows.to(torch.int64), blocks.to(torch.int64)
    k_tiles = padded_blocks // LAYOUT_BLOCK_TILE
    if layout == "linear":
        return rows * padded_blocks + blocks
    if layout == "swizzled_128x4":
        return ((rows // 128) * k_tiles * 512 + (blocks // 4) * 512 + (rows % 32) * 16
                + ((rows % 128) // 32) * 4 + blocks % 4)
    if layout == "8x4":
        return (rows // 8) * k_tiles * 32 + (blocks // 4) * 32 + (rows % 8) * 4 + blocks % 4
    _check_layout(layout)


def swizzle_scales(sf: torch.Tensor, layout: str) -> torch.Tensor:
    """Lay out linear block scales for an FP4/MX GEMM.

    sf: [M, K] uint8, one scale per block (K = H/16 for NVFP4, H/32 for MX), linear.
    layout: "linear" (returns a copy), "swizzled_128x4" or "8x4".
    Returns [Mp, Kp] uint8 (``swizzled_scale_shape``), padding zero; the bytes of FlashInfer's
    fp4_quantize swizzled scales and of ``block_scale_interleave`` (which returns them flat).
    """
    check_tensor("sf", sf, dtype=torch.uint8, ndim=2)
    num_rows, num_blocks = sf.shape
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    out = torch.zeros(padded_rows * padded_blocks, dtype=torch.uint8, device=sf.device)
    offsets = scale_offsets(torch.arange(num_rows, device=sf.device)[:, None],
                            torch.arange(num_blocks, device=sf.device)[None, :],
                            padded_blocks, layout)
    out[offsets.reshape(-1)] = sf.reshape(-1)
    return out.reshape(padded_rows, padded_blocks)


def unswizzle_scales(sf_swizzled: torch.Tensor, layout: str, num_rows: int,
                     num_blocks: int) -> torch.Tensor:
    """The inverse of ``swizzle_scales``: [Mp, Kp] (or flat [Mp*Kp]) uint8 in ``layout`` ->
    [num_rows, num_blocks] uint8 linear. num_rows and num_blocks are needed because the
    padding hides them."""
    check_tensor("sf_swizzled", sf_swizzled, dtype=torch.uint8)
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    if sf_swizzled.numel() != padded_rows * padded_blocks:
        raise ValueError(f"sf_swizzled has {sf_swizzled.numel()} bytes; layout={layout!r} with "
                         f"{num_rows} rows and {num_blocks} blocks needs "
                         f"{padded_rows} x {padded_blocks} = {padded_rows * padded_blocks}")
    offsets = scale_offsets(torch.arange(num_rows, device=sf_swizzled.device)[:, None],
                            torch.arange(num_blocks, device=sf_swizzled.device)[None, :],
                            padded_blocks, layout)
    return sf_swizzled.reshape(-1)[offsets]


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 global encode scale ``448 * 6 / amax(x)``.

    x: [M, H] bf16/fp16/fp32. Returns [1] fp32 (IEEE division, round to nearest even); the
    decode scale is its reciprocal. When amax(x) == 0 (all zeros, or M == 0) it returns 1.0:
    finite, and every block then has amax 0, scale code 0 and element code 0 (0x8 for -0.0).
    """
    check_tensor("x", x, dtype=QUANT_INPUT_DTYPES, ndim=2)
    amax = x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
    scale = _f32(NVFP4_GLOBAL_NUMERATOR, x.device) / amax
    return torch.where(amax == 0, torch.ones_like(scale), scale).reshape(1)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, *, layout: str = "linear",
                   fast_math: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize the rows of ``x`` (design.md's IEEE recipe, bit-exact).

    x: [M, H] bf16/fp16/fp32, H % 16 == 0.
    global_scale: [1] fp32 encode scale, e.g. ``nvfp4_global_scale(x)``.
    layout: scale layout, "linear", "swizzled_128x4" or "8x4".
    fast_math: FlashInfer's default recipe; needs the GPU's rcp.approx.ftz.f32, so the
        reference raises NotImplementedError (the Triton kernel has it on a GPU).
    Returns (packed [M, H/2] uint8, element 2i in the low nibble of byte i;
             scales uint8 e4m3 bits: [M, H/16] linear, [Mp, Kp] swizzled (``swizzle_scales``)).
    """
    if fast_math:
        raise NotImplementedError(
            "fast_math=True uses the GPU instruction rcp.approx.ftz.f32, whose results torch "
            "cannot reproduce; use kernels.quantize.quantize_nvfp4 on a GPU, or fast_math=False")
    _check_quant_input(x, NVFP4_BLOCK)
    _check_layout(layout)
    _check_global_scale(global_scale, x.device)
    gs = global_scale.reshape(()).to(torch.float32)
    blocks, amax = _block_amax(x, NVFP4_BLOCK)
    inv6 = _f32(1.0 / 6.0, x.device)
    sf = e4m3_code(amax * (gs * inv6))
    decode = 1.0 / gs
    out_scale = torch.clamp(1.0 / (e4m3_value(sf) * decode), max=FLT_MAX)
    out_scale = torch.where(amax == 0, torch.zeros_like(out_scale), out_scale)
    codes = e2m1_code(blocks * out_scale[..., None]).reshape(x.shape)
    return _pack_nibbles(codes), swizzle_scales(sf, layout)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     layout: str = "linear", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value each NVFP4 code stands for: ``(e2m1 * f32(sf)) * (1 / global_scale)``.

    packed: [M, H/2] uint8; scales: uint8 e4m3 bits in ``layout`` ([M, H/16] or [Mp, Kp]);
    global_scale: [1] fp32 encode scale. Returns [M, H] ``dtype`` (rounded once from fp32).
    """
    check_tensor("packed", packed, dtype=torch.uint8, ndim=2)
    _check_global_scale(global_scale, packed.device)
    num_rows, num_blocks = packed.shape[0], packed.shape[1] * 2 // NVFP4_BLOCK
    if packed.shape[1] * 2 % NVFP4_BLOCK:
        raise ValueError(f"packed has {packed.shape[1]} bytes per row; H = 2 * that must be a "
                         f"multiple of {NVFP4_BLOCK}")
    sf = unswizzle_scales(scales, layout, num_rows, num_blocks)
    values = e2m1_value(_unpack_nibbles(packed)).reshape(num_rows, num_blocks, NVFP4_BLOCK)
    decode = 1.0 / global_scale.reshape(()).to(torch.float32)
    out = (values * e4m3_value(sf)[..., None]) * decode
    return out.reshape(num_rows, num_blocks * NVFP4_BLOCK).to(dtype)


def _mx_scales(amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """e8m0 code of amax * f32(1 / element_max), rounded towards +inf."""
    inverse = _f32(1.0 / element_max, amax.device)
    return e8m0_code(amax * inverse)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize the rows of ``x`` (FlashInfer's mxfp8_quantize recipe).

    x: [M, H] bf16/fp16/fp32, H % 32 == 0.
    Returns (values [M, H] torch.float8_e4m3fn, as FlashInfer's mxfp8_quantize returns;
             scales [M, H/32] uint8 e8m0, code = e8m0(amax * f32(1/448)) rounded up).
    Element = e4m3_rne_satfinite(clamp(x * 2^(127 - code), -448, 448)); code 0 multiplies by 0
    (FlashInfer's flush-to-zero); NaN becomes +448.
    """
    _check_quant_input(x, MX_BLOCK)
    blocks, amax = _block_amax(x, MX_BLOCK)
    sf = _mx_scales(amax, E4M3_MAX)
    out_scale = torch.where(sf == 0, torch.zeros_like(amax), 1.0 / e8m0_value(sf))
    scaled = blocks * out_scale[..., None]
    scaled = torch.where(torch.isnan(scaled), torch.full_like(scaled, E4M3_MAX), scaled)
    values = e4m3_code(torch.clamp(scaled, -E4M3_MAX, E4M3_MAX)).reshape(x.shape)
    return values.view(torch.float8_e4m3fn), sf


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [M, H] float8_e4m3fn (or its uint8 bits), scales [M, H/32] uint8 e8m0 ->
    [M, H] ``dtype``: value * 2^(code - 127)."""
    check_tensor("values", values, dtype=(torch.float8_e4m3fn, torch.uint8), ndim=2)
    check_tensor("scales", scales, dtype=torch.uint8, ndim=2)
    num_rows = values.shape[0]
    hidden = values.shape[1]
    blocks = e4m3_value(values.view(torch.uint8)).reshape(num_rows, hidden // MX_BLOCK, MX_BLOCK)
    return (blocks * e8m0_value(scales)[..., None]).reshape(num_rows, hidden).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize the rows of ``x`` (FlashInfer's fp4_quantize(sf_vec_size=32,
    sf_use_ue8m0=True) recipe).

    x: [M, H] bf16/fp16/fp32, H % 32 == 0.
    Returns (packed [M, H/2] uint8, element 2i in the low nibble;
             scales [M, H/32] uint8 e8m0, code = e8m0(amax * f32(1/6)) rounded up).
    Element = e2m1_rne_satfinite(x * s), s = 0 if amax == 0, 1 if code == 0, else
    2^(127 - code).
    """
    _check_quant_input(x, MX_BLOCK)
    blocks, amax = _block_amax(x, MX_BLOCK)
    sf = _mx_scales(amax, E2M1_MAX)
    out_scale = torch.where(sf == 0, torch.ones_like(amax), 1.0 / e8m0_value(sf))
    out_scale = torch.where(amax == 0, torch.zeros_like(amax), out_scale)
    codes = e2m1_code(blocks * out_scale[..., None]).reshape(x.shape)
    return _pack_nibbles(codes), sf


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [M, H/2] uint8, scales [M, H/32] uint8 e8m0 -> [M, H] ``dtype``:
    e2m1 * 2^(code - 127)."""
    check_tensor("packed", packed, dtype=torch.uint8, ndim=2)
    check_tensor("scales", scales, dtype=torch.uint8, ndim=2)
    num_rows = packed.shape[0]
    hidden = packed.shape[1] * 2
    values = e2m1_value(_unpack_nibbles(packed)).reshape(num_rows, hidden // MX_BLOCK, MX_BLOCK)
    return (values * e8m0_value(scales)[..., None]).reshape(num_rows, hidden).to(dtype)
