"""NVFP4 / MXFP8 / MXFP4 quantization in Triton, bit-exact to ``kernels.reference.quant``.

Same names and arguments as the oracle (read its docstring for the recipes and what FlashInfer
does); the argument checks are ``kernels.spec.quant``'s. The ``@triton.jit`` code lives in
``kernels/quantize_details/``: the number formats and layouts (``formats``), the word reading
and packing (``words``), the kernels (``nvfp4``, ``mx``, ``scales``). This module holds the
launch rules and the launchers.

Launch rule (fixed, no autotune; ``python -m bench.tune`` times the alternatives, passing them
as launch configs): a program quantizes a tile of ``BLOCK_ROWS`` rows by ``BLOCKS`` scale
blocks, about ``tile_elements`` elements with up to ``num_warps`` warps (one scale block per
thread at most), smaller for small M (:func:`tile_shape`); an NVFP4 program then walks up to
``steps`` tiles along its rows, loading ``prefetch`` tiles ahead (:func:`nvfp4_steps`). The
grid covers rows x blocks, padded to the swizzled tile, so that the same programs write the zero
padding of the scales. The packed NVFP4 values are stored with L2 eviction priority
``store_policy`` ("evict_last"), a hint to keep them in L2 for the op that reads them next (a
transport send, a GEMM). Each default is the best row of a ``bench.tune`` run on an H200
(bench/results/tune-*.json holds the record of that choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from kernels import hardware
from kernels.quantize_details.mx import dequantize_kernel, mx_quantize_kernel
from kernels.quantize_details.nvfp4 import nvfp4_quantize_kernel
from kernels.quantize_details.scales import (amax_partial_kernel, global_scale_finish_kernel,
                                             scale_layout_kernel)
from kernels.quantize_details.words import as_pairs
from kernels.spec.quant import (MX_BLOCK, NVFP4_BLOCK, QUANT_INPUT_DTYPES, SCALE_LAYOUTS,
                                check_dequantize_mx_args, check_dequantize_nvfp4_args,
                                check_global_scale_values, check_quant_input,
                                check_quantize_nvfp4_args, check_quantize_nvfp4_values,
                                check_swizzle_args, check_unswizzle_args, swizzled_scale_shape)
from kernels.spec.tensors import check_tensor

LAYOUT_IDS = {name: i for i, name in enumerate(SCALE_LAYOUTS)}  # the kernels' LAYOUT constexpr


# =============================================================================================
# Launch configurations
# =============================================================================================

@dataclass(frozen=True)
class _Target:
    """Launch fields every quantize config has.

    ptx:     None: the GPU-only paths (inline PTX) are used where the tensor runs compiled on a
             GPU; True forces them (``tests.sm_compile`` builds GPU variants from CPU tensors);
             False turns them off (tests of the portable path on a GPU).
    num_sms: the SM count the small-M rules aim at; None reads the device's.
    """

    ptx: Optional[bool] = None
    num_sms: Optional[int] = None

    def runs_ptx(self, device: torch.device) -> bool:
        return hardware.can_run_ptx(device) if self.ptx is None else self.ptx

    def sms(self, device: torch.device) -> int:
        return hardware.num_sms(device) if self.num_sms is None else self.num_sms


@dataclass(frozen=True)
class NVFP4Launch(_Target):
    """Launch rule of ``quantize_nvfp4``: tiles of about ``tile_elements`` elements (at most
    ``max_blocks`` scale blocks wide) on ``num_warps`` warps; ``steps`` tiles per program along
    its rows, loading ``prefetch`` (1, 2 or 3) ahead; ``maxnreg`` a register cap (or None);
    ``store_policy`` the packed stores' L2 eviction priority ("" = the default); ``word_asm``
    the word-level inline PTX for bf16/fp16 on a GPU (:func:`nvfp4_word_asm`)."""

    tile_elements: int = 2048
    max_blocks: int = 64  # 64 NVFP4 blocks = 1024 columns = 2 KiB of bf16 per row
    num_warps: int = 4
    steps: int = 8
    prefetch: int = 3
    maxnreg: Optional[int] = None
    store_policy: str = "evict_last"
    word_asm: bool = True


@dataclass(frozen=True)
class BlockLaunch(_Target):
    """Launch rule of the MX quantizers and the dequantizers: tiles of about ``tile_elements``
    elements, at most ``max_blocks`` scale blocks wide, on ``num_warps`` warps. On a GPU,
    ``hardware_e4m3`` converts MXFP8 elements with ``cvt.rn.satfinite.e4m3x2.f32`` and
    ``word_asm`` reduces bf16/fp16 block maxima on packed pairs (both exact)."""

    tile_elements: int = 4096
    max_blocks: int = 32
    num_warps: int = 4
    hardware_e4m3: bool = True
    word_asm: bool = True


@dataclass(frozen=True)
class AmaxLaunch(_Target):
    """Launch rule of ``nvfp4_global_scale``: a persistent grid of ``programs_per_sm`` programs
    per SM, each looping over [``tile_rows``, ``tile_cols``] tiles (16 KiB of bf16 per step on
    8 warps: 4 16-byte loads per thread in flight), then one program reduces the per-program
    maxima ``finish_block`` at a time. Two launches, no memset."""

    tile_cols: int = 1024
    tile_rows: int = 8
    num_warps: int = 8
    programs_per_sm: int = 4
    finish_block: int = 1024


DEFAULT_NVFP4 = NVFP4Launch()
DEFAULT_BLOCK = BlockLaunch()
DEFAULT_AMAX = AmaxLaunch()


def nvfp4_word_asm(device: torch.device, in_kind: int, fast_math: bool,
                   stride_row: Optional[int], launch: _Target) -> bool:
    """Whether a kernel takes the word-level PTX path: bf16/fp16 input (IN_KIND 0/1), the IEEE
    recipe (fast math's inf scales make NaN products inside a block, whose signs that path
    cannot drop per element), on a GPU. ``stride_row`` (NVFP4, in words): a multiple of 16, so
    that Triton knows every row is 16-byte aligned and gives each thread its block's 4 words in
    a row; ``e2m1_words`` takes one block's sign masks for its 4 words, which then is right."""
    return (launch.word_asm and in_kind in (0, 1) and not fast_math and launch.runs_ptx(device)
            and (stride_row is None or stride_row % 16 == 0))


