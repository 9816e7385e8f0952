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

from a2a.alltoall import MoEAlltoall, sum_over_slots
from a2a.backends import BackendUnavailable, flashinfer_installed
from kernels import reference
from kernels.types import UNUSED
from tests.support import assert_close, run_distributed

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
    pytest.importorskip("a2a.quantize", reason="a2a.quantize (the quantize stage) has not "
                        "landed on this branch yet")
    run_distributed(2, _quantized_body)
