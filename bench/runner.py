"""The one loop that runs every stage: build inputs, check each path against the oracle, time
the paths that agree, and turn the result into records.

A record (one dict per stage, shape and backend) is the unit of the JSON and of the table:
``stage, backend, gpu, num_gpus, distributed, shape, dtype, time_us, p20_us, p80_us, std_us,
bytes, local_bytes, remote_bytes, hbm_bytes, gbps, pct_of_limit, ok, note, timing`` (and, with
``--kernel-times``, ``kernels_us``: device time per call of each kernel the path launches,
torch.profiler; and the fields of a timed path's ``facts``, e.g. the decode chain's
``launches``). ``distributed``: the stage runs one process per GPU (its shapes are per rank).
``gbps`` is the effective bandwidth (``bytes`` / time); ``pct_of_limit`` compares the HBM
minimum (``hbm_bytes``: differs from ``local_bytes`` only where a formula reads the same rows
several times, e.g. gather_rows) and the remote bytes with the measured limits. ``ok`` is
True (checked, then timed), False (output differs or the call failed; never timed) or None
(the path cannot run here, or there was no oracle to check it against; ``note`` says why).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from bench.stages import Path, Stage, Sweep, Unavailable
from bench.timing import (CaptureFailed, Timing, brief_error, kernel_times, nvtx_range, time_cpu,
                          time_fixed, time_gpu, time_graph_fixed, with_remark)


@dataclass
class RunContext:
    """Where the bench runs: device, ranks, limits.

    ``group`` is the torch.distributed group of the ranks (None in a single process).
    ``limits``: measured bandwidths in GB/s (``hbm_gbps``, ``nvlink_gbps``); empty on CPU.
    ``shared``: per-run objects a stage may keep across shapes (e.g. transport workspaces).
    ``kernel_times``: also profile each timed path's kernels (``--kernel-times``).
    """

    device: torch.device
    gpu: str
    rank: int = 0
    world_size: int = 1
    group: Any = None
    limits: dict = field(default_factory=dict)
    shared: dict = field(default_factory=dict)
    kernel_times: bool = False

    @property
    def interpreter(self) -> bool:
        return self.device.type != "cuda"

    def agree(self, ok: bool) -> bool:
        """True only when ``ok`` holds on every rank (every rank then takes the same branch)."""
        if self.group is None:
            return ok
        import torch.distributed as dist
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def gather(self, value: Any) -> list:
        """``value`` of every rank, in rank order (a picklable object; [value] alone)."""
        if self.group is None:
            return [value]
        import torch.distributed as dist
        values: list = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def slowest(self, timing: Timing) -> Timing:
        """The measurement of the rank with the largest median (what the layer waits for)."""
        if self.group is None:
            return timing
        import torch.distributed as dist
        values = torch.tensor([timing.median_us, timing.p20_us, timing.p80_us,
                               timing.std_us if timing.std_us is not None else float("nan")],
                              dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(values) for _ in range(self.world_size)]
        dist.all_gather(gathered, values, group=self.group)
        worst = max(gathered, key=lambda v: float(v[0])).tolist()
        return Timing(worst[0], worst[1], worst[2], timing.method + "_slowest_rank",
                      timing.remark, std_us=None if worst[3] != worst[3] else worst[3])

    def barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist
            dist.barrier(group=self.group)


def _is_backend_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says that the path cannot run here (the stage switch's refusal)."""
    from a2a.backends import BackendUnavailable
    return isinstance(error, (BackendUnavailable, Unavailable))


