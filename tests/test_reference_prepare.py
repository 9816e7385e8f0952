"""The prepare oracle (kernels/reference.py, Prepare section): a plan written out by hand, then
invariants on random routings, then the dispatch -> identity experts -> combine round trip."""

import pytest
import torch

from kernels import reference as ref
from kernels.types import UNUSED

X = UNUSED  # short for the hand-written buffers

# Two ranks, E = S = 4 (rank 0 owns ids {0, 1}, rank 1 owns {2, 3}), id 4 = padding, k = 2,
# five tokens per rank, N = 5 so every index buffer is N*R = 10 long.
GOLDEN_IDS = [
    torch.tensor([[0, 2], [1, 0], [3, 2], [2, 1], [4, 0]], dtype=torch.int32),
    torch.tensor([[3, 1], [2, 3], [1, 0], [4, 4], [0, 3]], dtype=torch.int32),
]
# weight of (rank r, token t, slot j) = 10 r + t + j/4: exact in fp32, and names its origin.
GOLDEN_WEIGHTS = [
    torch.tensor([[10 * r + t + j / 4 for j in range(2)] for t in range(5)], dtype=torch.float32)
    for r in range(2)
]

GOLDEN_PLANS = [
    dict(  # rank 0
        send_rank_count_cumsum=[4, 7],
        # to rank 0: tokens 0, 1, 3, 4; to rank 1: tokens 0, 2, 3
        send_rank_local_indices=[0, 1, 3, 4, 0, 2, 3, X, X, X],
        # token*k + first slot on that rank: t0 j0, t1 j0, t3 j1, t4 j1 | t0 j1, t2 j0, t3 j0
        backward_recv_rank_local_indices=[0, 2, 7, 9, 1, 4, 6, X, X, X],
        # from rank 0: its tokens 0, 1, 3, 4; from rank 1: its tokens 0, 2, 4
        recv_rank_count_cumsum=[4, 7],
        recv_rank_local_indices=[0, 1, 2, 3, 4, 5, 6, X, X, X],
        recv_expert_ids=[[0, 4], [1, 0], [4, 1], [4, 0], [4, 1], [1, 0], [0, 4],
                         [4, 4], [4, 4], [4, 4]],
        recv_weights=[[0, .25], [1, 1.25], [3, 3.25], [4, 4.25],
                      [10, 10.25], [12, 12.25], [14, 14.25], [0, 0], [0, 0], [0, 0]],
    ),
    dict(  # rank 1
        send_rank_count_cumsum=[3, 6],
        # to rank 0: tokens 0, 2, 4; to rank 1: tokens 0, 1, 4 (token 3 is all padding)
        send_rank_local_indices=[0, 2, 4, 0, 1, 4, X, X, X, X],
        backward_recv_rank_local_indices=[1, 4, 8, 0, 2, 9, X, X, X, X],
        # from rank 0: its tokens 0, 2, 3; from rank 1: its tokens 0, 1, 4
        recv_rank_count_cumsum=[3, 6],
        recv_rank_local_indices=[0, 1, 2, 3, 4, 5, X, X, X, X],
        recv_expert_ids=[[4, 2], [3, 2], [2, 4], [3, 4], [2, 3], [4, 3],
                         [4, 4], [4, 4], [4, 4], [4, 4]],
        recv_weights=[[0, .25], [2, 2.25], [3, 3.25], [10, 10.25], [11, 11.25], [14, 14.25],
                      [0, 0], [0, 0], [0, 0], [0, 0]],
    ),
]
# Pairs per id, padding not counted: rank 0 [3, 2, 3, 1] (9 = 10 - 1 padding), rank 1
# [2, 2, 1, 3] (8 = 10 - 2 padding). Every rank sees all rows.
GOLDEN_EXPERT_COUNTS = [[3, 2, 3, 1], [2, 2, 1, 3]]


def test_golden_two_ranks_every_field():
    plans = ref.simulate_alltoall(GOLDEN_IDS, GOLDEN_WEIGHTS, 4, 5)
    assert len(plans) == 2
    for rank, (plan, want) in enumerate(zip(plans, GOLDEN_PLANS)):
        for name, values in want.items():
            got = getattr(plan, name)
            dtype = torch.float32 if name == "recv_weights" else torch.int32
            assert got.dtype == dtype, name
            assert torch.equal(got, torch.tensor(values, dtype=dtype)), (rank, name, got)
        assert torch.equal(plan.expert_counts, torch.tensor(GOLDEN_EXPERT_COUNTS,
                                                            dtype=torch.int32))
        assert (plan.ep_rank, plan.ep_size, plan.max_tokens_per_rank, plan.num_tokens,
                plan.top_k, plan.slot_count) == (rank, 2, 5, 5, 2, 4)


def test_golden_local_plan_counts():
    plan = ref.local_send_plan(GOLDEN_IDS[0], 4, 2)
    assert plan.send_counts.tolist() == [4, 3]
    assert plan.expert_counts.tolist() == GOLDEN_EXPERT_COUNTS[0]
    # N defaults to T = 5; a larger N only lengthens the UNUSED tail.
    wide = ref.local_send_plan(GOLDEN_IDS[0], 4, 2, max_tokens_per_rank=8)
    assert wide.send_rank_local_indices.tolist() == [0, 1, 3, 4, 0, 2, 3] + [X] * 9


