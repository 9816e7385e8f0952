"""Routing: the Triton kernel and the public stage function against the torch oracle, and
FlashInfer's fused_topk_deepseek against both on a GPU.

Ids are compared exactly (every method, including rows full of exact logit ties, DeepSeek-V3
group ties and NaN logits); weights with TOLERANCES[float32], except that NaN weights must be
NaN on both faces, with the one bit pattern NAN_WEIGHT_BITS. On CPU the kernel runs in Triton's
interpreter, so the parametrization is a hand-picked list covering each axis (T, E, k, dtype,
method) rather than the cross product.
"""

import itertools
import logging

import pytest
import torch

from a2a.backends import BackendUnavailable
from a2a.routing import check_flashinfer_limits, route_topk_flashinfer
from a2a.routing import route_topk as route_topk_stage
from bench import floor
from bench.near_ties import MAX_NEAR_TIE_ROWS, near_ties
from kernels import reference, routing
from kernels.routing import MAX_EXPERTS
from kernels.routing import route_topk as route_topk_triton
from kernels.spec.routing import NAN_WEIGHT_BITS
from tests.support import TOLERANCES, assert_close

FP32 = TOLERANCES[torch.float32]
# Triton's interpreter computes in numpy, which warns on the NaN arithmetic these tests ask for.
NAN_ARITHMETIC = pytest.mark.filterwarnings(
    "ignore:(invalid value encountered|All-NaN slice):RuntimeWarning")


def launch_id(launch) -> str:
    """The fields of a RoutingLaunch that differ from the defaults (a test id)."""
    default = routing.RoutingLaunch()
    changed = [f"{name}={value}" for name, value in vars(launch).items()
               if value != getattr(default, name)]
    return ",".join(changed) or "default"


