"""Shared fixtures and markers.

Without a CUDA GPU every Triton kernel runs through Triton's interpreter on CPU tensors; the
variable must be set before triton is imported, which conftest does first. Markers ``gpu``,
``multigpu`` and ``sm100`` skip, with the reason, where the hardware is missing.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from a2a.backends import cuda_device_count, sm_major  # noqa: E402


def _skip_reason(item) -> str | None:
    gpus = cuda_device_count()
    if item.get_closest_marker("gpu") and gpus == 0:
        return "needs a CUDA GPU (none visible here)"
    if item.get_closest_marker("multigpu") and gpus < 2:
        return f"needs 2+ CUDA GPUs, {gpus} visible"
    if item.get_closest_marker("sm100"):
        major = sm_major(torch.device("cuda")) if gpus else None
        if major is None or major < 10:
            here = f"SM{major}0" if major is not None else "no CUDA GPU"
            return f"Blackwell-only comparison (SM100+); this machine has {here}"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = _skip_reason(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> torch.device:
    """The device kernels are tested on: the current CUDA GPU, else the CPU under the Triton
    interpreter."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    assert os.environ.get("TRITON_INTERPRET") == "1", "CPU tests need TRITON_INTERPRET=1"
    return torch.device("cpu")


@pytest.fixture
def seed() -> int:
    """Seeds torch's generators so that every test draws the same inputs run to run."""
    torch.manual_seed(0)
    return 0
