"""Result types shared by the reference oracle, the Triton kernels and the FlashInfer adapters.

Plain frozen dataclasses of tensors: no torch.distributed, no FlashInfer. Index buffers are int32
on the device of the input; entries past the valid prefix hold ``UNUSED`` (-1) so that two
implementations can be compared buffer for buffer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

# Marks an unused entry of an index buffer (past the valid prefix, or an alignment padding row).
UNUSED = -1


def _tensor_fields(obj) -> dict[str, torch.Tensor]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), torch.Tensor)}


class _TensorRecord:
    """Mixin: field-by-field access to the tensors of a frozen dataclass."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (for comparisons and device moves)."""
        return _tensor_fields(self)


@dataclass(frozen=True)
class Permutation(_TensorRecord):
    """Expert-major order of the locally owned (token, slot) pairs of ``topk_ids [T, k]``.

    A pair ``(t, j)`` is owned when ``first_expert <= topk_ids[t, j] < first_expert + E_local``.
    Inside one expert's segment the pairs keep their flat order ``t*k + j`` (a stable sort).
    ``P = T*k + E_local*(align - 1)`` is the static capacity (no host sync needed to size it).

    source_rows:    [P] int32, the flat pair index ``t*k + j`` each permuted row comes from;
                    UNUSED for alignment padding rows and for rows past ``expert_offsets[-1]``.
    expert_counts:  [E_local] int32, owned pairs per local expert (before alignment).
    expert_offsets: [E_local + 1] int32, start of each expert's segment in permuted order; each
                    segment is padded up to a multiple of ``align``; ``expert_offsets[-1]`` is the
                    number of permuted rows in use.
    inverse:        [T*k] int32, permuted position of pair ``t*k + j``; UNUSED when not owned.
    top_k:          k, the number of slots per token.
    align:          the segment alignment used.
    """

    source_rows: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    inverse: torch.Tensor
    top_k: int
    align: int = 1


@dataclass(frozen=True)
class LocalSendPlan(_TensorRecord):
    """What one rank sends where, from its own ``topk_ids [T, k]`` alone (no communication).

    Placement is linear over slots: ``rank(id) = id // (S // R)``; ids equal to S are padding
    and skipped. A token goes once to each distinct destination rank. N = max_tokens_per_rank.

    send_counts:                      [R] int32, tokens sent to each rank.
    send_rank_count_cumsum:           [R] int32, inclusive cumsum of ``send_counts``.
    send_rank_local_indices:          [N*R] int32, for rank r positions ``[cum[r-1], cum[r])``
                                      hold the token ids sent to r in ascending order; UNUSED
                                      past ``cum[R-1]``.
    backward_recv_rank_local_indices: [N*R] int32, parallel to the send list:
                                      ``token*k + j`` for the first slot j whose id lives on r;
                                      UNUSED past ``cum[R-1]``.
    expert_counts:                    [S] int32, (token, slot) pairs routed to each slot id.
    """

    send_counts: torch.Tensor
    send_rank_count_cumsum: torch.Tensor
    send_rank_local_indices: torch.Tensor
    backward_recv_rank_local_indices: torch.Tensor
    expert_counts: torch.Tensor


@dataclass(frozen=True)
class AlltoallPlan(_TensorRecord):
    """One rank's full prepare result: docs/design.md's contract, the drop-in for FlashInfer's
    ``MoEAlltoallInfo`` plus the received expert ids and weights.

    N = max_tokens_per_rank (same on every rank), R = ep_size, S = slot_count, k = top_k.

    send_rank_count_cumsum:           [R] int32, inclusive cumsum of tokens sent to each rank.
    send_rank_local_indices:          [N*R] int32, local token ids sent to rank r at positions
                                      ``[cum[r-1], cum[r])``, ascending; UNUSED past the total.
    backward_recv_rank_local_indices: [N*R] int32, parallel to the send list: ``token*k + j`` of
                                      the first slot j whose expert lives on r (where combine
                                      scatters the returned row); UNUSED past the total.
    recv_rank_count_cumsum:           [R] int32, inclusive cumsum of rows received from each
                                      source rank.
    recv_rank_local_indices:          [N*R] int32, identity over ``[0, total_recv)``; UNUSED
                                      after.
    recv_expert_ids:                  [N*R, k] int32, the sender's k ids, every id not owned by
                                      this rank replaced by S; rows past total_recv are all S.
    recv_weights:                     [N*R, k] float32, the sender's k weights, unmasked; rows
                                      past total_recv are 0.
    expert_counts:                    [R, S] int32 or None, every rank's per-slot pair counts.
    ep_rank, ep_size, max_tokens_per_rank, num_tokens (this rank's T), top_k, slot_count.
    """

    send_rank_count_cumsum: torch.Tensor
    send_rank_local_indices: torch.Tensor
    backward_recv_rank_local_indices: torch.Tensor
    recv_rank_count_cumsum: torch.Tensor
    recv_rank_local_indices: torch.Tensor
    recv_expert_ids: torch.Tensor
    recv_weights: torch.Tensor
    expert_counts: Optional[torch.Tensor]
    ep_rank: int
    ep_size: int
    max_tokens_per_rank: int
    num_tokens: int
    top_k: int
    slot_count: int

    @property
    def total_send(self) -> torch.Tensor:
        """Rows this rank sends (a 0-d device tensor: reading it syncs)."""
        return self.send_rank_count_cumsum[-1]

    @property
    def total_recv(self) -> torch.Tensor:
        """Rows this rank receives (a 0-d device tensor: reading it syncs)."""
        return self.recv_rank_count_cumsum[-1]
