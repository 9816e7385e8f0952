"""Frozen configuration of the Triton transport and the Triton prepare.

A :class:`MoEAlltoall` takes one of each at construction; they are part of the configuration
its ranks agree on there (every field changes what a collective call does, or how long it
waits), so two objects can differ and a captured CUDA graph keeps its own object's choice. The
launchers of ``a2a.triton_transport`` and ``a2a.triton_prepare`` take them as ``config=``.
Every rank of a workspace must use the same configuration.

The defaults are fixed rules (no autotuning), with their reasons below; ``bench/`` measures
the variants (``overlap``, ``fused_nvfp4_dispatch``) side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kernels.quantize imports triton: loaded only when a config is made
    from kernels.quantize import NVFP4Launch

# Default bound, in seconds, on a MoEAlltoall's wait for the other ranks at each collective
# call (``a2a.agreement``): long enough for a rank that is still compiling kernels or building
# FlashInfer's modules in its first call, far below the process group's 30 minutes.
DEFAULT_TIMEOUT_S = 300.0

# Default bound on each device-side wait, in spins (one system-scope atomic each, well over
# 0.1 us): tens of seconds, long enough for a peer that is still compiling its first call.
DEFAULT_TIMEOUT_SPINS = 1 << 26

# Default bound on the Triton transport's grid R * C: C = min(MAX_CHUNKS = 64, 256 // R) chunks
# per peer (64 up to R = 4, 32 at R = 8), each program copying 16 KB tiles, because NVLink
# stores need many bytes in flight per peer. No transport program waits for a program of its
# own rank, so any grid is safe on one GPU per rank.
TRANSPORT_PROGRAMS = 256

# Default bound on the Triton prepare's exchange grid R * C: its receive programs spin while
# its send programs of the same launch run, so all of them must be resident at once; an H200
# has 132 SMs.
EXCHANGE_PROGRAMS = 128


def default_send_nvfp4_launch() -> "NVFP4Launch":
    """The quantizing send's tile: ``kernels.quantize.NVFP4Launch`` with steps of 8192 elements
    (512 NVFP4 blocks, up to 64 of them per row, the rest in rows) on 4 warps, i.e. 16 KB of
    bf16 per step, the tile size of the byte-row send kernel; the word-level PTX path where the
    device runs compiled."""
    from kernels.quantize import NVFP4Launch
    return NVFP4Launch(tile_elements=8192, max_blocks=64, num_warps=4)


@dataclass(frozen=True)
class TransportConfig:
    """How the Triton transport moves rows (``a2a.triton_transport``).

    overlap:              run ``triton_dispatch_rows`` / ``triton_combine_rows`` as one launch
                          of send and receive programs (received chunks are copied out while
                          this rank still sends) instead of a send kernel, then a receive
                          kernel. Default False: the two-kernel form is the measured baseline;
                          both are bit-identical.
    fused_nvfp4_dispatch: ``MoEAlltoall.dispatch(quant="nvfp4")`` with the Triton transport and
                          the Triton quantizer and H % 64 == 0 quantizes inside the send kernel
                          (``triton_dispatch_nvfp4``: one transfer) instead of quantizing
                          locally and moving codes and scales as two transfers. Default False:
                          bit-identical either way; the two-transfer form is the baseline.
    max_programs:         bound of each kernel's grid R * C (C = chunks per peer).
    timeout_spins:        bound of each wait (``a2a.protocol``, "Bounded waits").
    nvfp4_launch:         the tile of the quantizing send (``kernels.quantize.NVFP4Launch``;
                          it reads ``tile_elements``, ``max_blocks``, ``num_warps``,
                          ``word_asm`` and ``ptx``); ``tests/sm_compile.py`` passes
                          ``ptx=True`` to build the GPU variant from CPU tensors.
    """

    overlap: bool = False
    fused_nvfp4_dispatch: bool = False
    max_programs: int = TRANSPORT_PROGRAMS
    timeout_spins: int = DEFAULT_TIMEOUT_SPINS
    nvfp4_launch: "NVFP4Launch" = field(default_factory=default_send_nvfp4_launch)

    def __post_init__(self):
        check_bounds("TransportConfig", self.max_programs, self.timeout_spins)


@dataclass(frozen=True)
class PrepareConfig:
    """How the Triton prepare exchanges plans (``a2a.triton_prepare``).

    max_programs:  bound of the exchange grid R * C; every program must be resident at once.
    timeout_spins: bound of each wait (``a2a.protocol``, "Bounded waits").
    """

    max_programs: int = EXCHANGE_PROGRAMS
    timeout_spins: int = DEFAULT_TIMEOUT_SPINS

    def __post_init__(self):
        check_bounds("PrepareConfig", self.max_programs, self.timeout_spins)


def check_bounds(what: str, max_programs, timeout_spins) -> None:
    """Raise ValueError unless max_programs >= 1 and timeout_spins >= 0 are ints."""
    if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
        raise ValueError(f"{what}: max_programs={max_programs!r} must be an int >= 1")
    if isinstance(timeout_spins, bool) or not isinstance(timeout_spins, int) \
            or timeout_spins < 0:
        raise ValueError(f"{what}: timeout_spins={timeout_spins!r} must be an int >= 0")