def tile_shape(num_rows: int, num_blocks: int, block: int, device: torch.device,
               launch) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCKS, num_warps) for ``num_rows`` rows of ``num_blocks`` blocks: the
    launch config's tile, then, for small M, fewer rows per program until the grid has 2
    programs per SM (one big tile per SM would leave the latency of its serial work), warps
    shrunk with the tile."""
    blocks = min(launch.max_blocks, triton.next_power_of_2(max(num_blocks, 1)))
    block_rows = max(1, launch.tile_elements // (blocks * block))
    while (block_rows > 1 and triton.cdiv(num_rows, block_rows) * triton.cdiv(num_blocks, blocks)
           < 2 * launch.sms(device)):
        block_rows //= 2
    # smaller tiles (small M) get fewer warps: one scale block per thread at most
    warps = max(1, min(launch.num_warps, block_rows * blocks // 32))
    return block_rows, blocks, warps


def nvfp4_steps(row_tiles: int, col_tiles: int, device: torch.device,
                launch: NVFP4Launch) -> int:
    """Tiles per NVFP4 program along its rows: up to ``launch.steps``, fewer while the grid
    would have less than 2 programs per SM, then evened out (7 tiles in 2 programs: 4 + 3, not
    5 + 2)."""
    steps = max(1, min(launch.steps, col_tiles))
    while steps > 1 and row_tiles * triton.cdiv(col_tiles, steps) < 2 * launch.sms(device):
        steps -= 1
    return triton.cdiv(col_tiles, triton.cdiv(col_tiles, steps)) if col_tiles else 1


def _register_cap(maxnreg: Optional[int]) -> dict:
    """Launch options capping the registers per thread (ignored by the interpreter)."""
    return {} if maxnreg is None or hardware.interpreting() else {"maxnreg": maxnreg}


# =============================================================================================
# Launchers
# =============================================================================================

def nvfp4_global_scale(x: torch.Tensor, *, launch: AmaxLaunch = DEFAULT_AMAX) -> torch.Tensor:
    """NVFP4 global encode scale ``448 * 6 / amax(x)``: [1] fp32, 1.0 when amax(x) == 0; a NaN
    in x gives the canonical NaN, an inf 0 (see ``kernels.reference.nvfp4_global_scale``).

    x: [M, H] bf16/fp16/fp32 (any strides). One read of x by a persistent grid, then one
    single-program reduction; the division is IEEE. Deterministic (max is order-independent).
    """
    check_tensor("x", x, dtype=QUANT_INPUT_DTYPES, ndim=2)
    num_rows, hidden = x.shape
    out = torch.empty(1, dtype=torch.float32, device=x.device)
    cols = min(launch.tile_cols, triton.next_power_of_2(max(hidden, 1)))
    block_rows = max(launch.tile_rows, launch.tile_rows * launch.tile_cols // cols)
    num_tiles = triton.cdiv(num_rows, block_rows) * triton.cdiv(hidden, cols)
    num_programs = min(num_tiles, launch.programs_per_sm * launch.sms(x.device))
    partial = torch.empty(max(num_programs, 1), dtype=torch.float32, device=x.device)
    if num_programs:
        amax_partial_kernel[(num_programs,)](x, partial, num_rows, hidden, x.stride(0),
                                             x.stride(1), triton.cdiv(num_tiles, num_programs),
                                             BLOCK_ROWS=block_rows, COLS=cols,
                                             num_warps=launch.num_warps)
    global_scale_finish_kernel[(1,)](partial, out, num_programs,
                                     BLOCK=min(launch.finish_block,
                                               triton.next_power_of_2(max(num_programs, 1))),
                                     num_warps=4)
    return out


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, *, layout: str = "linear",
                   fast_math: bool = False, out: Optional[torch.Tensor] = None,
                   out_scales: Optional[torch.Tensor] = None,
                   rows: Optional[torch.Tensor] = None, check_values: bool = True,
                   launch: NVFP4Launch = DEFAULT_NVFP4) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize rows of ``x``; bit-exact to ``kernels.reference.quantize_nvfp4``, whose
    contract it shares (the arguments, their checks and errors; read its docstring).

    x: [M, H] bf16/fp16/fp32, H % 16 == 0, any strides (read in place when its rows are
        runs of whole element pairs, the usual case; else copied to a contiguous tensor first).
    global_scale: [1] fp32 encode scale on x's device, in [2^-126, 2^126] (read by the kernel).
    layout: "linear", "swizzled_128x4" or "8x4"; the kernel writes this layout directly and
        zeroes its padding.
    fast_math: FlashInfer's default recipe with rcp.approx.ftz.f32 (GPU only).
    out: optional [M', H/2] uint8 buffer; out_scales: optional scale buffer of exactly the
        layout's shape ([M', H/16], or [Mp, Kp] from ``swizzled_scale_shape``), uint8; both
        contiguous on x's device; written and returned.
    rows: optional [M'] int32 row ids (any strides): quantize x[rows] (M' = len(rows), else
        M' = M); UNUSED (-1) gives a zero row.
    check_values: True: read the global scale and the range of rows first (one host sync,
        the oracle's errors). False: no sync (CUDA graphs); a row outside [0, M) then reads as
        a zero row, as on every face.
    launch: the launch rule (:class:`NVFP4Launch`); the default is the fixed rule.
    Returns (packed [M', H/2] uint8, element 2i in the low nibble; scales uint8 e4m3 bits).
    """
    num_rows, padded_rows, padded_blocks = check_quantize_nvfp4_args(
        x, global_scale, layout, out, out_scales, rows)
    if fast_math and not launch.runs_ptx(x.device):
        raise NotImplementedError(
            "fast_math=True needs the GPU instruction rcp.approx.ftz.f32 (inline PTX), which "
            "Triton's interpreter cannot run; use fast_math=False, or a CUDA tensor")
    if check_values:
        check_quantize_nvfp4_values(global_scale, rows, x.shape[0])
    if rows is not None:
        rows = rows.contiguous()
    num_src_rows, hidden = x.shape
    if out is None:
        out = torch.empty((num_rows, hidden // 2), dtype=torch.uint8, device=x.device)
    if out_scales is None:
        out_scales = torch.empty((padded_rows, padded_blocks), dtype=torch.uint8,
                                 device=x.device)
    block_rows, blocks, warps = tile_shape(padded_rows, padded_blocks, NVFP4_BLOCK, x.device,
                                           launch)
    row_tiles = triton.cdiv(padded_rows, block_rows)
    col_tiles = triton.cdiv(padded_blocks, blocks)
    steps = nvfp4_steps(row_tiles, col_tiles, x.device, launch)
    grid = (row_tiles, triton.cdiv(col_tiles, steps))
    if grid[0] * grid[1] == 0:
        return out, out_scales
    words, stride_row, in_kind = as_pairs(x)
    nvfp4_quantize_kernel[grid](
        words, rows if rows is not None else words, global_scale, out, out_scales,
        num_rows, num_src_rows, hidden, stride_row, padded_rows, padded_blocks,
        HAS_ROWS=rows is not None, IN_KIND=in_kind, LAYOUT=LAYOUT_IDS[layout],
        FAST_MATH=fast_math,
        WORD_ASM=nvfp4_word_asm(x.device, in_kind, fast_math, stride_row, launch),
        BLOCK_ROWS=block_rows, BLOCKS=blocks, STEPS=steps, PREFETCH=min(launch.prefetch, steps),
        STORE_POLICY=launch.store_policy, num_warps=warps, **_register_cap(launch.maxnreg),
        enable_fp_fusion=False)
    return out, out_scales


def _quantize_mx(x: torch.Tensor, fp4: bool,
                 launch: BlockLaunch) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of MXFP4 (values [M, H/2] uint8) or MXFP8 (values [M, H] uint8)."""
    check_quant_input(x, MX_BLOCK)
    num_rows, hidden = x.shape
    # MXFP8 writes the two e4m3 bytes of each element pair as one uint16.
    pairs = torch.empty((num_rows, hidden // 2), dtype=torch.uint8 if fp4 else torch.uint16,
                        device=x.device)
    scales = torch.empty((num_rows, hidden // MX_BLOCK), dtype=torch.uint8, device=x.device)
    block_rows, blocks, warps = tile_shape(num_rows, hidden // MX_BLOCK, MX_BLOCK, x.device,
                                           launch)
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden // MX_BLOCK, blocks))
    if grid[0] * grid[1]:
        words, stride_row, in_kind = as_pairs(x)
        mx_quantize_kernel[grid](words, pairs, scales, num_rows, hidden, stride_row,
                                 IN_KIND=in_kind, FP4=fp4,
                                 HARDWARE_E4M3=launch.hardware_e4m3 and launch.runs_ptx(x.device),
                                 WORD_ASM=nvfp4_word_asm(x.device, in_kind, False, None, launch),
                                 BLOCK_ROWS=block_rows, BLOCKS=blocks, num_warps=warps,
                                 enable_fp_fusion=False)
    return pairs.view(torch.uint8), scales


def quantize_mxfp8(x: torch.Tensor, *,
                   launch: BlockLaunch = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize rows of ``x``; bit-exact to ``kernels.reference.quantize_mxfp8``.

    x: [M, H] bf16/fp16/fp32, H % 32 == 0. Returns (values [M, H] float8_e4m3fn,
    scales [M, H/32] uint8 e8m0).
    """
    values, scales = _quantize_mx(x, False, launch)
    return values.view(torch.float8_e4m3fn), scales


def quantize_mxfp4(x: torch.Tensor, *,
                   launch: BlockLaunch = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize rows of ``x``; bit-exact to ``kernels.reference.quantize_mxfp4``.

    x: [M, H] bf16/fp16/fp32, H % 32 == 0. Returns (packed [M, H/2] uint8, element 2i in the
    low nibble; scales [M, H/32] uint8 e8m0).
    """
    return _quantize_mx(x, True, launch)


def _relayout(src: torch.Tensor, dst: torch.Tensor, layout: str, num_rows: int,
              num_blocks: int, swizzle: bool) -> torch.Tensor:
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    cover_rows, cover_blocks = ((padded_rows, padded_blocks) if swizzle
                                else (num_rows, num_blocks))
    block_rows, blocks = 32, 32
    grid = (triton.cdiv(cover_rows, block_rows), triton.cdiv(cover_blocks, blocks))
    if grid[0] * grid[1]:
        scale_layout_kernel[grid](src, dst, num_rows, num_blocks, padded_blocks, cover_rows,
                                  cover_blocks, LAYOUT=LAYOUT_IDS[layout], SWIZZLE=swizzle,
                                  BLOCK_ROWS=block_rows, BLOCKS=blocks, num_warps=4)
    return dst


def swizzle_scales(sf: torch.Tensor, layout: str) -> torch.Tensor:
    """Linear block scales [M, K] uint8 (any strides) -> [Mp, Kp] uint8 in ``layout``, padding
    zero (see ``kernels.reference.swizzle_scales``)."""
    check_swizzle_args(sf, layout)
    sf = sf.contiguous()
    num_rows, num_blocks = sf.shape
    out = torch.empty(swizzled_scale_shape(num_rows, num_blocks, layout), dtype=torch.uint8,
                      device=sf.device)
    return _relayout(sf, out, layout, num_rows, num_blocks, swizzle=True)


def unswizzle_scales(sf_swizzled: torch.Tensor, layout: str, num_rows: int,
                     num_blocks: int) -> torch.Tensor:
    """[Mp, Kp] (or flat) uint8 scales in ``layout``, any strides -> [num_rows, num_blocks]
    linear."""
    check_unswizzle_args(sf_swizzled, layout, num_rows, num_blocks)
    sf_swizzled = sf_swizzled.contiguous()
    out = torch.empty((num_rows, num_blocks), dtype=torch.uint8, device=sf_swizzled.device)
    return _relayout(sf_swizzled, out, layout, num_rows, num_blocks, swizzle=False)


def _dequantize(packed, scales, global_scale, layout, dtype, fmt, hidden, block, launch):
    """The dequantize launch on checked arguments (copied to contiguous tensors here)."""
    packed, scales = packed.contiguous(), scales.contiguous()
    num_rows = packed.shape[0]
    padded_blocks = swizzled_scale_shape(num_rows, hidden // block, layout)[1]
    out = torch.empty((num_rows, hidden), dtype=dtype, device=packed.device)
    block_rows, blocks, warps = tile_shape(num_rows, hidden // block, block, packed.device,
                                           launch)
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden // block, blocks))
    if grid[0] * grid[1]:
        dequantize_kernel[grid](packed, scales, global_scale, out, num_rows, hidden,
                                padded_blocks, FORMAT=fmt, LAYOUT=LAYOUT_IDS[layout],
                                BLOCK_ROWS=block_rows, BLOCKS=blocks, BLOCK=block,
                                num_warps=warps, enable_fp_fusion=False)
    return out


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     layout: str = "linear", dtype: torch.dtype = torch.float32,
                     check_values: bool = True,
                     launch: BlockLaunch = DEFAULT_BLOCK) -> torch.Tensor:
    """[M, H/2] uint8 codes, scales in ``layout`` ([Mp, Kp] or flat), [1] fp32 encode scale
    (any strides) -> [M, H] ``dtype``, ``(e2m1 * f32(sf)) * (1 / gs)``; bit-exact to the
    reference, with its checks (``check_values``: read and check the global scale)."""
    _, hidden = check_dequantize_nvfp4_args(packed, scales, global_scale, layout, dtype)
    if check_values:
        check_global_scale_values(global_scale)
    return _dequantize(packed, scales, global_scale, layout, dtype, 0, hidden, NVFP4_BLOCK,
                       launch)


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32,
                     launch: BlockLaunch = DEFAULT_BLOCK) -> torch.Tensor:
    """[M, H] float8_e4m3fn (or uint8 bits), exactly [M, H/32] e8m0 (any strides) -> [M, H]
    ``dtype``; bit-exact to the reference."""
    _, hidden = check_dequantize_mx_args(values, scales, dtype, fp4=False)
    return _dequantize(values.view(torch.uint8), scales, scales, "linear", dtype, 2, hidden,
                       MX_BLOCK, launch)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32,
                     launch: BlockLaunch = DEFAULT_BLOCK) -> torch.Tensor:
    """[M, H/2] uint8 codes, exactly [M, H/32] e8m0 (any strides) -> [M, H] ``dtype``;
    bit-exact to the reference."""
    _, hidden = check_dequantize_mx_args(packed, scales, dtype, fp4=True)
    return _dequantize(packed, scales, scales, "linear", dtype, 1, hidden, MX_BLOCK, launch)
