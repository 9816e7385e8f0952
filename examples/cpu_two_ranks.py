"""One MoE layer step on two ranks of a CPU machine: routing, the all-to-all, a toy expert
compute and the weighted combine, checked against a plain computation of the same layer.

    python examples/cpu_two_ranks.py          # from the repository root; about 20 s

Two processes over gloo, with the torch prepare and transport (torch.distributed collectives).
The single-rank ops (routing, the expert-major permutation, the row gather, the un-permute)
run as Triton kernels in Triton's CPU interpreter. Expert ``e`` multiplies its rows by
``1 + e / 8``, so the layer's output for token t is
``x[t] * sum_j weights[t, j] * (1 + ids[t, j] / 8)``, which the script checks.
"""

import os

# The Triton kernels run on CPU tensors through Triton's interpreter, which must be chosen
# before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import socket  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import a2a  # noqa: E402
from a2a.permute import permute_and_gather, unpermute_and_reduce  # noqa: E402
from a2a.routing import route_topk  # noqa: E402
from kernels.spec import FLOAT_TOLERANCES  # noqa: E402

NUM_EXPERTS, TOP_K, TOKENS, HIDDEN = 16, 4, 6, 64


def expert_scales(expert_ids: torch.Tensor) -> torch.Tensor:
    """The toy experts: expert e scales its rows by 1 + e / 8."""
    return 1.0 + expert_ids.float() / 8


def layer_step(rank: int, world_size: int, port: int) -> None:
    # README begin (the README's "Using it" shows the lines up to "README end")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    generator = torch.Generator().manual_seed(rank)
    logits = torch.randn(TOKENS, NUM_EXPERTS, generator=generator)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)  # float32 rows, moved as they are

    # DeepSeek-V3 routing: 4 groups of 4 experts, the best 2 groups kept, 4 experts a token.
    ids, weights = route_topk(logits, TOP_K, "deepseek_v3", bias=torch.zeros(NUM_EXPERTS),
                              num_groups=4, topk_groups=2, backend="triton")

    with a2a.MoEAlltoall(dist.group.WORLD, NUM_EXPERTS, TOP_K, max_tokens_per_rank=TOKENS,
                         hidden_size=HIDDEN,
                         backends={"prepare": "torch", "transport": "torch"}) as ep:
        plan = ep.prepare(ids, weights)         # AlltoallPlan: who sends which token where
        received = ep.dispatch(x, plan)         # [N*R, H]: the rows whose experts live here

        # The local experts [first, first + local): rows in expert-major order (the
        # permutation and the row gather as one op), the toy expert compute, then each
        # received row's weighted sum over its local slots.
        local = NUM_EXPERTS // world_size
        order, rows = permute_and_gather(plan.recv_expert_ids, received, NUM_EXPERTS,
                                         first_expert=rank * local,
                                         num_local_experts=local, backend="triton")  # [P, H]
        counts = order.expert_counts.tolist()
        starts = order.expert_offsets.tolist()
        for e in range(local):
            segment = slice(starts[e], starts[e] + counts[e])
            rows[segment] *= expert_scales(torch.tensor(rank * local + e))
        expert_out = unpermute_and_reduce(rows, order, plan.recv_weights, backend="triton")

        out = ep.combine(expert_out, plan)      # [T, H]: back to the tokens, summed over k
        # README end

    expected = x * (weights * expert_scales(ids)).sum(dim=1, keepdim=True)
    torch.testing.assert_close(out, expected, **FLOAT_TOLERANCES[torch.float32])
    sent = plan.send_rank_count_cumsum.tolist()
    # One write of the whole line with its newline: the two ranks share stdout, and print()
    # writes the text and the newline separately (unbuffered under .ci/run), so the ranks'
    # lines could run together.
    sys.stdout.write(f"rank {rank}: {TOKENS} tokens, sent {sent[0]} to rank 0 and "
                     f"{sent[1] - sent[0]} to rank 1, received {int(plan.total_recv)} rows; the "
                     f"combined output matches the plain computation (max abs error "
                     f"{(out - expected).abs().max():.2e})\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:  # a free port for the process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(layer_step, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
