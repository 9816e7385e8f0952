"""Timing and the machine's limits.

Three clocks, one result type (:class:`Timing`, microseconds):

- :func:`time_gpu`: :func:`time_eager` (do_bench's scheme, L2 flushed before each call, with
  a capped call count), or
  :func:`time_graph` (CUDA-graph replay, for launch-bound paths declared capture-safe; a failed
  capture is ended and torch's CUDA generator repaired, never left half-captured), or
  :func:`time_graph_flushed` (the same with an L2 flush before each call, the flush's own time
  subtracted); all give the median and the 20th / 80th percentiles.
  :func:`time_replays` times the replays of a graph of one call back to back (every call a
  graph launch of its own, as an engine replays one step's graph).
  :func:`time_graphs_interleaved` times several calls by graph replay in alternation, for rows
  whose ratio is judged (their medians from the same stretch of time), and
  :func:`time_host_interleaved` the host's time per call of several functions the same way.
- :func:`time_fixed`: a fixed number of event-timed calls, for collectives: every rank must call
  the op the same number of times (``do_bench`` picks its count from a first estimate, which
  differs per rank and would deadlock). ``before`` / ``after`` run untimed around each call
  (e.g. the combine that must follow a one-sided dispatch). :func:`time_graph_fixed`: the
  same fixed sequence captured in a CUDA graph on every rank and replayed, for the collectives
  declared capture-safe (their time without the host's launch cost).
- :func:`time_cpu`: ``time.perf_counter`` over a couple of calls, for the interpreter run, where
  the numbers mean nothing and are labelled so.

:func:`measure_limits` measures the HBM copy bandwidth and, with two GPUs, the NVLink peer-store
bandwidth; every row reports its fraction of these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Quantiles reported next to the median.
LOW_Q, HIGH_Q = 0.2, 0.8
# Eager timing budgets in milliseconds (half of do_bench's defaults, 25 / 100), and the call
# count clamped to [MIN_EAGER_CALLS, MAX_EAGER_CALLS]: do_bench's uncapped count (rep / time of
# one call) flushes L2 tens of thousands of times around a microsecond kernel, seconds per row.
WARMUP_MS, REP_MS = 10, 50
MIN_EAGER_CALLS, MAX_EAGER_CALLS = 10, 200
# Read before each eagerly timed call to evict L2 (50 MB on H100/H200). do_bench zeroes its
# buffer instead, which leaves L2 full of dirty lines that the timed kernel then pays to
# write back (about 50 MB, ~12 us at H200's bandwidth); reading leaves clean lines.
FLUSH_BYTES = 256 << 20
# CUDA-graph timing: one replay runs enough calls to last about GRAPH_REPLAY_MS (launch-bound
# calls of a few microseconds: hundreds per replay, capped at MAX_CALLS_PER_GRAPH), sized from
# GRAPH_ESTIMATE_REPLAYS replays of a one-call graph; GRAPH_SAMPLES replays give the quantiles.
GRAPH_REPLAY_MS, GRAPH_SAMPLES, GRAPH_ESTIMATE_REPLAYS, MAX_CALLS_PER_GRAPH = 1.0, 20, 3, 500
# Replays of a one-call graph per sample of time_replays, after ONE_GRAPH_WARM untimed ones.
ONE_GRAPH_CALLS, ONE_GRAPH_WARM = 100, 20
# Host time per call (time_host_interleaved): rounds of this many back-to-back calls per function.
HOST_CALLS, HOST_ROUNDS = 50, 20
# Calls of a collective per measurement (fixed so that every rank issues the same sequence).
FIXED_WARMUP, FIXED_REPS = 5, 30
# Collectives by graph replay: calls per graph and replays (samples), the same on every rank.
GRAPH_FIXED_CALLS, GRAPH_FIXED_SAMPLES = 20, 10
# Calls profiled per path by --kernel-times (kernel_times).
KERNEL_TIME_REPS = 10
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
    remark: str = ""  # e.g. why a graph timing fell back to eager timing
    std_us: Optional[float] = None  # population standard deviation of the samples


def _quantile(sorted_values: list[float], q: float) -> float:
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def _from_samples(samples_ms: list[float], method: str) -> Timing:
    ordered = sorted(samples_ms)
    return Timing(statistics.median(ordered) * 1e3, _quantile(ordered, LOW_Q) * 1e3,
                  _quantile(ordered, HIGH_Q) * 1e3, method,
                  std_us=statistics.pstdev(ordered) * 1e3)


@contextlib.contextmanager
def nvtx_range(name: str, device: torch.device):
    """An NVTX range named ``name`` around the block on a CUDA ``device`` (a profiler's
    timeline then names what ran); nothing on other devices."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def with_remark(timing: Timing, remark: str) -> Timing:
    """``timing`` with ``remark`` (e.g. why a graph timing fell back to eager timing)."""
    return dataclasses.replace(timing, remark=remark)


