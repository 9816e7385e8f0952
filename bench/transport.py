"""The stages that need one process per GPU: prepare across ranks, dispatch, combine, and the
whole layer (route, prepare, quantize, dispatch, identity experts through the permutation,
combine; payload bf16, or NVFP4 codes + scales decoded on arrival).

Every rank builds every rank's inputs from the same seeds, so that each can compute the oracle
(``kernels.reference.simulate_alltoall / simulate_dispatch / simulate_combine``) for itself and
check its own output. Our paths go through ``a2a.MoEAlltoall`` (one instance per shape and
backend choice, closed after the shape); the reference row ``flashinfer_one_sided`` is
FlashInfer's ``MoeAlltoAll`` (flashinfer.comm.trtllm_moe_alltoall), whose receive order comes
from atomics: its rows are sorted back by a token tag sent along before the comparison.

Bytes (per rank, averaged over the ranks; ``row`` = bytes of one payload row):
- dispatch: remote = rows sent to other ranks * row (stored into the peers);
  local = rows kept on this rank * row * 2 (read + write). Reading the remote rows from HBM runs
  under the slower NVLink stores and is not counted.
- combine: the same rows travel back: remote = rows returned to other ranks * 2H; local = rows
  returned to this rank * 2H * 2 + the output T * 2H.
- prepare: remote = rows sent to other ranks * k * 8 (ids and weights); local = T*k*8 read +
  N*R*k*8 written (received ids and weights).
- layer: dispatch + combine bytes (routing, prepare, quantize, dequantize and the expert
  permutation not counted; nvfp4 rows are H/2 + H/16 bytes).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from a2a import MoEAlltoall
from a2a.backends import flashinfer_installed, why_unavailable
from a2a.config import TransportConfig
from a2a.permute import gather_rows, permute_by_expert, unpermute_and_reduce
from a2a.routing import route_topk
from bench.stages import (DEEPSEEK_GROUPS, DEEPSEEK_SCALING, DEEPSEEK_TOPK_GROUPS, Path, Stage,
                          Unavailable, assert_same, generator, make_path, make_topk)
from kernels import quantize, reference

# DeepSeek-V3 routing in the layer (runs on FlashInfer on SM90 too).
LAYER_ROUTING = dict(method="deepseek_v3", num_groups=DEEPSEEK_GROUPS,
                     topk_groups=DEEPSEEK_TOPK_GROUPS, routed_scaling=DEEPSEEK_SCALING)
ONE_SIDED = "flashinfer_one_sided"
FUSED = "triton_fused"  # NVFP4 dispatch with the quantizer in the Triton send kernel
OVERLAPPED = "triton_overlap"  # bf16 dispatch as one launch of send and receive programs
# The Triton transport's target shapes (bench/targets.py), added to dispatch and combine.
TRANSPORT_TARGET_SHAPES = [dict(tokens=t, hidden=7168, experts=32, top_k=8, routing="uniform")
                           for t in (16, 2048)]


# ---------------------------------------------------------------------------------------------
# Inputs and the oracle
# ---------------------------------------------------------------------------------------------

def _all_inputs(shape: dict, device: torch.device, ctx) -> dict:
    """Every rank's routing and rows (same seeds on every rank), the oracle's plans, and this
    rank's share."""
    ranks = ctx.world_size
    tokens, hidden, experts, k = shape["tokens"], shape["hidden"], shape["experts"], \
        shape["top_k"]
    ids, weights, xs = [], [], []
    for rank in range(ranks):
        i, w = make_topk(tokens, experts, k, shape["routing"], device, salt=100 + rank)
        ids.append(i)
        weights.append(w)
        xs.append(torch.randn(tokens, hidden, generator=generator(device, 200 + rank),
                              device=device).to(torch.bfloat16))
    plans = reference.simulate_alltoall(ids, weights, experts, tokens)
    return dict(ids=ids, weights=weights, xs=xs, plans=plans, rank=ctx.rank, ranks=ranks)


