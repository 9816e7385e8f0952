"""``permute_and_gather`` (kernels.permute): the permutation and the row gather in one op,
against its oracle ``kernels.reference.permute_and_gather`` (``permute_by_expert``, then
``gather_rows`` through it): every index buffer and every gathered byte exactly equal, on
both sides of the rule's branch point (the one-launch form, which moves the rows in its own
launch, and the three-pass form, which launches the gather after it), and the same errors.
On CPU through Triton's interpreter on small rows; ``gpu`` tests take DeepSeek-R1's rows.
"""

from __future__ import annotations

import pytest
import torch

import a2a.permute
from kernels import permute as triton_permute
from kernels import reference
from test_permute import PERMUTE_CASES, random_ids
from test_reference_permute import assert_permutation_equal

SINGLE = triton_permute.PermuteLaunch(form="single")
THREE_PASS = triton_permute.PermuteLaunch(form="three_pass")


def rows_of(num_tokens, width, device, dtype=torch.bfloat16):
    """[T, width] rows whose bytes tell every row and column apart (random bits)."""
    bits = torch.randint(-2**15, 2**15, (num_tokens, width), dtype=torch.int16, device=device)
    return bits.view(torch.bfloat16).to(dtype) if dtype != torch.bfloat16 else bits.view(dtype)


def assert_same_result(got, want):
    """(permutation, out[, out_scales]) equal buffer for buffer and byte for byte."""
    assert len(got) == len(want)
    assert_permutation_equal(got[0], want[0])
    for actual, expected in zip(got[1:], want[1:]):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


def check(topk_ids, x, num_experts, *, scales=None, launch=triton_permute.DEFAULT_PERMUTE,
          gather_launch=triton_permute.DEFAULT_GATHER, **kwargs):
    got = triton_permute.permute_and_gather(topk_ids, x, num_experts, scales=scales,
                                            launch=launch, gather_launch=gather_launch,
                                            **kwargs)
    want = reference.permute_and_gather(topk_ids, x, num_experts, scales=scales, **kwargs)
    assert_same_result(got, want)
    # the fused op gives what the two ops give one after the other
    perm = reference.permute_by_expert(topk_ids, num_experts, **kwargs)
    assert torch.equal(got[1].view(torch.uint8),
                       reference.gather_rows(x, perm).view(torch.uint8))
    return got


# The permutation's cases (T 0..1023, E 8..384, k 1..8, align 1/16/128, a local range), bf16
# rows of 24 elements (12 words: a row tile wider than the row) with scales of 3 bytes.
@pytest.mark.parametrize("num_tokens, top_k, num_experts, first_expert, num_local, align, other",
                         PERMUTE_CASES)
def test_permute_and_gather_matches_oracle(device, seed, num_tokens, top_k, num_experts,
                                           first_expert, num_local, align, other):
    topk_ids = random_ids(num_tokens, top_k, num_experts, device)
    x = rows_of(num_tokens, 24, device)
    scales = torch.randint(0, 256, (num_tokens, 3), dtype=torch.uint8, device=device)
    kwargs = dict(first_expert=first_expert, num_local_experts=num_local, align=align)
    check(topk_ids, x, num_experts, scales=scales, **kwargs)
    if other:  # the form the rule does not pick
        local = num_local or num_experts - first_expert
        single = triton_permute.DEFAULT_PERMUTE.chooses_single(topk_ids.numel(), local)
        check(topk_ids, x, num_experts, launch=THREE_PASS if single else SINGLE, **kwargs)


@pytest.mark.parametrize("num_tokens, num_experts, align", [(256, 256, 1), (257, 256, 16)])
def test_permute_and_gather_on_both_sides_of_the_rule(device, seed, num_tokens, num_experts,
                                                      align):
    """k=8: 2048 pairs over E=256 are the one-launch form's last batch, one token more the
    three-pass form's first; both give the oracle's bytes."""
    topk_ids = random_ids(num_tokens, 8, num_experts, device)
    single = triton_permute.DEFAULT_PERMUTE.chooses_single(topk_ids.numel(), num_experts)
    assert single == (num_tokens == 256)
    check(topk_ids, rows_of(num_tokens, 8, device), num_experts, align=align)


@pytest.mark.parametrize("gather_launch", [
    triton_permute.GatherLaunch(slice_pairs=1, warps=1),
    triton_permute.GatherLaunch(slice_pairs=2, warps=4),
    triton_permute.GatherLaunch(slice_pairs=16, warps=8),
    triton_permute.GatherLaunch(programs=1),
    triton_permute.GatherLaunch(slice_pairs=8, group_tokens=False),
], ids=str)
@pytest.mark.parametrize("dtype, width", [(torch.uint8, 7), (torch.int16, 5),
                                          (torch.float32, 33), (torch.bfloat16, 0)])
def test_permute_and_gather_launches_and_row_types(device, seed, gather_launch, dtype, width):
    """Every slice and warp count, and rows of odd byte widths (moved as bytes or halves), an
    empty row and a row wider than one copy step (33 words with 1 warp and slice 1: 32 a step):
    the same bytes."""
    topk_ids = random_ids(37, 4, 16, device)
    x = torch.randint(0, 100, (37, width), device=device).to(dtype)
    check(topk_ids, x, 16, align=8, gather_launch=gather_launch)


def test_gather_launch_rule():
    rule = triton_permute.DEFAULT_GATHER
    assert [rule.slice_for(pairs) for pairs in (1, 128, 512, 1024, 2048, 8192)] == \
        [2, 2, 2, 4, 8, 16]
    assert triton_permute.GatherLaunch(slice_pairs=4).slice_for(2048) == 4


