"""Checks that read tensor values: the part of a contract that needs the device's data.

A shape, dtype or device check costs nothing; a value check (an index inside its range, a scale
that is finite) reads the tensor, which on a GPU is a host synchronisation. An op with such
checks takes the keyword ``check_values`` (``permute_by_expert`` and ``local_send_plan`` call
theirs ``check_ids``):

- ``True`` (the default): every face reads what it checks in ONE device-to-host copy
  (:func:`read_to_host`), before anything is launched or written, and raises the same
  ValueError, naming the bad value and the way out.
- ``False``: nothing is read (CUDA-graph capture, ``torch.compile``d code, a benchmark's hot
  loop). Each op's docstring says what a bad value then gives; it is the same on every face.

Every face calls the same function here, so that all of them read, accept and refuse alike.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kernels.types import UNUSED


def read_to_host(parts: Sequence[torch.Tensor]) -> list[float]:
    """The values of the small tensors ``parts`` (each flattened, in order) as Python floats,
    moved to the host in one copy (one sync on a GPU). int32 and float32 values are exact in
    float64 (NaN and inf included)."""
    if not parts:
        return []
    if parts[0].is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("check_values=True reads values on the host, which a CUDA graph "
                           "being captured cannot do; pass check_values=False inside the "
                           "capture (and check the inputs before it)")
    return torch.cat([part.reshape(-1).to(torch.float64) for part in parts]).tolist()


def index_extremes(index: torch.Tensor) -> list[torch.Tensor]:
    """``[tensor([min, max])]`` of an integer index tensor, computed on its device, for
    :func:`read_to_host`; ``[]`` when it is empty (nothing to read)."""
    if index.numel() == 0:
        return []
    low, high = torch.aminmax(index)
    return [torch.stack((low, high))]


def check_index_range(name: str, extremes: Sequence[float], limit: int, bound: str,
                      hint: str = "") -> None:
    """Raise ValueError when the index tensor ``name`` whose (min, max) are ``extremes`` holds
    a value that is neither UNUSED (-1) nor in ``[0, limit)`` (naming the smallest bad one
    below, else the largest). ``bound`` names the limit (e.g. "T*top_k"), ``hint`` is the
    likely cause of an entry past it and its fix. Empty ``extremes``: nothing to check."""
    if not extremes:
        return
    low, high = int(extremes[0]), int(extremes[1])
    if low >= UNUSED and high < limit:
        return
    bad = low if low < UNUSED else high
    hint = hint if bad >= limit else ""
    raise ValueError(f"{name} holds {bad}, outside [0, {bound}) = [0, {limit}) and not UNUSED "
                     f"({UNUSED}){hint}; check_values=False skips this check (no host read), "
                     f"and such an entry then counts as UNUSED")
