"""The Triton transport (a2a/triton_transport/): dispatch and combine by direct stores.

CPU (TRITON_INTERPRET=1): the interpreter runs programs, and ranks, one after another, so a
rank's receive cannot wait for a rank not yet run. Each call is emulated as in
tests/test_triton_prepare_gpu.py: every rank runs the call once with a tiny spin bound (its
sends all land, its waits for later ranks time out) and then again with the same call number
(the counter is set back), now finding every flag set. Results equal
``reference.simulate_dispatch`` / ``simulate_combine`` exactly (bytes; combine through
``sum_over_slots``), over several calls (both parities), R = 2 and 4, skewed routing and a
rank with no tokens.

GPU (marked gpu): R simulated ranks on one GPU (one stream per rank, small grids, warmup
first), 100 calls with fresh routing; CUDA-graph capture and replay (R = 1).
"""

import os

import pytest
import torch

from a2a import triton_transport as tt
from a2a.movement import sum_over_slots
from a2a.config import TransportConfig
from a2a.protocol import TransportTimeout, raise_on_timeout
from kernels import reference as ref
from tests.support import interpreter_with_runtime_loops
from tests.test_reference_prepare import random_routing

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreter emulation (TRITON_INTERPRET=1)")


def skewed_routing(ep_size, num_tokens, top_k, num_experts, generator):
    """Ids that favour the first rank's experts (most rows go to rank 0), 10% padding."""
    bias = torch.zeros(num_experts)
    bias[: num_experts // ep_size] = 3.0
    scores = torch.rand(num_tokens, num_experts, generator=generator) + bias
    ids = scores.topk(top_k, dim=1).indices
    pad = torch.rand(ids.shape, generator=generator) < 0.1
    return torch.where(pad, torch.full_like(ids, num_experts), ids).int()


def make_plans(tokens, top_k, experts, max_tokens, generator, skewed):
    ep_size = len(tokens)
    if skewed:
        ids = [skewed_routing(ep_size, t, top_k, experts, generator) for t in tokens]
    else:
        ids = [random_routing(ep_size, t, top_k, experts, experts, generator) for t in tokens]
    weights = [torch.rand(t, top_k, generator=generator) for t in tokens]
    return ref.simulate_alltoall(ids, weights, experts, max_tokens)


def reference_scattered(expert_out_per_rank, plans):
    """What every transport's combine returns before the reduction: source r's [T_r*k, H]
    zeros with the row returned for each send position at its backward index (the scatter
    step of ``reference.simulate_combine``)."""
    scattered = []
    for source, plan in enumerate(plans):
        rows = torch.zeros((plan.num_tokens * plan.top_k, expert_out_per_rank[0].shape[1]),
                           dtype=expert_out_per_rank[0].dtype,
                           device=expert_out_per_rank[0].device)
        send_start = 0
        for receiver, receiver_plan in enumerate(plans):
            send_end = int(plan.send_rank_count_cumsum[receiver])
            recv_cumsum = receiver_plan.recv_rank_count_cumsum
            recv_start = int(recv_cumsum[source - 1]) if source else 0
            slots = plan.backward_recv_rank_local_indices[send_start:send_end].long()
            rows[slots] = expert_out_per_rank[receiver][recv_start:recv_start + len(slots)]
            send_start = send_end
        scattered.append(rows)
    return scattered


class Ranks:
    """R ranks' transport state: one shared [R, words] workspace per transfer kind (row r =
    rank r's inbox) and a call counter per rank and kind."""

    def __init__(self, ep_size, max_tokens, row_bytes, device):
        words = tt.transport_workspace_bytes(ep_size, max_tokens, row_bytes) // 8
        self.workspace = {kind: torch.zeros((ep_size, words), dtype=torch.int64, device=device)
                          for kind in ("dispatch", "combine")}
        self.counters = {kind: [torch.zeros(1, dtype=torch.int64, device=device)
                                for _ in range(ep_size)] for kind in ("dispatch", "combine")}


def _mover(kind, global_scale=None):
    """The transport call of ``kind``: dispatch, dispatch_nvfp4 (quantizing in the send, with
    ``global_scale``), combine (scattered rows) or combine_fused (bf16 rows reduced over k in
    the receive kernel); each dispatch kind has its own workspace, the combines share one."""
    if kind == "combine_fused":
        return lambda *args, **kwargs: tt.triton_combine(*args, dtype=torch.bfloat16, **kwargs)
    if kind == "dispatch_nvfp4":
        return lambda x, plan, *args, **kwargs: tt.triton_dispatch_nvfp4(
            x, global_scale, plan, *args, **kwargs)
    return tt.triton_dispatch_rows if kind == "dispatch" else tt.triton_combine_rows


def _state_kind(kind):
    return {"combine_fused": "combine", "dispatch_nvfp4": "dispatch"}.get(kind, kind)


def emulate(kind, rows_per_rank, plans, ranks, max_programs, global_scale=None,
            overlap=False):
    """One call of ``kind`` on every rank, emulated in two passes (see the module docstring);
    ``overlap``: ``TransportConfig.overlap``."""
    move = _mover(kind, global_scale)
    kind = _state_kind(kind)
    counters = ranks.counters[kind]
    start = [int(c) for c in counters]
    for spins, check in ((2, False), (1000, True)):
        outs = []
        for rank, plan in enumerate(plans):
            counters[rank].fill_(start[rank])
            outs.append(move(rows_per_rank[rank], plan, ranks.workspace[kind],
                             call_counter=counters[rank], check=check,
                             config=TransportConfig(timeout_spins=spins, overlap=overlap,
                                                    max_programs=max_programs)))
    assert [int(c) for c in counters] == [s + 1 for s in start]
    return outs


@interpreted
@pytest.mark.parametrize("tokens,top_k,experts,max_tokens,hidden,skewed,max_programs", [
    ([5, 0], 2, 4, 6, 8, False, 2),              # a rank with no tokens, C = 1
    ([7, 9], 4, 8, 9, 24, True, 8),              # skewed, C = 4 chunks per pair
    ([6, 0, 3, 8], 3, 8, 8, 16, True, 8),        # R = 4, k not a power of two, C = 2
    ([4, 5, 1, 6], 8, 16, 6, 8, False, 4),       # R = 4, k = 8 (3+ rows summed), C = 1
])
@pytest.mark.parametrize("overlap", [False, True], ids=["two_kernels", "overlap"])
def test_dispatch_and_combine_emulated_on_cpu(monkeypatch, tokens, top_k, experts, max_tokens,
                                              hidden, skewed, max_programs, overlap):
    """Row transfers (and the fused combine, which has one form); ``overlap``: the send and
    receive programs in one launch (TransportConfig.overlap)."""
    interpreter_with_runtime_loops(monkeypatch)
    ep_size = len(tokens)
    generator = torch.Generator().manual_seed(sum(tokens) * 10 + ep_size)
    row_bytes = hidden * 2  # bf16 rows
    ranks = Ranks(ep_size, max_tokens, row_bytes, "cpu")
    for call in range(3):  # three calls: both parities, and parity 0 reused
        plans = make_plans(tokens, top_k, experts, max_tokens, generator, skewed)
        xs = [torch.randn(t, hidden, generator=generator).to(torch.bfloat16) for t in tokens]
        got = emulate("dispatch", [x.view(torch.uint8) for x in xs], plans, ranks, max_programs,
                      overlap=overlap)
        want = ref.simulate_dispatch(xs, plans)
        for rank in range(ep_size):
            assert got[rank].shape == (max_tokens * ep_size, row_bytes)
            assert torch.equal(got[rank].view(torch.bfloat16), want[rank]), (call, rank)

        # Combine: rows past total_recv hold NaN, which must not be read.
        outs = []
        for rank in range(ep_size):
            out = torch.randn(max_tokens * ep_size, hidden, generator=generator)
            out[int(plans[rank].total_recv):] = float("nan")
            outs.append(out.to(torch.bfloat16))
        scattered = emulate("combine", [o.view(torch.uint8) for o in outs], plans, ranks,
                            max_programs, overlap=overlap)
        want = ref.simulate_combine(outs, plans)
        want_scattered = reference_scattered(outs, plans)
        for rank in range(ep_size):
            assert scattered[rank].shape == (tokens[rank] * top_k, row_bytes)
            assert torch.equal(scattered[rank], want_scattered[rank].view(torch.uint8))
            combined = sum_over_slots(scattered[rank].view(torch.bfloat16), tokens[rank], top_k)
            assert torch.equal(combined, want[rank]), (call, rank)
            # Invariant: a slot row is nonzero only where the plan scatters a returned row.
            total = int(plans[rank].total_send)
            hit = torch.zeros(tokens[rank] * top_k, dtype=torch.bool)
            hit[plans[rank].backward_recv_rank_local_indices[:total].long()] = True
            assert not scattered[rank][~hit].any()
        # The fused combine (reduction in the receive kernel): the same sums, bit for bit.
        fused = emulate("combine_fused", [o.view(torch.uint8) for o in outs], plans, ranks,
                        max_programs)
        for rank in range(ep_size):
            assert fused[rank].dtype == torch.bfloat16
            assert torch.equal(fused[rank], want[rank]), (call, rank)


@interpreted
def test_nvfp4_payload_moves_bit_exactly_on_cpu(monkeypatch):
    """Packed codes and scale bytes (rows of 16 bytes) move unchanged."""
    interpreter_with_runtime_loops(monkeypatch)
    tokens, top_k, experts, max_tokens, hidden = [6, 4], 2, 4, 6, 256
    generator = torch.Generator().manual_seed(9)
    plans = make_plans(tokens, top_k, experts, max_tokens, generator, False)
    xs = [torch.randn(t, hidden, generator=generator) for t in tokens]
    amax = max(float(x.abs().max()) for x in xs)
    global_scale = torch.tensor([448.0 * 6.0 / amax])
    quantized = [ref.quantize_nvfp4(x, global_scale) for x in xs]
    for part in (0, 1):  # packed [T, H/2], scales [T, H/16]
        rows = [q[part].view(torch.uint8) for q in quantized]
        ranks = Ranks(2, max_tokens, rows[0].shape[1], "cpu")
        got = emulate("dispatch", rows, plans, ranks, max_programs=2)
        want = ref.simulate_dispatch(rows, plans)
        for rank in range(2):
            assert torch.equal(got[rank], want[rank]), (part, rank)


def _nvfp4_want(xs, plans, global_scale):
    """What the fused NVFP4 dispatch must deliver: the reference quantization (IEEE recipe,
    linear scales) of the rows a plain dispatch delivers (zero rows quantize to zeros)."""
    return [ref.quantize_nvfp4(rows, global_scale.to(rows.device))
            for rows in ref.simulate_dispatch(xs, plans)]


@interpreted
@pytest.mark.parametrize("tokens,hidden,skewed,dtype", [
    ([6, 4], 256, False, torch.bfloat16), ([5, 0, 7, 3], 192, True, torch.float16),
    ([3, 4], 64, False, torch.float32)])
def test_fused_nvfp4_dispatch_on_cpu(monkeypatch, tokens, hidden, skewed, dtype):
    """Quantizing in the send kernel delivers, bit for bit, the reference quantization of what
    a plain dispatch delivers, over calls of both parities (H = 192: a partial block tile)."""
    interpreter_with_runtime_loops(monkeypatch)
    max_tokens, top_k, experts = 8, 2, 8
    generator = torch.Generator().manual_seed(hidden + len(tokens))
    ranks = Ranks(len(tokens), max_tokens, tt.nvfp4_row_bytes(hidden), "cpu")
    for call in range(3):
        plans = make_plans(tokens, top_k, experts, max_tokens, generator, skewed)
        xs = [(torch.randn(t, hidden, generator=generator) * 4).to(dtype) for t in tokens]
        amax = max([float(x.float().abs().max()) for x in xs if x.numel()] + [1.0])
        global_scale = torch.tensor([448.0 * 6.0 / amax])
        got = emulate("dispatch_nvfp4", xs, plans, ranks, 2, global_scale)
        for rank, (packed, scales) in enumerate(_nvfp4_want(xs, plans, global_scale)):
            assert torch.equal(got[rank][0], packed), (call, rank)
            assert torch.equal(got[rank][1], scales), (call, rank)


def test_fused_nvfp4_dispatch_bad_inputs_raise():
    generator = torch.Generator().manual_seed(5)
    plan = make_plans([3, 2], 2, 4, 4, generator, False)[0]
    ranks = Ranks(2, 4, tt.nvfp4_row_bytes(128), "cpu")
    args = dict(call_counter=ranks.counters["dispatch"][0])
    gs = torch.ones(1)
    with pytest.raises(ValueError, match="H % 64 == 0"):
        tt.triton_dispatch_nvfp4(torch.zeros(3, 96), gs, plan, ranks.workspace["dispatch"],
                                 **args)
    with pytest.raises(ValueError, match="expected plan.num_tokens=3"):
        tt.triton_dispatch_nvfp4(torch.zeros(2, 128), gs, plan, ranks.workspace["dispatch"],
                                 **args)
    with pytest.raises(TypeError):
        tt.triton_dispatch_nvfp4(torch.zeros(3, 128, dtype=torch.int32), gs, plan,
                                 ranks.workspace["dispatch"], **args)
    with pytest.raises(ValueError, match="global_scale"):
        tt.triton_dispatch_nvfp4(torch.zeros(3, 128), torch.ones(2), plan,
                                 ranks.workspace["dispatch"], **args)
    small = Ranks(2, 4, 16, "cpu").workspace["dispatch"]  # sized for 16-byte rows
    with pytest.raises(ValueError, match="workspace must be"):
        tt.triton_dispatch_nvfp4(torch.zeros(3, 128), gs, plan, small, **args)
    assert tt.nvfp4_row_bytes(7168) == 4032 and tt.nvfp4_row_bytes(64) == 48


@interpreted
def test_missing_rank_times_out_and_is_named(monkeypatch):
    interpreter_with_runtime_loops(monkeypatch)
    generator = torch.Generator().manual_seed(4)
    plans = make_plans([3, 3], 2, 4, 4, generator, False)
    ranks = Ranks(2, 4, 16, "cpu")
    rows = torch.zeros((3, 16), dtype=torch.uint8)
    status = torch.zeros(2, dtype=torch.int64)
    tt.triton_dispatch_rows(rows, plans[0], ranks.workspace["dispatch"],
                            call_counter=ranks.counters["dispatch"][0], status=status,
                            check=False, config=TransportConfig(timeout_spins=3, max_programs=2))
    assert status.tolist() == [0, 1]  # rank 1 never came: source 1 timed out in call 0 (+1)
    with pytest.raises(TransportTimeout, match=r"source rank\(s\) \[1\]"):
        raise_on_timeout(status, 0, "transport")


def test_bad_inputs_raise():
    generator = torch.Generator().manual_seed(2)
    plans = make_plans([3, 2], 2, 4, 4, generator, False)
    ranks = Ranks(2, 4, 16, "cpu")
    counter = ranks.counters["dispatch"][0]
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        tt.triton_dispatch_rows(torch.zeros((3, 24), dtype=torch.uint8), plans[0],
                                ranks.workspace["dispatch"], call_counter=counter)
    with pytest.raises(ValueError, match="transport_workspace_bytes"):
        tt.triton_dispatch_rows(torch.zeros((3, 32), dtype=torch.uint8), plans[0],
                                ranks.workspace["dispatch"], call_counter=counter)
    with pytest.raises(ValueError, match="expected 3"):
        tt.triton_dispatch_rows(torch.zeros((2, 16), dtype=torch.uint8), plans[0],
                                ranks.workspace["dispatch"], call_counter=counter)
    with pytest.raises(TypeError, match="uint8"):
        tt.triton_dispatch_rows(torch.zeros((3, 8), dtype=torch.bfloat16), plans[0],
                                ranks.workspace["dispatch"], call_counter=counter)
    with pytest.raises(ValueError, match="expected 8"):
        tt.triton_combine_rows(torch.zeros((3, 16), dtype=torch.uint8), plans[0],
                               ranks.workspace["combine"], call_counter=counter)
    assert int(ranks.workspace["dispatch"].abs().sum()) == 0  # nothing was sent
    assert int(counter) == 0


def test_configs_are_frozen_and_checked():
    from a2a.config import PrepareConfig
    config = TransportConfig()
    assert not config.overlap and not config.fused_nvfp4_dispatch
    assert config.max_programs == 256
    assert config.nvfp4_launch.tile_elements == 8192 and config.nvfp4_launch.ptx is None
    assert PrepareConfig().max_programs == 128
    with pytest.raises(AttributeError):
        config.overlap = True  # frozen: a knob is chosen at construction
    for bad in (dict(max_programs=0), dict(timeout_spins=-1), dict(max_programs=2.5)):
        with pytest.raises(ValueError, match="must be an int"):
            TransportConfig(**bad)
        with pytest.raises(ValueError, match="must be an int"):
            PrepareConfig(**bad)


def test_workspace_size():
    # flags [R, MAX_CHUNKS] int64 and the arrivals word padded to 128 bytes, then [R][2][N][B]
    # rows, rounded to 128.
    assert tt.transport_workspace_bytes(2, 5, 48) == (2 * 64 * 8 + 128) + 2 * 2 * 5 * 48 + 64
    assert tt.transport_workspace_bytes(8, 1024, 14336) % 128 == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        tt.transport_workspace_bytes(2, 5, 40)


# ---------------------------------------------------------------------------------------------
# GPU: simulated ranks on one GPU
# ---------------------------------------------------------------------------------------------

def simulate_ranks(kind, rows_per_rank, plans, ranks, statuses, max_programs,
                   global_scale=None, overlap=False):
    """Launch every rank's transfer on its own stream (check=False); return after a sync."""
    config = TransportConfig(timeout_spins=1 << 24, max_programs=max_programs, overlap=overlap)
    move = _mover(kind, global_scale)
    kind = _state_kind(kind)
    streams = [torch.cuda.Stream() for _ in plans]
    current = torch.cuda.current_stream()
    outs = [None] * len(plans)
    for rank, plan in enumerate(plans):
        streams[rank].wait_stream(current)  # inputs were made on the current stream
        with torch.cuda.stream(streams[rank]):
            outs[rank] = move(rows_per_rank[rank], plan, ranks.workspace[kind],
                              call_counter=ranks.counters[kind][rank], status=statuses[rank],
                              check=False, config=config)
    torch.cuda.synchronize()
    return outs


GPU_CASES = [  # (R, N, k, E, H, max_programs): R * R * C spinning programs at most 128
    (2, 300, 8, 16, 512, 8),
    (4, 128, 8, 32, 7168, 8),
    (8, 64, 8, 64, 256, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("ep_size,max_tokens,top_k,experts,hidden,max_programs", GPU_CASES)
@pytest.mark.parametrize("overlap", [False, True], ids=["two_kernels", "overlap"])
def test_simulated_ranks_equal_reference_over_100_calls(device, ep_size, max_tokens, top_k,
                                                        experts, hidden, max_programs, overlap):
    generator = torch.Generator().manual_seed(ep_size * 100 + hidden)
    row_bytes = hidden * 2
    tt.warmup_transport(device, ep_size=ep_size, max_tokens_per_rank=max_tokens,
                        row_bytes=row_bytes, top_k=top_k,
                        config=TransportConfig(max_programs=max_programs, overlap=overlap))
    ranks = Ranks(ep_size, max_tokens, row_bytes, device)
    statuses = [torch.zeros(ep_size, dtype=torch.int64, device=device) for _ in range(ep_size)]
    for call in range(100):  # fresh routing every call
        tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=generator))
                  if call % 3 == 1 else max_tokens for _ in range(ep_size)]
        plans = [_plan_to(p, device) for p in
                 make_plans(tokens, top_k, experts, max_tokens, generator, call % 2 == 1)]
        xs = [torch.randn(t, hidden, generator=generator).to(torch.bfloat16).to(device)
              for t in tokens]
        got = simulate_ranks("dispatch", [x.view(torch.uint8) for x in xs], plans, ranks,
                             statuses, max_programs, overlap=overlap)
        want = ref.simulate_dispatch(xs, plans)
        outs = [torch.randn(max_tokens * ep_size, hidden, generator=generator)
                .to(torch.bfloat16).to(device) for _ in range(ep_size)]
        scattered = simulate_ranks("combine", [o.view(torch.uint8) for o in outs], plans, ranks,
                                   statuses, max_programs, overlap=overlap)
        combined_want = ref.simulate_combine(outs, plans)
        want_scattered = reference_scattered(outs, plans)
        for rank in range(ep_size):
            assert int(statuses[rank].max()) == 0, (call, rank, statuses[rank])
            assert torch.equal(got[rank].view(torch.bfloat16), want[rank]), (call, rank)
            # The scattered rows equal the other transports' bit for bit, so the combine
            # (sum_over_slots, shared by all transports) is bit-identical too.
            assert torch.equal(scattered[rank], want_scattered[rank].view(torch.uint8))
            combined = sum_over_slots(scattered[rank].view(torch.bfloat16), tokens[rank], top_k)
            assert torch.equal(combined, combined_want[rank].to(device)), (call, rank)
        fused = simulate_ranks("combine_fused", [o.view(torch.uint8) for o in outs], plans,
                               ranks, statuses, max_programs)
        for rank in range(ep_size):
            assert int(statuses[rank].max()) == 0, (call, rank, statuses[rank])
            assert torch.equal(fused[rank], combined_want[rank].to(device)), (call, rank)


