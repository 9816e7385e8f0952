"""The ``decode`` stage: one rank's whole single-GPU decode step, timed as one CUDA graph.

The chain, on DeepSeek-R1-FP4 shapes on a GPU (E=256 experts, k=8, 8 expert groups keep 4,
routed scaling 2.5, H=7168, x bf16; the interpreter runs tiny ones, :class:`DecodeStage`)::

    route_topk(logits [T, E] fp32, "deepseek_v3")     -> topk_ids [T, k] int32, weights [T, k] fp32
    scale_and_quantize_nvfp4(x)                      -> packed [T, H/2] uint8, scales [T, H/16],
        (nvfp4_global_scale(x), then quantize_nvfp4     global_scale [1] fp32
         with it: 2 launches at decode sizes)
    local_send_plan(topk_ids, E, ep_size)            -> LocalSendPlan (who sends what where)
    permute_by_expert(topk_ids, E)                   -> Permutation, P = T*k permuted rows
    gather_rows(packed, source_rows, scales=scales)  -> [P, H/2] uint8, [P, H/16] uint8
        (payload "nvfp4": the rows a receiving rank hands its grouped GEMM), or
    gather_rows(x, source_rows)                      -> [P, H] bf16   (payload "bf16")
    unpermute_and_reduce(expert_out [P, H] bf16, permutation, weights) -> [T, H] bf16

On the Triton rows the permutation and the gather run as one op, ``permute_and_gather``
(kernels/permute.py: at decode sizes the programs that place the pairs also move their rows,
one launch instead of two), except where the ``triton_overlap`` row keeps the NVFP4 gather
apart (:func:`run_chain_overlapped`); the oracle runs the two ops.

``expert_out`` is a stand-in for the expert GEMMs' output (fixed random bf16 rows): the chain is
everything around the experts. ``ep_size = 1`` (the shape's ``R``) models a rank that owns every
expert: its send plan sends every token to itself, so the transport between the quantize and the
permutation is the identity and the receiving rank's inputs are this rank's own ids and
quantized rows. The plan is still computed (and checked), as every EP step computes it. With
the ``bf16`` payload the sender still quantizes and the receiver gathers the bf16 rows instead
(what a bf16 dispatch delivers): the chain as it was first timed, which the T=2048 target keeps
(bench/targets.py).

In that order two steps follow a kernel that did not write their inputs, and the ``triton``
row says so (``overlap_previous=True``, kernels/hardware.py): the quantize (x, after the
routing) and the permutation (the ids, after the plan: with ``ep_size = 1`` no transport runs
between them). With PDL each reads its inputs while the kernel before it still runs. A rank
whose transport delivers the ids just before its permutation could not promise that: there
the permutation's first launch waits first, as every other step's does.

Paths (rows): ``triton`` (every op with ``backend="triton"`` and every check that reads the
device turned off, ``check_ids=False`` and ``check_values=False``: no host sync, so a CUDA
graph captures the whole chain),
``triton_compiled`` (the same chain under ``torch.compile(fullgraph=True)``, default mode:
Inductor launches the registered ops' kernels itself; timed by eager calls, GPU only),
``triton_compiled_graph`` (that compiled chain captured and replayed as one CUDA graph, as a
serving engine runs a compiled decode step; GPU only),
``triton_overlap`` (the ``triton`` row's ops with the quantize and the plan on streams of
their own beside the critical path route, permute, gather, unpermute,
:func:`run_chain_overlapped`: the graph holds a step's dependencies, not one line of launches;
GPU only),
``flashinfer_routing`` (the same chain with FlashInfer's ``fused_topk_deepseek`` as the routing
step: the one piece FlashInfer has on SM90), ``flashinfer`` (n/a: FlashInfer has no standalone
permutation, no global-scale op and, below SM100, no NVFP4 quantizer) and ``torch`` (the oracle,
``kernels.reference``, step by step).

Checks: a path's routing against the oracle's (ids exactly, weights with the routing tolerance;
FlashInfer's ids may differ on near-ties), then every later step against the oracle run on that
path's own routing (ids, plan, permutation and NVFP4 bits exactly, the output with the tolerance
table). On a GPU the chain is then captured in a CUDA graph and :data:`REPLAY_CHECKS` replays are
checked, each after new logits and activations are copied into the captured input buffers
(:func:`check_replays`), before the runner times it. Each row also records ``launches``: the
device activities (kernels, copies, memsets) one call of the chain makes, counted with
torch.profiler on a GPU. At the token counts where its target judges it
(:data:`PAIRED_TOKENS`), the ``triton_compiled_graph`` row also records ``paired_us``: its
graph and the ``triton`` row's timed again in alternation (:func:`paired_times`), which the
target reads. A row timed by graph replay also records ``one_graph_us`` (untimed by the
targets): the chain captured as a graph of one call, replayed back to back
(:func:`one_graph_time`), where the row's time is from one graph of many calls.

The library is imported inside the functions (bench/stages.py says why).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from bench.near_ties import MAX_NEAR_TIE_ROWS
from bench.stages import (DEEPSEEK_GROUPS, DEEPSEEK_SCALING, DEEPSEEK_TOPK_GROUPS, PERMUTE,
                          PREPARE, QUANTIZE, ROUTING, ROUTING_WEIGHT_TOL, Path, Stage, Sweep,
                          Unavailable, assert_same, check_routing_near_ties, generator,
                          make_path, stage_backend)

# DeepSeek-R1-FP4's dimensions: the chain's shape on every GPU sweep (DecodeStage).
DEEPSEEK_R1 = {"hidden": 7168, "experts": 256, "top_k": 8}
# Token counts of the decode sweep (--sweep decode): decode batches per rank, 1 to 2048.
DECODE_TOKENS = (1, 16, 64, 256, 2048)
DECODE_SWEEP = Sweep(tokens=DECODE_TOKENS, hidden=(DEEPSEEK_R1["hidden"],),
                     experts=(DEEPSEEK_R1["experts"],), top_k=(DEEPSEEK_R1["top_k"],),
                     routing=("uniform",), extra_shapes=True)
# Ranks of the expert-parallel group the chain models (see the module docstring).
DECODE_EP_SIZE = 1
PAYLOADS = ("nvfp4", "bf16")
# CUDA-graph replays checked against the oracle, each with fresh inputs, before the timing.
REPLAY_CHECKS = 10
# Calls of the chain profiled to count its launches (after one warm call).
LAUNCH_COUNT_CALLS = 3
# Salts of bench.stages.generator: the stage's inputs, then replay r's fresh inputs (SALT + r).
INPUT_SALT = 40
ROUTING_METHOD = "deepseek_v3"
# The rows of the chain compiled by torch.compile (:class:`CompiledChain`): timed by eager calls,
# and captured and replayed as one CUDA graph.
COMPILED_BACKEND = "triton_compiled"
COMPILED_GRAPH_BACKEND = "triton_compiled_graph"
# The row of the same chain with the steps off its critical path on streams of their own
# (OverlappedChain).
OVERLAP_BACKEND = "triton_overlap"
# The token counts whose chain time has a target (bench/targets.py).
TARGET_TOKENS = (16, 64, 256, 2048)
# The token counts where the compiled chain's graph is judged against the uncompiled chain's
# (bench/targets.py): there its row also times the two in alternation (paired_times).
PAIRED_TOKENS = (16, 64, 256)


# ---------------------------------------------------------------------------------------------
# The chain
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeOutputs:
    """Every step's result of one call of the chain (shapes as in the module docstring).

    ``gathered`` is ``(packed rows [P, H/2], their scales [P, H/16])`` for the ``nvfp4``
    payload and ``(bf16 rows [P, H],)`` for ``bf16``."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    plan: Any                   # kernels.types.LocalSendPlan
    global_scale: torch.Tensor
    packed: torch.Tensor
    scales: torch.Tensor
    permutation: Any            # kernels.types.Permutation
    gathered: tuple
    out: torch.Tensor