def _row_counts(inputs: dict) -> tuple[float, float]:
    """(rows kept on their own rank, rows sent to another rank), averaged over the ranks."""
    kept = sent = 0
    for source, plan in enumerate(inputs["plans"]):
        counts = torch.diff(plan.send_rank_count_cumsum.long(), prepend=plan.send_rank_count_cumsum
                            .new_zeros(1).long())
        kept += int(counts[source])
        sent += int(counts.sum()) - int(counts[source])
    return kept / len(inputs["plans"]), sent / len(inputs["plans"])


def _payload_row_bytes(shape: dict) -> int:
    h = shape["hidden"]
    nvfp4 = "nvfp4" in (shape.get("quant"), shape.get("payload"))
    return h // 2 + h // 16 if nvfp4 else 2 * h


def _dispatch_traffic(shape: dict, inputs: Optional[dict]) -> dict:
    if inputs is None:
        return {"local": 0, "remote": 0}
    kept, sent = _row_counts(inputs)
    row = _payload_row_bytes(shape)
    return {"local": int(2 * kept * row), "remote": int(sent * row)}


def _combine_traffic(shape: dict, inputs: Optional[dict]) -> dict:
    if inputs is None:
        return {"local": 0, "remote": 0}
    kept, sent = _row_counts(inputs)
    row = 2 * shape["hidden"]
    return {"local": int(2 * kept * row + shape["tokens"] * row), "remote": int(sent * row)}


def _prepare_traffic(shape: dict, inputs: Optional[dict]) -> dict:
    if inputs is None:
        return {"local": 0, "remote": 0}
    _, sent = _row_counts(inputs)
    t, k, r = shape["tokens"], shape["top_k"], inputs["ranks"]
    return {"local": 8 * t * k + 8 * t * r * k, "remote": int(8 * k * sent)}


def _layer_traffic(shape: dict, inputs: Optional[dict]) -> dict:
    d, c = _dispatch_traffic(shape, inputs), _combine_traffic(shape, inputs)
    return {"local": d["local"] + c["local"], "remote": d["remote"] + c["remote"]}


def _segments(cumsum: torch.Tensor) -> list[tuple[int, int]]:
    ends = cumsum.tolist()
    return list(zip([0] + ends[:-1], ends))


# ---------------------------------------------------------------------------------------------
# Our transport (a2a.MoEAlltoall) and FlashInfer's one-sided MoeAlltoAll
# ---------------------------------------------------------------------------------------------

# Hidden size of the (unused) payload rows of the prepare stage, which moves no rows.
PREPARE_HIDDEN = 16


def _moe_alltoall(ctx, shape: dict, prepare: str, transport: str, quantize: str = "triton",
                  transport_config: Optional[TransportConfig] = None):
    """An ``a2a.MoEAlltoall`` for this shape (collective), closed after the shape. Made with
    ``agree=False``: the rows time the data movement, without the per-call agreement of the
    ranks over the store (a host round trip that a hot loop turns off; the inputs here are
    valid on every rank, and the tests cover the agreement)."""
    for stage, backend in (("prepare", prepare), ("transport", transport),
                           ("quantize", quantize)):
        reason = why_unavailable(stage, backend, ctx.device)
        if reason is not None:
            raise Unavailable(f"not available: {reason}")
    instance = MoEAlltoall(ctx.group, shape["experts"], shape["top_k"], shape["tokens"],
                           shape.get("hidden", PREPARE_HIDDEN),
                           backends={"prepare": prepare, "transport": transport,
                                     "quantize": quantize},
                           transport_config=transport_config, agree=False)
    ctx.shared.setdefault("closers", []).append(instance.close)
    return instance


