"""The device protocol of the Triton prepare (``a2a.triton_prepare``) and the Triton transport
(``a2a.triton_transport``): how ranks hand data to each other through a peer-mapped workspace
with no host involvement, and how a missing peer becomes an error instead of a hang.

Both move data the same way. ``workspace [R, words]`` (int64/uint64) holds one inbox per rank
(row q = rank q's inbox, every row addressable from every rank: an MNNVL mapping, or for R
simulated ranks on one GPU a plain zeroed tensor). Each inbox starts with

    flags    [R, MAX_CHUNKS] int64   flag[s, chunk]: the last call whose chunk ``chunk``
                                     source s has delivered here, as c + 1 (0 = never)
    arrivals int64                   this rank's programs that have read the current call
                                     number (local use only; 0 between calls)

followed by data areas whose layout each user describes. A source splits what it sends to
one destination into C <= MAX_CHUNKS chunks; one program sends a chunk and publishes its flag,
one program (or a vector wait) receives it.

Flags carry the call number
---------------------------
Call c of a workspace publishes the value c + 1 (:func:`publish_flag`): a CTA barrier, so that
every thread's data stores come first, then one ``atomic_xchg(sem="release", scope="sys")``.
A receiver spins with ``atomic_add(flag, 0, sem="acquire", scope="sys")`` until the flag is
``>= c + 1`` (:func:`wait_for_flag`, :func:`wait_for_flags`), then a CTA barrier (the
acquiring thread's view before any thread reads), then reads the data through L2 (``.cg``).
``>=`` and not ``==``: a fast source may already have finished call c + 1 and published c + 2
before we look (each user's docstring says why that is the furthest it can get); a larger
value still proves the call-c data was stored before it (release covers all earlier stores).

Two parities
------------
The data areas are double-buffered: call c uses parity ``c % 2``. A source writes the area of
parity p again only in call c + 2, which it starts only after a step that needs our call
c + 1, which in turn runs after our call-c reads on the same stream; so call c + 2's stores
cannot overtake our call-c reads. Every rank makes the same sequence of calls on a workspace.

The call counter lives on the device
------------------------------------
``call_counter`` ([1] int64, zeroed with the workspace) holds c. Every program of the kernel
that ends a call reads it and counts itself in ``arrivals``; the last to arrive (every program
has then read c) sets the counter to c + 1 and ``arrivals`` back to 0 (:func:`advance_call`).
No call number comes from the host and no extra launch increments it, so a CUDA graph that
captures a call stays right at every replay (each replay is a new call).

Bounded waits and the status buffer
-----------------------------------
Every wait spins at most ``timeout_spins`` times (one system-scope atomic each, well over
0.1 us, so the default ``a2a.config.DEFAULT_TIMEOUT_SPINS`` is tens of seconds). On timeout
the program treats the missing data as empty (it never reads it: no out-of-range writes) and
records ``status[s] = max(status[s], c + 1)`` for each missing source s
(:func:`record_timeouts`). The status buffer ([R] int64, :func:`new_status`) is read only on
request, with one host sync (:func:`raise_on_timeout`); after a timeout the workspace is stale:
zero it and its call counter on every rank (or make new ones).

Co-residency, compilation and host syncs
----------------------------------------
Spinning programs must not keep the programs they wait for off the GPU. With one GPU per rank
this constrains only kernels that wait for their own rank's programs (each user says which).
With R simulated ranks on one GPU, all ranks' spinning programs must fit at once (tests use a
small ``max_programs``), and loading a compiled module waits until the device is idle, which
never happens while another rank spins: such ranks compile every variant first (each user's
warm-up function). Without a status read, a call has no host sync and is CUDA-graph
capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.spec.tensors import check_tensor

# Chunks per (source, destination) pair: a fixed upper bound, so that the flags' layout
# ([R, MAX_CHUNKS] per inbox) does not depend on the launch.
MAX_CHUNKS = 64


# ---------------------------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------------------------

@triton.jit
def flag_address(ws64, ws_row_stride, inbox, source, chunk, MAX_CHUNKS: tl.constexpr):
    """int64 pointer to flag[source, chunk] of rank ``inbox``'s inbox (``ws64``: the workspace
    as int64, ``ws_row_stride`` in 64-bit words)."""
    return ws64 + inbox.to(tl.int64) * ws_row_stride + source * MAX_CHUNKS + chunk


@triton.jit
def arrivals_address(ws64, ws_row_stride, ep_rank, ep_size, MAX_CHUNKS: tl.constexpr):
    """int64 pointer to the arrivals word of this rank's inbox (right after its flags)."""
    return ws64 + ep_rank.to(tl.int64) * ws_row_stride + ep_size * MAX_CHUNKS


@triton.jit
def publish_flag(flag_ptr, call):
    """Set the flag at ``flag_ptr`` to call + 1 after every thread's stores: a CTA barrier,
    then one release store at system scope."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, (call + 1).to(tl.int64), sem="release", scope="sys")


@triton.jit
def wait_for_flag(flag_ptr, expected, timeout_spins):
    """Spin until the flag at ``flag_ptr`` is >= expected (acquire, system scope) or the spin
    bound is reached. Returns whether it arrived."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < expected) & (spins < timeout_spins):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    return seen >= expected


