"""The stage switch: the one place where a backend is chosen for each stage.

Stages and backends
-------------------
Every stage of the MoE all-to-all pipeline (``STAGES``) can run on one of three backends:

``"triton"``      our Triton kernels (``kernels/``); a CUDA device, or CPU tensors under
                  ``TRITON_INTERPRET=1`` (Triton's interpreter, slow, for tests);
``"flashinfer"``  FlashInfer's fused CUDA path, imported lazily by the adapters in ``a2a/``;
``"torch"``       the plain-torch reference (``kernels/reference.py``) or, for the transport,
                  ``torch.distributed.all_to_all_single``; runs anywhere.

``"auto"`` picks the first backend of ``AUTO_ORDER[stage]`` that can run here; it is the only
choice that may fall back. An explicit choice that cannot run raises :class:`BackendUnavailable`
naming the reason and the choices that can.

Defaults come from the environment variable ``MOE_A2A_BACKENDS``, read once per process, e.g.
``MOE_A2A_BACKENDS="prepare=flashinfer,quantize=triton"``; stages it does not name default to
``"auto"``. A ``backend=`` keyword on a call overrides it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Callable, Optional

import torch

from kernels.hardware import capability, interpreting

STAGES = ("routing", "permute", "prepare", "quantize", "transport")
BACKENDS = ("triton", "flashinfer", "torch")
ENV_VAR = "MOE_A2A_BACKENDS"
logger = logging.getLogger("a2a")

# What "auto" tries, in order. FlashInfer comes after Triton: it is the comparison path, and its
# fp4 quantizer silently writes nothing below SM100 (see ``_quantize_flashinfer``).
AUTO_ORDER = {
    "routing": ("triton", "torch"),
    "permute": ("triton", "torch"),
    "prepare": ("triton", "torch"),
    "quantize": ("triton", "torch"),
    "transport": ("flashinfer", "torch"),
}

# Compute capability major of Blackwell, the first architecture FlashInfer's fp4/mx quantize
# kernels are compiled for.
BLACKWELL_SM_MAJOR = 10


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here. The message says why and what can."""


# ---------------------------------------------------------------------------------------------
# Capability predicates (cheap, no FlashInfer import)
# ---------------------------------------------------------------------------------------------

def triton_interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return interpreting()


def flashinfer_installed() -> bool:
    """True when the ``flashinfer`` package can be found. Does not import it."""
    return importlib.util.find_spec("flashinfer") is not None


def sm_major(device: torch.device) -> Optional[int]:
    """Compute capability major of a CUDA ``device``; None for any other device."""
    cap = capability(device)
    return cap[0] if cap is not None else None


