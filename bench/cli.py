"""The command line of the bench (``python -m bench``, ``moe-a2a-bench``): options, the sweep,
one process per GPU, the report. Lives in an importable module (not ``__main__``) so that
``torch.multiprocessing.spawn`` can pickle the per-GPU worker by name.
"""


from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tarfile
import textwrap
import time
from typing import Optional

import torch

# Without CUDA, Triton kernels can only run in its interpreter, which must be chosen before
# triton is imported (nothing under bench/ imports it at module level).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import report  # noqa: E402
from bench.decode import DECODE, DECODE_SWEEP  # noqa: E402
from bench.ops import OPS  # noqa: E402
from bench.ops import ROWS as OPS_ROWS  # noqa: E402
from bench.runner import RunContext, add_speedups, run_stages  # noqa: E402
from bench.stages import (CPU_QUICK_SWEEP, CPU_SWEEP, DEEPSEEK_SWEEP,  # noqa: E402
                          DEFAULT_SWEEP, QUICK_SWEEP, SINGLE_DEVICE_STAGES, TRANSPORT_SWEEP,
                          Stage, Sweep)
from bench.targets import judge_targets  # noqa: E402
from bench.timing import measure_limits  # noqa: E402
from bench.transport import DISTRIBUTED_STAGES, not_distributed_record  # noqa: E402

# The one-GPU stages (one per op, the decode chain that strings them, the registered ops' eager
# call costs), then the cross-rank.
ALL_STAGES: tuple[Stage, ...] = SINGLE_DEVICE_STAGES + (DECODE, OPS) + DISTRIBUTED_STAGES
STAGE_NAMES = tuple(dict.fromkeys(s.name for s in ALL_STAGES))
BACKEND_NAMES = (("triton", "flashinfer", "flashinfer_one_sided", "flashinfer_routing", "torch",
                  "torch_compile", "triton_overlap", "triton_compiled", "triton_compiled_graph")
                 + OPS_ROWS)
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
# Collectives wait this long for a peer: rank 0 may run the single-GPU sweep in between.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(hours=2)
# --sweep NAME: (its grid on a GPU, its grid without one). Without a GPU every Triton kernel runs
# in the interpreter, so every sweep but quick runs the same tiny CPU grid.
SWEEPS = {"quick": (QUICK_SWEEP, CPU_QUICK_SWEEP), "default": (DEFAULT_SWEEP, CPU_SWEEP),
          "deepseek": (DEEPSEEK_SWEEP, CPU_SWEEP), "transport": (TRANSPORT_SWEEP, CPU_SWEEP),
          "decode": (DECODE_SWEEP, CPU_SWEEP)}
# Seconds of sweep on a GPU before no further shape starts: with start-up, the limits and the
# shape running at the deadline, one call stays under about 8 minutes (the GPU calls that run
# the bench are limited to 10). The default sweep is sized to finish well inside it.
DEFAULT_GPU_BUDGET_S = 400

DESCRIPTION = """\
Benchmark every stage of the MoE all-to-all (routing, prepare, quantize, permute, dispatch,
combine), a decode step's one-GPU chain of them and the whole layer, for each backend that can
run here: every path is first checked against the torch oracle on the same inputs, and only the
paths that agree are timed. Reports time, GB/s (the bytes an ideal kernel moves) and the
fraction of the HBM / NVLink bandwidth measured in the same run, in a terminal table and in
JSON / Markdown / PNG files (and CSV with --csv).

Without a GPU the Triton kernels run in Triton's interpreter on tiny shapes: the outputs are
checked, but the timings mean nothing, and the options that need a GPU are listed at the start
as not applied."""


def _sweep_lines() -> str:
    """The sweeps of --sweep, one wrapped entry each, for the help's epilog."""
    lines = []
    for name, (gpu, cpu) in SWEEPS.items():
        text = gpu.describe()
        if cpu != CPU_SWEEP:
            text += f" (without a GPU: {cpu.describe()})"
        lines.append(textwrap.fill(text, 96, initial_indent=f"  {name:<10} ",
                                   subsequent_indent=" " * 13))
    lines.append(textwrap.fill(f"Without a GPU every other sweep runs {CPU_SWEEP.describe()}.",
                               96))
    return "\n".join(lines)


