"""The Triton permutation kernels (kernels.permute) against the oracle, and the stage switch.

Index buffers and gathered rows are compared exactly. unpermute_and_reduce is compared exactly
too, in every dtype: the kernel performs the oracle's float32 operations in the same order (fp
fusion off, so no fma) and rounds to the output dtype to nearest even, as torch does.
On CPU everything runs through Triton's interpreter on small shapes; ``gpu`` tests take the
production sizes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import a2a.permute
from a2a.backends import BackendUnavailable
from kernels import gather as triton_gather
from kernels import permute as triton_permute
from kernels import reference
from kernels.types import UNUSED, Permutation
from test_reference_permute import assert_permutation_equal, check_permutation_invariants

ROOT = Path(__file__).resolve().parents[1]


def random_ids(num_tokens, top_k, num_experts, device, *, padding=True) -> torch.Tensor:
    """[T, k] int32 ids in [0, E] (E = padding) or [0, E)."""
    high = num_experts + 1 if padding else num_experts
    return torch.randint(0, high, (num_tokens, top_k), dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------
# permute_by_expert
# ---------------------------------------------------------------------------------------------

def launch_id(launch) -> str:
    """The fields of a PermuteLaunch that differ from the defaults (a test id)."""
    default = triton_permute.PermuteLaunch()
    changed = [f"{name}={value}" for name, value in vars(launch).items()
               if value != getattr(default, name)]
    return ",".join(changed) or "default"


SINGLE = triton_permute.PermuteLaunch(form="single")
THREE_PASS = triton_permute.PermuteLaunch(form="three_pass")
FORMS = {"rule": triton_permute.DEFAULT_PERMUTE, "single": SINGLE, "three_pass": THREE_PASS}

# Each axis covered, kept small for the interpreter: T in 0, 1, 7, 16, 64, 255, 256, 257, 1023;
# E in 8, 60, 256, 384; k in 1, 4, 8; align 1, 16, 128; a local range; ids drawn from [0, E] so
# the padding id appears. The default rule runs the one-launch form up to 2048 pairs (E_local
# <= 256) or 1024 (E_local = 384): T=256 / 257 at k=8 and T=128 / 129 at E=384 are its two
# sides. Each case also runs the form the rule does not pick (``other``: False where that
# would be slow in the interpreter).
PERMUTE_CASES = [
    # T,   k, E,   first, E_local, align, other
    (0,    4, 8,   0,     None,    16,    True),
    (1,    1, 8,   0,     None,    1,     True),
    (1,    8, 256, 0,     None,    128,   True),
    (7,    4, 60,  0,     None,    16,    True),
    (16,   8, 384, 0,     None,    128,   True),
    (64,   8, 256, 64,    64,      16,    True),
    (256,  8, 384, 0,     None,    1,     True),
    (257,  8, 384, 0,     None,    16,    True),
    (255,  8, 8,   0,     None,    1,     True),
    (256,  8, 256, 0,     None,    128,   True),
    (257,  8, 256, 0,     None,    1,     True),
    (300,  4, 60,  30,    15,      16,    False),
    (1023, 8, 256, 0,     None,    16,    False),
]


def check_permute(topk_ids, num_experts, *, launch, first_expert=0, num_local=None, align=1):
    kwargs = dict(first_expert=first_expert, num_local_experts=num_local, align=align)
    got = triton_permute.permute_by_expert(topk_ids, num_experts, launch=launch, **kwargs)
    assert_permutation_equal(got, reference.permute_by_expert(topk_ids, num_experts, **kwargs))
    return got


@pytest.mark.parametrize("num_tokens, top_k, num_experts, first_expert, num_local, align, other",
                         PERMUTE_CASES)
def test_permute_matches_oracle(device, seed, num_tokens, top_k, num_experts, first_expert,
                                num_local, align, other):
    topk_ids = random_ids(num_tokens, top_k, num_experts, device)
    local = num_local or num_experts - first_expert
    single = triton_permute.DEFAULT_PERMUTE.chooses_single(topk_ids.numel(), local)
    launches = [triton_permute.DEFAULT_PERMUTE] + ([THREE_PASS if single else SINGLE]
                                                   if other else [])
    for launch in launches:
        got = check_permute(topk_ids, num_experts, launch=launch, first_expert=first_expert,
                            num_local=num_local, align=align)
    check_permutation_invariants(got, topk_ids, first_expert=first_expert,
                                 num_local_experts=local, align=align)


@pytest.mark.parametrize("num_tokens, num_experts, align", [(16, 256, 1), (257, 60, 16)])
def test_overlap_previous_gives_the_same_permutation(device, seed, num_tokens, num_experts,
                                                     align):
    """``overlap_previous`` (a stream-order promise) changes where the first launch waits, not
    what it computes: the oracle's buffers on both backends, in both forms."""
    topk_ids = random_ids(num_tokens, 8, num_experts, device)
    want = reference.permute_by_expert(topk_ids, num_experts, align=align)
    for backend in ("triton", "torch"):
        assert_permutation_equal(a2a.permute.permute_by_expert(
            topk_ids, num_experts, align=align, overlap_previous=True, backend=backend), want)


