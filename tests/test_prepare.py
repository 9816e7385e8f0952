"""The Triton local send plan (kernels/prepare.py) against the oracle: every field equal."""

import itertools

import pytest
import torch

from kernels import prepare
from kernels import reference as ref
from tests.test_reference_prepare import random_routing

# (top_k, num_experts, slot_count): S = E (E not a power of two: 24 experts over 8 ranks puts
# 3 on each), and S > E (redundant slots).
ROUTES = [(1, 24, 24), (2, 24, 24), (8, 24, 24), (1, 12, 24), (2, 12, 24), (8, 12, 24)]


def assert_plans_equal(got, want):
    assert got.tensors().keys() == want.tensors().keys()
    for name, expected in want.tensors().items():
        actual = got.tensors()[name]
        assert actual.dtype == expected.dtype, name
        assert torch.equal(actual.cpu(), expected.cpu()), (name, actual, expected)


@pytest.mark.parametrize("num_tokens,ep_size,route",
                         list(itertools.product([0, 1, 5, 255, 300], [1, 2, 4, 8], ROUTES)))
def test_equals_reference(device, num_tokens, ep_size, route):
    top_k, experts, slots = route
    generator = torch.Generator().manual_seed(num_tokens * 31 + ep_size * 7 + top_k)
    ids = random_routing(ep_size, num_tokens, top_k, experts, slots, generator, padding=0.15)
    max_tokens = num_tokens + 3
    want = ref.local_send_plan(ids, experts, ep_size, max_tokens_per_rank=max_tokens,
                               slot_count=slots)
    got = prepare.local_send_plan(ids.to(device), experts, ep_size,
                                  max_tokens_per_rank=max_tokens, slot_count=slots)
    assert_plans_equal(got, want)


def test_all_padding_and_single_rank_owner(device):
    ids = torch.tensor([[8, 8], [8, 8], [7, 8]], dtype=torch.int32)
    want = ref.local_send_plan(ids, 8, 4)
    got = prepare.local_send_plan(ids.to(device), 8, 4)
    assert_plans_equal(got, want)
    assert got.send_counts.tolist() == [0, 0, 0, 1]


def test_tail_spans_several_programs(device):
    """N*R larger than one program's tail chunk: the UNUSED tail is filled by extra programs."""
    ids = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32)
    max_tokens = prepare.TAIL_CHUNK + 5
    got = prepare.local_send_plan(ids.to(device), 4, 2, max_tokens_per_rank=max_tokens)
    assert_plans_equal(got, ref.local_send_plan(ids, 4, 2, max_tokens_per_rank=max_tokens))


def test_same_errors_as_reference(device):
    ids = torch.tensor([[0, 4], [1, 2], [3, 3]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        prepare.local_send_plan(ids, 4, 2, max_tokens_per_rank=2)
    with pytest.raises(ValueError, match="expert id 5"):
        prepare.local_send_plan(ids + 1, 4, 2)
    with pytest.raises(ValueError, match="multiple of ep_size"):
        prepare.local_send_plan(ids, 4, 3)
    with pytest.raises(ValueError, match="contiguous"):
        prepare.local_send_plan(torch.zeros(2, 6, dtype=torch.int32, device=device)[:, ::2],
                                4, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [16, 1023, 4096, 8192])
@pytest.mark.parametrize("ep_size", [2, 8, 64])
def test_large_equals_reference_gpu(device, num_tokens, ep_size):
    generator = torch.Generator().manual_seed(num_tokens + ep_size)
    ids = random_routing(ep_size, num_tokens, 8, 256, 256, generator, padding=0.05)
    want = ref.local_send_plan(ids, 256, ep_size, max_tokens_per_rank=8192)
    got = prepare.local_send_plan(ids.to(device), 256, ep_size, max_tokens_per_rank=8192)
    assert_plans_equal(got, want)


@pytest.mark.gpu
def test_bit_identical_over_100_runs_gpu(device):
    generator = torch.Generator().manual_seed(5)
    ids = random_routing(16, 8192, 8, 256, 256, generator).to(device)
    first = prepare.local_send_plan(ids, 256, 16, check_ids=False)
    for _ in range(100):
        again = prepare.local_send_plan(ids, 256, 16, check_ids=False)
        for name, tensor in first.tensors().items():
            assert torch.equal(again.tensors()[name], tensor), name
