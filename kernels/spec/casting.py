"""The bits of a float result: float32 -> output dtype rounded to nearest even, and one
canonical NaN per dtype.

torch alone does not give one NaN: a float32 NaN cast to bf16 is 0xFFFF on CPU's vectorised
path, 0x7FC0 on its scalar path and 0x7FFF on a GPU, and float32 arithmetic keeps the payload
of an input NaN on CPU where a GPU writes 0x7FFFFFFF. Every op that computes floats
(``unpermute_and_reduce``, the dequantizers, ``nvfp4_global_scale``) therefore writes every NaN
as ``CANONICAL_NAN_BITS[dtype]`` (positive, quiet, zero payload) on every face: the torch faces
through :func:`round_to_dtype`, the Triton kernels through ``kernels.casting.round_to``, its
``@triton.jit`` twin. Ops that move bytes (``gather_rows``, the transports) keep them as they
are.
"""

from __future__ import annotations

import torch

# Positive quiet NaN with a zero payload, as the bits of each float output dtype.
CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
# The integer dtype of the same width, to read and write those bits.
BITS_DTYPES = {torch.float32: torch.int32, torch.bfloat16: torch.int16,
               torch.float16: torch.int16}


def round_to_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``values`` -> ``dtype`` (float32, bfloat16 or float16), rounded to nearest even
    (overflow gives +-inf), every NaN written as ``CANONICAL_NAN_BITS[dtype]``. Any other
    dtype (an integer payload of the combine's oracle): torch's cast."""
    out = values.to(dtype)
    if dtype not in CANONICAL_NAN_BITS:
        return out
    bits = out.view(BITS_DTYPES[dtype])
    canonical = torch.full_like(bits, CANONICAL_NAN_BITS[dtype])
    return torch.where(torch.isnan(out), canonical, bits).view(dtype)