def test_rule_branch_points():
    """The default rule: the one-launch form up to 2048 pairs for E_local <= 512 (512 bins),
    half as many at 1024 bins (E_local 513..1024)."""
    rule = triton_permute.DEFAULT_PERMUTE
    assert rule.chooses_single(0, 8) and rule.chooses_single(2048, 256)
    assert not rule.chooses_single(2056, 256) and not rule.chooses_single(65536, 256)
    assert rule.chooses_single(2048, 384) and not rule.chooses_single(2056, 384)
    assert rule.chooses_single(1024, 600) and not rule.chooses_single(1032, 600)
    assert SINGLE.chooses_single(65536, 256) and not THREE_PASS.chooses_single(8, 8)
    with pytest.raises(ValueError, match="PermuteLaunch.form='two_pass' must be one of"):
        triton_permute.PermuteLaunch(form="two_pass").chooses_single(8, 8)


def test_single_form_reads_the_ids_in_steps_of_a_power_of_two():
    """The one-launch form's step over the ids: T*k rounded up to a power of two, at least one
    id per thread (128 at 4 warps), at most single_chunk (two steps past it); the slice does not
    change with it. The warps: 8 from a step of 2048 ids over at most 256 bins, else 4."""
    rule = triton_permute.DEFAULT_PERMUTE
    tiles = {pairs: triton_permute.single_tile(pairs, 256, rule) for pairs in
             (0, 1, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048)}
    assert {pairs: chunk for pairs, (chunk, _, _) in tiles.items()} == {
        0: 128, 1: 128, 128: 128, 129: 256, 256: 256, 257: 512, 512: 512, 513: 1024,
        1024: 1024, 1025: 2048, 2048: 2048}
    assert {pairs: warps for pairs, (_, _, warps) in tiles.items() if warps != 4} == {
        1025: 8, 2048: 8}
    assert {slice_pairs for _, slice_pairs, _ in tiles.values()} == {16}
    # over 512 bins (E_local = 384) the programs stay at 4 warps
    assert triton_permute.single_tile(2048, 384, rule) == (2048, 16, 4)
    narrow = triton_permute.PermuteLaunch(single_chunk=1024, single_warps=16)
    assert triton_permute.single_tile(8, 256, narrow)[0] == 512
    assert triton_permute.single_tile(2048, 256, narrow) == (1024, 16, 16)


@pytest.mark.parametrize("num_pairs", [128, 129, 256, 257, 512, 513, 1024, 1025, 2048])
def test_single_form_matches_oracle_on_both_sides_of_each_step(device, seed, num_pairs):
    """Exact equality at T*k on both sides of every step width of the one-launch form (k=1, so
    T = T*k), aligned segments and unowned ids included."""
    topk_ids = random_ids(num_pairs, 1, 60, device)
    check_permute(topk_ids, 60, launch=SINGLE, first_expert=10, num_local=40, align=16)


# Knobs the sweep (python -m bench.tune) may set, at values that exercise the loops: slices
# of several pairs per program, several tail blocks and expert tiles per program, several
# scan steps and expert chunks, both ranks of pass 3.
LAUNCH_VARIANTS = [
    triton_permute.PermuteLaunch(form="single", single_programs=4, single_fill=8192,
                                 single_warps=4),
    triton_permute.PermuteLaunch(form="single", single_warps=16, single_programs=256),
    triton_permute.PermuteLaunch(form="three_pass", block_pairs=64, scan_blocks=4,
                                 expert_chunk=8),
    triton_permute.PermuteLaunch(form="three_pass", block_pairs=256, place_warps=4,
                                 place_rank=triton_permute.RANK_ONEHOT, expert_chunk=16),
    triton_permute.ONEHOT_PERMUTE,
    # the first launch's loads before its wait (PDL off here: the same kernels' order of work)
    triton_permute.PermuteLaunch(form="single", overlap_previous=True),
    triton_permute.PermuteLaunch(form="three_pass", overlap_previous=True),
]


@pytest.mark.parametrize("launch", LAUNCH_VARIANTS, ids=launch_id)
@pytest.mark.parametrize("num_tokens, top_k, num_experts, first_expert, num_local, align", [
    (37, 8, 60, 0, None, 16), (150, 4, 256, 64, 128, 3), (5, 8, 384, 0, None, 128),
    (3, 2, 8, 0, None, 1500)])