def cuda_device_count() -> int:
    """Number of visible CUDA GPUs (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---------------------------------------------------------------------------------------------
# Why a (stage, backend) cannot run: None when it can
# ---------------------------------------------------------------------------------------------

def _triton(device: torch.device, **_) -> Optional[str]:
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreting():
        return None
    return (f"Triton kernels need a CUDA tensor, or CPU tensors with TRITON_INTERPRET=1 set "
            f"before triton is imported; got a tensor on {device}")


def _triton_peer_stores(subject: str) -> Callable[..., Optional[str]]:
    """The rule of a Triton kernel that stores into peer-mapped memory and spins on flags the
    other ranks set: it needs a CUDA device, also under the interpreter."""
    def reason(device: torch.device, **_) -> Optional[str]:
        if device.type == "cuda":
            return None
        return (f"{subject} into peer-mapped (MNNVL) memory and spins on flags the other ranks "
                f"set concurrently: it needs a CUDA device, even under TRITON_INTERPRET=1; got "
                f"a tensor on {device}")
    return reason


def _torch(device: torch.device, **_) -> Optional[str]:
    return None


def _flashinfer_common(device: torch.device) -> Optional[str]:
    if not flashinfer_installed():
        return "FlashInfer is not installed (pip install flashinfer-python)"
    if device.type != "cuda":
        return f"FlashInfer's kernels need a CUDA tensor; got a tensor on {device}"
    return None


def _quantize_flashinfer(device: torch.device, op: Optional[str] = None,
                         capability: Optional[tuple[int, int]] = None, **_) -> Optional[str]:
    # ``op`` narrows the rule to one quantize-stage op. block_scale_interleave (the scale
    # swizzle) is a plain CUDA kernel that runs on SM90 too; FlashInfer has no global-scale op.
    if op == "swizzle":
        return _flashinfer_common(device)
    if op == "global_scale":
        return "FlashInfer has no standalone NVFP4 global-scale op (it takes the scale as input)"
    if op == "dequantize":
        return "FlashInfer has no standalone dequantizer (its GEMMs read the codes directly)"
    if op == "unswizzle":
        return "FlashInfer has no scale unswizzle (only block_scale_interleave, the swizzle)"
    major = capability[0] if capability is not None else sm_major(device)
    if major is not None and major >= BLACKWELL_SM_MAJOR:
        return _flashinfer_common(device)
    here = f"SM{major}0" if major is not None else f"no CUDA device ({device})"
    return ("FlashInfer's fp4/mx quantize kernels are compiled only for SM100+ (their body is "
            "guarded by __CUDA_ARCH__ >= 1000); below that, fp4_quantize launches, writes "
            "nothing and returns uninitialised memory without an error. This machine has "
            f"{here}")


def _routing_flashinfer(device: torch.device, method: Optional[str] = None,
                        capability: Optional[tuple[int, int]] = None, **_) -> Optional[str]:
    common = _flashinfer_common(device)
    if common:
        return common
    if method != "deepseek_v3":
        # FlashInfer's general routing (trtllm_gen_routing) is Blackwell-only and not wrapped.
        return (f"only method='deepseek_v3' is wrapped for FlashInfer (fused_topk_deepseek); "
                f"asked for method={method!r}")
    cap = capability if capability is not None else globals()["capability"](device)
    if cap >= (8, 9):
        return None
    return (f"FlashInfer's fused_topk_deepseek runs on SM89 and newer; this device is "
            f"SM{cap[0]}{cap[1]}")


def _permute_flashinfer(device: torch.device, **_) -> Optional[str]:
    return "FlashInfer has no standalone expert permutation (it is fused into its MoE GEMMs)"


def _distributed_flashinfer(device: torch.device, **_) -> Optional[str]:
    return _flashinfer_common(device)


_REASONS: dict[tuple[str, str], Callable[..., Optional[str]]] = {}
for _stage in STAGES:
    _REASONS[(_stage, "triton")] = _triton
    _REASONS[(_stage, "torch")] = _torch
_REASONS[("prepare", "triton")] = _triton_peer_stores("the cross-rank Triton prepare stores")
_REASONS[("transport", "triton")] = _triton_peer_stores("the Triton transport stores rows")
_REASONS[("routing", "flashinfer")] = _routing_flashinfer
_REASONS[("permute", "flashinfer")] = _permute_flashinfer
_REASONS[("prepare", "flashinfer")] = _distributed_flashinfer
_REASONS[("quantize", "flashinfer")] = _quantize_flashinfer
_REASONS[("transport", "flashinfer")] = _distributed_flashinfer


def why_unavailable(stage: str, backend: str, device, **context) -> Optional[str]:
    """Why ``backend`` cannot run ``stage`` on ``device``; None when it can.

    ``context`` carries what a stage's rule needs, e.g. ``method="deepseek_v3"`` for routing,
    ``op="swizzle"`` for one quantize-stage op, or ``capability=(9, 0)`` to ask about a GPU of
    that compute capability instead of ``device``'s own.
    """
    _check_stage(stage)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS + ('auto',)}")
    return _REASONS[(stage, backend)](device=torch.device(device), **context)


def available_backends(stage: str, device, **context) -> tuple[str, ...]:
    """The backends that can run ``stage`` on ``device`` here, in ``BACKENDS`` order."""
    return tuple(b for b in BACKENDS if why_unavailable(stage, b, device, **context) is None)


# ---------------------------------------------------------------------------------------------
# Defaults and resolution
# ---------------------------------------------------------------------------------------------

def parse_backends(spec: str) -> dict[str, str]:
    """Parse ``"prepare=flashinfer,quantize=triton"`` into ``{stage: backend}``.

    Raises ValueError naming the bad part: unknown stage, unknown backend, or no ``=``.
    """
    choices: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, sep, backend = (s.strip() for s in part.partition("="))
        if not sep:
            raise ValueError(f"{ENV_VAR}: {part!r} is not 'stage=backend'")
        if stage not in STAGES:
            raise ValueError(f"{ENV_VAR}: stage={stage!r} is not one of {STAGES}")
        if backend not in BACKENDS + ("auto",):
            raise ValueError(f"{ENV_VAR}: backend {backend!r} for stage {stage!r} is not one of "
                             f"{BACKENDS + ('auto',)}")
        choices[stage] = backend
    return choices


@functools.lru_cache(maxsize=1)
def default_backends() -> dict[str, str]:
    """Each stage's default backend, from ``MOE_A2A_BACKENDS`` (read once per process)."""
    defaults = {stage: "auto" for stage in STAGES}
    defaults.update(parse_backends(os.environ.get(ENV_VAR, "")))
    return defaults


