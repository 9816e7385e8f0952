"""The ``ops`` stage: what an eager call through a registered ``moe_a2a::`` op costs (issue 17).

For every op of ``kernels.ops.OP_NAMES``, at T=16 on DeepSeek-R1's dimensions on a GPU (the
interpreter: tiny dimensions), three rows of the same kernels with the same arguments:

``triton_raw``     ``RegisteredOp.launch``: the op's function without the dispatcher
                  (argument checks, then the kernels launched directly);
``triton_public``  the public function (``kernels.<module>.<op>``), whose eager path skips the
                  dispatcher (``kernels.library.eager_bypass``) after its own checks;
``triton_op``      the ``.triton`` overload called through the dispatcher
                  (``torch.ops.moe_a2a.<op>.triton``), what a serving engine's eager call
                  costs;

and ``torch``, the oracle overload (``.torch``), which every row is checked against. Timed by
eager calls (the cost is the host's, which a CUDA graph would hide); the public calls pass
``check_ids=False`` / ``check_values=False`` (the raw launch reads nothing on the host either).
The targets (bench/targets.py): ``triton_op`` and ``triton_public`` each at most 2 us above
``triton_raw``, judged on a GPU by ``paired_us``: the host's time per call of the row and of the
raw launch, measured in alternation (``bench.timing.time_host_interleaved``), because eager
timings of microsecond calls taken one row after the other drift more than the 2 us judged.

:func:`op_call` builds one call of each op, the arguments of both overloads, the public function
and the oracle; ``tests/test_ops.py`` uses the same calls. The library is imported inside the
functions (bench/stages.py says why).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from bench.stages import (DEEPSEEK_GROUPS, DEEPSEEK_SCALING, DEEPSEEK_TOPK_GROUPS,
                          ROUTING_WEIGHT_TOL, Path, Stage, Sweep, assert_same, make_path)

# The token count the stage times on a GPU (issue 17: "at T=16").
OPS_TOKENS = 16
# DeepSeek-R1's dimensions (as bench/decode.py's DEEPSEEK_R1).
OPS_DIMS = {"hidden": 7168, "experts": 256, "top_k": 8}
# The rows of one op: the raw launch, the public function, the op through the dispatcher.
ROWS = ("triton_raw", "triton_public", "triton_op")


@dataclass(frozen=True)
class OpCall:
    """One call of a registered op.

    triton / torch: the arguments of the ``.triton`` overload (the launch config unpacked at
        the end) and of the ``.torch`` overload; out= buffers are separate tensors for each.
    public / oracle: the public function and the oracle on the same inputs (no arguments).
    compared: how many leading outputs of the overloads the public function returns (the
        others, e.g. permute's id range, are compared between the overloads only); 0: all.
    mutated: indices of the arguments the op writes (the out= form; it returns nothing).
    tolerant: indices of outputs equal within the routing tolerance, not bit for bit (the
        routing weights: their renormalisation sums in another order on the oracle).
    """

    triton: tuple
    torch: tuple
    public: Callable
    oracle: Callable
    compared: int
    mutated: tuple = ()
    tolerant: tuple = ()


def _randn(generator, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)


def op_call(name: str, device: torch.device, tokens: int, hidden: int, experts: int,
            top_k: int) -> OpCall:
    """A call of op ``name`` on ``tokens`` tokens of ``hidden`` bf16 values, DeepSeek-V3 routing
    over ``experts`` experts (8 groups keep 4) picking ``top_k`` (a fixed seed per T)."""
    from kernels import gather as G
    from kernels import permute as PM
    from kernels import prepare as PR
    from kernels import quantize as Q
    from kernels import reference
    from kernels import routing as RT
    from kernels.library import config_fields

    g = torch.Generator().manual_seed(tokens)
    x = _randn(g, tokens, hidden, dtype=torch.bfloat16, device=device)
    logits = _randn(g, tokens, experts, device=device)
    bias = _randn(g, experts, device=device)
    options = dict(bias=bias, num_groups=DEEPSEEK_GROUPS, topk_groups=DEEPSEEK_TOPK_GROUPS,
                   routed_scaling=DEEPSEEK_SCALING)
    if name == "route_topk":
        args = (logits, top_k, "deepseek_v3", bias, DEEPSEEK_GROUPS, DEEPSEEK_TOPK_GROUPS,
                DEEPSEEK_SCALING)
        return OpCall(args + config_fields(RT.default_launch()), args,
                      lambda: RT.route_topk(logits, top_k, "deepseek_v3", **options),
                      lambda: reference.route_topk(logits, top_k, "deepseek_v3", **options), 2,
                      tolerant=(1,))
    ids, weights = reference.route_topk(logits, top_k, "deepseek_v3", **options)
    if name == "local_send_plan":
        ranks, most = 2, max(8, tokens)
        args = (ids, experts, ranks, most, experts)
        return OpCall(args, args,
                      lambda: PR.local_send_plan(ids, experts, ranks, max_tokens_per_rank=most,
                                                 check_ids=False),
                      lambda: reference.local_send_plan(ids, experts, ranks,
                                                        max_tokens_per_rank=most), 5)
    if name == "permute_by_expert":
        local = experts // 2
        args = (ids, experts, local // 2, local, 4)
        kwargs = dict(first_expert=local // 2, num_local_experts=local, align=4)
        return OpCall(args + config_fields(PM.DEFAULT_PERMUTE), args,
                      lambda: PM.permute_by_expert(ids, experts, **kwargs, check_ids=False),
                      lambda: reference.permute_by_expert(ids, experts, **kwargs), 4)
    perm = reference.permute_by_expert(ids, experts)
    gs = reference.nvfp4_global_scale(x)
    packed, scales = reference.quantize_nvfp4(x, gs)
    if name == "gather_rows":
        args = (packed, perm.source_rows, scales, top_k)
        return OpCall(args, args,
                      lambda: G.gather_rows(packed, perm, scales=scales, check_values=False),
                      lambda: reference.gather_rows(packed, perm, scales=scales), 2)
    if name == "permute_and_gather":
        args = (ids, packed, scales, experts, 0, experts, 1)
        perm_gather = functools.partial(PM.permute_and_gather, ids, packed, experts,
                                        scales=scales)
        # (the public function's (permutation, out, out_scales) as the op orders them)
        return OpCall(args + config_fields(PM.DEFAULT_PERMUTE) + config_fields(PM.DEFAULT_GATHER),
                      args,
                      lambda: _gathered_first(perm_gather(check_ids=False)),
                      lambda: _gathered_first(reference.permute_and_gather(ids, packed, experts,
                                                                           scales=scales)), 6)
    if name == "unpermute_and_reduce":
        expert_out = _randn(g, tokens * top_k, hidden, dtype=torch.bfloat16, device=device)
        args = (expert_out, perm.inverse, weights)
        return OpCall(args, args,
                      lambda: G.unpermute_and_reduce(expert_out, perm, weights,
                                                     check_values=False),
                      lambda: reference.unpermute_and_reduce(expert_out, perm, weights), 1)
    if name == "nvfp4_global_scale":
        return OpCall((x,) + config_fields(Q.DEFAULT_AMAX), (x,),
                      lambda: Q.nvfp4_global_scale(x),
                      lambda: reference.nvfp4_global_scale(x), 1)
    if name == "quantize_nvfp4":
        rows = torch.tensor([tokens - 1, 0, tokens // 2], dtype=torch.int32, device=device)
        args = (x, gs, "swizzled_128x4", False, rows)
        kwargs = dict(layout="swizzled_128x4", rows=rows)
        return OpCall(args + config_fields(Q.DEFAULT_NVFP4), args,
                      lambda: Q.quantize_nvfp4(x, gs, **kwargs, check_values=False),
                      lambda: reference.quantize_nvfp4(x, gs, **kwargs), 2)
    if name == "quantize_nvfp4_out":
        def buffers():
            return (torch.zeros(tokens, hidden // 2, dtype=torch.uint8, device=device),
                    torch.zeros(tokens, hidden // 16, dtype=torch.uint8, device=device))
        head = (x, gs, "linear", False, None)
        # each caller its own buffers, made here: a timed call allocates nothing
        out, out_scales = buffers()
        return OpCall(head + buffers() + config_fields(Q.DEFAULT_NVFP4), head + buffers(),
                      lambda: Q.quantize_nvfp4(x, gs, out=out, out_scales=out_scales,
                                               check_values=False),
                      lambda: reference.quantize_nvfp4(x, gs), 0, mutated=(5, 6))
    if name == "scale_and_quantize_nvfp4":
        args = (x, "swizzled_128x4", False)
        return OpCall(args + config_fields(Q.DEFAULT_AMAX) + config_fields(Q.DEFAULT_NVFP4),
                      args,
                      lambda: Q.scale_and_quantize_nvfp4(x, layout="swizzled_128x4",
                                                         check_values=False),
                      lambda: reference.scale_and_quantize_nvfp4(x, layout="swizzled_128x4"),
                      3)
    if name in ("quantize_mxfp8", "quantize_mxfp4"):
        public, oracle = getattr(Q, name), getattr(reference, name)
        return OpCall((x,) + config_fields(Q.DEFAULT_BLOCK), (x,), lambda: public(x),
                      lambda: oracle(x), 2)
    if name == "dequantize_nvfp4":
        sw_packed, sw_scales = reference.quantize_nvfp4(x, gs, layout="swizzled_128x4")
        args = (sw_packed, sw_scales, gs, "swizzled_128x4", torch.bfloat16)
        kwargs = dict(layout="swizzled_128x4", dtype=torch.bfloat16)
        return OpCall(args + config_fields(Q.DEFAULT_BLOCK), args,
                      lambda: Q.dequantize_nvfp4(sw_packed, sw_scales, gs, **kwargs,
                                                 check_values=False),
                      lambda: reference.dequantize_nvfp4(sw_packed, sw_scales, gs, **kwargs),
                      1)
    if name in ("dequantize_mxfp8", "dequantize_mxfp4"):
        codes, mx_scales = getattr(reference, name.replace("dequantize", "quantize"))(x)
        public, oracle = getattr(Q, name), getattr(reference, name)
        args = (codes, mx_scales, torch.float32)
        return OpCall(args + config_fields(Q.DEFAULT_BLOCK), args,
                      lambda: public(codes, mx_scales), lambda: oracle(codes, mx_scales), 1)
    linear = scales
    if name == "swizzle_scales":
        args = (linear, "swizzled_128x4")
        return OpCall(args, args, lambda: Q.swizzle_scales(*args),
                      lambda: reference.swizzle_scales(*args), 1)
    if name == "unswizzle_scales":
        swizzled = reference.swizzle_scales(linear, "swizzled_128x4")
        args = (swizzled, "swizzled_128x4", tokens, hidden // 16)
        return OpCall(args, args, lambda: Q.unswizzle_scales(*args),
                      lambda: reference.unswizzle_scales(*args), 1)
    raise ValueError(f"no call of op {name!r}")


def _gathered_first(result: tuple) -> tuple:
    """``permute_and_gather``'s (permutation, rows...) as its op orders them: rows first."""
    return (*result[1:], result[0])


def tensors_of(result) -> tuple:
    """The tensors of a result, flat: a Permutation's four buffers, a LocalSendPlan's five."""
    from kernels.types import LocalSendPlan, Permutation
    if result is None:
        return ()
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, Permutation):
        return (result.source_rows, result.expert_counts, result.expert_offsets,
                result.inverse)
    if isinstance(result, LocalSendPlan):
        return tuple(result.tensors().values())
    return tuple(t for part in result for t in tensors_of(part))


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern (NaN payloads included) as an integer tensor of its shape."""
    t = t.contiguous()
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                       8: torch.int64}[t.element_size()])
    return t


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------

def _ops_names() -> tuple[str, ...]:
    from kernels.ops import OP_NAMES
    return OP_NAMES


def _build(shape: dict, device: torch.device, ctx=None) -> dict:
    call = op_call(shape["op"], device, shape["tokens"], shape["hidden"], shape["experts"],
                   shape["top_k"])
    return {"call": call}


def _outputs(call: OpCall, args: tuple, result) -> tuple:
    """What a row compares: the out= buffers it wrote, else its leading outputs; as bits,
    except the tolerant outputs."""
    outputs = (tuple(args[i] for i in call.mutated) if call.mutated
               else tensors_of(result)[:call.compared or None])
    return tuple(t if i in call.tolerant else bits(t) for i, t in enumerate(outputs))


def _paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    from kernels.ops import registered_ops
    call: OpCall = inputs["call"]
    op = registered_ops()[shape["op"]]
    device = next(t for t in call.triton if isinstance(t, torch.Tensor)).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    def row(backend: str, run: Callable, args: tuple, timed: str) -> Path:
        path = make_path(backend, lambda: run, timed=timed)
        return dataclasses.replace(path, normalize=lambda result: _outputs(call, args, result))

    def public_outputs(result):
        outputs = tensors_of(result)
        return tuple(t if i in call.tolerant else bits(t) for i, t in enumerate(outputs))

    def raw():
        return op.launch(*call.triton)

    def with_host_times(path: Path) -> Path:
        """``paired_us``: the host's time per call of this row and of the raw launch, timed
        in alternation (``bench.timing.time_host_interleaved``; the target reads them)."""
        if device.type != "cuda" or path.run is None:
            return path
        from bench.timing import time_host_interleaved

        def facts() -> dict:
            times = time_host_interleaved({path.backend: path.run, "triton_raw": raw}, device)
            return {"paired_us": {name: round(t.median_us, 3) for name, t in times.items()}}
        return dataclasses.replace(path, facts=facts)

    public = make_path("triton_public", lambda: call.public,
                       timed="timed: the public function (eager bypass)")
    public = dataclasses.replace(public, normalize=public_outputs)
    return [row("triton_raw", raw, call.triton, "timed: RegisteredOp.launch, no dispatcher"),
            with_host_times(public),
            with_host_times(row("triton_op", lambda: op.triton(*call.triton), call.triton,
                                f"timed: torch.ops.moe_a2a.{shape['op']}.triton through the "
                                f"dispatcher")),
            row("torch", lambda: op.torch(*call.torch), call.torch,
                f"the oracle overload torch.ops.moe_a2a.{shape['op']}.torch")]


def _check(out, ref, inputs, shape) -> None:
    assert_same(out, ref, what=shape["op"], tol=ROUTING_WEIGHT_TOL)


def _traffic(shape: dict, inputs=None) -> dict:
    """The bytes of the op's tensor arguments (its outputs are of the same order): the stage
    is about the host's cost per call, not bandwidth."""
    if inputs is None:
        return {"local": 0}
    return {"local": sum(t.numel() * t.element_size() for t in inputs["call"].triton
                         if isinstance(t, torch.Tensor))}


@dataclass(frozen=True)
class OpsStage(Stage):
    """One shape per op: DeepSeek-R1's dimensions at T=16 on a sweep with H=7168 (every GPU
    sweep), else (the interpreter's grids) the sweep's smallest dimensions at its smallest T."""

    def shapes(self, sweep: Sweep) -> list[dict]:
        if OPS_DIMS["hidden"] in sweep.hidden:
            dims = {key: (value,) for key, value in OPS_DIMS.items()}
            dims["tokens"] = (OPS_TOKENS,)
        else:
            dims = {key: (min(sweep.values(key)),) for key in OPS_DIMS}
            dims["tokens"] = (min(sweep.tokens),)
        shapes = super().shapes(dataclasses.replace(sweep, extra_shapes=False, **dims))
        return [dict(shape, op=name) for shape in shapes for name in _ops_names()]


OPS = OpsStage(
    name="ops", keys=("tokens", "hidden", "experts", "top_k"), build=_build, paths=_paths,
    check=_check, traffic=_traffic, dtype=lambda shape: "bf16",
    valid=lambda shape: shape["experts"] % DEEPSEEK_GROUPS == 0)