def test_permute_launch_variants_match_oracle(device, seed, launch, num_tokens, top_k,
                                              num_experts, first_expert, num_local, align):
    topk_ids = random_ids(num_tokens, top_k, num_experts, device)
    check_permute(topk_ids, num_experts, launch=launch, first_expert=first_expert,
                  num_local=num_local, align=align)


@pytest.mark.parametrize("form", FORMS)
def test_permute_one_expert_across_many_blocks(device, form):
    # 1200 pairs of one expert span 10 blocks of 128: the block scan must carry between them;
    # in the one-launch form, many slices.
    topk_ids = torch.full((300, 4), 3, dtype=torch.int32, device=device)
    topk_ids[::7, 1] = 5
    check_permute(topk_ids, 8, launch=FORMS[form], align=16)


def test_permute_more_blocks_than_one_scan_step(device, seed):
    # 33600 pairs = 263 blocks of 128: the rule's three-pass form scans them in one step of
    # 512, the launch with [128, 32] tiles in three.
    rule = triton_permute.DEFAULT_PERMUTE
    assert not rule.chooses_single(4200 * 8, 4)
    steps = triton_permute.PermuteLaunch(scan_blocks=128, expert_chunk=32)
    assert rule.block_pairs * steps.scan_blocks < 4200 * 8 <= rule.block_pairs * rule.scan_blocks
    topk_ids = random_ids(4200, 8, 8, device)
    for launch in (rule, steps):
        check_permute(topk_ids, 8, launch=launch, first_expert=2, num_local=4, align=4)


@pytest.mark.parametrize("form", FORMS)
def test_permute_is_deterministic(device, seed, form):
    topk_ids = random_ids(300 if form == "three_pass" else 100, 8, 60, device)
    first = triton_permute.permute_by_expert(topk_ids, 60, align=16, launch=FORMS[form])
    for _ in range(2):
        assert_permutation_equal(triton_permute.permute_by_expert(topk_ids, 60, align=16,
                                                                  launch=FORMS[form]), first)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bad", [-1, 9])