def make_logits(num_tokens, num_experts, dtype, device, seed=0):
    """Router logits [T, E]: even rows continuous, odd rows on a grid of 0.5 (many exact ties
    inside a row, also across the k-th / (k+1)-th boundary)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_experts, generator=gen)
    x[1::2] = (x[1::2] * 2).round() / 2
    return x.to(dtype).to(device)


def with_nans(logits, seed=2):
    """``logits`` with NaNs: about a third of the entries at random (both signs of NaN), one
    row all NaN, one row NaN but for 3 numbers, one row holding -inf beside a NaN (rows 2-4,
    where the batch has them)."""
    gen = torch.Generator().manual_seed(seed)
    x = logits.float().cpu().clone()
    num_tokens, num_experts = x.shape
    spots = torch.rand(num_tokens, num_experts, generator=gen) < 0.3
    x[spots] = float("nan")
    x[spots & (torch.rand(num_tokens, num_experts, generator=gen) < 0.5)] = -float("nan")
    if num_tokens > 4:
        x[2] = float("nan")
        x[3, :3] = logits[3, :3].float().cpu()
        x[3, 3:] = float("nan")
        x[4, :2] = torch.tensor([float("-inf"), float("nan")])
    return x.to(logits.dtype).to(logits.device)


def make_bias(num_experts, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, generator=gen) * 0.05).to(device)


def routing_kwargs(method, num_experts, device, groups=None):
    if method != "deepseek_v3":
        return {}
    num_groups, topk_groups = groups or (None, None)
    return dict(bias=make_bias(num_experts, device), num_groups=num_groups,
                topk_groups=topk_groups, routed_scaling=2.5)


def check_against_oracle(logits, top_k, method, run=route_topk_triton, run_kwargs=None,
                         **kwargs):
    ids, weights = run(logits, top_k, method, **kwargs, **(run_kwargs or {}))
    want_ids, want_weights = reference.route_topk(logits, top_k, method, **kwargs)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (logits.shape[0], top_k)
    assert ids.device == logits.device and weights.device == logits.device
    mismatched = (ids != want_ids).any(dim=1).nonzero().flatten().tolist()
    first = mismatched[:1]
    assert not mismatched, (f"{len(mismatched)} rows differ, first {mismatched[:5]}: "
                            f"{ids[first].tolist()} vs {want_ids[first].tolist()}")
    assert_same_weights(weights, want_weights)
    return ids, weights


def assert_same_weights(weights, want):
    """NaN at the same places, with the bits NAN_WEIGHT_BITS on both sides; the rest within
    the fp32 tolerance."""
    nan = want.isnan()
    assert torch.equal(weights.isnan(), nan)
    for got in (weights, want):
        assert (got.view(torch.int32)[nan] == NAN_WEIGHT_BITS).all()
    assert_close(weights[~nan], want[~nan])


def check_invariants(ids, num_experts):
    """Every row holds k distinct ids in [0, E)."""
    if ids.numel() == 0:
        return
    assert int(ids.min()) >= 0 and int(ids.max()) < num_experts
    ordered = ids.sort(dim=1).values
    assert (ordered[:, 1:] != ordered[:, :-1]).all()


# (method, T, E, k, dtype, (num_groups, topk_groups)): each T in 0, 1, 7, 255, 300, 1023, each
# E in 8, 60, 256, 384, each k in 1, 4, 8, both dtypes, every method; DeepSeek-V3 with and
# without dropped groups, group sizes that are not powers of two (60 / 5 = 12, 384 / 8 = 48).
CASES = [
    ("softmax_topk", 7, 8, 1, torch.float32, None),
    ("softmax_topk", 1023, 60, 4, torch.bfloat16, None),
    ("softmax_topk_renorm", 300, 60, 4, torch.bfloat16, None),
    ("softmax_topk_renorm", 1, 8, 8, torch.float32, None),
    ("topk_softmax", 255, 256, 8, torch.float32, None),
    ("sigmoid_topk", 1, 384, 8, torch.bfloat16, None),
    ("sigmoid_topk_renorm", 300, 8, 4, torch.float32, None),
    ("llama4", 255, 60, 1, torch.bfloat16, None),
    ("deepseek_v3", 300, 256, 8, torch.float32, (8, 4)),
    ("deepseek_v3", 7, 60, 4, torch.bfloat16, (5, 2)),
    ("deepseek_v3", 255, 384, 8, torch.bfloat16, (8, 3)),
    ("deepseek_v3", 7, 8, 8, torch.float32, None),
    ("deepseek_v3", 0, 256, 8, torch.float32, (8, 4)),
]


@pytest.mark.parametrize("method, num_tokens, num_experts, top_k, dtype, groups", CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_triton_matches_oracle(device, method, num_tokens, num_experts, top_k, dtype, groups):
    logits = make_logits(num_tokens, num_experts, dtype, device)
    ids, _ = check_against_oracle(logits, top_k, method,
                                  **routing_kwargs(method, num_experts, device, groups))
    check_invariants(ids, num_experts)


def test_the_tie_rows_really_tie(device):
    """The odd rows of make_logits hold ties at the k-th/(k+1)-th boundary, so the tests above
    exercise the tie rule (not only distinct scores)."""
    logits = make_logits(255, 60, torch.float32, device)
    top = logits.sort(dim=1, descending=True).values
    assert (top[1::2, 3] == top[1::2, 4]).float().mean() > 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_group_ties_keep_the_smaller_groups(device, dtype):
    """Every group holds a permutation of the same values (and the bias is 0), so every row
    ties all its group scores exactly: the kept groups must be 0 .. topk_groups-1."""
    num_tokens, num_groups, per_group, topk_groups, top_k = 37, 8, 16, 3, 8
    gen = torch.Generator().manual_seed(3)
    values = (torch.randn(num_tokens, per_group, generator=gen) * 2).round() / 2
    order = torch.stack([torch.randperm(per_group, generator=gen)
                         for _ in range(num_tokens * num_groups)]).view(num_tokens, num_groups, -1)
    logits = values[:, None, :].expand(-1, num_groups, -1).gather(2, order)
    logits = logits.reshape(num_tokens, -1).to(dtype).to(device)
    bias = torch.zeros(num_groups * per_group, device=device)
    ids, _ = check_against_oracle(logits, top_k, "deepseek_v3", bias=bias,
                                  num_groups=num_groups, topk_groups=topk_groups)
    assert int(ids.max()) < topk_groups * per_group


def test_strided_logits(device):
    wide = make_logits(64, 120, torch.float32, device)
    logits = wide[:, ::2]  # stride (120, 2)
    check_against_oracle(logits, 4, "softmax_topk")
    check_against_oracle(wide.t(), 4, "sigmoid_topk")  # [120, 64], stride (1, 120)


def test_negative_zero_ties_positive_zero(device):
    logits = torch.tensor([[-0.0, 0.0, -1.0, 0.0, -0.0, -3.0]] * 3, device=device)
    ids, _ = check_against_oracle(logits, 4, "topk_softmax")
    assert ids[0].tolist() == [0, 1, 3, 4]


# NaN logits: the Triton face ranks them as the oracle does (lowest, ties to the smaller id),
# and gives the same NaN weights. One case per method, DeepSeek-V3 with and without groups.
NAN_CASES = [
    ("softmax_topk", 9, 60, 4, torch.float32, None),
    ("softmax_topk_renorm", 9, 8, 8, torch.bfloat16, None),
    ("topk_softmax", 9, 60, 4, torch.float32, None),
    ("sigmoid_topk", 9, 60, 8, torch.float32, None),
    ("sigmoid_topk_renorm", 9, 8, 4, torch.float32, None),
    ("llama4", 9, 16, 1, torch.float32, None),
    ("deepseek_v3", 9, 256, 8, torch.float32, (8, 4)),
    ("deepseek_v3", 9, 60, 4, torch.bfloat16, (5, 2)),
    ("deepseek_v3", 9, 64, 8, torch.float32, None),
]


@NAN_ARITHMETIC
@pytest.mark.parametrize("method, num_tokens, num_experts, top_k, dtype, groups", NAN_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_nan_logits_rank_lowest_on_both_faces(device, method, num_tokens, num_experts, top_k,
                                              dtype, groups):
    logits = with_nans(make_logits(num_tokens, num_experts, dtype, device))
    ids, weights = check_against_oracle(logits, top_k, method,
                                        **routing_kwargs(method, num_experts, device, groups))
    check_invariants(ids, num_experts)
    assert weights.isnan().any()  # the case reaches the NaN weights
    if groups is None:
        # Row 2 is all NaN: ids 0..k-1 in order. Row 3 has numbers at 0, 1, 2 only: those
        # first, then the NaNs from id 3 up.
        assert ids[2].tolist() == list(range(top_k))
        assert ids[3, 3:].tolist() == list(range(3, top_k))


@NAN_ARITHMETIC
def test_nan_bias_and_group_scores(device):
    """DeepSeek-V3 with NaN in the bias: a group whose two best scores include a NaN has a NaN
    score, ranks last among the groups and is dropped; inside a kept group NaN experts come
    after every number."""
    logits = make_logits(13, 64, torch.float32, device)
    bias = make_bias(64, device)
    bias[8:16] = float("nan")       # group 1 (of 8 x 8): all NaN -> NaN group score
    bias[17] = float("nan")         # group 2: one NaN, its top two are numbers
    logits[::3, 40] = float("nan")  # group 5 of every third row: one NaN
    ids, _ = check_against_oracle(logits, 8, "deepseek_v3", bias=bias, num_groups=8,
                                  topk_groups=4)
    assert not ((ids >= 8) & (ids < 16)).any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stage_function_dispatches(device, caplog, backend):
    """The stage function runs the face it resolved (the switch logs its choice)."""
    logits = make_logits(7, 60, torch.bfloat16, device)
    with caplog.at_level(logging.DEBUG, logger="a2a"):
        check_against_oracle(logits, 4, "deepseek_v3", run=route_topk_stage,
                             run_kwargs=dict(backend=backend),
                             **routing_kwargs("deepseek_v3", 60, device, (5, 2)))
    assert f"routing: {backend!r} -> {backend}" in caplog.text


def test_stage_function_refuses_flashinfer_on_cpu():
    logits = torch.zeros(4, 8)
    with pytest.raises(BackendUnavailable, match="CUDA tensor"):
        route_topk_stage(logits, 2, "deepseek_v3", bias=torch.zeros(8), backend="flashinfer")


def test_flashinfer_adapter_wraps_deepseek_v3_only():
    with pytest.raises(NotImplementedError, match="wraps only fused_topk_deepseek"):
        route_topk_flashinfer(torch.zeros(4, 8), 2, "softmax_topk")


@pytest.mark.parametrize("args, message", [
    ((256, 9, 8, 4), "top_k <= 8"),
    ((384, 8, 1, 1), "without groups rejects top_k > 1 and crashed for top_k=1"),
    ((384, 1, 1, 1), "without groups rejects top_k > 1 and crashed for top_k=1"),
    ((384, 8, 8, 4), "E=384 <= 256"),
    ((256, 8, 4, 2), "E/num_groups=64 <= 32"),
    ((256, 8, 16, 4), "num_groups=16 <= 8"),
    ((256, 8, 8, 5), "topk_groups=5 <= 4"),
])
def test_flashinfer_limits_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        check_flashinfer_limits(*args)
    check_flashinfer_limits(256, 8, 8, 4)  # DeepSeek-V3's own shape passes


@pytest.mark.parametrize("run", [route_topk_triton, route_topk_stage])
def test_errors_are_the_oracles(device, run):
    logits = torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="method='top1' is not one of"):
        run(logits, 2, "top1")
    with pytest.raises(ValueError, match="top_k=9 must be <= the number of experts"):
        run(logits, 9, "softmax_topk")
    with pytest.raises(ValueError, match="needs bias"):
        run(logits, 2, "deepseek_v3")


def test_triton_refuses_more_experts_than_a_row_in_registers(device):
    logits = torch.zeros(2, MAX_EXPERTS + 1, device=device)
    with pytest.raises(ValueError, match=f"E <= {MAX_EXPERTS} \\(use backend='torch'\\)"):
        route_topk_triton(logits, 2, "softmax_topk")


# ---------------------------------------------------------------------------------------------
# GPU: large T, determinism, FlashInfer
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    ("softmax_topk", 8192, 128, 4, torch.bfloat16, None),
    ("softmax_topk_renorm", 4096, 60, 8, torch.float32, None),
    ("topk_softmax", 4096, 384, 8, torch.bfloat16, None),
    ("sigmoid_topk", 4096, 160, 4, torch.float32, None),
    ("sigmoid_topk_renorm", 4096, 512, 32, torch.float32, None),
    ("llama4", 8192, 16, 1, torch.bfloat16, None),
    ("deepseek_v3", 8192, 256, 8, torch.float32, (8, 4)),
    ("deepseek_v3", 8192, 256, 8, torch.bfloat16, (8, 4)),
    ("deepseek_v3", 4096, 384, 8, torch.float32, (1, 1)),
    ("deepseek_v3", 4096, 160, 6, torch.float32, (8, 3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("method, num_tokens, num_experts, top_k, dtype, groups", GPU_CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_triton_matches_oracle_at_scale(device, method, num_tokens, num_experts, top_k, dtype,
                                        groups):
    """The oracle runs on the same GPU: its sigmoid (torch.exp, IEEE division) and the kernel's
    (libdevice expf, div_rn) round identically, so even DeepSeek-V3 ids match exactly."""
    logits = make_logits(num_tokens, num_experts, dtype, device)
    ids, _ = check_against_oracle(logits, top_k, method,
                                  **routing_kwargs(method, num_experts, device, groups))
    check_invariants(ids, num_experts)


@pytest.mark.gpu
@pytest.mark.parametrize("method, groups, num_experts, top_k", [
    ("deepseek_v3", (8, 4), 256, 8), ("softmax_topk", None, 128, 4)])
def test_triton_is_bit_identical_over_100_runs(device, method, groups, num_experts, top_k):
    logits = make_logits(8192, num_experts, torch.bfloat16, device)
    kwargs = routing_kwargs(method, num_experts, device, groups)
    first_ids, first_weights = route_topk_triton(logits, top_k, method, **kwargs)
    for _ in range(100):
        ids, weights = route_topk_triton(logits, top_k, method, **kwargs)
        assert torch.equal(ids, first_ids)
        assert torch.equal(weights.view(torch.int32), first_weights.view(torch.int32))


def _flashinfer_routing_or_skip(device):
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        pytest.skip(f"fused_topk_deepseek needs SM89+, this GPU is SM{major}{minor}")


# FlashInfer's sigmoid differs from ours by a few ulp: rows may differ only on near-ties
# (bench/near_ties.py), and rarely.


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_experts, top_k, groups, dtype", [
    (8192, 256, 8, (8, 4), torch.bfloat16),   # DeepSeek-V3
    (8192, 256, 8, (8, 4), torch.float32),
    (4096, 128, 4, (4, 2), torch.float32),
    (1, 256, 8, (8, 4), torch.float32),
    (0, 256, 8, (8, 4), torch.float32),
])
def test_flashinfer_deepseek_matches_triton_except_near_ties(device, num_tokens, num_experts,
                                                             top_k, groups, dtype):
    _flashinfer_routing_or_skip(device)
    logits = make_logits(num_tokens, num_experts, dtype, device)
    bias = make_bias(num_experts, device)
    num_groups, topk_groups = groups
    kwargs = dict(bias=bias, num_groups=num_groups, topk_groups=topk_groups, routed_scaling=2.5)
    fi_ids, fi_weights = route_topk_stage(logits, top_k, "deepseek_v3", backend="flashinfer",
                                          **kwargs)
    ids, weights = route_topk_triton(logits, top_k, "deepseek_v3", **kwargs)
    assert fi_ids.dtype == torch.int32 and fi_weights.dtype == torch.float32
    assert fi_ids.shape == (num_tokens, top_k)
    check_invariants(fi_ids, num_experts)
    # Compare as sets: order inside the k may swap on a near-tie too.
    fi_sorted, fi_order = fi_ids.sort(dim=1)
    our_sorted, our_order = ids.sort(dim=1)
    differ = (fi_sorted != our_sorted).any(dim=1)
    near, near_inside = near_ties(logits, bias, top_k, num_groups, topk_groups)
    unexplained = (differ & ~near).nonzero().flatten().tolist()
    assert not unexplained, f"rows {unexplained[:5]} differ without a near-tie"
    assert int(differ.sum()) <= MAX_NEAR_TIE_ROWS * max(num_tokens, 1)
    same = ~differ
    assert_close(fi_weights.gather(1, fi_order)[same], weights.gather(1, our_order)[same])
    # Where no near-tie exists among the k+1 best, the order agrees too (best first).
    exact = same & ~near_inside
    assert torch.equal(fi_ids[exact], ids[exact])


@pytest.mark.gpu
def test_flashinfer_ranks_nan_first_as_its_adapter_documents(device):
    """a2a.routing documents FlashInfer's NaN order: highest (the GPU's NaN lies above +inf in
    cub's image of the float bits), its group kept first, every weight of the row NaN; the
    Triton face ranks the same NaN lowest."""
    _flashinfer_routing_or_skip(device)
    logits = make_logits(6, 256, torch.float32, device)
    logits[:, 37] = float("nan")                  # one expert of group 1 (experts 32..63)
    kwargs = dict(bias=make_bias(256, device), num_groups=8, topk_groups=4)
    ids, weights = route_topk_stage(logits, 8, "deepseek_v3", backend="flashinfer", **kwargs)
    assert (ids[:, 0] == 37).all()
    assert weights.isnan().all()
    ours, _ = route_topk_triton(logits, 8, "deepseek_v3", **kwargs)
    assert not (ours == 37).any()


# Launch variants the sweep (python -m bench.tune) may pick: each must give the oracle's ids,
# on rows with ties and rows with NaNs. CPU: a few, covering every value of every field (and
# the sorted-queue rounds with every compact form and weight source, with 2 rows per program,
# and with 2 warps, where they give way to the split rounds); GPU: the full product of the
# selection fields, each with the default and the new sigmoid division and group top-2, and the
# row and warp counts on the default.
SELECTION_FIELDS = dict(
    keys=[routing.KEYS_SPLIT32, routing.KEYS_PACKED64, routing.KEYS_QUEUES],
    group_select=[routing.GROUP_COUNT, routing.GROUP_ROUNDS],
    compact=[routing.COMPACT_NONE, routing.COMPACT_GATHER, routing.COMPACT_RELOAD],
    weights_from=[routing.WEIGHTS_RELOAD, routing.WEIGHTS_CARRY, routing.WEIGHTS_LOAD_EACH])
# (reciprocal, group_top2): the earlier forms, and the default ones that shorten the small-T chain
CHAIN_FORMS = [(routing.RECIP_DIV_RN, routing.TOP2_COUNT), (routing.RECIP_FMA, routing.TOP2_PAIRS)]
FAST = dict(reciprocal=routing.RECIP_FMA, keys=routing.KEYS_QUEUES,
            group_top2=routing.TOP2_PAIRS)
VARIANTS = [routing.SPLIT32_ROUTING, routing.PACKED64_ROUTING,
            routing.RoutingLaunch(keys=routing.KEYS_PACKED64),
            routing.RoutingLaunch(group_select=routing.GROUP_ROUNDS),
            routing.RoutingLaunch(compact=routing.COMPACT_GATHER),
            routing.RoutingLaunch(compact=routing.COMPACT_RELOAD,
                                  weights_from=routing.WEIGHTS_CARRY),
            routing.RoutingLaunch(weights_from=routing.WEIGHTS_CARRY, rows_per_program=2),
            routing.RoutingLaunch(weights_from=routing.WEIGHTS_LOAD_EACH, num_warps=2),
            routing.RoutingLaunch(keys=routing.KEYS_PACKED64, compact=routing.COMPACT_RELOAD,
                                  group_select=routing.GROUP_ROUNDS, rows_per_program=4,
                                  num_warps=2),
            routing.RoutingLaunch(reciprocal=routing.RECIP_FMA),
            routing.RoutingLaunch(group_top2=routing.TOP2_PAIRS),
            routing.RoutingLaunch(keys=routing.KEYS_QUEUES),
            routing.RoutingLaunch(**FAST),
            routing.RoutingLaunch(**FAST, compact=routing.COMPACT_GATHER,
                                  weights_from=routing.WEIGHTS_CARRY),
            routing.RoutingLaunch(**FAST, compact=routing.COMPACT_RELOAD,
                                  weights_from=routing.WEIGHTS_LOAD_EACH),
            routing.RoutingLaunch(**FAST, rows_per_program=2, group_select=routing.GROUP_ROUNDS),
            routing.RoutingLaunch(**FAST, num_warps=2)]
# Without groups: every form of the rounds and of the weights' source, the queues with 4 rows
WITHOUT_GROUPS_VARIANTS = [
    routing.PACKED64_ROUTING, routing.RoutingLaunch(keys=routing.KEYS_PACKED64),
    routing.RoutingLaunch(weights_from=routing.WEIGHTS_CARRY, rows_per_program=2),
    routing.RoutingLaunch(weights_from=routing.WEIGHTS_LOAD_EACH, num_warps=2),
    routing.RoutingLaunch(**FAST), routing.RoutingLaunch(**FAST, rows_per_program=4),
    routing.RoutingLaunch(**FAST, weights_from=routing.WEIGHTS_CARRY),
    routing.RoutingLaunch(**FAST, weights_from=routing.WEIGHTS_LOAD_EACH)]
ALL_VARIANTS = ([routing.RoutingLaunch(**dict(zip(SELECTION_FIELDS, combo)), reciprocal=reciprocal,
                                       group_top2=top2)
                 for combo in itertools.product(*SELECTION_FIELDS.values())
                 for reciprocal, top2 in CHAIN_FORMS]
                + [routing.RoutingLaunch(rows_per_program=rows, num_warps=warps)
                   for rows, warps in ((2, 1), (4, 1), (1, 2), (4, 2))]
                + [routing.RoutingLaunch(**FAST, rows_per_program=rows, num_warps=warps)
                   for rows, warps in ((2, 1), (4, 1), (1, 2))])


def variant_logits(num_tokens, num_experts, dtype, device):
    """Tie rows (odd) and NaN rows (the second half)."""
    logits = make_logits(num_tokens, num_experts, dtype, device)
    half = num_tokens // 2
    logits[half:] = with_nans(logits[half:])
    return logits


def check_launch(logits, top_k, method, launch, **kwargs):
    def run(logits, top_k, method, **kw):
        return route_topk_triton(logits, top_k, method, launch=launch, **kw)
    check_against_oracle(logits, top_k, method, run=run, **kwargs)


@NAN_ARITHMETIC
@pytest.mark.parametrize("launch", VARIANTS, ids=launch_id)
@pytest.mark.parametrize("num_experts, groups, top_k", [(256, (8, 4), 8), (60, (5, 2), 4)])
def test_launch_variants_match_oracle(device, launch, num_experts, groups, top_k):
    logits = variant_logits(14, num_experts, torch.float32, device)
    check_launch(logits, top_k, "deepseek_v3", launch,
                 **routing_kwargs("deepseek_v3", num_experts, device, groups))


# The sorted-queue rounds on the other tile shapes: groups padded inside (160 / 8 = 20 -> 32
# columns), 16 values per lane (E=384), bf16 logits (vectors of 8: two queues each), and a
# compact tile whose groups are not in id order from one queue of a lane to the next.
@NAN_ARITHMETIC
@pytest.mark.parametrize("launch", [routing.RoutingLaunch(**FAST),
                                    routing.RoutingLaunch(**FAST, compact=routing.COMPACT_RELOAD)],
                         ids=launch_id)
@pytest.mark.parametrize("num_experts, groups, top_k, dtype", [
    (160, (8, 3), 6, torch.float32), (384, (8, 3), 8, torch.float32),
    (256, (8, 4), 8, torch.bfloat16), (384, (8, 4), 8, torch.float32)],
    ids=lambda v: str(v).replace("torch.", ""))
def test_queue_rounds_match_oracle_on_other_tiles(device, launch, num_experts, groups, top_k,
                                                  dtype):
    logits = variant_logits(10, num_experts, dtype, device)
    check_launch(logits, top_k, "deepseek_v3", launch,
                 **routing_kwargs("deepseek_v3", num_experts, device, groups))


@pytest.mark.parametrize("method, top_k", [("softmax_topk", 4), ("topk_softmax", 4),
                                           ("sigmoid_topk_renorm", 8)])
@NAN_ARITHMETIC
@pytest.mark.parametrize("launch", WITHOUT_GROUPS_VARIANTS, ids=launch_id)
def test_launch_variants_match_oracle_without_groups(device, method, top_k, launch):
    logits = variant_logits(10, 128, torch.bfloat16, device)
    check_launch(logits, top_k, method, launch)


@NAN_ARITHMETIC
@pytest.mark.parametrize("launch", [routing.RoutingLaunch(**FAST),
                                    routing.RoutingLaunch(**FAST,
                                                          weights_from=routing.WEIGHTS_LOAD_EACH)],
                         ids=launch_id)
def test_queue_rounds_match_oracle_with_32_experts_chosen(device, launch):
    """k = 32 of 512: a lane's queues run dry (NONE_KEY enters at their back) before the end."""
    logits = variant_logits(6, 512, torch.float32, device)
    check_launch(logits, 32, "softmax_topk_renorm", launch)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", ALL_VARIANTS, ids=launch_id)