@dataclass(frozen=True)
class ChainSteps:
    """The six ops of the chain, each a function with the signature of its oracle in
    ``kernels.reference`` (options such as ``backend=`` and ``check_ids=`` already bound);
    ``quantize`` is ``scale_and_quantize_nvfp4``: x -> (packed, scales, global_scale).
    ``permute_gather`` (optional): ``permute_and_gather``, the permutation and the payload's
    gather in one op, run in place of ``permute`` and ``gather`` when given."""

    route: Callable
    plan: Callable
    quantize: Callable
    permute: Callable
    gather: Callable
    unpermute: Callable
    permute_gather: Optional[Callable] = None


def oracle_steps() -> ChainSteps:
    """The plain-torch oracle of every step (``kernels.reference``)."""
    from kernels import reference
    return ChainSteps(route=reference.route_topk, plan=reference.local_send_plan,
                      quantize=reference.scale_and_quantize_nvfp4,
                      permute=reference.permute_by_expert,
                      gather=reference.gather_rows, unpermute=reference.unpermute_and_reduce)


def triton_steps(routing_backend: str = "triton", overlap_previous: bool = False,
                 fused: bool = True) -> ChainSteps:
    """Every step on ``backend="triton"`` with its device-read checks off (no host sync), the
    routing on ``routing_backend`` ("triton" or "flashinfer"). ``overlap_previous``: the
    quantize and the permutation overlap the kernel before them, as :func:`run_chain`'s order
    allows (the module docstring says why); not for another order. ``fused``: the permutation
    and the gather run as one op, ``permute_and_gather`` (else the two ops). The local send
    plan has no stage function (it is a plain kernel, as the ``prepare`` stage notes): its
    launcher is called directly."""
    from a2a.permute import (gather_rows, permute_and_gather, permute_by_expert,
                             unpermute_and_reduce)
    from a2a.quantize import scale_and_quantize_nvfp4
    from a2a.routing import route_topk
    from kernels.prepare import local_send_plan
    return ChainSteps(
        route=functools.partial(route_topk, backend=routing_backend),
        plan=functools.partial(local_send_plan, check_ids=False),
        quantize=functools.partial(scale_and_quantize_nvfp4, check_values=False,
                                   overlap_previous=overlap_previous, backend="triton"),
        permute=functools.partial(permute_by_expert, check_ids=False,
                                  overlap_previous=overlap_previous, backend="triton"),
        gather=functools.partial(gather_rows, check_values=False, backend="triton"),
        unpermute=functools.partial(unpermute_and_reduce, check_values=False,
                                    backend="triton"),
        permute_gather=(functools.partial(permute_and_gather, check_ids=False,
                                          overlap_previous=overlap_previous, backend="triton")
                        if fused else None))