def test_permute_names_a_bad_id(device, bad, form):
    topk_ids = torch.tensor([[0, 1], [bad, 2]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=f"expert id {bad} outside"):
        triton_permute.permute_by_expert(topk_ids, 8, launch=FORMS[form])


@pytest.mark.parametrize("form", ["single", "three_pass"])
@pytest.mark.parametrize("bad", [-5, 9])
@pytest.mark.parametrize("num_tokens", [3, 300])
def test_permute_device_check_names_the_extreme_id(device, bad, num_tokens, form):
    """The id range is checked on the device (the one-launch form's program 0 reduces all ids;
    the three-pass form per block, reduced in pass 2) and read once: the error names the same
    id as the oracle's (the smallest if negative, else the largest), also when the bad id sits
    in a later block and several are bad."""
    topk_ids = random_ids(num_tokens, 4, 8, device)
    topk_ids[-1, 2] = bad
    topk_ids[num_tokens // 2, 0] = bad + (-1 if bad < 0 else 1)  # the extreme one
    extreme = bad + (-1 if bad < 0 else 1)
    triton_run = functools.partial(triton_permute.permute_by_expert, launch=FORMS[form])
    for run in (reference.permute_by_expert, triton_run, a2a.permute.permute_by_expert):
        with pytest.raises(ValueError, match=f"expert id {extreme} outside \\[0, 8\\]"):
            run(topk_ids, 8, check_ids=True)


@pytest.mark.parametrize("form", ["single", "three_pass"])
@pytest.mark.parametrize("bad", [-1, 61, 2**31 - 1])
def test_permute_unchecked_skips_bad_ids(device, bad, form):
    """check_ids=False reads nothing and skips out-of-range ids as not owned: the result equals
    the oracle's (also unchecked) and that of the same ids with the bad ones set to padding."""
    topk_ids = random_ids(300 if form == "three_pass" else 120, 8, 60, device)
    topk_ids[::7, 3] = bad
    padded = topk_ids.clone()
    padded[::7, 3] = 60
    for first_expert, num_local, align in [(0, None, 1), (16, 20, 8)]:
        kwargs = dict(first_expert=first_expert, num_local_experts=num_local, align=align)
        got = triton_permute.permute_by_expert(topk_ids, 60, check_ids=False,
                                               launch=FORMS[form], **kwargs)
        assert_permutation_equal(got, reference.permute_by_expert(topk_ids, 60, check_ids=False,
                                                                  **kwargs))
        assert_permutation_equal(got, reference.permute_by_expert(padded, 60, **kwargs))
        assert (got.inverse.view(-1, 8)[::7, 3] == UNUSED).all()
        stage = a2a.permute.permute_by_expert(topk_ids, 60, check_ids=False, backend="triton",
                                              **kwargs)
        assert_permutation_equal(stage, got)


def test_permute_refuses_bad_inputs(device):
    # a view is accepted (as on every face) and equals the oracle
    view = torch.tensor([[0, 1, 2, 8], [3, 3, 0, 7]], dtype=torch.int32, device=device).t()
    assert_permutation_equal(triton_permute.permute_by_expert(view, 8),
                             reference.permute_by_expert(view, 8))
    with pytest.raises(ValueError, match="align=0"):
        triton_permute.permute_by_expert(torch.zeros((4, 2), dtype=torch.int32, device=device),
                                         8, align=0)


# ---------------------------------------------------------------------------------------------
# gather_rows
# ---------------------------------------------------------------------------------------------

def _table(num_tokens, width, dtype, device):
    if dtype.is_floating_point:
        return torch.randn(num_tokens, width, device=device).to(dtype)
    return torch.randint(0, 256, (num_tokens, width), device=device).to(dtype)


@pytest.mark.parametrize("dtype, width", [
    (torch.bfloat16, 64),      # 128-byte rows: 4-byte words
    (torch.float16, 3),        # 6-byte rows: 2-byte words
    (torch.float32, 40),
    (torch.uint8, 32),         # packed NVFP4 codes [T, H/2]
    (torch.uint8, 7),          # odd byte width: 1-byte words
])
def test_gather_matches_oracle(device, seed, dtype, width):
    topk_ids = random_ids(37, 4, 8, device)
    perm = reference.permute_by_expert(topk_ids, 8, align=16)
    x = _table(37, width, dtype, device)
    got = triton_gather.gather_rows(x, perm.source_rows, top_k=4)
    want = reference.gather_rows(x, perm.source_rows, top_k=4)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_gather_with_scales_matches_oracle(device, seed):
    # NVFP4: H=256 -> codes [T, 128] uint8, scales [T, 16] uint8
    rows = torch.tensor([5, UNUSED, 0, 5, 299, UNUSED, 17], dtype=torch.int32, device=device)
    codes = _table(300, 128, torch.uint8, device)
    scales = _table(300, 16, torch.uint8, device)
    got = triton_gather.gather_rows(codes, rows, scales=scales)
    want = reference.gather_rows(codes, rows, scales=scales)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gather_without_tokens(device):
    rows = torch.full((5,), UNUSED, dtype=torch.int32, device=device)
    got = triton_gather.gather_rows(torch.empty((0, 8), device=device), rows)
    assert torch.equal(got, torch.zeros((5, 8), device=device))


def test_gather_takes_views(device, seed):
    """Transposed and sliced x, scales and rows (every face takes any strides)."""
    x = torch.randn(8, 6, device=device).t()                      # [6, 8], strides (1, 6)
    scales = _table(12, 6, torch.uint8, device)[::2]              # [6, 6], every other row
    rows = torch.tensor([5, 9, UNUSED, 0, 3, 1, 2, 4], dtype=torch.int32, device=device)[::2]
    got = triton_gather.gather_rows(x, rows, scales=scales, top_k=2)
    want = reference.gather_rows(x, rows, scales=scales, top_k=2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gather_row_past_the_end_is_zero_not_the_next_row(device, seed):
    """An entry equal to T*top_k (just past the end) is refused with check_values, and with
    check_values=False gives the documented zero row on both faces, not the row of memory
    after x: x is a view of the first T rows of a larger table whose other rows are not zero."""
    top_k, num_tokens = 2, 5
    table = torch.randn(num_tokens + 3, 24, device=device).to(torch.bfloat16) + 4  # no zeros
    scale_table = _table(num_tokens + 3, 3, torch.uint8, device) | 1
    x, scales = table[:num_tokens], scale_table[:num_tokens]   # contiguous views
    rows = torch.tensor([0, num_tokens * top_k, 9, num_tokens * top_k + 1, UNUSED],
                        dtype=torch.int32, device=device)
    for gather in (triton_gather.gather_rows, reference.gather_rows):
        with pytest.raises(ValueError, match=r"rows holds 11, outside \[0, T\*top_k\) = "
                                             r"\[0, 10\)"):
            gather(x, rows, top_k=top_k)
        out, out_scales = gather(x, rows, scales=scales, top_k=top_k, check_values=False)
        assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[4])
        assert not out[[1, 3, 4]].view(torch.int16).any(), gather.__module__
        assert not out_scales[[1, 3, 4]].any() and torch.equal(out_scales[2], scales[4])


def test_gather_takes_the_permutation_and_refuses_a_wrong_top_k(device, seed):
    """With the Permutation as rows its top_k is used: a different top_k, or x of another T,
    is refused. With a tensor, a top_k smaller than the permutation's makes rows past T*top_k,
    refused by the range check (once 10 of 20 rows came back as zeros)."""
    topk_ids = random_ids(10, 2, 4, device, padding=False)
    perm = reference.permute_by_expert(topk_ids, 4)
    x = torch.randn(10, 8, device=device)
    want = reference.gather_rows(x, perm.source_rows, top_k=2)
    for gather in (triton_gather.gather_rows, reference.gather_rows):
        assert torch.equal(gather(x, perm), want) and torch.equal(gather(x, perm, top_k=2), want)
        with pytest.raises(ValueError, match="top_k=1 but the permutation was built with "
                                             "top_k=2; leave top_k out"):
            gather(x, perm, top_k=1)
        with pytest.raises(ValueError, match="x has 9 rows but the permutation was built for "
                                             "20 \\(token, slot\\) pairs of k=2, i.e. T=10"):
            gather(x[:9], perm)
        with pytest.raises(ValueError, match="outside \\[0, T\\*top_k\\) = \\[0, 10\\) and "
                                             "not UNUSED \\(-1\\); rows past T\\*top_k mostly "
                                             "mean a top_k smaller"):
            gather(x, perm.source_rows)


# ---------------------------------------------------------------------------------------------
# unpermute_and_reduce
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens, top_k, num_experts, first_expert, num_local, hidden", [
    (7, 4, 60, 0, None, 96),
    (300, 8, 256, 64, 64, 64),      # a local range: many tokens own nothing -> zero rows
    (255, 1, 8, 0, None, 40),
])
def test_unpermute_equals_oracle(device, seed, dtype, num_tokens, top_k, num_experts,
                                 first_expert, num_local, hidden):
    topk_ids = random_ids(num_tokens, top_k, num_experts, device)
    perm = reference.permute_by_expert(topk_ids, num_experts, first_expert=first_expert,
                                       num_local_experts=num_local, align=16)
    expert_out = torch.randn(perm.source_rows.numel(), hidden, device=device).to(dtype)
    weights = torch.rand(num_tokens, top_k, device=device)
    got = triton_gather.unpermute_and_reduce(expert_out, perm, weights)
    want = reference.unpermute_and_reduce(expert_out, perm, weights)
    assert got.dtype == dtype
    assert torch.equal(got, want)