class CaptureFailed(RuntimeError):
    """A CUDA-graph capture of the timed call failed (it synced or otherwise touched the host)."""


def time_gpu(fn: Callable[[], object], *, graph: bool = False, flush: bool = False) -> Timing:
    """Time ``fn`` on the current GPU: :func:`time_eager` (L2 flushed before each call), or, with
    ``graph=True``, CUDA-graph replay (:func:`time_graph`, for launch-bound paths declared
    capture-safe, i.e. free of host syncs; with ``flush=True`` each call in the graph follows
    an L2 flush, :func:`time_graph_flushed`). A capture that fails anyway is cleaned up (see
    :func:`time_graph`) and the call is timed eagerly; ``remark`` says so."""
    if graph:
        try:
            return time_graph_flushed(fn) if flush else time_graph(fn)
        except CaptureFailed as error:
            return with_remark(time_eager(fn), f"declared capture-safe but the CUDA-graph "
                                               f"capture failed ({error}): timed eagerly")
    return time_eager(fn)


_FLUSH: dict = {}


def _flusher(device: torch.device) -> Callable[[], object]:
    """A call that evicts L2 by reading :data:`FLUSH_BYTES` (an amax: no temporary, unlike an
    int32 sum, which widens the whole buffer to int64), one buffer per device."""
    if device not in _FLUSH:
        _FLUSH[device] = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    buffer = _FLUSH[device]
    return lambda: torch.amax(buffer)