def _one_sided(ctx, shape: dict):
    """FlashInfer's one-sided ``MoeAlltoAll`` for this (E, k); every instance shares one
    workspace sized for the largest shape of the sweep (FlashInfer caches workspaces by size
    for the life of the process)."""
    if not flashinfer_installed():
        raise Unavailable("not available: FlashInfer is not installed")
    try:
        from flashinfer.comm.comm_backend import TorchDistBackend
        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlMemory
        from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll
    except Exception as error:  # CUDA Python bindings missing, etc.
        raise Unavailable(f"not available: FlashInfer's MoeAlltoAll does not import "
                          f"({type(error).__name__}: {error})") from None
    sweep = ctx.shared["sweep"]
    max_tokens = max(sweep.tokens + ((8192,) if sweep.extra_shapes else ()))
    max_k = max(sweep.top_k)
    # Extra payloads: ids (k*4) and weights (k*4) are in FlashInfer's own formula; the token tag
    # (4 int32) is extra.
    size = MoeAlltoAll.get_moe_workspace_size_per_rank(
        ctx.world_size, max_k, max_tokens, max(sweep.hidden), extra_payload_bytes_per_token=16)
    mapping = Mapping(world_size=ctx.world_size, rank=ctx.rank, gpus_per_node=ctx.world_size,
                      tp_size=ctx.world_size, moe_ep_size=ctx.world_size)
    MnnvlMemory.initialize()
    # Set the communicator directly (set_comm_from_config would split a new torch.distributed
    # group on every call; see a2a/workspace.py).
    MnnvlMemory.comm = TorchDistBackend(group=ctx.group)
    return MoeAlltoAll(mapping, max_tokens, shape["top_k"], shape["experts"],
                       workspace_size_per_rank=size)


def _token_tags(inputs: dict) -> torch.Tensor:
    """[T, 4] int32 rows (source rank, token, 0, 0): 16 bytes, sent along to sort by."""
    x = inputs["xs"][inputs["rank"]]
    tags = torch.zeros(x.shape[0], 4, dtype=torch.int32, device=x.device)
    tags[:, 0] = inputs["rank"]
    tags[:, 1] = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    return tags


def _one_sided_sorted(recv_x: torch.Tensor, recv_tags: torch.Tensor, inputs: dict) -> torch.Tensor:
    """FlashInfer's receive buffers [R, T, H] back in the oracle's order: by source rank, then
    ascending token (the counts come from the oracle plan; the tags must name that source)."""
    plan = inputs["plans"][inputs["rank"]]
    parts = []
    for source, (start, end) in enumerate(_segments(plan.recv_rank_count_cumsum)):
        tags = recv_tags[source, :end - start]
        assert bool((tags[:, 0] == source).all()), f"rows from rank {source} carry other tags"
        order = tags[:, 1].long().argsort()
        parts.append(recv_x[source, :end - start][order])
    return torch.cat(parts)


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

def _dispatch_build(shape: dict, device: torch.device, ctx=None) -> dict:
    inputs = _all_inputs(shape, device, ctx)
    if shape["quant"] == "nvfp4":
        # One global scale shared by all ranks (in practice, the max over the ranks).
        gs = torch.stack([reference.nvfp4_global_scale(x) for x in inputs["xs"]]).min(
            dim=0).values
        rows = [reference.quantize_nvfp4(x, gs, layout="linear") for x in inputs["xs"]]
        inputs["global_scale"] = gs
        codes = reference.simulate_dispatch([r[0] for r in rows], inputs["plans"])
        scales = reference.simulate_dispatch([r[1] for r in rows], inputs["plans"])
        inputs["expected"] = (codes[ctx.rank], scales[ctx.rank])
    else:
        inputs["expected"] = reference.simulate_dispatch(inputs["xs"], inputs["plans"])[ctx.rank]
    return inputs


def _received(out: Any, inputs: dict) -> Any:
    """The valid prefix (total_recv rows) of a dispatch result (a tensor or a tuple)."""
    total = int(inputs["plans"][inputs["rank"]].total_recv)
    if isinstance(out, (tuple, list)):
        return tuple(part[:total] for part in out)
    return out[:total]


