"""Everything that spans ranks or backends: the stage switch, the FlashInfer adapters, MNNVL
workspaces, transports, the cross-rank prepare and the dispatcher.

FlashInfer is imported lazily, only inside its adapters: ``import a2a`` never imports it.
"""

from a2a.backends import (BACKENDS, STAGES, BackendUnavailable, available_backends,
                          default_backends, resolve, why_unavailable)
from a2a.alltoall import MoEAlltoall
from a2a.config import PrepareConfig, TransportConfig
from kernels.types import AlltoallPlan

__all__ = ["AlltoallPlan", "MoEAlltoall", "BACKENDS", "STAGES", "BackendUnavailable",
           "PrepareConfig", "TransportConfig", "available_backends", "default_backends",
           "resolve", "why_unavailable"]
