"""float32 -> output dtype rounding inside kernels, shared by the un-permute and the Triton
transport's fused combine (``@triton.jit``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(acc, DTYPE: tl.constexpr):
    """float32 -> DTYPE, round to nearest even. For bf16 the rounding is spelled out on the bits
    (torch's formula, NaN -> 0x7FC0): the GPU's own cast rounds to nearest even too, but
    Triton's interpreter truncates, and both faces must equal the oracle bit for bit."""
    if DTYPE == tl.bfloat16:
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(DTYPE)