def _dispatch_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    rank = inputs["rank"]
    x = inputs["xs"][rank]
    quant = None if shape["quant"] == "bf16" else shape["quant"]

    def ours(transport, transport_config=None):
        def factory():
            a2a = _moe_alltoall(ctx, shape, "torch", transport,
                                transport_config=transport_config, agree=False)
            my_plan = a2a.prepare(inputs["ids"][rank], inputs["weights"][rank])
            return lambda: a2a.dispatch(x, my_plan, quant=quant,
                                        global_scale=inputs.get("global_scale"))
        return factory

    # Triton and FlashInfer's moe_comm launch kernels only: timed by CUDA-graph replay (the
    # torch transport's all_to_all_single takes host-side split sizes, so it is timed eagerly).
    paths = [make_path(b, ours(b), normalize=lambda out: _received(out, inputs),
                       capture_safe=b != "torch")
             for b in ("triton", "flashinfer", "torch")]
    if quant == "nvfp4":  # the quantizer in the Triton send kernel
        paths.append(make_path(FUSED, ours("triton", TransportConfig(fused_nvfp4_dispatch=True)),
                               normalize=lambda out: _received(out, inputs), capture_safe=True))
    if quant is not None:
        paths.append(Path(ONE_SIDED, reason="not run: the one-sided reference row sends bf16 "
                                            "rows only"))
        return paths
    # send and receive programs in one launch
    paths.append(make_path(OVERLAPPED, ours("triton", TransportConfig(overlap=True)),
                           normalize=lambda out: _received(out, inputs), capture_safe=True))

    holder: dict = {}

    def one_sided():
        moe = _one_sided(ctx, shape)
        tags = _token_tags(inputs)
        ids = inputs["ids"][rank]

        def dispatch():
            holder["recv"] = moe.dispatch(ids, [x, tags], shape["tokens"])
            return holder["recv"]

        holder["after"] = lambda: moe.combine(holder["recv"][0], shape["tokens"])
        return dispatch

    path = make_path(ONE_SIDED, one_sided,
                     normalize=lambda recv: _one_sided_sorted(recv[0], recv[1], inputs),
                     after=lambda: holder["after"]())
    return paths + [path]


def _dispatch_check(out, ref, inputs, shape) -> None:
    assert_same(out, _received(inputs["expected"], inputs), what="received rows")


DISPATCH = Stage(
    name="dispatch", keys=("tokens", "hidden", "experts", "top_k", "routing"),
    variants=({"quant": "bf16"}, {"quant": "nvfp4"}),
    extra=lambda: [dict(quant=q, **shape) for shape in TRANSPORT_TARGET_SHAPES
                   for q in ("bf16", "nvfp4")],
    build=_dispatch_build, paths=_dispatch_paths, check=_dispatch_check,
    traffic=_dispatch_traffic,
    dtype=lambda shape: shape.get("quant", "bf16"),
    distributed=True, oracle=None, graph=True)


# ---------------------------------------------------------------------------------------------
# Combine (identity experts: every received row goes back as it came)
# ---------------------------------------------------------------------------------------------

def _combine_build(shape: dict, device: torch.device, ctx=None) -> dict:
    inputs = _all_inputs(shape, device, ctx)
    received = reference.simulate_dispatch(inputs["xs"], inputs["plans"])
    inputs["expert_out"] = received[ctx.rank]
    inputs["expected"] = reference.simulate_combine(received, inputs["plans"])[ctx.rank]
    return inputs