def test_unpermute_load_policy_is_evict_first_from_half_to_four_times_the_l2():
    l2 = 50 << 20                                          # an H100's or H200's L2
    policy = triton_gather.unpermute_load_policy
    assert policy(l2 // 2, l2) == "" and policy(l2 // 2 + 1, l2) == "evict_first"
    assert policy(4 * l2, l2) == "evict_first" and policy(4 * l2 + 1, l2) == ""
    # a decode step's expert output, E=256 k=8 H=7168 bf16 (T*k rows): T=128 below,
    # T=256 and T=1024 inside, T=2048 past
    rows = [policy(tokens * 8 * 7168 * 2, l2) for tokens in (128, 256, 1024, 2048)]
    assert rows == ["", "evict_first", "evict_first", ""]
    assert policy(1 << 28, 0) == ""                        # no cache to choose for (the CPU)


@pytest.mark.parametrize("load_policy", ["", "evict_first"])
def test_unpermute_either_load_policy_equals_oracle(device, seed, load_policy):
    # both policies on any device (the rule picks one by the output's size and the GPU's L2)
    num_tokens, top_k, num_experts, hidden = 33, 8, 64, 200
    topk_ids = random_ids(num_tokens, top_k, num_experts, device)
    perm = reference.permute_by_expert(topk_ids, num_experts, align=16)
    expert_out = torch.randn(perm.source_rows.numel(), hidden, device=device).to(torch.bfloat16)
    weights = torch.rand(num_tokens, top_k, device=device)
    got = triton_gather._launch_unpermute(expert_out, perm.inverse, weights, traced=False,
                                          load_policy=load_policy)
    assert torch.equal(got, reference.unpermute_and_reduce(expert_out, perm, weights))


def test_unpermute_strided_weights_and_rounding_ties(device):
    # w*x = 1 + 3*2^-8 is a bf16 tie: nearest even gives 1 + 2^-6 (truncation 1 + 2^-7).
    topk_ids = torch.tensor([[0, 1], [1, 1], [2, 2]], dtype=torch.int32, device=device)
    perm = reference.permute_by_expert(topk_ids, 3, num_local_experts=2)
    expert_out = torch.ones((perm.source_rows.numel(), 16), dtype=torch.bfloat16, device=device)
    weights = torch.tensor([[1 + 3 * 2**-8, 1 + 3 * 2**-8, 0.0],
                            [0.0, 0.0, 5.0]], device=device).t()     # [3, 2] strides (1, 3)
    got = triton_gather.unpermute_and_reduce(expert_out, perm, weights)
    want = reference.unpermute_and_reduce(expert_out, perm, weights)
    assert torch.equal(got, want)
    # tokens 0 and 1: the tie term plus a zero-weight term; token 2 owns nothing
    assert got[0, 0].item() == got[1, 0].item() == 1 + 2**-6
    assert got[2].abs().sum().item() == 0


def test_unpermute_refuses_mismatches(device):
    perm = reference.permute_by_expert(torch.zeros((2, 2), dtype=torch.int32, device=device), 2)
    with pytest.raises(ValueError, match="expert_out has 3 rows but the permutation has P=4"):
        triton_gather.unpermute_and_reduce(torch.zeros((3, 8), device=device), perm,
                                           torch.ones((2, 2), device=device))


def _bits(values, dtype):
    """A tensor of ``dtype`` from its bit patterns (ints, possibly >= 2^31 for fp32)."""
    width = torch.int32 if dtype == torch.float32 else torch.int16
    signed = [v - (1 << 32) if width == torch.int32 and v >= 1 << 31 else
              v - (1 << 16) if width == torch.int16 and v >= 1 << 15 else v for v in values]
    return torch.tensor(signed, dtype=width).view(dtype)


def _one_slot_each(weights: torch.Tensor, dtype, device):
    """(expert_out of ones [T, 4] in ``dtype``, a k = 1 permutation, weights [T, 1]): token t's
    output is exactly round(0 + weights[t] * 1.0), its accumulation in float32."""
    num_tokens = weights.numel()
    perm = reference.permute_by_expert(torch.zeros((num_tokens, 1), dtype=torch.int32,
                                                   device=device), 1)
    expert_out = torch.ones((num_tokens, 4), dtype=dtype, device=device)
    return expert_out, perm, weights.reshape(num_tokens, 1).to(device)


# float32 accumulation (bits) -> bf16 result (bits), round to nearest even; golden.
BF16_ROUNDING = [
    (0x3F808000, 0x3F80),  # 1 + 2^-8: a tie, down to the even 1.0 (half-up would give 0x3F81)
    (0x3F818000, 0x3F82),  # 1 + 3*2^-8: a tie, up to the even 1 + 2^-6
    (0x3F808001, 0x3F81),  # just above the tie: up
    (0x3F807FFF, 0x3F80),  # just below the tie: down
    (0x3F804000, 0x3F80),  # a quarter step: down
    (0xBF808000, 0xBF80),  # -(1 + 2^-8): the tie goes to even in magnitude
    (0xBF818000, 0xBF82),
    (0x7F7F7FFF, 0x7F7F),  # just below the tie past bf16's max: the max
    (0x7F7F8000, 0x7F80),  # that tie: to the even, +inf (overflow)
    (0x7F7FFFFF, 0x7F80),  # FLT_MAX: +inf
    (0xFF7FFFFF, 0xFF80),  # -FLT_MAX: -inf
    (0x7F800000, 0x7F80),  # +inf stays
    (0x00008000, 0x0000),  # subnormal tie: to even 0
    (0x00018000, 0x0002),  # subnormal tie: to even 2
    (0x80000000, 0x0000),  # -0.0 weight: 0 + (-0) is +0
    (0x7FC00000, 0x7FC0),  # NaN: the canonical NaN
    (0xFFC00001, 0x7FC0),  # a negative NaN with a payload: canonical too
    (0x7F800001, 0x7FC0),  # a signalling NaN: canonical too
]


def test_unpermute_rounds_bf16_to_nearest_even(device):
    """The float32 -> bf16 cast of the un-permute, case by case (ties both ways, just above
    and below a tie, overflow, subnormals, NaNs), on both faces against golden bits."""
    weights = _bits([acc for acc, _ in BF16_ROUNDING], torch.float32)
    expert_out, perm, weights = _one_slot_each(weights, torch.bfloat16, device)
    want = torch.tensor([bf16 for _, bf16 in BF16_ROUNDING], dtype=torch.int32)
    for unpermute in (triton_gather.unpermute_and_reduce, reference.unpermute_and_reduce):
        got = unpermute(expert_out, perm, weights).view(torch.int16).to(torch.int32) & 0xFFFF
        assert torch.equal(got.cpu(), want[:, None].expand(-1, 4)), unpermute.__module__


@pytest.mark.parametrize("dtype, cases", [
    (torch.float16, [(0x3F801000, 0x3C00),   # 1 + 2^-11: a tie, down to even 1.0
                     (0x3F803000, 0x3C02),   # 1 + 3*2^-11: a tie, up to even
                     (0x477FF000, 0x7C00),   # 65520: overflows to +inf
                     (0xFFC00001, 0x7E00)]),  # a negative NaN: the canonical NaN
    (torch.float32, [(0x3F800001, 0x3F800001), (0x7F800001, 0x7FC00000),
                     (0xFFC00001, 0x7FC00000), (0x7FFFFFFF, 0x7FC00000)]),
])
def test_unpermute_rounding_and_nan_in_fp16_and_fp32(device, dtype, cases):
    weights = _bits([acc for acc, _ in cases], torch.float32)
    expert_out, perm, weights = _one_slot_each(weights, dtype, device)
    want = _bits([out for _, out in cases], dtype)
    width = torch.int32 if dtype == torch.float32 else torch.int16
    for unpermute in (triton_gather.unpermute_and_reduce, reference.unpermute_and_reduce):
        got = unpermute(expert_out, perm, weights).view(width)
        assert torch.equal(got.cpu(), want.view(width)[:, None].expand(-1, 4))


def test_unpermute_nan_rows_give_one_nan(device, seed):
    """NaN (and inf * 0) inside expert rows: one canonical NaN in every output dtype, on both
    faces (the GPU writes 0x7FFFFFFF, torch on CPU 0xFFFF for bf16, without it)."""
    topk_ids = random_ids(40, 4, 8, device)
    perm = reference.permute_by_expert(topk_ids, 8)
    expert_out = torch.randn(perm.source_rows.numel(), 24, device=device)
    expert_out[::3, 5] = float("nan")
    expert_out[1::5, 7] = -float("nan")
    expert_out[2::4, 9] = float("inf")
    weights = torch.rand(40, 4, device=device)
    weights[::2, 1] = 0.0  # inf * 0 = NaN
    for dtype, width in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16),
                         (torch.float32, torch.int32)):
        got = triton_gather.unpermute_and_reduce(expert_out.to(dtype), perm, weights)
        want = reference.unpermute_and_reduce(expert_out.to(dtype), perm, weights)
        assert torch.equal(got.view(width), want.view(width)), dtype
        assert bool(got.isnan().any())
        nan_bits = got.view(width)[got.isnan()].unique().tolist()
        assert nan_bits == [_bits([{torch.bfloat16: 0x7FC0, torch.float16: 0x7E00,
                                    torch.float32: 0x7FC00000}[dtype]], dtype)
                            .view(width).item()]


