"""The benchmark's machinery on CPU: the runner's check-before-time rule on a synthetic stage,
a --quick interpreter sweep of real stages, the JSON / Markdown writers, the bytes formulas and
the limit, speed-up and target arithmetic (numbers written out by hand).

Every run of the real bench goes through a subprocess (``python -m bench``): on a GPU the bench
times by CUDA-graph capture, which must never run inside the pytest process (a failed capture
could leave torch's CUDA state broken for every later test), and without a GPU the subprocess
hides CUDA and runs the interpreter, so the same test runs on both machines."""

import csv
import glob
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest
import torch

from bench.floor import FLOOR_VARIANTS, nvfp4_traffic
from bench import report
from bench.cli import parse_args
from bench.runner import RunContext, add_speedups, percent_of_limit, run_stages
from bench.stages import (PERMUTE, QUANTIZE, ROUTING, Path, Stage, Sweep, Unavailable,
                          assert_same, make_path, make_topk)
from bench.targets import judge_targets

RECORD_KEYS = {"stage", "backend", "gpu", "num_gpus", "shape", "dtype", "time_us", "p20_us",
               "p80_us", "bytes", "local_bytes", "remote_bytes", "hbm_bytes", "gbps",
               "pct_of_limit", "ok", "note", "timing"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Wall-clock limit of one bench subprocess (GPU runs compile kernels first).
BENCH_TIMEOUT_S = 600


def run_bench(args: list[str], out_dir, *, cpu: bool) -> tuple[str, dict]:
    """``python -m bench ARGS --out OUT_DIR`` in a subprocess (CUDA hidden when ``cpu``);
    returns its stdout and the JSON it wrote."""
    env = dict(os.environ)
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "bench", *args, "--no-progress", "--out",
                           str(out_dir)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = glob.glob(os.path.join(str(out_dir), "*.json"))
    return done.stdout, json.load(open(path))


META_KEYS = {"gpu", "driver", "torch", "triton", "flashinfer", "date", "command", "limits"}

TINY = Sweep(tokens=(3, 5), hidden=(32,), experts=(8,), top_k=(2,), routing=("uniform",))


def _broken_setup():
    raise RuntimeError("boom")


def _cumsum_stage() -> Stage:
    """A stage whose paths are known: the oracle, a correct twin, a wrong one, a failing one
    and one that cannot run."""
    def paths(inputs, shape, ctx):
        x = inputs["x"]
        return [Path("torch", run=lambda: torch.cumsum(x, 0)),
                Path("triton", run=lambda: x.flip(0).cumsum(0).flip(0).neg().add(x.sum(0))
                     .add(x)),  # the same sums computed the other way round
                Path("flashinfer", run=lambda: torch.cumsum(x, 0) + 1),
                Path("torch_compile", run=lambda: 1 / 0),
                Path("flashinfer_one_sided", reason="not available: by construction"),
                make_path("broken_setup", _broken_setup)]
    return Stage(name="cumsum", keys=("tokens",),
                 build=lambda shape, device, ctx=None: {
                     "x": torch.arange(shape["tokens"] * 4, dtype=torch.float32,
                                       device=device).reshape(-1, 4)},
                 paths=paths, check=lambda out, ref, inputs, shape: assert_same(out, ref),
                 traffic=lambda shape, inputs=None: {"local": 2 * 16 * shape["tokens"]},
                 dtype=lambda shape: "fp32")


def test_runner_checks_before_timing():
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu")
    records = run_stages([_cumsum_stage()], TINY, ctx, progress=False)
    assert len(records) == 2 * 6  # two shapes, six paths
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert r["bytes"] == 32 * r["shape"]["tokens"]
        timed = r["time_us"] is not None
        assert timed == (r["ok"] is True), r  # only checked paths are timed
        if timed:
            assert r["p20_us"] <= r["time_us"] <= r["p80_us"]
    by_backend = {r["backend"]: r for r in records if r["shape"]["tokens"] == 5}
    assert by_backend["torch"]["ok"] is True and by_backend["torch"]["note"] == "oracle"
    assert by_backend["triton"]["ok"] is True
    assert by_backend["flashinfer"]["ok"] is False
    assert by_backend["flashinfer"]["note"].startswith("mismatch")
    assert by_backend["torch_compile"]["ok"] is False
    assert "ZeroDivisionError" in by_backend["torch_compile"]["note"]
    assert by_backend["flashinfer_one_sided"]["ok"] is None
    assert by_backend["flashinfer_one_sided"]["note"] == "not available: by construction"
    assert by_backend["broken_setup"]["ok"] is False
    assert by_backend["broken_setup"]["note"] == "error: setup failed: RuntimeError: boom"


def test_make_path_turns_refusals_into_reasons():
    from a2a.backends import BackendUnavailable

    def refuse():
        raise Unavailable("not available: refused")

    def switch_refuses():
        raise BackendUnavailable("quantize backend 'flashinfer' cannot run here: why\nmore")
    assert make_path("triton", refuse) == Path("triton", reason="not available: refused")
    assert make_path("flashinfer", switch_refuses).reason == \
        "not available: quantize backend 'flashinfer' cannot run here: why"
    path = make_path("triton", lambda: (lambda: 7))
    assert path.run() == 7 and path.reason == ""


def test_backend_filter_keeps_the_oracle_for_checking():
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu")
    records = run_stages([_cumsum_stage()], TINY, ctx, backends={"flashinfer"}, progress=False)
    assert [r["backend"] for r in records] == ["flashinfer", "flashinfer"]
    assert all(r["ok"] is False for r in records)  # checked against the (hidden) oracle


def test_cpu_run_names_the_options_that_do_not_apply(tmp_path):
    """Without a GPU: one line on stderr names every GPU-only option given, with its reason;
    the CPU grid runs instead of --sweep deepseek; --targets adds no column; the terminal
    table fits 120 columns; --csv writes the rows under FlashInfer's column names."""
    path = tmp_path / "rows.csv"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "bench", "--stages", "prepare", "--tokens", "7",
                           "--sweep", "deepseek", "--gpus", "2", "--kernel-times", "--targets",
                           "--bundle", "--no-progress", "--csv", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "not applied" in line]
    assert len(said) == 1, done.stderr
    for option in ("--sweep deepseek", "--gpus 2", "--kernel-times", "--targets", "--bundle"):
        assert option in said[0], said[0]
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    assert "target" not in lines[2] and not any(line.startswith("targets:") for line in lines)
    assert "prepare local R=8 T=7 E=16 k=4 uniform" in done.stdout  # the CPU grid's E and k
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    local = [r for r in rows if r["routine"] == "prepare_local" and r["backend"] == "triton"]
    assert len(local) == 2 and all(r["ok"] == "ok" and r["ep_size"] == "8" for r in local)


