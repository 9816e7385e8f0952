"""The ``moe_a2a::`` torch.library ops (``kernels.library``, ``kernels.ops``; issue 17).

For every op of ``kernels.ops.OP_NAMES``: both overloads (``.triton``: the Triton launcher, under
the interpreter on a CPU; ``.torch``: the oracle) give the bits of the public function and of
the oracle; ``torch.library.opcheck`` passes on both; the fake gives the real outputs' shapes,
dtypes and strides. Then the DeepSeek-V3 decode chain (every op on ``backend="triton"``) under
``torch.compile(fullgraph=True)``: bit-identical to eager, one compile over several T, and the
device-read checks raising inside a compiled region as they do eagerly. The ``gpu`` tests do the
same with Inductor compiling the Triton kernels itself (the interpreter keeps the ops opaque).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.ops import OpCall, bits, op_call, tensors_of
from bench.stages import DEEPSEEK_GROUPS, DEEPSEEK_SCALING, DEEPSEEK_TOPK_GROUPS
from kernels import gather as G
from kernels import ops, reference
from kernels import permute as PM
from kernels import prepare as PR
from kernels import routing as RT
from tests.support import assert_close

# Small DeepSeek-V3-like shapes (the interpreter runs every kernel in Python); the groups and
# the scaling are the bench's (bench.stages).
EXPERTS, TOP_K = 64, 4
GROUPS, KEEP, SCALING = DEEPSEEK_GROUPS, DEEPSEEK_TOPK_GROUPS, DEEPSEEK_SCALING
HIDDEN = 64


def make_case(name: str, device: torch.device, tokens: int = 5) -> OpCall:
    """The call of op ``name`` on ``tokens`` tokens of the test's small shapes (the bench's
    ``ops`` stage makes the same calls at T=16 on DeepSeek-R1's)."""
    return op_call(name, device, tokens, HIDDEN, EXPERTS, TOP_K)


def _routing(generator, tokens, device):
    logits = torch.randn(tokens, EXPERTS, generator=generator).to(device)
    bias = torch.randn(EXPERTS, generator=generator).to(device)
    return reference.route_topk(logits, TOP_K, "deepseek_v3", bias=bias, num_groups=GROUPS,
                                topk_groups=KEEP, routed_scaling=SCALING)


def _randn(generator, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)


def assert_same_bits(actual, expected, what: str, tolerant: tuple = ()) -> None:
    """Every output tensor equal bit for bit (those at ``tolerant`` within the tolerance
    table of ``tests.support.assert_close``)."""
    actual, expected = tensors_of(actual), tensors_of(expected)
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, (
            f"{what}[{i}]: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}")
        if i in tolerant:
            assert_close(a, e)
        else:
            assert torch.equal(bits(a), bits(e)), f"{what}[{i}]: the bits differ"


def run_overload(op, case: OpCall, face: str):
    """Call the overload ``face`` of ``op``; returns its outputs (the mutated buffers for the
    out= form, written on fresh zeroed copies)."""
    args = list(case.triton if face == "triton" else case.torch)
    for i in case.mutated:
        args[i] = torch.zeros_like(args[i])
    result = op.overload(face)(*args)
    return tuple(args[i] for i in case.mutated) if case.mutated else tensors_of(result)


def test_op_names_are_the_registered_ops():
    registered = ops.registered_ops()
    assert tuple(registered) == ops.OP_NAMES
    for name, op in registered.items():
        assert op.triton.name() == f"moe_a2a::{name}.triton"
        assert op.torch.name() == f"moe_a2a::{name}.torch"


