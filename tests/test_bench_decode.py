"""The ``decode`` bench stage (bench/decode.py): its shapes, rows, check, bytes and targets on
CPU (the Triton chain in the interpreter on tiny shapes), and on a GPU the chain's CUDA graph
checked at every one of 100 replays with fresh routing.

Every GPU test runs in a subprocess, as tests/test_bench.py's do (no CUDA-graph capture inside
the pytest process)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from bench.cli import ALL_STAGES, BACKEND_NAMES, STAGE_NAMES, parse_args, pick_sweep
from bench.decode import (DECODE, DECODE_SWEEP, DecodeChain, check_chain, check_replays,
                          count_launches, decode_inputs, decode_traffic, oracle_chain,
                          oracle_steps, other_id_sets, after_routing, replay_inputs)
from bench.runner import RunContext, run_stages
from bench.stages import (CPU_QUICK_SWEEP, CPU_SWEEP, DEEPSEEK_SWEEP, DEFAULT_SWEEP, Path,
                          Stage, Sweep)
from bench.targets import BOUNDS_GPU, judge_targets
from kernels.hardware import interpreting
from tests.test_bench import BENCH_TIMEOUT_S, ROOT, run_bench

CPU = torch.device("cpu")
# The Triton chain on CPU tensors needs the interpreter; on a GPU machine (no TRITON_INTERPRET)
# the gpu-marked tests below run it on the GPU instead.
needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="runs the Triton chain on CPU tensors, which needs "
    "TRITON_INTERPRET=1 (set by conftest without a GPU); the gpu tests cover it here")
# The interpreter's grid for these tests: one shape per payload (its middle token count, 5).
TINY = Sweep(tokens=(3, 5, 9), hidden=(32,), experts=(16,), top_k=(4,), routing=("uniform",))


def tiny_shape(payload: str = "nvfp4", tokens: int = 5) -> dict:
    return dict(payload=payload, ep_size=1, tokens=tokens, hidden=32, experts=16, top_k=4)


# ---------------------------------------------------------------------------------------------
# Shapes and registration
# ---------------------------------------------------------------------------------------------

def test_decode_sweep_is_deepseek_r1_at_the_decode_token_counts():
    # Written out here, not read from the code under test.
    expected = [dict(payload=p, ep_size=1, tokens=t, hidden=7168, experts=256, top_k=8)
                for t in (1, 16, 64, 256, 2048) for p in ("nvfp4", "bf16")]
    assert DECODE.shapes(DECODE_SWEEP) == expected
    assert pick_sweep(parse_args(["--sweep", "decode"]), on_gpu=True) == DECODE_SWEEP
    only_16 = pick_sweep(parse_args(["--sweep", "decode", "--tokens", "16"]), on_gpu=True)
    assert DECODE.shapes(only_16) == [s for s in expected if s["tokens"] == 16]


def test_other_gpu_sweeps_keep_deepseek_r1_dims_and_their_token_counts():
    for sweep in (DEFAULT_SWEEP, DEEPSEEK_SWEEP):
        shapes = DECODE.shapes(sweep)
        assert {(s["hidden"], s["experts"], s["top_k"]) for s in shapes} == {(7168, 256, 8)}
        assert sorted({s["tokens"] for s in shapes}) == sorted(sweep.tokens)
        assert len(shapes) == 2 * len(sweep.tokens)


def test_interpreter_grids_run_one_tiny_shape_per_payload():
    for sweep, hidden in ((CPU_SWEEP, 256), (CPU_QUICK_SWEEP, 128)):
        assert DECODE.shapes(sweep) == [
            dict(payload=p, ep_size=1, tokens=7, hidden=hidden, experts=16, top_k=4)
            for p in ("nvfp4", "bf16")]
    assert DECODE.shapes(TINY) == [tiny_shape("nvfp4"), tiny_shape("bf16")]


def test_decode_is_a_registered_single_gpu_stage():
    assert "decode" in STAGE_NAMES and DECODE in ALL_STAGES and not DECODE.distributed
    assert "flashinfer_routing" in BACKEND_NAMES
    assert parse_args(["--stages", "decode", "--backends", "triton,flashinfer_routing"]
                      ).stage_list == ["decode"]


# ---------------------------------------------------------------------------------------------
# The stage on CPU: every row
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_rows() -> dict:
    """The stage's rows on TINY (both payloads), by backend and payload."""
    ctx = RunContext(device=CPU, gpu="cpu (Triton interpreter)")
    records = run_stages([DECODE], TINY, ctx, progress=False)
    return {(r["backend"], r["shape"]["payload"]): r for r in records}