@triton.jit
def wait_for_flags(flag_ptrs, mask, expected, timeout_spins):
    """Spin until every masked flag is >= expected (acquire, system scope) or the spin bound is
    reached. Returns [n] int1: flag arrived (True for masked-off lanes)."""
    arrived = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope="sys")
    ok = (arrived >= expected) | (mask == 0)
    done = tl.min(ok.to(tl.int32), axis=0)
    spins = 0
    while (done == 0) & (spins < timeout_spins):
        arrived = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope="sys")
        ok = (arrived >= expected) | (mask == 0)
        done = tl.min(ok.to(tl.int32), axis=0)
        spins += 1
    return ok


@triton.jit
def record_timeouts(status_ptr, sources, call, missing):
    """``status[s] = max(status[s], call + 1)`` for every source s where ``missing``."""
    tl.atomic_max(status_ptr + sources, (call + 1).to(tl.int64), mask=missing)


@triton.jit
def advance_call(counter_ptr, arrivals, call):
    """Called by every program of the kernel that ends a call, once it has read ``call`` from
    ``counter_ptr``: the last to arrive (every program has then read it) sets the counter to
    call + 1 and rearms the arrival count ``arrivals`` (an int64 that is 0 between calls)."""
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr, call + 1, sem="relaxed", scope="gpu")


# ---------------------------------------------------------------------------------------------
# Host side: argument checks, the status buffer, timeouts
# ---------------------------------------------------------------------------------------------

def check_workspace(workspace: torch.Tensor, ep_size: int, words: int, device: torch.device,
                    sized_by: str) -> None:
    """Raise unless ``workspace`` is [ep_size, >= words] int64/uint64 on ``device`` with unit
    column stride; ``sized_by`` names the function that gives the size."""
    check_tensor("workspace", workspace, dtype=(torch.int64, torch.uint64), ndim=2,
                 device=device)
    if workspace.shape[0] != ep_size or workspace.shape[1] < words or workspace.stride(1) != 1:
        raise ValueError(f"workspace must be [ep_size={ep_size}, >= {words}] with unit column "
                         f"stride ({sized_by}); got shape {tuple(workspace.shape)} strides "
                         f"{workspace.stride()}")


def check_call_counter(call_counter: torch.Tensor, device: torch.device) -> None:
    """Raise unless ``call_counter`` is a [1] int64 tensor on ``device``."""
    check_tensor("call_counter", call_counter, dtype=torch.int64, ndim=1, device=device)
    if call_counter.numel() != 1:
        raise ValueError(f"call_counter must have 1 entry, got {call_counter.numel()}")


def check_status(status: Optional[torch.Tensor], ep_size: int, device: torch.device) -> None:
    """Raise unless ``status`` is None or an [ep_size] int64 tensor on ``device``."""
    if status is None:
        return
    check_tensor("status", status, dtype=torch.int64, ndim=1, device=device)
    if status.numel() != ep_size:
        raise ValueError(f"status must have ep_size={ep_size} entries, got {status.numel()}")


def new_status(ep_size: int, device: torch.device) -> torch.Tensor:
    """A zeroed status buffer: [R] int64, entry s becomes c + 1 when a wait for source s timed
    out in call c."""
    return torch.zeros(ep_size, dtype=torch.int64, device=device)


def timed_out_sources(status: torch.Tensor) -> tuple[list[int], list[int]]:
    """(source ranks whose wait timed out, the calls it happened in) from a status buffer
    (reading it is a host sync)."""
    values = status.tolist()
    missing = [source for source, value in enumerate(values) if value]
    return missing, sorted({values[s] - 1 for s in missing})


class CollectiveTimeout(RuntimeError):
    """Some peers did not arrive within the bound of a wait (device spins or host seconds)."""


class PrepareTimeout(CollectiveTimeout):
    """Some source ranks did not deliver their Triton-prepare data within the spin bound."""


class TransportTimeout(CollectiveTimeout):
    """Some source ranks did not deliver their Triton-transport rows within the spin bound."""


# What a status buffer belongs to -> (its exception, what the sources did not deliver).
TIMEOUT_KINDS = {"prepare": (PrepareTimeout, "prepare data"),
                 "transport": (TransportTimeout, "rows")}


def raise_on_timeout(status: torch.Tensor, ep_rank: int, what: str) -> None:
    """Raise :class:`PrepareTimeout` (``what="prepare"``) or :class:`TransportTimeout`
    (``what="transport"``) naming the source ranks whose data did not arrive, when the status
    buffer records any (one host sync)."""
    error, data = TIMEOUT_KINDS[what]
    missing, calls = timed_out_sources(status)
    if missing:
        raise error(
            f"rank {ep_rank}: source rank(s) {missing} did not deliver their {data} within "
            f"timeout_spins (call(s) {calls} of the Triton {what}; did every rank make the same "
            f"sequence of {what} calls on this workspace?). The workspace is now stale: zero it "
            f"and its call counter on every rank, or make new ones.")
