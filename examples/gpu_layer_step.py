"""One MoE layer step on every visible GPU, one process per GPU: DeepSeek-V3 routing, the
Triton prepare and transport, an NVFP4 dispatch, a toy expert compute on the dequantized rows
and the weighted combine, checked against a plain computation of the same layer.

    python examples/gpu_layer_step.py       # from the repository root; 1 GPU or more

NCCL process group, FlashInfer's MNNVL workspaces (one host: no NVLink fabric needed), the
Triton prepare and transport (stores straight into the peers' workspaces). Expert ``e``
multiplies its rows by ``1 + e / 64``; the check compares with
``dequantize(quantize(x))[t] * sum_j weights[t, j] * (1 + ids[t, j] / 64)``.
"""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import a2a
from a2a.permute import gather_rows, permute_by_expert, unpermute_and_reduce
from a2a.quantize import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from a2a.routing import route_topk
from kernels.spec import FLOAT_TOLERANCES

NUM_EXPERTS, TOP_K, TOKENS, HIDDEN = 256, 8, 64, 7168


def expert_scales(expert_ids: torch.Tensor) -> torch.Tensor:
    """The toy experts: expert e scales its rows by 1 + e / 64."""
    return 1.0 + expert_ids.float() / 64


def layer_step(rank: int, world_size: int, port: int) -> None:
    # README begin (the README's "Using it" shows the lines up to "README end")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, device_id=device)
    generator = torch.Generator(device=device).manual_seed(rank)
    logits = torch.randn(TOKENS, NUM_EXPERTS, device=device, generator=generator)
    bias = torch.randn(NUM_EXPERTS, device=device, generator=generator) * 0.1
    x = torch.randn(TOKENS, HIDDEN, device=device, generator=generator).to(torch.bfloat16)

    # DeepSeek-V3 routing: 8 groups of 32 experts, the best 4 groups kept, 8 experts a token.
    ids, weights = route_topk(logits, TOP_K, "deepseek_v3", bias=bias, num_groups=8,
                              topk_groups=4, routed_scaling=2.5, backend="triton")
    # One NVFP4 global scale for the whole batch: the smallest of the ranks' own (the one of
    # the largest |x|), so that a receiver dequantizes every row with the same scale.
    global_scale = nvfp4_global_scale(x, backend="triton")
    dist.all_reduce(global_scale, op=dist.ReduceOp.MIN)

    with a2a.MoEAlltoall(dist.group.WORLD, NUM_EXPERTS, TOP_K, max_tokens_per_rank=TOKENS,
                         hidden_size=HIDDEN,
                         backends={"prepare": "triton", "transport": "triton"}) as ep:
        plan = ep.prepare(ids, weights)
        packed, scales = ep.dispatch(x, plan, quant="nvfp4", global_scale=global_scale)

        # The local experts [first, first + local): received rows in expert-major order,
        # dequantized, scaled by their expert, then each row's weighted sum over its slots.
        local = NUM_EXPERTS // world_size
        order = permute_by_expert(plan.recv_expert_ids, NUM_EXPERTS, first_expert=rank * local,
                                  num_local_experts=local, backend="triton")
        codes, code_scales = gather_rows(packed, order, scales=scales, backend="triton")
        rows = dequantize_nvfp4(codes, code_scales, global_scale, backend="triton")  # [P, H]
        counts, starts = order.expert_counts.tolist(), order.expert_offsets.tolist()
        for e in range(local):
            segment = slice(starts[e], starts[e] + counts[e])
            rows[segment] *= expert_scales(torch.tensor(rank * local + e))
        expert_out = unpermute_and_reduce(rows, order, plan.recv_weights, backend="triton")
        out = ep.combine(expert_out, plan)      # [T, H] float32
        # README end

    own_codes, own_scales = quantize_nvfp4(x, global_scale, backend="triton")
    restored = dequantize_nvfp4(own_codes, own_scales, global_scale, backend="triton")
    expected = restored * (weights * expert_scales(ids)).sum(dim=1, keepdim=True)
    torch.testing.assert_close(out, expected, **FLOAT_TOLERANCES[torch.float32])
    print(f"rank {rank}: {TOKENS} tokens, NVFP4 rows received: {int(plan.total_recv)}; the "
          f"combined output matches the plain computation (max abs error "
          f"{(out - expected).abs().max():.2e})", flush=True)
    dist.destroy_process_group()


def main() -> None:
    world_size = torch.cuda.device_count()
    if world_size == 0:
        raise SystemExit("this example needs a CUDA GPU; examples/cpu_two_ranks.py runs on CPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(layer_step, args=(world_size, port), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
