"""``python -m bench.tune``: time the launch-rule variants of the Triton kernels on one GPU.

The launch rules of the quantize, routing and permute kernels are frozen launch configs
(``kernels.quantize.NVFP4Launch``, ``BlockLaunch``, ``AmaxLaunch``;
``kernels.routing.RoutingLaunch``; ``kernels.permute.PermuteLaunch``) that each launcher takes
as ``launch=``. This tool passes each variant in turn, checks its output bit for bit against
the torch oracle (routing: the ids), and times it the way ``python -m bench`` times that stage
(CUDA-graph replay; quantize with an L2 flush before each call), next to FlashInfer where it
has the op. Defaults are chosen from the rows of such a run, and the JSON it writes
(``bench/results/tune-<gpu>-<time>.json``) is the record of that choice. The NVFP4 case also
times ``bench.floor`` (the same bytes read and written with no arithmetic), the yardstick for
how close the quantizer is to the memory system's limit for its traffic; the routing cases time
the launch floor of routing's launch shape the same way (``floor:`` rows). Flushed cases are also
timed back to back without the flush (``steady_us``): every call's reads miss L2 anyway, and
the previous call's writes drain during the next one.

    python -m bench.tune                     # every kernel
    python -m bench.tune --only nvfp4,routing
    python -m bench.tune --only routing,permute

The permute cases time both forms of ``permute_by_expert`` (one launch, three passes) at the
token counts around the rule's branch point; the summary prints the best row of each form per
case, from which the branch point (``PermuteLaunch.single_max_pairs``) is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from bench.report import gpu_name
from bench.stages import DEEPSEEK_GROUPS, DEEPSEEK_SCALING, DEEPSEEK_TOPK_GROUPS
from bench.timing import time_graph, time_graph_flushed

SEED = 0
BIG, SMALL = (8192, 7168), (128, 7168)
KERNELS = ("nvfp4", "mxfp8", "global_scale", "routing", "permute")


@dataclass
class Case:
    """One op on one shape: ``run(launch)`` returns the output tensors for a launch config
    (None: the launcher's default), ``expected`` the oracle's; ``graph``: plain CUDA-graph
    replay, else replay with an L2 flush before each call; ``checked``: how many leading
    outputs are compared bit for bit (None: all; routing: the ids, its weights are checked by
    the tests); ``kernel``: the ``--only`` name that selects the case."""

    name: str
    run: Callable[[object], tuple]
    expected: Callable[[], tuple]
    variants: list  # launch configs; None is the default rule
    kernel: str
    graph: bool = False
    checked: Optional[int] = None
    others: dict[str, Callable[[], object]] = field(default_factory=dict)  # e.g. FlashInfer


def _grid(config_type, **axes) -> list:
    """One ``config_type`` per combination of the axes' values (the other fields default)."""
    return [config_type(**dict(zip(axes, combo))) for combo in itertools.product(*axes.values())]


def variant_label(launch) -> str:
    """The fields of a launch config that differ from its type's defaults ("default" if none)."""
    if launch is None:
        return "default"
    default = type(launch)()
    changed = [f"{f.name}={getattr(launch, f.name)}" for f in dataclasses.fields(launch)
               if getattr(launch, f.name) != getattr(default, f.name)]
    return ",".join(changed) or "default"


def _with_launch(fn):
    """``fn(launch=config)`` for a config, ``fn()`` for None (the launcher's default rule)."""
    return lambda launch: fn() if launch is None else fn(launch=launch)


def _quantize_cases(device) -> list[Case]:
    from bench import floor
    from kernels import quantize as Q
    from kernels import reference as R
    generator = torch.Generator(device="cpu").manual_seed(SEED)
    tiles = [None] + _grid(Q.BlockLaunch, tile_elements=[2048, 4096, 8192, 16384],
                           num_warps=[4, 8], max_blocks=[32, 64])
    # NVFP4: a thread holds one block per tile (tile_elements = 16 * 32 * num_warps);
    # steps: tiles per program along a row (7 tiles cover a 7168-wide row)
    nvfp4_tiles = [None] + [
        Q.NVFP4Launch(max_blocks=64, steps=steps, tile_elements=tile, num_warps=warps,
                      prefetch=prefetch, maxnreg=maxnreg)
        for tile, warps, prefetch, maxnreg, steps in (
            (2048, 4, 2, None, 8), (2048, 4, 1, None, 8), (2048, 4, 3, None, 8),
            (2048, 4, 3, 64, 8), (1024, 2, 2, None, 8), (1024, 2, 3, None, 8),
            (4096, 8, 2, None, 8), (4096, 8, 3, None, 8), (2048, 4, 2, None, 4))]
    # the packed stores' L2 eviction priority
    policies = [Q.NVFP4Launch(store_policy=policy) for policy in ("", "evict_first")]
    # programs_per_sm = 2**20: one tile per program (no persistent loop)
    amax = [None] + _grid(Q.AmaxLaunch, programs_per_sm=[4, 16, 1 << 20], tile_rows=[4, 8, 16],
                          tile_cols=[1024, 2048], num_warps=[4, 8])
    cases = []
    for rows, hidden in (BIG, SMALL):
        x = (torch.randn(rows, hidden, generator=generator) * 3).to(torch.bfloat16).to(device)
        gs = R.nvfp4_global_scale(x)
        # the same bytes moved without the arithmetic (bench/floor.py), for scale
        floors = {f"traffic floor {'x'.join(map(str, v[:3]))} {v[3] or 'default'}":
                  lambda x=x, v=v: floor.nvfp4_traffic(x, v) for v in floor.FLOOR_VARIANTS}
        for layout in ("linear", "swizzled_128x4") if rows == BIG[0] else ("linear",):
            others = dict(floors) if layout == "linear" else {}
            if rows == BIG[0]:  # each call into other buffers: no output is still in L2
                for policy in (Q.DEFAULT_NVFP4.store_policy, ""):
                    others[f"rotating outputs, store_policy={policy}"] = rotating_nvfp4(
                        x, gs, layout, Q.NVFP4Launch(store_policy=policy))
            cases.append(Case(
                f"nvfp4_{layout} [{rows},{hidden}]",
                _with_launch(lambda x=x, gs=gs, layout=layout, **kw: Q.quantize_nvfp4(
                    x, gs, layout=layout, check_values=False, **kw)),
                lambda x=x, gs=gs, layout=layout: R.quantize_nvfp4(x, gs, layout=layout),
                nvfp4_tiles + policies, kernel="nvfp4", others=others))
        if rows == BIG[0]:
            cases.append(Case(f"mxfp8 [{rows},{hidden}]",
                              _with_launch(lambda x=x, **kw: Q.quantize_mxfp8(x, **kw)),
                              lambda x=x: R.quantize_mxfp8(x), tiles, kernel="mxfp8"))
        cases.append(Case(f"global_scale [{rows},{hidden}]",
                          _with_launch(lambda x=x, **kw: (Q.nvfp4_global_scale(x, **kw),)),
                          lambda x=x: (R.nvfp4_global_scale(x),), amax,
                          kernel="global_scale"))
    return cases


def rotating_nvfp4(x: torch.Tensor, gs: torch.Tensor, layout: str,
                   launch) -> Callable[[], tuple]:
    """A call of ``quantize_nvfp4(x, gs, layout=layout, launch=launch)`` that writes into the
    next of enough output buffers (out=, out_scales=) to hold 4x the L2 (at least 2), in turn:
    a timed call never finds its output's lines in L2 from an earlier call, so every call's
    writes reach DRAM within the timed replay (checks that a store policy's gain is not such
    reuse)."""
    from kernels import quantize as Q
    from kernels.hardware import l2_cache_bytes
    from kernels.spec import swizzled_scale_shape
    rows, hidden = x.shape
    scale_shape = swizzled_scale_shape(rows, hidden // 16, layout)
    out_bytes = rows * hidden // 2 + scale_shape[0] * scale_shape[1]
    l2_bytes = l2_cache_bytes(x.device) or out_bytes  # (0 where there is no L2 to outrun)
    buffers = [(torch.empty(rows, hidden // 2, dtype=torch.uint8, device=x.device),
                torch.empty(scale_shape, dtype=torch.uint8, device=x.device))
               for _ in range(max(2, -(-4 * l2_bytes // out_bytes)))]
    calls = itertools.count()

    def call():
        out, out_scales = buffers[next(calls) % len(buffers)]
        return Q.quantize_nvfp4(x, gs, layout=layout, out=out, out_scales=out_scales,
                                check_values=False, launch=launch)
    return call


# DeepSeek-V3 routing is timed beside FlashInfer's fused_topk_deepseek from 1 to 8192 tokens:
# one row per program up to 1024 tokens, so the small counts time the latency of one program's
# chain of reductions, 8192 the throughput. At a few counts the launch floor is timed too
# (bench/floor.py): an empty kernel (T=16) and a kernel that only loads each row and stores k
# ids, one warp per row (T=1, 16, 128): how much of a call is launch spacing in the graph.
ROUTING_TOKENS = (1, 16, 64, 128, 512, 2048, 8192)
ROUTING_ROW_FLOOR_TOKENS = (1, 16, 128)
ROUTING_EMPTY_FLOOR_TOKENS = (16,)


def routing_variants() -> list:
    """The routing launch variants timed: the default, the two earlier forms (the int32 rounds
    over whole rows, the int64 rounds), the default with each of its three shortenings of the
    small-T chain undone (the rounds over sorted per-lane queues, the branch-free sigmoid
    division, the one-pass group top-2), and the default with each remaining choice that may
    still help it."""
    from kernels import routing as K
    return [None, K.SPLIT32_ROUTING, K.PACKED64_ROUTING,
            K.RoutingLaunch(keys=K.KEYS_SPLIT32),
            K.RoutingLaunch(reciprocal=K.RECIP_DIV_RN),
            K.RoutingLaunch(group_top2=K.TOP2_COUNT),
            K.RoutingLaunch(compact=K.COMPACT_RELOAD),
            K.RoutingLaunch(weights_from=K.WEIGHTS_LOAD_EACH),
            K.RoutingLaunch(group_select=K.GROUP_ROUNDS),
            K.RoutingLaunch(rows_per_program=2)]


def _routing_floors(logits: torch.Tensor, tokens: int) -> dict:
    """The launch-floor rows of the routing case at ``tokens`` (see ROUTING_TOKENS)."""
    from bench import floor
    floors = {}
    if tokens in ROUTING_EMPTY_FLOOR_TOKENS:
        floors["floor: empty kernel (1 program, 1 warp, 1 store)"] = floor.empty_launch(
            logits.device)
    if tokens in ROUTING_ROW_FLOOR_TOKENS:
        floors[f"floor: load a row, store 8 ids ({tokens} programs of 1 warp)"] = (
            lambda: (floor.row_ids(logits, 8),))
    return floors


def _routing_cases(device) -> list[Case]:
    from a2a.routing import route_topk
    from kernels import reference as R
    from kernels import routing as K
    generator = torch.Generator(device="cpu").manual_seed(SEED)
    cases = []
    for tokens in ROUTING_TOKENS:
        logits = torch.randn(tokens, 256, generator=generator).to(device)
        bias = (torch.randn(256, generator=generator) * 0.1).to(device)
        args = (logits, 8, "deepseek_v3")
        kwargs = dict(bias=bias, num_groups=DEEPSEEK_GROUPS, topk_groups=DEEPSEEK_TOPK_GROUPS,
                      routed_scaling=DEEPSEEK_SCALING)
        cases.append(Case(
            f"deepseek_v3 T={tokens} E=256 k=8 groups 8/4",
            _with_launch(lambda args=args, kwargs=kwargs, **kw: K.route_topk(*args, **kwargs,
                                                                             **kw)),
            lambda args=args, kwargs=kwargs: R.route_topk(*args, **kwargs), routing_variants(),
            kernel="routing", graph=True, checked=1,
            others={"flashinfer": lambda args=args, kwargs=kwargs: route_topk(
                *args, **kwargs, backend="flashinfer"), **_routing_floors(logits, tokens)}))
    softmax = torch.randn(8192, 128, generator=generator).to(device)
    cases.append(Case(
        "softmax_topk T=8192 E=128 k=4",
        _with_launch(lambda **kw: K.route_topk(softmax, 4, "softmax_topk", **kw)),
        lambda: R.route_topk(softmax, 4, "softmax_topk"),
        [None, K.RoutingLaunch(keys=K.KEYS_PACKED64), K.RoutingLaunch(keys=K.KEYS_SPLIT32),
         K.RoutingLaunch(weights_from=K.WEIGHTS_CARRY),
         K.RoutingLaunch(keys=K.KEYS_SPLIT32, rows_per_program=4)]
        + _grid(K.RoutingLaunch, rows_per_program=[1, 2, 4], num_warps=[1, 2]),
        kernel="routing", graph=True, checked=1))
    return cases


# permute_by_expert: (tokens, experts, align); k = 8, all experts local, ids uniform over [0, E)
# (check_ids=False, as the bench times it: no host read). E=256 at the token counts and
# around the branch point of the rule (2048 pairs: 256 tokens); E=64 and 384 at a few.
PERMUTE_SHAPES = ([(t, 256, a) for a in (1, 128) for t in (1, 16, 64, 128, 256, 512, 1024, 8192)]
                  + [(t, e, a) for e in (64, 384) for a in (1, 128) for t in (16, 256, 8192)])
# The one-launch form is not timed past this many pairs (its every program compares a slice
# with all T*k ids: far slower there, by construction).
PERMUTE_SINGLE_MAX_TIMED = 16384


def permute_variants(num_pairs: int) -> list:
    """The permute launch variants timed at ``num_pairs`` = T*k pairs: the default rule, each
    form forced with its knobs varied one at a time, and the three-pass form as it was before
    the one-launch form (one-hot ranks)."""
    from kernels import permute as K
    single = [K.PermuteLaunch(form="single"),
              K.PermuteLaunch(form="single", single_warps=2),
              K.PermuteLaunch(form="single", single_warps=16),
              K.PermuteLaunch(form="single", single_programs=64),
              K.PermuteLaunch(form="single", single_programs=256),
              K.PermuteLaunch(form="single", single_fill=8192),
              K.PermuteLaunch(form="single", single_chunk=256),
              K.PermuteLaunch(form="single", single_chunk=512),
              K.PermuteLaunch(form="single", single_chunk=1024),
              K.PermuteLaunch(form="single", single_warps=8),
              K.PermuteLaunch(form="single", single_wide_warps=4)]
    three = [K.PermuteLaunch(form="three_pass"),
             K.PermuteLaunch(form="three_pass", block_pairs=256),
             K.PermuteLaunch(form="three_pass", place_warps=4),
             K.PermuteLaunch(form="three_pass", scan_blocks=512, expert_chunk=4),
             K.PermuteLaunch(form="three_pass", scan_blocks=128, expert_chunk=32),
             K.ONEHOT_PERMUTE]
    return [None] + (single if num_pairs <= PERMUTE_SINGLE_MAX_TIMED else []) + three


def _permute_cases(device) -> list[Case]:
    from kernels import permute as K
    from kernels import reference as R
    generator = torch.Generator(device="cpu").manual_seed(SEED)
    cases = []
    for tokens, experts, align in PERMUTE_SHAPES:
        ids = torch.randint(0, experts, (tokens, 8), generator=generator,
                            dtype=torch.int32).to(device)

        def fields(permutation):
            return (permutation.source_rows, permutation.expert_counts,
                    permutation.expert_offsets, permutation.inverse)

        cases.append(Case(
            f"permute T={tokens} E={experts} k=8 align={align}",
            _with_launch(lambda ids=ids, experts=experts, align=align, fields=fields, **kw: fields(
                K.permute_by_expert(ids, experts, align=align, check_ids=False, **kw))),
            lambda ids=ids, experts=experts, align=align, fields=fields: fields(
                R.permute_by_expert(ids, experts, align=align)),
            permute_variants(tokens * 8), kernel="permute", graph=True))
    return cases


def _same(actual: tuple, expected: tuple, checked: Optional[int]) -> bool:
    """Bit-equal outputs, the first ``checked`` of them (None: all)."""
    pairs = list(zip(actual, expected))[:checked]
    return all(a.shape == e.shape and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1
                                                  else a, e.view(torch.uint8)
                                                  if e.dtype.itemsize == 1 else e)
               for a, e in pairs)


def _times(fn, graph: bool) -> dict:
    """{time_us}: graph replay (``graph``), else {time_us: replay with an L2 flush before each
    call (the bench's timing), steady_us: back-to-back replay, no flush}."""
    if graph:
        return dict(time_us=time_graph(fn).median_us)
    return dict(time_us=time_graph_flushed(fn).median_us, steady_us=time_graph(fn).median_us)


def _print_row(row: dict) -> None:
    steady = f"(back to back {row['steady_us']:.2f})" if row.get("steady_us") else ""
    print(f"{row['case']:40s} {row['variant']:90s} {'ok' if row['ok'] else 'FAIL'} "
          f"{row.get('time_us') or 0:9.2f} {steady} {row.get('error', '')}", flush=True)


def run_case(case: Case) -> list[dict]:
    expected = case.expected()
    rows = []
    for name, fn in case.others.items():
        try:
            rows.append(dict(case=case.name, variant=name, ok=True, **_times(fn, case.graph)))
        except Exception as error:  # noqa: BLE001 - reported, the sweep goes on
            rows.append(dict(case=case.name, variant=name, ok=False, error=str(error)[:200]))
        _print_row(rows[-1])
    for launch in case.variants:
        label = variant_label(launch)
        try:
            ok = _same(case.run(launch), expected, case.checked)
            times = _times(lambda launch=launch: case.run(launch), case.graph) if ok else {}
            rows.append(dict(case=case.name, variant=label, ok=ok, **times))
        except Exception as error:  # noqa: BLE001
            rows.append(dict(case=case.name, variant=label, ok=False, error=str(error)[:200]))
        _print_row(rows[-1])
    return rows


def print_forms(rows: list[dict]) -> None:
    """For the permute cases: the best time of each forced form (``form=...`` in the variant
    label) and the default rule's, per case: where the one-launch form stops winning is the
    branch point of ``PermuteLaunch``'s rule."""
    best: dict = {}
    for row in rows:
        if not (row["case"].startswith("permute") and row["ok"] and row.get("time_us")):
            continue
        form = next((part.split("=")[1] for part in row["variant"].split(",")
                     if part.startswith("form=")), "rule")
        key = (row["case"], form)
        if key not in best or row["time_us"] < best[key]["time_us"]:
            best[key] = row
    if not best:
        return
    print("\npermute, best per form (us):")
    for case in dict.fromkeys(c for c, _ in best):
        cells = [f"{form} {best[(case, form)]['time_us']:7.2f}"
                 for form in ("single", "three_pass", "rule") if (case, form) in best]
        print(f"  {case:40s} " + "   ".join(cells))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(KERNELS),
                        help=f"comma-separated, among: {', '.join(KERNELS)}")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                        help="folder for the tune-<gpu>-<time>.json record (default: "
                             "bench/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.tune times kernels on a GPU; none is visible")
    device = torch.device("cuda", 0)
    wanted = args.only.split(",")
    unknown = sorted(set(wanted) - set(KERNELS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not among {', '.join(KERNELS)}")
    builders = [(("nvfp4", "mxfp8", "global_scale"), _quantize_cases),
                (("routing",), _routing_cases), (("permute",), _permute_cases)]
    cases = [c for kernels, build in builders if set(kernels) & set(wanted)
             for c in build(device) if c.kernel in wanted]
    rows = [row for case in cases for row in run_case(case)]
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    gpu = gpu_name(device)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"tune-{gpu.lower().replace(' ', '-')}-{stamp}.json")
    with open(path, "w") as f:
        json.dump(dict(gpu=gpu, date=stamp, torch=torch.__version__, rows=rows), f, indent=1)
    best = {}
    for row in rows:
        if (row["ok"] and row.get("time_us") and row["variant"] != "flashinfer"
                and not row["variant"].startswith(("traffic floor", "floor:"))):
            if row["case"] not in best or row["time_us"] < best[row["case"]]["time_us"]:
                best[row["case"]] = row
    print("\nbest per case:")
    for case, row in best.items():
        default = next((r for r in rows if r["case"] == case and r["variant"] == "default"), None)
        print(f"  {case:40s} {row['time_us']:8.2f} us  {row['variant']}"
              + (f"  (default {default['time_us']:.2f})" if default and default.get("time_us")
                 else ""))
    print_forms(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
