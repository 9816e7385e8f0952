"""The "quantize" stage: NVFP4 / MXFP8 / MXFP4 quantization, dequantization and the scale
layouts, on the backend ``a2a.backends.resolve("quantize", ...)`` picks: "triton"
(``kernels.quantize``), "torch" (``kernels.reference``) or "flashinfer" (the adapters below,
imported lazily; FlashInfer has no dequantizer, no global-scale op and no unswizzle).

FlashInfer facts the adapters rely on (0.7.2):
- ``fp4_quantize(x, global_scale, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout,
  is_sf_8x4_layout)`` returns (uint8 [M, H/2], uint8 scales [M, H/16] linear or [Mp, Kp]
  swizzled); its kernels do nothing below SM100 (the switch refuses there). It takes
  bf16/fp16 (and fp8) input, not float32, and reads a column-major input (stride(-2) == 1) as
  its transpose: the adapters refuse float32 and pass a contiguous x. It has no ``rows`` and
  no ``out`` buffers: the adapter gathers rows with ``kernels.gather.gather_rows`` (a row
  outside [0, M) is a zero row, as on every face) and copies into the checked buffers.
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

import dataclasses
import os
from typing import Optional

import torch

from a2a.backends import resolve
from kernels import quantize as triton_quantize
from kernels import reference
from kernels.spec.quant import (MX_BLOCK, NVFP4_BLOCK, check_quant_input,
                                check_quantize_nvfp4_args, check_quantize_nvfp4_values,
                                check_swizzle_args, swizzled_scale_shape)
from kernels.spec.tensors import check_tensor

STAGE = "quantize"
_FAST_MATH_ENV = "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH"
# The input dtypes FlashInfer's fp4_quantize / mxfp8_quantize take (not float32).
FLASHINFER_INPUT_DTYPES = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# FlashInfer adapters: the shared checks of kernels.spec first (the same errors as the other
# faces), then FlashInfer's call on a contiguous input (it reads a column-major input as its
# transpose), its results reshaped to the shared contract.
# ---------------------------------------------------------------------------------------------

def _flashinfer_input(x: torch.Tensor) -> torch.Tensor:
    """x as FlashInfer's quantizers take it: bf16/fp16 (it has no float32 path: refused, with
    the faces that take it), contiguous."""
    if x.dtype not in FLASHINFER_INPUT_DTYPES:
        raise TypeError(f"FlashInfer's quantizers take bfloat16 or float16 x, got "
                        f"{str(x.dtype).replace('torch.', '')}; use backend='triton' or "
                        f"'torch' for it")
    return x.contiguous()


def _flashinfer_quantize_nvfp4(x, global_scale, *, layout="linear", fast_math=False, out=None,
                               out_scales=None, rows=None, check_values=True):
    import flashinfer

    from kernels.gather import gather_rows

    check_quantize_nvfp4_args(x, global_scale, layout, out, out_scales, rows)
    if check_values:
        check_quantize_nvfp4_values(global_scale, rows, x.shape[0])
    if rows is not None:  # checked above: a row outside [0, M) is a zero row, as everywhere
        x = gather_rows(x, rows, check_values=False)
    x = _flashinfer_input(x)
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
    packed, scales = packed.view(torch.uint8), scales.view(torch.uint8).reshape(shape)
    # out / out_scales have exactly these shapes and dtypes (checked): a plain byte copy
    if out is not None:
        packed = out.copy_(packed)
    if out_scales is not None:
        scales = out_scales.copy_(scales)
    return packed, scales


def _flashinfer_quantize_mxfp8(x):
    import flashinfer

    check_quant_input(x, MX_BLOCK)
    values, scales = flashinfer.mxfp8_quantize(_flashinfer_input(x), is_sf_swizzled_layout=False)
    return values, scales.view(torch.uint8).reshape(x.shape[0], -1)


def _flashinfer_quantize_mxfp4(x):
    import flashinfer

    check_quant_input(x, MX_BLOCK)
    packed, scales = flashinfer.fp4_quantize(_flashinfer_input(x), None, sf_vec_size=MX_BLOCK,
                                             sf_use_ue8m0=True, is_sf_swizzled_layout=False)
    return packed.view(torch.uint8), scales.view(torch.uint8).reshape(x.shape[0], -1)


def _flashinfer_swizzle_scales(sf, layout):
    import flashinfer

    check_swizzle_args(sf, layout)
    if layout != "swizzled_128x4":
        raise ValueError(f"FlashInfer's block_scale_interleave makes only the 'swizzled_128x4' "
                         f"layout; got layout={layout!r} (use backend='triton' or 'torch')")
    shape = swizzled_scale_shape(sf.shape[0], sf.shape[1], layout)
    return flashinfer.block_scale_interleave(sf.contiguous()).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Stage functions: resolve the backend, then call that face with every argument as given (the
# face does the shared checks; nothing is converted or emulated here).
# ---------------------------------------------------------------------------------------------

def _device(name: str, tensor: torch.Tensor) -> torch.device:
    check_tensor(name, tensor)  # the faces' TypeError for a non-tensor, before resolving
    return tensor.device


def nvfp4_global_scale(x: torch.Tensor, *, overlap_previous: bool = False,
                       backend: Optional[str] = None) -> torch.Tensor:
    """448 * 6 / amax(x) as [1] fp32 (1.0 when amax == 0); x: [M, H] bf16/fp16/fp32, any
    strides. overlap_previous: the caller's promise that the kernel launched just before this
    call on its stream did not write x; on "triton" with PDL (SM90+) the amax pass then reads
    x while that kernel still runs (``kernels.quantize.AmaxLaunch.overlap_previous``); the
    same bits either way, nothing on "torch". FlashInfer has no such kernel:
    backend="flashinfer" is refused with that reason."""
    chosen = resolve(STAGE, backend, _device("x", x), op="global_scale")
    if chosen == "torch":
        return reference.nvfp4_global_scale(x)
    return triton_quantize.nvfp4_global_scale(x, launch=_amax_launch(overlap_previous))


def _amax_launch(overlap_previous: bool) -> "triton_quantize.AmaxLaunch":
    """The global scale's launch config: the default with ``overlap_previous``."""
    return dataclasses.replace(triton_quantize.DEFAULT_AMAX, overlap_previous=overlap_previous)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, *, layout: str = "linear",
                   fast_math: bool = False, out: Optional[torch.Tensor] = None,
                   out_scales: Optional[torch.Tensor] = None,
                   rows: Optional[torch.Tensor] = None, check_values: bool = True,
                   backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize rows of x. Arguments, checks and returns as
    ``kernels.reference.quantize_nvfp4`` on every backend: x [M, H] (any strides),
    global_scale [1] fp32 in [2^-126, 2^126], layout, fast_math (not on "torch"), out /
    out_scales (exact shape, uint8, contiguous), rows ([M'] int32, UNUSED = a zero row),
    check_values (one host read of the scale and the rows' range; False for CUDA graphs);
    returns (packed [M', H/2] uint8, scales uint8 e4m3 in ``layout``)."""
    chosen = resolve(STAGE, backend, _device("x", x))
    run = {"triton": triton_quantize.quantize_nvfp4, "torch": reference.quantize_nvfp4,
           "flashinfer": _flashinfer_quantize_nvfp4}[chosen]
    return run(x, global_scale, layout=layout, fast_math=fast_math, out=out,
               out_scales=out_scales, rows=rows, check_values=check_values)


def scale_and_quantize_nvfp4(x: torch.Tensor, *, layout: str = "linear", fast_math: bool = False,
                             check_values: bool = True, overlap_previous: bool = False,
                             backend: Optional[str] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`nvfp4_global_scale` and :func:`quantize_nvfp4` with it as one op (two launches on
    "triton"): x [M, H] (any strides), layout, fast_math (not on "torch"), check_values (one
    host read of the computed scale; False for CUDA graphs), overlap_previous (as
    :func:`nvfp4_global_scale`'s: its amax pass is the op's first launch); returns (packed
    [M, H/2] uint8, scales uint8 e4m3 in ``layout``, global_scale [1] fp32), the bits of the
    two ops. FlashInfer has no global-scale op: backend="flashinfer" is refused with that
    reason."""
    chosen = resolve(STAGE, backend, _device("x", x), op="global_scale")
    if chosen == "torch":
        return reference.scale_and_quantize_nvfp4(x, layout=layout, fast_math=fast_math,
                                                  check_values=check_values)
    return triton_quantize.scale_and_quantize_nvfp4(
        x, layout=layout, fast_math=fast_math, check_values=check_values,
        amax_launch=_amax_launch(overlap_previous))


def quantize_mxfp8(x: torch.Tensor, *, backend: Optional[str] = None):
    """x [M, H] (any strides) -> (float8_e4m3fn [M, H], e8m0 uint8 [M, H/32]); see the
    reference."""
    chosen = resolve(STAGE, backend, _device("x", x))
    if chosen == "triton":
        return triton_quantize.quantize_mxfp8(x)
    if chosen == "torch":
        return reference.quantize_mxfp8(x)
    return _flashinfer_quantize_mxfp8(x)


def quantize_mxfp4(x: torch.Tensor, *, backend: Optional[str] = None):
    """x [M, H] (any strides) -> (packed uint8 [M, H/2], e8m0 uint8 [M, H/32]); see the
    reference."""
    chosen = resolve(STAGE, backend, _device("x", x))
    if chosen == "triton":
        return triton_quantize.quantize_mxfp4(x)
    if chosen == "torch":
        return reference.quantize_mxfp4(x)
    return _flashinfer_quantize_mxfp4(x)


def swizzle_scales(sf: torch.Tensor, layout: str, *,
                   backend: Optional[str] = None) -> torch.Tensor:
    """Linear scales [M, K] uint8 (any strides) -> [Mp, Kp] uint8 in ``layout`` (padding
    zero). "flashinfer" (block_scale_interleave, 128x4 only) runs on SM90 too: resolved with
    ``op="swizzle"``."""
    chosen = resolve(STAGE, backend, _device("sf", sf), op="swizzle")
    if chosen == "triton":
        return triton_quantize.swizzle_scales(sf, layout)
    if chosen == "torch":
        return reference.swizzle_scales(sf, layout)
    return _flashinfer_swizzle_scales(sf, layout)


def unswizzle_scales(sf_swizzled: torch.Tensor, layout: str, num_rows: int, num_blocks: int, *,
                     backend: Optional[str] = None) -> torch.Tensor:
    """[Mp, Kp] (or flat) uint8 scales in ``layout`` -> [num_rows, num_blocks] linear (the
    inverse of :func:`swizzle_scales`). FlashInfer has no unswizzle: refused with that
    reason."""
    chosen = resolve(STAGE, backend, _device("sf_swizzled", sf_swizzled), op="unswizzle")
    run = triton_quantize.unswizzle_scales if chosen == "triton" else reference.unswizzle_scales
    return run(sf_swizzled, layout, num_rows, num_blocks)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     layout: str = "linear", dtype: torch.dtype = torch.float32,
                     check_values: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """The value of each NVFP4 code, ``(e2m1 * f32(sf)) * (1 / global_scale)``: packed
    [M, H/2] uint8, scales uint8 in ``layout``, global_scale [1] fp32 (its value checked with
    ``check_values``, one host read) -> [M, H] ``dtype``; the same bits on every backend
    (``kernels.reference.dequantize_nvfp4``). FlashInfer has no dequantizer."""
    chosen = resolve(STAGE, backend, _device("packed", packed), op="dequantize")
    run = triton_quantize.dequantize_nvfp4 if chosen == "triton" else reference.dequantize_nvfp4
    return run(packed, scales, global_scale, layout=layout, dtype=dtype,
               check_values=check_values)


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32,
                     backend: Optional[str] = None) -> torch.Tensor:
    """values [M, H] float8_e4m3fn (or its uint8 bits), scales [M, H/32] uint8 e8m0 ->
    [M, H] ``dtype`` (``kernels.reference.dequantize_mxfp8``). FlashInfer has no
    dequantizer."""
    chosen = resolve(STAGE, backend, _device("values", values), op="dequantize")
    run = triton_quantize.dequantize_mxfp8 if chosen == "triton" else reference.dequantize_mxfp8
    return run(values, scales, dtype=dtype)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32,
                     backend: Optional[str] = None) -> torch.Tensor:
    """packed [M, H/2] uint8, scales [M, H/32] uint8 e8m0 -> [M, H] ``dtype``
    (``kernels.reference.dequantize_mxfp4``). FlashInfer has no dequantizer."""
    chosen = resolve(STAGE, backend, _device("packed", packed), op="dequantize")
    run = triton_quantize.dequantize_mxfp4 if chosen == "triton" else reference.dequantize_mxfp4
    return run(packed, scales, dtype=dtype)