@pytest.mark.gpu
@pytest.mark.parametrize("ep_size,max_tokens,hidden,max_programs",
                         [(2, 300, 7168, 8), (4, 64, 192, 8)])
def test_simulated_ranks_fused_nvfp4_dispatch(device, ep_size, max_tokens, hidden,
                                              max_programs):
    """The quantizing send on one GPU, R simulated ranks, 20 calls with fresh routing: the
    reference quantization of what a plain dispatch delivers, bit for bit."""
    top_k, experts = 8, 8 * ep_size
    generator = torch.Generator().manual_seed(ep_size + hidden)
    row_bytes = tt.nvfp4_row_bytes(hidden)
    ranks = Ranks(ep_size, max_tokens, row_bytes, device)
    statuses = [torch.zeros(ep_size, dtype=torch.int64, device=device) for _ in range(ep_size)]
    global_scale = torch.tensor([448.0 * 6.0 / 16.0], device=device)
    warm = Ranks(1, max_tokens, row_bytes, device)  # compile first: simulated ranks spin
    plan = _plan_to(make_plans([4], top_k, experts, max_tokens, generator, False)[0], device)
    tt.triton_dispatch_nvfp4(torch.zeros(4, hidden, dtype=torch.bfloat16, device=device),
                             global_scale, plan, warm.workspace["dispatch"],
                             call_counter=warm.counters["dispatch"][0],
                             config=TransportConfig(max_programs=1))
    for call in range(20):
        tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=generator))
                  for _ in range(ep_size)]
        plans = [_plan_to(p, device) for p in
                 make_plans(tokens, top_k, experts, max_tokens, generator, call % 2 == 1)]
        xs = [(torch.randn(t, hidden, generator=generator) * 4).to(torch.bfloat16).to(device)
              for t in tokens]
        got = simulate_ranks("dispatch_nvfp4", xs, plans, ranks, statuses, max_programs,
                             global_scale)
        for rank, (packed, scales) in enumerate(_nvfp4_want(xs, plans, global_scale)):
            assert int(statuses[rank].max()) == 0, (call, rank, statuses[rank])
            assert torch.equal(got[rank][0], packed), (call, rank)
            assert torch.equal(got[rank][1], scales), (call, rank)