def test_triton_overload_dispatches_eagerly_below_autograd(device):
    """Every .triton overload has a kernel at the CPU and CUDA keys and a fallthrough at their
    autograd keys (kernels.library.register): an input that requires grad gives an output
    that does not (a custom op's own autograd kernel would mark it; the ops have no
    derivatives), with the raw launch's bits."""
    for name, op in ops.registered_ops().items():
        for key in ("CPU", "CUDA", "AutogradCPU", "AutogradCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.triton.name(), key), \
                (name, key)
    op = ops.registered_ops()["unpermute_and_reduce"]
    expert_out, inverse, weights = make_case("unpermute_and_reduce", device).triton
    out = op.triton(expert_out, inverse, weights.clone().requires_grad_())
    assert not out.requires_grad
    assert torch.equal(out, op.launch(expert_out, inverse, weights))


def test_out_form_bumps_the_versions_of_what_it_writes(device):
    """The mutating op's ADInplaceOrView kernel (kernels.library._version_bump): the version
    counters of ``out`` and ``out_scales`` move on every call, given by position or by name,
    and the input's does not; the buffers hold the public function's bits."""
    op = ops.registered_ops()["quantize_nvfp4_out"]
    case = make_case("quantize_nvfp4_out", device)
    args = list(case.triton)
    x, out, out_scales = args[0], args[5], args[6]
    before = (x._version, out._version, out_scales._version)
    op.triton(*args)
    assert (x._version, out._version, out_scales._version) == (
        before[0], before[1] + 1, before[2] + 1)
    schema_names = [a.name for a in op.triton._schema.arguments]
    named = dict(zip(schema_names[5:], args[5:]))
    op.triton(*args[:5], **named)
    assert (out._version, out_scales._version) == (before[1] + 2, before[2] + 2)
    assert_same_bits((out, out_scales), case.public(), "quantize_nvfp4_out through the op")


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_overloads_give_the_public_and_oracle_bits(name, device):
    op = ops.registered_ops()[name]
    case = make_case(name, device)
    public, oracle = case.public(), case.oracle()
    by_triton, by_torch = run_overload(op, case, "triton"), run_overload(op, case, "torch")
    assert_same_bits(by_triton, by_torch, f"{name}: .triton vs .torch", case.tolerant)
    compared = case.compared or len(by_triton)
    assert_same_bits(by_triton[:compared], public, f"{name}: .triton vs the public function")
    assert_same_bits(by_torch[:compared], oracle, f"{name}: .torch vs the oracle")
    assert_same_bits(public, oracle, f"{name}: public vs oracle", case.tolerant)


@pytest.mark.parametrize("name", ops.OP_NAMES)
@pytest.mark.parametrize("face", ["triton", "torch"])
def test_opcheck(name, face, device):
    op = ops.registered_ops()[name]
    case = make_case(name, device, tokens=3)
    args = case.triton if face == "triton" else case.torch
    torch.library.opcheck(op.overload(face), opcheck_args(name, args), raise_exception=True)


def opcheck_args(name: str, args: tuple) -> tuple:
    """``args`` as opcheck can take them: its schema check compares each input before and
    after the call with allclose, which torch implements for float8 on no device; the
    dequantize_mxfp8 op takes the codes' uint8 bits as well (the float8 codes are covered by
    the other tests)."""
    if name == "dequantize_mxfp8":
        return (args[0].view(torch.uint8),) + tuple(args[1:])
    return tuple(args)


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_fake_gives_real_shapes_dtypes_strides(name, device):
    op = ops.registered_ops()[name]
    for tokens in (1, 6):
        case = make_case(name, device, tokens)
        real = run_overload(op, case, "torch")
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                         for a in case.torch]
            result = op.torch(*fake_args)
        fake = (tuple(fake_args[i] for i in case.mutated) if case.mutated
                else tensors_of(result))
        assert len(fake) == len(real), name
        for i, (f, r) in enumerate(zip(fake, real)):
            assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride()), (
                f"{name}[{i}] at T={tokens}: fake {f.dtype}{tuple(f.shape)} {f.stride()}, "
                f"real {r.dtype}{tuple(r.shape)} {r.stride()}")


def test_check_config_parameters_refuses_a_dropped_field():
    from kernels.library import check_config_parameters

    def op(logits: torch.Tensor, num_warps: int) -> torch.Tensor:
        return logits
    with pytest.raises(TypeError, match="RoutingLaunch has the fields"):
        check_config_parameters(op, RT.RoutingLaunch)


# =============================================================================================
# The decode chain under torch.compile
# =============================================================================================

# The chain's capacity: static, whatever T (max_tokens_per_rank sizes the plan's buffers); the
# GPU tests run T up to 256, the interpreter up to 16.
CHAIN_MAX_TOKENS = 256 if torch.cuda.is_available() else 32


