"""MoEAlltoall on CPU: 2 and 4 gloo ranks, torch prepare + torch transport.

Every rank's plan must equal ``reference.simulate_alltoall``'s field for field (the inputs of
all ranks are gathered with ``all_gather_object``); dispatched rows must equal
``simulate_dispatch``'s and carry their source in their payload (``x[:, 0] = rank*1000 +
token``); combine must return ``sum_k w_k * f(e_k) * x`` for every token, where "expert" e scales
its rows by ``f(e)``. The Triton and FlashInfer backends need GPUs: tests/test_alltoall_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from a2a.agreement import BrokenAlltoall, PeerRejected, PeerTimeout
from a2a.alltoall import MoEAlltoall
from a2a.movement import sum_over_slots
from a2a.backends import BackendUnavailable, flashinfer_installed
from a2a.config import PrepareConfig, TransportConfig
from kernels import reference
from kernels.types import UNUSED
from tests.support import assert_close, run_distributed, watchdog

TORCH_BACKENDS = {"prepare": "torch", "transport": "torch"}


def expert_factor(ids: torch.Tensor) -> torch.Tensor:
    """f(e): what "expert" e multiplies its rows by (exact in binary floating point)."""
    return 1.0 + ids.float() / 8.0


def make_routing(rank: int, num_tokens: int, num_experts: int, top_k: int, seed: int, *,
                 hot_rank: int = -1, padding: bool = False):
    """Rank ``rank``'s routing: k distinct experts per token, weights in (0, 1]. ``hot_rank``
    draws its experts 8x more often (that rank receives several times the rows);
    ``padding`` sets some slots to the padding id E."""
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    preference = torch.ones(num_tokens, num_experts)
    if hot_rank >= 0:
        per_rank = num_experts // dist.get_world_size()
        preference[:, hot_rank * per_rank:(hot_rank + 1) * per_rank] = 8.0
    if num_tokens:
        ids = torch.multinomial(preference, top_k, replacement=False, generator=generator)
    else:
        ids = torch.empty((0, top_k), dtype=torch.long)
    ids = ids.to(torch.int32)
    if padding and num_tokens:
        drop = torch.rand(num_tokens, top_k, generator=generator) < 0.2
        drop[:, 0] = False
        ids[drop] = num_experts
    weights = torch.rand(num_tokens, top_k, generator=generator) + 0.01
    return ids.contiguous(), weights.contiguous()


def make_payload(rank: int, num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """[T, H] float32: column 0 = rank*1000 + token (the row's source), the rest random."""
    generator = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(num_tokens, hidden, generator=generator)
    x[:, 0] = rank * 1000 + torch.arange(num_tokens, dtype=torch.float32)
    return x


def local_experts(recv_rows: torch.Tensor, plan) -> torch.Tensor:
    """Every received row's expert output: sum over its local slots of w * f(e) * row."""
    owned = plan.recv_expert_ids != plan.slot_count                      # [N*R, k]
    scale = (plan.recv_weights * expert_factor(plan.recv_expert_ids) * owned).sum(dim=1)
    return (recv_rows.float() * scale[:, None]).to(recv_rows.dtype)


def gather(obj):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def assert_plans_equal(actual, expected) -> None:
    for name, tensor in expected.tensors().items():
        got = getattr(actual, name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), f"{name}: {got} != {tensor}"
    for name in ("ep_rank", "ep_size", "max_tokens_per_rank", "num_tokens", "top_k",
                 "slot_count"):
        assert getattr(actual, name) == getattr(expected, name), name
    assert (actual.expert_counts is None) == (expected.expert_counts is None)


# One scenario: (tokens of each rank, E, k, N, hot rank, padding ids, payload dtype).
SCENARIOS = {
    2: [((5, 7), 8, 2, 8, -1, False, torch.float32),
        ((0, 1), 4, 2, 2, -1, False, torch.float32),               # a rank with 0, one with 1
        ((12, 9), 8, 3, 12, 1, True, torch.bfloat16)],              # skewed, padding, bf16
    4: [((6, 0, 1, 5), 8, 2, 6, -1, False, torch.float32),
        ((10, 10, 10, 10), 16, 4, 10, 2, True, torch.float32),     # rank 2 receives ~4x
        ((3, 7, 2, 4), 12, 3, 8, -1, True, torch.bfloat16)],
}


def _round_trip_body(rank: int, world_size: int, hidden: int) -> None:
    for seed, (tokens, num_experts, top_k, max_tokens, hot, padding, dtype) in \
            enumerate(SCENARIOS[world_size]):
        ids, weights = make_routing(rank, tokens[rank], num_experts, top_k, seed,
                                    hot_rank=hot, padding=padding)
        x = make_payload(rank, tokens[rank], hidden, seed).to(dtype)
        everyone = gather((ids, weights, x))
        all_ids, all_weights, all_x = (list(t) for t in zip(*everyone))
        oracle = reference.simulate_alltoall(all_ids, all_weights, num_experts, max_tokens)

        with MoEAlltoall(None, num_experts, top_k, max_tokens, hidden,
                         backends=TORCH_BACKENDS) as a2a:
            assert a2a.backends["prepare"] == "torch" and a2a.backends["transport"] == "torch"
            plan = a2a.prepare(ids, weights)
            assert_plans_equal(plan, oracle[rank])
            if hot >= 0 and rank == hot:
                cold = [int(p.total_recv) for q, p in enumerate(oracle) if q != hot]
                assert int(plan.total_recv) >= 2 * max(cold), "skew did not skew"

            recv = a2a.dispatch(x, plan)
            expected_recv = reference.simulate_dispatch(all_x, oracle)[rank]
            assert recv.dtype == dtype and torch.equal(recv, expected_recv)
            total = int(plan.total_recv)
            if dtype == torch.float32:       # every row names its source rank and token
                cumsum = [0] + plan.recv_rank_count_cumsum.tolist()
                for source in range(world_size):
                    rows = recv[cumsum[source]:cumsum[source + 1], 0]
                    assert torch.all(torch.div(rows, 1000, rounding_mode="floor") == source)
                    sent = oracle[source].send_rank_local_indices
                    start = 0 if rank == 0 else int(oracle[source].send_rank_count_cumsum[rank - 1])
                    tokens_sent = sent[start:start + rows.numel()].float()
                    assert torch.equal(rows - 1000 * source, tokens_sent)
            assert torch.all(recv[total:] == 0)

            out = a2a.combine(local_experts(recv, plan), plan)
            owned = ids != num_experts
            per_token = (weights * expert_factor(ids) * owned).sum(dim=1)
            expected = (x.float() * per_token[:, None]).to(dtype)
            assert out.shape == (tokens[rank], hidden) and out.dtype == dtype
            assert_close(out, expected)
            # The same reduction as the oracle's combine on the same rows.
            expert_out = gather(local_experts(recv, plan))
            assert torch.equal(out, reference.simulate_combine(expert_out, oracle)[rank])


@pytest.mark.parametrize("world_size", [2, 4])
def test_plans_dispatch_and_combine(world_size):
    run_distributed(world_size, _round_trip_body, 8)


def _bad_input_body(rank: int, world_size: int) -> None:
    num_experts, top_k, max_tokens, hidden = 8, 2, 4, 8

    # Ranks that disagree on the configuration raise on every rank.
    with pytest.raises(ValueError, match="disagree"):
        MoEAlltoall(None, num_experts, top_k, max_tokens, hidden + 8 * rank,
                    backends=TORCH_BACKENDS)
    # The Triton transport's and prepare's configs are part of the configuration (two objects
    # may differ; the ranks of one may not), and so are timeout and agree.
    for differs in (dict(transport_config=TransportConfig(overlap=rank == 1)),
                    dict(prepare_config=PrepareConfig(max_programs=64 + rank)),
                    dict(timeout=60.0 + rank), dict(agree=rank == 0)):
        with pytest.raises(ValueError, match="disagree"):
            MoEAlltoall(None, num_experts, top_k, max_tokens, hidden, backends=TORCH_BACKENDS,
                        **differs)
    # One rank rejecting the configuration raises everywhere.
    with pytest.raises(ValueError, match="multiple of the group size|rejected"):
        MoEAlltoall(None, num_experts + rank, top_k, max_tokens, hidden, backends=TORCH_BACKENDS)
    with pytest.raises(ValueError, match="multiple of the group size"):
        MoEAlltoall(None, 7, top_k, max_tokens, hidden, backends=TORCH_BACKENDS)
    with pytest.raises(BackendUnavailable, match="peer-mapped .* needs a CUDA device"):
        MoEAlltoall(None, num_experts, top_k, max_tokens, hidden,
                    backends={"prepare": "triton", "transport": "torch"})
    with pytest.raises(BackendUnavailable, match="CUDA"):
        MoEAlltoall(None, num_experts, top_k, max_tokens, hidden,
                    backends={"prepare": "torch", "transport": "flashinfer"})
    with pytest.raises(ValueError, match="unknown stage"):
        MoEAlltoall(None, num_experts, top_k, max_tokens, hidden, backends={"routing": "torch"})

    a2a = MoEAlltoall(None, num_experts, top_k, max_tokens, hidden, backends=TORCH_BACKENDS)
    ids, weights = make_routing(rank, 3, num_experts, top_k, seed=5)

    # An id out of range on rank 1 raises there (naming it) and on rank 0 (naming rank 1).
    bad = ids.clone()
    if rank == 1:
        bad[1, 0] = -1
        bad[2, 1] = num_experts + 3
    with pytest.raises(ValueError, match="outside" if rank == 1 else r"rank\(s\) \[1\]"):
        a2a.prepare(bad, weights)
    # sanitize=True maps them to the padding id S: the plan is the oracle's for those ids.
    plan = a2a.prepare(bad, weights, sanitize=True)
    fixed = torch.where((bad < 0) | (bad > num_experts), num_experts, bad)
    all_ids, all_weights = zip(*gather((fixed, weights)))
    oracle = reference.simulate_alltoall(list(all_ids), list(all_weights), num_experts,
                                         max_tokens)
    assert_plans_equal(plan, oracle[rank])

    # More tokens than max_tokens_per_rank, wrong dtype, device-independent shape errors.
    many, many_weights = make_routing(rank, max_tokens + 1, num_experts, top_k, seed=6)
    with pytest.raises(ValueError, match="max_tokens_per_rank" if rank == 0 else "rejected"):
        a2a.prepare(many if rank == 0 else ids, many_weights if rank == 0 else weights)
    with pytest.raises(TypeError, match="int32"):
        a2a.prepare(ids.long(), weights)
    with pytest.raises(ValueError, match="contiguous"):
        a2a.prepare(ids.t().contiguous().t(), weights)
    with pytest.raises(ValueError, match="top_k=2"):
        a2a.prepare(ids[:, :1].contiguous(), weights[:, :1].contiguous())

    plan = a2a.prepare(ids, weights)
    x = make_payload(rank, 3, hidden, seed=5)
    with pytest.raises(ValueError, match="expected"):
        a2a.dispatch(x[:2], plan)                       # rows != plan.num_tokens
    with pytest.raises(TypeError, match="bfloat16"):
        a2a.dispatch(x.double(), plan)
    with pytest.raises(ValueError, match="quant"):
        a2a.dispatch(x, plan, quant="int4")
    with pytest.raises(ValueError, match="global_scale"):
        a2a.dispatch(x, plan, quant="nvfp4")
    with pytest.raises(ValueError, match="expected"):
        a2a.combine(torch.zeros(3, hidden), plan)
    recv = a2a.dispatch(x, plan)
    out = a2a.combine(local_experts(recv, plan), plan)
    assert out.shape == (3, hidden)

    a2a.close()
    a2a.close()                                        # closing twice is a no-op
    assert a2a.closed
    with pytest.raises(RuntimeError, match="closed"):
        a2a.prepare(ids, weights)
    with pytest.raises(RuntimeError, match="closed"):
        a2a.dispatch(x, plan)


def test_bad_input_and_config_mismatch():
    run_distributed(2, _bad_input_body)


def test_sum_over_slots_accumulates_in_float32():
    # Three bf16 rows whose running bf16 sum would lose the small term.
    rows = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    assert sum_over_slots(rows, 1, 3).item() == 258.0
    scattered = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    assert torch.equal(sum_over_slots(scattered, 2, 3),
                       scattered.reshape(2, 3, 2).sum(dim=1))


@pytest.mark.skipif(not flashinfer_installed(), reason="FlashInfer is not installed")
def test_flashinfer_info_round_trip():
    """AlltoallPlan -> MoEAlltoallInfo -> AlltoallPlan, with FlashInfer-style garbage (longer
    index buffers, junk past the valid prefix, NaN weights in padding rows) cleaned up."""
    from a2a.flashinfer_comm import plan_from_flashinfer, to_flashinfer_info

    torch.manual_seed(0)
    num_experts, top_k, max_tokens, ep_size = 8, 3, 6, 2
    all_ids = [torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(t)]).int()
               for t in (6, 4)]
    all_weights = [torch.rand(t, top_k) for t in (6, 4)]
    plans = reference.simulate_alltoall(all_ids, all_weights, num_experts, max_tokens)
    for plan in plans:
        info = to_flashinfer_info(plan)
        assert info.local_token_allocation_count == max_tokens * ep_size
        assert info.send_rank_local_indices is plan.send_rank_local_indices
        assert info.local_gather_indices is None

        long_rows = max_tokens * max(ep_size, top_k)

        def junk(valid: torch.Tensor, total: int) -> torch.Tensor:
            out = torch.full((long_rows,), 12345, dtype=torch.int32)
            out[:total] = valid[:total]
            return out
        total_send, total_recv = int(plan.total_send), int(plan.total_recv)
        info.send_rank_local_indices = junk(plan.send_rank_local_indices, total_send)
        info.backward_recv_rank_local_indices = junk(plan.backward_recv_rank_local_indices,
                                                     total_send)
        info.recv_rank_local_indices = junk(plan.recv_rank_local_indices, total_recv)
        weights = plan.recv_weights.clone()
        weights[total_recv:] = float("nan")
        back = plan_from_flashinfer(
            info, plan.recv_expert_ids, weights, plan.expert_counts, ep_rank=plan.ep_rank,
            ep_size=ep_size, max_tokens_per_rank=max_tokens, num_tokens=plan.num_tokens,
            top_k=top_k, slot_count=num_experts)
        assert_plans_equal(back, plan)
        assert torch.all(back.send_rank_local_indices[total_send:] == UNUSED)


