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

# (section: routing -- route_topk and its methods)


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
                          num_local_experts: Optional[int], align: int) -> int:
    """All checks of ``permute_by_expert`` (the id range one reads the tensor: a host sync on a
    GPU). Returns ``E_local``."""
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    local = _local_expert_count(num_experts, first_expert, num_local_experts, align)
    check_top_k(topk_ids.shape[1], num_experts)
    check_expert_ids("topk_ids", topk_ids, num_experts, allow_padding=True)
    _permutation_capacity(topk_ids.numel(), local, align)
    return local


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int, *, first_expert: int = 0,
                      num_local_experts: Optional[int] = None, align: int = 1) -> Permutation:
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

    Raises ValueError for an id < 0 or > ``num_experts`` (naming it), a local range past
    ``num_experts``, ``align < 1`` or ``k > num_experts``; TypeError for non-int32 ids.
    """
    num_local = _check_permute_inputs(topk_ids, num_experts, first_expert, num_local_experts,
                                      align)
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

# (section: prepare -- local_send_plan, simulate_alltoall, simulate_dispatch, simulate_combine)


# =============================================================================================
# NVFP4 / MXFP8 / MXFP4 quantization
# =============================================================================================

# (section: quantization -- nvfp4, swizzle, mxfp8, mxfp4)
