"""The Triton cross-rank prepare (a2a/triton_prepare.py) with R ranks simulated on one GPU.

GPU only: the exchange needs its ranks running at the same time (each spins until the others'
flags arrive), while Triton's CPU interpreter runs programs, and ranks, one after another. The one
CPU test (``test_exchange_index_math_emulated_on_cpu``) checks the kernel's index math in the
interpreter by running every rank twice with its call counter set to the same call: the first
pass delivers all data (its waits time out at once), the second finds every flag set.

Simulation: one zeroed [R, words] workspace (row r = rank r's inbox), one CUDA stream per rank;
every rank's call is launched on its own stream with ``check=False`` (a host sync inside one
rank's call would wait for ranks not yet launched) and ``check_ids=False``; then all streams are
synchronized and each plan is compared field by field with ``simulate_alltoall``. Each test
first calls ``triton_prepare.warmup_prepare`` for its configuration: compiling (loading a CUDA
module) waits for the device to be idle, which never happens while another rank's exchange
spins. The exchange kernels of all R ranks must be resident at once or they deadlock: with
``PrepareConfig.max_programs`` = P each rank launches R * C <= P programs of 4 warps, so R * P
programs in all (at most 8 * 16 = 128 here), far below what 132 SMs hold.
"""

import os

import pytest
import torch

from a2a import triton_prepare as tp
from a2a.config import PrepareConfig
from a2a.protocol import PrepareTimeout, raise_on_timeout
from kernels import prepare
from kernels import reference as ref
from tests.support import interpreter_with_runtime_loops
from tests.test_reference_prepare import random_routing

CONCURRENT = "the exchange needs its ranks running concurrently (each spins on the others' " \
             "flags); Triton's CPU interpreter runs them one after another"
gpu_only = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=CONCURRENT)]


def simulate_ranks(ids, weights, workspace, statuses, counters, *, num_experts, max_tokens,
                   slots, max_programs, with_expert_counts=True, timeout_spins=1 << 24,
                   ranks=None):
    """Launch every rank's triton_prepare on its own stream (rank r's call counter:
    ``counters[r]``); return the plans after a sync."""
    ep_size = len(ids)
    streams = [torch.cuda.Stream() for _ in range(ep_size)]
    plans = [None] * ep_size
    current = torch.cuda.current_stream()
    for rank in (range(ep_size) if ranks is None else ranks):
        streams[rank].wait_stream(current)  # inputs were made on the current stream
        with torch.cuda.stream(streams[rank]):
            plans[rank] = tp.triton_prepare(
                ids[rank], weights[rank], workspace, ep_rank=rank, ep_size=ep_size,
                num_experts=num_experts, max_tokens_per_rank=max_tokens, slot_count=slots,
                call_counter=counters[rank], with_expert_counts=with_expert_counts,
                config=PrepareConfig(max_programs=max_programs, timeout_spins=timeout_spins),
                check=False, check_ids=False, status=statuses[rank])
    torch.cuda.synchronize()
    return plans


def _counters(ep_size, device):
    """One zeroed call counter per simulated rank."""
    return [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(ep_size)]


def assert_plan_equal(got, want):
    for name, expected in want.tensors().items():
        actual = got.tensors()[name]
        assert actual is not None, name
        assert actual.dtype == expected.dtype, name
        assert torch.equal(actual.cpu(), expected.cpu()), (got.ep_rank, name)
    assert (got.expert_counts is None) == (want.expert_counts is None)
    assert (got.ep_rank, got.num_tokens, got.top_k, got.slot_count) == \
        (want.ep_rank, want.num_tokens, want.top_k, want.slot_count)


def make_inputs(ep_size, max_tokens, top_k, experts, slots, generator, device, *, uneven):
    tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=generator)) if uneven
              else max_tokens for _ in range(ep_size)]
    ids = [random_routing(ep_size, t, top_k, experts, slots, generator) for t in tokens]
    weights = [torch.rand(t, top_k, generator=generator) for t in tokens]
    return ids, weights, [i.to(device) for i in ids], [w.to(device) for w in weights]


CASES = [  # (R, N, k, E, S, max_programs): C = chunks per pair
    (2, 300, 2, 8, 8, 8),      # C = 4: several chunks per (source, destination)
    (2, 64, 8, 32, 32, 2),     # C = 1
    (4, 130, 8, 12, 16, 8),    # redundant slots, C = 2
    (8, 40, 3, 16, 24, 8),     # k not a power of two, C = 1
    (8, 257, 8, 256, 256, 16),  # DeepSeek-like routing, C = 2
]