EPILOG = f"""\
examples:
  python -m bench                        all stages, the default sweep (until --budget)
  python -m bench --sweep deepseek       DeepSeek-V3 shapes only (fits one GPU call)
  python -m bench --stages decode --sweep decode --targets   the decode chain, T 1 to 2048
  python -m bench --gpus 2               one process per GPU: adds dispatch, combine, layer
  python -m bench --stages quantize,routing --backends triton,flashinfer --quick
  python -m bench --stages permute --budget 400 --bundle --out results/p
  python -m bench --targets --csv run.csv
  python -m bench --readme-from bench/results/a.json,bench/results/b.json

sweeps (--sweep) on a GPU:
{_sweep_lines()}

The default sweep does not fit in one {DEFAULT_GPU_BUDGET_S} s --budget at large T: the shapes left
are listed as skipped, each with the command that runs it; run a few --stages (or --tokens)
per call. Results go to bench/results/ on a GPU; without one, only when --out is given."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default=",".join(STAGE_NAMES),
                        help=f"comma-separated subset of {','.join(STAGE_NAMES)} (default: all; "
                             f"dispatch, combine, layer and the cross-rank prepare need --gpus 2)")
    parser.add_argument("--backends", default=None,
                        help=f"comma-separated subset of {','.join(BACKEND_NAMES)} "
                             "(the torch oracle still runs to check the others)")
    parser.add_argument("--sweep", choices=tuple(SWEEPS), default="default",
                        help="the shape grid (listed below); default: default")
    parser.add_argument("--quick", action="store_true",
                        help=f"same as --sweep quick; on a GPU: {QUICK_SWEEP.describe()}; "
                             f"without one: {CPU_QUICK_SWEEP.describe()}")
    parser.add_argument("--tokens", default=None,
                        help="comma-separated token counts replacing the sweep's (e.g. 16,8192)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds of sweep after which no shape starts (the rest are listed "
                             f"as skipped); default {DEFAULT_GPU_BUDGET_S} on a GPU, none "
                             f"without one; 0 = no limit")
    parser.add_argument("--bundle", action="store_true",
                        help="also pack this run's files (JSON, Markdown, plot) into one "
                             "<name>.tar.gz in the --out folder")
    parser.add_argument("--gpus", type=int, default=1,
                        help="one process per GPU; 2+ adds dispatch, combine and layer")
    parser.add_argument("--out", default=None,
                        help="where to write JSON, Markdown and the plot (default on a GPU: "
                             "bench/results/; without one nothing is written unless given)")
    parser.add_argument("--csv", default=None, metavar="PATH",
                        help="also write every row to PATH as CSV, under the column names of "
                             "FlashInfer's benchmark CSV (routine, median_time and std_time "
                             "in ms, tb_per_sec, backend, num_tokens, hidden_size, num_experts, "
                             "top_k, ep_size, input_dtype, quant_dtype, case_tag), then ours")
    parser.add_argument("--targets", action="store_true",
                        help="judge the rows that have a stated target (bench/targets.py): a "
                             "PASS/FAIL column and a list after the table (GPU shapes only)")
    parser.add_argument("--kernel-times", action="store_true",
                        help="also profile each timed GPU path (torch.profiler; warm L2, no "
                             "graph) and record its kernels' device time per call in the "
                             "JSON (kernels_us)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    parser.add_argument("--readme-from", default=None, metavar="JSON[,JSON]",
                        help="run nothing: rewrite README.md's headline table from these "
                             "result files of earlier GPU runs (interpreter-mode results are "
                             "refused)")
    args = parser.parse_args(argv)
    args.stage_list = _choose(args.stages, STAGE_NAMES, "--stages")
    args.backend_set = (set(_choose(args.backends, BACKEND_NAMES, "--backends"))
                        if args.backends else None)
    if args.quick:
        args.sweep = "quick"
    if args.gpus < 1:
        raise SystemExit(f"--gpus {args.gpus}: give 1 or more")
    args.deadline = None  # main() sets it from --budget when the run starts
    try:
        args.token_list = (tuple(int(t) for t in args.tokens.split(",") if t.strip())
                           if args.tokens else None)
    except ValueError:
        raise SystemExit(f"--tokens {args.tokens!r}: comma-separated integers, e.g. 16,8192")
    args.command = " ".join(["python -m bench"] + list(argv if argv is not None
                                                       else sys.argv[1:]))
    return args


def options_not_applied(args: argparse.Namespace, on_gpu: bool) -> list[str]:
    """The options given that do not apply on this machine, each with the reason (empty on a
    GPU: there every option applies)."""
    if on_gpu:
        return []
    ignored = []
    if args.sweep in ("deepseek", "transport", "decode"):
        ignored.append(f"--sweep {args.sweep} (the interpreter runs the CPU grid instead)")
    if args.gpus > 1:
        ignored.append(f"--gpus {args.gpus} (no CUDA GPU: one process, the cross-rank stages "
                       f"listed as n/a)")
    if args.kernel_times:
        ignored.append("--kernel-times (profiles GPU kernels)")
    if args.targets:
        ignored.append("--targets (the targets are for GPU shapes, which the CPU grid has not)")
    if args.out is None:
        ignored += [f"{option} (nothing is written without --out)"
                    for option, given in (("--bundle", args.bundle), ("--no-plots", args.no_plots))
                    if given]
    return ignored


def _choose(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in allowed]
    if unknown:
        raise SystemExit(f"{option}: unknown {unknown}; choose from {','.join(allowed)}")
    return chosen


def pick_sweep(args: argparse.Namespace, on_gpu: bool) -> Sweep:
    """The sweep named by --sweep (its tiny interpreter twin without a GPU), with --tokens."""
    gpu_sweep, cpu_sweep = SWEEPS[args.sweep]
    sweep = gpu_sweep if on_gpu else cpu_sweep
    if args.token_list:
        sweep = dataclasses.replace(sweep, tokens=args.token_list)
    return sweep


def deadline(args: argparse.Namespace, on_gpu: bool) -> Optional[float]:
    """``time.time()`` after which no shape starts (None: no limit)."""
    default = DEFAULT_GPU_BUDGET_S if on_gpu else 0
    budget = args.budget if args.budget is not None else default
    return time.time() + budget if budget > 0 else None


def run_bench(args: argparse.Namespace, ctx: RunContext) -> list[dict]:
    """Run the selected stages in this process; returns the records on rank 0 (all of them)
    and the distributed records on the other ranks."""
    on_gpu = ctx.device.type == "cuda"
    sweep = pick_sweep(args, on_gpu)
    ctx.shared["sweep"] = sweep
    progress = not args.no_progress
    records: list[dict] = []
    distributed = [s for s in DISTRIBUTED_STAGES if s.name in args.stage_list]
    if ctx.world_size >= 2:
        records += run_stages(distributed, sweep, ctx, backends=args.backend_set,
                              progress=progress, deadline=args.deadline)
    elif ctx.rank == 0:
        records += [not_distributed_record(s, ctx) for s in distributed]
    if ctx.rank == 0:
        local = RunContext(device=ctx.device, gpu=ctx.gpu, world_size=ctx.world_size,
                           limits=ctx.limits, kernel_times=ctx.kernel_times)
        single = [s for s in ALL_STAGES if not s.distributed and s.name in args.stage_list]
        records = run_stages(single, sweep, local, backends=args.backend_set,
                             progress=progress, deadline=args.deadline) + records
    return records


def finish(args: argparse.Namespace, records: list[dict], ctx: RunContext) -> list[str]:
    """Speed-ups, targets, the table; the files when asked for (or by default on a GPU)."""
    on_gpu = ctx.device.type == "cuda"
    targets = args.targets and on_gpu
    add_speedups(records)
    if targets:
        judge_targets(records)
    meta = report.make_meta(ctx.device, ctx.world_size, ctx.limits, args.command,
                            options_not_applied(args, on_gpu))
    print(report.format_table(records, meta, with_targets=targets))
    written = [report.write_csv(records, args.csv)] if args.csv else []
    out = args.out or (DEFAULT_OUT if on_gpu else None)
    if out is None:
        print("(no GPU: the JSON and Markdown files are not written; pass --out DIR to keep "
              "them)", file=sys.stderr)
    else:
        files = report.write_results(records, meta, out, with_targets=targets,
                                     plots=not args.no_plots)
        if args.bundle:
            files.append(bundle(files))
        written += files
    if written:
        print("wrote " + ", ".join(written), file=sys.stderr)
    return written


def bundle(paths: list[str]) -> str:
    """Pack ``paths`` (one run's files, all in one folder) into ``<stem>.tar.gz`` next to them:
    one file to fetch instead of several."""
    stem = os.path.splitext(paths[0])[0]
    archive = stem + ".tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in paths:
            tar.add(path, arcname=os.path.basename(path))
    return archive


def gpu_worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """One process per GPU: NCCL group, limits on rank 0, the distributed stages on every rank,
    then the single-GPU stages and the report on rank 0."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device,
                            timeout=PROCESS_GROUP_TIMEOUT)
    try:
        limits = measure_limits(device) if rank == 0 else {}
        dist.barrier()
        ctx = RunContext(device=device, gpu=report.gpu_name(device), rank=rank,
                         world_size=world_size, group=dist.group.WORLD, limits=limits,
                         kernel_times=args.kernel_times)
        records = run_bench(args, ctx)
        if rank == 0:
            finish(args, records, ctx)
        # The other ranks wait here for rank 0's single-GPU sweep, so that no peer-mapped
        # workspace is torn down while a rank may still use it.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Entry point of ``python -m bench`` and ``moe-a2a-bench``; returns the records of a
    single-process run (empty for ``--gpus N > 1``, where rank 0 reports)."""
    args = parse_args(argv)
    if args.readme_from:
        report.update_readme(README, [p for p in args.readme_from.split(",") if p])
        print(f"updated {README}", file=sys.stderr)
        return []
    on_gpu = torch.cuda.is_available()
    not_applied = options_not_applied(args, on_gpu)
    if not_applied:
        print("No CUDA GPU here; not applied: " + "; ".join(not_applied), file=sys.stderr)
    args.deadline = deadline(args, on_gpu)
    if args.gpus > 1 and on_gpu:
        available = torch.cuda.device_count()
        if available < args.gpus:
            raise SystemExit(f"--gpus {args.gpus}: only {available} CUDA GPU(s) visible")
        import torch.multiprocessing as mp
        mp.spawn(gpu_worker, args=(args.gpus, _free_port(), args), nprocs=args.gpus, join=True)
        return []
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        limits = measure_limits(device)
    else:
        device, limits = torch.device("cpu"), {}
    ctx = RunContext(device=device, gpu=report.gpu_name(device), limits=limits,
                     kernel_times=args.kernel_times)
    records = run_bench(args, ctx)
    finish(args, records, ctx)
    return records
