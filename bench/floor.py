"""Yardsticks that ``python -m bench.tune`` times beside the kernels: what the same launches
and memory traffic cost without the kernels' arithmetic.

NVFP4: the memory traffic of a quantization without its arithmetic (``--only nvfp4``).

``nvfp4_traffic(x)`` reads a [M, H] bf16/fp16 tensor the way ``kernels.quantize`` does (16-byte
loads, one 16-element block per thread and tile) and writes what NVFP4 writes: 8 bytes per
block (the xor of the block's two halves, truncated) and one byte per block, so it moves
exactly 2.5625 * M * H bytes, the 8-byte stores with the L2 eviction priority of the variant
(the quantizer's is ``kernels.quantize.NVFP4Launch.store_policy``). Its best time is what the
quantizer could reach if its arithmetic were free; the result is meaningless data.

Routing (``--only routing``): ``empty_launch`` (one program, one warp, one store) and
``row_ids`` (routing's launch shape, one warp per row: load the row, store k ids), the launch
floor of a routing kernel replayed in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hardware import can_run_ptx
from kernels.quantize_details.words import store_bytes

# (rows per tile, warps, tiles per program along a row, L2 eviction priority of the 8-byte
# stores): one 16-element block per thread
FLOOR_VARIANTS = ((2, 4, 7, "evict_last"), (2, 4, 7, ""), (2, 4, 1, "evict_last"),
                  (4, 8, 1, "evict_last"), (1, 2, 7, "evict_last"))


@triton.jit
def _traffic_kernel(x_ptr, out_ptr, scales_ptr, num_rows, hidden,
                    BLOCK_ROWS: tl.constexpr, BLOCKS: tl.constexpr, STEPS: tl.constexpr,
                    ASM: tl.constexpr, STORE_POLICY: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    num_blocks = hidden // 16
    row_ok = rows < num_rows
    in_ptrs = x_ptr + rows.to(tl.int64) * (hidden // 2)  # int32 words of 2 elements
    out_ptrs = out_ptr + rows.to(tl.int64) * (hidden // 4)  # int16: 4 per block
    for step in tl.static_range(STEPS):
        blocks = (tl.program_id(1) * STEPS + step) * BLOCKS + tl.arange(0, BLOCKS)
        mask = row_ok[:, None, None] & (blocks < num_blocks)[None, :, None]
        words = (blocks * 8)[None, :, None] + tl.arange(0, 4)[None, None, :]
        lo = tl.load(in_ptrs[:, None, None] + words, mask=mask, other=0)
        hi = tl.load(in_ptrs[:, None, None] + words + 4, mask=mask, other=0)
        mixed = lo ^ hi
        tl.store(out_ptrs[:, None, None] + (blocks * 4)[None, :, None]
                 + tl.arange(0, 4)[None, None, :], mixed.to(tl.int16), mask=mask,
                 eviction_policy=STORE_POLICY)
        store_bytes(scales_ptr + rows[:, None] * num_blocks + blocks[None, :],
                    tl.max(mixed, axis=2), row_ok[:, None] & (blocks < num_blocks)[None, :],
                    ASM)


def nvfp4_traffic(x: torch.Tensor, variant: tuple = FLOOR_VARIANTS[0]):
    """(out [M, H/2] uint8, scales [M, H/16] uint8) of meaningless bytes, moving NVFP4's
    traffic; ``variant`` = (rows per tile, warps, tiles per program, store policy) from
    FLOOR_VARIANTS."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or x.shape[1] % 64:
        raise ValueError("nvfp4_traffic takes a 2-D bf16/fp16 tensor with H % 64 == 0")
    x = x.contiguous()
    num_rows, hidden = x.shape
    block_rows, warps, steps, policy = variant
    blocks = 32 * warps // block_rows  # one block per thread
    out = torch.empty(num_rows, hidden // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_rows, hidden // 16, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(num_rows, block_rows),
            triton.cdiv(triton.cdiv(hidden // 16, blocks), steps))
    _traffic_kernel[grid](x.view(torch.int32), out.view(torch.int16), scales, num_rows, hidden,
                          BLOCK_ROWS=block_rows, BLOCKS=blocks, STEPS=steps,
                          ASM=can_run_ptx(x.device), STORE_POLICY=policy, num_warps=warps)
    return out, scales


# The launch floor of the routing kernel (``python -m bench.tune --only routing`` times it
# beside the kernel, CUDA-graph replayed the same way): a graph of back-to-back launches of a
# kernel that does (almost) nothing, and of one that does a routing program's unavoidable
# part, load a row of logits and store k ids, one row per program. Their times bound what any
# routing kernel of that launch shape can reach; the rest is the kernel's own chain.
@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr, 0)


@triton.jit
def _row_ids_kernel(logits_ptr, ids_ptr, stride_token, EXPERTS: tl.constexpr,
                    TOP_K: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_token + tl.arange(0, EXPERTS))
    # one int32 warp reduction, so that every id depends on the whole row
    top = tl.max(x.to(tl.int32, bitcast=True), axis=0)
    tl.store(ids_ptr + row.to(tl.int64) * TOP_K + tl.arange(0, TOP_K), top + tl.arange(0, TOP_K))


def empty_launch(device: torch.device):
    """A call that launches one program of one warp storing one int32 (into a buffer made
    once): the time of a launch that does nothing."""
    out = torch.empty(1, dtype=torch.int32, device=device)

    def call():
        _empty_kernel[(1,)](out, num_warps=1)
        return (out,)
    return call


def row_ids(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, k] int32 of meaningless ids: one program of one warp per row of ``logits`` [T, E]
    (float32, E a power of two, contiguous rows; k a power of two) loads the row and stores k
    ids that depend on it through one int32 max (routing's launch shape, without the
    routing)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 \
            or logits.shape[1] & (logits.shape[1] - 1) or top_k < 1 or top_k & (top_k - 1):
        raise ValueError(f"row_ids takes float32 logits [T, E] with E a power of two and "
                         f"contiguous rows, and a power-of-two top_k; got "
                         f"{logits.dtype} {tuple(logits.shape)}, top_k={top_k}")
    num_tokens, num_experts = logits.shape
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        _row_ids_kernel[(num_tokens,)](logits, ids, logits.stride(0), EXPERTS=num_experts,
                                       TOP_K=top_k, num_warps=1)
    return ids