@gpu_only[0]
@gpu_only[1]
@pytest.mark.parametrize("ep_size,max_tokens,top_k,experts,slots,max_programs", CASES)
def test_simulated_ranks_equal_reference_over_100_calls(device, ep_size, max_tokens, top_k,
                                                        experts, slots, max_programs):
    generator = torch.Generator().manual_seed(ep_size * 1000 + max_tokens)
    words = tp.prepare_workspace_words(ep_size, max_tokens, top_k, experts, slots)
    workspace = torch.zeros((ep_size, words), dtype=torch.int64, device=device)
    statuses = [torch.zeros(ep_size, dtype=torch.int64, device=device) for _ in range(ep_size)]
    counters = _counters(ep_size, device)
    tp.warmup_prepare(device, ep_size=ep_size, num_experts=experts,
                      max_tokens_per_rank=max_tokens, top_k=top_k, slot_count=slots,
                      config=PrepareConfig(max_programs=max_programs))
    for call in range(100):  # fresh routing every call: exercises the flags and the parities
        ids, weights, ids_dev, weights_dev = make_inputs(
            ep_size, max_tokens, top_k, experts, slots, generator, device, uneven=call % 3 == 1)
        with_counts = call % 5 != 4
        plans = simulate_ranks(ids_dev, weights_dev, workspace, statuses, counters,
                               num_experts=experts, max_tokens=max_tokens, slots=slots,
                               max_programs=max_programs, with_expert_counts=with_counts)
        assert [int(c) for c in counters] == [call + 1] * ep_size  # advanced on the device
        want = ref.simulate_alltoall(ids, weights, experts, max_tokens, slots,
                                     with_expert_counts=with_counts)
        for rank in range(ep_size):
            assert int(statuses[rank].max()) == 0, (call, rank, statuses[rank])
            assert_plan_equal(plans[rank], want[rank])


@gpu_only[0]
@gpu_only[1]
def test_bit_identical_over_100_runs(device):
    ep_size, max_tokens, top_k, experts = 4, 512, 8, 64
    generator = torch.Generator().manual_seed(11)
    _, _, ids, weights = make_inputs(ep_size, max_tokens, top_k, experts, experts, generator,
                                     device, uneven=False)
    words = tp.prepare_workspace_words(ep_size, max_tokens, top_k, experts)
    workspace = torch.zeros((ep_size, words), dtype=torch.uint64, device=device)
    statuses = [torch.zeros(ep_size, dtype=torch.int64, device=device) for _ in range(ep_size)]
    tp.warmup_prepare(device, ep_size=ep_size, num_experts=experts,
                      max_tokens_per_rank=max_tokens, top_k=top_k,
                      config=PrepareConfig(max_programs=16), with_expert_counts=(True,))
    counters = _counters(ep_size, device)
    first = simulate_ranks(ids, weights, workspace, statuses, counters, num_experts=experts,
                           max_tokens=max_tokens, slots=experts, max_programs=16)
    for call in range(1, 101):
        again = simulate_ranks(ids, weights, workspace, statuses, counters, num_experts=experts,
                               max_tokens=max_tokens, slots=experts, max_programs=16)
        for rank in range(ep_size):
            for name, tensor in first[rank].tensors().items():
                assert torch.equal(again[rank].tensors()[name], tensor), (call, rank, name)


@gpu_only[0]
@gpu_only[1]
def test_missing_rank_times_out_and_is_named(device):
    ep_size, max_tokens, top_k, experts = 2, 16, 2, 4
    generator = torch.Generator().manual_seed(3)
    _, _, ids, weights = make_inputs(ep_size, max_tokens, top_k, experts, experts, generator,
                                     device, uneven=False)
    words = tp.prepare_workspace_words(ep_size, max_tokens, top_k, experts)
    workspace = torch.zeros((ep_size, words), dtype=torch.int64, device=device)
    statuses = [torch.zeros(ep_size, dtype=torch.int64, device=device) for _ in range(ep_size)]
    simulate_ranks(ids, weights, workspace, statuses, _counters(ep_size, device),
                   num_experts=experts, max_tokens=max_tokens, slots=experts, max_programs=2,
                   timeout_spins=1000, ranks=[0])  # rank 1 never comes
    assert statuses[0].tolist() == [0, 1]  # source 1 timed out in call 0 (value call + 1)
    with pytest.raises(PrepareTimeout, match=r"source rank\(s\) \[1\]"):
        raise_on_timeout(statuses[0], 0, "prepare")