class Progress:
    """A plain-text progress line on stderr (no tqdm)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // max(self.total, 1)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total} {label[:70]:<70}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def shape_label(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def run_stages(stages: list[Stage], sweep: Sweep, ctx: RunContext, *,
               backends: Optional[set[str]] = None, progress: bool = True,
               deadline: Optional[float] = None) -> list[dict]:
    """Run every shape of every stage; returns the records (on every rank).

    ``deadline`` (``time.time()`` seconds): no shape starts after it (the ranks agree); each
    shape left gets one row saying it was skipped."""
    plan = [(stage, shape) for stage in stages for shape in stage.shapes(sweep)]
    bar = Progress(len(plan), enabled=progress and ctx.rank == 0)
    records: list[dict] = []
    for stage, shape in plan:
        bar.step(f"{stage.name} {shape_label(shape)}")
        if not ctx.agree(deadline is None or time.time() < deadline):
            records.append(make_record(stage, shape, ctx, "*", ok=None,
                                       note=f"skipped: --budget spent; run it alone with "
                                            f"--stages {stage.name} "
                                            f"--tokens {shape.get('tokens', '')}".rstrip()))
            continue
        records += run_shape(stage, shape, ctx, backends=backends)
    bar.close()
    return records


def run_shape(stage: Stage, shape: dict, ctx: RunContext, *,
              backends: Optional[set[str]] = None) -> list[dict]:
    """Check and time every path of ``stage`` on one ``shape``."""
    try:
        inputs = stage.build(shape, ctx.device, ctx)
        paths = stage.paths(inputs, shape, ctx)
    except Unavailable as why:
        _close_shape_resources(ctx)
        return [make_record(stage, shape, ctx, "*", ok=None, note=str(why))]
    if backends is not None:
        paths = [p for p in paths if p.backend in backends or p.backend == stage.oracle]
    ref, ref_note = _oracle_output(stage, paths, ctx)
    records = []
    try:
        for path in paths:
            if backends is not None and path.backend not in backends:
                continue  # the oracle ran only to check the others
            # a profiler's timeline (nsys, torch.profiler) shows which stage, shape and path
            # each check and timing loop belongs to
            with nvtx_range(f"{stage.name} {shape_label(shape)} {path.backend}", ctx.device):
                records.append(_run_path(stage, shape, ctx, inputs, path, ref, ref_note))
            if ctx.device.type == "cuda":  # an asynchronous error shows up in its own row
                torch.cuda.synchronize(ctx.device)
    finally:
        _close_shape_resources(ctx)
    return records


def _close_shape_resources(ctx: RunContext) -> None:
    """Close what the paths of one shape opened (e.g. transport workspaces; collective)."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    for close in ctx.shared.pop("closers", []):
        close()


def _oracle_output(stage: Stage, paths: list[Path], ctx: RunContext) -> tuple[Any, str]:
    """The oracle's (normalized) output, or (None, why it is missing). Stages whose check
    computes the expected result itself have ``oracle=None``."""
    if stage.oracle is None:
        return None, ""
    oracle = next((p for p in paths if p.backend == stage.oracle), None)
    if oracle is None or oracle.run is None:
        return None, (oracle.reason if oracle else f"no {stage.oracle} path")
    try:
        return _call_once(oracle), ""
    except Exception as error:  # the oracle itself failed: nothing can be checked
        return None, f"oracle failed: {brief_error(error)}"


def _call_once(path: Path, run: Optional[Any] = None) -> Any:
    """One untimed call: ``before``, ``run`` (or the given call), ``normalize`` (before
    ``after`` can overwrite a workspace-backed output), ``after``."""
    if path.before is not None:
        path.before()
    out = (run or path.run)()
    if path.normalize is not None:
        out = path.normalize(out)
    if path.after is not None:
        path.after()
    return out


def _run_path(stage: Stage, shape: dict, ctx: RunContext, inputs: dict, path: Path,
              ref: Any, ref_note: str) -> dict:
    record = lambda **kw: make_record(stage, shape, ctx, path.backend, inputs=inputs, **kw)  # noqa
    if path.run is None:
        ctx.agree(False)  # keep the ranks' collective sequence identical
        return record(ok=False if path.reason.startswith("error") else None, note=path.reason)
    if ref_note:
        ctx.agree(False)
        return record(ok=None, note=f"not checked, so not timed: {ref_note}")
    ok, note = True, ""
    try:
        if stage.oracle is not None and path.backend == stage.oracle:
            note = "oracle"  # its output is ``ref``, computed once
        else:
            check = path.check or stage.check
            note = check(_call_once(path), ref, inputs, shape) or ""
            if path.checked is not None:  # the same op with its input checks on
                check(_call_once(path, path.checked), ref, inputs, shape)
    except AssertionError as error:
        ok, note = False, f"mismatch: {brief_error(error)}"
    except Exception as error:
        if _is_backend_unavailable(error):
            ok, note = None, f"not available: {error}"
        else:
            ok, note = False, f"error: {brief_error(error)}"
    if not ctx.agree(ok is True):
        if ok is True:
            failed = [f"rank {rank}: {their_note}" for rank, (their_ok, their_note)
                      in enumerate(ctx.gather((ok, note))) if their_ok is not True]
            ok, note = False, "another rank failed this path (" + "; ".join(failed) + ")"
        else:
            ctx.gather((ok, note))  # the same collective on every rank
        return record(ok=ok, note=note)
    try:
        timing = _time(stage, path, ctx)
    except Exception as error:
        return record(ok=False, note=f"timing failed: {brief_error(error)}")
    note = "; ".join(part for part in (note, path.timed, timing.remark) if part)
    row = record(ok=True, note=note, timing=timing)
    if path.facts is not None:
        try:
            facts = path.facts()
        except Exception as error:  # noqa: BLE001 - extra fields; the timed row stands
            facts = {}
            row["note"] = "; ".join(p for p in (row["note"], f"facts failed: "
                                                f"{brief_error(error)}") if p)
        row.update(facts)
        row["note"] = "; ".join(p for p in [row["note"]] + [
            f"{key}: {value}" for key, value in facts.items() if value is not None] if p)
    if ctx.kernel_times and not ctx.interpreter and path.before is None and path.after is None:
        try:
            with torch.cuda.device(ctx.device):
                row["kernels_us"] = kernel_times(
                    path.run, barrier=ctx.barrier if stage.distributed else None)
        except Exception as error:  # noqa: BLE001 - a diagnostic; the timed row stands
            row["note"] = "; ".join(p for p in (row["note"], f"kernel times failed: "
                                                f"{brief_error(error)}") if p)
    return row