def test_unpermute_inverse_out_of_range(device, seed):
    """An inverse entry outside [0, P) (not UNUSED): the same ValueError on both faces with
    check_values; skipped as not owned on both with check_values=False."""
    topk_ids = random_ids(6, 2, 4, device, padding=False)
    perm = reference.permute_by_expert(topk_ids, 4)
    capacity = perm.source_rows.numel()
    expert_out = torch.randn(capacity, 8, device=device)
    weights = torch.rand(6, 2, device=device)
    for bad in (capacity, -2, 2**31 - 1):
        inverse = perm.inverse.clone()
        inverse[3] = bad
        broken = Permutation(**{**perm.tensors(), "inverse": inverse}, top_k=2)
        errors = []
        for unpermute in (triton_gather.unpermute_and_reduce, reference.unpermute_and_reduce):
            with pytest.raises(ValueError) as error:
                unpermute(expert_out, broken, weights)
            errors.append(str(error.value))
        assert errors[0] == errors[1] and f"permutation.inverse holds {bad}" in errors[0]
        unowned = Permutation(**{**perm.tensors(),
                                 "inverse": torch.where(torch.arange(12, device=device) == 3,
                                                        UNUSED, perm.inverse)}, top_k=2)
        want = reference.unpermute_and_reduce(expert_out, unowned, weights)
        for unpermute in (triton_gather.unpermute_and_reduce, reference.unpermute_and_reduce):
            assert torch.equal(unpermute(expert_out, broken, weights, check_values=False), want)


