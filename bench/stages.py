"""The single-device stages as small specs: shapes, inputs, paths, check, bytes moved.

A :class:`Stage` says which shape keys it sweeps, how to build its inputs, which paths
(backends) can run them, how to compare a path's output with the oracle's (the ``torch`` path,
``kernels.reference``), and how many bytes an ideal kernel moves (the ``traffic`` formula,
written out per stage below). The loop that runs them all is ``bench/runner.py``; the stages that
need several ranks are in ``bench/transport.py``.

A path whose backend cannot run here is listed with the reason instead of a function
(:class:`Path` with ``run=None``): the stage switch's ``a2a.backends.why_unavailable`` gives it.

The library is imported inside the functions, never at module level: the bench decides whether
Triton interprets (``TRITON_INTERPRET``, bench/cli.py) before anything imports triton.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from bench.timing import brief_error

# Float outputs are compared with the library's one table; index outputs and quantized codes /
# scales exactly.
from kernels.spec import FLOAT_TOLERANCES as TOLERANCES  # noqa: E402
# Routing weights of FlashInfer's fused kernels are computed in another order (fast exp, other
# summation order): compared a little looser than fp32 round-off.
ROUTING_WEIGHT_TOL = dict(atol=1e-4, rtol=1e-4)

# DeepSeek-V3 routing: 8 expert groups, keep the best 4, scale the weights by 2.5.
DEEPSEEK_GROUPS, DEEPSEEK_TOPK_GROUPS, DEEPSEEK_SCALING = 8, 4, 2.5
# Ranks of the single-device prepare (the local send plan of one rank of an EP8 deployment).
PREPARE_EP_SIZE = 8
# Popularity exponent of skewed routing: expert e is drawn with weight 1/(e+1)^SKEW_EXPONENT
# (Zipf-like: with E=256 the top 8 experts take ~half of the pairs).
SKEW_EXPONENT = 1.2
SEED = 0
# torch.compile of the oracle: dynamo's recompile limit while the compiled oracle runs (its
# default, 8, is below the number of quantize shapes and layouts of a sweep; past it dynamo
# would silently run the function eagerly).
COMPILE_RECOMPILE_LIMIT = 256


class Unavailable(Exception):
    """A path cannot run here; the message (``"not available: ..."``) says why."""


@dataclass(frozen=True)
class Path:
    """One way to compute a stage.

    run:       the timed call, or None when the path cannot run (``reason`` says why).
    normalize: untimed, turns ``run``'s output into what ``Stage.check`` compares (default: as is).
    before:    untimed, run before each call (e.g. the dispatch a one-sided combine needs).
    after:     untimed, run after each call (e.g. the combine that must follow that dispatch).
    checked:   untimed, the same op with all its input checks, when ``run`` is a fast path that
               skips them (e.g. ``check_ids=False``): checked against the oracle too.
    capture_safe: ``run`` does no host sync (no ``.item()``, no data-dependent shapes), so a
               CUDA graph can capture it. Only such paths are timed by graph replay (on stages
               with ``graph=True``); the default is False, i.e. eager timing.
    timed:     which call is timed, when that is not obvious (shown in the row's note).
    check:     this path's own check, when it differs from ``Stage.check`` (same signature;
               e.g. FlashInfer's routing, allowed to differ on near-ties).
    facts:     untimed, after the path is timed: more fields for its record, each also named
               in the note (e.g. the decode chain's ``launches``).
    """

    backend: str
    run: Optional[Callable[[], Any]] = None
    reason: str = ""
    normalize: Optional[Callable[[Any], Any]] = None
    before: Optional[Callable[[], Any]] = None
    after: Optional[Callable[[], Any]] = None
    checked: Optional[Callable[[], Any]] = None
    capture_safe: bool = False
    timed: str = ""
    check: Optional[Callable[[Any, Any, dict, dict], Optional[str]]] = None
    facts: Optional[Callable[[], dict]] = None


@dataclass(frozen=True)
class Sweep:
    """The shape grid; each stage takes the product over the keys it uses."""

    tokens: tuple[int, ...]
    hidden: tuple[int, ...]
    experts: tuple[int, ...]
    top_k: tuple[int, ...]
    routing: tuple[str, ...]
    extra_shapes: bool = False  # add the shapes that have targets (bench/targets.py)

    def values(self, key: str) -> tuple:
        return {"tokens": self.tokens, "hidden": self.hidden, "experts": self.experts,
                "top_k": self.top_k, "routing": self.routing}[key]

    def describe(self) -> str:
        """The grid in words, e.g. ``T {16,512} x H 7168 x E 256 x k 8, uniform routing``."""
        def axis(name, values):
            return f"{name} {values[0]}" if len(values) == 1 else \
                f"{name} {{{','.join(str(v) for v in values)}}}"
        grid = " x ".join(axis(name, values) for name, values in (
            ("T", self.tokens), ("H", self.hidden), ("E", self.experts), ("k", self.top_k)))
        targets = ", plus the target shapes" if self.extra_shapes else ""
        return f"{grid}, {' and '.join(self.routing)} routing{targets}"


# The full grid: 6 token counts x H {4096, 7168} x E {64, 256} x k {4, 8} x 2 routings, plus the
# target shapes. Too big for one GPU call at large T: bench/cli.py's --budget (GPU default)
# stops starting shapes at the deadline and lists the ones it skipped.
DEFAULT_SWEEP = Sweep(tokens=(1, 16, 128, 512, 2048, 8192), hidden=(4096, 7168),
                      experts=(64, 256), top_k=(4, 8), routing=("uniform", "skewed"),
                      extra_shapes=True)
# DeepSeek-V3 shapes only (H=7168, E=256, k=8) over the token counts (with the decode sizes 64
# and 256 of the routing and permute targets), both routings, plus the target shapes: about a
# third of the default, sized to finish in one GPU call.
DEEPSEEK_SWEEP = Sweep(tokens=(1, 16, 64, 128, 256, 512, 2048, 8192), hidden=(7168,),
                       experts=(256,), top_k=(8,), routing=("uniform", "skewed"),
                       extra_shapes=True)
# The Triton transport's targets (E=32, k=8, H=7168) over every token count: dispatch and combine.
TRANSPORT_SWEEP = Sweep(tokens=(1, 16, 128, 512, 2048, 8192), hidden=(7168,), experts=(32,),
                        top_k=(8,), routing=("uniform",), extra_shapes=True)
QUICK_SWEEP = Sweep(tokens=(16, 512, 8192), hidden=(7168,), experts=(256,), top_k=(8,),
                    routing=("uniform",))
# Without a GPU every Triton kernel runs in the interpreter: tiny shapes only.
CPU_SWEEP = Sweep(tokens=(1, 7, 33), hidden=(256,), experts=(16,), top_k=(4,),
                  routing=("uniform", "skewed"))
CPU_QUICK_SWEEP = Sweep(tokens=(7,), hidden=(128,), experts=(16,), top_k=(4,),
                        routing=("uniform",))


@dataclass(frozen=True)
class Stage:
    """A stage of the MoE layer as the bench sees it.

    keys:      shape keys swept from :class:`Sweep` (the product, deduplicated).
    variants:  extra per-stage shape entries, each a dict merged into every grid point
               (e.g. the quantize formats); ``valid`` filters impossible combinations;
               ``unused(shape)`` names grid keys a variant ignores (dropped, then deduplicated).
    extra:     shapes added when the sweep asks for the target shapes (bench/targets.py).
    build:     ``(shape, device, ctx) -> inputs`` (a dict), deterministic from SEED.
    paths:     ``(inputs, shape, ctx) -> list[Path]``; must include the ``torch`` oracle.
    check:     ``(out, ref, inputs, shape) -> None``, raises AssertionError on a mismatch (may
               return a short remark instead of None, shown in the row's note).
    traffic:   ``(shape, inputs) -> {"local": bytes}`` (and ``"remote"`` for transports): the
               bytes an ideal implementation moves; the formulas are written next to each stage
               (``inputs`` is None when they could not be built).
    dtype:     ``shape -> str``, the payload dtype named in the record.
    graph:     launch-bound: time the paths declared ``capture_safe`` by CUDA-graph replay.
    flush:     with ``graph``: an L2 flush before each call in the graph (its time subtracted).
    distributed: needs one process per GPU (bench/transport.py).
    """

    name: str
    keys: tuple[str, ...]
    build: Callable[..., dict]
    paths: Callable[[dict, dict, Any], list[Path]]
    check: Callable[[Any, Any, dict, dict], None]
    traffic: Callable[..., dict]
    dtype: Callable[[dict], str]
    variants: tuple[dict, ...] = ({},)
    valid: Callable[[dict], bool] = lambda shape: True
    unused: Callable[[dict], tuple] = lambda shape: ()
    extra: Callable[[], Iterable[dict]] = lambda: ()
    graph: bool = False
    flush: bool = False
    distributed: bool = False
    oracle: Optional[str] = "torch"

    def shapes(self, sweep: Sweep) -> list[dict]:
        grid = itertools.product(*(sweep.values(k) for k in self.keys))
        shapes = [{**variant, **dict(zip(self.keys, point))}
                  for point in grid for variant in self.variants]
        shapes = [{k: v for k, v in shape.items() if k not in self.unused(shape)}
                  for shape in shapes]
        if sweep.extra_shapes:  # the target shapes whose token count the sweep has
            shapes += [dict(s) for s in self.extra() if s.get("tokens") in sweep.tokens]
        unique: list[dict] = []
        for shape in shapes:
            if self.valid(shape) and shape not in unique:
                unique.append(shape)
        return unique


# ---------------------------------------------------------------------------------------------
# Helpers shared by the stages
# ---------------------------------------------------------------------------------------------

def make_path(backend: str, factory: Callable[[], Callable[[], Any]], **kwargs) -> Path:
    """A :class:`Path` from ``factory() -> run``; an :class:`Unavailable` or the stage switch's
    ``a2a.backends.BackendUnavailable`` raised while building it becomes the reason; any other
    error too, as ``"error: ..."`` (the runner marks that path failed, ok=False)."""
    try:
        return Path(backend, run=factory(), **kwargs)
    except Unavailable as why:
        return Path(backend, reason=str(why), **kwargs)
    except Exception as error:  # the switch refused, or building the path failed
        from a2a.backends import BackendUnavailable
        if isinstance(error, BackendUnavailable):
            lines = str(error).strip().splitlines()
            return Path(backend, reason=f"not available: {lines[0] if lines else ''}", **kwargs)
        return Path(backend, reason=f"error: setup failed: {brief_error(error)}"[:300], **kwargs)


def stage_backend(stage: str, backend: str, device: torch.device, **context) -> None:
    """Raise :class:`Unavailable` when the stage switch says ``backend`` cannot run ``stage``
    (``context``: what the stage's rule needs, e.g. ``method=`` for routing)."""
    from a2a.backends import why_unavailable
    why = why_unavailable(stage, backend, device, **context)
    if why is not None:
        raise Unavailable(f"not available: {why}")


def generator(device: torch.device, salt: int = 0) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(SEED + salt)
    return gen


def make_topk(tokens: int, experts: int, top_k: int, routing: str, device: torch.device,
              salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct expert ids per token and their weights (rows sum to 1).

    uniform: every expert equally likely; skewed: expert e drawn with weight 1/(e+1)^1.2
    (Gumbel top-k: k distinct draws without replacement). Returns ids [T, k] int32 and
    weights [T, k] float32.
    """
    gen = generator(device, salt)
    noise = -torch.log(-torch.log(torch.rand(tokens, experts, generator=gen, device=device)
                                  .clamp_(1e-9, 1 - 1e-7)))
    if routing == "skewed":
        popularity = torch.arange(1, experts + 1, device=device, dtype=torch.float32)
        noise = noise - SKEW_EXPONENT * torch.log(popularity)
    elif routing != "uniform":
        raise ValueError(f"routing={routing!r} must be 'uniform' or 'skewed'")
    ids = noise.topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen, device=device).softmax(dim=1)
    return ids.contiguous(), weights.contiguous()


def assert_same(out: Any, ref: Any, *, what: str = "output", tol: Optional[dict] = None) -> None:
    """Compare nested tuples / dataclasses / tensors: integer and byte tensors exactly, floats
    with :data:`TOLERANCES` (or ``tol``). Raises AssertionError naming the differing part."""
    if hasattr(ref, "tensors") and callable(ref.tensors):
        ref_fields, out_fields = ref.tensors(), out.tensors()
        for name, value in ref_fields.items():
            assert_same(out_fields.get(name), value, what=f"{what}.{name}", tol=tol)
        return
    if isinstance(ref, (tuple, list)):
        assert isinstance(out, (tuple, list)) and len(out) == len(ref), \
            f"{what}: expected {len(ref)} parts, got {type(out).__name__}"
        for i, (o, r) in enumerate(zip(out, ref)):
            assert_same(o, r, what=f"{what}[{i}]", tol=tol)
        return
    if not isinstance(ref, torch.Tensor):
        assert out == ref, f"{what}: {out!r} != {ref!r}"
        return
    assert isinstance(out, torch.Tensor), f"{what}: expected a tensor, got {type(out).__name__}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    if ref.dtype in TOLERANCES:
        try:
            torch.testing.assert_close(out, ref, **(tol or TOLERANCES[ref.dtype]))
        except AssertionError as error:
            raise AssertionError(f"{what}: {str(error).splitlines()[0]}") from None
        return
    if ref.dtype.is_floating_point:  # fp8 and other byte formats: bit-exact
        out, ref = out.view(torch.uint8), ref.view(torch.uint8)
    mismatched = int((out != ref).sum())
    assert mismatched == 0, f"{what}: {mismatched} of {ref.numel()} entries differ"


# ---------------------------------------------------------------------------------------------
# Routing: logits [T, E] fp32 -> ids [T, k] int32, weights [T, k] fp32
# ---------------------------------------------------------------------------------------------

def routing_inputs(shape: dict, device: torch.device, ctx=None) -> dict:
    """The routing stage's inputs for ``shape``: ``logits`` [T, E] fp32 (skewed: expert e's
    logit lowered by 1.2 * log(e+1)) and the method's ``options`` (DeepSeek-V3: bias [E] fp32,
    8 groups keep 4, scaling 2.5)."""
    gen = generator(device, 1)
    tokens, experts = shape["tokens"], shape["experts"]
    logits = torch.randn(tokens, experts, generator=gen, device=device, dtype=torch.float32)
    if shape["routing"] == "skewed":
        popularity = torch.arange(1, experts + 1, device=device, dtype=torch.float32)
        logits -= SKEW_EXPONENT * torch.log(popularity)
    bias = 0.1 * torch.randn(experts, generator=gen, device=device, dtype=torch.float32)
    if shape["method"] == "deepseek_v3":
        options = dict(bias=bias, num_groups=DEEPSEEK_GROUPS, topk_groups=DEEPSEEK_TOPK_GROUPS,
                       routed_scaling=DEEPSEEK_SCALING)
    else:
        options = {}
    return dict(logits=logits, options=options)


def _routing_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    logits, k, method, options = inputs["logits"], shape["top_k"], shape["method"], \
        inputs["options"]

    def public(backend):
        def factory():
            from a2a.routing import route_topk
            stage_backend("routing", backend, logits.device, method=method)
            return lambda: route_topk(logits, k, method, backend=backend, **options)
        return factory

    def oracle():
        from kernels.reference import route_topk
        return lambda: route_topk(logits, k, method, **options)

    # Both kernels' argument checks are host-side only (no reads of the logits).
    return [make_path("triton", public("triton"), capture_safe=True),
            make_path("flashinfer", public("flashinfer"), capture_safe=True,
                      check=check_routing_near_ties if method == "deepseek_v3" else None),
            make_path("torch", oracle)]


def check_routing(out, ref, inputs, shape) -> None:
    """Same set of ids per token (order inside a row may differ: FlashInfer sorts by weight,
    ties aside), same weight for each id."""
    (ids, weights), (ref_ids, ref_weights) = out, ref
    order, ref_order = ids.long().argsort(dim=1), ref_ids.long().argsort(dim=1)
    assert_same(ids.gather(1, order), ref_ids.gather(1, ref_order), what="ids")
    assert_same(weights.gather(1, order), ref_weights.gather(1, ref_order), what="weights",
                tol=ROUTING_WEIGHT_TOL)


def check_routing_near_ties(out, ref, inputs, shape, *,
                            allowed_rows: Optional[float] = None) -> Optional[str]:
    """FlashInfer's fused_topk_deepseek (sigmoid via tanh): the id set of a row may differ from
    the oracle's only on a near-tie (bench/near_ties.py), in at most MAX_NEAR_TIE_ROWS of the
    rows (or ``allowed_rows`` rows: what is left of an allowance over several calls); the rows
    whose sets agree are checked as :func:`check_routing` does. Returns a remark for the row's
    note ("" when every set agrees)."""
    from bench.near_ties import MAX_NEAR_TIE_ROWS, near_ties
    (ids, weights), (ref_ids, ref_weights) = out, ref
    assert_same(ids.dtype, ref_ids.dtype, what="ids dtype")
    assert ids.shape == ref_ids.shape, f"ids: shape {tuple(ids.shape)} != {tuple(ref_ids.shape)}"
    sorted_ids, order = ids.long().sort(dim=1)
    ref_sorted, ref_order = ref_ids.long().sort(dim=1)
    differ = (sorted_ids != ref_sorted).any(dim=1)
    num_differ = int(differ.sum())
    if num_differ:
        options = inputs["options"]
        near, _ = near_ties(inputs["logits"], options["bias"], shape["top_k"],
                            options["num_groups"], options["topk_groups"])
        unexplained = (differ & ~near).nonzero().flatten().tolist()
        assert not unexplained, (f"ids: rows {unexplained[:5]} differ without a near-tie "
                                 f"({len(unexplained)} such rows)")
        if allowed_rows is None:
            allowed, of = MAX_NEAR_TIE_ROWS * max(ids.shape[0], 1), \
                f"{MAX_NEAR_TIE_ROWS:.1%} of {ids.shape[0]}"
        else:
            allowed, of = allowed_rows, f"the {allowed_rows:g} rows left of the allowance"
        assert num_differ <= allowed, f"ids: {num_differ} near-tie rows differ, more than {of}"
    same = ~differ
    assert_same(weights.gather(1, order)[same], ref_weights.gather(1, ref_order)[same],
                what="weights", tol=ROUTING_WEIGHT_TOL)
    return (f"{num_differ} near-tie row(s) pick another id set (allowed: sigmoid via tanh)"
            if num_differ else "")


def _routing_traffic(shape: dict, inputs=None) -> dict:
    # Read the logits T*E*4 (+ the bias E*4 for deepseek_v3), write ids and weights T*k*(4+4).
    t, e, k = shape["tokens"], shape["experts"], shape["top_k"]
    bias = 4 * e if shape["method"] == "deepseek_v3" else 0
    return {"local": 4 * t * e + bias + 8 * t * k}


def _routing_valid(shape: dict) -> bool:
    if shape["method"] != "deepseek_v3":
        return True
    e = shape["experts"]
    per_group = e // DEEPSEEK_GROUPS
    # A group's score sums its top-2 experts: groups of at least 2.
    return (e % DEEPSEEK_GROUPS == 0 and per_group >= 2
            and DEEPSEEK_TOPK_GROUPS * per_group >= shape["top_k"])


ROUTING = Stage(
    name="routing", keys=("tokens", "experts", "top_k", "routing"),
    variants=({"method": "softmax_topk"}, {"method": "deepseek_v3"}),
    valid=_routing_valid,
    extra=lambda: [dict(method="deepseek_v3", tokens=8192, experts=256, top_k=8,
                        routing="uniform"),
                   dict(method="softmax_topk", tokens=8192, experts=128, top_k=4,
                        routing="uniform")],
    build=routing_inputs, paths=_routing_paths, check=check_routing,
    traffic=_routing_traffic, dtype=lambda shape: "fp32", graph=True)


# ---------------------------------------------------------------------------------------------
# Prepare (one rank's local send plan, EP8): ids [T, k] -> LocalSendPlan
# ---------------------------------------------------------------------------------------------

def _prepare_build(shape: dict, device: torch.device, ctx=None) -> dict:
    ids, _ = make_topk(shape["tokens"], shape["experts"], shape["top_k"], shape["routing"],
                       device)
    return dict(topk_ids=ids)


def _prepare_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    ids, experts, ep, tokens = inputs["topk_ids"], shape["experts"], shape["ep_size"], \
        shape["tokens"]

    def oracle():
        from kernels.reference import local_send_plan
        return lambda: local_send_plan(ids, experts, ep, max_tokens_per_rank=tokens)

    # No stage switch here: its "prepare" rule is about the cross-rank prepare (peer-mapped
    # memory); the local plan is a plain kernel that runs wherever Triton does.
    def triton(check_ids: bool):
        from kernels.prepare import local_send_plan
        return lambda: local_send_plan(ids, experts, ep, max_tokens_per_rank=tokens,
                                       check_ids=check_ids)

    # The id range check reads the ids back (a host sync): the call with it is checked against
    # the oracle too, the one without it is timed.
    path = make_path("triton", lambda: triton(False), capture_safe=True,
                     timed="timed: local_send_plan(check_ids=False)")
    if path.run is not None:
        path = dataclasses.replace(path, checked=triton(True))
    return [path, make_path("torch", oracle)]


def _prepare_traffic(shape: dict, inputs=None) -> dict:
    # Read ids T*k*4; write send_counts and their cumsum 2*R*4, the two index lists 2*N*R*4
    # (N = T here) and the per-expert counts E*4.
    t, e, k, r = shape["tokens"], shape["experts"], shape["top_k"], shape["ep_size"]
    return {"local": 4 * t * k + 8 * r + 8 * t * r + 4 * e}


PREPARE = Stage(
    name="prepare", keys=("tokens", "experts", "top_k", "routing"),
    variants=({"scope": "local", "ep_size": PREPARE_EP_SIZE},),
    valid=lambda shape: shape["experts"] % shape["ep_size"] == 0,
    extra=lambda: [dict(scope="local", ep_size=PREPARE_EP_SIZE, tokens=t, experts=256, top_k=8,
                        routing="uniform") for t in (16, 512, 8192)],
    build=_prepare_build, paths=_prepare_paths,
    check=lambda out, ref, inputs, shape: assert_same(out, ref, what="plan"),
    traffic=_prepare_traffic, dtype=lambda shape: "int32", graph=True)


# ---------------------------------------------------------------------------------------------
# Quantize: x [M, H] bf16 -> NVFP4 (linear or 128x4 scales), MXFP8, or the NVFP4 global scale
# ---------------------------------------------------------------------------------------------

def _quantize_build(shape: dict, device: torch.device, ctx=None) -> dict:
    gen = generator(device, 2)
    x = torch.randn(shape["tokens"], shape["hidden"], generator=gen, device=device,
                    dtype=torch.float32).to(torch.bfloat16)
    return dict(x=x)


def _quantize_call(fn: Callable, shape: dict, x: torch.Tensor,
                   global_scale: Optional[torch.Tensor], **backend) -> Callable[[], Any]:
    """The call of one quantize op, the same for every face. NVFP4 is called with
    ``check_values=False``: the global scale (the oracle's) is valid, and its value check would
    read the device (a host sync) in every timed call."""
    op = shape["op"]
    if op in ("global_scale", "mxfp8"):
        return lambda: fn(x, **backend)
    layout = "swizzled_128x4" if op == "nvfp4_swizzled" else "linear"
    return lambda: fn(x, global_scale, layout=layout, check_values=False, **backend)


QUANTIZE_OPS = ("nvfp4_linear", "nvfp4_swizzled", "mxfp8", "global_scale")
# Inductor options that keep the compiled oracle bit-exact with eager torch where Inductor
# allows it: emulate_precision_casts keeps eager's bf16/fp32 roundings between fused ops and
# turns off Triton's mul+add -> FMA contraction (enable_fp_fusion), which otherwise changes the
# last bit of the scale arithmetic and so some FP4 codes.
COMPILE_OPTIONS = {"emulate_precision_casts": True}
COMPILE_NOTE = "torch.compile(options={'emulate_precision_casts': True}): eager roundings, no FMA"


def quantize_functions(op: str) -> tuple[Callable, Callable]:
    """(the public stage function in ``a2a.quantize``, its oracle in ``kernels.reference``) of
    the quantize op ``op`` (one of :data:`QUANTIZE_OPS`)."""
    from a2a import quantize as public
    from kernels import reference
    if op == "mxfp8":
        return public.quantize_mxfp8, reference.quantize_mxfp8
    if op == "global_scale":
        return public.nvfp4_global_scale, reference.nvfp4_global_scale
    return public.quantize_nvfp4, reference.quantize_nvfp4


def _quantize_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    x, op = inputs["x"], shape["op"]
    holder: dict = {}

    def global_scale() -> Optional[torch.Tensor]:
        """The oracle's global scale for the NVFP4 ops (None for the others, which take none),
        computed once and shared by every path (untimed)."""
        if not op.startswith("nvfp4"):
            return None
        if "gs" not in holder:
            from kernels.reference import nvfp4_global_scale
            holder["gs"] = nvfp4_global_scale(x)
        return holder["gs"]

    def public(backend):
        def factory():
            fn, _ = quantize_functions(op)
            # The switch's rule for the op: FlashInfer has no global-scale kernel at all.
            context = {"op": "global_scale"} if op == "global_scale" else {}
            stage_backend("quantize", backend, x.device, **context)
            return _quantize_call(fn, shape, x, global_scale(), backend=backend)
        return factory

    def oracle():
        _, fn = quantize_functions(op)
        return _quantize_call(fn, shape, x, global_scale())

    def compiled():
        if x.device.type != "cuda":
            raise Unavailable("not available: torch.compile is timed on GPU only (the CPU run "
                              "checks the interpreter, its timings mean nothing)")
        import torch._dynamo
        _, fn = quantize_functions(op)
        cache = ctx.shared.setdefault("compiled", {})
        if fn not in cache:
            # One compiled function per oracle for the whole run; dynamic=True: one compile per
            # op (and layout) for all token counts.
            cache[fn] = torch.compile(fn, dynamic=True, options=COMPILE_OPTIONS)
        call = _quantize_call(cache[fn], shape, x, global_scale())

        def run():
            # Past dynamo's recompile limit the function would silently run eagerly.
            with torch._dynamo.config.patch(recompile_limit=COMPILE_RECOMPILE_LIMIT):
                return call()
        return run

    # Triton and the compiled oracle: CUDA-graph replay, each call after an L2 flush (the
    # kernel from a cold cache without the host's launch cost, which eager timing would show
    # for the small shapes). A failed capture falls back to eager timing, with a remark.
    return [make_path("triton", public("triton"), capture_safe=True),
            make_path("flashinfer", public("flashinfer")),
            make_path("torch", oracle),
            make_path("torch_compile", compiled, timed=COMPILE_NOTE, capture_safe=True)]


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _quantize_traffic(shape: dict, inputs=None) -> dict:
    m, h = shape["tokens"], shape["hidden"]
    op = shape["op"]
    if op == "nvfp4_linear":
        # read bf16 2*M*H; write codes M*H/2 and e4m3 scales M*H/16: 2.5625*M*H.
        return {"local": 2 * m * h + m * h // 2 + m * h // 16}
    if op == "nvfp4_swizzled":
        # as linear, but the scales are padded to 128 rows x 4 columns.
        return {"local": 2 * m * h + m * h // 2 + _round_up(m, 128) * _round_up(h // 16, 4)}
    if op == "mxfp8":
        # read bf16 2*M*H; write e4m3 codes M*H and e8m0 scales M*H/32: 3.03125*M*H.
        return {"local": 2 * m * h + m * h + m * h // 32}
    # global_scale: read bf16 2*M*H (the 4-byte result is negligible).
    return {"local": 2 * m * h}


QUANTIZE = Stage(
    name="quantize", keys=("tokens", "hidden"),
    variants=tuple({"op": op} for op in QUANTIZE_OPS),
    extra=lambda: [dict(op="nvfp4_linear", tokens=8192, hidden=7168),
                   dict(op="nvfp4_linear", tokens=128, hidden=7168),
                   dict(op="mxfp8", tokens=8192, hidden=7168),
                   dict(op="global_scale", tokens=8192, hidden=7168)],
    build=_quantize_build, paths=_quantize_paths,
    check=lambda out, ref, inputs, shape: assert_same(out, ref, what=shape["op"]),
    traffic=_quantize_traffic, dtype=lambda shape: "bf16", graph=True, flush=True)


# ---------------------------------------------------------------------------------------------
# Permute: expert-major order, row gather, weighted un-permute (all experts local, align 1)
# ---------------------------------------------------------------------------------------------

def _permute_build(shape: dict, device: torch.device, ctx=None) -> dict:
    ids, weights = make_topk(shape["tokens"], shape["experts"], shape["top_k"],
                             shape["routing"], device)
    inputs = dict(topk_ids=ids, topk_weights=weights)
    if shape["op"] == "permute_by_expert":
        return inputs
    # The other two ops run on the oracle's permutation (the same input for every path).
    from kernels.reference import permute_by_expert
    permutation = permute_by_expert(ids, shape["experts"])
    gen = generator(device, 3)
    t, h, k = shape["tokens"], shape["hidden"], shape["top_k"]
    if shape["op"] == "gather_rows":
        inputs["x"] = torch.randn(t, h, generator=gen, device=device).to(torch.bfloat16)
        # Row of x each permuted row copies: its token (pair index // k); UNUSED stays UNUSED.
        source = permutation.source_rows
        inputs["rows"] = torch.where(source >= 0, source // k, source).to(torch.int32)
    else:
        inputs["expert_out"] = torch.randn(permutation.source_rows.numel(), h, generator=gen,
                                           device=device).to(torch.bfloat16)
    inputs["permutation"] = permutation
    return inputs


PERMUTE_OPS = ("permute_by_expert", "gather_rows", "unpermute_and_reduce")


def permute_functions(op: str) -> tuple[Callable, Callable]:
    """(the public stage function in ``a2a.permute``, its oracle in ``kernels.reference``) of
    the permute op ``op`` (one of :data:`PERMUTE_OPS`)."""
    from a2a import permute as public
    from kernels import reference
    if op == "permute_by_expert":
        return public.permute_by_expert, reference.permute_by_expert
    if op == "gather_rows":
        return public.gather_rows, reference.gather_rows
    return public.unpermute_and_reduce, reference.unpermute_and_reduce


def _permute_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    op, device = shape["op"], inputs["topk_ids"].device

    def call(fn, **options):
        if op == "permute_by_expert":
            return lambda: fn(inputs["topk_ids"], shape["experts"], **options)
        if op == "gather_rows":
            return lambda: fn(inputs["x"], inputs["rows"], **options)
        return lambda: fn(inputs["expert_out"], inputs["permutation"], inputs["topk_weights"],
                          **options)

    def public(backend, **options):
        def factory():
            fn, _ = permute_functions(op)
            stage_backend("permute", backend, device)
            return call(fn, backend=backend, **options)
        return factory

    if op == "permute_by_expert":
        # The id range check reads a device flag back (a host sync): the call with it is
        # checked against the oracle too, the one without it (check_ids=False) is timed.
        triton = make_path("triton", public("triton", check_ids=False), capture_safe=True,
                           timed="timed: permute_by_expert(check_ids=False)")
        if triton.run is not None:
            triton = dataclasses.replace(triton, checked=public("triton")())
    else:
        # The row-index range check reads a device flag back too: checked with it, timed
        # without it.
        triton = make_path("triton", public("triton", check_values=False), capture_safe=True,
                           timed=f"timed: {op}(check_values=False)")
        if triton.run is not None:
            triton = dataclasses.replace(triton, checked=public("triton")())
    return [triton, make_path("flashinfer", public("flashinfer")),
            make_path("torch", lambda: call(permute_functions(op)[1]))]


def _permute_traffic(shape: dict, inputs=None) -> dict:
    t, e, k = shape["tokens"], shape["experts"], shape["top_k"]
    pairs = t * k  # P = T*k permuted rows (all experts local, align 1)
    if shape["op"] == "permute_by_expert":
        # read ids P*4; write source_rows P*4, inverse P*4, counts E*4, offsets (E+1)*4.
        return {"local": 12 * pairs + 8 * e + 4}
    h = shape["hidden"]
    if shape["op"] == "gather_rows":
        # Effective bytes (the GB/s column, the unit of its target): read the row index P*4
        # and P rows of bf16, write P rows: 4*P*H + 4*P. Each token row is read k times, mostly
        # from L2: the % limit column uses the HBM minimum instead, T rows read once:
        # 2*T*H + 2*P*H + 4*P.
        return {"local": 4 * pairs * h + 4 * pairs,
                "hbm_local": 2 * t * h + 2 * pairs * h + 4 * pairs}
    # unpermute_and_reduce: read P rows of bf16, inverse and weights T*k*(4+4); write T rows.
    return {"local": 2 * pairs * h + 8 * pairs + 2 * t * h}


PERMUTE = Stage(
    name="permute", keys=("tokens", "hidden", "experts", "top_k", "routing"),
    variants=tuple({"op": op} for op in PERMUTE_OPS),
    extra=lambda: [dict(op=op, tokens=8192, hidden=7168, experts=256, top_k=8,
                        routing="uniform") for op in ("gather_rows", "unpermute_and_reduce")],
    build=_permute_build, paths=_permute_paths,
    check=lambda out, ref, inputs, shape: assert_same(out, ref, what=shape["op"]),
    traffic=_permute_traffic,
    unused=lambda shape: ("hidden",) if shape["op"] == "permute_by_expert" else (),
    dtype=lambda shape: "int32" if shape["op"] == "permute_by_expert" else "bf16",
    graph=True)


SINGLE_DEVICE_STAGES = (ROUTING, PREPARE, QUANTIZE, PERMUTE)
