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


@pytest.mark.parametrize("num_tokens,ep_size,route",
                         list(itertools.product([0, 1, 5, 300], [1, 2, 8],
                                                [(2, 24, 24), (8, 12, 24)])))
def test_one_and_two_launch_forms_equal_reference(device, num_tokens, ep_size, route):
    """The same routing through both forms: N = T + 3 fits one block (one launch), N = 1100
    takes several blocks (count and index launches); each equals the oracle."""
    top_k, experts, slots = route
    generator = torch.Generator().manual_seed(num_tokens * 13 + ep_size)
    ids = random_routing(ep_size, num_tokens, top_k, experts, slots, generator, padding=0.15)
    for max_tokens, single in ((num_tokens + 3, True), (1100, False)):
        assert prepare.plan_config(max_tokens, ep_size, top_k, slots).single == single
        want = ref.local_send_plan(ids, experts, ep_size, max_tokens_per_rank=max_tokens,
                                   slot_count=slots)
        got = prepare.local_send_plan(ids.to(device), experts, ep_size,
                                      max_tokens_per_rank=max_tokens, slot_count=slots)
        assert_plans_equal(got, want)


@pytest.mark.parametrize("max_tokens", [128, 129])
def test_single_launch_warps_rule_both_sides(device, max_tokens):
    """The one-launch kernel runs on 8 warps from 2048 (token, slot) pairs per block (N = 129
    rounds up to 256 tokens at k = 8) and on 4 below (N = 128: 1024 pairs); both equal the
    oracle, with T = N and with fewer tokens than N."""
    cfg = prepare.plan_config(max_tokens, 1, 8, 256)
    assert cfg.single
    assert cfg.single_warps == (prepare.SINGLE_WIDE_WARPS if max_tokens == 129
                                else prepare.NUM_WARPS)
    generator = torch.Generator().manual_seed(max_tokens)
    for num_tokens in (max_tokens, 77):
        ids = random_routing(1, num_tokens, 8, 256, 256, generator, padding=0.15)
        want = ref.local_send_plan(ids, 256, 1, max_tokens_per_rank=max_tokens)
        got = prepare.local_send_plan(ids.to(device), 256, 1, max_tokens_per_rank=max_tokens)
        assert_plans_equal(got, want)


@pytest.mark.parametrize("max_tokens", [4, 1100])
def test_out_of_range_id_named_by_both_forms(device, max_tokens):
    ids = torch.tensor([[0, 1], [2, 9], [3, 3]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="expert id 9 outside"):
        prepare.local_send_plan(ids, 4, 2, max_tokens_per_rank=max_tokens)


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


def test_same_errors_as_reference_and_views(device):
    ids = torch.tensor([[0, 4], [1, 2], [3, 3]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        prepare.local_send_plan(ids, 4, 2, max_tokens_per_rank=2)
    with pytest.raises(ValueError, match="expert id 5"):
        prepare.local_send_plan(ids + 1, 4, 2)
    with pytest.raises(ValueError, match="multiple of ep_size"):
        prepare.local_send_plan(ids, 4, 3)

    # A view is taken as it is (copied to a contiguous tensor for the kernels), on every face.
    view = torch.tensor([[0, 9, 4, 9, 1, 9], [3, 9, 2, 9, 2, 9]], dtype=torch.int32)[:, ::2]
    assert_plans_equal(prepare.local_send_plan(view.to(device), 4, 2),
                       ref.local_send_plan(view, 4, 2))


def test_negative_id_raises_and_names_it(device):
    ids = torch.tensor([[0, 1], [2, -1], [3, 3]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="expert id -1"):
        prepare.local_send_plan(ids, 4, 2)


def test_fast_path_treats_out_of_range_ids_as_padding(device):
    """check_ids=False never syncs nor raises: ids outside [0, S] are sent nowhere."""
    ids = torch.tensor([[0, -1], [9, 2], [3, -7], [12, 1]], dtype=torch.int32)
    as_padding = torch.where((ids < 0) | (ids > 8), torch.full_like(ids, 8), ids)
    got = prepare.local_send_plan(ids.to(device), 8, 4, max_tokens_per_rank=6, check_ids=False)
    assert_plans_equal(got, ref.local_send_plan(as_padding, 8, 4, max_tokens_per_rank=6))


def test_launch_constants_depend_on_the_configuration_only():
    """Every rank of a configuration (N, R, k, S) gets the same compiled variant whatever its T:
    the launch constants are a function of the configuration."""
    cfg = prepare.plan_config(300, 4, 8, 16)
    assert prepare.block_tokens(300, 4) == cfg.block_t
    assert cfg.index_programs * cfg.bins >= 16  # the histogram slices cover S
    assert cfg.index_programs * prepare.TAIL_CHUNK >= 300 * 4  # the tail programs cover N*R
    assert cfg.nb_pad * cfg.block_t >= 300  # the index kernel sees every block of any T <= N


@pytest.mark.gpu
def test_one_compiled_variant_for_every_token_count_gpu(device):
    """T only sizes the grid: after the first call, other T (incl. 0, 1, 16) compile nothing."""
    generator = torch.Generator().manual_seed(2)
    kernels = (prepare._count_kernel, prepare._index_kernel, prepare._single_plan_kernel)

    def cached():
        index = torch.cuda.current_device()
        return [len(kernel.device_caches[index][0]) for kernel in kernels]

    prepare.local_send_plan(random_routing(4, 300, 8, 16, 16, generator).to(device), 16, 4,
                            max_tokens_per_rank=300)
    before = cached()
    for tokens in (0, 1, 16, 17, 255, 300):
        ids = random_routing(4, tokens, 8, 16, 16, generator)
        got = prepare.local_send_plan(ids.to(device), 16, 4, max_tokens_per_rank=300)
        assert_plans_equal(got, ref.local_send_plan(ids, 16, 4, max_tokens_per_rank=300))
    assert cached() == before


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