def test_quick_does_what_its_help_says(capsys, monkeypatch):
    from bench.cli import pick_sweep
    from bench.stages import CPU_QUICK_SWEEP, QUICK_SWEEP
    assert pick_sweep(parse_args(["--quick"]), on_gpu=True) == QUICK_SWEEP
    assert pick_sweep(parse_args(["--quick"]), on_gpu=False) == CPU_QUICK_SWEEP
    assert pick_sweep(parse_args(["--sweep", "deepseek", "--quick"]), on_gpu=True) == QUICK_SWEEP
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help at $COLUMNS: one line per option
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    (quick,) = [line for line in capsys.readouterr().out.splitlines()
                if line.strip().startswith("--quick")]
    # Written out here, not read from the sweeps: the help names both grids.
    assert "T {16,512,8192} x H 7168 x E 256 x k 8, uniform routing" in quick
    assert "without one: T 7 x H 128 x E 16 x k 4, uniform routing" in quick


def test_help_reads_well_on_its_own(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description.startswith("Benchmark every stage") and description.endswith(".")
    assert "issue" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    for option in ("--quick", "--csv", "--readme-from", "--targets", "--budget"):
        assert option in text
    assert "examples:" in text and "sweeps (--sweep) on a GPU:" in text


def test_options_not_applied_only_without_a_gpu():
    from bench.cli import options_not_applied
    args = parse_args(["--sweep", "transport", "--kernel-times", "--targets", "--gpus", "2",
                       "--no-plots", "--bundle"])
    assert options_not_applied(args, on_gpu=True) == []
    said = options_not_applied(args, on_gpu=False)
    assert [s.split(" (")[0] for s in said] == [
        "--sweep transport", "--gpus 2", "--kernel-times", "--targets", "--bundle", "--no-plots"]
    assert all(s.endswith(")") for s in said)  # each with its reason
    # --out makes --bundle and --no-plots apply; plain defaults apply everywhere
    assert options_not_applied(parse_args(["--bundle", "--no-plots", "--out", "x"]), False) == []
    assert options_not_applied(parse_args([]), on_gpu=False) == []
    assert options_not_applied(parse_args(["--quick", "--budget", "5"]), on_gpu=False) == []


def test_quick_cpu_sweep_of_real_stages(tmp_path):
    out, data = run_bench(["--quick", "--stages", "routing,prepare", "--no-plots", "--bundle"],
                          tmp_path, cpu=True)
    assert "MEAN NOTHING" in out
    (archive,) = glob.glob(str(tmp_path / "*.tar.gz"))
    with tarfile.open(archive) as tar:
        assert sorted(n.rsplit(".", 1)[1] for n in tar.getnames()) == ["json", "md"]
    records = data["records"]
    assert {r["stage"] for r in records} == {"routing", "prepare"}
    local_triton = [r for r in records if r["stage"] == "prepare" and r["backend"] == "triton"
                    and r["shape"].get("scope") == "local"]
    assert local_triton and all(r["ok"] is True for r in local_triton), local_triton
    assert all("check_ids=False" in r["note"] for r in local_triton)  # the sync-free call
    assert max(len(line) for line in out.splitlines()) <= 120
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert r["gpu"] == "cpu (Triton interpreter)" and r["num_gpus"] == 1
        # On CPU a path is either checked and right, or listed with the reason it cannot run;
        # a mismatch or an error of a real kernel fails this test.
        assert r["ok"] is not False, r
        assert (r["ok"] is None) == bool(r["note"].startswith(("not available", "not checked"))), r


def test_routing_oracle_rows_pass_their_own_check():
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu")
    records = run_stages([ROUTING], TINY, ctx, progress=False)
    torch_rows = [r for r in records if r["backend"] == "torch"]
    assert torch_rows and all(r["ok"] is True for r in torch_rows)


def test_writers(tmp_path):
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu (Triton interpreter)")
    records = run_stages([_cumsum_stage()], TINY, ctx, progress=False)
    add_speedups(records)
    meta = report.make_meta(torch.device("cpu"), 1, {}, "python -m bench --test")
    written = report.write_results(records, meta, str(tmp_path), plots=False)
    data = json.loads(open(written[0]).read())
    assert META_KEYS <= set(data["meta"]) and data["meta"]["command"] == "python -m bench --test"
    assert len(data["records"]) == len(records)
    assert all(RECORD_KEYS <= set(r) for r in data["records"])
    markdown = open(written[1]).read()
    assert "MEAN NOTHING" in markdown
    table_lines = [line for line in markdown.splitlines() if line.startswith("| cumsum")]
    assert len(table_lines) == len(records)
    assert written[0].endswith(".json") and "cpu-triton-interpreter-1gpu-" in written[0]


def _row(stage="quantize", backend="triton", ok=True, note="", time_us=12.5, **shape) -> dict:
    """A record as bench/runner.py makes it (the fields the writers read)."""
    timed = ok is True
    return dict(stage=stage, backend=backend, gpu="NVIDIA H200", num_gpus=2,
                distributed=stage in ("dispatch", "combine", "layer"),
                shape=shape or dict(op="nvfp4_linear", tokens=8192, hidden=7168),
                dtype="bf16", time_us=time_us if timed else None,
                p20_us=time_us - 0.5 if timed else None, p80_us=time_us + 1 if timed else None,
                std_us=0.25 if timed else None, bytes=150_470_656, local_bytes=150_470_656,
                remote_bytes=0, hbm_bytes=150_470_656, gbps=12037.7 if timed else None,
                pct_of_limit=87.5 if timed else None, ok=ok, note=note,
                timing="cuda_graph" if timed else None)


GPU_META = dict(gpu="NVIDIA H200", num_gpus=2, limits={"hbm_gbps": 4280.0, "nvlink_gbps": 360.0},
                interpreter=False, date="2026-12-01T00:00:00", command="python -m bench",
                driver="1", torch="2", triton="3", flashinfer="0.7.2")


def test_terminal_table_fits_120_columns_and_summarises_what_cannot_run():
    long_note = "timed: " + "a very long explanation of the timed call, " * 8
    refused = ("not available: FlashInfer's fp4/mx quantize kernels are compiled only for SM100+ "
               "(their body is guarded by __CUDA_ARCH__ >= 1000); this machine has SM90")
    dispatch = dict(quant="bf16", tokens=2048, hidden=7168, experts=32, top_k=8,
                    routing="uniform")
    records = [_row(note=long_note), _row(backend="torch", note="oracle", time_us=5321.4),
               _row(backend="torch_compile", ok=False,
                    note="mismatch: AssertionError: " + "x" * 200)]
    records += [_row(backend="flashinfer", ok=None, note=refused,
                     op=op, tokens=t, hidden=7168) for op in ("nvfp4_linear", "mxfp8")
                for t in (16, 8192)]
    records += [_row("dispatch", backend=b, note="", time_us=84.0, **dispatch)
                for b in ("triton", "flashinfer", "flashinfer_one_sided", "triton_overlap")]
    records.append(_row("dispatch", backend="triton_fused", ok=None,
                        note="not run: the fused row needs nvfp4", **dispatch))
    records.append(_row("permute", backend="*", ok=None,
                        note="skipped: --budget spent; run it alone with --stages permute "
                             "--tokens 8192", op="gather_rows", tokens=8192))
    judge_targets(records)
    add_speedups(records)
    for with_targets in (False, True):
        text = report.format_table(records, GPU_META, with_targets=with_targets)
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= 120, max(lines, key=len)
        assert "timed: a very long" in text and long_note not in text  # cut, not lost
        assert "--budget spent" in text  # a row that can run is never summarised away
        summary = [line for line in lines if line.startswith("n/a here")]
        assert summary and "5 rows" in summary[0]
        assert any("quantize flashinfer x 4: FlashInfer's fp4/mx quantize kernels are compiled "
                   "only for SM100+" in line for line in lines)
        assert any("dispatch triton_fused x 1: the fused row needs nvfp4" in line
                   for line in lines)
        assert not any(line.lstrip().startswith("flashinfer ") and "n/a" in line
                       for line in lines)
    assert any(line.startswith("  PASS") and "<= 40 us" in line for line in lines)
    markdown = report.format_markdown(records, GPU_META, with_targets=True)
    assert long_note in markdown and refused in markdown  # the files keep every row in full
    assert sum(line.startswith("| ") for line in markdown.splitlines()) == len(records) + 1


def test_csv_rows_under_flashinfer_column_names(tmp_path):
    # FlashInfer's benchmark CSV names, written out here (benchmarks/routines/
    # flashinfer_benchmark_utils.py); times in ms, bandwidth in TB/s.
    flashinfer = ["routine", "median_time", "std_time", "tb_per_sec", "backend", "num_tokens",
                  "hidden_size", "num_experts", "top_k", "ep_size", "input_dtype", "quant_dtype"]
    dispatch = dict(quant="nvfp4", tokens=16, hidden=7168, experts=32, top_k=8,
                    routing="uniform")
    records = [_row(), _row("dispatch", backend="flashinfer_one_sided", ok=None,
                            note="not run: bf16 only", **dispatch),
               _row("prepare", scope="local", ep_size=8, tokens=16, experts=256, top_k=8,
                    routing="skewed")]
    path = report.write_csv(records, str(tmp_path / "sub" / "rows.csv"))
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[:len(flashinfer)] == flashinfer
    quantize, one_sided, prepare = rows
    assert quantize["routine"] == "quantize_nvfp4_linear" and quantize["backend"] == "triton"
    assert float(quantize["median_time"]) == pytest.approx(0.0125)  # 12.5 us
    assert float(quantize["std_time"]) == pytest.approx(0.00025)
    assert float(quantize["tb_per_sec"]) == pytest.approx(12.0377)
    assert (quantize["num_tokens"], quantize["hidden_size"], quantize["num_experts"]) == \
        ("8192", "7168", "")
    assert quantize["input_dtype"] == "torch.bfloat16" and quantize["quant_dtype"] == "nvfp4"
    assert one_sided["routine"] == "dispatch" and one_sided["median_time"] == ""
    assert (one_sided["ep_size"], one_sided["quant_dtype"], one_sided["ok"]) == \
        ("2", "nvfp4", "n/a")
    assert one_sided["case_tag"] == "routing=uniform" and one_sided["note"] == "not run: bf16 only"
    assert prepare["routine"] == "prepare_local" and prepare["ep_size"] == "8"


def test_readme_from_refuses_interpreter_results(tmp_path):
    readme = tmp_path / "README.md"
    text = f"intro\n{report.README_START}\nold\n{report.README_END}\nend\n"
    readme.write_text(text)
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"meta": dict(GPU_META, gpu="cpu (Triton interpreter)",
                                            interpreter=True), "records": [_row()]}))
    with pytest.raises(SystemExit, match="interpreter-mode result"):
        report.update_readme(str(readme), [str(cpu)])
    nothing = tmp_path / "nothing.json"
    nothing.write_text(json.dumps({"meta": dict(GPU_META, num_gpus=1),
                                   "records": [_row(tokens=5, hidden=64, op="mxfp8")]}))
    with pytest.raises(SystemExit, match="no row for the headline"):
        report.update_readme(str(readme), [str(nothing)])
    assert readme.read_text() == text  # untouched
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"meta": GPU_META, "records": [_row()]}))
    report.update_readme(str(readme), [str(gpu)])
    assert "PASS: NVFP4 [8192,7168] <= 40 us" in readme.read_text()