def test_unpermute_takes_views(device, seed):
    topk_ids = random_ids(9, 3, 8, device)
    perm = reference.permute_by_expert(topk_ids, 8, align=4)
    expert_out = torch.randn(40, perm.source_rows.numel(), device=device).t()[:, ::2]
    weights = torch.rand(3, 9, device=device).t()
    inverse_view = torch.stack((perm.inverse, perm.inverse), dim=1)[:, 0]   # stride 2
    viewed = Permutation(**{**perm.tensors(), "inverse": inverse_view}, top_k=3, align=4)
    want = reference.unpermute_and_reduce(expert_out.contiguous(), perm, weights.contiguous())
    for unpermute in (triton_gather.unpermute_and_reduce, reference.unpermute_and_reduce):
        assert torch.equal(unpermute(expert_out, viewed, weights), want)


# ---------------------------------------------------------------------------------------------
# The stage switch (a2a.permute)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_stage_functions_agree_with_the_oracle(device, seed, backend):
    topk_ids = random_ids(40, 4, 16, device)
    perm = a2a.permute.permute_by_expert(topk_ids, 16, first_expert=8, num_local_experts=8,
                                         align=4, backend=backend)
    want = reference.permute_by_expert(topk_ids, 16, first_expert=8, num_local_experts=8,
                                       align=4)
    assert_permutation_equal(perm, want)
    x = torch.randn(40, 32, device=device).to(torch.bfloat16)
    rows = a2a.permute.gather_rows(x, perm.source_rows, top_k=4, backend=backend)
    assert torch.equal(rows, reference.gather_rows(x, want.source_rows, top_k=4))
    weights = torch.rand(40, 4, device=device)
    out = a2a.permute.unpermute_and_reduce(rows, perm, weights, backend=backend)
    assert torch.equal(out, reference.unpermute_and_reduce(rows, want, weights))


