"""The benchmark's machinery on CPU: the runner's check-before-time rule on a synthetic stage,
a --quick interpreter sweep of real stages, the JSON / Markdown writers, the bytes formulas and
the limit, speed-up and target arithmetic (numbers written out by hand)."""

import json

import pytest
import torch

from bench import report
from bench.__main__ import main, parse_args
from bench.runner import RunContext, add_speedups, percent_of_limit, run_stages
from bench.stages import (PERMUTE, QUANTIZE, ROUTING, Path, Stage, Sweep, Unavailable,
                          assert_same, make_path, make_topk)
from bench.targets import judge_targets

RECORD_KEYS = {"stage", "backend", "gpu", "num_gpus", "shape", "dtype", "time_us", "p20_us",
               "p80_us", "bytes", "local_bytes", "remote_bytes", "gbps", "pct_of_limit", "ok",
               "note", "timing"}
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
    def refuse():
        raise Unavailable("not available: refused")
    assert make_path("triton", refuse) == Path("triton", reason="not available: refused")
    path = make_path("triton", lambda: (lambda: 7))
    assert path.run() == 7 and path.reason == ""


def test_backend_filter_keeps_the_oracle_for_checking():
    ctx = RunContext(device=torch.device("cpu"), gpu="cpu")
    records = run_stages([_cumsum_stage()], TINY, ctx, backends={"flashinfer"}, progress=False)
    assert [r["backend"] for r in records] == ["flashinfer", "flashinfer"]
    assert all(r["ok"] is False for r in records)  # checked against the (hidden) oracle


def test_quick_cpu_sweep_of_real_stages(capsys):
    records = main(["--quick", "--stages", "routing,prepare", "--no-progress", "--no-plots"])
    out = capsys.readouterr().out
    assert "MEAN NOTHING" in out
    assert {r["stage"] for r in records} == {"routing", "prepare"}
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert r["gpu"] == "cpu (Triton interpreter)" and r["num_gpus"] == 1
        # On CPU a path is either checked and right, or listed with the reason it cannot run;
        # a mismatch or an error of a real kernel fails this test.
        assert r["ok"] is not False, r
        assert (r["ok"] is None) == bool(r["note"].startswith(("not available", "not checked"))), r


def test_real_oracles_are_checked_once_written():
    reference = pytest.importorskip("kernels.reference")
    if not hasattr(reference, "route_topk"):
        pytest.skip("kernels.reference.route_topk is not on this branch yet")
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


def test_bytes_formulas_by_hand():
    # NVFP4 [8192, 7168]: 2*M*H read + M*H/2 + M*H/16 written = 2.5625 * 58,720,256.
    assert QUANTIZE.traffic(dict(op="nvfp4_linear", tokens=8192, hidden=7168)) == \
        {"local": 150_470_656}
    # MXFP8: 2*M*H + M*H + M*H/32 = 3.03125 * 58,720,256.
    assert QUANTIZE.traffic(dict(op="mxfp8", tokens=8192, hidden=7168)) == {"local": 177_995_776}
    # Swizzled NVFP4 [33, 256]: 16,896 + 4,224 + scales padded to 128 x 16 = 2,048.
    assert QUANTIZE.traffic(dict(op="nvfp4_swizzled", tokens=33, hidden=256)) == \
        {"local": 23_168}
    # gather_rows [65536, 7168] bf16: read + write 65536 rows of 14,336 bytes + the row index.
    assert PERMUTE.traffic(dict(op="gather_rows", tokens=8192, hidden=7168, experts=256,
                                top_k=8, routing="uniform")) == {"local": 1_879_310_336}
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


def test_target_shapes_are_in_the_full_sweep():
    from bench.stages import DEFAULT_SWEEP, PREPARE
    from bench.targets import TARGETS
    stages = {"quantize": QUANTIZE, "routing": ROUTING, "permute": PERMUTE, "prepare": PREPARE}
    for target in TARGETS:
        shapes = stages[target.stage].shapes(DEFAULT_SWEEP)
        assert any(all(s.get(k) == v for k, v in target.match.items()) for s in shapes), \
            target.text


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