def test_bytes_formulas_by_hand():
    # NVFP4 [8192, 7168]: 2*M*H read + M*H/2 + M*H/16 written = 2.5625 * 58,720,256.
    assert QUANTIZE.traffic(dict(op="nvfp4_linear", tokens=8192, hidden=7168)) == \
        {"local": 150_470_656}
    # MXFP8: 2*M*H + M*H + M*H/32 = 3.03125 * 58,720,256.
    assert QUANTIZE.traffic(dict(op="mxfp8", tokens=8192, hidden=7168)) == {"local": 177_995_776}
    # Swizzled NVFP4 [33, 256]: 16,896 + 4,224 + scales padded to 128 x 16 = 2,048.
    assert QUANTIZE.traffic(dict(op="nvfp4_swizzled", tokens=33, hidden=256)) == \
        {"local": 23_168}
    # gather_rows [65536, 7168] bf16: read + write 65536 rows of 14,336 bytes + the row index;
    # from HBM at least the 8192 token rows once + 65536 rows written + the row index.
    assert PERMUTE.traffic(dict(op="gather_rows", tokens=8192, hidden=7168, experts=256,
                                top_k=8, routing="uniform")) == \
        {"local": 1_879_310_336, "hbm_local": 1_057_226_752}
    # DeepSeek-V3 routing T=8192 E=256 k=8: logits 8,388,608 + bias 1,024 + ids/weights 524,288.
    assert ROUTING.traffic(dict(method="deepseek_v3", tokens=8192, experts=256, top_k=8,
                                routing="uniform")) == {"local": 8_913_920}


def test_percent_of_limit_and_speedups():
    limits = {"hbm_gbps": 4000.0, "nvlink_gbps": 400.0}
    # 4 MB at 4000 GB/s = 1 us ideal; measured 2 us -> 50 %.
    assert percent_of_limit(4_000_000, 0, 2.0, limits) == pytest.approx(50.0)
    # + 0.4 MB remote at 400 GB/s = 1 us more; 2 us ideal in 4 us -> 50 %.
    assert percent_of_limit(4_000_000, 400_000, 4.0, limits) == pytest.approx(50.0)
    assert percent_of_limit(1, 1, 1.0, {"hbm_gbps": 1.0}) is None  # no NVLink measured
    rows = [dict(stage="s", shape={"t": 1}, backend=b, time_us=t)
            for b, t in (("triton", 10.0), ("flashinfer", 30.0), ("flashinfer_one_sided", 20.0),
                         ("torch", 50.0))]
    add_speedups(rows)
    triton = rows[0]
    assert triton["speedup_vs_flashinfer"] == pytest.approx(2.0)  # best FlashInfer row: 20 us
    assert triton["speedup_vs_torch"] == pytest.approx(5.0)


