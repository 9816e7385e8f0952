"""Timing and the machine's limits.

Three clocks, one result type (:class:`Timing`, microseconds):

- :func:`time_gpu`: ``triton.testing.do_bench`` (L2 flushed between calls), or
  ``triton.testing.do_bench_cudagraph`` (CUDA-graph replay, for launch-bound stages); both give
  the median and the 20th / 80th percentiles.
- :func:`time_fixed`: a fixed number of event-timed calls, for collectives: every rank must call
  the op the same number of times (``do_bench`` picks its count from a first estimate, which
  differs per rank and would deadlock). ``before`` / ``after`` run untimed around each call
  (e.g. the combine that must follow a one-sided dispatch).
- :func:`time_cpu`: ``time.perf_counter`` over a couple of calls, for the interpreter run, where
  the numbers mean nothing and are labelled so.

:func:`measure_limits` measures the HBM copy bandwidth and, with two GPUs, the NVLink peer-store
bandwidth; every row reports its fraction of these.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Quantiles reported next to the median.
LOW_Q, HIGH_Q = 0.2, 0.8
# do_bench budgets in milliseconds: half of Triton's defaults (25 / 100 / 20), enough for stable
# medians of microsecond kernels, and the full sweep has about a thousand rows.
WARMUP_MS, REP_MS, GRAPH_REP_MS = 10, 50, 20
# Calls of a collective per measurement (fixed so that every rank issues the same sequence).
FIXED_WARMUP, FIXED_REPS = 5, 30
# Interpreter runs: a couple of calls after the checked one, the numbers mean nothing anyway.
CPU_REPS = 2
# Bytes copied to measure the HBM and peer bandwidths: large enough to hide launch cost and
# leave L2 (50 MB on H100/H200) far behind.
LIMIT_PROBE_BYTES = 1 << 30
PEER_PROBE_BYTES = 256 << 20


@dataclass(frozen=True)
class Timing:
    """One measurement in microseconds; ``method`` says how it was taken."""

    median_us: float
    p20_us: float
    p80_us: float
    method: str


def _quantile(sorted_values: list[float], q: float) -> float:
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def _from_samples(samples_ms: list[float], method: str) -> Timing:
    ordered = sorted(samples_ms)
    return Timing(statistics.median(ordered) * 1e3, _quantile(ordered, LOW_Q) * 1e3,
                  _quantile(ordered, HIGH_Q) * 1e3, method)


def time_gpu(fn: Callable[[], object], *, graph: bool = False) -> Timing:
    """Time ``fn`` on the current GPU. ``graph=True`` replays it from a CUDA graph (for
    launch-bound stages); when capture fails (an op that syncs or allocates on the host),
    falls back to ``do_bench`` and says so in ``method``."""
    import triton.testing

    quantiles = [0.5, LOW_Q, HIGH_Q]
    if graph:
        try:
            median, low, high = triton.testing.do_bench_cudagraph(fn, rep=GRAPH_REP_MS,
                                                                  quantiles=quantiles)
            return Timing(median * 1e3, low * 1e3, high * 1e3, "cuda_graph")
        except Exception:  # capture refused: fall through to eager timing
            torch.cuda.synchronize()
    median, low, high = triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS,
                                                quantiles=quantiles)
    return Timing(median * 1e3, low * 1e3, high * 1e3, "do_bench")


def time_fixed(fn: Callable[[], object], *, before: Optional[Callable[[], object]] = None,
               after: Optional[Callable[[], object]] = None,
               barrier: Optional[Callable[[], object]] = None, warmup: int = FIXED_WARMUP,
               reps: int = FIXED_REPS) -> Timing:
    """Time ``fn`` over exactly ``warmup + reps`` calls with CUDA events (collectives);
    ``before`` / ``after`` run untimed around each call."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
        if after is not None:
            after()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        if after is not None:
            after()
    torch.cuda.synchronize()
    return _from_samples([s.elapsed_time(e) for s, e in zip(starts, ends)], "fixed_events")


def time_cpu(fn: Callable[[], object], *, reps: int = CPU_REPS) -> Timing:
    """Wall-clock ``fn`` on the CPU (interpreter runs: the numbers mean nothing)."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return _from_samples(samples, "perf_counter_interpreter")


# ---------------------------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------------------------

def _peer_store_kernel():
    """A Triton copy kernel whose stores go to another GPU's memory (built on first use)."""
    import triton
    import triton.language as tl

    @triton.jit
    def peer_store(src_ptr, dst_ptr, num_words, BLOCK: tl.constexpr):
        # Persistent grid-stride copy of int4-sized words: 16-byte loads and stores.
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        for start in range(pid * BLOCK, num_words, step):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < num_words
            tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)

    return peer_store


# CTAs of the peer-store probe: design.md saw 32-64 CTAs reach ~350 GB/s per direction on H200.
PEER_STORE_CTAS = 64
PEER_STORE_BLOCK = 4096


def measure_limits(device: torch.device) -> dict:
    """Measure the bandwidth limits the rows are compared with, in GB/s (1e9 bytes/s).

    ``hbm_gbps``: ``dst.copy_(src)`` of 1 GiB on ``device``, counting read + write bytes.
    ``nvlink_gbps``: a Triton kernel on ``device`` storing 256 MiB into the next GPU's memory
    (one direction, counting the bytes stored remotely); falls back to a copy-engine peer copy
    (``method`` says which). Absent with one GPU. On CPU: an empty dict.
    """
    if device.type != "cuda":
        return {}
    limits: dict = {}
    src = torch.empty(LIMIT_PROBE_BYTES // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    timing = time_gpu(lambda: dst.copy_(src))
    limits["hbm_gbps"] = 2 * LIMIT_PROBE_BYTES / (timing.median_us * 1e3)
    limits["hbm_method"] = "torch copy_ of 1 GiB, read+write bytes"
    del src, dst
    if torch.cuda.device_count() < 2:
        return limits
    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    src = torch.empty(PEER_PROBE_BYTES // 4, dtype=torch.int32, device=device)
    dst = torch.empty(PEER_PROBE_BYTES // 4, dtype=torch.int32, device=peer)
    dst.copy_(src)  # makes torch enable peer access between the two devices
    try:
        kernel = _peer_store_kernel()
        words = src.numel()

        def store():
            kernel[(PEER_STORE_CTAS,)](src, dst, words, BLOCK=PEER_STORE_BLOCK)

        store()
        torch.cuda.synchronize(device)
        if not torch.equal(dst.cpu(), src.cpu()):
            raise RuntimeError("peer-store probe copied wrong data")
        timing = time_gpu(store)
        limits["nvlink_method"] = (f"Triton stores from {device} into {peer}, one direction, "
                                   f"{PEER_STORE_CTAS} CTAs")
    except Exception as error:  # no peer pointer access from Triton: use the copy engine
        timing = time_gpu(lambda: dst.copy_(src))
        limits["nvlink_method"] = (f"copy-engine peer copy {device} -> {peer} (Triton peer store "
                                   f"failed: {type(error).__name__}: {error})")
    limits["nvlink_gbps"] = PEER_PROBE_BYTES / (timing.median_us * 1e3)
    return limits
