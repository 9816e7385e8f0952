"""MoEAlltoall inside torch.compile: the registered ops of a2a.ops (moe_a2a::prepare,
::dispatch, ::dispatch_nvfp4, ::dispatch_mxfp8, ::combine).

A model step (prepare, dispatch of bf16 rows and of NVFP4 and MXFP8 codes, a stand-in expert,
combine) compiled with ``fullgraph=True`` must give the eager step's outputs and plan bit for
bit, with one graph and no break (``torch._dynamo.explain``), and T changing between calls must
not recompile per T: after warming up T = 0, 1 and one T >= 2 (0 and 1 are always specialised),
the other T run under ``set_stance("fail_on_recompile")``.

CPU (2 gloo ranks, the torch prepare and transport, the Triton quantizers in the interpreter
where named): backends eager and aot_eager, and inductor on fewer T; opcheck of every op; the
plan's two-buffer form (zero-copy for the Triton prepare, whose R = 1 exchange runs in the
interpreter). GPU (marked): the Triton prepare and transport, one rank on one GPU (and two
ranks on two), compiled with inductor, bit-identical, no recompile per T, the compiled step
captured in a CUDA graph and replayed, ``mode="reduce-overhead"``, opcheck.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch._dynamo.testing

from a2a import ops
from a2a.alltoall import MoEAlltoall
from a2a.config import TransportConfig
from a2a.resources import AlltoallResources, NotAllocated
from kernels import reference
from tests.support import interpreter_with_runtime_loops, run_distributed
from tests.test_alltoall import assert_plans_equal, make_payload, make_routing

# The CPU layer: E, k, N, H (H % 32 == 0 for MXFP8; rows of 16n bytes are not needed on the
# torch transport).
E, K, N, H = 8, 2, 8, 64
GLOBAL_SCALE = 448.0 * 6.0 / 4.0
WARM_T = (1, 5, 0)          # compiles: T = 1 and T = 0 are specialised, T = 5 is dynamic
MORE_T = (3, 7, 8, 2)       # then no recompile
TORCH_BACKENDS = {"prepare": "torch", "transport": "torch", "quantize": "torch"}


def stand_in_expert(recv: torch.Tensor, plan) -> torch.Tensor:
    """Each received row times the number of its slots this rank owns: one rounding, so the
    eager and the compiled (fused) arithmetic give the same bits."""
    owned = (plan.recv_expert_ids != plan.slot_count).sum(dim=1)
    return (recv.float() * owned[:, None].float()).to(recv.dtype)


def make_step(a2a: MoEAlltoall, global_scale: torch.Tensor):
    def step(topk_ids, topk_weights, x):
        plan = a2a.prepare(topk_ids, topk_weights)
        recv = a2a.dispatch(x, plan)
        packed, scales = a2a.dispatch(x, plan, quant="nvfp4", global_scale=global_scale)
        codes, mx_scales = a2a.dispatch(x, plan, quant="mxfp8")
        out = a2a.combine(stand_in_expert(recv, plan), plan)
        return plan, (recv, packed, scales, codes, mx_scales, out)
    return step


def inputs(rank: int, tokens: int, device, *, hidden: int = H, experts: int = E,
           top_k: int = K):
    ids, weights = make_routing(rank, tokens, experts, top_k, seed=tokens)
    x = make_payload(rank, tokens, hidden, seed=tokens).to(torch.bfloat16)
    args = tuple(t.to(device) for t in (ids, weights, x))
    for t in args:  # T is dim 0 of all three
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return args


def assert_same(got, want, what) -> None:
    got_plan, got_outs = got
    want_plan, want_outs = want
    assert_plans_equal(got_plan, want_plan)
    for index, (a, b) in enumerate(zip(got_outs, want_outs)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, index)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (what, index)


def compile_and_compare(step, rank, device, backend, warm, more, make_inputs=None,
                        **compile_kwargs):
    """Compile ``step``; run warm then more T (more under fail_on_recompile), each compared
    with the eager step on the same inputs (``make_inputs(rank, tokens, device)``, default
    :func:`inputs`). Returns the number of compiled frames and the compiled step."""
    make_inputs = inputs if make_inputs is None else make_inputs
    torch._dynamo.reset()
    counter = (torch._dynamo.testing.CompileCounterWithBackend(backend)
               if backend != "eager" else torch._dynamo.testing.CompileCounter())
    compiled = torch.compile(step, backend=counter, fullgraph=True, **compile_kwargs)
    for tokens in warm:
        args = make_inputs(rank, tokens, device)
        assert_same(compiled(*args), step(*args), (backend, tokens))
    torch.compiler.set_stance("fail_on_recompile")
    try:
        for tokens in more:
            args = make_inputs(rank, tokens, device)
            assert_same(compiled(*args), step(*args), (backend, tokens))
    finally:
        torch.compiler.set_stance("default")
    return counter.frame_count, compiled


# ---------------------------------------------------------------------------------------------
# CPU: 2 gloo ranks
# ---------------------------------------------------------------------------------------------

def _compiled_step_body(rank: int, world_size: int) -> None:
    # agree=True (the default): eager calls agree, traced calls do not (they could not).
    a2a = MoEAlltoall(None, E, K, N, H, backends=TORCH_BACKENDS)
    a2a.allocate(dtypes=(torch.bfloat16,), quant=("nvfp4", "mxfp8"))
    step = make_step(a2a, torch.tensor([GLOBAL_SCALE]))
    for backend in ("eager", "aot_eager"):
        frames, _ = compile_and_compare(step, rank, "cpu", backend, WARM_T, MORE_T)
        assert frames == len(WARM_T), (backend, frames)
    explained = torch._dynamo.explain(step)(*inputs(rank, 5, "cpu"))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons
    # Closing the object: the compiled step's guards fail, the retrace raises.
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    compiled(*inputs(rank, 4, "cpu"))
    handle = a2a.handle
    a2a.close()
    with pytest.raises(RuntimeError, match="closed"):
        compiled(*inputs(rank, 4, "cpu"))
    with pytest.raises(RuntimeError, match=f"no MoEAlltoall has handle {handle}"):
        ops.registered(handle)


def _inductor_body(rank: int, world_size: int) -> None:
    with MoEAlltoall(None, E, K, N, H, backends=TORCH_BACKENDS, agree=False) as a2a:
        a2a.allocate(dtypes=(torch.bfloat16,), quant=("nvfp4", "mxfp8"))
        step = make_step(a2a, torch.tensor([GLOBAL_SCALE]))
        frames, _ = compile_and_compare(step, rank, "cpu", "inductor", (5,), (3, 8))
        assert frames == 1, frames


def opcheck_every_op(a2a: MoEAlltoall, rank: int, tokens: int, device, *,
                     prepare_tests=None) -> None:
    """torch.library.opcheck of the five ops on ``a2a``'s state (every rank makes the same
    calls: each run of an op is a collective). ``prepare_tests``: opcheck's test_utils for the
    prepare (default all)."""
    ids, weights, x = inputs(rank, tokens, device, hidden=a2a.hidden_size,
                             experts=a2a.num_experts, top_k=a2a.top_k)
    global_scale = torch.tensor([GLOBAL_SCALE], device=device)
    plan = a2a.prepare(ids, weights, check_inputs=False)
    tensors = ops.plan_tensors(plan)
    recv = a2a.dispatch(x, plan)
    movement, resources = a2a._movement, a2a._resources
    prepare_kwargs = {} if prepare_tests is None else {"test_utils": prepare_tests}
    cases = [
        (torch.ops.moe_a2a.prepare.default,
         (a2a.handle, ids, weights, resources.prepare_state(create=False)), prepare_kwargs),
        (torch.ops.moe_a2a.dispatch.default,
         (a2a.handle, x, tensors,
          movement.transport_state("dispatch", None, x.dtype, create=False)), {}),
        (torch.ops.moe_a2a.dispatch_nvfp4.default,
         (a2a.handle, x, global_scale, tensors,
          movement.transport_state("dispatch", "nvfp4", x.dtype, create=False)), {}),
        (torch.ops.moe_a2a.dispatch_mxfp8.default,
         (a2a.handle, x, tensors,
          movement.transport_state("dispatch", "mxfp8", x.dtype, create=False)), {}),
        (torch.ops.moe_a2a.combine.default,
         (a2a.handle, stand_in_expert(recv, plan), tensors, tokens,
          movement.transport_state("combine", None, recv.dtype, create=False)), {}),
    ]
    for op, args, kwargs in cases:
        torch.library.opcheck(op, args, raise_exception=True, **kwargs)
    # Called directly, each op gives the eager method's bits (the eager path bypasses it).
    local, received = torch.ops.moe_a2a.prepare(a2a.handle, *cases[0][1][1:])
    assert_plans_equal(ops.plan_from_buffers(
        local, received, a2a.plan_layout, ep_rank=a2a.ep_rank, ep_size=a2a.ep_size,
        max_tokens_per_rank=a2a.max_tokens_per_rank, num_tokens=tokens, top_k=a2a.top_k,
        slot_count=a2a.slot_count), plan)
    assert torch.equal(torch.ops.moe_a2a.dispatch(*cases[1][1]), recv)
    assert torch.equal(torch.ops.moe_a2a.combine(*cases[4][1]),
                       a2a.combine(stand_in_expert(recv, plan), plan))


def _opcheck_body(rank: int, world_size: int) -> None:
    # The quantized dispatches through the Triton quantizers (interpreted here).
    backends = {**TORCH_BACKENDS, "quantize": "triton"}
    with MoEAlltoall(None, E, K, N, H, backends=backends, agree=False) as a2a:
        a2a.allocate(dtypes=(torch.bfloat16,), quant=("nvfp4", "mxfp8"))
        opcheck_every_op(a2a, rank, 5, "cpu")
        # The torch-backend ops count their calls in the sequence counter they declare.
        before = int(a2a._resources.sequence)
        a2a.prepare(*inputs(rank, 3, "cpu")[:2])                      # eager: not counted
        assert int(a2a._resources.sequence) == before
        compiled = torch.compile(lambda ids, w: a2a.prepare(ids, w), backend="aot_eager",
                                 fullgraph=True)
        compiled(*inputs(rank, 3, "cpu")[:2])
        assert int(a2a._resources.sequence) == before + 1


def _gloo_body(rank: int, world_size: int) -> None:
    _opcheck_body(rank, world_size)
    _inductor_body(rank, world_size)
    _compiled_step_body(rank, world_size)


def test_compiled_step_and_opcheck_on_gloo():
    """One process group for the three parts (starting one costs more than a part here):
    opcheck of every op; the step compiled with inductor; with eager and aot_eager over more
    T, explain, and what a compiled step does once its object is closed."""
    run_distributed(2, _gloo_body)


# ---------------------------------------------------------------------------------------------
# CPU, one process
# ---------------------------------------------------------------------------------------------

def test_plan_buffers_round_trip_copies_other_plans():
    """A plan from elsewhere (the oracle's, like the torch prepare's) is copied into the two
    buffers, and carved back bit for bit."""
    generator = torch.Generator().manual_seed(3)
    ids = [torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(t)]).int()
           for t in (6, 3)]
    weights = [torch.rand(t, K, generator=generator) for t in (6, 3)]
    layout = ops.plan_layout(2, N, K, E)
    for plan in reference.simulate_alltoall(ids, weights, E, N):
        local, received = ops.plan_buffers(plan, layout)
        assert local.numel() == layout.local_words and local.dtype == torch.int32
        assert received.numel() == layout.received_words
        assert local.untyped_storage().data_ptr() != \
            plan.send_rank_count_cumsum.untyped_storage().data_ptr()
        back = ops.plan_from_buffers(local, received, layout, ep_rank=plan.ep_rank,
                                     ep_size=2, max_tokens_per_rank=N,
                                     num_tokens=plan.num_tokens, top_k=K, slot_count=E)
        assert_plans_equal(back, plan)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton prepare of one rank in the interpreter")
def test_plan_buffers_are_the_triton_prepares_own(monkeypatch):
    """With one rank the Triton prepare runs in the interpreter (each program waits only for
    its own flag, set just before): its plan already lies in the layout's two buffers, which
    the prepare op returns without a copy."""
    from a2a.config import PrepareConfig
    from a2a.triton_prepare import prepare_workspace_words, triton_prepare
    interpreter_with_runtime_loops(monkeypatch)
    max_tokens, top_k, experts = 6, 2, 4
    generator = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k]
                       for _ in range(5)]).int()
    weights = torch.rand(5, top_k, generator=generator)
    workspace = torch.zeros((1, prepare_workspace_words(1, max_tokens, top_k, experts)),
                            dtype=torch.int64)
    counter = torch.zeros(1, dtype=torch.int64)
    plan = triton_prepare(ids, weights, workspace, ep_rank=0, ep_size=1, num_experts=experts,
                          max_tokens_per_rank=max_tokens, call_counter=counter,
                          config=PrepareConfig(max_programs=2, timeout_spins=100))
    assert_plans_equal(plan, reference.simulate_alltoall([ids], [weights], experts,
                                                         max_tokens)[0])
    layout = ops.plan_layout(1, max_tokens, top_k, experts)
    local, received = ops.plan_buffers(plan, layout)
    assert local.untyped_storage().data_ptr() == \
        plan.send_rank_local_indices.untyped_storage().data_ptr()
    assert received.untyped_storage().data_ptr() == \
        plan.recv_weights.untyped_storage().data_ptr()
    back = ops.plan_from_buffers(local, received, layout, ep_rank=0, ep_size=1,
                                 max_tokens_per_rank=max_tokens, num_tokens=5, top_k=top_k,
                                 slot_count=experts)
    assert_plans_equal(back, plan)
    for name, tensor in plan.tensors().items():
        assert getattr(back, name).data_ptr() == tensor.data_ptr(), name


def test_traced_calls_need_allocated_workspaces():
    """What a traced call asks for is never made there: NotAllocated names allocate()."""
    resources = AlltoallResources(None, torch.device("cpu"), ep_rank=0, ep_size=2,
                                  max_tokens_per_rank=N, top_k=K, num_experts=E, slot_count=E,
                                  backends={"prepare": "triton", "transport": "triton"})
    with pytest.raises(NotAllocated, match=r"allocate\(dtypes=\.\.\., quant=\.\.\.\)"):
        resources.prepare_state(create=False)
    with pytest.raises(NotAllocated, match="dispatch workspace for rows of 128 bytes"):
        resources.transport_state("dispatch", [128], create=False)
    torch_state = AlltoallResources(None, torch.device("cpu"), ep_rank=0, ep_size=2,
                                    max_tokens_per_rank=N, top_k=K, num_experts=E,
                                    slot_count=E,
                                    backends={"prepare": "torch", "transport": "torch"})
    assert torch_state.prepare_state(create=False) == [torch_state.sequence]


# ---------------------------------------------------------------------------------------------
# GPU: the Triton prepare and transport
# ---------------------------------------------------------------------------------------------

# A DeepSeek-like layer on 16n-byte rows (H/32 scale bytes: H % 512 == 0 for MXFP8).
GPU_E, GPU_K, GPU_N, GPU_H = 32, 8, 64, 512
GPU_WARM_T, GPU_MORE_T = (1, 16, 0), (5, 37, 64, 2)
TRITON_BACKENDS = {"prepare": "triton", "transport": "triton", "quantize": "triton"}
# Transport configs the compiled step runs with: the defaults, and the quantizing send with
# send and receive programs in one launch.
GPU_CONFIGS = {"default": TransportConfig(),
               "fused_overlap": TransportConfig(fused_nvfp4_dispatch=True, overlap=True)}
RANKS = [pytest.param(1, marks=pytest.mark.gpu, id="1rank"),
         pytest.param(2, marks=pytest.mark.multigpu, id="2ranks")]


def gpu_inputs(rank, tokens, device):
    return inputs(rank, tokens, device, hidden=GPU_H, experts=GPU_E, top_k=GPU_K)


def _triton_compiled_body(rank: int, world_size: int, config_name: str) -> None:
    device = torch.device("cuda", rank)
    config = GPU_CONFIGS[config_name]
    a2a = MoEAlltoall(None, GPU_E, GPU_K, GPU_N, GPU_H, backends=TRITON_BACKENDS,
                      transport_config=config)
    global_scale = torch.tensor([GLOBAL_SCALE], device=device)
    step = make_step(a2a, global_scale)
    # Before allocate(): the traced call cannot make the workspaces, and says so.
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="allocate"):
        torch.compile(step, backend="eager", fullgraph=True)(*gpu_inputs(rank, 4, device))
    a2a.allocate(dtypes=(torch.bfloat16,), quant=("nvfp4", "mxfp8"))

    frames, compiled = compile_and_compare(step, rank, device, "inductor", GPU_WARM_T,
                                           GPU_MORE_T, make_inputs=gpu_inputs)
    assert frames == len(GPU_WARM_T), frames
    explained = torch._dynamo.explain(step)(*gpu_inputs(rank, 16, device))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons

    # The compiled step captured in a CUDA graph (T fixed), replayed with fresh inputs.
    tokens = 16 + rank
    static = gpu_inputs(rank, tokens, device)
    compiled(*static)  # compiled for this T (dynamic) and warm
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = compiled(*static)
    for replay in range(10):
        fresh = make_routing(rank, tokens, GPU_E, GPU_K, seed=500 + replay) + (
            make_payload(rank, tokens, GPU_H, seed=500 + replay).to(torch.bfloat16),)
        for target, value in zip(static, fresh):
            target.copy_(value)
        graph.replay()
        torch.cuda.synchronize(device)
        assert_same(captured, step(*static), ("cuda graph", replay))

    # Cudagraph trees (mode="reduce-overhead"): the same bits whether or not they capture.
    torch._dynamo.reset()
    overhead = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for tokens in (16, 16, 16, 9):
        args = gpu_inputs(rank, tokens, device)
        got = overhead(*args)
        got = (dataclasses.replace(got[0], **{n: t.clone() for n, t in got[0].tensors().items()}),
               tuple(t.clone() for t in got[1]))
        assert_same(got, step(*args), ("reduce-overhead", tokens))
    a2a.check_transport()  # no wait timed out, eager, compiled or replayed
    a2a.close()


@pytest.mark.parametrize("config_name", sorted(GPU_CONFIGS))
@pytest.mark.parametrize("world_size", RANKS)
def test_compiled_triton_step(world_size, config_name):
    run_distributed(world_size, _triton_compiled_body, config_name, cuda=True)


def _triton_opcheck_body(rank: int, world_size: int) -> None:
    # A dedicated object: opcheck runs each op several times on copies of its state.
    with MoEAlltoall(None, GPU_E, GPU_K, GPU_N, GPU_H, backends=TRITON_BACKENDS,
                     agree=False) as a2a:
        a2a.allocate(dtypes=(torch.bfloat16,), quant=("nvfp4", "mxfp8"))
        # The prepare's buffers leave their padding words unwritten, so its outputs are
        # compared by value only through the plan (opcheck_every_op), not by opcheck's
        # eager-vs-AOT comparison of whole outputs.
        opcheck_every_op(a2a, rank, 16, torch.device("cuda", rank),
                         prepare_tests=("test_schema", "test_autograd_registration",
                                        "test_faketensor"))


@pytest.mark.gpu
def test_opcheck_of_every_op_with_the_triton_backends():
    run_distributed(1, _triton_opcheck_body, cuda=True)