def decode_chain(logits, bias, x, expert_out, check: bool = False):
    """DeepSeek-V3 route_topk -> local_send_plan -> nvfp4_global_scale + quantize_nvfp4 ->
    permute_by_expert -> gather_rows (the NVFP4 rows and scales) -> unpermute_and_reduce, every
    stage on ``backend="triton"``; ``check``: the device-read checks on. Returns every output
    tensor (a flat tuple)."""
    from a2a.permute import gather_rows, permute_by_expert, unpermute_and_reduce
    from a2a.quantize import nvfp4_global_scale, quantize_nvfp4
    from a2a.routing import route_topk
    ids, weights = route_topk(logits, TOP_K, "deepseek_v3", bias=bias, num_groups=GROUPS,
                              topk_groups=KEEP, routed_scaling=SCALING, backend="triton")
    plan = PR.local_send_plan(ids, EXPERTS, 1, max_tokens_per_rank=CHAIN_MAX_TOKENS,
                              check_ids=check)
    gs = nvfp4_global_scale(x, backend="triton")
    packed, scales = quantize_nvfp4(x, gs, check_values=check, backend="triton")
    perm = permute_by_expert(ids, EXPERTS, check_ids=check, backend="triton")
    rows, row_scales = gather_rows(packed, perm, scales=scales, check_values=check,
                                   backend="triton")
    out = unpermute_and_reduce(expert_out, perm, weights, check_values=check, backend="triton")
    return (ids, weights, *tensors_of(plan), gs, packed, scales, *tensors_of(perm), rows,
            row_scales, out)


def chain_inputs(tokens: int, device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(100 + tokens)
    return (_randn(g, tokens, EXPERTS, device=device), _randn(g, EXPERTS, device=device),
            _randn(g, tokens, HIDDEN, dtype=torch.bfloat16, device=device),
            _randn(g, tokens * TOP_K, HIDDEN, dtype=torch.bfloat16, device=device))


def mark_tokens_dynamic(inputs: tuple) -> None:
    """Mark T (dim 0 of logits, x and expert_out's T*k) dynamic."""
    logits, _, x, expert_out = inputs
    for t in (logits, x, expert_out):
        torch._dynamo.mark_dynamic(t, 0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_chain_is_bit_identical(backend, device):
    torch._dynamo.reset()
    inputs = chain_inputs(6, device)
    expected = decode_chain(*inputs)
    compiled = torch.compile(decode_chain, backend=backend, fullgraph=True)
    assert_same_bits(compiled(*inputs), expected, f"chain compiled with {backend}")


def test_chain_has_no_graph_break(device):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(decode_chain)(*chain_inputs(6, device))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_chain_compiles_once_over_tokens(backend, device):
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(decode_chain, backend=counter, fullgraph=True)
    first = chain_inputs(4, device)
    mark_tokens_dynamic(first)
    compiled(*first)
    try:
        torch.compiler.set_stance("fail_on_recompile")
        for tokens in (7, 16):
            inputs = chain_inputs(tokens, device)
            assert_same_bits(compiled(*inputs), decode_chain(*inputs), f"chain at T={tokens}")
    finally:
        torch.compiler.set_stance("default")
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checks_raise_inside_a_compiled_chain(backend, device):
    """A bad expert id given to a compiled chain with the checks on: the same ValueError as
    eagerly (``moe_a2a::check_values`` reads the values when the compiled code runs)."""
    torch._dynamo.reset()

    def permute_then_plan(ids):
        perm = PM.permute_by_expert(ids, EXPERTS)
        plan = PR.local_send_plan(ids, EXPERTS, 1, max_tokens_per_rank=8)
        return perm.source_rows, plan.send_counts

    good, _ = _routing(torch.Generator().manual_seed(3), 4, device)
    bad = good.clone()
    bad[2, 1] = EXPERTS + 3
    with pytest.raises(ValueError) as eager_error:
        permute_then_plan(bad)
    compiled = torch.compile(permute_then_plan, backend=backend, fullgraph=True)
    assert_same_bits(compiled(good), permute_then_plan(good), "checked chain, good ids")
    with pytest.raises(ValueError) as compiled_error:
        compiled(bad)
    assert str(compiled_error.value) == str(eager_error.value)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_gather_check_raises_inside_a_compiled_region(backend, device):
    torch._dynamo.reset()
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16, device=device)
    rows = torch.tensor([0, 3, 15, 16], dtype=torch.int32, device=device)  # 16 = T*k: outside

    def gather(x, rows):
        return G.gather_rows(x, rows, top_k=TOP_K)

    with pytest.raises(ValueError) as eager_error:
        gather(x, rows)
    with pytest.raises(ValueError) as compiled_error:
        torch.compile(gather, backend=backend, fullgraph=True)(x, rows)
    assert str(compiled_error.value) == str(eager_error.value)


# =============================================================================================
# On the GPU: Inductor compiles the Triton kernels of the triton_ops itself
# =============================================================================================

GPU_TOKENS = (1, 16, 64, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_opcheck_triton_on_gpu(name):
    op = ops.registered_ops()[name]
    case = make_case(name, torch.device("cuda"), tokens=16)
    torch.library.opcheck(op.triton, opcheck_args(name, case.triton), raise_exception=True)


@pytest.mark.gpu
def test_chain_under_inductor_on_gpu():
    device = torch.device("cuda")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(decode_chain)(*chain_inputs(16, device))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(decode_chain, backend=counter, fullgraph=True)
    for i, tokens in enumerate(GPU_TOKENS):
        inputs = chain_inputs(tokens, device)
        if tokens > 1:
            mark_tokens_dynamic(inputs)
        assert_same_bits(compiled(*inputs), decode_chain(*inputs), f"inductor, T={tokens}")
        if i == 1:  # T=1 has a graph of its own (0/1 specialisation), T=16 the dynamic one
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    assert counter.frame_count == 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["quantize_nvfp4", "quantize_mxfp8", "quantize_mxfp4",
                                  "dequantize_nvfp4", "unpermute_and_reduce"])
def test_fp_exact_ops_under_inductor_on_gpu(name):
    """The ops whose bits depend on no FMA contraction: Inductor compiles their kernels with
    its own launch options (``enable_fp_fusion=False`` is not passed on), so each is checked
    compiled against the oracle."""
    device = torch.device("cuda")
    op = ops.registered_ops()[name]
    case = make_case(name, device, tokens=64)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op.triton(*a), backend="inductor", fullgraph=True)
    assert_same_bits(tensors_of(compiled(*case.triton))[:case.compared or None],
                     case.oracle(), f"{name} under inductor", case.tolerant)