def _quantized_body(rank: int, world_size: int) -> None:
    num_experts, top_k, max_tokens, hidden = 8, 3, 6, 64
    ids, weights = make_routing(rank, (6, 4)[rank], num_experts, top_k, seed=21)
    x = torch.randn(ids.shape[0], hidden, generator=torch.Generator().manual_seed(rank))
    x = x.to(torch.bfloat16)
    all_ids, all_weights, all_x = (list(t) for t in zip(*gather((ids, weights, x))))
    oracle = reference.simulate_alltoall(all_ids, all_weights, num_experts, max_tokens)
    global_scale = reference.nvfp4_global_scale(torch.cat(all_x))     # shared by every rank
    with MoEAlltoall(None, num_experts, top_k, max_tokens, hidden,
                     backends={**TORCH_BACKENDS, "quantize": "torch"}) as a2a:
        plan = a2a.prepare(ids, weights)
        packed, scales = a2a.dispatch(x, plan, quant="nvfp4", global_scale=global_scale)
        quantized = [reference.quantize_nvfp4(t, global_scale) for t in all_x]
        assert packed.dtype == torch.uint8 and scales.dtype == torch.uint8
        assert torch.equal(packed, reference.simulate_dispatch([q for q, _ in quantized],
                                                               oracle)[rank])
        assert torch.equal(scales, reference.simulate_dispatch([s for _, s in quantized],
                                                               oracle)[rank])
        codes, mx_scales = a2a.dispatch(x, plan, quant="mxfp8")
        quantized = [reference.quantize_mxfp8(t) for t in all_x]
        expected = reference.simulate_dispatch([q.view(torch.uint8) for q, _ in quantized],
                                               oracle)[rank]
        assert torch.equal(codes.view(torch.uint8), expected)
        assert torch.equal(mx_scales, reference.simulate_dispatch([s for _, s in quantized],
                                                                  oracle)[rank])