@needs_interpreter
@pytest.mark.parametrize("payload", ["nvfp4", "bf16"])
def test_cpu_rows_check_the_triton_chain_and_say_why_flashinfer_cannot_run(cpu_rows, payload):
    assert {backend for backend, p in cpu_rows if p == payload} == {
        "triton", "triton_overlap", "triton_compiled", "triton_compiled_graph",
        "flashinfer_routing", "flashinfer", "torch"}
    overlapped = cpu_rows[("triton_overlap", payload)]
    assert overlapped["ok"] is None
    assert overlapped["note"].startswith("not available: the overlapped chain runs"), overlapped
    for backend in ("triton_compiled", "triton_compiled_graph"):
        compiled = cpu_rows[(backend, payload)]
        assert compiled["ok"] is None
        assert compiled["note"].startswith("not available: the compiled chain needs a GPU")
    triton = cpu_rows[("triton", payload)]
    # checked against the oracle (a mismatch would make ok False), then timed
    assert triton["ok"] is True and triton["time_us"] is not None, triton
    assert "check_ids/check_values=False" in triton["note"]
    assert triton["launches"] is None  # counted on a GPU only (the interpreter launches nothing)
    assert cpu_rows[("torch", payload)]["ok"] is True
    routing = cpu_rows[("flashinfer_routing", payload)]
    assert routing["ok"] is None and routing["note"].startswith("not available: FlashInfer")
    whole = cpu_rows[("flashinfer", payload)]
    assert whole["ok"] is None
    assert whole["note"].startswith("not available: FlashInfer has no standalone permutation")
    for step in ("global scale: FlashInfer has no standalone NVFP4 global-scale op",
                 "NVFP4 quantize: FlashInfer's fp4/mx quantize kernels are compiled only for "
                 "SM100+", "permutation: "):
        assert step in whole["note"], whole["note"]
    shape = tiny_shape(payload)
    assert triton["bytes"] == decode_traffic(shape)["local"]
    assert triton["hbm_bytes"] == decode_traffic(shape)["hbm_local"]


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------

