"""MoEAlltoall on 2 GPUs: NCCL + MnnvlMemory, every prepare x transport x payload.

Run on a 2-GPU host: ``pytest -q tests/test_alltoall_gpu.py`` (each test spawns 2 ranks; the
first use of FlashInfer's alltoall module JIT-builds it once).

- every combination prepare {triton, flashinfer, torch} x transport {triton, flashinfer, torch} x
  payload {bf16, nvfp4 (Triton quantizer)} gives bit-identical combine results and the same
  received payload (per source segment, sorted by the source's token id: FlashInfer's send
  order comes from atomics);
- every plan is checked against ``reference.simulate_alltoall``: field for field for the
  Triton and torch prepares, per segment (sets, and rows matched through the sender's order)
  for FlashInfer's;
- a Triton plan goes through FlashInfer's own ``MnnvlMoe.mnnvl_moe_alltoallv`` /
  ``..._combine`` (via ``to_flashinfer_info``); FlashInfer's plan through the torch transport;
- the Triton plan is bit-identical over 100 runs;
- MoEAlltoall (and its three MNNVL workspaces) is made, used and closed 20 times without
  leaking device memory, address reservations or file descriptors;
- the Triton transport: 1,000 dispatch/combine iterations with fresh routing (bf16, and nvfp4
  every 10th, also by an object whose TransportConfig quantizes in the send kernel
  (fused_nvfp4_dispatch); another bf16 dispatch every 10th by one whose TransportConfig moves
  rows in one launch of send and receive programs (overlap)),
  bit-identical to the torch transport on the same plan, no timeout; prepare, dispatch and
  combine captured in one CUDA graph and replayed 100 times with fresh routing and inputs,
  each replay checked. These two also run with one rank (on a 1-GPU host).
"""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch

from a2a.alltoall import MoEAlltoall
from a2a.config import TransportConfig
from kernels import reference
from kernels.types import UNUSED
from tests.support import assert_close, run_distributed
from tests.test_alltoall import (assert_plans_equal, expert_factor, gather, local_experts,
                                 make_routing)

WORLD_SIZE = 2
# DeepSeek-like routing on a small layer: FlashInfer needs E % 4 == 0 and rows of 16n bytes;
# H = 256 gives nvfp4 rows of 128 bytes and scale rows of 16 bytes.
NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN = 32, 8, 64, 256
TOKENS = (64, 37)                    # a full rank and an awkward count
PREPARES = ("triton", "flashinfer", "torch")
TRANSPORTS = ("triton", "flashinfer", "torch")
# The Triton transport's soak and CUDA-graph tests: one rank (a 1-GPU host) and WORLD_SIZE.
RANK_COUNTS = [pytest.param(1, marks=pytest.mark.gpu),
               pytest.param(WORLD_SIZE, marks=pytest.mark.multigpu)]


def _cpu_plan(plan):
    """The plan's tensors on the CPU, as a dict (picklable for all_gather_object)."""
    return {name: t.cpu() for name, t in plan.tensors().items()}


def _segment(cumsum: torch.Tensor, rank: int) -> tuple[int, int]:
    end = int(cumsum[rank])
    return (int(cumsum[rank - 1]) if rank else 0), end


def check_unordered_plan(plan, oracle: list, sender_plans: list, rank: int) -> None:
    """A plan whose send segments may be in any order (FlashInfer's) against the oracle:
    counts exact; each send segment the oracle's set of (token, backward index) pairs; every
    received row equal to the oracle's row for the token the sender put at that position."""
    mine, expected = _cpu_plan(plan), _cpu_plan(oracle[rank])
    for name in ("send_rank_count_cumsum", "recv_rank_count_cumsum", "recv_rank_local_indices",
                 "expert_counts"):
        assert torch.equal(mine[name], expected[name]), name
    for destination in range(WORLD_SIZE):
        start, end = _segment(mine["send_rank_count_cumsum"], destination)
        pairs = sorted(zip(mine["send_rank_local_indices"][start:end].tolist(),
                           mine["backward_recv_rank_local_indices"][start:end].tolist()))
        oracle_pairs = list(zip(expected["send_rank_local_indices"][start:end].tolist(),
                                expected["backward_recv_rank_local_indices"][start:end].tolist()))
        assert pairs == oracle_pairs, f"send segment to rank {destination}"
    total_send = int(mine["send_rank_count_cumsum"][-1])
    assert torch.all(mine["send_rank_local_indices"][total_send:] == UNUSED)
    assert torch.all(mine["backward_recv_rank_local_indices"][total_send:] == UNUSED)
    for source in range(WORLD_SIZE):
        send_start, send_end = _segment(sender_plans[source]["send_rank_count_cumsum"], rank)
        actual_order = sender_plans[source]["send_rank_local_indices"][send_start:send_end]
        oracle_order = _cpu_plan(oracle[source])["send_rank_local_indices"][send_start:send_end]
        where = {token: i for i, token in enumerate(oracle_order.tolist())}
        recv_start, _ = _segment(mine["recv_rank_count_cumsum"], source)
        for offset, token in enumerate(actual_order.tolist()):
            row, oracle_row = recv_start + offset, recv_start + where[token]
            assert torch.equal(mine["recv_expert_ids"][row],
                               expected["recv_expert_ids"][oracle_row])
            assert torch.equal(mine["recv_weights"][row], expected["recv_weights"][oracle_row])
    total_recv = int(mine["recv_rank_count_cumsum"][-1])
    assert torch.all(mine["recv_expert_ids"][total_recv:] == NUM_EXPERTS)
    assert torch.all(mine["recv_weights"][total_recv:] == 0)


