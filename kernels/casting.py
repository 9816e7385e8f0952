"""float32 -> output dtype rounding inside kernels, shared by the un-permute, the dequantizers,
the global scale and the Triton transport's fused combine (``@triton.jit``): the twin of
``kernels.spec.casting.round_to_dtype``, bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.spec.casting import CANONICAL_NAN_BITS

# The canonical NaNs (kernels.spec.casting) as constexprs: a jit function reads only those.
NAN_F32 = tl.constexpr(CANONICAL_NAN_BITS[torch.float32])
NAN_BF16 = tl.constexpr(CANONICAL_NAN_BITS[torch.bfloat16])
NAN_F16 = tl.constexpr(CANONICAL_NAN_BITS[torch.float16])


@triton.jit
def round_to(acc, DTYPE: tl.constexpr):
    """float32 -> DTYPE (float32, bfloat16 or float16), round to nearest even, every NaN
    written as the canonical NaN of DTYPE (a GPU's own NaN is 0x7FFFFFFF, the interpreter
    keeps the payload). For bf16 the rounding is spelled out on the bits (torch's formula):
    the GPU's own cast rounds to nearest even too, but Triton's interpreter truncates, and both
    must equal the oracle bit for bit."""
    bits = acc.to(tl.uint32, bitcast=True)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if DTYPE == tl.bfloat16:
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(nan, NAN_BF16, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float16:
        rounded = acc.to(tl.float16).to(tl.uint16, bitcast=True)
        return tl.where(nan, NAN_F16, rounded).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return tl.where(nan, NAN_F32, bits).to(tl.float32, bitcast=True)