def test_targets_pass_and_fail():
    def row(time_us, backend="triton", gbps=None):
        return dict(stage="quantize", backend=backend, time_us=time_us, gbps=gbps,
                    shape=dict(op="nvfp4_linear", tokens=8192, hidden=7168))
    fast, slow, untimed = row(39.0), row(41.0), row(None)
    judge_targets([fast, slow, untimed])
    assert fast["target_pass"] is True and slow["target_pass"] is False
    assert untimed["target_pass"] is None and "40 us" in fast["target"]
    routing = [dict(stage="routing", backend=b, time_us=t, gbps=None,
                    shape=dict(method="deepseek_v3", tokens=8192, experts=256, top_k=8,
                               routing="uniform")) for b, t in (("triton", 8.0),
                                                                ("flashinfer", 10.0))]
    judge_targets(routing)
    assert routing[0]["target_pass"] is True  # 8 <= 0.8 * 10
    assert "target" not in routing[1]
    stale = dict(routing[1], target="an older target", target_pass=False)  # from a JSON
    judge_targets([stale])
    assert "target" not in stale and "target_pass" not in stale


def test_absolute_bounds_judged_on_their_gpu_only():
    """A time bound set on the H200 is judged on rows timed on an H200 (or of no recorded GPU)
    and not judged elsewhere, with the reason in the text; a bound relative to FlashInfer's
    row of the same run is judged on any GPU. The terminal table says "not judged"."""
    def quantize(time_us, gpu):
        return dict(stage="quantize", backend="triton", time_us=time_us, gbps=None, gpu=gpu,
                    shape=dict(op="nvfp4_linear", tokens=8192, hidden=7168))
    on_h200, on_h100 = quantize(41.0, "NVIDIA H200"), quantize(41.0, "NVIDIA H100 80GB HBM3")
    judge_targets([on_h200, on_h100])
    assert on_h200["target_pass"] is False and "not judged" not in on_h200["target"]
    assert on_h100["target_pass"] is None
    assert on_h100["target"].endswith("(a bound for an H200: not judged on NVIDIA H100 80GB "
                                      "HBM3)"), on_h100["target"]
    routing = [dict(stage="routing", backend=b, time_us=t, gbps=None, gpu="NVIDIA H100 80GB HBM3",
                    shape=dict(method="deepseek_v3", tokens=8192, experts=256, top_k=8,
                               routing="uniform")) for b, t in (("triton", 9.0),
                                                                ("flashinfer", 10.0))]
    judge_targets(routing)
    assert routing[0]["target_pass"] is False  # 9 > 0.8 * 10, on any GPU
    assert "not judged" not in routing[0]["target"]
    on_h100.update(note="", bytes=1, p20_us=41.0, p80_us=41.0, pct_of_limit=None,
                   remote_bytes=0, ok=True)
    header, rows = report.table_rows([on_h100], with_targets=True)
    assert rows[0][header.index("target")].startswith("not judged: NVFP4 [8192,7168]")


def test_transport_targets_pair_sum_and_best_flashinfer():
    """dispatch + combine at T=16 judged on their sum; every dispatch/combine row against the
    faster of FlashInfer's two transports; a row under several targets fails if one does."""
    def shape(tokens, quant=None):
        return dict(tokens=tokens, hidden=7168, experts=32, top_k=8, routing="uniform",
                    **({"quant": quant} if quant else {}))

    def rows(stage, tokens, times, quant=None):
        return [dict(stage=stage, backend=b, time_us=t, gbps=None, shape=shape(tokens, quant))
                for b, t in zip(("triton", "flashinfer", "flashinfer_one_sided"), times)]
    small = (rows("dispatch", 16, (8.0, 9.0, 50.0), "bf16")
             + rows("combine", 16, (11.5, 46.0, 33.0)))
    big = (rows("dispatch", 2048, (85.0, 298.0, 84.0), "bf16")
           + rows("combine", 2048, (99.0, 1128.0, 136.0)))
    judge_targets(small + big)
    assert small[0]["target_pass"] is True  # 8 <= min(9, 50)
    assert small[3]["target_pass"] is True and "20 us together" in small[3]["target"]  # 19.5
    assert big[0]["target_pass"] is False  # <= 90 us holds, but 85 > the one-sided 84
    assert "<= 90 us" in big[0]["target"] and "best FlashInfer" in big[0]["target"]
    assert big[3]["target_pass"] is True  # 99 <= 100 and 99 <= 136
    slow_pair = (rows("dispatch", 16, (9.0, 9.0, 50.0), "bf16")
                 + rows("combine", 16, (11.5, 46.0, 33.0)))
    judge_targets(slow_pair)
    assert slow_pair[3]["target_pass"] is False  # 20.5 > 20
    lone = rows("combine", 16, (11.5, 46.0, 33.0))
    judge_targets(lone)
    assert lone[0]["target_pass"] is None  # no dispatch row to add


def test_target_shapes_are_in_the_default_and_deepseek_sweeps():
    from bench.decode import DECODE, DECODE_SWEEP
    from bench.ops import OPS
    from bench.stages import DEEPSEEK_SWEEP, DEFAULT_SWEEP, PREPARE, TRANSPORT_SWEEP
    from bench.targets import TARGETS
    from bench.transport import COMBINE, DISPATCH
    stages = {"quantize": QUANTIZE, "routing": ROUTING, "permute": PERMUTE, "prepare": PREPARE,
              "dispatch": DISPATCH, "combine": COMBINE, "decode": DECODE, "ops": OPS}
    # the transport sweep holds the transport's targets, the decode sweep the decode chain's
    own = {"dispatch": TRANSPORT_SWEEP, "combine": TRANSPORT_SWEEP, "decode": DECODE_SWEEP}
    for target in TARGETS:
        if target.stage in own:
            shapes = stages[target.stage].shapes(own[target.stage])
            assert any(all(s.get(k) == v for k, v in target.match.items()) for s in shapes), \
                target.text
    for sweep in (DEFAULT_SWEEP, DEEPSEEK_SWEEP):
        for target in TARGETS:
            if target.match.get("tokens") in (64, 256) and sweep is DEFAULT_SWEEP:
                continue  # the decode sizes T=64 and 256: the deepseek and decode sweeps' only
            shapes = stages[target.stage].shapes(sweep)
            assert any(all(s.get(k) == v for k, v in target.match.items()) for s in shapes), \
                target.text


