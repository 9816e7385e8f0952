"""The permutation oracle (kernels.reference): golden cases worked by hand, invariants, errors."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.types import UNUSED, Permutation

U = UNUSED


def ids(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def assert_permutation_equal(actual: Permutation, expected: Permutation) -> None:
    """Every tensor field equal exactly (dtype, shape, values), and the same top_k and align."""
    assert (actual.top_k, actual.align) == (expected.top_k, expected.align)
    for name, want in expected.tensors().items():
        got = getattr(actual, name)
        assert got.dtype == want.dtype and got.device == want.device, name
        assert torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"


def check_permutation_invariants(perm: Permutation, topk_ids: torch.Tensor, *, first_expert: int,
                                 num_local_experts: int, align: int) -> None:
    """What any correct Permutation of ``topk_ids`` satisfies, computed here pair by pair."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).tolist()
    capacity = num_tokens * top_k + num_local_experts * (align - 1)
    source_rows, inverse = perm.source_rows.tolist(), perm.inverse.tolist()
    counts, offsets = perm.expert_counts.tolist(), perm.expert_offsets.tolist()
    assert len(source_rows) == capacity and len(inverse) == num_tokens * top_k
    assert len(counts) == num_local_experts and len(offsets) == num_local_experts + 1
    assert (perm.top_k, perm.align) == (top_k, align)

    pairs_of = [[] for _ in range(num_local_experts)]       # ascending flat pair index
    for pair, expert_id in enumerate(flat):
        if first_expert <= expert_id < first_expert + num_local_experts:
            pairs_of[expert_id - first_expert].append(pair)
    assert counts == [len(p) for p in pairs_of]
    assert sum(counts) == sum(1 for i in inverse if i != UNUSED)

    assert offsets[0] == 0 and offsets[-1] <= capacity
    for e in range(num_local_experts):
        size = offsets[e + 1] - offsets[e]
        assert size % align == 0 and counts[e] <= size < counts[e] + align, (e, size)
        segment = source_rows[offsets[e]:offsets[e + 1]]
        assert segment == pairs_of[e] + [UNUSED] * (size - counts[e]), e
    assert source_rows[offsets[-1]:] == [UNUSED] * (capacity - offsets[-1])

    for pair, place in enumerate(inverse):                    # round trips
        if place == UNUSED:
            assert not first_expert <= flat[pair] < first_expert + num_local_experts
        else:
            assert source_rows[place] == pair
    for place, pair in enumerate(source_rows):
        if pair != UNUSED:
            assert inverse[pair] == place


# ---------------------------------------------------------------------------------------------
# permute_by_expert
# ---------------------------------------------------------------------------------------------

def test_permute_golden_with_alignment_and_foreign_ids():
    # T=4, k=2, E=6 of which this rank owns experts 0..2; id 5 belongs to another rank.
    # flat pairs: 0:2 1:0 2:2 3:1 4:0 5:2 6:5 7:0; align 2 pads 3 -> 4, 1 -> 2, 3 -> 4.
    perm = reference.permute_by_expert(ids([[2, 0], [2, 1], [0, 2], [5, 0]]), 6,
                                       num_local_experts=3, align=2)
    assert_permutation_equal(perm, Permutation(
        source_rows=ints([1, 4, 7, U, 3, U, 0, 2, 5, U, U]),   # P = 8 + 3*(2-1) = 11
        expert_counts=ints([3, 1, 3]),
        expert_offsets=ints([0, 4, 6, 10]),
        inverse=ints([6, 0, 7, 4, 1, 8, U, 2]),
        top_k=2, align=2))


def test_permute_golden_local_range_and_padding_id():
    # E=8, this rank owns experts 4 and 5; 8 is the padding id, 1 another rank's expert.
    # flat pairs: 0:4 1:8 2:5 3:4 4:1 5:5
    perm = reference.permute_by_expert(ids([[4, 8], [5, 4], [1, 5]]), 8, first_expert=4,
                                       num_local_experts=2)
    assert_permutation_equal(perm, Permutation(
        source_rows=ints([0, 3, 2, 5, U, U]),
        expert_counts=ints([2, 2]),
        expert_offsets=ints([0, 2, 4]),
        inverse=ints([0, U, 2, 1, U, 3]),
        top_k=2, align=1))


