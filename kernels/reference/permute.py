"""The oracle of the permutation ops: ``permute_by_expert`` (expert-major order of the locally
owned (token, slot) pairs), ``gather_rows`` and ``unpermute_and_reduce``, in plain torch."""

from __future__ import annotations

from typing import Optional, Union

import torch

from kernels.spec.casting import round_to_dtype
from kernels.spec.permute import (check_gather_inputs, check_gather_values,
                                  check_permute_and_gather_inputs, check_permute_inputs,
                                  check_unpermute_inputs, check_unpermute_values,
                                  permutation_capacity)
from kernels.types import UNUSED, Permutation


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
    num_local = check_permute_inputs(topk_ids, num_experts, first_expert, num_local_experts,
                                     align, check_ids=check_ids)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    capacity = permutation_capacity(num_pairs, num_local, align)

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


def gather_table_rows(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``out[p] = table[tokens[p]]`` byte for byte, and a zero row where ``tokens[p]`` is
    outside ``[0, T)``. table: [T, W] any dtype and strides; tokens: [P] integer. No host
    sync (capturable): the rows are moved as bytes, so NaN payloads and -0.0 stay as they
    are."""
    num_tokens, width = table.shape
    if num_tokens == 0 or width == 0:  # nothing to read: every row is a zero row
        return torch.zeros((tokens.numel(), width), dtype=table.dtype, device=table.device)
    # [T, W * bytes per element]; flat first: a contiguous tensor with a size-1 dim may carry
    # any stride there, which a dtype view refuses
    raw = table.contiguous().reshape(-1).view(torch.uint8).reshape(num_tokens, -1)
    valid = (tokens >= 0) & (tokens < num_tokens)
    out = raw[torch.where(valid, tokens, 0).long()].masked_fill_(~valid[:, None], 0)
    return out.view(table.dtype)


def gather_rows(x: torch.Tensor, rows: Union[torch.Tensor, Permutation], *,
                scales: Optional[torch.Tensor] = None, top_k: Optional[int] = None,
                check_values: bool = True
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Copy the rows of ``x`` into permuted order: ``out[p] = x[rows[p] // top_k]``, byte for
    byte.

    Pass the :class:`Permutation` itself as ``rows`` (its ``source_rows``, flat pair indices
    ``t*k + j``, and its ``top_k`` are used: a wrong k cannot be passed), or a tensor of rows
    with ``top_k`` (default 1: ``rows`` are token ids).

    Arguments:
        x: [T, W] any dtype and strides, e.g. bf16 hidden rows [T, H] or packed NVFP4 codes
            uint8 [T, H/2].
        rows: a Permutation, or [P] int32 (any strides), the source of each output row:
            ``UNUSED`` (-1) gives a zero row, otherwise a value in ``[0, T*top_k)``.
        scales: optional [T, Ws] (e.g. NVFP4 block scales uint8 [T, H/16], linear layout),
            gathered with the same rows.
        top_k: how many consecutive ``rows`` values map to one row of ``x``; with a
            Permutation leave it out (or pass the permutation's).
        check_values: True: read the range of ``rows`` (one host sync) and raise ValueError
            for an entry that is neither UNUSED nor in ``[0, T*top_k)``. False: nothing is
            read (CUDA graphs); such an entry then gives a zero row, on every face.

    Returns:
        out: [P, W] in ``x``'s dtype; or ``(out, out_scales [P, Ws])`` when ``scales`` is given.
    """
    rows, top_k = check_gather_inputs(x, rows, scales, top_k)
    if check_values:
        check_gather_values(rows, x.shape[0], top_k)
    limit = x.shape[0] * top_k
    # Out of range (UNUSED included) -> token -1 -> a zero row.
    tokens = torch.where((rows >= 0) & (rows < limit), rows // top_k, UNUSED)
    out = gather_table_rows(x, tokens)
    return out if scales is None else (out, gather_table_rows(scales, tokens))


def permute_and_gather(topk_ids: torch.Tensor, x: torch.Tensor, num_experts: int, *,
                       scales: Optional[torch.Tensor] = None, first_expert: int = 0,
                       num_local_experts: Optional[int] = None, align: int = 1,
                       check_ids: bool = True) -> tuple:
    """:func:`permute_by_expert`, then :func:`gather_rows` of x (and scales) through it: the
    oracle of the fused op. x: [T, W] any dtype, one row per token of ``topk_ids`` [T, k];
    scales: optional [T, Ws]. Returns ``(permutation, out)`` or ``(permutation, out,
    out_scales)``; the errors of the two ops (the ids' first)."""
    check_permute_inputs(topk_ids, num_experts, first_expert, num_local_experts, align,
                         check_ids=False)
    check_permute_and_gather_inputs(topk_ids, x, scales)
    permutation = permute_by_expert(topk_ids, num_experts, first_expert=first_expert,
                                    num_local_experts=num_local_experts, align=align,
                                    check_ids=check_ids)
    gathered = gather_rows(x, permutation, scales=scales, check_values=False)
    return (permutation, gathered) if scales is None else (permutation, *gathered)


def unpermute_and_reduce(expert_out: torch.Tensor, permutation: Permutation,
                         topk_weights: torch.Tensor, *,
                         check_values: bool = True) -> torch.Tensor:
    """Weighted sum of each token's permuted rows, back in token order.

    ``out[t] = sum_j w[t, j] * expert_out[inverse[t*k + j]]`` over the owned slots, j = 0..k-1
    in that order, accumulated in float32 from +0 (one rounded multiply, then one rounded add,
    per owned slot; unowned slots are skipped), then rounded once to ``expert_out``'s dtype
    (nearest even; every NaN written as the canonical NaN, ``kernels.spec.casting``). A token
    with no owned slot gives a zero row.

    Arguments:
        expert_out: [P, H] bf16/fp16/fp32, any strides, one row per permuted row (the expert
            compute's output in the order of ``permutation.source_rows``; padding rows are
            never read).
        permutation: the :class:`Permutation` the rows were gathered with; its ``inverse``
            [T*k] int32 holds each slot's row of ``expert_out`` or UNUSED (not owned).
        topk_weights: [T, k] fp32 (bf16/fp16 accepted), any strides, the routing weight of
            each slot.
        check_values: True: read the range of ``permutation.inverse`` (one host sync) and raise
            ValueError for an entry that is neither UNUSED nor in ``[0, P)``. False: nothing is
            read (CUDA graphs); such a slot then counts as not owned, on every face.

    Returns:
        out: [T, H] in ``expert_out``'s dtype.
    """
    check_unpermute_inputs(expert_out, permutation, topk_weights)
    if check_values:
        check_unpermute_values(permutation)
    return reduce_slots(expert_out, permutation.inverse, topk_weights)


def reduce_slots(expert_out: torch.Tensor, inverse: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
    """The sum of :func:`unpermute_and_reduce` on checked tensors: ``inverse`` [T*k] int32 (the
    permutation's), ``P = expert_out.shape[0]``; an entry outside ``[0, P)`` is not owned."""
    num_tokens, top_k = topk_weights.shape
    capacity = expert_out.shape[0]
    inverse = inverse.reshape(num_tokens, top_k)
    acc = torch.zeros((num_tokens, expert_out.shape[1]), dtype=torch.float32,
                      device=expert_out.device)
    for j in range(top_k if capacity > 0 else 0):  # P == 0: no slot can be owned
        owned = (inverse[:, j] >= 0) & (inverse[:, j] < capacity)
        values = expert_out[torch.where(owned, inverse[:, j], 0).long()].float()
        terms = topk_weights[:, j].float()[:, None] * values
        acc = torch.where(owned[:, None], acc + terms, acc)
    return round_to_dtype(acc, expert_out.dtype)
