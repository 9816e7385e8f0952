"""The oracle of the quantization ops: NVFP4 (design recipe, bit-exact), MXFP8, MXFP4, their
dequantizers, the global scale and the scale layouts, in plain torch.

Every conversion rounds to nearest, ties to even, and saturates to the largest finite value
("satfinite"). Signs are kept, so -0.0 and negative values that round to zero give e2m1 code
0x8, as the hardware conversion does. The formats' numbers are in ``kernels.spec.quant``.

What FlashInfer 0.7.2 does (read in csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh
and cpp/kernels/quantization.cu; facts, not code):
- NVFP4, FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1: sf = e4m3(amax * (gs * f32(1/6))), 0 when
  amax == 0; out_scale = fminf(1 / (f32(sf) * (1 / gs)), FLT_MAX) with IEEE divisions, 0 when
  amax == 0; codes = cvt.rn.satfinite.e2m1x2.f32(x * out_scale). Default ("fast math"): the
  same with rcp.approx.ftz.f32 for 1/6, 1/gs and the outer reciprocal, and no FLT_MAX clamp.
  The variable is read with getenv on every launch (not cached, not at JIT time; both recipes
  are compiled into the same module) and must be exactly "1".
- MXFP8 (cvt_warp_fp16_to_mxfp8): s = amax * rcp.approx(448); code = e8m0 of s rounded towards
  +inf, satfinite; out_scale = 1 / 2^(code-127), but 0 when that power is 0 under the module's
  flush-to-zero (code 0); values clamped to +-448 (fminf/fmaxf, so NaN becomes +448) and then
  converted with cvt.rn.satfinite to e4m3.
- MXFP4 (fp4_quantize with sf_vec_size=32, sf_use_ue8m0=True): s = amax * rcp.approx(6); code
  as above; out_scale = 0 when amax == 0, 1 when code == 0 (exp2f_rcp's special case), else
  2^(127 - code); codes = cvt.rn.satfinite.e2m1x2.f32(x * out_scale).
- All these modules are built with -use_fast_math (flush-to-zero). We keep subnormals, so we
  agree with FlashInfer unless a block amax, 1/gs or f32(sf) * (1/gs) is below 2^-126; and we use
  f32(1/6), f32(1/448) where FlashInfer uses rcp.approx (a GPU test checks they are equal).
- Swizzled scale layouts (get_sf_out_offset_128x4 / _8x4): the formulas in docs/design.md;
  the padding is written as zeros. fp4_quantize returns swizzled scales as [Mp, Kp] uint8,
  block_scale_interleave returns the same bytes flat, [Mp * Kp].
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.reference.permute import gather_table_rows
from kernels.spec.casting import round_to_dtype
from kernels.spec.quant import (E2M1_MAX, E4M3_MAX, FLT_MAX, LAYOUT_BLOCK_TILE, MX_BLOCK,
                                NVFP4_BLOCK, NVFP4_GLOBAL_NUMERATOR, QUANT_INPUT_DTYPES,
                                check_dequantize_mx_args, check_dequantize_nvfp4_args,
                                check_global_scale_values, check_layout, check_quant_input,
                                check_quantize_nvfp4_args, check_quantize_nvfp4_values,
                                check_scale_and_quantize_nvfp4_args, check_swizzle_args,
                                check_unswizzle_args, swizzled_scale_shape)
from kernels.spec.tensors import check_tensor


def _e2m1_grid(device: torch.device) -> torch.Tensor:
    """E2M1_VALUES as an fp32 tensor on ``device``, computed there from the codes (exponent
    e = code >> 1, mantissa m = code & 1: m / 2 for e == 0, else 2^(e-1) * (1 + m / 2)), not
    copied from the host, so that the oracle stays capturable in a CUDA graph (compiled too)."""
    code = torch.arange(8, device=device)
    exponent, mantissa = (code >> 1).to(torch.float32), (code & 1).to(torch.float32)
    return torch.where(exponent == 0, mantissa * 0.5,
                       torch.exp2(exponent - 1) * (1.0 + mantissa * 0.5))


def _f32(value: float, device: torch.device) -> torch.Tensor:
    """fp32(value) as a 0-d tensor filled on ``device`` (no host-to-device copy)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _round_to_grid(magnitude: torch.Tensor, mantissa_bits: int, min_exponent: int,
                   max_value: float) -> torch.Tensor:
    """Round non-negative fp32 ``magnitude`` to the nearest value (ties to even) of a binary
    format with ``mantissa_bits`` and smallest normal exponent ``min_exponent``, saturating at
    ``max_value`` (NaN stays NaN). Exact: the quantum is a power of two, so scaling by it is
    exact and torch.round (half to even) does the rounding."""
    _, exponent = torch.frexp(magnitude)  # magnitude = f * 2^exponent, f in [0.5, 1)
    exponent = torch.clamp(exponent - 1, min=min_exponent)  # floor(log2), at least emin
    quantum_exponent = exponent - mantissa_bits
    quantum_exponent = quantum_exponent.to(torch.float32)
    rounded = torch.ldexp(torch.round(torch.ldexp(magnitude, -quantum_exponent)),
                          quantum_exponent)
    return torch.where(rounded > max_value, torch.full_like(rounded, max_value), rounded)