def test_permute_golden_empty_expert_and_align_4():
    # Expert 1 gets nothing: a zero-length segment; expert 0's single pair is padded to 4.
    perm = reference.permute_by_expert(ids([[2], [0], [2]]), 3, align=4)
    assert_permutation_equal(perm, Permutation(
        source_rows=ints([1, U, U, U, 0, 2, U, U, U, U, U, U]),   # P = 3 + 3*3 = 12
        expert_counts=ints([1, 0, 2]),
        expert_offsets=ints([0, 4, 4, 8]),
        inverse=ints([4, 0, 5]),
        top_k=1, align=4))


def test_permute_no_tokens():
    perm = reference.permute_by_expert(torch.empty((0, 4), dtype=torch.int32), 8, align=16)
    assert_permutation_equal(perm, Permutation(
        source_rows=torch.full((8 * 15,), U, dtype=torch.int32),
        expert_counts=torch.zeros(8, dtype=torch.int32),
        expert_offsets=torch.zeros(9, dtype=torch.int32),
        inverse=torch.empty(0, dtype=torch.int32), top_k=4, align=16))


@pytest.mark.parametrize("num_tokens, top_k, num_experts, first_expert, num_local, align", [
    (1, 1, 8, 0, None, 1),
    (7, 4, 60, 0, None, 16),
    (255, 8, 256, 0, None, 1),
    (300, 8, 256, 64, 64, 128),
    (300, 4, 60, 30, 15, 16),
])
def test_permute_invariants(seed, num_tokens, top_k, num_experts, first_expert, num_local,
                            align):
    # ids in [0, E]: E is the padding id
    topk_ids = torch.randint(0, num_experts + 1, (num_tokens, top_k), dtype=torch.int32)
    perm = reference.permute_by_expert(topk_ids, num_experts, first_expert=first_expert,
                                       num_local_experts=num_local, align=align)
    check_permutation_invariants(perm, topk_ids, first_expert=first_expert,
                                 num_local_experts=num_local or num_experts - first_expert,
                                 align=align)


@pytest.mark.parametrize("bad, message", [(-1, "expert id -1"), (9, "expert id 9"),
                                          (100, "expert id 100")])
def test_permute_names_a_bad_id(bad, message):
    with pytest.raises(ValueError, match=message):
        reference.permute_by_expert(ids([[0, 1], [bad, 2]]), 8)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(first_expert=8), ValueError, r"first_expert=8 must be an int in \[0, 8\)"),
    (dict(first_expert=-1), ValueError, "first_expert=-1"),
    (dict(first_expert=4, num_local_experts=5), ValueError, "lower num_local_experts to 4"),
    (dict(num_local_experts=0), ValueError, "num_local_experts=0"),
    (dict(align=0), ValueError, "align=0 must be a positive int"),
])
def test_permute_refuses_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        reference.permute_by_expert(ids([[0, 1]]), 8, **kwargs)


def test_permute_refuses_bad_tensors():
    with pytest.raises(TypeError, match="topk_ids must be int32, got int64"):
        reference.permute_by_expert(torch.zeros((2, 2), dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="topk_ids must be 2-D"):
        reference.permute_by_expert(torch.zeros(4, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="top_k=3 must be <= the number of experts"):
        reference.permute_by_expert(torch.zeros((2, 3), dtype=torch.int32), 2)


# ---------------------------------------------------------------------------------------------
# gather_rows
# ---------------------------------------------------------------------------------------------

def test_gather_golden_pairs_to_tokens():
    x = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.bfloat16)
    # pair indices with top_k=2: 5 -> token 2, 0 -> token 0, 3 -> token 1
    out = reference.gather_rows(x, ints([5, U, 0, 3, U]), top_k=2)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.tensor([[5, 6], [0, 0], [1, 2], [3, 4], [0, 0]],
                                         dtype=torch.bfloat16))


def test_gather_golden_with_scales():
    codes = torch.arange(12, dtype=torch.uint8).reshape(3, 4)    # packed NVFP4 [T, H/2]
    scales = torch.tensor([[10], [20], [30]], dtype=torch.uint8)  # [T, H/16]
    out, out_scales = reference.gather_rows(codes, ints([2, 2, U, 0]), scales=scales)
    assert torch.equal(out, torch.tensor([[8, 9, 10, 11], [8, 9, 10, 11], [0, 0, 0, 0],
                                          [0, 1, 2, 3]], dtype=torch.uint8))
    assert torch.equal(out_scales, torch.tensor([[30], [30], [0], [10]], dtype=torch.uint8))