def test_golden_dispatch_and_combine():
    plans = ref.simulate_alltoall(GOLDEN_IDS, GOLDEN_WEIGHTS, 4, 5, with_expert_counts=False)
    assert all(p.expert_counts is None for p in plans)
    x = [torch.tensor([[1000. * r + t] for t in range(5)]) for r in range(2)]
    recv = ref.simulate_dispatch(x, plans)
    assert recv[0].flatten().tolist() == [0, 1, 3, 4, 1000, 1002, 1004, 0, 0, 0]
    assert recv[1].flatten().tolist() == [0, 2, 3, 1000, 1001, 1004, 0, 0, 0, 0]
    # Receiver q returns row * (q + 1): token t of rank r comes back as the sum over the ranks
    # it went to.
    back = ref.simulate_combine([recv[q] * (q + 1) for q in range(2)], plans)
    assert back[0].flatten().tolist() == [0 * 3, 1 * 1, 2 * 2, 3 * 3, 4 * 1]
    assert back[1].flatten().tolist() == [1000 * 3, 1001 * 2, 1002 * 1, 0, 1004 * 3]


def random_routing(ep_size, num_tokens, top_k, num_experts, slots, generator, padding=0.1):
    """[T, k] int32 ids: k distinct experts per token (as a top-k gives), then a fraction of
    slots replaced by padding S; with slots > experts some ids move to a redundant copy."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    ids = scores.topk(top_k, dim=1).indices
    if slots > num_experts:
        copy = torch.randint(0, slots // num_experts + 1, ids.shape, generator=generator)
        moved = ids + copy * num_experts
        ids = torch.where(moved < slots, moved, ids)
    pad = torch.rand(ids.shape, generator=generator) < padding
    return torch.where(pad, torch.full_like(ids, slots), ids).int()


CASES = [  # (R, T per rank, k, E, S)
    (1, [7], 1, 4, 4),
    (2, [0, 5], 2, 4, 4),
    (2, [9, 3], 4, 6, 8),
    (4, [13, 1, 7, 0], 2, 8, 8),
    (4, [31, 30, 29, 17], 8, 12, 16),
    (8, [11, 5, 0, 20, 3, 9, 1, 16], 3, 16, 24),
]


@pytest.mark.parametrize("ep_size,tokens,top_k,experts,slots", CASES)
def test_invariants_on_random_routing(ep_size, tokens, top_k, experts, slots):
    generator = torch.Generator().manual_seed(ep_size * 100 + top_k)
    max_tokens = max(tokens) + 2
    ids = [random_routing(ep_size, t, top_k, experts, slots, generator) for t in tokens]
    weights = [torch.rand(t, top_k, generator=generator) for t in tokens]
    plans = ref.simulate_alltoall(ids, weights, experts, max_tokens, slots)
    per_rank = slots // ep_size
    rows = max_tokens * ep_size
    for rank, plan in enumerate(plans):
        routed = ids[rank]
        destination = routed.long() // per_rank
        # Every (token, destination rank) pair is sent exactly once, in ascending token order.
        send_cum = plan.send_rank_count_cumsum
        assert (send_cum.diff() >= 0).all() and send_cum[0] >= 0
        for dest in range(ep_size):
            start = int(send_cum[dest - 1]) if dest else 0
            tokens_sent = plan.send_rank_local_indices[start:int(send_cum[dest])].long()
            want = torch.nonzero((destination == dest).any(dim=1)).flatten()
            assert torch.equal(tokens_sent, want)
            slot = plan.backward_recv_rank_local_indices[start:int(send_cum[dest])].long()
            assert torch.equal(slot // top_k, tokens_sent)
            j = slot % top_k
            assert (destination[tokens_sent, j] == dest).all()
            for earlier in range(top_k):  # no earlier slot of the token lives on dest
                before = earlier < j
                assert not (before & (destination[tokens_sent, earlier] == dest)).any()
        total = int(send_cum[-1])
        assert (plan.send_rank_local_indices[total:] == UNUSED).all()
        assert (plan.backward_recv_rank_local_indices[total:] == UNUSED).all()
        # Received rows: counts match the senders', identity indices, ids owned or S.
        recv_cum = plan.recv_rank_count_cumsum
        assert (recv_cum.diff() >= 0).all()
        for source in range(ep_size):
            sent = plans[source].send_rank_count_cumsum
            assert int(recv_cum[source] - (recv_cum[source - 1] if source else 0)) == \
                int(sent[rank] - (sent[rank - 1] if rank else 0))
        total_recv = int(recv_cum[-1])
        assert total_recv <= rows
        assert torch.equal(plan.recv_rank_local_indices[:total_recv],
                           torch.arange(total_recv, dtype=torch.int32))
        assert (plan.recv_rank_local_indices[total_recv:] == UNUSED).all()
        got = plan.recv_expert_ids[:total_recv].long()
        owned = got != slots
        assert ((got[owned] // per_rank) == rank).all()
        assert owned.any(dim=1).all()  # a row is received only if it holds a local expert
        assert (plan.recv_expert_ids[total_recv:] == slots).all()
        assert (plan.recv_weights[total_recv:] == 0).all()
        # Owned (row, slot) pairs received = pairs routed to this rank's slots, over all ranks.
        routed_here = sum(int(((i.long() // per_rank) == rank).sum()) for i in ids)
        assert int(owned.sum()) == routed_here
        # Expert counts: every rank's, identical everywhere; they sum to the non-padding pairs.
        assert plan.expert_counts.shape == (ep_size, slots)
        assert torch.equal(plan.expert_counts, plans[0].expert_counts)
        assert int(plan.expert_counts[rank].sum()) == int((routed != slots).sum())


@pytest.mark.parametrize("ep_size,tokens,top_k,experts,slots", CASES)
def test_dispatch_identity_combine_round_trip(ep_size, tokens, top_k, experts, slots):
    """Identity experts: each token comes back multiplied by its number of distinct
    destination ranks; received ids and weights are the sender's, row by row."""
    generator = torch.Generator().manual_seed(7 + ep_size)
    max_tokens = max(tokens) + 1
    ids = [random_routing(ep_size, t, top_k, experts, slots, generator) for t in tokens]
    weights = [torch.rand(t, top_k, generator=generator) for t in tokens]
    plans = ref.simulate_alltoall(ids, weights, experts, max_tokens, slots)
    hidden = 3
    x = [(1000. * r + torch.arange(t, dtype=torch.float32)).unsqueeze(1).repeat(1, hidden)
         for r, t in enumerate(tokens)]
    recv = ref.simulate_dispatch(x, plans)
    packed_w = ref.simulate_dispatch(weights, plans)
    for rank, plan in enumerate(plans):
        total = int(plan.total_recv)
        assert recv[rank].shape == (max_tokens * ep_size, hidden)
        assert (recv[rank][total:] == 0).all()
        assert torch.equal(packed_w[rank], plan.recv_weights)
        source = (recv[rank][:total, 0] // 1000).long()  # rows encode their origin
        token = (recv[rank][:total, 0] % 1000).long()
        per_source = torch.bincount(source, minlength=ep_size)
        assert torch.equal(per_source.int(), plan.recv_rank_count_cumsum.diff(
            prepend=torch.zeros(1, dtype=torch.int32)))
        for row in range(total):
            sent_ids = ids[int(source[row])][int(token[row])]
            keep = (sent_ids.long() // (slots // ep_size)) == rank
            assert torch.equal(plan.recv_expert_ids[row],
                               torch.where(keep, sent_ids, torch.full_like(sent_ids, slots)))
    back = ref.simulate_combine(recv, plans)
    for rank in range(ep_size):
        fan_out = torch.stack([((ids[rank].long() // (slots // ep_size)) == d).any(dim=1)
                               for d in range(ep_size)], dim=1).sum(dim=1)
        assert torch.equal(back[rank], x[rank] * fan_out.float().unsqueeze(1))


def test_combine_rounds_once_in_bf16():
    plans = ref.simulate_alltoall(GOLDEN_IDS, GOLDEN_WEIGHTS, 4, 5)
    out = [torch.full((10, 1), 1.0 + 2 ** -8, dtype=torch.bfloat16) for _ in range(2)]
    back = ref.simulate_combine(out, plans)
    # rank 0 token 0 goes to both ranks: (1 + 2^-8) rounds to 1 in bf16 first; 2 * 1 = 2.
    assert back[0].dtype == torch.bfloat16 and back[0][0, 0].item() == 2.0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int64)), TypeError, "int32"),
    (dict(topk_ids=torch.zeros(6, dtype=torch.int32)), ValueError, "2-D"),
    (dict(max_tokens_per_rank=2), ValueError, "max_tokens_per_rank"),
    (dict(ep_size=3), ValueError, "multiple of ep_size"),
    (dict(slot_count=2), ValueError, "slot_count"),
    (dict(topk_ids=torch.tensor([[0, 5], [1, 2], [3, 3]], dtype=torch.int32)), ValueError,
     "expert id 5"),
    (dict(topk_ids=torch.tensor([[0, -1], [1, 2], [3, 3]], dtype=torch.int32)), ValueError,
     "expert id -1"),
    (dict(topk_ids=torch.zeros(3, 33, dtype=torch.int32), num_experts=64), ValueError, "32"),
])
def test_bad_input_names_the_problem(kwargs, error, match):
    args = dict(topk_ids=torch.tensor([[0, 4], [1, 2], [3, 3]], dtype=torch.int32),
                num_experts=4, ep_size=2)
    args.update(kwargs)
    ids = args.pop("topk_ids")
    experts = args.pop("num_experts")
    ep = args.pop("ep_size")
    with pytest.raises(error, match=match):
        ref.local_send_plan(ids, experts, ep, **args)
