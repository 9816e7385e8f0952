"""The memory traffic of an NVFP4 quantization without its arithmetic: a yardstick for the
quantize kernel (``python -m bench.tune --only nvfp4`` times it beside the kernel).

``nvfp4_traffic(x)`` reads a [M, H] bf16/fp16 tensor the way ``kernels.quantize`` does (16-byte
loads, one 16-element block per thread and tile) and writes what NVFP4 writes: 8 bytes per
block (the xor of the block's two halves, truncated) and one byte per block, so it moves
exactly 2.5625 * M * H bytes, the 8-byte stores with the L2 eviction priority of the variant
(the quantizer's is ``kernels.quantize.NVFP4Launch.store_policy``). Its best time is what the
quantizer could reach if its arithmetic were free; the result is meaningless data.
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
