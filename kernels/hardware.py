"""What the launchers ask of the machine: whether Triton interprets, whether inline PTX can run,
how many SMs a device has. One place, so that every launcher answers the same way.
"""

from __future__ import annotations

import functools
import os

import torch

# Stands in for the SM count where there is none to read (the interpreter, a CPU tensor).
INTERPRETER_SMS = 4


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def can_run_ptx(device: torch.device) -> bool:
    """Whether kernels on ``device`` run compiled for a GPU (inline PTX works), not
    interpreted."""
    return torch.device(device).type == "cuda" and not interpreting()


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (read once per device and cached);
    ``INTERPRETER_SMS`` for a CPU tensor or under the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sms(index)