def canonical_rows(recv: torch.Tensor, rank: int, sender_plans: list) -> torch.Tensor:
    """Received rows reordered by (source rank, source token id), whatever the send order."""
    order = []
    recv_start = 0
    for source in range(WORLD_SIZE):
        start, end = _segment(sender_plans[source]["send_rank_count_cumsum"], rank)
        tokens = sender_plans[source]["send_rank_local_indices"][start:end]
        order.append(recv_start + torch.argsort(tokens, stable=True))
        recv_start += end - start
    return recv[torch.cat(order).to(recv.device)]


def _combinations_body(rank: int, world_size: int) -> None:
    from a2a.flashinfer_comm import to_flashinfer_info

    device = torch.device(torch.accelerator.current_accelerator().type, rank)
    ids, weights = make_routing(rank, TOKENS[rank], NUM_EXPERTS, TOP_K, seed=11, padding=True)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=torch.Generator().manual_seed(rank))
    x = x.to(torch.bfloat16)
    all_ids, all_weights, all_x = (list(t) for t in zip(*gather((ids, weights, x))))
    oracle = reference.simulate_alltoall([t.to(device) for t in all_ids],
                                         [t.to(device) for t in all_weights],
                                         NUM_EXPERTS, MAX_TOKENS)
    ids, weights, x = ids.to(device), weights.to(device), x.to(device)
    # One global scale for every rank, so a receiver can decode any source's rows.
    amax = torch.stack([t.abs().amax().float() for t in all_x]).max()
    global_scale = (torch.tensor(448.0 * 6.0) / amax).reshape(1).to(device)

    baseline: dict = {}
    for prepare, transport in itertools.product(PREPARES, TRANSPORTS):
        backends = {"prepare": prepare, "transport": transport, "quantize": "triton"}
        with MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN,
                         backends=backends) as a2a:
            plan = a2a.prepare(ids, weights)
            sender_plans = gather(_cpu_plan(plan))
            if prepare == "flashinfer":
                check_unordered_plan(plan, oracle, sender_plans, rank)
            else:
                assert_plans_equal(plan, oracle[rank])

            # bf16 payload: exact against the oracle with this plan's order; same rows as the
            # baseline in canonical order; combine bit-identical across combinations.
            recv = a2a.dispatch(x, plan)
            total = int(plan.total_recv)
            expected = reference.simulate_dispatch([t.to(device) for t in all_x],
                                                   [_as_plan(p, q, plan) for q, p in
                                                    enumerate(sender_plans)])[rank]
            assert torch.equal(recv[:total], expected[:total]), (prepare, transport)
            assert torch.all(recv[total:] == 0)
            canonical = canonical_rows(recv[:total], rank, sender_plans)
            out = a2a.combine(local_experts(recv, plan), plan)
            per_token = (weights * expert_factor(ids) * (ids != NUM_EXPERTS)).sum(dim=1)
            assert_close(out, (x.float() * per_token[:, None]).to(torch.bfloat16))

            # NVFP4 payload from the Triton quantizer: codes and scales moved bit-exactly.
            packed, scales = a2a.dispatch(x, plan, quant="nvfp4", global_scale=global_scale)
            assert packed.dtype == torch.uint8 and packed.shape == (MAX_TOKENS * WORLD_SIZE,
                                                                    HIDDEN // 2)
            assert scales.dtype == torch.uint8 and scales.shape == (MAX_TOKENS * WORLD_SIZE,
                                                                    HIDDEN // 16)
            quantized = [reference.quantize_nvfp4(t.to(device), global_scale) for t in all_x]
            plans_all = [_as_plan(p, q, plan) for q, p in enumerate(sender_plans)]
            expected_packed = reference.simulate_dispatch([q for q, _ in quantized], plans_all)
            expected_scales = reference.simulate_dispatch([s for _, s in quantized], plans_all)
            assert torch.equal(packed[:total], expected_packed[rank][:total])
            assert torch.equal(scales[:total], expected_scales[rank][:total])
            decoded = reference.dequantize_nvfp4(packed, scales, global_scale,
                                                 dtype=torch.bfloat16)
            out_fp4 = a2a.combine(local_experts(decoded, plan), plan)

            result = {"recv": canonical, "packed": canonical_rows(packed[:total], rank,
                                                                  sender_plans),
                      "scales": canonical_rows(scales[:total], rank, sender_plans),
                      "out": out, "out_fp4": out_fp4}
            if not baseline:
                baseline = result
            for name, value in result.items():
                assert torch.equal(value, baseline[name]), (prepare, transport, name)

            if prepare == "triton" and transport == "flashinfer":
                _through_flashinfer_api(a2a, plan, x, recv, out, to_flashinfer_info)


def _as_plan(tensors: dict, rank: int, like):
    """An AlltoallPlan from gathered CPU tensors, on ``like``'s device (for the oracle)."""
    import dataclasses
    device = like.send_rank_count_cumsum.device
    fields = {name: t.to(device) for name, t in tensors.items()}
    return dataclasses.replace(like, ep_rank=rank, num_tokens=TOKENS[rank], **fields)


def _through_flashinfer_api(a2a, plan, x, recv, out, to_flashinfer_info) -> None:
    """A Triton plan driven through FlashInfer's own MnnvlMoe alltoallv and combine."""
    from flashinfer.comm.trtllm_alltoall import MnnvlMoe

    info = to_flashinfer_info(plan)
    workspace = a2a.flashinfer_comm_workspace()
    total = int(plan.total_recv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        theirs = MnnvlMoe.mnnvl_moe_alltoallv(x, info, workspace, plan.ep_rank, plan.ep_size)
        assert torch.equal(theirs[:total], recv[:total])
        combined = MnnvlMoe.mnnvl_moe_alltoallv_combine(
            local_experts(recv, plan), info, workspace, plan.ep_rank, plan.ep_size, plan.top_k,
            plan.num_tokens)
    # FlashInfer sums in bf16 (torch.sum, which accumulates in float32 on the GPU).
    assert_close(combined, out)


@pytest.mark.multigpu
def test_every_backend_combination_agrees():
    run_distributed(WORLD_SIZE, _combinations_body, cuda=True)


def _determinism_body(rank: int, world_size: int) -> None:
    device = torch.device(torch.accelerator.current_accelerator().type, rank)
    ids, weights = make_routing(rank, TOKENS[rank], NUM_EXPERTS, TOP_K, seed=3)
    all_ids, all_weights = (list(t) for t in zip(*gather((ids, weights))))
    oracle = reference.simulate_alltoall(all_ids, all_weights, NUM_EXPERTS, MAX_TOKENS)[rank]
    with MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN,
                     backends={"prepare": "triton", "transport": "flashinfer"}) as a2a:
        first = a2a.prepare(ids.to(device), weights.to(device))
        assert_plans_equal(_to(first, "cpu"), oracle)
        for run in range(99):
            again = a2a.prepare(ids.to(device), weights.to(device))
            for name, tensor in first.tensors().items():
                assert torch.equal(getattr(again, name), tensor), (run, name)


def _to(plan, device):
    import dataclasses
    return dataclasses.replace(plan, **{n: t.to(device) for n, t in plan.tensors().items()})


@pytest.mark.multigpu
def test_triton_plan_is_bit_identical_over_100_runs():
    run_distributed(WORLD_SIZE, _determinism_body, cuda=True)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _reinit_body(rank: int, world_size: int) -> None:
    from flashinfer.comm.mnnvl import MnnvlMemory

    device = torch.device(torch.accelerator.current_accelerator().type, rank)
    ids, weights = make_routing(rank, TOKENS[rank], NUM_EXPERTS, TOP_K, seed=4)
    ids, weights = ids.to(device), weights.to(device)
    x = torch.randn(TOKENS[rank], HIDDEN, device=device, dtype=torch.bfloat16)
    backend_cycle = [("triton", "flashinfer"), ("flashinfer", "flashinfer")]
    reference_out = None
    before = None
    for cycle in range(20):
        prepare, transport = backend_cycle[cycle % 2]
        a2a = MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN,
                          backends={"prepare": prepare, "transport": transport})
        plan = a2a.prepare(ids, weights)
        recv = a2a.dispatch(x, plan)
        out = a2a.combine(local_experts(recv, plan), plan)
        if reference_out is None:
            reference_out = out
        assert torch.equal(out, reference_out), cycle
        a2a.close()
        with pytest.raises(RuntimeError, match="closed"):
            a2a.combine(local_experts(recv, plan), plan)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        state = (len(MnnvlMemory.allocated_map), len(MnnvlMemory.address_refcnt), _open_fds(),
                 torch.cuda.mem_get_info(device)[0])
        if cycle == 1:
            before = state          # after both backend kinds have built their modules
        elif before is not None:
            assert state[:3] == before[:3], (cycle, state, before)
            # Free device memory within 64 MiB of where it was (MNNVL segments are ~1 MiB+).
            assert abs(state[3] - before[3]) < 64 << 20, (cycle, state, before)
    assert len(MnnvlMemory.allocated_map) == 0


@pytest.mark.multigpu
def test_init_close_reinit_20_times():
    run_distributed(WORLD_SIZE, _reinit_body, cuda=True)


def _limits_body(rank: int, world_size: int) -> None:
    device = torch.device(torch.accelerator.current_accelerator().type, rank)
    # FlashInfer's prepare limits, rejected on every rank at construction.
    with pytest.raises(ValueError, match="multiple of 4"):
        MoEAlltoall(None, 30, TOP_K, MAX_TOKENS, HIDDEN,
                    backends={"prepare": "flashinfer", "transport": "torch"})
    with pytest.raises(ValueError, match="top_k"):
        MoEAlltoall(None, 64, 33, MAX_TOKENS, HIDDEN,
                    backends={"prepare": "flashinfer", "transport": "torch"})
    with MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, 4,
                     backends={"prepare": "flashinfer", "transport": "flashinfer"}) as a2a:
        ids, weights = make_routing(rank, 5, NUM_EXPERTS, TOP_K, seed=9)
        ids, weights = ids.to(device), weights.to(device)
        bad = ids.clone()
        if rank == 0:
            bad[0, 0] = -1                 # FlashInfer would send it to rank 0
        with pytest.raises(ValueError, match="outside" if rank == 0 else "rejected"):
            a2a.prepare(bad, weights)
        plan = a2a.prepare(bad, weights, sanitize=True)
        assert int(plan.expert_counts[rank].sum()) == int((bad >= 0).sum())
        x = torch.zeros(5, 4, device=device, dtype=torch.bfloat16)       # 8-byte rows
        with pytest.raises(ValueError, match="16 bytes"):
            a2a.dispatch(x, plan)
        with pytest.raises(ValueError, match="is on"):
            a2a.prepare(ids.cpu(), weights.cpu())