def routing_options(bias: torch.Tensor) -> dict:
    """DeepSeek-V3's routing options: the selection bias [E] fp32, 8 groups keep 4, 2.5."""
    return dict(bias=bias, num_groups=DEEPSEEK_GROUPS, topk_groups=DEEPSEEK_TOPK_GROUPS,
                routed_scaling=DEEPSEEK_SCALING)


def after_routing(steps: ChainSteps, shape: dict, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, x: torch.Tensor, expert_out: torch.Tensor,
                  quantized: Optional[tuple] = None) -> DecodeOutputs:
    """The chain's steps after the routing, on the given routing; ``quantized`` (global scale,
    packed, scales) reuses a quantization of ``x`` instead of computing it again."""
    experts = shape["experts"]
    if quantized is None:
        packed, scales, global_scale = steps.quantize(x)
    else:
        global_scale, packed, scales = quantized
    plan = steps.plan(topk_ids, experts, shape["ep_size"], max_tokens_per_rank=shape["tokens"])
    permutation, gathered = permute_payload(steps, shape, topk_ids, x, packed, scales)
    out = steps.unpermute(expert_out, permutation, topk_weights)
    return DecodeOutputs(topk_ids, topk_weights, plan, global_scale, packed, scales,
                         permutation, gathered, out)


def gather_payload(steps: ChainSteps, shape: dict, x: torch.Tensor, packed: torch.Tensor,
                   scales: torch.Tensor, permutation) -> tuple:
    """The rows the receiving rank hands its experts (``DecodeOutputs.gathered``): the packed
    NVFP4 rows and their scales for the ``nvfp4`` payload, the bf16 rows of ``x`` for ``bf16``."""
    if shape["payload"] == "nvfp4":
        return tuple(steps.gather(packed, permutation.source_rows, scales=scales,
                                  top_k=shape["top_k"]))
    return (steps.gather(x, permutation.source_rows, top_k=shape["top_k"]),)


def permute_payload(steps: ChainSteps, shape: dict, topk_ids: torch.Tensor, x: torch.Tensor,
                    packed: torch.Tensor, scales: torch.Tensor) -> tuple:
    """(permutation, gathered): the permutation of ``topk_ids`` and :func:`gather_payload`'s
    rows through it, by ``steps.permute_gather`` in one op where the steps have it."""
    if steps.permute_gather is None:
        permutation = steps.permute(topk_ids, shape["experts"])
        return permutation, gather_payload(steps, shape, x, packed, scales, permutation)
    if shape["payload"] == "nvfp4":
        permutation, *gathered = steps.permute_gather(topk_ids, packed, shape["experts"],
                                                      scales=scales)
    else:
        permutation, *gathered = steps.permute_gather(topk_ids, x, shape["experts"])
    return permutation, tuple(gathered)


def run_chain(steps: ChainSteps, shape: dict, logits: torch.Tensor, bias: torch.Tensor,
              x: torch.Tensor, expert_out: torch.Tensor) -> DecodeOutputs:
    """One call of the whole chain (the module docstring lists its steps)."""
    topk_ids, topk_weights = steps.route(logits, shape["top_k"], ROUTING_METHOD,
                                         **routing_options(bias))
    return after_routing(steps, shape, topk_ids, topk_weights, x, expert_out)