def test_stage_refuses_flashinfer_with_the_reason(device):
    topk_ids = torch.zeros((2, 2), dtype=torch.int32, device=device)
    with pytest.raises(BackendUnavailable, match="no standalone expert permutation"):
        a2a.permute.permute_by_expert(topk_ids, 8, backend="flashinfer")
    with pytest.raises(BackendUnavailable, match="no standalone expert permutation"):
        a2a.permute.gather_rows(torch.zeros((2, 4), device=device), topk_ids[0],
                                backend="flashinfer")


def test_stage_names_a_non_tensor():
    with pytest.raises(TypeError, match="topk_ids must be a torch.Tensor, got list"):
        a2a.permute.permute_by_expert([[0, 1]], 8, backend="torch")


# ---------------------------------------------------------------------------------------------
# GPU: production sizes
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 128, 256, 257, 1024, 4096, 8192])
@pytest.mark.parametrize("first_expert, num_local, align", [(0, None, 1), (0, None, 128),
                                                            (64, 32, 128), (0, 512, 16),
                                                            (0, 384, 1)])
def test_permute_gpu_matches_oracle_and_repeats(device, seed, num_tokens, first_expert,
                                                num_local, align):
    """The default rule (either form, by T*k and E_local) at the decode and prefill sizes,
    exact against the oracle, then 100 runs bit-identical."""
    num_experts = 512 if num_local == 512 else 384 if num_local == 384 else 256
    topk_ids = random_ids(num_tokens, 8, num_experts, device)
    kwargs = dict(first_expert=first_expert, num_local_experts=num_local, align=align)
    first = triton_permute.permute_by_expert(topk_ids, num_experts, **kwargs)
    assert_permutation_equal(first, reference.permute_by_expert(topk_ids, num_experts, **kwargs))
    for _ in range(100):
        assert_permutation_equal(triton_permute.permute_by_expert(topk_ids, num_experts,
                                                                  **kwargs), first)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [SINGLE, THREE_PASS] + LAUNCH_VARIANTS, ids=launch_id)
@pytest.mark.parametrize("num_tokens, align", [(1, 128), (64, 1), (256, 128), (1024, 16)])
def test_permute_gpu_forms_match_oracle_and_repeat(device, seed, launch, num_tokens, align):
    """Every form and knob the sweep may pick, exact, and 100 runs bit-identical."""
    topk_ids = random_ids(num_tokens, 8, 256, device)
    first = check_permute(topk_ids, 256, launch=launch, align=align)
    for _ in range(100):
        again = triton_permute.permute_by_expert(topk_ids, 256, align=align, launch=launch)
        assert_permutation_equal(again, first)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["single", "three_pass"])
def test_permute_gpu_skewed_routing(device, form):
    # Every token to experts 0..7: all pairs of 8 experts (8192 per expert at T=8192: 32
    # blocks each); the one-launch form at 256 tokens.
    num_tokens = 256 if form == "single" else 8192
    topk_ids = torch.arange(8, dtype=torch.int32, device=device).repeat(num_tokens, 1)
    check_permute(topk_ids, 256, launch=FORMS[form], align=128)


@pytest.mark.gpu
def test_gather_and_unpermute_gpu_large(device, seed):
    # T=8192, k=8, H=7168 bf16: 65536 permuted rows (plus padding), the speed-target size.
    num_tokens, top_k, hidden = 8192, 8, 7168
    topk_ids = random_ids(num_tokens, top_k, 256, device, padding=False)
    perm = triton_permute.permute_by_expert(topk_ids, 256, align=128)
    x = torch.randn(num_tokens, hidden, device=device).to(torch.bfloat16)
    rows = triton_gather.gather_rows(x, perm.source_rows, top_k=top_k)
    assert torch.equal(rows, reference.gather_rows(x, perm.source_rows, top_k=top_k))
    weights = torch.rand(num_tokens, top_k, device=device)
    out = triton_gather.unpermute_and_reduce(rows, perm, weights)
    assert torch.equal(out, reference.unpermute_and_reduce(rows, perm, weights))
    again = triton_gather.unpermute_and_reduce(rows, perm, weights)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