def test_quantized_dispatch_moves_codes_and_scales_bit_exactly():
    run_distributed(2, _quantized_body)


# ---------------------------------------------------------------------------------------------
# No rank left hanging (issue 16): each scenario ends with an error on every rank
# ---------------------------------------------------------------------------------------------

# The objects' bound on waiting for a peer (seconds), and each scenario's hard bound: past it,
# the rank prints its traceback and exits (tests.support.watchdog), which fails the test.
PEER_TIMEOUT_S = 3.0
SCENARIO_LIMIT_S = 10.0
# The whole test's hard bound (startup and every scenario), after which the harness kills it.
HANG_TEST_LIMIT_S = 240.0
# The layer of the scenarios: E (a multiple of 2 and 3), k, N, H.
HANG_E, HANG_K, HANG_N, HANG_H = 12, 2, 4, 16


def _small_a2a(**kwargs) -> MoEAlltoall:
    return MoEAlltoall(None, HANG_E, HANG_K, HANG_N, HANG_H, backends=TORCH_BACKENDS,
                       timeout=PEER_TIMEOUT_S,
                       **kwargs)


def _peer_error(bad: int):
    """What the ranks other than ``bad`` raise when ``bad`` rejected its arguments."""
    return pytest.raises(PeerRejected, match=rf"rank\(s\) \[{bad}\] rejected their arguments")