def test_default_sweep_is_the_full_grid_and_deepseek_fits_one_gpu_call():
    # The full grid, written out again here (not read from the code under test).
    from bench.stages import DEEPSEEK_SWEEP, DEFAULT_SWEEP, SINGLE_DEVICE_STAGES
    from bench.transport import DISTRIBUTED_STAGES
    assert DEFAULT_SWEEP.tokens == (1, 16, 128, 512, 2048, 8192)
    assert set(DEFAULT_SWEEP.hidden) == {4096, 7168}
    assert set(DEFAULT_SWEEP.experts) == {64, 256}
    assert set(DEFAULT_SWEEP.top_k) == {4, 8}
    assert set(DEFAULT_SWEEP.routing) == {"uniform", "skewed"}
    assert parse_args([]).sweep == "default"
    # The deepseek sweep is sized to finish inside one GPU call's --budget; the default grid is
    # several times larger and stops at --budget.
    count = lambda sweep, stages: sum(len(s.shapes(sweep)) for s in stages)  # noqa: E731
    assert count(DEEPSEEK_SWEEP, SINGLE_DEVICE_STAGES) <= 130
    assert count(DEEPSEEK_SWEEP, DISTRIBUTED_STAGES) <= 105
    assert count(DEFAULT_SWEEP, SINGLE_DEVICE_STAGES) >= 3 * count(DEEPSEEK_SWEEP,
                                                                   SINGLE_DEVICE_STAGES)
    # 6 T x 2 H x 2 E x 2 k x 2 routings = 96 grid points per dispatch variant, plus the
    # Triton transport's target shapes (E=32 k=8 H=7168, T = 16 and 2048, bf16 and nvfp4).
    dispatch = next(s for s in DISTRIBUTED_STAGES if s.name == "dispatch")
    assert len(dispatch.shapes(DEFAULT_SWEEP)) == 96 * 2 + 2 * 2


def test_budget_skips_the_shapes_left_on_every_rank():
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu")
    records = run_stages([_cumsum_stage()], TINY, ctx, progress=False, deadline=time.time() - 1)
    assert len(records) == 2  # one row per shape, nothing run
    for r in records:
        assert r["ok"] is None and r["time_us"] is None
        assert r["note"] == f"skipped: --budget spent; run it alone with --stages cumsum " \
                            f"--tokens {r['shape']['tokens']}"


def test_fast_path_and_its_checked_twin_are_both_checked():
    """A sync-free timed call (``run``) and the same op with its checks (``checked``): a wrong
    answer from either fails the row; the note names the timed call."""
    def paths(inputs, shape, ctx):
        x = inputs["x"]
        right = lambda: x * 2  # noqa: E731
        return [Path("torch", run=right),
                Path("triton", run=right, checked=right, timed="timed: fast"),
                Path("flashinfer", run=right, checked=lambda: x * 3, timed="timed: fast"),
                Path("torch_compile", run=lambda: x * 3, checked=right, timed="timed: fast")]
    stage = Stage(name="double", keys=("tokens",),
                  build=lambda shape, device, ctx=None: {"x": torch.ones(shape["tokens"])},
                  paths=paths, check=lambda out, ref, inputs, shape: assert_same(out, ref),
                  traffic=lambda shape, inputs=None: {"local": 8}, dtype=lambda shape: "fp32")
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu")
    rows = {r["backend"]: r for r in run_stages([stage], TINY, ctx, progress=False)
            if r["shape"]["tokens"] == 3}
    assert rows["triton"]["ok"] is True and rows["triton"]["note"] == "timed: fast"
    assert rows["flashinfer"]["ok"] is False and rows["flashinfer"]["time_us"] is None
    assert rows["torch_compile"]["ok"] is False and rows["torch_compile"]["time_us"] is None


def test_one_plot_file(tmp_path):
    pytest.importorskip("matplotlib")
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu (Triton interpreter)")
    records = run_stages([_cumsum_stage()], TINY, ctx, progress=False)
    meta = report.make_meta(torch.device("cpu"), 1, {}, "python -m bench --test")
    written = report.write_results(records, meta, str(tmp_path), plots=True)
    assert [os.path.splitext(p)[1] for p in written] == [".json", ".md", ".png"]
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in written)


def test_cli_sweeps_tokens_and_budget():
    from bench.cli import deadline, pick_sweep
    from bench.stages import CPU_QUICK_SWEEP, DEEPSEEK_SWEEP, DEFAULT_SWEEP, QUICK_SWEEP
    args = parse_args(["--quick", "--tokens", "16,8192"])
    assert pick_sweep(args, on_gpu=True).tokens == (16, 8192)
    assert pick_sweep(args, on_gpu=True).hidden == QUICK_SWEEP.hidden
    assert pick_sweep(args, on_gpu=False).hidden == CPU_QUICK_SWEEP.hidden
    assert pick_sweep(parse_args(["--sweep", "deepseek"]), on_gpu=True) == DEEPSEEK_SWEEP
    assert pick_sweep(parse_args([]), on_gpu=True) == DEFAULT_SWEEP
    assert deadline(parse_args([]), on_gpu=False) is None
    assert deadline(parse_args(["--budget", "0"]), on_gpu=True) is None
    left = deadline(parse_args([]), on_gpu=True) - time.time()
    assert 390 < left <= 400
    with pytest.raises(SystemExit):
        parse_args(["--tokens", "16,x"])


def test_worker_is_importable_for_spawn():
    # torch.multiprocessing.spawn pickles the worker by module and name: not __main__.
    from bench.cli import gpu_worker
    assert gpu_worker.__module__ == "bench.cli"


# ---------------------------------------------------------------------------------------------
# On a GPU (subprocesses only: no CUDA-graph capture inside the pytest process)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_quick_bench_graph_times_the_capture_safe_paths(tmp_path):
    _, data = run_bench(["--quick", "--tokens", "16", "--stages", "routing,prepare,permute",
                         "--backends", "triton,torch", "--no-plots", "--budget", "0"], tmp_path,
                        cpu=False)
    rows = [r for r in data["records"] if r["backend"] == "triton"]
    assert rows
    for r in rows:
        assert r["ok"] is not False, r
        if r["ok"] and "host-sync" not in r["note"]:
            assert r["timing"] == "cuda_graph", r  # declared capture-safe, and it was


@pytest.mark.gpu
def test_gpu_kernel_times_name_the_kernels(tmp_path):
    """--kernel-times: each timed GPU row carries its kernels' device time per call."""
    _, data = run_bench(["--quick", "--tokens", "16", "--stages", "routing",
                         "--backends", "triton", "--no-plots", "--budget", "0",
                         "--kernel-times"], tmp_path, cpu=False)
    rows = [r for r in data["records"] if r["backend"] == "triton" and r["ok"]]
    assert rows
    for r in rows:
        assert any("route_topk" in name and us > 0 for name, us in r["kernels_us"].items()), r


def test_device_trace_detaches_cupti_when_its_session_stops(monkeypatch):
    """Every profile of the bench stops with TEARDOWN_CUPTI=1 in the environment (Kineto reads
    it then): a session must not leave CUPTI attached to slow the timings after it."""
    import torch.profiler
    from bench import timing
    seen = {}

    class Recorder:
        def __init__(self, activities):
            seen["activities"] = activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen["at_stop"] = os.environ.get("TEARDOWN_CUPTI")
            return False

    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.setattr(torch.profiler, "profile", Recorder)
    with timing.device_trace() as trace:
        assert isinstance(trace, Recorder)
    assert seen == {"activities": [torch.profiler.ProfilerActivity.CUDA], "at_stop": "1"}