def time_eager(fn: Callable[[], object], *, warmup_ms: float = WARMUP_MS,
               rep_ms: float = REP_MS) -> Timing:
    """do_bench's scheme with a capped call count: warm-up calls, then each call between its
    own CUDA events, after reading :data:`FLUSH_BYTES` so that it starts with a cold L2."""
    device = torch.device("cuda", torch.cuda.current_device())
    flush = _flusher(device)
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 3, 1e-4)
    for _ in range(int(min(MAX_EAGER_CALLS, max(1, warmup_ms / estimate_ms)))):
        fn()
    calls = int(min(MAX_EAGER_CALLS, max(MIN_EAGER_CALLS, rep_ms / estimate_ms)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for begin, finish in zip(starts, ends):
        flush()
        begin.record()
        fn()
        finish.record()
    torch.cuda.synchronize(device)
    return _from_samples([b.elapsed_time(f) for b, f in zip(starts, ends)], "eager_l2_flushed")


def brief_error(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters: an error as a row's
    note or a remark shows it."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:limit]


def _capture(fn: Callable[[], object], calls: int, stream) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` calls of ``fn`` captured on ``stream``; raises
    :class:`CaptureFailed` after ending the capture, whatever went wrong.

    ``torch.cuda.graph`` is not used: when the capture is invalidated (a host sync inside
    ``fn``), its ``__exit__`` raises from ``capture_end`` and skips restoring the stream."""
    cuda_graph = torch.cuda.CUDAGraph()
    error: Optional[BaseException] = None
    with torch.cuda.stream(stream):
        cuda_graph.capture_begin()
        try:
            for _ in range(calls):
                fn()
        except Exception as raised:  # e.g. "operation not permitted when stream is capturing"
            error = raised
        try:
            cuda_graph.capture_end()
        except Exception as raised:  # the capture was invalidated: CUDA still ended it
            error = error or raised
    if error is not None:
        raise CaptureFailed(brief_error(error, 200)) from error
    return cuda_graph


def _recover_from_failed_capture(device: torch.device, stream, rng_state: torch.Tensor) -> None:
    """Undo what a failed capture leaves behind.

    When CUDA invalidates a capture, ``CUDAGraph.capture_end`` raises before it runs the
    generators' capture epilogue: torch's default CUDA generator keeps believing that it is
    being captured, and every later random op on the device fails with "Offset increment
    outside graph capture encountered unexpectedly". A capture that succeeds runs the
    prologue / epilogue pair again and clears that state; the generator's seed and offset are
    then restored from ``rng_state`` (taken before the capture)."""
    torch.cuda.synchronize(device)
    scratch = torch.zeros(1, device=device)
    try:
        _capture(lambda: scratch.add_(1), 1, stream)
    except Exception:  # judged by the check below
        pass
    torch.cuda.synchronize(device)
    try:
        torch.empty(1, device=device).uniform_()  # uses the default generator
    except RuntimeError as error:
        raise RuntimeError(f"a failed CUDA-graph capture left torch's default CUDA generator "
                           f"broken ({brief_error(error, 200)}); restart the process") from error
    finally:
        torch.cuda.set_rng_state(rng_state, device)


def _sized_graph(fn: Callable[[], object], replay_ms: float):
    """Warm ``fn`` up on a side stream, then capture a CUDA graph of ``n`` calls of it, ``n``
    sized so that one replay lasts about ``replay_ms``. Returns (graph, n, stream). A failed
    capture is cleaned up (:func:`_recover_from_failed_capture`) and re-raised."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up: JIT compiles and lazy allocations must not happen under capture
    torch.cuda.synchronize(device)
    rng_state = torch.cuda.get_rng_state(device)
    try:
        one = _capture(fn, 1, stream)
        estimate_ms = _replay_ms(one, stream, GRAPH_ESTIMATE_REPLAYS)
        del one
        calls = int(max(1, min(MAX_CALLS_PER_GRAPH, round(replay_ms / max(estimate_ms, 1e-4)))))
        return _capture(fn, calls, stream), calls, stream
    except CaptureFailed:
        _recover_from_failed_capture(device, stream, rng_state)
        raise


def time_graph(fn: Callable[[], object], *, replay_ms: float = GRAPH_REPLAY_MS,
               samples: int = GRAPH_SAMPLES) -> Timing:
    """Time ``fn`` by CUDA-graph replay: a graph of ``n`` calls (``n`` sized so one replay
    lasts about ``replay_ms``), replayed ``samples`` times between CUDA events; a sample is
    one replay / ``n``. No L2 flush (launch-bound paths move little data).

    ``fn`` must be capture-safe: no host syncs (``.item()``, ``.tolist()``, data-dependent
    shapes). If the capture fails anyway, the capture is ended, torch's CUDA generator state
    is repaired and restored (:func:`_recover_from_failed_capture`) and :class:`CaptureFailed`
    is raised."""
    many, calls, stream = _sized_graph(fn, replay_ms)
    _replay_ms(many, stream, 1)  # warm replay
    times = [_replay_ms(many, stream, 1) / calls for _ in range(samples)]
    del many
    torch.cuda.synchronize()
    return _from_samples(times, "cuda_graph")


def time_replays(cuda_graph: "torch.cuda.CUDAGraph", *, calls: int = ONE_GRAPH_CALLS,
                 samples: int = GRAPH_SAMPLES) -> Timing:
    """Time the replays of ``cuda_graph`` (a graph of one call, captured by the caller) back to
    back on the current stream: a sample is :func:`_replay_ms` of ``calls`` replays. Unlike
    :func:`time_graph`, whose one graph holds many calls, every call is a graph launch of its
    own, as a serving engine replays the graph of one step: the gaps between graph launches
    count, and a call's streams are not joined into one long graph."""
    stream = torch.cuda.current_stream()
    _replay_ms(cuda_graph, stream, ONE_GRAPH_WARM)  # warm replays
    times = [_replay_ms(cuda_graph, stream, calls) for _ in range(samples)]
    return _from_samples(times, "cuda_graph_one_call")


def _alternating(names: list[str], rounds: int):
    """``names`` ``rounds`` times over, in reverse order every other round (a, b, b, a, a, b,
    ...): in the interleaved timings, no name always runs first after the others."""
    for round_index in range(rounds):
        yield from (names if round_index % 2 == 0 else names[::-1])


def time_graphs_interleaved(fns: dict[str, Callable[[], object]], *,
                            replay_ms: float = GRAPH_REPLAY_MS,
                            samples: int = 2 * GRAPH_SAMPLES) -> dict[str, Timing]:
    """Time several capture-safe calls by CUDA-graph replay, interleaved: each gets its graph of
    ``n`` calls (as :func:`time_graph`), then the graphs are replayed in turn, ``samples``
    rounds, the order reversed every other round. Every name's median then comes from the same
    stretch of time as the others', so a drift of the machine's speed over a run (clocks, a
    neighbour) does not fall between two rows compared with each other. Returns name -> its
    :class:`Timing` (method ``cuda_graph_interleaved``)."""
    graphs = {name: _sized_graph(fn, replay_ms) for name, fn in fns.items()}
    for graph, _, stream in graphs.values():
        _replay_ms(graph, stream, 1)  # warm replay
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for name in _alternating(list(graphs), samples):
        graph, calls, stream = graphs[name]
        times[name].append(_replay_ms(graph, stream, 1) / calls)
    del graphs
    torch.cuda.synchronize()
    return {name: _from_samples(values, "cuda_graph_interleaved")
            for name, values in times.items()}


def time_host_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, *,
                          calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS
                          ) -> dict[str, Timing]:
    """The host's time per call of several functions, interleaved: each round times ``calls``
    calls of each function back to back (``time.perf_counter``, no sync between them: their
    launches queue up, so the host's cost is what is measured while it stays ahead of the
    device), the device drained before each batch, the order reversed every other round.
    Returns name -> :class:`Timing` (method ``host_interleaved``) of the per-call times. (A CPU
    ``device`` has nothing to drain.)"""
    def drain():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in fns.values():
        fn()  # warm
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in _alternating(list(fns), rounds):
        fn = fns[name]
        drain()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times[name].append((time.perf_counter() - start) * 1e3 / calls)
    drain()
    return {name: _from_samples(values, "host_interleaved") for name, values in times.items()}


def time_graph_flushed(fn: Callable[[], object], *, replay_ms: float = GRAPH_REPLAY_MS,
                       samples: int = GRAPH_SAMPLES) -> Timing:
    """Like :func:`time_graph`, each call preceded by the L2 flush of :func:`time_eager`: a
    sample is (one replay of ``n`` x (flush, call) - one replay of ``n`` x flush) / ``n``, both
    graphs replayed alternately. The kernel's time from a cold L2 without the host's launch
    cost, for short kernels whose eager timing would show the host."""
    flush = _flusher(torch.device("cuda", torch.cuda.current_device()))

    def flushed_call():
        flush()
        fn()

    with_calls, calls, stream = _sized_graph(flushed_call, replay_ms)
    flushes = _capture(flush, calls, stream)
    _replay_ms(with_calls, stream, 1)
    _replay_ms(flushes, stream, 1)
    times = [(_replay_ms(with_calls, stream, 1) - _replay_ms(flushes, stream, 1)) / calls
             for _ in range(samples)]
    del with_calls, flushes
    torch.cuda.synchronize()
    return _from_samples(times, "cuda_graph_l2_flushed")


def _replay_ms(cuda_graph, stream, replays: int) -> float:
    """Milliseconds per replay of ``cuda_graph`` on ``stream``, over ``replays`` replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(replays):
            cuda_graph.replay()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


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


@contextlib.contextmanager
def device_trace():
    """torch.profiler recording the GPU's activities over the block (yields the profile), and
    CUPTI detached from the process when the block ends.

    Kineto, torch.profiler's engine, leaves CUPTI attached after a session unless the
    environment's ``TEARDOWN_CUPTI`` is "1" when the session stops. Attached, it slowed every
    later CUDA-graph timing of the process (on an H200, a decode chain's graph of many calls
    by microseconds, whatever was timed), so each bench row timed after an earlier row's
    launch count or kernel times read slower. Every profile the bench takes goes through here;
    the variable stays set for the rest of the process."""
    from torch.profiler import ProfilerActivity, profile
    os.environ["TEARDOWN_CUPTI"] = "1"
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        yield trace


def kernel_times(fn: Callable[[], object], *, barrier: Optional[Callable[[], object]] = None,
                 reps: int = KERNEL_TIME_REPS) -> dict[str, float]:
    """Device time per call (us) of each GPU activity ``fn`` launches (kernels, memsets,
    copies), by torch.profiler (:func:`device_trace`) over exactly ``reps`` calls after one
    untimed call (the same count on every rank, so collectives can use it). A spinning receive
    kernel's time includes its wait, which is the point: it shows how a transfer's time splits
    between its kernels."""
    fn()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    with device_trace() as trace:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in trace.key_averages():
        total = getattr(event, "self_device_time_total", None)
        if total is None:  # older torch
            total = getattr(event, "self_cuda_time_total", 0)
        if total > 0:
            times[event.key] = round(total / reps, 2)
    return times


def time_graph_fixed(fn: Callable[[], object], *, barrier: Callable[[], object],
                     agree: Callable[[bool], bool], warmup: int = FIXED_WARMUP,
                     calls: int = GRAPH_FIXED_CALLS,
                     samples: int = GRAPH_FIXED_SAMPLES) -> Timing:
    """Collectives by CUDA-graph replay: every rank captures the same ``calls`` calls of ``fn``
    (a fixed count, so that the ranks' device-side sequences pair up) and replays the graph
    ``samples`` times, each replay started after a barrier; a sample is one replay / ``calls``
    (the ranks' start skew after the barrier is spread over the calls, and counted). Raises
    :class:`CaptureFailed` on every rank when the capture failed on any (``agree``: True only
    if true on every rank), after cleaning up, so that all ranks fall back together."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize(device)
    rng_state = torch.cuda.get_rng_state(device)
    barrier()
    cuda_graph, error = None, None
    try:
        cuda_graph = _capture(fn, calls, stream)
    except CaptureFailed as failed:
        _recover_from_failed_capture(device, stream, rng_state)
        error = failed
    if not agree(cuda_graph is not None):
        del cuda_graph
        raise error or CaptureFailed("the capture failed on another rank")
    barrier()
    _replay_ms(cuda_graph, stream, 1)  # warm replay
    times = []
    for _ in range(samples):
        barrier()
        times.append(_replay_ms(cuda_graph, stream, 1) / calls)
    del cuda_graph
    torch.cuda.synchronize(device)
    return _from_samples(times, "cuda_graph_fixed")


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

def peer_store_kernel():
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


# The peer-store probe's persistent grid (CTAs) and int32 words per step (16-byte stores): enough
# store streams to keep one direction of the NVLink peer path busy.
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
        kernel = peer_store_kernel()
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