@pytest.mark.parametrize("num_experts, groups, top_k", [(256, (8, 4), 8), (160, (8, 3), 6)])
def test_launch_variants_match_oracle_at_scale(device, launch, num_experts, groups, top_k):
    logits = variant_logits(4096, num_experts, torch.bfloat16, device)
    check_launch(logits, top_k, "deepseek_v3", launch,
                 **routing_kwargs("deepseek_v3", num_experts, device, groups))


@pytest.mark.gpu
@pytest.mark.parametrize("keys", SELECTION_FIELDS["keys"])
@pytest.mark.parametrize("weights_from", SELECTION_FIELDS["weights_from"])
@pytest.mark.parametrize("reciprocal", [routing.RECIP_DIV_RN, routing.RECIP_FMA])
@pytest.mark.parametrize("method, num_experts, top_k", [
    ("deepseek_v3", 384, 8), ("softmax_topk_renorm", 512, 32), ("softmax_topk", 128, 4),
    ("sigmoid_topk", 16, 1), ("sigmoid_topk_renorm", 256, 8)])
def test_launch_variants_match_oracle_at_scale_without_groups(device, keys, weights_from,
                                                              reciprocal, method, num_experts,
                                                              top_k):
    logits = variant_logits(4096, num_experts, torch.float32, device)
    launch = routing.RoutingLaunch(keys=keys, weights_from=weights_from, reciprocal=reciprocal)
    check_launch(logits, top_k, method, launch,
                 **routing_kwargs(method, num_experts, device, None))


