"""The "quantize" stage: NVFP4 / MXFP8 / MXFP4 quantization and scale swizzling, on the backend
``a2a.backends.resolve("quantize", ...)`` picks: "triton" (``kernels.quantize``), "torch"
(``kernels.reference``) or "flashinfer" (the adapters below, imported lazily).

FlashInfer facts the adapters rely on (0.7.2):
- ``fp4_quantize(x, global_scale, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout,
  is_sf_8x4_layout)`` returns (uint8 [M, H/2], uint8 scales [M, H/16] linear or [Mp, Kp]
  swizzled); its kernels do nothing below SM100 (the switch refuses there).
- Its IEEE recipe is chosen by the environment variable FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH,
  read with getenv on every launch (not cached, not at JIT time: both recipes are compiled into
  the same module) and only the exact value "1" counts. The adapter sets it around the call
  (process-wide; not safe against other threads quantizing at the same moment).
- ``mxfp8_quantize(x, is_sf_swizzled_layout=False)`` returns (float8_e4m3fn [M, H], flat uint8
  [M*H/32]); MXFP4 is ``fp4_quantize(sf_vec_size=32, sf_use_ue8m0=True)`` (mxfp4_quantize moves
  the input to the current GPU and defaults to the swizzled layout, so we call fp4_quantize).
- ``block_scale_interleave(sf)`` (alias ``nvfp4_block_scale_interleave``) returns the 128x4
  swizzled bytes flat, [Mp * Kp]; it runs on SM90 too.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from a2a.backends import resolve
from kernels import quantize as triton_quantize
from kernels import reference
from kernels.spec.quant import (MX_BLOCK, NVFP4_BLOCK, check_layout, check_quant_input,
                                check_swizzle_args, swizzled_scale_shape)

STAGE = "quantize"
_FAST_MATH_ENV = "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH"


# ---------------------------------------------------------------------------------------------
# FlashInfer adapters
# ---------------------------------------------------------------------------------------------

def _flashinfer_quantize_nvfp4(x, global_scale, *, layout="linear", fast_math=False):
    import flashinfer

    check_quant_input(x, NVFP4_BLOCK)
    check_layout(layout)
    previous = os.environ.get(_FAST_MATH_ENV)
    os.environ[_FAST_MATH_ENV] = "0" if fast_math else "1"
    try:
        packed, scales = flashinfer.fp4_quantize(
            x, global_scale, sf_vec_size=NVFP4_BLOCK, sf_use_ue8m0=False,
            is_sf_swizzled_layout=layout != "linear", is_sf_8x4_layout=layout == "8x4")
    finally:
        if previous is None:
            del os.environ[_FAST_MATH_ENV]
        else:
            os.environ[_FAST_MATH_ENV] = previous
    shape = swizzled_scale_shape(x.shape[0], x.shape[1] // NVFP4_BLOCK, layout)
    return packed.view(torch.uint8), scales.view(torch.uint8).reshape(shape)


def _flashinfer_quantize_mxfp8(x):
    import flashinfer

    check_quant_input(x, MX_BLOCK)
    values, scales = flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=False)
    return values, scales.view(torch.uint8).reshape(x.shape[0], -1)


def _flashinfer_quantize_mxfp4(x):
    import flashinfer

    check_quant_input(x, MX_BLOCK)
    packed, scales = flashinfer.fp4_quantize(x, None, sf_vec_size=MX_BLOCK,
                                             sf_use_ue8m0=True, is_sf_swizzled_layout=False)
    return packed.view(torch.uint8), scales.view(torch.uint8).reshape(x.shape[0], -1)


def _flashinfer_swizzle_scales(sf, layout):
    import flashinfer

    if layout != "swizzled_128x4":
        raise ValueError(f"FlashInfer's block_scale_interleave makes only the 'swizzled_128x4' "
                         f"layout; got layout={layout!r} (use backend='triton')")
    check_swizzle_args(sf, layout)
    shape = swizzled_scale_shape(sf.shape[0], sf.shape[1], layout)
    return flashinfer.block_scale_interleave(sf).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Stage functions
# ---------------------------------------------------------------------------------------------

def nvfp4_global_scale(x: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """448 * 6 / amax(x) as [1] fp32 (1.0 when amax == 0); x: [M, H] bf16/fp16/fp32.
    FlashInfer has no such kernel: backend="flashinfer" is refused with that reason."""
    chosen = resolve(STAGE, backend, x.device, op="global_scale")
    if chosen == "torch":
        return reference.nvfp4_global_scale(x)
    return triton_quantize.nvfp4_global_scale(x)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, *, layout: str = "linear",
                   fast_math: bool = False, out: Optional[torch.Tensor] = None,
                   out_scales: Optional[torch.Tensor] = None,
                   rows: Optional[torch.Tensor] = None,
                   backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize rows of x. Arguments and returns as ``kernels.quantize.quantize_nvfp4``
    (x [M, H], global_scale [1] fp32, layout, fast_math, out, out_scales, rows);
    returns (packed [M', H/2] uint8, scales uint8 e4m3 in ``layout``). ``out``/``out_scales``/
    ``rows`` are Triton-only; the torch and FlashInfer paths copy into out buffers."""
    chosen = resolve(STAGE, backend, x.device)
    if chosen == "triton":
        return triton_quantize.quantize_nvfp4(x, global_scale, layout=layout,
                                              fast_math=fast_math, out=out,
                                              out_scales=out_scales, rows=rows)
    source = x[rows.long()] if rows is not None else x
    if chosen == "torch":
        packed, scales = reference.quantize_nvfp4(source, global_scale, layout=layout,
                                                  fast_math=fast_math)
    else:
        packed, scales = _flashinfer_quantize_nvfp4(source, global_scale, layout=layout,
                                                    fast_math=fast_math)
    if out is not None:
        packed = out.copy_(packed)
    if out_scales is not None:
        scales = out_scales.copy_(scales)
    return packed, scales


def quantize_mxfp8(x: torch.Tensor, *, backend: Optional[str] = None):
    """x [M, H] -> (float8_e4m3fn [M, H], e8m0 uint8 [M, H/32]); see the reference."""
    chosen = resolve(STAGE, backend, x.device)
    if chosen == "triton":
        return triton_quantize.quantize_mxfp8(x)
    if chosen == "torch":
        return reference.quantize_mxfp8(x)
    return _flashinfer_quantize_mxfp8(x)


def quantize_mxfp4(x: torch.Tensor, *, backend: Optional[str] = None):
    """x [M, H] -> (packed uint8 [M, H/2], e8m0 uint8 [M, H/32]); see the reference."""
    chosen = resolve(STAGE, backend, x.device)
    if chosen == "triton":
        return triton_quantize.quantize_mxfp4(x)
    if chosen == "torch":
        return reference.quantize_mxfp4(x)
    return _flashinfer_quantize_mxfp4(x)


def swizzle_scales(sf: torch.Tensor, layout: str, *,
                   backend: Optional[str] = None) -> torch.Tensor:
    """Linear scales [M, K] uint8 -> [Mp, Kp] uint8 in ``layout`` (padding zero). "flashinfer"
    (block_scale_interleave, 128x4 only) runs on SM90 too: resolved with ``op="swizzle"``."""
    chosen = resolve(STAGE, backend, sf.device, op="swizzle")
    if chosen == "triton":
        return triton_quantize.swizzle_scales(sf, layout)
    if chosen == "torch":
        return reference.swizzle_scales(sf, layout)
    return _flashinfer_swizzle_scales(sf, layout)