def _combine_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    rank = inputs["rank"]

    def ours(transport):
        def factory():
            a2a = _moe_alltoall(ctx, shape, "torch", transport)
            my_plan = a2a.prepare(inputs["ids"][rank], inputs["weights"][rank])
            return lambda: a2a.combine(inputs["expert_out"], my_plan)
        return factory

    holder: dict = {}

    def one_sided():
        moe = _one_sided(ctx, shape)
        ids, x = inputs["ids"][rank], inputs["xs"][rank]

        def dispatch():  # untimed: combine needs a dispatch before it
            holder["recv"] = moe.dispatch(ids, [x], shape["tokens"])

        holder["before"] = dispatch
        # Identity experts: the received rows [R, T, H] go back as the payload.
        return lambda: moe.combine(holder["recv"][0], shape["tokens"])

    return [make_path(b, ours(b), capture_safe=b != "torch")
            for b in ("triton", "flashinfer", "torch")] + [
        make_path(ONE_SIDED, one_sided, before=lambda: holder["before"]())]


COMBINE = Stage(
    name="combine", keys=("tokens", "hidden", "experts", "top_k", "routing"),
    extra=lambda: [dict(shape) for shape in TRANSPORT_TARGET_SHAPES],
    build=_combine_build, paths=_combine_paths,
    check=lambda out, ref, inputs, shape: assert_same(out, inputs["expected"], what="combined"),
    traffic=_combine_traffic, dtype=lambda shape: "bf16", distributed=True, oracle=None,
    graph=True)


# ---------------------------------------------------------------------------------------------
# Prepare across ranks
# ---------------------------------------------------------------------------------------------

def canonical_plan(plan) -> dict:
    """The plan with FlashInfer's atomic order taken out: each send segment sorted by token
    (backward indices moved along), each receive segment's (ids, weights) rows sorted by their
    content (:func:`sort_segments_by_content`; rows with equal ids, common under skewed
    routing, differ in their weights: sorting by the ids alone left them in arrival order)."""
    out = {"send_rank_count_cumsum": plan.send_rank_count_cumsum,
           "recv_rank_count_cumsum": plan.recv_rank_count_cumsum}
    send = plan.send_rank_local_indices.clone()
    backward = plan.backward_recv_rank_local_indices.clone()
    for start, end in _segments(plan.send_rank_count_cumsum):
        order = send[start:end].long().argsort() + start
        send[start:end], backward[start:end] = send[order], backward[order]
    ids, weights = sort_segments_by_content((plan.recv_expert_ids, plan.recv_weights),
                                            plan.recv_rank_count_cumsum)
    out.update(send_rank_local_indices=send, backward_recv_rank_local_indices=backward,
               recv_rank_local_indices=plan.recv_rank_local_indices, recv_expert_ids=ids,
               recv_weights=weights)
    if plan.expert_counts is not None:
        out["expert_counts"] = plan.expert_counts
    return out


def _prepare_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    rank = inputs["rank"]

    def ours(prepare):
        def factory():
            a2a = _moe_alltoall(ctx, shape, prepare, "torch")
            # check_inputs=False: no host read of the ids (the inputs are valid; the checked
            # call is covered by the tests).
            return lambda: a2a.prepare(inputs["ids"][rank], inputs["weights"][rank],
                                       check_inputs=False)
        return factory

    # The Triton prepare's fast path (check_inputs=False) has no host sync and keeps its call
    # number on the device: timed by CUDA-graph replay. FlashInfer's and torch's eagerly.
    return [make_path(b, ours(b), normalize=canonical_plan, capture_safe=b == "triton")
            for b in ("triton", "flashinfer", "torch")]


def _prepare_check(out: dict, ref, inputs, shape) -> None:
    expected = canonical_plan(inputs["plans"][inputs["rank"]])
    for name, value in expected.items():
        if name == "expert_counts" and name not in out:
            continue  # a path that does not gather the statistics
        assert_same(out[name], value, what=name)