def _plan_to(plan, device):
    import dataclasses
    fields = {name: t.to(device) for name, t in plan.tensors().items() if t is not None}
    return dataclasses.replace(plan, **fields)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(device):
    """check=False has no host sync: one rank (R = 1) captures dispatch + combine in a CUDA
    graph; every replay is a new call (the device counter advances, parities alternate)."""
    max_tokens, top_k, experts, hidden = 64, 4, 8, 256
    row_bytes = hidden * 2
    generator = torch.Generator().manual_seed(6)
    tt.warmup_transport(device, ep_size=1, max_tokens_per_rank=max_tokens, row_bytes=row_bytes,
                        top_k=top_k)
    plan = _plan_to(make_plans([max_tokens], top_k, experts, max_tokens, generator, False)[0],
                    device)
    ranks = Ranks(1, max_tokens, row_bytes, device)
    status = torch.zeros(1, dtype=torch.int64, device=device)
    x = torch.empty(max_tokens, hidden, dtype=torch.bfloat16, device=device)
    expert_out = torch.empty(max_tokens, hidden, dtype=torch.bfloat16, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        recv = tt.triton_dispatch_rows(x.view(torch.uint8), plan, ranks.workspace["dispatch"],
                                       call_counter=ranks.counters["dispatch"][0],
                                       status=status, check=False)
        scattered = tt.triton_combine_rows(expert_out.view(torch.uint8), plan,
                                           ranks.workspace["combine"],
                                           call_counter=ranks.counters["combine"][0],
                                           status=status, check=False)
        fused = tt.triton_combine(expert_out.view(torch.uint8), plan,
                                  ranks.workspace["combine"], dtype=torch.bfloat16,
                                  call_counter=ranks.counters["combine"][0], status=status,
                                  check=False)
    for replay in range(5):
        x.copy_(torch.randn(max_tokens, hidden, generator=generator).to(torch.bfloat16))
        expert_out.copy_(torch.randn(max_tokens, hidden, generator=generator)
                         .to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(recv.view(torch.bfloat16), ref.simulate_dispatch([x], [plan])[0])
        assert torch.equal(scattered, reference_scattered([expert_out], [plan])[0]
                           .view(torch.uint8))
        assert torch.equal(fused, ref.simulate_combine([expert_out.cpu()], [_plan_to(
            plan, "cpu")])[0].to(device))
        assert int(ranks.counters["dispatch"][0]) == replay + 1
        assert int(ranks.counters["combine"][0]) == 2 * (replay + 1)
    assert status.tolist() == [0]


def test_switch_rule_needs_a_cuda_device():
    from a2a.backends import BackendUnavailable, resolve
    assert resolve("transport", "triton", torch.device("cuda", 0)) == "triton"
    with pytest.raises(BackendUnavailable, match="peer-mapped .* needs a CUDA device"):
        resolve("transport", "triton", torch.device("cpu"))