def test_kernel_times_flag_parses():
    assert parse_args(["--kernel-times"]).kernel_times and not parse_args([]).kernel_times


@pytest.mark.gpu
def test_gpu_failed_capture_is_cleaned_up():
    """A path that syncs on the host cannot be captured: the graph timer must end the
    capture, fall back to eager timing and leave torch's CUDA random generator usable."""
    script = (
        "import torch\n"
        "from bench.timing import time_gpu\n"
        "x = torch.ones(1024, device='cuda')\n"
        "t = time_gpu(lambda: x.sum().item(), graph=True)\n"
        "assert t.method == 'eager_l2_flushed' and 'capture failed' in t.remark, t\n"
        "torch.randint(0, 10, (8,), device='cuda')\n"
        "torch.randn(8, device='cuda')\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    y = torch.rand(8, device='cuda')\n"
        "g.replay(); torch.cuda.synchronize()\n"
        "print('clean')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-3000:]


@pytest.mark.multigpu
def test_two_gpu_bench_spawns_its_workers(tmp_path):
    _, data = run_bench(["--gpus", "2", "--quick", "--tokens", "16", "--stages",
                         "prepare,dispatch", "--no-plots", "--budget", "0"], tmp_path, cpu=False)
    dispatch = [r for r in data["records"] if r["stage"] == "dispatch"]
    assert dispatch and all(r["num_gpus"] == 2 for r in dispatch)
    assert not any(r["ok"] is False for r in dispatch if r["backend"] == "triton"), dispatch


def test_skewed_routing_is_skewed_and_distinct():
    ids, weights = make_topk(512, 16, 4, "skewed", torch.device("cpu"))
    counts = torch.bincount(ids.flatten().long(), minlength=16)
    assert counts[0] > 3 * counts[15]
    assert all(len(set(row.tolist())) == 4 for row in ids)
    torch.testing.assert_close(weights.sum(1), torch.ones(512))


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        parse_args(["--stages", "routing,nope"])
    with pytest.raises(SystemExit):
        parse_args(["--backends", "cuda"])
    args = parse_args(["--stages", "quantize", "--backends", "triton,torch_compile"])
    assert args.stage_list == ["quantize"] and args.backend_set == {"triton", "torch_compile"}


# ---------------------------------------------------------------------------------------------
# FlashInfer's routing: the documented near-tie tolerance (bench/near_ties.py)
# ---------------------------------------------------------------------------------------------

def _deepseek_routing_case(tokens=1000, experts=16, top_k=4):
    """Random logits except row 0, where every expert ties (zero bias): any id set is a
    near-tie there. Returns (out, ref, inputs, shape) for the routing checks, out = the
    oracle's (ids, weights) copied."""
    from kernels.reference import route_topk
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[0] = 0.25
    options = dict(bias=torch.zeros(experts), num_groups=8, topk_groups=4, routed_scaling=2.5)
    shape = dict(method="deepseek_v3", tokens=tokens, experts=experts, top_k=top_k,
                 routing="uniform")
    ref = route_topk(logits, top_k, "deepseek_v3", **options)
    out = (ref[0].clone(), ref[1].clone())
    return out, ref, dict(logits=logits, options=options), shape


def _other_set(row: torch.Tensor, experts: int) -> torch.Tensor:
    """The same row with its first id replaced by an expert it does not hold."""
    unused = [e for e in range(experts) if e not in row.tolist()]
    row = row.clone()
    row[0] = unused[0]
    return row


def test_flashinfer_routing_check_allows_rare_near_ties_only():
    from bench.stages import check_routing, check_routing_near_ties
    out, ref, inputs, shape = _deepseek_routing_case()
    assert check_routing_near_ties(out, ref, inputs, shape) == ""
    out[0][0] = _other_set(out[0][0], 16)  # the all-tie row picks another set
    note = check_routing_near_ties(out, ref, inputs, shape)
    assert note.startswith("1 near-tie row")
    with pytest.raises(AssertionError, match="ids"):
        check_routing(out, ref, inputs, shape)  # the Triton path's check stays exact
    # A row without a near-tie must not differ.
    out, ref, inputs, shape = _deepseek_routing_case()
    out[0][5] = _other_set(out[0][5], 16)
    with pytest.raises(AssertionError, match="without a near-tie"):
        check_routing_near_ties(out, ref, inputs, shape)
    # Near-ties, but more than 0.1% of the rows (2 of 1000).
    out, ref, inputs, shape = _deepseek_routing_case()
    inputs["logits"][1] = 0.25
    out[0][0] = _other_set(out[0][0], 16)
    out[0][1] = _other_set(out[0][1], 16)
    with pytest.raises(AssertionError, match="more than"):
        check_routing_near_ties(out, ref, inputs, shape)
    # Weights are still compared on the rows whose sets agree.
    out, ref, inputs, shape = _deepseek_routing_case()
    out[1][7, 0] += 0.01
    with pytest.raises(AssertionError, match="weights"):
        check_routing_near_ties(out, ref, inputs, shape)


def test_only_flashinfer_deepseek_routing_gets_the_tolerance():
    from bench.stages import check_routing_near_ties, routing_inputs
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu")
    for method in ("deepseek_v3", "softmax_topk"):
        shape = dict(method=method, tokens=4, experts=16, top_k=4, routing="uniform")
        inputs = routing_inputs(shape, torch.device("cpu"))
        paths = {p.backend: p for p in ROUTING.paths(inputs, shape, ctx)}
        assert paths["triton"].check is None
        assert paths["flashinfer"].check is (check_routing_near_ties
                                             if method == "deepseek_v3" else None)


# ---------------------------------------------------------------------------------------------
# The layer (its paths need 2 GPUs; its oracle pipeline and check run here)
# ---------------------------------------------------------------------------------------------

class _Rank:
    def __init__(self, rank, world_size=2):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")


@pytest.mark.parametrize("payload", ["bf16", "nvfp4"])
def test_layer_oracle_pipeline_and_check(payload):
    from bench.transport import LAYER
    from bench.transport import layer_build as _layer_build
    from bench.transport import layer_check as _layer_check
    from bench.transport import sort_segments_by_content as _canonical_rows
    from kernels.reference import dequantize_nvfp4, quantize_nvfp4, route_topk
    shape = dict(payload=payload, tokens=6, hidden=64, experts=16, top_k=4, routing="skewed")
    assert shape in LAYER.shapes(Sweep(tokens=(6,), hidden=(64,), experts=(16,), top_k=(4,),
                                       routing=("skewed",)))
    for rank in (0, 1):
        inputs = _layer_build(shape, torch.device("cpu"), _Rank(rank))
        expected = inputs["expected"]
        # Identity experts: the layer returns each token's (decoded) row times the sum of its k
        # weights, up to bf16 rounding.
        x = inputs["xs"][rank]
        if payload == "nvfp4":
            x = dequantize_nvfp4(*quantize_nvfp4(x, inputs["global_scale"]),
                                 inputs["global_scale"], dtype=torch.bfloat16)
        _, weights = route_topk(inputs["logits"], 4, "deepseek_v3", bias=inputs["bias"],
                                num_groups=8, topk_groups=4, routed_scaling=2.5)
        assert_same(expected["out"], (x.float() * weights.sum(1, keepdim=True)).bfloat16())
        assert len(expected["received"]) == (2 if payload == "nvfp4" else 1)
        total = int(inputs["plans"][rank].total_recv)
        assert total > 0 and expected["rows"].shape == (total, 64)
        _layer_check(expected, None, inputs, shape)  # the oracle passes its own check
        # A segment in another order (FlashInfer's atomic order) still passes ...
        ends = inputs["plans"][rank].recv_rank_count_cumsum.tolist()
        order = torch.cat([torch.arange(end - 1, start - 1, -1)
                           for start, end in zip([0] + ends[:-1], ends)])
        assert not torch.equal(order, torch.arange(total))
        shuffled = tuple(p[order] for p in expected["received"] + (expected["rows"],))
        again = _canonical_rows(shuffled, inputs["plans"][rank].recv_rank_count_cumsum)
        _layer_check(dict(expected, received=again[:-1], rows=again[-1]), None, inputs, shape)
        # ... rows out of order (not canonicalized) do not.
        moved = tuple(p.flip(0) for p in expected["received"] + (expected["rows"],))
        with pytest.raises(AssertionError, match="received"):
            _layer_check(dict(expected, received=moved[:-1], rows=moved[-1]), None, inputs,
                         shape)
        # ... one changed byte of a received row does not.
        broken = expected["received"][0].clone()
        broken.view(torch.uint8)[0, 0] ^= 1
        with pytest.raises(AssertionError, match="received"):
            _layer_check(dict(expected, received=(broken,) + expected["received"][1:]), None,
                         inputs, shape)
        with pytest.raises(AssertionError, match="layer output"):
            _layer_check(dict(expected, out=expected["out"] + 1), None, inputs, shape)


def test_layer_uses_the_triton_transport_on_cuda():
    # The stage switch lists the Triton transport on CUDA (no GPU needed to ask it).
    from bench.transport import layer_choice as _layer_choice
    choice = _layer_choice("triton", torch.device("cuda", 0))
    assert choice == dict(routing="triton", prepare="triton", quantize="triton",
                          transport="triton", permute="triton")
    # On CPU the cross-rank stages fall back (the layer then runs on no row: it needs 2 GPUs).
    assert _layer_choice("torch", torch.device("cpu"))["transport"] == "torch"


@pytest.mark.multigpu
def test_two_gpu_layer_rows_check_both_payloads(tmp_path):
    _, data = run_bench(["--gpus", "2", "--quick", "--tokens", "16", "--stages", "layer",
                         "--no-plots", "--budget", "0"], tmp_path, cpu=False)
    layer = [r for r in data["records"] if r["stage"] == "layer"]
    for payload in ("bf16", "nvfp4"):
        rows = {r["backend"]: r for r in layer if r["shape"].get("payload") == payload}
        assert rows["triton"]["ok"] is True and rows["torch"]["ok"] is True, rows
        assert rows["flashinfer"]["ok"] is not False, rows["flashinfer"]


def test_canonical_plan_orders_equal_id_rows_by_weight():
    """FlashInfer's receive segments come in atomic order. Rows with the same ids (common under
    skewed routing) differ in their weights, so the canonical order sorts by the whole row:
    a plan with such rows swapped canonicalizes equal, one with a changed weight does not."""
    import dataclasses

    from bench.transport import canonical_plan as _canonical_plan
    from kernels.reference import simulate_alltoall
    ids = [torch.tensor([[0, 1], [0, 1], [2, 3], [0, 1]], dtype=torch.int32),
           torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)]
    weights = [torch.tensor([[0.1, 0.9], [0.7, 0.3], [0.5, 0.5], [0.2, 0.8]]),
               torch.tensor([[0.6, 0.4], [0.3, 0.7]])]
    plan = simulate_alltoall(ids, weights, 4, 4)[0]
    want = _canonical_plan(plan)
    end = int(plan.recv_rank_count_cumsum[0])  # rank 0's own rows: ids (0, 1) three times
    assert end == 3 and bool((plan.recv_expert_ids[:end] == plan.recv_expert_ids[0]).all())
    order = torch.tensor([2, 0, 1] + list(range(3, plan.recv_weights.shape[0])))
    swapped = dataclasses.replace(plan, recv_expert_ids=plan.recv_expert_ids[order],
                                  recv_weights=plan.recv_weights[order])
    for name, value in _canonical_plan(swapped).items():
        assert torch.equal(value, want[name]), name
    changed = plan.recv_weights.clone()
    changed[1, 0] += 0.25
    got = _canonical_plan(dataclasses.replace(plan, recv_weights=changed))
    assert not torch.equal(got["recv_weights"], want["recv_weights"])