# A T at which the ops run their large-T forms on DeepSeek-R1's dimensions: the three-pass
# permutation (with its scratch), the two-kernel local plan, the three-launch quantize.
LARGE_TOKENS = 2048


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["permute_by_expert", "local_send_plan",
                                  "scale_and_quantize_nvfp4"])
def test_large_t_forms_under_inductor_on_gpu(name):
    """Each op compiled by Inductor at a T of its large-T form, bit-identical to the oracle. (The
    compiled decode chain faulted at T=2048 while the three-pass permutation's scratch was one
    buffer split in three: tests/ops_trace.py --check views says why.)"""
    device = torch.device("cuda")
    op = ops.registered_ops()[name]
    case = op_call(name, device, LARGE_TOKENS, 7168, 256, 8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op.triton(*a), backend="inductor", fullgraph=True)
    result = tensors_of(compiled(*case.triton))
    torch.cuda.synchronize()
    assert_same_bits(result[:case.compared or None], case.oracle(),
                     f"{name} under inductor, T={LARGE_TOKENS}", case.tolerant)


@pytest.mark.gpu
def test_chain_under_reduce_overhead_on_gpu():
    device = torch.device("cuda")
    torch._dynamo.reset()
    compiled = torch.compile(decode_chain, mode="reduce-overhead", fullgraph=True)
    for replay in range(4):
        inputs = chain_inputs(16, device)
        inputs = tuple(t.clone() for t in inputs)
        torch.manual_seed(replay)
        inputs[0].normal_()
        assert_same_bits(compiled(*inputs), decode_chain(*inputs), f"replay {replay}")


@pytest.mark.gpu
def test_compiled_chain_in_a_cuda_graph_on_gpu():
    device = torch.device("cuda")
    torch._dynamo.reset()
    compiled = torch.compile(decode_chain, backend="inductor", fullgraph=True)
    static = tuple(t.clone() for t in chain_inputs(16, device))
    compiled(*static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        compiled(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(*static)
    for replay in range(4):
        fresh = chain_inputs(16, device)
        torch.manual_seed(replay)
        fresh[0].normal_()
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(captured, decode_chain(*fresh), f"graph replay {replay}")


@pytest.mark.parametrize("method", ["softmax_topk", "sigmoid_topk"])
def test_routing_without_groups_through_the_op(method, device):
    """The public function hands the op its arguments as given (num_groups None for a method
    without groups): the op's own checks accept them, compiled as eagerly."""
    torch._dynamo.reset()
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(5)).to(device)

    def route(logits):
        return RT.route_topk(logits, 2, method)
    assert_same_bits(torch.compile(route, backend="eager", fullgraph=True)(logits),
                     route(logits), f"{method} compiled")