PREPARE_RANKS = Stage(
    name="prepare", keys=("tokens", "experts", "top_k", "routing"),
    variants=({"scope": "ranks"},),
    extra=lambda: [dict(scope="ranks", tokens=t, experts=256, top_k=8, routing="uniform")
                   for t in (16, 512, 8192)],
    build=lambda shape, device, ctx=None: _all_inputs({**shape, "hidden": PREPARE_HIDDEN}, device,
                                                      ctx),
    paths=_prepare_paths, check=_prepare_check, traffic=_prepare_traffic,
    dtype=lambda shape: "int32", distributed=True, oracle=None, graph=True)


# ---------------------------------------------------------------------------------------------
# The layer: route, prepare, quantize, dispatch, identity experts via the permutation, combine
# ---------------------------------------------------------------------------------------------

# Rounds of redrawing the logit rows that have a DeepSeek-V3 near-tie (bench/near_ties.py), so
# that FlashInfer's routing (sigmoid via tanh) must pick the oracle's ids, in the oracle's order,
# and every path's plan is the oracle's. About 0.1% of rows have one; 8 rounds leave none.
NEAR_TIE_REDRAWS = 8


def _layer_logits(shape: dict, device: torch.device, rank: int,
                  bias: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s router logits [T, E] fp32 (skewed like the routing stage's), its
    near-tie rows redrawn."""
    from bench.near_ties import near_ties
    from bench.stages import SKEW_EXPONENT
    tokens, experts = shape["tokens"], shape["experts"]

    def draw(salt):
        logits = torch.randn(tokens, experts, generator=generator(device, salt), device=device)
        if shape["routing"] == "skewed":
            popularity = torch.arange(1, experts + 1, device=device, dtype=torch.float32)
            logits -= SKEW_EXPONENT * torch.log(popularity)
        return logits

    logits = draw(300 + rank)
    for round_ in range(NEAR_TIE_REDRAWS):
        _, tied = near_ties(logits, bias, shape["top_k"], LAYER_ROUTING["num_groups"],
                            LAYER_ROUTING["topk_groups"])
        if not bool(tied.any()):
            break
        logits = torch.where(tied[:, None], draw(1000 + 16 * rank + round_), logits)
    return logits


def _row_keys(parts: tuple) -> torch.Tensor:
    """A float64 key per row of the byte content of ``parts`` (tensors of equal row count):
    equal rows get equal keys; distinct rows distinct ones (random weights, chunked)."""
    data = torch.cat([p.contiguous().view(torch.uint8).reshape(p.shape[0], -1) for p in parts],
                     dim=1)
    weights = torch.rand(data.shape[1], generator=generator(torch.device("cpu"), 7),
                         dtype=torch.float64).to(data.device)
    return torch.cat([chunk.double() @ weights for chunk in data.split(1024)]) \
        if data.shape[0] else data.new_zeros(0, dtype=torch.float64)


def sort_segments_by_content(parts: tuple, cumsum: torch.Tensor) -> tuple:
    """``parts`` (received rows, the valid prefix) with each source rank's segment sorted by
    row content: FlashInfer's prepare sends a segment in atomic order, the oracle by token."""
    order = torch.arange(parts[0].shape[0], device=parts[0].device)
    keys = _row_keys(parts)
    for start, end in _segments(cumsum):
        order[start:end] = keys[start:end].argsort(stable=True) + start
    return tuple(p[order] for p in parts)


def layer_build(shape: dict, device: torch.device, ctx=None) -> dict:
    """Every rank's logits and tokens; the oracle pipeline: reference routing ->
    simulate_alltoall -> [quantize_nvfp4 ->] simulate_dispatch -> [dequantize_nvfp4 ->]
    identity experts (reference permute, gather, weighted un-permute) -> simulate_combine."""
    inputs = _all_inputs(shape, device, ctx)
    rank, ranks, experts, k = ctx.rank, ctx.world_size, shape["experts"], shape["top_k"]
    bias = 0.1 * torch.randn(experts, generator=generator(device, 301), device=device)
    all_logits = [_layer_logits(shape, device, r, bias) for r in range(ranks)]
    routed = [reference.route_topk(logits, k, bias=bias, **LAYER_ROUTING)
              for logits in all_logits]
    ids, weights = [r[0] for r in routed], [r[1] for r in routed]
    plans = reference.simulate_alltoall(ids, weights, experts, shape["tokens"])
    # The plans of the routed ids (also for the bytes moved), replacing _all_inputs' draws.
    inputs.update(logits=all_logits[rank], bias=bias, ids=ids, weights=weights, plans=plans)
    if shape["payload"] == "nvfp4":
        # A static global scale shared by all ranks (as a calibrated input scale would be):
        # the receiver decodes every source's rows with it. Computed here, untimed.
        gs = torch.stack([reference.nvfp4_global_scale(x) for x in inputs["xs"]]).min(
            dim=0).values
        quantized = [reference.quantize_nvfp4(x, gs, layout="linear") for x in inputs["xs"]]
        codes = reference.simulate_dispatch([q[0] for q in quantized], plans)
        scales = reference.simulate_dispatch([q[1] for q in quantized], plans)
        rows = [reference.dequantize_nvfp4(c, sf, gs, dtype=torch.bfloat16)
                for c, sf in zip(codes, scales)]
        received = (codes[rank], scales[rank])
        inputs["global_scale"] = gs
    else:
        rows = reference.simulate_dispatch(inputs["xs"], plans)
        received = (rows[rank],)
    local = experts // ranks
    expert_out = []
    for receiver, plan in enumerate(plans):
        order = reference.permute_by_expert(plan.recv_expert_ids, experts,
                                            first_expert=receiver * local,
                                            num_local_experts=local)
        source = order.source_rows
        token_rows = torch.where(source >= 0, source // k, source).to(torch.int32)
        gathered = reference.gather_rows(rows[receiver], token_rows)
        expert_out.append(reference.unpermute_and_reduce(gathered, order, plan.recv_weights))
    out = reference.simulate_combine(expert_out, plans)[rank]
    inputs["expected"] = _layer_normalize((out, plans[rank].recv_rank_count_cumsum, received,
                                           rows[rank]), inputs)
    return inputs


def _layer_normalize(result: tuple, inputs: dict) -> dict:
    """(out, recv cumsum, received parts, rows the experts read) -> what the check compares:
    the received parts and expert rows of the valid prefix, each segment in canonical order."""
    out, cumsum, received, rows = result
    total = int(inputs["plans"][inputs["rank"]].total_recv)
    oracle_cumsum = inputs["plans"][inputs["rank"]].recv_rank_count_cumsum
    parts = sort_segments_by_content(tuple(p[:total] for p in received) + (rows[:total],),
                                     oracle_cumsum)
    return dict(out=out, recv_rank_count_cumsum=cumsum, received=parts[:-1], rows=parts[-1])


def layer_check(out: dict, ref, inputs: dict, shape: dict) -> None:
    """Counts, received rows (codes and scales) and the rows the experts read (dequantized)
    exactly; the layer's output with the bf16 tolerance (the reductions' order may differ)."""
    expected = inputs["expected"]
    assert_same(out["recv_rank_count_cumsum"], expected["recv_rank_count_cumsum"],
                what="recv_rank_count_cumsum")
    assert_same(tuple(p.view(torch.uint8) for p in out["received"]),
                tuple(p.view(torch.uint8) for p in expected["received"]),
                what="received rows (bit-exact)")
    assert_same(out["rows"].view(torch.uint8), expected["rows"].view(torch.uint8),
                what="expert input rows (bit-exact)")
    assert_same(out["out"], expected["out"], what="layer output")


def layer_choice(backend: str, device: torch.device) -> dict:
    """The backend of each stage for the layer row ``backend``: that backend wherever the
    stage switch says it can run, else triton (e.g. on CUDA the triton row runs the Triton
    transport and prepare; on SM90 the flashinfer row quantizes with Triton)."""
    choice = {}
    for stage in ("routing", "prepare", "quantize", "transport", "permute"):
        context = {"method": LAYER_ROUTING["method"]} if stage == "routing" else {}
        choice[stage] = (backend if why_unavailable(stage, backend, device, **context) is None
                         else "triton")
    return choice


def _layer_paths(inputs: dict, shape: dict, ctx) -> list[Path]:
    rank, ranks = inputs["rank"], inputs["ranks"]
    experts, k = shape["experts"], shape["top_k"]
    local_experts = experts // ranks
    x = inputs["xs"][rank]
    nvfp4 = shape["payload"] == "nvfp4"
    gs = inputs.get("global_scale")

    def layer(backend):
        def factory():
            choice = layer_choice(backend, ctx.device)
            dequantize = (reference.dequantize_nvfp4 if choice["quantize"] == "torch"
                          else quantize.dequantize_nvfp4)
            a2a = _moe_alltoall(ctx, shape, choice["prepare"], choice["transport"],
                                quantize=choice["quantize"])

            def run():
                ids, weights = route_topk(inputs["logits"], k, LAYER_ROUTING["method"],
                                          bias=inputs["bias"],
                                          num_groups=LAYER_ROUTING["num_groups"],
                                          topk_groups=LAYER_ROUTING["topk_groups"],
                                          routed_scaling=LAYER_ROUTING["routed_scaling"],
                                          backend=choice["routing"])
                plan = a2a.prepare(ids, weights)
                if nvfp4:  # quantize (in dispatch), send codes + scales, decode on arrival
                    received = a2a.dispatch(x, plan, quant="nvfp4", global_scale=gs)
                    recv = dequantize(received[0], received[1], gs, dtype=torch.bfloat16)
                else:
                    recv = a2a.dispatch(x, plan)
                    received = (recv,)
                order = permute_by_expert(plan.recv_expert_ids, experts,
                                          first_expert=rank * local_experts,
                                          num_local_experts=local_experts,
                                          backend=choice["permute"])
                # Token row of each permuted (row, slot) pair; UNUSED (-1) stays -1.
                source = order.source_rows
                token_rows = torch.where(source >= 0, source // k, source)
                rows = gather_rows(recv, token_rows, backend=choice["permute"])
                expert_out = unpermute_and_reduce(rows, order, plan.recv_weights,
                                                  backend=choice["permute"])
                return a2a.combine(expert_out, plan), plan.recv_rank_count_cumsum, received, recv
            return run
        return factory

    timed = ("timed: route, prepare, quantize (static global scale), dispatch of codes + scales, "
             "dequantize, identity experts, combine" if nvfp4 else "")
    return [make_path(b, layer(b), normalize=lambda r: _layer_normalize(r, inputs), timed=timed)
            for b in ("triton", "flashinfer", "torch")] + [
        Path(ONE_SIDED, reason="not run: the layer row of FlashInfer's one-sided all-to-all is "
                               "not written yet (its receive buffers hold stale rows past the "
                               "counts, which the permutation would read)")]


LAYER = Stage(
    name="layer", keys=("tokens", "hidden", "experts", "top_k", "routing"),
    variants=({"payload": "bf16"}, {"payload": "nvfp4"}),
    build=layer_build, paths=_layer_paths, check=layer_check,
    traffic=_layer_traffic, dtype=lambda shape: shape.get("payload", "bf16"), distributed=True,
    oracle=None)


DISTRIBUTED_STAGES = (PREPARE_RANKS, DISPATCH, COMBINE, LAYER)


def not_distributed_record(stage: Stage, ctx) -> dict:
    """The one row listing a multi-rank stage that a single process cannot run."""
    from bench.runner import make_record
    where = "no GPU here" if ctx.device.type != "cuda" else f"{ctx.world_size} process"
    return make_record(stage, {"scope": "ranks"} if stage.name == "prepare" else {}, ctx, "*",
                       ok=None, note=f"not available: needs --gpus 2 or more ({where})")