def _time(stage: Stage, path: Path, ctx: RunContext) -> Timing:
    if ctx.interpreter:
        return time_cpu(path.run)
    with torch.cuda.device(ctx.device):
        if stage.distributed:
            if stage.graph and path.capture_safe and path.before is None and path.after is None:
                try:
                    return ctx.slowest(time_graph_fixed(path.run, barrier=ctx.barrier,
                                                        agree=ctx.agree))
                except CaptureFailed as error:  # on every rank (time_graph_fixed agrees)
                    return with_remark(ctx.slowest(time_fixed(path.run, barrier=ctx.barrier)),
                                       f"declared capture-safe but the CUDA-graph capture "
                                       f"failed ({error}): timed eagerly")
            return ctx.slowest(time_fixed(path.run, before=path.before, after=path.after,
                                          barrier=ctx.barrier))
        # Graph replay only for the paths that declare themselves free of host syncs: a
        # capture attempted on any other path would fail (and is never tried).
        return time_gpu(path.run, graph=stage.graph and path.capture_safe, flush=stage.flush)


def make_record(stage: Stage, shape: dict, ctx: RunContext, backend: str, *,
                ok: Optional[bool], note: str = "", timing: Optional[Timing] = None,
                inputs: Optional[dict] = None) -> dict:
    """One row of the results (see the module docstring)."""
    traffic = stage.traffic(shape, inputs)
    local, remote = traffic.get("local", 0), traffic.get("remote", 0)
    hbm_local = traffic.get("hbm_local", local)
    record = {
        "stage": stage.name, "backend": backend, "gpu": ctx.gpu, "num_gpus": ctx.world_size,
        "distributed": stage.distributed, "shape": dict(shape), "dtype": stage.dtype(shape),
        "time_us": None, "p20_us": None, "p80_us": None, "std_us": None,
        "bytes": local + remote, "local_bytes": local, "remote_bytes": remote,
        "hbm_bytes": hbm_local,
        "gbps": None, "pct_of_limit": None, "ok": ok, "note": note, "timing": None,
    }
    if timing is not None:
        record.update(time_us=timing.median_us, p20_us=timing.p20_us, p80_us=timing.p80_us,
                      std_us=timing.std_us, timing=timing.method,
                      gbps=(local + remote) / (timing.median_us * 1e3) if timing.median_us > 0
                      else None,
                      pct_of_limit=percent_of_limit(hbm_local, remote, timing.median_us,
                                                    ctx.limits))
    return record


def percent_of_limit(local: int, remote: int, time_us: float, limits: dict) -> Optional[float]:
    """100 * (ideal time) / (measured time), the ideal time moving ``local`` bytes at the HBM
    copy bandwidth and ``remote`` bytes at the NVLink peer-store bandwidth. None when a needed
    limit was not measured (CPU; remote bytes on one GPU)."""
    hbm, nvlink = limits.get("hbm_gbps"), limits.get("nvlink_gbps")
    if time_us <= 0 or (local and not hbm) or (remote and not nvlink):
        return None
    ideal_us = (local / (hbm * 1e3) if local else 0.0) + (remote / (nvlink * 1e3) if remote
                                                          else 0.0)
    return 100.0 * ideal_us / time_us


def add_speedups(records: list[dict]) -> None:
    """Add ``speedup_vs_flashinfer`` (best of the FlashInfer rows) and ``speedup_vs_torch``
    (the torch row) to every timed record: other time / this time, >1 means faster."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["stage"], repr(sorted(r["shape"].items()))), []).append(r)
    for group in groups.values():
        timed = {r["backend"]: r["time_us"] for r in group if r["time_us"]}
        flashinfer = [t for b, t in timed.items() if b.startswith("flashinfer")]
        for r in group:
            t = r["time_us"]
            r["speedup_vs_flashinfer"] = min(flashinfer) / t if t and flashinfer else None
            r["speedup_vs_torch"] = timed["torch"] / t if t and "torch" in timed else None