def test_row_copies_rule():
    """One load of a token's row serves the slice's pairs of that token where the slices start
    at token boundaries or lie inside one token; else a load per pair."""
    def copies(slice_pairs, top_k, group_tokens=True):
        return triton_permute.GatherLaunch(group_tokens=group_tokens).copies(slice_pairs,
                                                                             top_k)
    assert [copies(s, 8) for s in (1, 2, 4, 8, 16)] == [1, 2, 4, 8, 8]
    assert [copies(s, 3) for s in (1, 2, 4, 8)] == [1, 1, 1, 1]
    assert [copies(s, 6) for s in (1, 2, 4, 8)] == [1, 2, 1, 1]
    assert copies(8, 8, group_tokens=False) == 1


@pytest.mark.parametrize("top_k, slice_pairs", [(3, 2), (6, 2), (6, 4), (4, 8), (8, 2)])
@pytest.mark.parametrize("group_tokens", [True, False])
def test_permute_and_gather_token_copies(device, seed, top_k, slice_pairs, group_tokens):
    """Slices that split a token's pairs, hold whole tokens, or straddle two tokens, with
    pairs of other ranks' experts among them (E_local 5 of 12 from 4) and padding, a load per
    token or per pair, with and without overlap_previous: the oracle's bytes."""
    topk_ids = random_ids(29, top_k, 12, device)
    x = rows_of(29, 9, device)
    scales = torch.randint(0, 256, (29, 2), dtype=torch.uint8, device=device)
    gather_launch = triton_permute.GatherLaunch(slice_pairs=slice_pairs,
                                                group_tokens=group_tokens)
    for overlap in (False, True):
        check(topk_ids, x, 12, scales=scales, first_expert=4, num_local_experts=5, align=4,
              gather_launch=gather_launch,
              launch=triton_permute.PermuteLaunch(overlap_previous=overlap))


def test_permute_and_gather_is_deterministic(device, seed):
    topk_ids = random_ids(64, 8, 60, device)
    x = rows_of(64, 16, device)
    first = triton_permute.permute_and_gather(topk_ids, x, 60, align=16)
    for _ in range(3):
        assert_same_result(triton_permute.permute_and_gather(topk_ids, x, 60, align=16), first)


def test_permute_and_gather_overlap_previous_gives_the_same_bytes(device, seed):
    topk_ids = random_ids(16, 8, 256, device)
    x = rows_of(16, 8, device)
    check(topk_ids, x, 256, launch=triton_permute.PermuteLaunch(overlap_previous=True))


def test_permute_and_gather_refuses_what_the_two_ops_refuse(device):
    """The same errors on both faces: ids (dtype, range with check_ids), x (rank, rows, device)
    and scales (rows), the launch; an unchecked bad id is skipped as not owned."""
    topk_ids = random_ids(4, 2, 8, device, padding=False)
    x = rows_of(4, 8, device)
    cases = [
        ((topk_ids.long(), x, 8), {}, TypeError, "int32"),
        ((topk_ids, x[0], 8), {}, ValueError, "2-D"),
        ((topk_ids, x[:3], 8), {}, ValueError, "one row of x per token"),
        ((topk_ids, x, 8), dict(scales=torch.zeros(3, 1, dtype=torch.uint8, device=device)),
         ValueError, "scales has 3 rows"),
        ((topk_ids, x, 8), dict(align=0), ValueError, "align"),
        ((topk_ids, x, 1), {}, ValueError, "top_k"),
    ]
    for args, kwargs, error, words in cases:
        for face in (triton_permute.permute_and_gather, reference.permute_and_gather):
            with pytest.raises(error, match=words):
                face(*args, **kwargs)
    bad = topk_ids.clone()
    bad[1, 0] = 9
    for face in (triton_permute.permute_and_gather, reference.permute_and_gather):
        with pytest.raises(ValueError, match="9"):
            face(bad, x, 8)
    got = triton_permute.permute_and_gather(bad, x, 8, check_ids=False)
    assert_same_result(got, reference.permute_and_gather(bad, x, 8, check_ids=False))
    with pytest.raises(ValueError, match="slice_pairs"):
        triton_permute.permute_and_gather(topk_ids, x, 8,
                                          gather_launch=triton_permute.GatherLaunch(3))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_stage_function(device, seed, backend):
    topk_ids = random_ids(9, 4, 16, device)
    x = rows_of(9, 8, device)
    scales = torch.randint(0, 256, (9, 2), dtype=torch.uint8, device=device)
    got = a2a.permute.permute_and_gather(topk_ids, x, 16, scales=scales, align=4,
                                         backend=backend)
    assert_same_result(got, reference.permute_and_gather(topk_ids, x, 16, scales=scales,
                                                         align=4))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256, 257, 8192])
@pytest.mark.parametrize("payload", ["bf16", "nvfp4"])
@pytest.mark.parametrize("align", [1, 128])
def test_permute_and_gather_gpu_matches_oracle_and_repeats(device, seed, num_tokens, payload,
                                                           align):
    """DeepSeek-R1's rows (bf16 [T, 7168], or packed NVFP4 [T, 3584] with scales [T, 448]),
    E=256 k=8, exact, then 100 runs bit-identical."""
    topk_ids = random_ids(num_tokens, 8, 256, device)
    if payload == "bf16":
        x, scales = rows_of(num_tokens, 7168, device), None
    else:
        x = torch.randint(0, 256, (num_tokens, 3584), dtype=torch.uint8, device=device)
        scales = torch.randint(0, 256, (num_tokens, 448), dtype=torch.uint8, device=device)
    first = check(topk_ids, x, 256, scales=scales, align=align)
    for _ in range(100):
        assert_same_result(triton_permute.permute_and_gather(topk_ids, x, 256, scales=scales,
                                                             align=align), first)