def sigmoid_sweep(device):
    """fp32 logits [T, 32] whose every value is a different float: all of [-90, -85] (where
    exp(-x) nears and passes 2**125 and overflows, so that 1 / (1 + exp(-x)) is subnormal or 0)
    one float in 7, and 2**20 more log-uniform over +-1e-8 .. 100 of both signs."""
    low = torch.tensor(-90.0).view(torch.int32).item()
    high = torch.tensor(-85.0).view(torch.int32).item()
    tail = torch.arange(high, low + 1, 7, dtype=torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(5)
    spread = torch.exp(torch.empty(1 << 20).uniform_(-18.5, 4.7, generator=gen))
    spread = spread * (torch.randint(0, 2, (1 << 20,), generator=gen) * 2 - 1)
    values = torch.cat([tail, spread, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])
    values = torch.cat([values, torch.zeros(-len(values) % 32)])
    return values.view(-1, 32).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("reciprocal", [routing.RECIP_FMA, routing.RECIP_FMA_TILE])
@pytest.mark.parametrize("weights_from", [routing.WEIGHTS_RELOAD, routing.WEIGHTS_LOAD_EACH])
def test_branch_free_sigmoid_is_the_oracles_bit_for_bit(device, weights_from, reciprocal):
    """RECIP_FMA's sigmoid (MUFU.RCP and the division's fast path written out, div.rn only for a
    subnormal 1 / d, per thread or, RECIP_FMA_TILE, per tile) against the oracle's
    1 / (1 + exp(-x)) on the same GPU, bit for bit: the weights of sigmoid_topk with k = E are
    the sigmoids of the whole row."""
    logits = sigmoid_sweep(device)
    launch = routing.RoutingLaunch(reciprocal=reciprocal, keys=routing.KEYS_QUEUES,
                                   weights_from=weights_from)
    ids, weights = route_topk_triton(logits, 32, "sigmoid_topk", launch=launch)
    want_ids, want_weights = reference.route_topk(logits, 32, "sigmoid_topk")
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights.view(torch.int32), want_weights.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [routing.RoutingLaunch(reciprocal=routing.RECIP_FMA),
                                    routing.RoutingLaunch(reciprocal=routing.RECIP_FMA,
                                                          num_warps=2),
                                    routing.RoutingLaunch(**FAST),
                                    routing.RoutingLaunch(**FAST, compact=routing.COMPACT_RELOAD),
                                    routing.RoutingLaunch(reciprocal=routing.RECIP_FMA_TILE)],
                         ids=launch_id)