def test_gather_round_trips_a_permutation(seed):
    topk_ids = torch.randint(0, 9, (20, 4), dtype=torch.int32)
    perm = reference.permute_by_expert(topk_ids, 8, align=4)
    x = torch.randn(20, 16)
    out = reference.gather_rows(x, perm.source_rows, top_k=4)
    for pair, place in enumerate(perm.inverse.tolist()):
        if place != U:
            assert torch.equal(out[place], x[pair // 4])
    padding = perm.source_rows == U
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


@pytest.mark.parametrize("rows, message", [([0, 6], "rows holds 6, outside"),
                                           ([-2, 0], "rows holds -2, outside")])
def test_gather_names_a_bad_row(rows, message):
    with pytest.raises(ValueError, match=message):
        reference.gather_rows(torch.zeros((3, 2)), ints(rows), top_k=2)


def test_gather_refuses_bad_arguments():
    x = torch.zeros((3, 2))
    with pytest.raises(TypeError, match="rows must be int32"):
        reference.gather_rows(x, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="scales has 2 rows but x has 3"):
        reference.gather_rows(x, ints([0]), scales=torch.zeros((2, 1), dtype=torch.uint8))
    with pytest.raises(ValueError, match="top_k=0 must be a positive int"):
        reference.gather_rows(x, ints([0]), top_k=0)


# ---------------------------------------------------------------------------------------------
# unpermute_and_reduce
# ---------------------------------------------------------------------------------------------

def test_unpermute_golden():
    # E=3 owned 0..1 (expert 2 is foreign): token 0 -> experts (0, 2), token 1 -> (1, 0),
    # token 2 -> (2, 2) owns nothing.
    perm = reference.permute_by_expert(ids([[0, 2], [1, 0], [2, 2]]), 3, num_local_experts=2)
    assert perm.inverse.tolist() == [0, U, 2, 1, U, U]
    expert_out = torch.tensor([[1., 2.], [10., 20.], [100., 200.], [7., 7.], [7., 7.], [7., 7.]])
    weights = torch.tensor([[0.5, 9.0], [0.25, 2.0], [3.0, 4.0]])
    out = reference.unpermute_and_reduce(expert_out, perm, weights)
    # token 0: 0.5*row0; token 1: 0.25*row2 + 2.0*row1; token 2: nothing owned
    assert torch.equal(out, torch.tensor([[0.5, 1.0], [45.0, 90.0], [0.0, 0.0]]))


def test_unpermute_inverts_gather_for_top1(seed):
    topk_ids = torch.randint(0, 8, (30, 1), dtype=torch.int32)
    perm = reference.permute_by_expert(topk_ids, 8, align=8)
    x = torch.randn(30, 8, dtype=torch.bfloat16)
    rows = reference.gather_rows(x, perm.source_rows, top_k=1)
    back = reference.unpermute_and_reduce(rows, perm, torch.ones(30, 1))
    assert torch.equal(back, x)


def test_unpermute_rounds_to_nearest_even_once():
    # w*x = 1 + 3*2^-8 in fp32, a tie between bf16 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6
    perm = reference.permute_by_expert(ids([[0]]), 1)
    out = reference.unpermute_and_reduce(torch.ones((1, 1), dtype=torch.bfloat16), perm,
                                         torch.tensor([[1 + 3 * 2**-8]]))
    assert out.item() == 1 + 2**-6


def test_unpermute_refuses_mismatches():
    perm = reference.permute_by_expert(ids([[0, 1], [1, 0]]), 2)
    rows = torch.zeros((4, 3))
    with pytest.raises(ValueError, match="expert_out has 5 rows but the permutation has P=4"):
        reference.unpermute_and_reduce(torch.zeros((5, 3)), perm, torch.ones(2, 2))
    with pytest.raises(ValueError, match="k=1 slots but the permutation was built with top_k=2"):
        reference.unpermute_and_reduce(rows, perm, torch.ones(4, 1))
    with pytest.raises(ValueError, match="does not match the permutation's T\\*k=4"):
        reference.unpermute_and_reduce(rows, perm, torch.ones(3, 2))
    with pytest.raises(TypeError, match="expert_out must be bfloat16 or float16 or float32"):
        reference.unpermute_and_reduce(rows.to(torch.int32), perm, torch.ones(2, 2))
    with pytest.raises(TypeError, match="permutation must be a Permutation"):
        reference.unpermute_and_reduce(rows, perm.inverse, torch.ones(2, 2))
