"""Everything that spans ranks or backends: the stage switch, the FlashInfer adapters, MNNVL
workspaces, transports, the cross-rank prepare and the dispatcher.

FlashInfer is imported lazily, only inside its adapters: ``import a2a`` never imports it.
``print(a2a.describe())`` says what each stage's ``"auto"`` resolves to here, and why the other
backends cannot run; ``repr(MoEAlltoall(...))`` names the backends an object resolved; the
``a2a`` logger writes each resolution at DEBUG level.
"""

import kernels as _kernels

if getattr(_kernels, "PROJECT", None) != "triton-moe-a2a":
    raise ImportError(
        f"the package 'kernels' found at {getattr(_kernels, '__file__', None) or _kernels} is not "
        f"triton-moe-a2a's: another distribution with the same import name (e.g. the Hugging "
        f"Face 'kernels' hub loader, which transformers uses) is installed in this environment "
        f"and shadows or overwrote ours. Install triton-moe-a2a in an environment without it "
        f"(pip uninstall kernels, then reinstall triton-moe-a2a)")

from a2a.backends import (BACKENDS, STAGES, BackendUnavailable, available_backends,
                          default_backends, describe, resolve, why_unavailable)
from a2a.alltoall import MoEAlltoall
from a2a.config import PrepareConfig, TransportConfig
from kernels.types import AlltoallPlan

__all__ = ["AlltoallPlan", "MoEAlltoall", "BACKENDS", "STAGES", "BackendUnavailable",
           "PrepareConfig", "TransportConfig", "available_backends", "default_backends",
           "describe", "resolve", "why_unavailable"]
