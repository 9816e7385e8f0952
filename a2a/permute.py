"""The "permute" stage: expert-major permutation around the local expert compute.

Public functions with the signatures of their oracles in ``kernels.reference`` plus a keyword
``backend=None``: ``"triton"`` runs ``kernels.permute``, ``"torch"`` the plain-torch reference.
FlashInfer has no standalone permutation (it is fused into its MoE GEMMs), so the switch refuses
``"flashinfer"`` with that reason. The backend is resolved once per call by
``a2a.backends.resolve("permute", backend, device)``.

A local expert step on a rank that owns experts ``[first, first + E_local)``::

    perm = permute_by_expert(recv_expert_ids, num_experts, first_expert=first,
                             num_local_experts=E_local, align=128)
    rows = gather_rows(recv_x, perm)                                        # [P, H]
    # (or both in one call: perm, rows = permute_and_gather(recv_expert_ids, recv_x, ...))
    expert_out = grouped_gemm(rows, perm.expert_offsets)                    # the user's
    out = unpermute_and_reduce(expert_out, perm, recv_weights)             # [T, H]
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from a2a.backends import resolve
from kernels import reference
from kernels.types import Permutation


def _resolve(backend: Optional[str], tensor: torch.Tensor, name: str) -> str:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    return resolve("permute", backend, tensor.device)


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int, *, first_expert: int = 0,
                      num_local_experts: Optional[int] = None, align: int = 1,
                      check_ids: bool = True, overlap_previous: bool = False,
                      backend: Optional[str] = None) -> Permutation:
    """Expert-major order of the locally owned (token, slot) pairs.

    Arguments:
        topk_ids: [T, k] int32, global expert id of each (token, slot); ``num_experts`` is the
            padding id (an unowned slot); any other id outside ``[0, num_experts)`` is an error.
        num_experts: E (or the slot count S), the number of global expert ids.
        first_expert: the first global expert id this rank owns (``ep_rank * E_local``).
        num_local_experts: E_local; default ``num_experts - first_expert``.
        align: pad every expert's segment up to a multiple of this (e.g. the grouped GEMM's
            tile height; 1 = no padding).
        check_ids: True: raise ValueError for an id outside ``[0, num_experts]`` (one host
            sync on a GPU: Triton checks on the device and reads the result once). False: no
            sync (CUDA graphs, benchmarks); out-of-range ids are skipped as not owned.
        overlap_previous: the caller's promise that the kernel launched just before this call
            on its stream did not write ``topk_ids`` (say, the quantize of the activations
            came between the routing and this call). On "triton" with PDL (SM90+) the
            permutation then reads the ids while that kernel still runs
            (``kernels.permute.PermuteLaunch.overlap_previous``); the same bits either way, and
            nothing on "torch". A false promise gives a wrong permutation, not an error.
        backend: "triton", "torch" or "auto"; None takes the default (``MOE_A2A_BACKENDS``).

    Returns:
        :class:`kernels.types.Permutation`: ``source_rows [P]`` (flat pair index ``t*k + j`` of
        each permuted row, UNUSED for padding), ``expert_counts [E_local]``,
        ``expert_offsets [E_local + 1]``, ``inverse [T*k]``, all int32 on ``topk_ids``' device,
        ``P = T*k + E_local*(align - 1)``. Both backends give identical buffers.
    """
    options = dict(first_expert=first_expert, num_local_experts=num_local_experts, align=align,
                   check_ids=check_ids)
    if _resolve(backend, topk_ids, "topk_ids") == "triton":
        from kernels.permute import PermuteLaunch, permute_by_expert
        return permute_by_expert(topk_ids, num_experts, **options,
                                 launch=PermuteLaunch(overlap_previous=overlap_previous))
    return reference.permute_by_expert(topk_ids, num_experts, **options)


def gather_rows(x: torch.Tensor, rows: Union[torch.Tensor, Permutation], *,
                scales: Optional[torch.Tensor] = None, top_k: Optional[int] = None,
                check_values: bool = True, backend: Optional[str] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Copy rows of ``x`` into permuted order: ``out[p] = x[rows[p] // top_k]``, zeros where
    ``rows[p]`` is UNUSED; both backends give the same bytes and the same errors
    (``kernels.reference.gather_rows``).

    Arguments:
        x: [T, W] any dtype and strides (bf16 rows [T, H], packed NVFP4 uint8 [T, H/2], ...).
        rows: the :class:`Permutation` itself (its source_rows and top_k are used), or [P]
            int32 rows with ``top_k``.
        scales: optional [T, Ws], e.g. NVFP4 block scales uint8 [T, H/16], gathered alike.
        top_k: consecutive ``rows`` values per row of ``x`` (default 1 = rows are token ids;
            leave it out with a Permutation).
        check_values: True: one host read of the rows' range, ValueError for an entry neither
            UNUSED nor in [0, T*top_k). False: no read (CUDA graphs); such an entry gives a
            zero row.
        backend: "triton", "torch" or "auto"; None takes the default.

    Returns:
        out [P, W] in ``x``'s dtype, or ``(out, out_scales [P, Ws])`` when ``scales`` is given.
    """
    if _resolve(backend, x, "x") == "triton":
        from kernels.gather import gather_rows as run
    else:
        run = reference.gather_rows
    return run(x, rows, scales=scales, top_k=top_k, check_values=check_values)


