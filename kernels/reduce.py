"""The combine's reduction over k, one fixed order (plain torch): used by the torch and
FlashInfer transports and by the oracle; the Triton transport's fused reduction repeats it."""

from __future__ import annotations

import torch


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