@gpu_only[0]
@gpu_only[1]
def test_workspace_checks(device):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    weights = torch.zeros(4, 2, dtype=torch.float32, device=device)
    small = torch.zeros((2, 8), dtype=torch.int64, device=device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="prepare_workspace_words"):
        tp.triton_prepare(ids, weights, small, ep_rank=0, ep_size=2, num_experts=4,
                          max_tokens_per_rank=4, call_counter=counter)
    words = tp.prepare_workspace_words(2, 4, 2, 4)
    workspace = torch.zeros((2, words), dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="call_counter must have 1 entry"):
        tp.triton_prepare(ids, weights, workspace, ep_rank=0, ep_size=2, num_experts=4,
                          max_tokens_per_rank=4, call_counter=counter.repeat(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
def test_fast_path_has_no_host_sync_and_captures_in_a_cuda_graph(device):
    """check=False, check_ids=False (and the local plan's check_ids=False) never sync: CUDA-graph
    capture would raise on a sync. One rank (R = 1) exchanges with itself."""
    max_tokens, top_k, experts = 100, 4, 8
    generator = torch.Generator().manual_seed(5)
    ids, weights, ids_dev, weights_dev = make_inputs(1, max_tokens, top_k, experts, experts,
                                                     generator, device, uneven=False)
    tp.warmup_prepare(device, ep_size=1, num_experts=experts, max_tokens_per_rank=max_tokens,
                      top_k=top_k, with_expert_counts=(True,))
    words = tp.prepare_workspace_words(1, max_tokens, top_k, experts)
    workspace = torch.zeros((1, words), dtype=torch.int64, device=device)
    status = torch.zeros(1, dtype=torch.int64, device=device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = tp.triton_prepare(ids_dev[0], weights_dev[0], workspace, ep_rank=0, ep_size=1,
                                 num_experts=experts, max_tokens_per_rank=max_tokens,
                                 call_counter=counter, check=False, check_ids=False,
                                 status=status)
        local = prepare.local_send_plan(ids_dev[0], experts, 1, max_tokens_per_rank=max_tokens,
                                        check_ids=False)
    want_plan = ref.simulate_alltoall(ids, weights, experts, max_tokens)[0]
    for replay in range(1, 4):  # every replay is a new call: the counter, the parity advance
        plan.recv_rank_local_indices.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert counter.tolist() == [replay] and status.tolist() == [0]
        assert_plan_equal(plan, want_plan)
    want = ref.local_send_plan(ids[0], experts, 1, max_tokens_per_rank=max_tokens)
    for name, tensor in want.tensors().items():
        assert torch.equal(local.tensors()[name].cpu(), tensor), name


def test_bad_id_raises_before_anything_is_sent(device):
    """check_ids=True reads the device-side range check before the exchange launches."""
    ids = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=device)
    weights = torch.ones(2, 2, dtype=torch.float32, device=device)
    words = tp.prepare_workspace_words(2, 4, 2, 4)
    workspace = torch.zeros((2, words), dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="expert id -1"):
        tp.triton_prepare(ids, weights, workspace, ep_rank=0, ep_size=2, num_experts=4,
                          max_tokens_per_rank=4, check_ids=True,
                          call_counter=torch.zeros(1, dtype=torch.int64, device=device))
    assert int(workspace.abs().sum()) == 0  # no count, row or flag was written


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter emulation")
@pytest.mark.parametrize("ep_size,max_tokens,top_k,experts,slots,max_programs,with_counts", [
    (2, 5, 2, 4, 4, 2, True),
    (2, 300, 2, 8, 8, 8, True),    # C = 4 chunks per pair
    (3, 40, 3, 6, 9, 3, False),
    (4, 70, 8, 12, 16, 8, True),   # C = 2
])
def test_exchange_index_math_emulated_on_cpu(monkeypatch, ep_size, max_tokens, top_k, experts,
                                             slots, max_programs, with_counts):
    interpreter_with_runtime_loops(monkeypatch)
    generator = torch.Generator().manual_seed(ep_size * 7 + max_tokens)
    words = tp.prepare_workspace_words(ep_size, max_tokens, top_k, experts, slots)
    workspace = torch.zeros((ep_size, words), dtype=torch.int64)
    tp.warmup_prepare("cpu", ep_size=ep_size, num_experts=experts,
                      max_tokens_per_rank=max_tokens, top_k=top_k, slot_count=slots,
                      config=PrepareConfig(max_programs=max_programs))  # touches no workspace
    counters = _counters(ep_size, "cpu")
    for call in range(2):  # two calls: both parities of the double buffer
        ids, weights, _, _ = make_inputs(ep_size, max_tokens, top_k, experts, slots, generator,
                                         "cpu", uneven=True)
        for spins in (2, 1000):  # pass 1 delivers (its waits time out), pass 2 receives
            statuses = [torch.zeros(ep_size, dtype=torch.int64) for _ in range(ep_size)]
            for counter in counters:
                counter.fill_(call)  # both passes are call `call`
            plans = [tp.triton_prepare(
                ids[rank], weights[rank], workspace, ep_rank=rank, ep_size=ep_size,
                num_experts=experts, max_tokens_per_rank=max_tokens, slot_count=slots,
                call_counter=counters[rank], with_expert_counts=with_counts,
                config=PrepareConfig(max_programs=max_programs, timeout_spins=spins),
                check=spins > 2, status=statuses[rank])
                for rank in range(ep_size)]
            assert [int(c) for c in counters] == [call + 1] * ep_size
        want = ref.simulate_alltoall(ids, weights, experts, max_tokens, slots,
                                     with_expert_counts=with_counts)
        for rank in range(ep_size):
            assert_plan_equal(plans[rank], want[rank])