def permute_and_gather(topk_ids: torch.Tensor, x: torch.Tensor, num_experts: int, *,
                       scales: Optional[torch.Tensor] = None, first_expert: int = 0,
                       num_local_experts: Optional[int] = None, align: int = 1,
                       check_ids: bool = True, overlap_previous: bool = False,
                       backend: Optional[str] = None) -> tuple:
    """:func:`permute_by_expert` and :func:`gather_rows` of ``x`` (and ``scales``) through the
    permutation, fused: on "triton" a decode batch's permutation moves the rows in its own
    launch (``kernels.permute.permute_and_gather``). Arguments as for the two functions;
    ``overlap_previous`` promises what it promises for :func:`permute_by_expert` (x and
    scales are read after the wait in any case).

    Returns ``(permutation, out)``, or ``(permutation, out, out_scales)`` with ``scales``:
    what ``permute_by_expert`` and ``gather_rows(x, permutation, scales=scales)`` return, the
    same buffers and bytes on both backends."""
    options = dict(scales=scales, first_expert=first_expert,
                   num_local_experts=num_local_experts, align=align, check_ids=check_ids)
    if _resolve(backend, topk_ids, "topk_ids") == "triton":
        from kernels.permute import PermuteLaunch, permute_and_gather
        return permute_and_gather(topk_ids, x, num_experts, **options,
                                  launch=PermuteLaunch(overlap_previous=overlap_previous))
    return reference.permute_and_gather(topk_ids, x, num_experts, **options)


def unpermute_and_reduce(expert_out: torch.Tensor, permutation: Permutation,
                         topk_weights: torch.Tensor, *, check_values: bool = True,
                         backend: Optional[str] = None) -> torch.Tensor:
    """Weighted sum of each token's permuted rows, back in token order:
    ``out[t] = sum_j w[t, j] * expert_out[inverse[t*k + j]]`` over owned slots, j = 0..k-1,
    float32 accumulation, rounded once (nearest even, one canonical NaN); both backends give
    bit-identical results and the same errors (``kernels.reference.unpermute_and_reduce``).

    Arguments:
        expert_out: [P, H] bf16/fp16/fp32 (any strides), the expert compute's output in
            permuted order.
        permutation: the :class:`Permutation` the rows were gathered with.
        topk_weights: [T, k] fp32 (bf16/fp16 accepted), the routing weights.
        check_values: True: one host read of ``permutation.inverse``'s range, ValueError for
            an entry neither UNUSED nor in [0, P). False: no read; such a slot is skipped.
        backend: "triton", "torch" or "auto"; None takes the default.

    Returns:
        out: [T, H] in ``expert_out``'s dtype (zero rows for tokens with no owned slot).
    """
    if _resolve(backend, expert_out, "expert_out") == "triton":
        from kernels.gather import unpermute_and_reduce as run
    else:
        run = reference.unpermute_and_reduce
    return run(expert_out, permutation, topk_weights, check_values=check_values)