def _flip_first(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its first element changed (one bit for bytes, +1 for ints, +0.5
    for floats)."""
    t = t.clone()
    flat = t.view(-1)
    if t.dtype == torch.uint8:
        flat[0] ^= 1
    elif t.dtype.is_floating_point:
        flat[0] += 0.5
    else:
        flat[0] += 1
    return t


@pytest.mark.parametrize("payload", ["nvfp4", "bf16"])
def test_check_names_every_step_that_differs(payload):
    shape = tiny_shape(payload)
    inputs = decode_inputs(shape, CPU)
    ref = oracle_chain(inputs, shape)
    assert check_chain(ref, ref, inputs, shape) == ""
    ids = ref.topk_ids.clone()
    ids[0, [0, 1]] = ids[0, [1, 0]]  # the same set, another order
    plan = dataclasses.replace(ref.plan, expert_counts=_flip_first(ref.plan.expert_counts))
    permutation = dataclasses.replace(ref.permutation,
                                      inverse=_flip_first(ref.permutation.inverse))
    wrong = {
        "topk_ids": dict(topk_ids=ids),
        "topk_weights": dict(topk_weights=ref.topk_weights + 1e-3),  # > the routing tolerance
        "plan.expert_counts": dict(plan=plan),
        "global_scale": dict(global_scale=torch.nextafter(ref.global_scale,
                                                          2 * ref.global_scale)),
        "packed": dict(packed=_flip_first(ref.packed)),
        "scales": dict(scales=_flip_first(ref.scales)),
        "permutation.inverse": dict(permutation=permutation),
        "gathered": dict(gathered=(_flip_first(ref.gathered[0]),) + ref.gathered[1:]),
        "out": dict(out=_flip_first(ref.out)),
    }
    if payload == "nvfp4":  # the gathered scales too
        wrong["gathered nvfp4 rows[1]"] = dict(gathered=(ref.gathered[0],
                                                         _flip_first(ref.gathered[1])))
    for part, change in wrong.items():
        with pytest.raises(AssertionError, match=part.replace("[", r"\[")):
            check_chain(dataclasses.replace(ref, **change), ref, inputs, shape)


def _near_tie_inputs(shape: dict) -> dict:
    """Inputs whose token 0 ties experts 4 and 6 for its 4th pick (same logit in two kept
    groups, no bias): the oracle takes 4 (the smaller id), another kernel may take 6."""
    inputs = decode_inputs(shape, CPU)
    row = torch.full((shape["experts"],), -5.0)
    row[:8] = torch.tensor([3.0, 2.9, 2.8, 1.0, 2.7, 1.5, 2.7, 1.4])
    inputs["logits"][0] = row
    inputs["options"] = dict(inputs["options"], bias=torch.zeros(shape["experts"]))
    return inputs


def test_check_follows_the_paths_own_routing_past_a_near_tie():
    # 1000 tokens: one differing row is within FlashInfer's allowance (0.1% of the rows).
    shape = dict(tiny_shape("nvfp4", tokens=1000))
    inputs = _near_tie_inputs(shape)
    ref = oracle_chain(inputs, shape)
    assert ref.topk_ids[0].tolist() == [0, 1, 2, 4]
    ids = ref.topk_ids.clone()
    ids[0, 3] = 6  # the other side of the tie, with the same weight
    other = after_routing(oracle_steps(), shape, ids, ref.topk_weights, inputs["x"],
                          inputs["expert_out"])
    assert "near-tie" in check_chain(other, ref, inputs, shape, near_ties=True)
    assert other_id_sets(other, ref) == 1
    # Across CUDA-graph replays the allowance is shared: none left, the row fails.
    check_chain(other, ref, inputs, shape, near_ties=True, near_tie_rows=1)
    with pytest.raises(AssertionError, match="more than the 0 rows left"):
        check_chain(other, ref, inputs, shape, near_ties=True, near_tie_rows=0)
    with pytest.raises(AssertionError, match="topk_ids"):  # exact for the Triton chain
        check_chain(other, ref, inputs, shape)
    # The later steps are judged on the path's own routing: the oracle's plan and
    # permutation (made from the other ids) do not pass.
    stale = dataclasses.replace(other, plan=ref.plan, permutation=ref.permutation)
    with pytest.raises(AssertionError, match="plan"):
        check_chain(stale, ref, inputs, shape, near_ties=True)


# ---------------------------------------------------------------------------------------------
# Replays with fresh inputs (eagerly here; the CUDA graph's replays on the GPU below)
# ---------------------------------------------------------------------------------------------

def test_replays_load_fresh_inputs_check_each_and_restore_the_originals():
    shape = tiny_shape("nvfp4")
    inputs = decode_inputs(shape, CPU)
    fresh = replay_inputs(inputs, shape, 1)
    assert not torch.equal(fresh["logits"], inputs["logits"])
    assert not torch.equal(fresh["x"], inputs["x"])
    assert torch.equal(replay_inputs(inputs, shape, 1)["logits"], fresh["logits"])  # seeded
    chain = DecodeChain(oracle_steps(), inputs, shape)
    assert check_replays(chain, chain, inputs, 3) == 0
    assert torch.equal(chain.logits, inputs["logits"]) and torch.equal(chain.x, inputs["x"])
    # Outputs that do not follow the new inputs (a graph replaying stale buffers) fail.
    first = chain()
    with pytest.raises(AssertionError, match="replay 1 of 2"):
        check_replays(chain, lambda: first, inputs, 2)
    assert torch.equal(chain.logits, inputs["logits"])  # restored after a failure too


@needs_interpreter
def test_triton_chain_replays_eagerly_in_the_interpreter():
    from bench.decode import triton_steps
    shape = tiny_shape("bf16")
    inputs = decode_inputs(shape, CPU)
    chain = DecodeChain(triton_steps(), inputs, shape)
    assert check_replays(chain, chain, inputs, 1) == 0


def test_launches_are_counted_on_a_gpu_only():
    assert count_launches(lambda: None, CPU) is None


def test_runner_adds_a_paths_facts_to_its_record_and_note():
    def paths(inputs, shape, ctx):
        x = inputs["x"]
        return [Path("torch", run=lambda: x + 1),
                Path("triton", run=lambda: x + 1, facts=lambda: {"launches": 3}),
                Path("flashinfer", run=lambda: x + 1, facts=lambda: 1 / 0)]
    stage = Stage(name="plus", keys=("tokens",),
                  build=lambda shape, device, ctx=None: {"x": torch.ones(shape["tokens"])},
                  paths=paths, check=lambda out, ref, inputs, shape: None,
                  traffic=lambda shape, inputs=None: {"local": 8}, dtype=lambda shape: "fp32")
    ctx = RunContext(device=CPU, gpu="cpu")
    rows = {r["backend"]: r for r in run_stages([stage], TINY, ctx, progress=False)
            if r["shape"]["tokens"] == 3}
    assert rows["triton"]["launches"] == 3 and rows["triton"]["note"] == "launches: 3"
    assert rows["flashinfer"]["ok"] is True and "launches" not in rows["flashinfer"]
    assert rows["flashinfer"]["note"].startswith("facts failed: ZeroDivisionError")


# ---------------------------------------------------------------------------------------------
# Bytes and targets
# ---------------------------------------------------------------------------------------------

def test_bytes_by_hand_at_t16():
    t, h, e, k, r = 16, 7168, 256, 8, 1
    p = t * k
    # Written out per step: routing, local plan, global scale, NVFP4 quantize, permutation.
    before_gather = ((4 * t * e + 4 * e + 8 * t * k) + (4 * t * k + 8 * r + 8 * t * r + 4 * e)
                     + 2 * t * h + (2 * t * h + t * h // 2 + t * h // 16)
                     + (12 * p + 8 * e + 4))
    unpermute = 2 * p * h + 8 * p + 2 * t * h
    row = h // 2 + h // 16  # packed codes and scales of one NVFP4 row
    nvfp4 = dict(payload="nvfp4", ep_size=1, tokens=t, hidden=h, experts=e, top_k=k)
    assert decode_traffic(nvfp4) == {
        "local": before_gather + (2 * p * row + 4 * p) + unpermute,
        "hbm_local": before_gather + (t * row + p * row + 4 * p) + unpermute}
    assert decode_traffic(dict(nvfp4, payload="bf16")) == {
        "local": before_gather + (4 * p * h + 4 * p) + unpermute,
        "hbm_local": before_gather + (2 * t * h + 2 * p * h + 4 * p) + unpermute}
    assert decode_traffic(nvfp4)["local"] == 3_645_068


def _decode_row(tokens: int, time_us: float, payload: str = "nvfp4",
                backend: str = "triton") -> dict:
    return {"stage": "decode", "backend": backend, "time_us": time_us, "gbps": None,
            "shape": dict(payload=payload, ep_size=1, tokens=tokens, hidden=7168,
                          experts=256, top_k=8)}


def test_decode_targets_bound_the_triton_chain_of_both_payloads():
    # The bounds, written out: 12 / 15 / 25 us, and T=2048 no slower than 218.4 us.
    bounds = {16: 12.0, 64: 15.0, 256: 25.0, 2048: 218.4}
    for payload in ("nvfp4", "bf16"):
        rows = ([_decode_row(t, bound, payload) for t, bound in bounds.items()]
                + [_decode_row(t, bound + 0.1, payload) for t, bound in bounds.items()]
                + [_decode_row(16, 99.0, payload, backend="flashinfer_routing"),
                   _decode_row(1, 99.0, payload)])
        judge_targets(rows)
        assert [r["target_pass"] for r in rows[:8]] == [True] * 4 + [False] * 4
        assert "218.4 us (no slower than before)" in rows[3]["target"]
        assert "target" not in rows[8] and "target" not in rows[9]  # not Triton / no target


def test_compiled_chain_target_is_its_cuda_graph_row():
    """The compiled chain replayed as a CUDA graph is judged against the uncompiled chain's
    CUDA graph; the compiled chain's eager calls are reported, not judged."""
    graphed = "triton_compiled_graph"
    rows = [_decode_row(16, 10.0), _decode_row(16, 9.0, backend=graphed),
            _decode_row(64, 10.0), _decode_row(64, 11.0, backend=graphed),
            _decode_row(256, 30.0, backend=graphed),   # no uncompiled row: not judged
            _decode_row(16, 300.0, backend="triton_compiled")]
    judge_targets(rows)
    assert [r.get("target_pass") for r in rows[1:4:2]] == [True, False]
    assert rows[4]["target_pass"] is None
    assert "target" not in rows[5]
    assert "compiled T=16 (CUDA graph) <= uncompiled (CUDA graph)" in rows[1]["target"]


# ---------------------------------------------------------------------------------------------
# On a GPU (subprocesses)
# ---------------------------------------------------------------------------------------------

REPLAY_SCRIPT = """
import torch
from bench.decode import (DECODE_TOKENS, PAYLOADS, DEEPSEEK_R1, DecodeChain, OverlappedChain,
                          check_chain, check_replays, decode_inputs, graph_replayer,
                          oracle_chain, triton_steps)
device = torch.device("cuda", 0)
for routing, chain_class in (("triton", DecodeChain), ("triton", OverlappedChain),
                             ("flashinfer", DecodeChain)):
    for tokens in DECODE_TOKENS:
        for payload in PAYLOADS:
            shape = dict(payload=payload, ep_size=1, tokens=tokens, **DEEPSEEK_R1)
            inputs = decode_inputs(shape, device)
            # the serial chain as the bench times it: the quantize and the permutation
            # reading their inputs before they wait (overlap_previous)
            chain = chain_class(triton_steps(routing, overlap_previous=chain_class is DecodeChain),
                                inputs, shape)
            near_ties = routing == "flashinfer"
            check_chain(chain(), oracle_chain(inputs, shape), inputs, shape, near_ties=near_ties)
            near = check_replays(chain, graph_replayer(chain), inputs, 100, near_ties=near_ties)
            print("replayed", routing, tokens, payload, near, flush=True)
print("all replays checked")
"""


@pytest.mark.gpu
def test_gpu_chain_graph_checked_at_each_of_100_replays_with_fresh_routing():
    done = subprocess.run([sys.executable, "-c", REPLAY_SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0 and "all replays checked" in done.stdout, \
        done.stdout[-2000:] + done.stderr[-3000:]
    # (routing, chain) pairs x token counts x payloads
    assert done.stdout.count("replayed ") == 3 * 5 * 2


LAUNCH_SCRIPT = """
import torch
from bench.decode import (DEEPSEEK_R1, DecodeChain, count_launches, decode_inputs,
                          routing_options, triton_steps)
device = torch.device("cuda", 0)
shape = dict(payload="nvfp4", ep_size=1, tokens=16, **DEEPSEEK_R1)
inputs = decode_inputs(shape, device)


def step_launches(fused):
    chain = DecodeChain(triton_steps(fused=fused), inputs, shape)
    out = chain()
    steps, k, e = chain.steps, shape["top_k"], shape["experts"]
    alone = [
        lambda: steps.route(chain.logits, k, "deepseek_v3", **routing_options(chain.bias)),
        lambda: steps.plan(out.topk_ids, e, 1, max_tokens_per_rank=16),
        lambda: steps.quantize(chain.x),
    ]
    if fused:
        alone.append(lambda: steps.permute_gather(out.topk_ids, out.packed, e,
                                                  scales=out.scales))
    else:
        alone += [lambda: steps.permute(out.topk_ids, e),
                  lambda: steps.gather(out.packed, out.permutation.source_rows,
                                       scales=out.scales, top_k=k)]
    alone.append(lambda: steps.unpermute(chain.expert_out, out.permutation, out.topk_weights))
    counts = [count_launches(step, device) for step in alone]
    total = count_launches(chain, device)
    assert all(c >= 1 for c in counts) and total == sum(counts), (fused, total, counts)
    return total, counts


fused, split = step_launches(True), step_launches(False)
# permute_and_gather is one launch at T=16, where the two ops are two
assert fused[1][3] == 1 and fused[0] == split[0] - 1, (fused, split)
print("launches", fused, split)
"""


@pytest.mark.gpu
def test_gpu_launch_count_is_the_sum_of_the_steps_launches():
    done = subprocess.run([sys.executable, "-c", LAUNCH_SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0 and "launches" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_decode_rows(tmp_path):
    _, data = run_bench(["--stages", "decode", "--sweep", "decode", "--tokens", "16",
                         "--targets", "--no-plots", "--budget", "0"], tmp_path, cpu=False)
    rows = {(r["backend"], r["shape"]["payload"]): r for r in data["records"]}
    for payload in ("nvfp4", "bf16"):
        triton = rows[("triton", payload)]
        assert triton["ok"] is True and triton["timing"] == "cuda_graph", triton
        assert "10 CUDA-graph replays checked with fresh routing" in triton["note"], triton
        # route 1, plan 1, global scale + quantize 2, permute_and_gather 1, unpermute 1
        assert isinstance(triton["launches"], int) and triton["launches"] >= 6, triton
        # a bound in us: judged (PASS or FAIL) on the GPU it was set on, else "not judged"
        on_bounds_gpu = BOUNDS_GPU in triton["gpu"]
        assert (triton["target_pass"] is not None) == on_bounds_gpu, triton
        assert ("not judged on" in triton["target"]) != on_bounds_gpu, triton
        routing = rows[("flashinfer_routing", payload)]  # fused_topk_deepseek runs on SM89+
        assert routing["ok"] is True and routing["timing"] == "cuda_graph", routing
        whole = rows[("flashinfer", payload)]
        assert whole["ok"] is None and "no standalone permutation" in whole["note"], whole
        assert rows[("torch", payload)]["ok"] is True
        compiled = rows[("triton_compiled", payload)]  # timed by eager calls
        assert compiled["ok"] is True and compiled["timing"] != "cuda_graph", compiled
        assert "torch.compile(fullgraph=True)" in compiled["note"], compiled
        overlapped = rows[("triton_overlap", payload)]  # checked at every replay, then timed
        assert overlapped["ok"] is True and overlapped["timing"] == "cuda_graph", overlapped
        assert "10 CUDA-graph replays checked with fresh routing" in overlapped["note"]
        # the overlapped row's NVFP4 rows: the permutation and the gather as two ops
        split = 1 if payload == "nvfp4" else 0
        assert overlapped["launches"] == triton["launches"] + split, (overlapped, triton)
        assert (overlapped["target_pass"] is not None) == on_bounds_gpu, overlapped
        graphed = rows[("triton_compiled_graph", payload)]
        assert graphed["ok"] is True and graphed["timing"] == "cuda_graph", graphed
        assert "10 CUDA-graph replays checked with fresh routing" in graphed["note"], graphed
        assert graphed["target_pass"] is not None, graphed  # relative: judged on any GPU
        for row in (triton, overlapped, graphed, routing):  # a graph of one call, replayed
            assert isinstance(row["one_graph_us"], float) and row["one_graph_us"] > 0, row
            assert f"one_graph_us: {row['one_graph_us']}" in row["note"], row
        assert "one_graph_us" not in compiled, compiled