def test_branch_free_sigmoid_ranks_tiny_scores_as_the_oracle(device, launch):
    """DeepSeek-V3 rows with no bias whose scores are tiny sigmoids: logits in [-90, -85]
    (mostly subnormal sigmoids or 0, taking the div.rn branch, all of a thread's values
    together) and in [-86.6, -84] (1 / d just above the smallest normals, the fast path's
    edge), many exact ties among them: the ids match only if each sigmoid is the oracle's bit
    for bit."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.rand(2048, 256, generator=gen)
    logits[:1024] = logits[:1024] * -5.0 - 85.0
    logits[1024:] = logits[1024:] * -2.6 - 84.0
    logits[::3] = (logits[::3] * 4).round() / 4  # exact ties of the logits too
    logits = logits.to(device)
    check_launch(logits, 8, "deepseek_v3", launch, bias=torch.zeros(256, device=device),
                 num_groups=8, topk_groups=4, routed_scaling=2.5)


def test_routing_launch_floor_kernels(device):
    """bench.floor's routing yardsticks (timed by bench.tune beside the routing cases): the
    empty kernel stores its one value; row_ids stores each row's int32 max plus 0 .. k-1, so
    that every id depends on the whole row."""
    (out,) = floor.empty_launch(device)()
    assert out.tolist() == [0]
    logits = make_logits(19, 256, torch.float32, device)
    ids = floor.row_ids(logits, 8)
    top = logits.view(torch.int32).max(dim=1).values
    assert torch.equal(ids, top[:, None] + torch.arange(8, dtype=torch.int32, device=device))
    assert floor.row_ids(logits[:0], 8).shape == (0, 8)
    with pytest.raises(ValueError, match="power-of-two top_k"):
        floor.row_ids(logits, 6)


def test_default_launch_is_the_tuned_rule_on_a_gpu_and_the_split_rounds_interpreted():
    """route_topk(launch=None) takes DEFAULT_ROUTING with compiled Triton and SPLIT32_ROUTING
    under the interpreter (the same bits: every launch is checked against the oracle)."""
    from kernels.hardware import interpreting
    expected = routing.SPLIT32_ROUTING if interpreting() else routing.DEFAULT_ROUTING
    assert routing.default_launch() == expected
    assert routing.DEFAULT_ROUTING.keys == routing.KEYS_QUEUES