@pytest.mark.multigpu
def test_flashinfer_limits_and_bad_ids_raise_everywhere():
    run_distributed(WORLD_SIZE, _limits_body, cuda=True)


# Soak length: 1,000 steps by default (each step also runs the torch reference transport);
# MOE_A2A_SOAK_STEPS=10000 runs the 10,000-iteration soak.
SOAK_STEPS = int(os.environ.get("MOE_A2A_SOAK_STEPS", "1000"))


def _triton_transport_soak_body(rank: int, world_size: int) -> None:
    device = torch.device(torch.accelerator.current_accelerator().type, rank)
    triton = MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN,
                         backends={"prepare": "triton", "transport": "triton",
                                   "quantize": "triton"})
    torch_ref = MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN,
                            backends={"prepare": "torch", "transport": "torch",
                                      "quantize": "triton"})
    # The same transport with the quantizer in the send kernel, and with send and receive
    # programs in one launch (their own workspaces; they move rows with `triton`'s plans).
    fused, overlapped = (
        MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN,
                    backends={"prepare": "triton", "transport": "triton", "quantize": "triton"},
                    transport_config=config)
        for config in (TransportConfig(fused_nvfp4_dispatch=True), TransportConfig(overlap=True)))
    mismatches = []
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(SOAK_STEPS):
        tokens = int(torch.randint(0, MAX_TOKENS + 1, (1,), generator=generator))
        ids, weights = make_routing(rank, tokens, NUM_EXPERTS, TOP_K, seed=step,
                                    hot_rank=step % 3 - 1, padding=step % 2 == 1)
        ids, weights = ids.to(device), weights.to(device)
        x = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16).to(device)
        plan = triton.prepare(ids, weights, check_inputs=step % 50 == 0)  # reads the status
        recv, recv_ref = triton.dispatch(x, plan), torch_ref.dispatch(x, plan)
        expert_out = local_experts(recv_ref, plan)
        out, out_ref = triton.combine(expert_out, plan), torch_ref.combine(expert_out, plan)
        same = torch.equal(recv, recv_ref) and torch.equal(out, out_ref)
        if step % 10 == 0:
            global_scale = torch.tensor([448.0 * 6.0 / 8.0], device=device)
            got = triton.dispatch(x, plan, quant="nvfp4", global_scale=global_scale)
            want = torch_ref.dispatch(x, plan, quant="nvfp4", global_scale=global_scale)
            same = same and all(torch.equal(a, b) for a, b in zip(got, want))
            quantized_in_send = fused.dispatch(x, plan, quant="nvfp4", global_scale=global_scale)
            same = same and all(torch.equal(a, b) for a, b in zip(quantized_in_send, want))
        if step % 10 == 5:  # the bf16 dispatch as one launch of send and receive programs
            same = same and torch.equal(overlapped.dispatch(x, plan), recv_ref)
        if not same:
            mismatches.append(step)
    for checked in (triton, fused, overlapped):
        checked.check_transport()
    assert mismatches == [], mismatches
    for a2a in (triton, torch_ref, fused, overlapped):
        a2a.close()