def _still_usable(a2a: MoEAlltoall, rank: int) -> None:
    """After an agreed rejection nothing moved: the next calls work on every rank."""
    ids, weights = make_routing(rank, 3, HANG_E, HANG_K, seed=41)
    plan = a2a.prepare(ids, weights)
    recv = a2a.dispatch(make_payload(rank, 3, HANG_H, seed=41), plan)
    assert a2a.combine(local_experts(recv, plan), plan).shape == (3, HANG_H)


def _scenario_constructor_backends_string(rank, bad):
    with pytest.raises(TypeError, match="backends must be a dict") if rank == bad \
            else _peer_error(bad):
        MoEAlltoall(None, HANG_E, HANG_K, HANG_N, HANG_H, timeout=PEER_TIMEOUT_S,
                    backends="torch" if rank == bad else TORCH_BACKENDS)


def _scenario_too_many_tokens_unchecked(rank, bad):
    with _small_a2a() as a2a:
        ids, weights = make_routing(rank, 5 if rank == bad else 3, HANG_E, HANG_K, seed=42)
        with pytest.raises(ValueError, match="max_tokens_per_rank") if rank == bad \
                else _peer_error(bad):
            a2a.prepare(ids, weights, check_inputs=False)
        _still_usable(a2a, rank)


def _scenario_padding_ids_unchecked(rank, bad):
    """check_inputs=False with ids -1 and S + 3 on one rank: treated as padding, as the
    Triton prepare does: the plan is the oracle's for those ids mapped to S."""
    with _small_a2a() as a2a:
        ids, weights = make_routing(rank, 4, HANG_E, HANG_K, seed=43)
        if rank == bad:
            ids[0, 0], ids[2, 1] = -1, HANG_E + 3
        plan = a2a.prepare(ids, weights, check_inputs=False)
        fixed = torch.where((ids < 0) | (ids > HANG_E), HANG_E, ids)
        all_ids, all_weights = zip(*gather((fixed, weights)))
        oracle = reference.simulate_alltoall(list(all_ids), list(all_weights), HANG_E, HANG_N)
        assert_plans_equal(plan, oracle[rank])