def run_chain_overlapped(steps: ChainSteps, shape: dict, logits: torch.Tensor,
                         bias: torch.Tensor, x: torch.Tensor, expert_out: torch.Tensor,
                         streams: tuple) -> DecodeOutputs:
    """:func:`run_chain` with the steps that the critical path does not wait for on streams of
    their own, so that a CUDA graph captured from it holds the dependencies of a real step
    instead of one line of launches:

        streams[0] (the critical path):  route -> permute -> gather -> unpermute
        streams[1]:  global scale + quantize    (payload nvfp4: the gather waits for it)
        streams[2]:  (after route) local send plan

    With the bf16 payload the permutation and the gather are one op (``steps.permute_gather``)
    where the steps have it. The NVFP4 payload keeps the two apart: its fused op would read
    the quantized rows, so it would wait for the quantize, which the permutation alone runs
    beside (on an H100 at T=256 the fused op there made the row about 1 us slower).

    The gather and the un-permute stay in that order on one stream although the bench's
    un-permute reads the fixed ``expert_out`` and not the gathered rows: in a step the expert
    GEMMs read the gathered rows and write what the un-permute reads, so the un-permute cannot
    start before the gather has finished. (A graph that let the two run side by side would time
    a step no engine can run.) The steps are enqueued in the order they can start (route,
    global scale + quantize, permute, plan, gather, unpermute); the graph need not run its
    independent branches in that order (docs/design.md, "The decode step's launches"). The
    critical path and the plan (one program) run at the highest stream priority. Every stream
    starts after everything queued on the current stream (a call never overlaps the previous
    call's uses of its buffers) and the current stream waits for all three at the end: the call
    is joined, as graph capture requires. The same ops on the same inputs: the same outputs as
    :func:`run_chain`."""
    critical, quant_stream, plan_stream = streams
    current = torch.cuda.current_stream(x.device)
    k, experts = shape["top_k"], shape["experts"]
    for stream in streams:
        stream.wait_stream(current)
    routed, quantized = torch.cuda.Event(), torch.cuda.Event()
    with torch.cuda.stream(critical):
        topk_ids, topk_weights = steps.route(logits, k, ROUTING_METHOD, **routing_options(bias))
        routed.record(critical)
    with torch.cuda.stream(quant_stream):
        packed, scales, global_scale = steps.quantize(x)
        quantized.record(quant_stream)
    # The fused permutation and gather of NVFP4 rows would wait for the quantize: that
    # payload keeps the permutation beside the quantize, and the gather after both.
    fused = steps.permute_gather is not None and shape["payload"] == "bf16"
    if not fused:
        with torch.cuda.stream(critical):
            permutation = steps.permute(topk_ids, experts)
    with torch.cuda.stream(plan_stream):
        plan_stream.wait_event(routed)
        plan = steps.plan(topk_ids, experts, shape["ep_size"],
                          max_tokens_per_rank=shape["tokens"])
    with torch.cuda.stream(critical):
        # the NVFP4 rows exist once the quantize has run; the bf16 rows read x alone
        if shape["payload"] == "nvfp4":
            critical.wait_event(quantized)
        if fused:
            permutation, gathered = permute_payload(steps, shape, topk_ids, x, packed, scales)
        else:
            gathered = gather_payload(steps, shape, x, packed, scales, permutation)
        out = steps.unpermute(expert_out, permutation, topk_weights)
    for stream in streams:
        current.wait_stream(stream)
    return DecodeOutputs(topk_ids, topk_weights, plan, global_scale, packed, scales,
                         permutation, gathered, out)


class DecodeChain:
    """The chain on input buffers of its own: ``logits`` [T, E] fp32 and ``x`` [T, H] bf16 are
    copies that :meth:`load` overwrites in place, so that a CUDA graph captured from a call
    replays on whatever was loaded last. ``bias`` and ``expert_out`` are read-only and shared."""

    def __init__(self, steps: ChainSteps, inputs: dict, shape: dict):
        self.steps, self.shape = steps, shape
        self.logits = inputs["logits"].clone()
        self.x = inputs["x"].clone()
        self.bias = inputs["options"]["bias"]
        self.expert_out = inputs["expert_out"]

    def __call__(self) -> DecodeOutputs:
        return run_chain(self.steps, self.shape, self.logits, self.bias, self.x,
                         self.expert_out)

    def load(self, logits: torch.Tensor, x: torch.Tensor) -> None:
        """Copy new inputs into the buffers every call (and every captured graph) reads."""
        self.logits.copy_(logits)
        self.x.copy_(x)


class OverlappedChain(DecodeChain):
    """:class:`DecodeChain` run by :func:`run_chain_overlapped` on three streams of its own
    (GPU only): the graph the ``triton_overlap`` row replays. The critical path's stream and
    the plan's have the device's highest priority."""

    def __init__(self, steps: ChainSteps, inputs: dict, shape: dict):
        super().__init__(steps, inputs, shape)
        device = self.x.device
        # (torch maps a priority past the device's range to the nearest one: the highest)
        self.streams = (torch.cuda.Stream(device=device, priority=-100),
                        torch.cuda.Stream(device=device),
                        torch.cuda.Stream(device=device, priority=-100))

    def __call__(self) -> DecodeOutputs:
        return run_chain_overlapped(self.steps, self.shape, self.logits, self.bias, self.x,
                                    self.expert_out, self.streams)