def resolve(stage: str, backend: Optional[str], device, **context) -> str:
    """The backend that will run ``stage`` for a tensor on ``device``.

    ``backend=None`` takes the default (``MOE_A2A_BACKENDS`` or ``"auto"``). ``"auto"`` returns
    the first backend of ``AUTO_ORDER[stage]`` that can run; an explicit backend that cannot
    run raises :class:`BackendUnavailable` with the reason and the backends that can.
    """
    _check_stage(stage)
    device = torch.device(device)
    requested = backend if backend is not None else default_backends()[stage]
    if requested == "auto":
        chosen = next((candidate for candidate in AUTO_ORDER[stage]
                       if why_unavailable(stage, candidate, device, **context) is None), "torch")
        _log_choice(stage, requested, chosen, device)
        return chosen
    reason = why_unavailable(stage, requested, device, **context)
    if reason is None:
        _log_choice(stage, requested, requested, device)
        return requested
    can = available_backends(stage, device, **context)
    raise BackendUnavailable(
        f"{stage} backend {requested!r} cannot run here: {reason}. "
        f"Backends that can: {', '.join(can) if can else 'none'} (or 'auto').")


def _log_choice(stage: str, requested: str, chosen: str, device: torch.device) -> None:
    # Not while torch.compile traces the caller: a logging call there is a graph break.
    if not torch.compiler.is_compiling():
        logger.debug("%s: %r -> %s (on %s)", stage, requested, chosen, device)


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not one of {STAGES}")


def describe(device=None, **context) -> str:
    """What each stage runs on ``device`` (default: the current CUDA GPU, else the CPU) with
    the defaults in force: one line per stage, ``stage: requested -> chosen``, and for each
    backend that cannot run there, why. E.g. ``print(a2a.describe())``."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    defaults = default_backends()
    lines = [f"device {device}" + (" (Triton interpreter)" if interpreting() else "")
             + f"; defaults from {ENV_VAR}={os.environ.get(ENV_VAR, '')!r}"]
    for stage in STAGES:
        requested = defaults[stage]
        try:
            chosen = resolve(stage, requested, device, **context)
        except BackendUnavailable as error:
            chosen = f"refused ({error})"
        lines.append(f"{stage}: {requested!r} -> {chosen}")
        for backend in BACKENDS:
            why = why_unavailable(stage, backend, device, **context)
            if why is not None:
                lines.append(f"    {backend}: not here: {why}")
    return "\n".join(lines)