def _scenario_dispatch_float64(rank, bad):
    with _small_a2a() as a2a:
        ids, weights = make_routing(rank, 3, HANG_E, HANG_K, seed=44)
        plan = a2a.prepare(ids, weights)
        x = make_payload(rank, 3, HANG_H, seed=44)
        with pytest.raises(TypeError, match="float64") if rank == bad else _peer_error(bad):
            a2a.dispatch(x.double() if rank == bad else x, plan)
        _still_usable(a2a, rank)


def _scenario_nvfp4_scale_of_two(rank, bad):
    with _small_a2a() as a2a:
        ids, weights = make_routing(rank, 3, HANG_E, HANG_K, seed=45)
        plan = a2a.prepare(ids, weights)
        x = make_payload(rank, 3, HANG_H, seed=45).bfloat16()
        scale = torch.ones(2 if rank == bad else 1)
        with pytest.raises(ValueError, match="global_scale must hold 1 element") \
                if rank == bad else _peer_error(bad):
            a2a.dispatch(x, plan, quant="nvfp4", global_scale=scale)
        _still_usable(a2a, rank)


def _scenario_nvfp4_scale_not_finite(rank, bad):
    """A NaN global scale on one rank (its value is read before the agreement): ValueError
    there, the peers' rejection on the others; with check_values=False nobody reads it and
    the call goes through on every rank."""
    with _small_a2a() as a2a:
        ids, weights = make_routing(rank, 3, HANG_E, HANG_K, seed=48)
        plan = a2a.prepare(ids, weights)
        x = make_payload(rank, 3, HANG_H, seed=48).bfloat16()
        scale = torch.full((1,), float("nan") if rank == bad else 1.0)
        with pytest.raises(ValueError, match="global_scale holds nan") \
                if rank == bad else _peer_error(bad):
            a2a.dispatch(x, plan, quant="nvfp4", global_scale=scale)
        packed, _ = a2a.dispatch(x, plan, quant="nvfp4", global_scale=scale,
                                 check_values=False)
        assert packed.shape == (a2a.max_tokens_per_rank * a2a.ep_size, HANG_H // 2)
        _still_usable(a2a, rank)


def _scenario_combine_wrong_shape(rank, bad):
    with _small_a2a() as a2a:
        ids, weights = make_routing(rank, 3, HANG_E, HANG_K, seed=46)
        plan = a2a.prepare(ids, weights)
        recv = a2a.dispatch(make_payload(rank, 3, HANG_H, seed=46), plan)
        expert_out = local_experts(recv, plan)
        with pytest.raises(ValueError, match="expert_out has shape") if rank == bad \
                else _peer_error(bad):
            a2a.combine(expert_out[:-1] if rank == bad else expert_out, plan)
        _still_usable(a2a, rank)


def _scenario_raise_between_prepare_and_dispatch(rank, bad):
    """The user's code on rank ``bad`` raises after prepare (a server catches it): the others'
    dispatch raises within the timeout naming ``bad``; later, ``bad``'s own dispatch raises
    instead of entering the collective alone, and the object refuses every call after."""
    a2a = _small_a2a()
    ids, weights = make_routing(rank, 3, HANG_E, HANG_K, seed=47)
    plan = a2a.prepare(ids, weights)
    x = make_payload(rank, 3, HANG_H, seed=47)
    if rank != bad:
        # (whichever healthy rank decided first: "did not arrive within", "gave up waiting")
        with pytest.raises(PeerTimeout, match=rf"rank\(s\) \[{bad}\] .*timeout={PEER_TIMEOUT_S}"):
            a2a.dispatch(x, plan)
    dist.barrier()  # `bad` comes back only after the others gave up
    if rank == bad:
        with pytest.raises(PeerTimeout, match=rf"gave up waiting for rank\(s\) \[{bad}\]"):
            a2a.dispatch(x, plan)
    with pytest.raises(BrokenAlltoall, match="unusable"):
        a2a.prepare(ids, weights)
    assert a2a.broken is not None
    a2a.close()


def _scenario_out_of_step(rank, bad):
    """Rank ``bad`` skips dispatch and goes on with the next prepare before the others time
    out: the ranks are at different calls, and every rank raises, naming the calls."""
    with _small_a2a() as a2a:
        ids, weights = make_routing(rank, 3, HANG_E, HANG_K, seed=48)
        plan = a2a.prepare(ids, weights)
        with pytest.raises(PeerRejected, match="different collective calls"):
            if rank == bad:
                a2a.prepare(ids, weights)
            else:
                a2a.dispatch(make_payload(rank, 3, HANG_H, seed=48), plan)
        _still_usable(a2a, rank)


def _scenario_broken_rank_poisons_the_next_call(rank, bad):
    """A rank whose object broke (a timeout or an error while data moved) makes the next
    agreement fail on every rank, naming it, without waiting for the timeout."""
    from a2a.agreement import Agreement
    agreement = Agreement(None, rank, dist.get_world_size(), PEER_TIMEOUT_S)
    agreement.agree("construct", "", None)
    if rank == bad:
        agreement.poison(f"rank {bad}: a test breaks it")
    else:
        with pytest.raises(BrokenAlltoall, match=rf"MoEAlltoall of rank\(s\) \[{bad}\] broke"):
            agreement.agree("dispatch", "", None)
    with pytest.raises(BrokenAlltoall, match="unusable"):
        agreement.agree("combine", "", None)


def _scenario_agreements_leave_no_keys(rank, bad):
    """Each call's keys are deleted by the last rank done with it: 20 calls leave the store
    as they found it."""
    from a2a.agreement import group_store
    store = group_store(None)
    with _small_a2a() as a2a:
        dist.barrier()
        before = store.num_keys()
        dist.barrier()
        ids, weights = make_routing(rank, 3, HANG_E, HANG_K, seed=49)
        x = make_payload(rank, 3, HANG_H, seed=49)
        for _ in range(5):
            _still_usable(a2a, rank)  # prepare, dispatch, combine
            plan = a2a.prepare(ids, weights)
            with pytest.raises(TypeError) if rank == bad else _peer_error(bad):
                a2a.dispatch(x.double() if rank == bad else x, plan)  # an agreed rejection
        dist.barrier()
        after = store.num_keys()
        dist.barrier()
    assert after == before, (before, after)


HANG_SCENARIOS = [_scenario_constructor_backends_string, _scenario_too_many_tokens_unchecked,
                  _scenario_padding_ids_unchecked, _scenario_dispatch_float64,
                  _scenario_nvfp4_scale_of_two, _scenario_nvfp4_scale_not_finite,
                  _scenario_combine_wrong_shape,
                  _scenario_raise_between_prepare_and_dispatch, _scenario_out_of_step,
                  _scenario_broken_rank_poisons_the_next_call,
                  _scenario_agreements_leave_no_keys]


def _hang_scenarios_body(rank: int, world_size: int) -> None:
    _small_a2a().close()  # imports and first-use work, before the bounded scenarios
    bad = world_size - 1  # the last rank misbehaves; with 3 ranks, two healthy ones wait
    for scenario in HANG_SCENARIOS:
        dist.barrier()
        with watchdog(SCENARIO_LIMIT_S):
            scenario(rank, bad)


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_rank_left_hanging(world_size):
    """Every hang scenario of issue 16 (one rank's bad argument in each collective call, the
    user's code raising between prepare and dispatch, out-of-step calls, a broken rank) ends
    with an error on every rank, each within SCENARIO_LIMIT_S, the healthy ranks naming the
    one at fault; agreed rejections leave the object usable and the store clean."""
    run_distributed(world_size, _hang_scenarios_body, timeout=HANG_TEST_LIMIT_S)
