"""The contract of the permutation ops (``permute_by_expert``, ``gather_rows``,
``unpermute_and_reduce``): their argument checks and the permutation's static capacity."""

from __future__ import annotations

from typing import Optional

import torch

from kernels.spec.tensors import check_expert_ids, check_tensor, check_top_k
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


def check_gather_inputs(x: torch.Tensor, rows: torch.Tensor, scales: Optional[torch.Tensor],
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


# Dtypes the un-permute reduces (it accumulates in float32 and casts back).
UNPERMUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_unpermute_inputs(expert_out: torch.Tensor, permutation: Permutation,
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
