"""The contract of the permutation ops (``permute_by_expert``, ``gather_rows``,
``unpermute_and_reduce``): their argument checks and the permutation's static capacity."""

from __future__ import annotations

from typing import Optional, Union

import torch

from kernels.spec.tensors import check_expert_ids, check_tensor, check_top_k
from kernels.spec.values import check_index_range, index_extremes, read_to_host
from kernels.types import Permutation


def local_expert_count(num_experts: int, first_expert: int,
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


def permutation_capacity(num_pairs: int, num_local_experts: int, align: int) -> int:
    """``P = T*k + E_local*(align - 1)``: the most permuted rows any routing can need."""
    capacity = num_pairs + num_local_experts * (align - 1)
    if capacity >= 2**31:
        raise ValueError(f"T*k + E_local*(align-1) = {capacity} permuted rows do not fit the "
                         f"int32 index buffers; split the batch")
    return capacity


def check_permute_inputs(topk_ids: torch.Tensor, num_experts: int, first_expert: int,
                         num_local_experts: Optional[int], align: int, *,
                         check_ids: bool = True) -> int:
    """All checks of ``permute_by_expert`` (the id range one, with ``check_ids``, reads the
    tensor: a host sync on a GPU). Returns ``E_local``."""
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    local = local_expert_count(num_experts, first_expert, num_local_experts, align)
    check_top_k(topk_ids.shape[1], num_experts)
    if check_ids:
        check_expert_ids("topk_ids", topk_ids, num_experts, allow_padding=True)
    permutation_capacity(topk_ids.numel(), local, align)
    return local


def check_gather_inputs(x: torch.Tensor, rows: Union[torch.Tensor, Permutation],
                        scales: Optional[torch.Tensor],
                        top_k: Optional[int]) -> tuple[torch.Tensor, int]:
    """Host-side checks of ``gather_rows`` (every face; no host sync). Returns the rows tensor
    and k: ``rows`` may be a :class:`Permutation`, whose ``source_rows`` and ``top_k`` are then
    used (an explicit ``top_k`` must equal it, and x must hold the permutation's T tokens), so
    that a wrong k cannot be passed; a tensor ``rows`` takes ``top_k`` (default 1)."""
    permutation = rows if isinstance(rows, Permutation) else None
    if permutation is not None:
        if top_k is not None and top_k != permutation.top_k:
            raise ValueError(f"top_k={top_k!r} but the permutation was built with top_k="
                             f"{permutation.top_k}; leave top_k out when passing the "
                             f"Permutation")
        rows, top_k = permutation.source_rows, permutation.top_k
    elif top_k is None:
        top_k = 1
    check_tensor("x", x, ndim=2)
    name = "permutation.source_rows" if permutation is not None else "rows"
    check_tensor(name, rows, dtype=torch.int32, ndim=1, device=x.device)
    if scales is not None:
        check_tensor("scales", scales, ndim=2, device=x.device)
        if scales.shape[0] != x.shape[0]:
            raise ValueError(f"scales has {scales.shape[0]} rows but x has {x.shape[0]}; "
                             f"pass the scales of x in the linear layout [T, H/16]")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be a positive int (1 = rows are token ids)")
    if permutation is not None and x.shape[0] * top_k != permutation.inverse.numel():
        raise ValueError(f"x has {x.shape[0]} rows but the permutation was built for "
                         f"{permutation.inverse.numel()} (token, slot) pairs of k={top_k}, "
                         f"i.e. T={permutation.inverse.numel() // top_k} tokens")
    return rows, top_k


def check_permute_and_gather_inputs(topk_ids: torch.Tensor, x: torch.Tensor,
                                    scales: Optional[torch.Tensor]) -> None:
    """The row checks of ``permute_and_gather`` (after ``check_permute_inputs``; no host
    read): x [T, W] and the optional scales [T, Ws] on the ids' device, one row per token of
    ``topk_ids`` [T, k]."""
    check_tensor("x", x, ndim=2, device=topk_ids.device)
    if x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but topk_ids has {topk_ids.shape[0]} tokens; "
                         f"pass one row of x per token")
    if scales is not None:
        check_tensor("scales", scales, ndim=2, device=x.device)
        if scales.shape[0] != x.shape[0]:
            raise ValueError(f"scales has {scales.shape[0]} rows but x has {x.shape[0]}; "
                             f"pass the scales of x in the linear layout [T, H/16]")


def check_gather_values(rows: torch.Tensor, num_tokens: int, top_k: int) -> None:
    """The device-read check of ``gather_rows`` (its ``check_values``; one host read): every
    entry of ``rows`` is UNUSED (-1) or in ``[0, T*top_k)``."""
    check_index_range("rows", read_to_host(index_extremes(rows)), num_tokens * top_k,
                      "T*top_k", hint="; rows past T*top_k mostly mean a top_k smaller than "
                      "the permutation's: pass the Permutation itself as rows")


# Dtypes the un-permute reduces (it accumulates in float32 and casts back).
UNPERMUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_unpermute_tensors(expert_out: torch.Tensor, inverse: torch.Tensor,
                            topk_weights: torch.Tensor) -> None:
    """The checks of ``unpermute_and_reduce`` on its tensors alone (what the registered op,
    which takes the permutation's ``inverse`` and ``P = expert_out.shape[0]``, can check; no
    host sync): expert_out [P, H] and topk_weights [T, k] bf16/fp16/fp32 (any strides), the
    int32 inverse [T*k] on their device."""
    check_tensor("expert_out", expert_out, dtype=UNPERMUTE_DTYPES, ndim=2)
    check_tensor("permutation.inverse", inverse, dtype=torch.int32, ndim=1,
                 device=expert_out.device)
    check_tensor("topk_weights", topk_weights, dtype=UNPERMUTE_DTYPES, ndim=2,
                 device=expert_out.device)
    _check_weight_pairs(topk_weights, inverse)


def _check_weight_pairs(topk_weights: torch.Tensor, inverse: torch.Tensor) -> None:
    if topk_weights.numel() != inverse.numel():
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} does not match the "
                         f"permutation's T*k={inverse.numel()} pairs")


def check_unpermute_inputs(expert_out: torch.Tensor, permutation: Permutation,
                           topk_weights: torch.Tensor) -> None:
    """Host-side checks of ``unpermute_and_reduce`` (every face; no host sync): expert_out
    [P, H] and topk_weights [T, k] bf16/fp16/fp32 (any strides), the permutation's int32
    inverse [T*k] on their device."""
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
    _check_weight_pairs(topk_weights, permutation.inverse)


def check_unpermute_values(permutation: Permutation) -> None:
    """The device-read check of ``unpermute_and_reduce`` (its ``check_values``; one host
    read): every entry of ``permutation.inverse`` is UNUSED (-1) or in ``[0, P)``."""
    check_inverse_values(permutation.inverse, permutation.source_rows.numel())


def check_inverse_values(inverse: torch.Tensor, capacity: int) -> None:
    """:func:`check_unpermute_values` on the permutation's ``inverse`` and its capacity P."""
    check_index_range("permutation.inverse", read_to_host(index_extremes(inverse)), capacity,
                      "P", hint="; pass the Permutation the rows were gathered with")