@pytest.mark.parametrize("world_size", RANK_COUNTS)
def test_triton_transport_soak(world_size):
    run_distributed(world_size, _triton_transport_soak_body, cuda=True)


GRAPH_REPLAYS = 100


def _triton_transport_graph_body(rank: int, world_size: int) -> None:
    """prepare + dispatch + combine captured in one CUDA graph, replayed GRAPH_REPLAYS times
    with fresh routing and tokens copied into the captured inputs; every replay's plan,
    received rows and combine equal the torch prepare and transport on the same routing."""
    device = torch.device(torch.accelerator.current_accelerator().type, rank)
    tokens = TOKENS[rank % len(TOKENS)]
    with MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN,
                     backends={"prepare": "triton", "transport": "triton"}) as a2a, \
            MoEAlltoall(None, NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN,
                        backends={"prepare": "torch", "transport": "torch"}) as torch_ref:
        ids, weights = (t.to(device) for t in make_routing(rank, tokens, NUM_EXPERTS, TOP_K,
                                                           seed=21))
        x = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
        plan = a2a.prepare(ids, weights)  # workspaces, compiles
        a2a.combine(local_experts(a2a.dispatch(x, plan), plan), plan)
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            plan = a2a.prepare(ids, weights, check_inputs=False)
            recv = a2a.dispatch(x, plan)
            out = a2a.combine(local_experts(recv, plan), plan)
        generator = torch.Generator().manual_seed(rank)
        for replay in range(GRAPH_REPLAYS):  # each replay is a new call on every rank
            fresh_ids, fresh_weights = make_routing(rank, tokens, NUM_EXPERTS, TOP_K,
                                                    seed=1000 + replay, hot_rank=replay % 3 - 1,
                                                    padding=replay % 2 == 1)
            ids.copy_(fresh_ids)
            weights.copy_(fresh_weights)
            x.copy_(torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize(device)
            want_plan = torch_ref.prepare(ids, weights)
            assert_plans_equal(plan, want_plan)
            want = torch_ref.dispatch(x, want_plan)
            assert torch.equal(recv, want), replay
            assert torch.equal(out, torch_ref.combine(local_experts(want, want_plan),
                                                      want_plan)), replay
        a2a.check_transport()


@pytest.mark.parametrize("world_size", RANK_COUNTS)
def test_triton_transport_in_a_cuda_graph(world_size):
    """One rank (its rows all local copies, flags and counters still used) runs on a 1-GPU
    host; WORLD_SIZE ranks need as many GPUs."""
    run_distributed(world_size, _triton_transport_graph_body, cuda=True)