class CompiledChain(DecodeChain):
    """:class:`DecodeChain` under ``torch.compile(fullgraph=True)`` in its default mode
    (Inductor, no CUDA graphs; ``dynamic=False``: a shape of the stage compiles once for its
    T). Inductor sees the Triton kernels of the registered ops (``kernels.library``) and
    launches them from its own wrapper code; the row is timed by eager calls, beside the
    ``triton`` row's CUDA-graph replay of the uncompiled chain."""

    def __init__(self, steps: ChainSteps, inputs: dict, shape: dict):
        super().__init__(steps, inputs, shape)
        # Every shape of the stage compiles the same method anew (dynamic=False): dynamo's
        # cache of it is cleared first, so that the sweep's shapes do not add up to its
        # recompile limit.
        torch._dynamo.reset()
        self.compiled = torch.compile(super().__call__, fullgraph=True, dynamic=False)

    def __call__(self) -> DecodeOutputs:
        return self.compiled()


def compiled_reason(device: torch.device) -> Optional[str]:
    """Why the compiled chain cannot run on ``device`` (None where it can)."""
    if device.type != "cuda":
        return ("not available: the compiled chain needs a GPU (under Triton's interpreter the "
                "registered ops are opaque to Inductor: nothing of the chain to compile)")
    return None


def overlap_reason(device: torch.device) -> Optional[str]:
    """Why the overlapped chain cannot run on ``device`` (None where it can)."""
    if device.type != "cuda":
        return ("not available: the overlapped chain runs its independent steps on CUDA "
                "streams (a GPU only)")
    return None


def oracle_chain(inputs: dict, shape: dict) -> DecodeOutputs:
    """The oracle's outputs of the chain on ``inputs`` (logits, options, x, expert_out)."""
    return run_chain(oracle_steps(), shape, inputs["logits"], inputs["options"]["bias"],
                     inputs["x"], inputs["expert_out"])


# ---------------------------------------------------------------------------------------------
# Inputs, check, launches
# ---------------------------------------------------------------------------------------------

def permuted_rows(shape: dict) -> int:
    """P = T*k: every pair is owned (one rank holds every expert), no alignment padding."""
    return shape["tokens"] * shape["top_k"]


def routing_and_activations(shape: dict, device: torch.device, salt: int) -> dict:
    """Router logits [T, E] fp32 and activations x [T, H] bf16, standard normal, drawn from
    ``bench.stages.generator(device, salt)``: the same for the same salt."""
    gen = generator(device, salt)
    logits = torch.randn(shape["tokens"], shape["experts"], generator=gen, device=device,
                         dtype=torch.float32)
    x = torch.randn(shape["tokens"], shape["hidden"], generator=gen, device=device,
                    dtype=torch.float32).to(torch.bfloat16)
    return dict(logits=logits, x=x)


def decode_inputs(shape: dict, device: torch.device, ctx=None) -> dict:
    """The stage's inputs: ``logits``, ``x`` (:func:`routing_and_activations`), the routing
    ``options`` (bias [E] fp32 of 0.1 * normal), and the stand-in expert output
    ``expert_out`` [P, H] bf16."""
    inputs = routing_and_activations(shape, device, INPUT_SALT)
    gen = generator(device, INPUT_SALT - 1)
    bias = 0.1 * torch.randn(shape["experts"], generator=gen, device=device,
                             dtype=torch.float32)
    expert_out = torch.randn(permuted_rows(shape), shape["hidden"], generator=gen,
                             device=device, dtype=torch.float32).to(torch.bfloat16)
    return dict(inputs, options=routing_options(bias), expert_out=expert_out)


def replay_inputs(inputs: dict, shape: dict, replay: int) -> dict:
    """``inputs`` with fresh logits and activations for replay number ``replay`` (1, 2, ...)."""
    fresh = routing_and_activations(shape, inputs["x"].device, INPUT_SALT + replay)
    return dict(inputs, **fresh)