def e4m3_code(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn bits (uint8), round to nearest even, satfinite (|x| > 448 and
    +-inf give +-448); NaN gives 0x7F."""
    x = x.to(torch.float32)
    magnitude = _round_to_grid(x.abs(), mantissa_bits=3, min_exponent=-6, max_value=E4M3_MAX)
    _, exponent = torch.frexp(magnitude)
    exponent = exponent - 1  # floor(log2) of the rounded magnitude
    normal = magnitude >= 2.0 ** -6
    # normal: (exponent + 7) << 3 | mantissa; subnormal: magnitude / 2^-9 (0..7)
    mantissa = torch.where(normal, torch.ldexp(magnitude, -exponent.to(torch.float32)) * 8 - 8,
                           magnitude * 512)
    code = torch.where(normal, (exponent + 7) * 8, torch.zeros_like(exponent)) + mantissa.to(
        torch.int32)
    code = torch.where(torch.signbit(x), code | 0x80, code)
    code = torch.where(torch.isnan(x), torch.full_like(code, 0x7F), code)
    return code.to(torch.uint8)


def e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bits (uint8) -> fp32 (exact)."""
    return code.view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 code (uint8, 0..15), round to nearest even, satfinite (|x| > 6 and +-inf
    give +-6); the sign bit is kept (-0.0 -> 0x8); NaN gives 0x7, whatever its sign bit (a
    GPU's NaN products carry none; a CPU keeps an operand's, so the sign is not defined)."""
    x = x.to(torch.float32)
    magnitude = _round_to_grid(x.abs(), mantissa_bits=1, min_exponent=0, max_value=E2M1_MAX)
    nan = torch.isnan(x)
    magnitude = torch.where(nan, torch.full_like(magnitude, E2M1_MAX), magnitude)
    grid = _e2m1_grid(x.device)
    code = torch.searchsorted(grid, magnitude.contiguous())  # exact match: the grid index
    code = torch.where(torch.signbit(x) & ~nan, code | 0x8, code)
    return code.to(torch.uint8)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """e2m1 code (uint8, low 4 bits) -> fp32 (exact)."""
    grid = _e2m1_grid(code.device)
    code = code.to(torch.int64) & 0xF
    magnitude = grid[code & 0x7]
    return torch.where(code >= 8, -magnitude, magnitude)


def e8m0_code(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> e8m0 code (uint8): the smallest c with 2^(c-127) >= x (rounding
    towards +inf), 0 for x <= 2^-127 (and x == 0), satfinite 254 above 2^127; NaN gives 255."""
    x = x.to(torch.float32)
    _, exponent = torch.frexp(x)  # x = f * 2^exponent, f in [0.5, 1)
    is_power_of_two = torch.ldexp(torch.ones_like(x), (exponent - 1).to(torch.float32)) == x
    ceil_log2 = torch.where(is_power_of_two, exponent - 1, exponent)
    code = torch.clamp(ceil_log2 + 127, 0, 254)
    code = torch.where(x == 0, torch.zeros_like(code), code)
    code = torch.where(torch.isinf(x), torch.full_like(code, 254), code)
    code = torch.where(torch.isnan(x), torch.full_like(code, 255), code)
    return code.to(torch.uint8)


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """e8m0 code (uint8) -> fp32 2^(code-127) (exact; 2^-127 is an fp32 subnormal)."""
    return torch.ldexp(torch.ones(code.shape, dtype=torch.float32, device=code.device),
                       code.to(torch.float32) - 127)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[M, H] codes (uint8 < 16) -> [M, H/2] bytes; element 2i in the low nibble of byte i."""
    pairs = codes.reshape(codes.shape[0], codes.shape[1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[M, H/2] bytes -> [M, H] codes; the inverse of ``_pack_nibbles``."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return codes.reshape(packed.shape[0], packed.shape[1] * 2)


def _block_amax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as fp32 [M, H/block, block] and its per-block amax [M, H/block]."""
    blocks = x.to(torch.float32).reshape(x.shape[0], x.shape[1] // block, block)
    return blocks, blocks.abs().amax(dim=-1)


def scale_offsets(rows: torch.Tensor, blocks: torch.Tensor, padded_blocks: int,
                  layout: str) -> torch.Tensor:
    """Byte offset of scale (row, block) in a ``layout`` buffer with ``padded_blocks`` (Kp)
    blocks per row, int64, broadcasting ``rows`` against ``blocks``:
    128x4: (m//128)*(Kp/4)*512 + (kb//4)*512 + (m%32)*16 + ((m%128)//32)*4 + kb%4;
    8x4:   (m//8)*(Kp/4)*32 + (kb//4)*32 + (m%8)*4 + kb%4; linear: m*Kp + kb."""
    rows, blocks = rows.to(torch.int64), blocks.to(torch.int64)
    k_tiles = padded_blocks // LAYOUT_BLOCK_TILE
    if layout == "linear":
        return rows * padded_blocks + blocks
    if layout == "swizzled_128x4":
        return ((rows // 128) * k_tiles * 512 + (blocks // 4) * 512 + (rows % 32) * 16
                + ((rows % 128) // 32) * 4 + blocks % 4)
    if layout == "8x4":
        return (rows // 8) * k_tiles * 32 + (blocks // 4) * 32 + (rows % 8) * 4 + blocks % 4
    check_layout(layout)


def swizzle_scales(sf: torch.Tensor, layout: str) -> torch.Tensor:
    """Lay out linear block scales for an FP4/MX GEMM.

    sf: [M, K] uint8, one scale per block (K = H/16 for NVFP4, H/32 for MX), linear.
    layout: "linear" (returns a copy), "swizzled_128x4" or "8x4".
    Returns [Mp, Kp] uint8 (``swizzled_scale_shape``), padding zero; the bytes of FlashInfer's
    fp4_quantize swizzled scales and of ``block_scale_interleave`` (which returns them flat).
    """
    check_swizzle_args(sf, layout)
    num_rows, num_blocks = sf.shape
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    out = torch.zeros(padded_rows * padded_blocks, dtype=torch.uint8, device=sf.device)
    offsets = scale_offsets(torch.arange(num_rows, device=sf.device)[:, None],
                            torch.arange(num_blocks, device=sf.device)[None, :],
                            padded_blocks, layout)
    out[offsets.reshape(-1)] = sf.reshape(-1)
    return out.reshape(padded_rows, padded_blocks)


def unswizzle_scales(sf_swizzled: torch.Tensor, layout: str, num_rows: int,
                     num_blocks: int) -> torch.Tensor:
    """The inverse of ``swizzle_scales``: [Mp, Kp] (or flat [Mp*Kp]) uint8 in ``layout`` ->
    [num_rows, num_blocks] uint8 linear. num_rows and num_blocks are needed because the
    padding hides them."""
    padded_rows, padded_blocks = check_unswizzle_args(sf_swizzled, layout, num_rows, num_blocks)
    offsets = scale_offsets(torch.arange(num_rows, device=sf_swizzled.device)[:, None],
                            torch.arange(num_blocks, device=sf_swizzled.device)[None, :],
                            padded_blocks, layout)
    return sf_swizzled.reshape(-1)[offsets]


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 global encode scale ``448 * 6 / amax(x)``.

    x: [M, H] bf16/fp16/fp32, any strides. Returns [1] fp32 (IEEE division, round to nearest
    even); the decode scale is its reciprocal. When amax(x) == 0 (all zeros, or no elements)
    it returns 1.0: finite, and every block then has amax 0, scale code 0 and element code 0
    (0x8 for -0.0). x with a NaN gives the canonical NaN, with an inf 0: ``quantize_nvfp4``
    refuses both (and a scale above 2^126, from amax(x) below ~3.2e-35) under its
    ``check_values``.
    """
    check_tensor("x", x, dtype=QUANT_INPUT_DTYPES, ndim=2)
    amax = x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
    scale = _f32(NVFP4_GLOBAL_NUMERATOR, x.device) / amax
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return round_to_dtype(scale, torch.float32).reshape(1)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, *, layout: str = "linear",
                   fast_math: bool = False, out: Optional[torch.Tensor] = None,
                   out_scales: Optional[torch.Tensor] = None,
                   rows: Optional[torch.Tensor] = None,
                   check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize rows of ``x`` (docs/design.md's IEEE recipe, bit-exact).

    x: [M, H] bf16/fp16/fp32, H % 16 == 0, any strides.
    global_scale: [1] fp32 encode scale on x's device, e.g. ``nvfp4_global_scale(x)``; it
        must lie in [2^-126, 2^126] (``kernels.spec.GLOBAL_SCALE_MIN`` / ``_MAX``).
    layout: scale layout, "linear", "swizzled_128x4" or "8x4".
    fast_math: FlashInfer's default recipe; needs the GPU's rcp.approx.ftz.f32, so the
        reference raises NotImplementedError (the Triton kernel has it on a GPU).
    out: optional [M', H/2] uint8 buffer; out_scales: optional scale buffer of exactly the
        layout's shape ([M', H/16] linear, [Mp, Kp] from ``swizzled_scale_shape``), uint8;
        both contiguous on x's device (anything else is refused: no conversion, no
        broadcasting). The results are written there and returned.
    rows: optional [M'] int32 (any strides): quantize ``x[rows]``; an entry UNUSED (-1) gives
        a zero row (codes 0, scale 0). M' = len(rows), else M' = M.
    check_values: True: read the global scale and the range of ``rows`` (one host sync) and
        raise ValueError for a scale outside [2^-126, 2^126] or a row neither UNUSED nor in
        [0, M). False: nothing is read (CUDA graphs); an out-of-range row then gives a zero
        row, on every face, and a bad scale gives the codes its arithmetic gives.
    Returns (packed [M', H/2] uint8, element 2i in the low nibble of byte i;
             scales uint8 e4m3 bits: [M', H/16] linear, [Mp, Kp] swizzled (``swizzle_scales``)).
    """
    check_quantize_nvfp4_args(x, global_scale, layout, out, out_scales, rows)
    if fast_math:
        raise NotImplementedError(
            "fast_math=True uses the GPU instruction rcp.approx.ftz.f32, whose results torch "
            "cannot reproduce; use kernels.quantize.quantize_nvfp4 on a GPU, or fast_math=False")
    if check_values:
        check_quantize_nvfp4_values(global_scale, rows, x.shape[0])
    if rows is not None:
        x = gather_table_rows(x, rows)  # an entry outside [0, M) -> a zero row
    gs = global_scale.reshape(()).to(torch.float32)
    blocks, amax = _block_amax(x, NVFP4_BLOCK)
    inv6 = _f32(1.0 / 6.0, x.device)
    sf = e4m3_code(amax * (gs * inv6))
    decode = 1.0 / gs
    out_scale = torch.clamp(1.0 / (e4m3_value(sf) * decode), max=FLT_MAX)
    out_scale = torch.where(amax == 0, torch.zeros_like(out_scale), out_scale)
    codes = e2m1_code(blocks * out_scale[..., None]).reshape(x.shape)
    packed, scales = _pack_nibbles(codes), swizzle_scales(sf, layout)
    # out / out_scales have exactly these shapes and dtypes (checked): a plain byte copy
    if out is not None:
        packed = out.copy_(packed)
    if out_scales is not None:
        scales = out_scales.copy_(scales)
    return packed, scales


def scale_and_quantize_nvfp4(x: torch.Tensor, *, layout: str = "linear", fast_math: bool = False,
                             check_values: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`nvfp4_global_scale` and :func:`quantize_nvfp4` of ``x`` with it, as one op: what a
    sending rank computes of its own rows.

    x: [M, H] bf16/fp16/fp32, H % 16 == 0, any strides; layout and fast_math as in
    :func:`quantize_nvfp4`. check_values: True: read the global scale (one host sync) and
    raise quantize_nvfp4's ValueError for one outside [2^-126, 2^126] (x with a NaN or an
    inf, or with amax(x) below ~3.2e-35); False: nothing is read (CUDA graphs) and such a
    scale gives the codes its arithmetic gives, on every face.
    Returns (packed [M, H/2] uint8, scales uint8 in ``layout``, global_scale [1] fp32): the
    same bits as the two ops called one after the other.
    """
    check_scale_and_quantize_nvfp4_args(x, layout)
    global_scale = nvfp4_global_scale(x)
    packed, scales = quantize_nvfp4(x, global_scale, layout=layout, fast_math=fast_math,
                                    check_values=check_values)
    return packed, scales, global_scale


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     layout: str = "linear", dtype: torch.dtype = torch.float32,
                     check_values: bool = True) -> torch.Tensor:
    """The value each NVFP4 code stands for: ``(e2m1 * f32(sf)) * (1 / global_scale)``.

    packed: [M, H/2] uint8; scales: uint8 e4m3 bits in ``layout``, exactly [M, H/16] (linear)
    or [Mp, Kp], or the same bytes flat; global_scale: [1] fp32 encode scale; any strides.
    dtype: float32, bfloat16 or float16. check_values: read the global scale (one host sync)
    and refuse it outside [2^-126, 2^126], as ``quantize_nvfp4`` does.
    Returns [M, H] ``dtype``, rounded once from fp32 (nearest even, NaN canonical).
    """
    num_rows, hidden = check_dequantize_nvfp4_args(packed, scales, global_scale, layout, dtype)
    if check_values:
        check_global_scale_values(global_scale)
    num_blocks = hidden // NVFP4_BLOCK
    sf = unswizzle_scales(scales, layout, num_rows, num_blocks)
    values = e2m1_value(_unpack_nibbles(packed)).reshape(num_rows, num_blocks, NVFP4_BLOCK)
    decode = 1.0 / global_scale.reshape(()).to(torch.float32)
    out = (values * e4m3_value(sf)[..., None]) * decode
    return round_to_dtype(out.reshape(num_rows, num_blocks * NVFP4_BLOCK), dtype)


def _mx_scales(amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """e8m0 code of amax * f32(1 / element_max), rounded towards +inf."""
    inverse = _f32(1.0 / element_max, amax.device)
    return e8m0_code(amax * inverse)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize the rows of ``x`` (FlashInfer's mxfp8_quantize recipe).

    x: [M, H] bf16/fp16/fp32, H % 32 == 0.
    Returns (values [M, H] torch.float8_e4m3fn, as FlashInfer's mxfp8_quantize returns;
             scales [M, H/32] uint8 e8m0, code = e8m0(amax * f32(1/448)) rounded up).
    Element = e4m3_rne_satfinite(clamp(x * 2^(127 - code), -448, 448)); code 0 multiplies by 0
    (FlashInfer's flush-to-zero); NaN becomes +448.
    """
    check_quant_input(x, MX_BLOCK)
    blocks, amax = _block_amax(x, MX_BLOCK)
    sf = _mx_scales(amax, E4M3_MAX)
    out_scale = torch.where(sf == 0, torch.zeros_like(amax), 1.0 / e8m0_value(sf))
    scaled = blocks * out_scale[..., None]
    scaled = torch.where(torch.isnan(scaled), torch.full_like(scaled, E4M3_MAX), scaled)
    values = e4m3_code(torch.clamp(scaled, -E4M3_MAX, E4M3_MAX)).reshape(x.shape)
    return values.view(torch.float8_e4m3fn), sf


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [M, H] float8_e4m3fn (or its uint8 bits), scales exactly [M, H/32] uint8 e8m0,
    any strides -> [M, H] ``dtype`` (float32/bf16/fp16): value * 2^(code - 127), rounded once
    (nearest even, NaN canonical)."""
    num_rows, hidden = check_dequantize_mx_args(values, scales, dtype, fp4=False)
    blocks = e4m3_value(values.view(torch.uint8)).reshape(num_rows, hidden // MX_BLOCK, MX_BLOCK)
    out = (blocks * e8m0_value(scales)[..., None]).reshape(num_rows, hidden)
    return round_to_dtype(out, dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize the rows of ``x`` (FlashInfer's fp4_quantize(sf_vec_size=32,
    sf_use_ue8m0=True) recipe).

    x: [M, H] bf16/fp16/fp32, H % 32 == 0.
    Returns (packed [M, H/2] uint8, element 2i in the low nibble;
             scales [M, H/32] uint8 e8m0, code = e8m0(amax * f32(1/6)) rounded up).
    Element = e2m1_rne_satfinite(x * s), s = 0 if amax == 0, 1 if code == 0, else
    2^(127 - code).
    """
    check_quant_input(x, MX_BLOCK)
    blocks, amax = _block_amax(x, MX_BLOCK)
    sf = _mx_scales(amax, E2M1_MAX)
    out_scale = torch.where(sf == 0, torch.ones_like(amax), 1.0 / e8m0_value(sf))
    out_scale = torch.where(amax == 0, torch.zeros_like(amax), out_scale)
    codes = e2m1_code(blocks * out_scale[..., None]).reshape(x.shape)
    return _pack_nibbles(codes), sf


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [M, H/2] uint8, scales exactly [M, H/32] uint8 e8m0, any strides -> [M, H]
    ``dtype`` (float32/bf16/fp16): e2m1 * 2^(code - 127), rounded once (nearest even, NaN
    canonical)."""
    num_rows, hidden = check_dequantize_mx_args(packed, scales, dtype, fp4=True)
    values = e2m1_value(_unpack_nibbles(packed)).reshape(num_rows, hidden // MX_BLOCK, MX_BLOCK)
    out = (values * e8m0_value(scales)[..., None]).reshape(num_rows, hidden)
    return round_to_dtype(out, dtype)
