"""Generic argument checks shared by every face of every op.

Each raises ValueError (TypeError for a wrong type or dtype) naming the argument, the value and
the way out, so that a bad call fails before anything is launched or sent.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

DTypes = Union[torch.dtype, Iterable[torch.dtype]]


def check_tensor(name: str, t, *, dtype: Optional[DTypes] = None, ndim: Optional[int] = None,
                 device: Optional[torch.device] = None, contiguous: bool = False) -> None:
    """Check that ``t`` is a tensor of the given dtype(s), rank, device and layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            names = " or ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{name} must be {names}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); "
                         f"shape {tuple(t.shape)} strides {t.stride()}")


def check_expert_ids(name: str, ids: torch.Tensor, num_ids: int, *,
                     allow_padding: bool = True) -> None:
    """Check that every id of the int32 tensor ``ids`` lies in ``[0, num_ids)`` (or equals
    ``num_ids``, the padding id, when ``allow_padding``). Reads the tensor (syncs on a GPU)."""
    check_tensor(name, ids, dtype=torch.int32)
    if ids.numel() == 0:
        return
    high = num_ids if allow_padding else num_ids - 1
    low_seen, high_seen = int(ids.min()), int(ids.max())
    if low_seen < 0 or high_seen > high:
        bad = low_seen if low_seen < 0 else high_seen
        allowed = (f"[0, {num_ids}] ({num_ids} = padding)" if allow_padding
                   else f"[0, {num_ids})")
        raise ValueError(f"{name} holds expert id {bad} outside {allowed}")


def check_top_k(top_k: int, num_experts: int, *, limit: Optional[int] = None,
                limit_reason: str = "") -> None:
    """Check ``1 <= top_k <= num_experts`` (and ``<= limit`` when given). ``top_k`` may be a
    traced size (``torch.SymInt``, k read from a shape while an op is traced with every size
    dynamic): the comparisons then guard on it."""
    if not isinstance(top_k, (int, torch.SymInt)) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be a positive int")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be <= the number of experts ({num_experts})")
    if limit is not None and top_k > limit:
        reason = f" ({limit_reason})" if limit_reason else ""
        raise ValueError(f"top_k={top_k} must be <= {limit}{reason}")


# Float outputs compared against the oracle (tests, the bench) use this table, stated once;
# index outputs and NVFP4/MX codes are compared exactly. Keyed by the dtype of the output.
FLOAT_TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}