def check_chain(out: DecodeOutputs, ref: DecodeOutputs, inputs: dict, shape: dict, *,
                near_ties: bool = False, near_tie_rows: Optional[float] = None) -> str:
    """Raise AssertionError naming the first step whose output differs from the oracle's.

    The routing is compared with the oracle's ``ref`` (ids exactly, weights with the routing
    tolerance; ``near_ties``: FlashInfer's rule, ids may differ on near-tied rows, in at most
    ``near_tie_rows`` rows when given, else 0.1% of them), every
    later step with the oracle run on this path's own routing: the plan, the permutation, the
    global scale, the NVFP4 codes and scales and the gathered rows exactly, the reduced output
    with the tolerance table. Returns a remark for the row's note ("" when there is none)."""
    remark = ""
    if near_ties:
        remark = check_routing_near_ties((out.topk_ids, out.topk_weights),
                                         (ref.topk_ids, ref.topk_weights), inputs, shape,
                                         allowed_rows=near_tie_rows)
    else:
        assert_same(out.topk_ids, ref.topk_ids, what="topk_ids")
        assert_same(out.topk_weights, ref.topk_weights, what="topk_weights",
                    tol=ROUTING_WEIGHT_TOL)
    same_routing = (torch.equal(out.topk_ids, ref.topk_ids)
                    and torch.equal(out.topk_weights, ref.topk_weights))
    if same_routing:
        expected = ref
    else:  # the oracle's later steps on this path's routing, on the oracle's quantization
        expected = after_routing(oracle_steps(), shape, out.topk_ids, out.topk_weights,
                                 inputs["x"], inputs["expert_out"],
                                 quantized=(ref.global_scale, ref.packed, ref.scales))
    assert_same(out.plan, expected.plan, what="plan")
    assert_same(out.global_scale, expected.global_scale, what="global_scale",
                tol=dict(atol=0.0, rtol=0.0))
    assert_same(out.packed, expected.packed, what="packed")
    assert_same(out.scales, expected.scales, what="scales")
    assert_same(out.permutation, expected.permutation, what="permutation")
    assert_same(out.gathered, expected.gathered, what=f"gathered {shape['payload']} rows")
    assert_same(out.out, expected.out, what="out")
    return remark


def capture(chain: DecodeChain) -> tuple["torch.cuda.CUDAGraph", DecodeOutputs]:
    """A CUDA graph of one call of ``chain`` and the outputs that every replay rewrites (after
    one warm-up call on a side stream, as torch's graph capture asks)."""
    device = chain.x.device
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        outputs = chain()
    return cuda_graph, outputs


def graph_replayer(chain: DecodeChain) -> Callable[[], DecodeOutputs]:
    """``run()``: replay a CUDA graph of ``chain`` (captured here) and return its outputs."""
    cuda_graph, outputs = capture(chain)

    def run() -> DecodeOutputs:
        cuda_graph.replay()
        return outputs
    return run


def other_id_sets(out: DecodeOutputs, ref: DecodeOutputs) -> int:
    """Tokens whose set of expert ids differs between ``out`` and ``ref``."""
    return int((out.topk_ids.long().sort(dim=1).values
                != ref.topk_ids.long().sort(dim=1).values).any(dim=1).sum())


def check_replays(chain: DecodeChain, run: Callable[[], DecodeOutputs], inputs: dict,
                  replays: int, *, near_ties: bool = False) -> int:
    """Check ``replays`` calls of ``run`` (e.g. :func:`graph_replayer`'s replays), each after
    fresh logits and activations (:func:`replay_inputs`) are loaded into ``chain``, against the
    oracle on those inputs (:func:`check_chain`); AssertionError names the replay. With
    ``near_ties`` the 0.1% of rows that may pick another id set on a near-tie are counted over
    all the replays' rows together (one such row at T=16 is not 0.1% of one replay). ``chain``'s
    buffers hold ``inputs`` again afterwards. Returns the number of rows that picked another
    id set (0 unless ``near_ties``)."""
    allowance = MAX_NEAR_TIE_ROWS * replays * chain.shape["tokens"]
    other_sets = 0
    try:
        for replay in range(1, replays + 1):
            fresh = replay_inputs(inputs, chain.shape, replay)
            chain.load(fresh["logits"], fresh["x"])
            out = run()
            ref = oracle_chain(fresh, chain.shape)
            try:
                check_chain(out, ref, fresh, chain.shape, near_ties=near_ties,
                            near_tie_rows=allowance - other_sets)
            except AssertionError as error:
                raise AssertionError(f"replay {replay} of {replays} (fresh routing): "
                                     f"{error}") from None
            other_sets += other_id_sets(out, ref)
    finally:
        chain.load(inputs["logits"], inputs["x"])
    return other_sets


def paired_times(chain: DecodeChain, backend: str, inputs: dict, shape: dict) -> dict:
    """``chain`` (the ``backend`` row's) and a new uncompiled chain (the ``triton`` row's), each
    captured as CUDA graphs and replayed in alternation
    (``bench.timing.time_graphs_interleaved``): {backend: us, "triton": us}, the medians, for
    the target that judges the one row against the other (bench/targets.py reads them instead
    of the two rows' own times, which were taken minutes apart)."""
    from bench.timing import time_graphs_interleaved
    other = DecodeChain(triton_steps(overlap_previous=True), inputs, shape)
    with torch.cuda.device(chain.x.device):
        times = time_graphs_interleaved({backend: chain, "triton": other})
    return {name: round(timing.median_us, 3) for name, timing in times.items()}


def one_graph_time(chain: DecodeChain) -> float:
    """The median us per call of ``chain`` captured as a CUDA graph of one call and replayed
    back to back (``bench.timing.time_replays``): how an engine replays one decode step's graph.
    The row's own time comes from one graph of many calls (``bench.timing.time_graph``), which
    joins every call's streams into one long graph; the two differ most for the overlapped
    chain."""
    from bench.timing import time_replays
    with torch.cuda.device(chain.x.device):
        cuda_graph, _ = capture(chain)
        return round(time_replays(cuda_graph).median_us, 2)