@pytest.mark.parametrize("variant", FLOOR_VARIANTS)
def test_traffic_floor_moves_nvfp4_bytes(device, variant):
    """bench.floor's yardstick writes NVFP4's byte counts: per 16-element block, the 4 low
    halves of (first 4 words ^ last 4 words) and the low byte of their max."""
    x = torch.randn(3, 192, device=device).to(torch.bfloat16)
    out, scales = nvfp4_traffic(x, variant)
    words = x.view(torch.int32).view(3, 12, 2, 4)
    mixed = words[:, :, 0] ^ words[:, :, 1]
    assert out.shape == (3, 96) and scales.shape == (3, 12)
    assert torch.equal(out.view(torch.int16).view(3, 12, 4), mixed.to(torch.int16))
    assert torch.equal(scales, (mixed.amax(dim=2) & 0xFF).to(torch.uint8))


def test_tune_rotating_outputs_cycle_and_stay_exact(device):
    """bench.tune's rotating NVFP4 call writes each call into the next of its output buffers
    (4 on CPU, where the L2 size stands in as one output) and every call equals the oracle."""
    from bench.tune import rotating_nvfp4
    from kernels import reference as R
    from kernels.quantize import DEFAULT_NVFP4
    x = torch.randn(130, 64, device=device).to(torch.bfloat16)
    gs = R.nvfp4_global_scale(x)
    call = rotating_nvfp4(x, gs, "swizzled_128x4", DEFAULT_NVFP4)
    outs = [call() for _ in range(5)]
    want = R.quantize_nvfp4(x, gs, layout="swizzled_128x4")
    pointers = [out[0].data_ptr() for out in outs]
    assert len(set(pointers)) >= 2 and pointers[0] != pointers[1]
    for out in outs:
        assert all(torch.equal(a, b) for a, b in zip(out, want))


