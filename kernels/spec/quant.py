"""The contract of the quantization ops (NVFP4, MXFP8, MXFP4, the scale layouts): the numbers of
the formats, the layouts' shapes and the argument checks every face shares.

Numbers (bit-exact; docs/design.md "NVFP4"):
  e4m3 (float8_e4m3fn): bias 7, 3 mantissa bits, max 448, no inf; code 0x7F/0xFF is NaN.
  e2m1: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} for codes 0..7, bit 3 the sign.
  e8m0: code c means 2^(c - 127); 255 is NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.spec.tensors import check_tensor
from kernels.spec.values import check_index_range, index_extremes, read_to_host

E2M1_MAX = 6.0  # largest e2m1 magnitude
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
NVFP4_BLOCK = 16  # elements per NVFP4 scale
MX_BLOCK = 32  # elements per MX (e8m0) scale
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX  # gs = 448 * 6 / amax(x)
FLT_MAX = 3.4028234663852886e38
SCALE_LAYOUTS = ("linear", "swizzled_128x4", "8x4")
# Row tile of each swizzled layout (the number of rows it pads to); both pad blocks to 4.
LAYOUT_ROW_TILE = {"swizzled_128x4": 128, "8x4": 8}
LAYOUT_BLOCK_TILE = 4
QUANT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Output dtypes of the dequantizers (fp32 math, rounded once; kernels.spec.casting).
DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The global encode scales quantize_nvfp4 accepts: gs and the decode scale 1/gs both normal
# fp32 numbers. Outside, the result is degenerate: 1/gs overflows to inf (gs < 2^-126, e.g.
# 1e-40: every code dequantizes to NaN) or is subnormal (gs > 2^126, e.g. 3e38: FlashInfer
# flushes it to zero, and every block scale saturates at 448); 0, -0, NaN and inf are refused.
GLOBAL_SCALE_MIN = 2.0 ** -126
GLOBAL_SCALE_MAX = 2.0 ** 126
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# fp32 constants of the recipes: the exact fp32 values of 1/6 and 1/448, rounded to nearest.
INV_E2M1_MAX = float(torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32))
INV_E4M3_MAX = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def check_quant_input(x: torch.Tensor, block: int) -> None:
    check_tensor("x", x, dtype=QUANT_INPUT_DTYPES, ndim=2)
    if x.shape[1] % block:
        raise ValueError(f"x has H={x.shape[1]} columns; H must be a multiple of {block} "
                         f"(one scale per {block} elements); pad the hidden size")


def check_layout(layout: str) -> None:
    if layout not in SCALE_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {SCALE_LAYOUTS}")


def check_global_scale(global_scale: torch.Tensor, device: torch.device) -> None:
    """The host-side checks of a global encode scale: one float32 element on ``device``. Its
    value is checked by :func:`check_global_scale_value` (a device read)."""
    check_tensor("global_scale", global_scale, dtype=torch.float32, device=device)
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale must hold 1 element, got shape "
                         f"{tuple(global_scale.shape)}; pass nvfp4_global_scale(x)")


def check_global_scale_value(value: float) -> None:
    """Raise ValueError unless the global scale ``value`` (read from the device) lies in
    ``[GLOBAL_SCALE_MIN, GLOBAL_SCALE_MAX] = [2^-126, 2^126]``: finite, > 0, and with a
    normal reciprocal (the decode scale)."""
    if GLOBAL_SCALE_MIN <= value <= GLOBAL_SCALE_MAX:  # False for NaN
        return
    raise ValueError(f"global_scale holds {value:.9g}; it must be a finite float32 in "
                     f"[2^-126, 2^126] (the scale and its reciprocal, the decode scale, both "
                     f"normal), as nvfp4_global_scale(x) gives for finite x with amax(x) = 0 or "
                     f">= ~3.2e-35; check_values=False skips this check (no host read)")


def check_global_scale_values(global_scale: torch.Tensor) -> None:
    """Read the global scale (one host read) and check its value
    (:func:`check_global_scale_value`); for ops whose only device-read check it is."""
    check_global_scale_value(read_to_host([global_scale])[0])


def swizzled_scale_shape(num_rows: int, num_blocks: int, layout: str) -> tuple[int, int]:
    """[Mp, Kp] of the scale buffer of ``layout``: [M, H/16] for "linear"; for the swizzled
    layouts rows padded to 128 (or 8) and blocks to 4 (FlashInfer's fp4_quantize shape)."""
    check_layout(layout)
    if layout == "linear":
        return num_rows, num_blocks
    return (round_up(num_rows, LAYOUT_ROW_TILE[layout]),
            round_up(num_blocks, LAYOUT_BLOCK_TILE))


def check_mx_scales(scales: torch.Tensor, num_rows: int, hidden: int, device) -> None:
    """MX scales: [M, H/32] uint8 e8m0 on ``device``."""
    check_tensor("scales", scales, dtype=torch.uint8, ndim=2, device=device)
    if tuple(scales.shape) != (num_rows, hidden // MX_BLOCK):
        raise ValueError(f"scales has shape {tuple(scales.shape)}; expected "
                         f"{(num_rows, hidden // MX_BLOCK)} (one e8m0 per {MX_BLOCK} elements)")


def check_out(name: str, out: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype,
              device: torch.device) -> Optional[torch.Tensor]:
    """Check a caller's output buffer: exactly ``shape``, ``dtype``, ``device``, contiguous."""
    if out is None:
        return None
    check_tensor(name, out, dtype=dtype, device=device, contiguous=True)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(out.shape)}; this call writes {tuple(shape)}")
    return out


def check_quantize_nvfp4_args(x: torch.Tensor, global_scale: torch.Tensor, layout: str,
                              out: Optional[torch.Tensor], out_scales: Optional[torch.Tensor],
                              rows: Optional[torch.Tensor]) -> tuple[int, int, int]:
    """The host-side checks of ``quantize_nvfp4`` (every face): x [M, H] bf16/fp16/fp32 with
    H % 16 == 0 (any strides); global_scale one fp32 element on x's device; a known layout;
    rows None or [M'] int32 on x's device (any strides; int64 is refused: the library's index
    buffers are int32); out exactly [M', H/2] uint8 and out_scales exactly the layout's
    [Mp, Kp] uint8, contiguous, on x's device (no conversion, no broadcasting). Returns
    (M', Mp, Kp), M' = len(rows) or M. The values (global scale, rows) are checked by
    :func:`check_quantize_nvfp4_values`."""
    check_quant_input(x, NVFP4_BLOCK)
    check_layout(layout)
    check_global_scale(global_scale, x.device)
    if rows is not None:
        check_tensor("rows", rows, dtype=torch.int32, ndim=1, device=x.device)
    num_rows = x.shape[0] if rows is None else rows.numel()
    hidden = x.shape[1]
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, hidden // NVFP4_BLOCK, layout)
    check_out("out", out, (num_rows, hidden // 2), torch.uint8, x.device)
    check_out("out_scales", out_scales, (padded_rows, padded_blocks), torch.uint8, x.device)
    return num_rows, padded_rows, padded_blocks


def check_scale_and_quantize_nvfp4_args(x: torch.Tensor, layout: str) -> None:
    """The host-side checks of ``scale_and_quantize_nvfp4`` (every face), before anything is
    computed: x [M, H] bf16/fp16/fp32 with H % 16 == 0 (any strides) and a known layout."""
    check_quant_input(x, NVFP4_BLOCK)
    check_layout(layout)


def check_quantize_nvfp4_values(global_scale: torch.Tensor, rows: Optional[torch.Tensor],
                                num_src_rows: int) -> None:
    """The device-read checks of ``quantize_nvfp4`` (its ``check_values``), in one host read:
    the global scale (:func:`check_global_scale_value`) and rows, each UNUSED (-1, a zero row)
    or in ``[0, M)``."""
    values = read_to_host([global_scale] + ([] if rows is None else index_extremes(rows)))
    check_global_scale_value(values[0])
    check_index_range("rows", values[1:], num_src_rows, "M")


def check_output_dtype(dtype) -> None:
    """A dequantizer's ``dtype``: float32, bfloat16 or float16."""
    if dtype not in DEQUANT_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in DEQUANT_DTYPES)
        raise TypeError(f"dtype={dtype!r} must be one of {names} (the dequantized values)")


def check_scale_buffer(name: str, scales: torch.Tensor, layout: str, num_rows: int,
                       num_blocks: int) -> tuple[int, int]:
    """Scales of ``layout`` for ``num_rows`` x ``num_blocks`` blocks: exactly [Mp, Kp] or the
    same bytes flat, [Mp * Kp] (``block_scale_interleave`` returns them flat). Returns
    (Mp, Kp)."""
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    if tuple(scales.shape) not in ((padded_rows, padded_blocks), (padded_rows * padded_blocks,)):
        raise ValueError(f"{name} has shape {tuple(scales.shape)}; layout={layout!r} with "
                         f"{num_rows} rows and {num_blocks} blocks needs [{padded_rows}, "
                         f"{padded_blocks}] (or flat [{padded_rows * padded_blocks}])")
    return padded_rows, padded_blocks


def check_dequantize_nvfp4_args(packed: torch.Tensor, scales: torch.Tensor,
                                global_scale: torch.Tensor, layout: str,
                                dtype) -> tuple[int, int]:
    """``dequantize_nvfp4``'s host-side checks: packed [M, H/2] uint8 (H % 16 == 0), scales
    uint8 [Mp, Kp] of the layout (or flat), global_scale one fp32 element, all on one device
    (any strides); dtype float32/bf16/fp16. Returns (M, H). With ``check_values`` the face
    also reads the global scale (:func:`check_global_scale_values`)."""
    check_tensor("packed", packed, dtype=torch.uint8, ndim=2)
    check_tensor("scales", scales, dtype=torch.uint8, device=packed.device)
    check_layout(layout)
    check_global_scale(global_scale, packed.device)
    check_output_dtype(dtype)
    num_rows, hidden = packed.shape[0], packed.shape[1] * 2
    if hidden % NVFP4_BLOCK:
        raise ValueError(f"packed has {packed.shape[1]} bytes per row; H = 2 * that must be a "
                         f"multiple of {NVFP4_BLOCK}")
    check_scale_buffer("scales", scales, layout, num_rows, hidden // NVFP4_BLOCK)
    return num_rows, hidden


def check_dequantize_mx_args(codes: torch.Tensor, scales: torch.Tensor, dtype, *,
                             fp4: bool) -> tuple[int, int]:
    """``dequantize_mxfp4`` (``fp4``: codes [M, H/2] uint8) / ``dequantize_mxfp8`` (codes
    [M, H] float8_e4m3fn or its uint8 bits) checks: scales exactly [M, H/32] uint8 e8m0 on
    the codes' device, H % 32 == 0, any strides; dtype float32/bf16/fp16. Returns (M, H)."""
    if fp4:
        check_tensor("packed", codes, dtype=torch.uint8, ndim=2)
    else:
        check_tensor("values", codes, dtype=(torch.float8_e4m3fn, torch.uint8), ndim=2)
    check_output_dtype(dtype)
    num_rows, hidden = codes.shape[0], codes.shape[1] * (2 if fp4 else 1)
    if hidden % MX_BLOCK:
        raise ValueError(f"{'packed' if fp4 else 'values'} holds H={hidden} elements per row; "
                         f"H must be a multiple of {MX_BLOCK} (one e8m0 scale per "
                         f"{MX_BLOCK} elements)")
    check_mx_scales(scales, num_rows, hidden, codes.device)
    return num_rows, hidden


def check_swizzle_args(sf: torch.Tensor, layout: str) -> None:
    """``swizzle_scales``: sf [M, K] uint8 linear scales (any strides), a known layout."""
    check_tensor("sf", sf, dtype=torch.uint8, ndim=2)
    check_layout(layout)


def check_unswizzle_args(sf_swizzled: torch.Tensor, layout: str, num_rows: int,
                         num_blocks: int) -> tuple[int, int]:
    """``unswizzle_scales``: sf_swizzled uint8, exactly the layout's [Mp, Kp] or the same bytes
    flat (any strides); num_rows, num_blocks ints >= 0. Returns (Mp, Kp)."""
    check_tensor("sf_swizzled", sf_swizzled, dtype=torch.uint8)
    check_layout(layout)
    for name, value in (("num_rows", num_rows), ("num_blocks", num_blocks)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    return check_scale_buffer("sf_swizzled", sf_swizzled, layout, num_rows, num_blocks)