def count_launches(fn: Callable[[], Any], device: torch.device,
                   calls: int = LAUNCH_COUNT_CALLS) -> Optional[int]:
    """Device activities (kernels, copies, memsets) per call of ``fn``: torch.profiler
    (``bench.timing.device_trace``) over ``calls`` calls after one warm call. None off a GPU
    (the interpreter launches nothing)."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType

    from bench.timing import device_trace
    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize(device)
        with device_trace() as trace:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize(device)
    launched = sum(event.device_type == DeviceType.CUDA for event in trace.events())
    return round(launched / calls)


# ---------------------------------------------------------------------------------------------
# Paths, bytes, the stage
# ---------------------------------------------------------------------------------------------

def flashinfer_reason(device: torch.device) -> str:
    """Why the whole chain cannot run on FlashInfer here: the switch's reason for each step it
    lacks (the permutation always; the global scale always; the quantizer below SM100)."""
    from a2a.backends import why_unavailable
    steps = (("routing", "routing", {"method": ROUTING_METHOD}),
             ("global scale", "quantize", {"op": "global_scale"}),
             ("NVFP4 quantize", "quantize", {}),
             ("permutation", "permute", {}))
    reasons = [f"{name}: {why}" for name, stage, context in steps
               if (why := why_unavailable(stage, "flashinfer", device, **context)) is not None]
    return ("not available: FlashInfer has no standalone permutation, so the chain cannot run on "
            "FlashInfer alone (what it lacks here, step by step: " + "; ".join(reasons) + ")")


def decode_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    device = inputs["x"].device

    def chain_path(backend: str, routing_backend: str, timed: str,
                   compiled: bool = False, graphed: bool = True,
                   overlapped: bool = False, paired: bool = False) -> Path:
        holder: dict = {}

        def factory():
            stage_backend("routing", routing_backend, device, method=ROUTING_METHOD)
            for stage in ("quantize", "permute"):
                stage_backend(stage, "triton", device)
            if compiled and compiled_reason(device):
                raise Unavailable(compiled_reason(device))
            if overlapped and overlap_reason(device):
                raise Unavailable(overlap_reason(device))
            chain_class = (CompiledChain if compiled else
                           OverlappedChain if overlapped else DecodeChain)
            # run_chain's order, where the flags hold; not the overlapped chain's streams
            holder["chain"] = chain_class(triton_steps(routing_backend,
                                                       overlap_previous=not overlapped),
                                          inputs, shape)
            return holder["chain"]

        near_ties = routing_backend == "flashinfer"

        def check(out, ref, checked_inputs, checked_shape) -> str:
            remark = check_chain(out, ref, checked_inputs, checked_shape, near_ties=near_ties)
            if device.type != "cuda" or (compiled and not graphed):
                return remark  # no CUDA graph in the interpreter; the compiled row runs eagerly
            chain = holder["chain"]
            near = check_replays(chain, graph_replayer(chain), inputs, REPLAY_CHECKS,
                                 near_ties=near_ties)
            replays = f"{REPLAY_CHECKS} CUDA-graph replays checked with fresh routing"
            if near:
                replays += f" ({near} near-tie row(s) picked another id set)"
            return "; ".join(part for part in (remark, replays) if part)

        # graphed: timed by CUDA-graph replay (no host sync in the chain); else by eager calls
        path = make_path(backend, factory, capture_safe=graphed, timed=timed, check=check)
        if path.run is None:
            return path

        def facts() -> dict:
            found = {"launches": count_launches(path.run, device)}
            if graphed and device.type == "cuda":
                found["one_graph_us"] = one_graph_time(holder["chain"])
            if paired and device.type == "cuda" and shape["tokens"] in PAIRED_TOKENS:
                found["paired_us"] = paired_times(holder["chain"], backend, inputs, shape)
            return found
        return dataclasses.replace(path, facts=facts)

    oracle = make_path("torch", lambda: lambda: oracle_chain(inputs, shape))
    oracle = dataclasses.replace(
        oracle, facts=lambda: {"launches": count_launches(oracle.run, device)})
    return [chain_path("triton", "triton",
                       "timed: the whole chain, Triton, check_ids/check_values=False, the "
                       "quantize and the permutation with overlap_previous=True"),
            chain_path(OVERLAP_BACKEND, "triton",
                       "timed: the triton row's ops, the quantize and the plan on streams of "
                       "their own beside the critical path (route, permute, gather, unpermute; "
                       "the NVFP4 gather waits for the quantize), one CUDA graph",
                       overlapped=True),
            chain_path(COMPILED_BACKEND, "triton",
                       "timed: the triton row's chain under torch.compile(fullgraph=True), "
                       "default mode (Inductor, no CUDA graphs), dynamic=False, eager calls",
                       compiled=True, graphed=False),
            chain_path(COMPILED_GRAPH_BACKEND, "triton",
                       "timed: the triton_compiled chain captured and replayed as one CUDA "
                       "graph", compiled=True, paired=True),
            chain_path("flashinfer_routing", "flashinfer",
                       "timed: the chain with FlashInfer's fused_topk_deepseek as its routing "
                       "step, the other steps Triton"),
            Path("flashinfer", reason=flashinfer_reason(device)),
            oracle]


def gather_bytes(tokens: int, rows: int, row_bytes: int) -> dict:
    """The bytes of gathering ``rows`` rows of ``row_bytes`` bytes out of ``tokens`` rows, with
    an int32 index per row: effective (read and write every row, ``local``) and the HBM minimum
    (each source row read once, ``hbm_local``), as the permute stage counts its gather."""
    return {"local": 2 * rows * row_bytes + 4 * rows,
            "hbm_local": tokens * row_bytes + rows * row_bytes + 4 * rows}


def step_bytes(shape: dict) -> dict[str, dict]:
    """Each step's bytes, by the formula of the stage that times it alone (bench/stages.py);
    the gather of packed NVFP4 rows by :func:`gather_bytes` (its codes and scales, one index
    read for both)."""
    t, h, e, k = shape["tokens"], shape["hidden"], shape["experts"], shape["top_k"]
    dims = dict(tokens=t, hidden=h, experts=e, top_k=k)
    pairs = permuted_rows(shape)
    if shape["payload"] == "nvfp4":
        gather = gather_bytes(t, pairs, h // 2 + h // 16)
    else:
        gather = PERMUTE.traffic(dict(dims, op="gather_rows"))
    return {
        "route_topk": ROUTING.traffic(dict(dims, method=ROUTING_METHOD)),
        "local_send_plan": PREPARE.traffic(dict(dims, ep_size=shape["ep_size"])),
        "nvfp4_global_scale": QUANTIZE.traffic(dict(dims, op="global_scale")),
        "quantize_nvfp4": QUANTIZE.traffic(dict(dims, op="nvfp4_linear")),
        "permute_by_expert": PERMUTE.traffic(dict(dims, op="permute_by_expert")),
        "gather_rows": gather,
        "unpermute_and_reduce": PERMUTE.traffic(dict(dims, op="unpermute_and_reduce")),
    }


def decode_traffic(shape: dict, inputs=None) -> dict:
    """The chain's bytes: the sum of its steps' (:func:`step_bytes`), each step reading its
    inputs from and writing its outputs to memory; ``hbm_local`` counts the gather's source
    rows once."""
    steps = step_bytes(shape).values()
    return {"local": sum(s["local"] for s in steps),
            "hbm_local": sum(s.get("hbm_local", s["local"]) for s in steps)}


def deepseek_routable(shape: dict) -> bool:
    """DeepSeek-V3 routing with 8 groups keeping 4 can pick k experts among E."""
    per_group = shape["experts"] // DEEPSEEK_GROUPS
    return (shape["experts"] % DEEPSEEK_GROUPS == 0 and per_group >= 2
            and DEEPSEEK_TOPK_GROUPS * per_group >= shape["top_k"])


@dataclass(frozen=True)
class DecodeStage(Stage):
    """A :class:`Stage` on one set of dimensions per sweep. A sweep with DeepSeek-R1's hidden
    size (every GPU sweep) gives DeepSeek-R1's dimensions (:data:`DEEPSEEK_R1`) at each of its
    token counts; any other (the interpreter's grids) its smallest dimensions at its middle
    token count only: one call of the chain takes seconds in the interpreter (most of it in
    ``nvfp4_global_scale``, whose reduction the interpreter runs element by element)."""

    def shapes(self, sweep: Sweep) -> list[dict]:
        if DEEPSEEK_R1["hidden"] in sweep.hidden:
            dims = {key: (value,) for key, value in DEEPSEEK_R1.items()}
        else:
            dims = {key: (min(sweep.values(key)),) for key in DEEPSEEK_R1}
            dims["tokens"] = (sorted(sweep.tokens)[len(sweep.tokens) // 2],)
        return super().shapes(dataclasses.replace(sweep, **dims))


DECODE = DecodeStage(
    name="decode", keys=("tokens", "hidden", "experts", "top_k"),
    variants=tuple({"payload": payload, "ep_size": DECODE_EP_SIZE} for payload in PAYLOADS),
    valid=deepseek_routable,
    extra=lambda: [dict(payload=payload, ep_size=DECODE_EP_SIZE, tokens=t, **DEEPSEEK_R1)
                   for t in TARGET_TOKENS for payload in PAYLOADS],
    build=decode_inputs, paths=decode_paths,
    check=check_chain, traffic=decode_traffic, dtype=lambda shape: "bf16", graph=True)
