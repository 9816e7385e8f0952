"""What the launchers ask of the machine: whether Triton interprets, whether inline PTX can run,
how many SMs and how much L2 a device has, whether kernels can be launched with PDL. One place,
so that every launcher answers the same way.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_index(device: torch.device) -> int:
    """The index of the CUDA ``device`` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _compiled_properties(device: torch.device):
    """The properties of the GPU that kernels on ``device`` run compiled on (read once per
    device and cached); None for a CPU tensor or under the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    return _cuda_properties(_cuda_index(device))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; ``INTERPRETER_SMS`` for a CPU tensor or under
    the interpreter."""
    properties = _compiled_properties(device)
    return INTERPRETER_SMS if properties is None else properties.multi_processor_count


def l2_cache_bytes(device: torch.device) -> int:
    """Bytes of ``device``'s L2 cache; 0 for a CPU tensor or under the interpreter, which have
    no cache policy to choose."""
    properties = _compiled_properties(device)
    return 0 if properties is None else properties.L2_cache_size


# ---------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL)
# ---------------------------------------------------------------------------------------------
# A kernel launched with PDL may start while the kernel before it on the stream is still
# running: once every program of that kernel has signalled (``griddepcontrol.launch_dependents``)
# the next one is launched and its programs are placed on the SMs, and each of them waits
# (``griddepcontrol.wait``) until the earlier kernel has finished and its writes are visible.
# What it saves is the next kernel's launch and placement, which a chain of small launches
# (the decode step's) otherwise pays between every two kernels; a CUDA graph captured from the
# stream keeps the edges. Every kernel of kernels/ starts with
# :func:`grid_dependency_prologue`: it waits before its first load or store, so no access of
# any kernel moves before the end of the one before it and the results are the same bits with
# PDL or without.
#
# Since every kernel lets the next launch only after its own wait, a kernel that launches finds
# every kernel before it on the stream finished, except the one just before it. Two first
# launches may therefore read before they wait, where the reads cannot be of that one kernel's
# writes:
# - on the caller's promise, ``overlap_previous`` (``AmaxLaunch``, the global scale's amax
#   pass; ``PermuteLaunch``, the permutation's first launch): the kernel just before the op
#   wrote none of its inputs. The kernel reads its inputs and computes, then waits, then
#   stores: its stores still follow the end of that kernel (whose buffers the caching
#   allocator may hand to this one), and its end still follows it, so the kernels after it
#   find the same order as before. Its work overlaps that kernel's, which is what a chain
#   of small launches gains (the decode step: the amax pass beside the routing, the
#   permutation beside the local send plan).
# - within one op: ``scale_and_quantize_nvfp4``'s quantize issues its first loads of x before
#   waiting for the op's own amax pass (which only read x), then reads the global scale.
# A promise the stream does not keep gives wrong results, not an error: only the caller knows
# what its stream launched last. (A kernel of another library may let its dependents launch
# before its own wait; after such a kernel the promise must cover the kernel before that one
# as well, which may still be running.)
#
# Where the next kernel may launch is each kernel's own choice (``LAUNCH_NEXT``): at once, for
# every kernel but ``unpermute_and_reduce``, which lets it launch as its programs exit. The
# un-permute ends the receiving rank's step and streams P rows through hundreds of programs; a
# kernel launched beside them ran slower than one launched at its exit (on an H200, the next
# decode step's routing, behind the un-permute in one CUDA graph), and what follows it is the
# caller's (the combine, the next layer), which gains little from an earlier start.

# The first architecture with griddepcontrol (Hopper).
PDL_MIN_MAJOR = 9


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> Optional[tuple[int, int]]:
    """Compute capability ``(major, minor)`` of a CUDA ``device`` (read once per device and
    cached); None for any other device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_capability(_cuda_index(device))


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with PDL: compiled (not interpreted) for
    an SM90 or later GPU."""
    return can_run_ptx(device) and capability(device)[0] >= PDL_MIN_MAJOR


def grid_dependency(device: torch.device, traced: bool) -> dict:
    """The launch arguments of a kernel of kernels/ on ``device``: ``PDL`` (the kernel's
    constexpr, :func:`grid_dependency_prologue`) and, where it is on, Triton's ``launch_pdl``.
    On wherever the device supports it, except for a ``traced`` launch (through
    ``wrap_triton``: Inductor launches the kernel itself, with no launch attributes)."""
    if traced or not pdl_supported(device):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def grid_dependency_prologue(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """The first statement of every kernel: with ``PDL``, wait for the kernel before it on the
    stream to finish (its writes visible), then, with ``LAUNCH_NEXT``, let the next kernel
    launch. Without ``LAUNCH_NEXT`` the next kernel launches as this one's programs exit (a
    program that exits counts as having signalled): never beside its running programs, and
    still without waiting for the kernel to be complete, as a launch without PDL would.
    Without ``PDL``, nothing (the stream orders the launches)."""
    if PDL:
        gdc_wait()
        if LAUNCH_NEXT:
            gdc_launch_dependents()