def _record_nvtx(monkeypatch) -> list:
    """The names pushed as NVTX ranges from now on (torch's range_push, still called on a GPU)."""
    pushed = []
    push = torch.cuda.nvtx.range_push

    def record(name):
        pushed.append(name)
        return push(name) if torch.cuda.is_available() else 0
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", record)
    return pushed


@pytest.mark.gpu
def test_gpu_stage_calls_carry_nvtx_ranges(monkeypatch):
    """Every path's check and timing runs inside an NVTX range named stage, shape and path:
    the names a profiler timeline shows."""
    pushed = _record_nvtx(monkeypatch)
    ctx = RunContext(device=torch.device("cuda"), gpu=torch.cuda.get_device_name())
    records = run_stages([_cumsum_stage()], TINY, ctx, progress=False)
    expected = [f"cumsum tokens={r['shape']['tokens']} {r['backend']}" for r in records]
    assert [name for name in pushed if name.startswith("cumsum ")] == expected


def test_no_nvtx_ranges_off_a_gpu(monkeypatch):
    pushed = _record_nvtx(monkeypatch)
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu")
    run_stages([_cumsum_stage()], TINY, ctx, progress=False)
    assert pushed == []


# ---------------------------------------------------------------------------------------------
# The ops stage (bench/ops.py): the eager call cost of the registered ops
# ---------------------------------------------------------------------------------------------

def test_ops_stage_shapes_are_t16_deepseek_r1_on_gpu_sweeps_and_one_tiny_shape_on_cpu():
    from bench.ops import OPS, OPS_DIMS
    from bench.stages import CPU_QUICK_SWEEP, DEEPSEEK_SWEEP
    from kernels.ops import OP_NAMES
    gpu = OPS.shapes(DEEPSEEK_SWEEP)
    assert [s["op"] for s in gpu] == list(OP_NAMES)
    assert all(dict(s, op=None) == dict(tokens=16, op=None, **OPS_DIMS) for s in gpu)
    cpu = OPS.shapes(CPU_QUICK_SWEEP)
    assert {(s["tokens"], s["hidden"], s["experts"], s["top_k"]) for s in cpu} == {(7, 128, 16, 4)}


@pytest.mark.parametrize("op", ["permute_by_expert", "quantize_nvfp4_out", "swizzle_scales"])
def test_ops_stage_rows_are_checked_against_the_torch_overload(op):
    from bench.ops import OPS, ROWS
    from bench.runner import run_shape
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu (Triton interpreter)")
    shape = dict(tokens=7, hidden=128, experts=16, top_k=4, op=op)
    records = {r["backend"]: r for r in run_shape(OPS, shape, ctx)}
    assert set(records) == set(ROWS) | {"torch"}
    for backend in ROWS:
        assert records[backend]["ok"] is True and records[backend]["time_us"], records[backend]


def test_ops_target_is_two_us_over_the_raw_launch():
    def row(backend, time_us, op="gather_rows"):
        return {"stage": "ops", "backend": backend, "time_us": time_us, "gbps": None,
                "shape": dict(tokens=16, hidden=7168, experts=256, top_k=8, op=op)}
    rows = [row("triton_raw", 5.0), row("triton_op", 7.0), row("triton_public", 5.5),
            row("triton_raw", 5.0, "route_topk"), row("triton_op", 7.5, "route_topk"),
            row("triton_public", 7.25, "route_topk")]
    judge_targets(rows)
    assert [rows[i]["target_pass"] for i in (1, 2, 4, 5)] == [True, True, False, False]
    assert "target" not in rows[0] and "target" not in rows[3]
    assert "public function <= raw launch + 2 us" in rows[2]["target"]
    from bench.targets import TARGETS
    from kernels.ops import OP_NAMES
    assert {t.match["op"] for t in TARGETS if t.stage == "ops"} == set(OP_NAMES)


@pytest.mark.gpu
def test_gpu_ops_stage_times_every_op_three_ways(tmp_path):
    from bench.ops import ROWS
    from kernels.ops import OP_NAMES
    _, data = run_bench(["--stages", "ops", "--sweep", "deepseek", "--targets", "--no-plots",
                         "--budget", "0"], tmp_path, cpu=False)
    rows = {(r["shape"]["op"], r["backend"]): r for r in data["records"]}
    for name in OP_NAMES:
        for backend in ROWS:
            r = rows[(name, backend)]
            assert r["ok"] is True and r["shape"]["tokens"] == 16, r
        assert rows[(name, "triton_op")]["target_pass"] is not None
        assert rows[(name, "triton_public")]["target_pass"] is not None


def test_ratio_target_reads_the_paired_times_where_the_row_has_them():
    """The compiled chain's target (<= 1.0 x the uncompiled chain) judges the two graphs timed
    in alternation (``paired_us``, bench.decode.paired_times) when the row carries them, else
    the two rows' own times."""
    def row(backend, time_us, paired=None):
        record = {"stage": "decode", "backend": backend, "time_us": time_us, "gbps": None,
                  "shape": dict(tokens=16, hidden=7168, experts=256, top_k=8,
                                payload="nvfp4", ep_size=1)}
        if paired is not None:
            record["paired_us"] = paired
        return record
    rows = [row("triton", 15.0), row("triton_compiled_graph", 18.0,
                                     {"triton_compiled_graph": 16.4, "triton": 16.5})]
    judge_targets(rows)
    assert rows[1]["target_pass"] is True  # 16.4 <= 16.5, though 18.0 > 15.0
    rows = [row("triton", 15.0), row("triton_compiled_graph", 14.0,
                                     {"triton_compiled_graph": 16.6, "triton": 16.5})]
    judge_targets(rows)
    assert rows[1]["target_pass"] is False  # 16.6 > 16.5, though 14.0 < 15.0
    rows = [row("triton", 15.0), row("triton_compiled_graph", 15.5)]
    judge_targets(rows)
    assert rows[1]["target_pass"] is False  # no pairing: the rows' own times
    # the decode chain pairs its rows at the token counts of the ratio targets
    from bench.decode import PAIRED_TOKENS
    from bench.targets import TARGETS
    assert {t.match["tokens"] for t in TARGETS if t.kind == "max_ratio_vs_backend"
            and t.stage == "decode"} == set(PAIRED_TOKENS)


def test_host_interleaved_timing_alternates_and_times_per_call():
    """bench.timing.time_host_interleaved: every function gets rounds x calls calls (plus one
    warm call), the order of each round reversed every other round; per-call times in us."""
    from bench.timing import time_host_interleaved
    seen = []
    fns = {name: (lambda name=name: seen.append(name)) for name in ("a", "b")}
    times = time_host_interleaved(fns, torch.device("cpu"), calls=3, rounds=4)
    assert set(times) == {"a", "b"} and all(t.method == "host_interleaved" for t in times.values())
    assert all(t.median_us >= 0 for t in times.values())
    assert seen == ["a", "b"] + ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3 \
        + ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
