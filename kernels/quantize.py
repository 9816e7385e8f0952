"""NVFP4 / MXFP8 / MXFP4 quantization in Triton, bit-exact to ``kernels.reference.quant``.

Same names and arguments as the oracle (read its docstring for the recipes and what FlashInfer
does); the argument checks are ``kernels.spec.quant``'s. The ``@triton.jit`` code lives in
``kernels/quantize_details/``: the number formats and layouts (``formats``), the word reading
and packing (``words``), the kernels (``nvfp4``, ``mx``, ``scales``). This module holds the
launch rules and the launchers.

Launch rule (fixed, no autotune; ``python -m bench.tune`` times the alternatives, passing them
as launch configs): a program quantizes a tile of ``BLOCK_ROWS`` rows by ``BLOCKS`` scale
blocks, about ``tile_elements`` elements with up to ``num_warps`` warps (one scale block per
thread at most); an NVFP4 program walks up to ``steps`` tiles along its rows, loading
``prefetch`` tiles ahead. Two buckets of M (:func:`tile_shape`, :func:`nvfp4_tile_shape`): that
tile where its grid has 2 programs per SM, else one row (and one tile) per program; so a
compiled caller with a dynamic M gets at most two compiled kernels per op, whatever M. The
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
from torch.library import wrap_triton

from kernels import hardware, library, reference
from kernels.quantize_details.mx import dequantize_kernel, mx_quantize_kernel
from kernels.quantize_details.nvfp4 import nvfp4_quantize_kernel
from kernels.quantize_details.scales import (amax_partial_kernel, global_scale_finish_kernel,
                                             scale_layout_kernel)
from kernels.quantize_details.words import as_pairs
from kernels.sizes import cdiv, next_power_of_2
from kernels.spec.quant import (MX_BLOCK, NVFP4_BLOCK, QUANT_INPUT_DTYPES, SCALE_LAYOUTS,
                                check_dequantize_mx_args, check_dequantize_nvfp4_args,
                                check_global_scale_values, check_quant_input,
                                check_quantize_nvfp4_args, check_quantize_nvfp4_values,
                                check_scale_and_quantize_nvfp4_args, check_swizzle_args,
                                check_unswizzle_args, swizzled_scale_shape)
from kernels.spec.launch import checked_launch
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
    num_sms: the SM count the small-M rules aim at; None reads the device's; 0 sets no
             minimum grid (tests walk several tiles per program with it).
    """

    ptx: Optional[bool] = None
    num_sms: Optional[int] = None

    def runs_ptx(self, device: torch.device) -> bool:
        return hardware.can_run_ptx(device) if self.ptx is None else self.ptx

    def sms(self, device: torch.device) -> int:
        return hardware.num_sms(device) if self.num_sms is None else self.num_sms


# Where NVFP4Launch.store_policy may put the packed stores in L2 ("": the default priority).
STORE_POLICIES = ("", "evict_first", "evict_last")


@checked_launch(positive=("steps", "maxnreg"), non_negative=("num_sms",),
                powers_of_two=("tile_elements", "max_blocks"), warps=("num_warps",),
                choices={"prefetch": (1, 2, 3), "store_policy": STORE_POLICIES})
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


@checked_launch(non_negative=("num_sms",), powers_of_two=("tile_elements", "max_blocks"),
                warps=("num_warps",))
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


@checked_launch(positive=("programs_per_sm",), non_negative=("num_sms",),
                powers_of_two=("tile_cols", "tile_rows", "finish_block"), warps=("num_warps",))
class AmaxLaunch(_Target):
    """Launch rule of ``nvfp4_global_scale``: a persistent grid of ``programs_per_sm`` programs
    per SM, each looping over [``tile_rows``, ``tile_cols``] tiles (16 KiB of bf16 per step on
    8 warps: 4 16-byte loads per thread in flight), then one program reduces the per-program
    maxima ``finish_block`` at a time. Two launches, no memset.

    ``overlap_previous``: the caller's promise that the kernel launched just before this op on
    its stream wrote none of x (for example, after the routing, x is the layer's input from
    earlier still). Where the launch uses PDL (SM90+, compiled, not traced), the amax pass then
    reads x while that kernel still runs and waits for it only before its one store. Without
    the promise (the default) it waits first, as every kernel does. A false promise gives
    wrong maxima, not an error: the overlap is the caller's knowledge of its stream. No
    effect without PDL; the same bits either way."""

    tile_cols: int = 1024
    tile_rows: int = 8
    num_warps: int = 8
    programs_per_sm: int = 4
    finish_block: int = 1024
    overlap_previous: bool = False


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


def fills_device(programs: int, device: torch.device, launch) -> bool:
    """Whether a grid of ``programs`` has 2 programs per SM (the launch config's SM count)."""
    return programs >= 2 * launch.sms(device)


def tile_shape(num_rows: int, num_blocks: int, block: int, device: torch.device,
               launch) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCKS, num_warps) for ``num_rows`` rows of ``num_blocks`` blocks, in two
    buckets: the launch config's tile when its grid has 2 programs per SM; else (small M) one
    row per program, so that many programs share the few rows (one big tile per SM would
    leave the latency of its serial work), warps shrunk with the tile (one scale block per
    thread at most). The columns come from H alone and the choice is one comparison on M, so a
    traced M gets one compiled kernel per bucket, not one per M."""
    # int(): the width is static (a traced size is specialised here, as for every constexpr)
    blocks = min(launch.max_blocks, next_power_of_2(max(int(num_blocks), 1)))
    block_rows = max(1, launch.tile_elements // (blocks * block))
    if block_rows > 1 and not fills_device(
            cdiv(num_rows, block_rows) * cdiv(num_blocks, blocks), device, launch):
        block_rows = 1
    warps = max(1, min(launch.num_warps, block_rows * blocks // 32))
    return block_rows, blocks, warps


def nvfp4_tile_shape(num_rows: int, num_blocks: int, device: torch.device,
                     launch: NVFP4Launch) -> tuple[int, int, int, int]:
    """(BLOCK_ROWS, BLOCKS, num_warps, STEPS) of ``quantize_nvfp4``, in two buckets like
    :func:`tile_shape`: the config's tile with up to ``steps`` tiles per program along its rows
    (evened out: 7 tiles in 2 programs are 4 + 3, not 5 + 2) when that grid has 2 programs per
    SM; else one row and one tile per program."""
    block_rows, blocks, steps, small = _nvfp4_config_tile(num_rows, num_blocks, device, launch)
    if small:
        block_rows, steps = 1, 1
    warps = max(1, min(launch.num_warps, block_rows * blocks // 32))
    return block_rows, blocks, warps, steps


def _nvfp4_config_tile(num_rows: int, num_blocks: int, device: torch.device,
                       launch: NVFP4Launch) -> tuple[int, int, int, bool]:
    """(BLOCK_ROWS, BLOCKS, STEPS) of the config's tile and whether M falls in the small-M
    bucket (that tile's grid would not have 2 programs per SM)."""
    # int(): the width is static (a traced size is specialised here, as for every constexpr)
    blocks = min(launch.max_blocks, next_power_of_2(max(int(num_blocks), 1)))
    block_rows = max(1, launch.tile_elements // (blocks * NVFP4_BLOCK))
    col_tiles = cdiv(num_blocks, blocks)
    steps = max(1, min(launch.steps, col_tiles))
    steps = cdiv(col_tiles, cdiv(col_tiles, steps)) if col_tiles else 1
    small = (block_rows > 1 or steps > 1) and not fills_device(
        cdiv(num_rows, block_rows) * cdiv(col_tiles, steps), device, launch)
    return block_rows, blocks, steps, small


def finishes_in_quantize(num_rows: int, num_blocks: int, device: torch.device,
                         launch: NVFP4Launch) -> bool:
    """Whether ``scale_and_quantize_nvfp4`` finishes the global scale inside the quantize's
    programs (2 launches) rather than in the one-program finish launch (3): in the small-M
    bucket of :func:`nvfp4_tile_shape` (T <= 527 at H = 7168 on an H200), the decode sizes,
    where a launch costs more than the work. Past it every one of the quantize's many
    programs would read the amax pass's partial maxima, hundreds of them, before its first
    store: more than the finish launch saves (the overlapped decode chain at T = 2048 was
    slower that way on an H200; the decode rows of bench/results show the chain with the
    rule)."""
    return _nvfp4_config_tile(num_rows, num_blocks, device, launch)[3]


def _register_cap(maxnreg: Optional[int]) -> dict:
    """Launch options capping the registers per thread (ignored by the interpreter)."""
    return {} if maxnreg is None or hardware.interpreting() else {"maxnreg": maxnreg}


# =============================================================================================
# Launchers. Each op: ``_launch_<op>`` (checked arguments; ``traced`` launches through
# ``wrap_triton``, the registered op's body, else the kernels themselves, the eager path), the
# op's two faces and fake (``kernels.library``), and the public function.
# =============================================================================================

def _launch_amax(x: torch.Tensor, launch: AmaxLaunch, traced: bool) -> tuple:
    """The global scale's amax pass: (partial maxima [capacity] fp32, how many it wrote, the
    finish's BLOCK). Every size that is a constexpr or sizes a buffer comes from H, the SM
    count and the config; M only sets the grid (``torch.sym_min``: no branch on M) and the
    loop count."""
    num_rows, hidden = x.shape
    cols = min(launch.tile_cols, next_power_of_2(max(int(hidden), 1)))
    block_rows = max(launch.tile_rows, launch.tile_rows * launch.tile_cols // cols)
    num_tiles = cdiv(num_rows, block_rows) * cdiv(hidden, cols)
    most = max(1, launch.programs_per_sm * launch.sms(x.device))  # the grid's capacity
    num_programs = torch.sym_min(num_tiles, most)
    partial = torch.empty(most, dtype=torch.float32, device=x.device)
    amax = wrap_triton(amax_partial_kernel) if traced else amax_partial_kernel
    if x.numel():
        amax[(num_programs,)](x, partial, num_rows, hidden, x.stride(0), x.stride(1),
                              cdiv(num_tiles, num_programs), BLOCK_ROWS=block_rows,
                              COLS=cols, OVERLAP_PREVIOUS=launch.overlap_previous,
                              num_warps=launch.num_warps,
                              **hardware.grid_dependency(x.device, traced))
    return (partial, num_programs if x.numel() else 0,
            min(launch.finish_block, next_power_of_2(most)))


def _launch_finish(partials: tuple, out: torch.Tensor, traced: bool) -> None:
    """The global scale's one-program finish: ``out`` [1] = the scale of the partials."""
    partial, count, block = partials
    finish = wrap_triton(global_scale_finish_kernel) if traced else global_scale_finish_kernel
    finish[(1,)](partial, out, count, BLOCK=block, num_warps=4,
                 **hardware.grid_dependency(out.device, traced))


def _launch_global_scale(x: torch.Tensor, launch: AmaxLaunch, traced: bool) -> torch.Tensor:
    """The amax pass, then the finish."""
    out = torch.empty(1, dtype=torch.float32, device=x.device)
    _launch_finish(_launch_amax(x, launch, traced), out, traced)
    return out


def _global_scale_face(traced: bool):
    def nvfp4_global_scale_op(x: torch.Tensor, ptx: Optional[bool], num_sms: Optional[int],
                              tile_cols: int, tile_rows: int, num_warps: int,
                              programs_per_sm: int, finish_block: int,
                              overlap_previous: bool) -> torch.Tensor:
        """``moe_a2a::nvfp4_global_scale``: x, then the fields of :class:`AmaxLaunch`."""
        check_tensor("x", x, dtype=QUANT_INPUT_DTYPES, ndim=2)
        launch = AmaxLaunch(ptx, num_sms, tile_cols, tile_rows, num_warps, programs_per_sm,
                            finish_block, overlap_previous)
        return _launch_global_scale(x, launch, traced)
    library.check_config_parameters(nvfp4_global_scale_op, AmaxLaunch)
    return nvfp4_global_scale_op


def _global_scale_torch(x: torch.Tensor) -> torch.Tensor:
    return reference.nvfp4_global_scale(x)


def _global_scale_fake(x, *launch_fields):
    return x.new_empty(1, dtype=torch.float32)


NVFP4_GLOBAL_SCALE = library.register(
    "nvfp4_global_scale", triton=_global_scale_face(True), launch=_global_scale_face(False),
    torch_face=_global_scale_torch, fake=_global_scale_fake)


def nvfp4_global_scale(x: torch.Tensor, *, launch: AmaxLaunch = DEFAULT_AMAX) -> torch.Tensor:
    """NVFP4 global encode scale ``448 * 6 / amax(x)``: [1] fp32, 1.0 when amax(x) == 0; a NaN
    in x gives the canonical NaN, an inf 0 (see ``kernels.reference.nvfp4_global_scale``).

    x: [M, H] bf16/fp16/fp32 (any strides). One read of x by a persistent grid, then one
    single-program reduction; the division is IEEE. Deterministic (max is order-independent).
    Runs the registered op ``moe_a2a::nvfp4_global_scale.triton`` (directly in eager mode).
    """
    check_tensor("x", x, dtype=QUANT_INPUT_DTYPES, ndim=2)
    if library.eager_bypass(x):
        return _launch_global_scale(x, launch, traced=False)
    return NVFP4_GLOBAL_SCALE.triton(x, *library.config_fields(launch))


def _check_nvfp4(x, global_scale, layout, fast_math, out, out_scales, rows, launch):
    """The shared checks and the fast-math device rule; returns (M', Mp, Kp)."""
    shape = check_quantize_nvfp4_args(x, global_scale, layout, out, out_scales, rows)
    _check_fast_math(x, fast_math, launch)
    return shape


def _check_fast_math(x, fast_math, launch):
    """The fast-math device rule: the recipe needs inline PTX."""
    if fast_math and not launch.runs_ptx(x.device):
        raise NotImplementedError(
            "fast_math=True needs the GPU instruction rcp.approx.ftz.f32 (inline PTX), which "
            "Triton's interpreter cannot run; use fast_math=False, or a CUDA tensor")


def _nvfp4_shapes(x, layout, rows):
    """((M', H/2), (Mp, Kp)): the packed codes' and the scales' shapes."""
    num_rows = x.shape[0] if rows is None else rows.shape[0]
    return ((num_rows, x.shape[1] // 2),
            swizzled_scale_shape(num_rows, x.shape[1] // NVFP4_BLOCK, layout))


def _launch_nvfp4(x, global_scale, layout, fast_math, rows, out, out_scales,
                  launch: NVFP4Launch, traced: bool, partials: Optional[tuple] = None,
                  x_ready: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantize launch on checked arguments; ``out`` / ``out_scales`` None: allocated.
    ``traced`` (the registered op's body, which Inductor compiles) stores the block scales by
    ``tl.store``, which Inductor's mutation analysis follows; the eager path keeps the inline
    PTX store on a GPU (``quantize_tile``). The same bits either way. ``partials`` (from
    :func:`_launch_amax`): the kernel computes the global scale from them and writes it to
    ``global_scale`` (the caller writes it where the grid is empty). ``x_ready``: the kernel
    before this launch on the stream did not write x (``scale_and_quantize_nvfp4``: it is the
    op's own global-scale pass); the kernel's first loads of x then precede its wait."""
    packed_shape, scale_shape = _nvfp4_shapes(x, layout, rows)
    num_rows = packed_shape[0]
    padded_rows, padded_blocks = scale_shape
    if rows is not None:
        rows = rows.contiguous()
    num_src_rows, hidden = x.shape
    if out is None:
        out = torch.empty(packed_shape, dtype=torch.uint8, device=x.device)
    if out_scales is None:
        out_scales = torch.empty(scale_shape, dtype=torch.uint8, device=x.device)
    block_rows, blocks, warps, steps = nvfp4_tile_shape(padded_rows, padded_blocks, x.device,
                                                        launch)
    grid = (cdiv(padded_rows, block_rows),
            cdiv(cdiv(padded_blocks, blocks), steps))
    if padded_rows == 0 or padded_blocks == 0:
        return out, out_scales
    words, stride_row, in_kind = as_pairs(x)
    word_asm = nvfp4_word_asm(x.device, in_kind, fast_math, stride_row, launch)
    kernel = wrap_triton(nvfp4_quantize_kernel) if traced else nvfp4_quantize_kernel
    partial, num_partials, partial_block = (global_scale, 0, 16) if partials is None else partials
    kernel[grid](
        words, rows if rows is not None else words, global_scale, out, out_scales,
        num_rows, num_src_rows, hidden, stride_row, padded_rows, padded_blocks, partial,
        num_partials, HAS_ROWS=rows is not None, IN_KIND=in_kind, LAYOUT=LAYOUT_IDS[layout],
        FAST_MATH=fast_math, WORD_ASM=word_asm, STORE_ASM=word_asm and not traced,
        BLOCK_ROWS=block_rows, BLOCKS=blocks, STEPS=steps, PREFETCH=min(launch.prefetch, steps),
        STORE_POLICY=launch.store_policy, SCALE_FROM_PARTIALS=partials is not None,
        PARTIAL_BLOCK=partial_block, X_READY=x_ready, num_warps=warps,
        **_register_cap(launch.maxnreg),
        enable_fp_fusion=False, **hardware.grid_dependency(x.device, traced))
    return out, out_scales


def _nvfp4_face(traced: bool):
    def quantize_nvfp4_op(x: torch.Tensor, global_scale: torch.Tensor, layout: str,
                          fast_math: bool, rows: Optional[torch.Tensor], ptx: Optional[bool],
                          num_sms: Optional[int], tile_elements: int, max_blocks: int,
                          num_warps: int, steps: int, prefetch: int, maxnreg: Optional[int],
                          store_policy: str, word_asm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``moe_a2a::quantize_nvfp4``: the arguments, then the fields of
        :class:`NVFP4Launch` -> (packed [M', H/2] uint8, scales uint8 in ``layout``)."""
        launch = NVFP4Launch(ptx, num_sms, tile_elements, max_blocks, num_warps, steps,
                             prefetch, maxnreg, store_policy, word_asm)
        _check_nvfp4(x, global_scale, layout, fast_math, None, None, rows, launch)
        return _launch_nvfp4(x, global_scale, layout, fast_math, rows, None, None, launch,
                             traced)
    library.check_config_parameters(quantize_nvfp4_op, NVFP4Launch)
    return quantize_nvfp4_op


def _nvfp4_torch(x: torch.Tensor, global_scale: torch.Tensor, layout: str, fast_math: bool,
                 rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_nvfp4(x, global_scale, layout=layout, fast_math=fast_math,
                                    rows=rows, check_values=False)


def _nvfp4_fake(x, global_scale, layout, fast_math, rows, *launch_fields):
    packed_shape, scale_shape = _nvfp4_shapes(x, layout, rows)
    return (x.new_empty(packed_shape, dtype=torch.uint8),
            x.new_empty(scale_shape, dtype=torch.uint8))


QUANTIZE_NVFP4 = library.register("quantize_nvfp4", triton=_nvfp4_face(True),
                                  launch=_nvfp4_face(False), torch_face=_nvfp4_torch,
                                  fake=_nvfp4_fake)


def _nvfp4_out_face(traced: bool):
    def quantize_nvfp4_out_op(x: torch.Tensor, global_scale: torch.Tensor, layout: str,
                              fast_math: bool, rows: Optional[torch.Tensor], out: torch.Tensor,
                              out_scales: torch.Tensor, ptx: Optional[bool],
                              num_sms: Optional[int], tile_elements: int, max_blocks: int,
                              num_warps: int, steps: int, prefetch: int,
                              maxnreg: Optional[int], store_policy: str,
                              word_asm: bool) -> None:
        """``moe_a2a::quantize_nvfp4_out``: ``quantize_nvfp4`` writing the caller's buffers
        ``out`` [M', H/2] and ``out_scales`` (the layout's exact shape), uint8, contiguous."""
        launch = NVFP4Launch(ptx, num_sms, tile_elements, max_blocks, num_warps, steps,
                             prefetch, maxnreg, store_policy, word_asm)
        _check_nvfp4(x, global_scale, layout, fast_math, out, out_scales, rows, launch)
        _launch_nvfp4(x, global_scale, layout, fast_math, rows, out, out_scales, launch, traced)
    library.check_config_parameters(quantize_nvfp4_out_op, NVFP4Launch)
    return quantize_nvfp4_out_op


def _nvfp4_out_torch(x: torch.Tensor, global_scale: torch.Tensor, layout: str, fast_math: bool,
                     rows: Optional[torch.Tensor], out: torch.Tensor,
                     out_scales: torch.Tensor) -> None:
    reference.quantize_nvfp4(x, global_scale, layout=layout, fast_math=fast_math, rows=rows,
                             out=out, out_scales=out_scales, check_values=False)


def _nvfp4_out_fake(x, global_scale, layout, fast_math, rows, out, out_scales, *launch_fields):
    return None


QUANTIZE_NVFP4_OUT = library.register(
    "quantize_nvfp4_out", triton=_nvfp4_out_face(True), launch=_nvfp4_out_face(False),
    torch_face=_nvfp4_out_torch, fake=_nvfp4_out_fake, mutates_args=("out", "out_scales"))
library.register_value_check("quantize_nvfp4", check_quantize_nvfp4_values)


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
    Runs the registered op ``moe_a2a::quantize_nvfp4.triton``, or with ``out`` /
    ``out_scales`` ``moe_a2a::quantize_nvfp4_out.triton`` (the missing buffer allocated
    here); directly in eager mode.
    """
    _check_nvfp4(x, global_scale, layout, fast_math, out, out_scales, rows, launch)
    if check_values:
        library.run_value_check("quantize_nvfp4", [global_scale, rows], [x.shape[0]])
    bypass = library.eager_bypass(x, global_scale, rows, out, out_scales)
    if out is None and out_scales is None:
        if bypass:
            return _launch_nvfp4(x, global_scale, layout, fast_math, rows, None, None, launch,
                                 traced=False)
        return QUANTIZE_NVFP4.triton(x, global_scale, layout, fast_math, rows,
                                     *library.config_fields(launch))
    packed_shape, scale_shape = _nvfp4_shapes(x, layout, rows)
    if out is None:
        out = torch.empty(packed_shape, dtype=torch.uint8, device=x.device)
    if out_scales is None:
        out_scales = torch.empty(scale_shape, dtype=torch.uint8, device=x.device)
    if bypass:
        return _launch_nvfp4(x, global_scale, layout, fast_math, rows, out, out_scales, launch,
                             traced=False)
    QUANTIZE_NVFP4_OUT.triton(x, global_scale, layout, fast_math, rows, out, out_scales,
                              *library.config_fields(launch))
    return out, out_scales


def _launch_scale_and_quantize(x, layout, fast_math, amax_launch: AmaxLaunch,
                               launch: NVFP4Launch, traced: bool) -> tuple:
    """``scale_and_quantize_nvfp4`` on checked arguments: the amax pass, then the quantize,
    which finishes the global scale itself where :func:`finishes_in_quantize` says so (two
    launches; the finish kernel as well only where the quantize grid is empty, M = 0), else
    after the finish kernel (three)."""
    padded_rows, padded_blocks = _nvfp4_shapes(x, layout, None)[1]
    partials = _launch_amax(x, amax_launch, traced)
    global_scale = torch.empty(1, dtype=torch.float32, device=x.device)
    if not finishes_in_quantize(padded_rows, padded_blocks, x.device, launch):
        _launch_finish(partials, global_scale, traced)
        return _launch_nvfp4(x, global_scale, layout, fast_math, None, None, None, launch,
                             traced, x_ready=True) + (global_scale,)
    packed, scales = _launch_nvfp4(x, global_scale, layout, fast_math, None, None, None,
                                   launch, traced, partials, x_ready=True)
    if padded_rows == 0 or padded_blocks == 0:  # no quantize program ran
        _launch_finish(partials, global_scale, traced)
    return packed, scales, global_scale


def _check_scale_and_quantize(x, layout, fast_math, launch):
    check_scale_and_quantize_nvfp4_args(x, layout)
    _check_fast_math(x, fast_math, launch)


def _scale_and_quantize_face(traced: bool):
    def scale_and_quantize_nvfp4_op(
            x: torch.Tensor, layout: str, fast_math: bool, amax_ptx: Optional[bool],
            amax_num_sms: Optional[int], amax_tile_cols: int, amax_tile_rows: int,
            amax_num_warps: int, amax_programs_per_sm: int, amax_finish_block: int,
            amax_overlap_previous: bool, ptx: Optional[bool], num_sms: Optional[int],
            tile_elements: int, max_blocks: int, num_warps: int, steps: int, prefetch: int,
            maxnreg: Optional[int], store_policy: str, word_asm: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``moe_a2a::scale_and_quantize_nvfp4``: the arguments, the fields of
        :class:`AmaxLaunch` (prefixed ``amax_``), then those of :class:`NVFP4Launch` ->
        (packed [M, H/2] uint8, scales uint8 in ``layout``, global_scale [1] fp32)."""
        amax_launch = AmaxLaunch(amax_ptx, amax_num_sms, amax_tile_cols, amax_tile_rows,
                                 amax_num_warps, amax_programs_per_sm, amax_finish_block,
                                 amax_overlap_previous)
        launch = NVFP4Launch(ptx, num_sms, tile_elements, max_blocks, num_warps, steps,
                             prefetch, maxnreg, store_policy, word_asm)
        _check_scale_and_quantize(x, layout, fast_math, launch)
        return _launch_scale_and_quantize(x, layout, fast_math, amax_launch, launch, traced)
    library.check_config_parameters(scale_and_quantize_nvfp4_op, AmaxLaunch, NVFP4Launch,
                                    prefixes=("amax_", ""))
    return scale_and_quantize_nvfp4_op


def _scale_and_quantize_torch(x: torch.Tensor, layout: str, fast_math: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.scale_and_quantize_nvfp4(x, layout=layout, fast_math=fast_math,
                                              check_values=False)


def _scale_and_quantize_fake(x, layout, fast_math, *launch_fields):
    packed_shape, scale_shape = _nvfp4_shapes(x, layout, None)
    return (x.new_empty(packed_shape, dtype=torch.uint8),
            x.new_empty(scale_shape, dtype=torch.uint8), x.new_empty(1, dtype=torch.float32))


SCALE_AND_QUANTIZE_NVFP4 = library.register(
    "scale_and_quantize_nvfp4", triton=_scale_and_quantize_face(True),
    launch=_scale_and_quantize_face(False), torch_face=_scale_and_quantize_torch,
    fake=_scale_and_quantize_fake)
library.register_value_check("scale_and_quantize_nvfp4", check_global_scale_values)


def scale_and_quantize_nvfp4(x: torch.Tensor, *, layout: str = "linear",
                             fast_math: bool = False, check_values: bool = True,
                             amax_launch: AmaxLaunch = DEFAULT_AMAX,
                             launch: NVFP4Launch = DEFAULT_NVFP4
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`nvfp4_global_scale` and :func:`quantize_nvfp4` with it, in two launches instead of
    three at decode sizes: the amax pass (``amax_launch``), then the quantize (``launch``),
    each of whose programs finishes the global scale from the amax pass's partial maxima
    itself (one program also writes it out); past them (:func:`finishes_in_quantize`) the
    three launches of the two ops. Bit-exact to ``kernels.reference.scale_and_quantize_nvfp4``,
    whose contract it shares (read its docstring): x [M, H] bf16/fp16/fp32, H % 16 == 0, any
    strides; layout; fast_math (GPU only). check_values: True reads the global scale after
    the launches (one host sync) and raises the oracle's ValueError for one outside
    [2^-126, 2^126]; False: no sync (CUDA graphs).
    Returns (packed [M, H/2] uint8, scales uint8 e4m3 bits in ``layout``, global_scale [1]
    fp32). Runs the registered op ``moe_a2a::scale_and_quantize_nvfp4.triton`` (directly in
    eager mode)."""
    _check_scale_and_quantize(x, layout, fast_math, launch)
    if library.eager_bypass(x):
        result = _launch_scale_and_quantize(x, layout, fast_math, amax_launch, launch,
                                            traced=False)
    else:
        result = SCALE_AND_QUANTIZE_NVFP4.triton(x, layout, fast_math,
                                                 *library.config_fields(amax_launch),
                                                 *library.config_fields(launch))
    if check_values:
        library.run_value_check("scale_and_quantize_nvfp4", [result[2]], [])
    return result


def _launch_mx(x: torch.Tensor, fp4: bool, launch: BlockLaunch,
               traced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of MXFP4 (values [M, H/2] uint8) or MXFP8 (values [M, H] uint8) on a
    checked x."""
    num_rows, hidden = x.shape
    # MXFP8 writes the two e4m3 bytes of each element pair as one uint16.
    pairs = torch.empty((num_rows, hidden // 2), dtype=torch.uint8 if fp4 else torch.uint16,
                        device=x.device)
    scales = torch.empty((num_rows, hidden // MX_BLOCK), dtype=torch.uint8, device=x.device)
    block_rows, blocks, warps = tile_shape(num_rows, hidden // MX_BLOCK, MX_BLOCK, x.device,
                                           launch)
    grid = (cdiv(num_rows, block_rows), cdiv(hidden // MX_BLOCK, blocks))
    if num_rows and hidden:
        words, stride_row, in_kind = as_pairs(x)
        kernel = wrap_triton(mx_quantize_kernel) if traced else mx_quantize_kernel
        kernel[grid](words, pairs, scales, num_rows, hidden, stride_row, IN_KIND=in_kind,
                     FP4=fp4, HARDWARE_E4M3=launch.hardware_e4m3 and launch.runs_ptx(x.device),
                     WORD_ASM=nvfp4_word_asm(x.device, in_kind, False, None, launch),
                     BLOCK_ROWS=block_rows, BLOCKS=blocks, num_warps=warps,
                     enable_fp_fusion=False, **hardware.grid_dependency(x.device, traced))
    return pairs.view(torch.uint8), scales


def _mx_face(fp4: bool, traced: bool):
    def quantize_mx_op(x: torch.Tensor, ptx: Optional[bool], num_sms: Optional[int],
                       tile_elements: int, max_blocks: int, num_warps: int,
                       hardware_e4m3: bool, word_asm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``moe_a2a::quantize_mxfp4`` / ``quantize_mxfp8``: x, then the fields of
        :class:`BlockLaunch` -> (packed [M, H/2] uint8 / values [M, H] float8_e4m3fn,
        scales [M, H/32] uint8 e8m0)."""
        check_quant_input(x, MX_BLOCK)
        launch = BlockLaunch(ptx, num_sms, tile_elements, max_blocks, num_warps,
                             hardware_e4m3, word_asm)
        values, scales = _launch_mx(x, fp4, launch, traced)
        return (values if fp4 else values.view(torch.float8_e4m3fn)), scales
    library.check_config_parameters(quantize_mx_op, BlockLaunch)
    return quantize_mx_op


def _mxfp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_mxfp8(x)


def _mxfp4_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize_mxfp4(x)


def _mxfp8_fake(x, *launch_fields):
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((x.shape[0], x.shape[1] // MX_BLOCK), dtype=torch.uint8))


def _mxfp4_fake(x, *launch_fields):
    return (x.new_empty((x.shape[0], x.shape[1] // 2), dtype=torch.uint8),
            x.new_empty((x.shape[0], x.shape[1] // MX_BLOCK), dtype=torch.uint8))


QUANTIZE_MXFP8 = library.register("quantize_mxfp8", triton=_mx_face(False, True),
                                  launch=_mx_face(False, False), torch_face=_mxfp8_torch,
                                  fake=_mxfp8_fake)
QUANTIZE_MXFP4 = library.register("quantize_mxfp4", triton=_mx_face(True, True),
                                  launch=_mx_face(True, False), torch_face=_mxfp4_torch,
                                  fake=_mxfp4_fake)


def quantize_mxfp8(x: torch.Tensor, *,
                   launch: BlockLaunch = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize rows of ``x``; bit-exact to ``kernels.reference.quantize_mxfp8``.

    x: [M, H] bf16/fp16/fp32, H % 32 == 0. Returns (values [M, H] float8_e4m3fn,
    scales [M, H/32] uint8 e8m0). Runs ``moe_a2a::quantize_mxfp8.triton`` (directly in eager
    mode).
    """
    check_quant_input(x, MX_BLOCK)
    if library.eager_bypass(x):
        values, scales = _launch_mx(x, False, launch, traced=False)
        return values.view(torch.float8_e4m3fn), scales
    return QUANTIZE_MXFP8.triton(x, *library.config_fields(launch))


def quantize_mxfp4(x: torch.Tensor, *,
                   launch: BlockLaunch = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize rows of ``x``; bit-exact to ``kernels.reference.quantize_mxfp4``.

    x: [M, H] bf16/fp16/fp32, H % 32 == 0. Returns (packed [M, H/2] uint8, element 2i in the
    low nibble; scales [M, H/32] uint8 e8m0). Runs ``moe_a2a::quantize_mxfp4.triton``
    (directly in eager mode).
    """
    check_quant_input(x, MX_BLOCK)
    if library.eager_bypass(x):
        return _launch_mx(x, True, launch, traced=False)
    return QUANTIZE_MXFP4.triton(x, *library.config_fields(launch))


def _launch_relayout(src: torch.Tensor, layout: str, num_rows: int, num_blocks: int,
                     swizzle: bool, traced: bool) -> torch.Tensor:
    """Swizzle (linear [M, K] -> [Mp, Kp] in ``layout``) or unswizzle contiguous ``src``."""
    padded_rows, padded_blocks = swizzled_scale_shape(num_rows, num_blocks, layout)
    shape = (padded_rows, padded_blocks) if swizzle else (num_rows, num_blocks)
    dst = torch.empty(shape, dtype=torch.uint8, device=src.device)
    cover_rows, cover_blocks = shape
    block_rows, blocks = 32, 32
    grid = (cdiv(cover_rows, block_rows), cdiv(cover_blocks, blocks))
    if cover_rows and cover_blocks:
        kernel = wrap_triton(scale_layout_kernel) if traced else scale_layout_kernel
        kernel[grid](src, dst, num_rows, num_blocks, padded_blocks, cover_rows, cover_blocks,
                     LAYOUT=LAYOUT_IDS[layout], SWIZZLE=swizzle, BLOCK_ROWS=block_rows,
                     BLOCKS=blocks, num_warps=4, **hardware.grid_dependency(src.device, traced))
    return dst


def _swizzle_face(traced: bool):
    def swizzle_scales_op(sf: torch.Tensor, layout: str) -> torch.Tensor:
        """``moe_a2a::swizzle_scales``: linear [M, K] uint8 -> [Mp, Kp] in ``layout``."""
        check_swizzle_args(sf, layout)
        return _launch_relayout(sf.contiguous(), layout, sf.shape[0], sf.shape[1], True,
                                traced)
    return swizzle_scales_op


def _swizzle_torch(sf: torch.Tensor, layout: str) -> torch.Tensor:
    return reference.swizzle_scales(sf, layout)


def _swizzle_fake(sf, layout):
    return sf.new_empty(swizzled_scale_shape(sf.shape[0], sf.shape[1], layout))


SWIZZLE_SCALES = library.register("swizzle_scales", triton=_swizzle_face(True),
                                  launch=_swizzle_face(False), torch_face=_swizzle_torch,
                                  fake=_swizzle_fake)


def swizzle_scales(sf: torch.Tensor, layout: str) -> torch.Tensor:
    """Linear block scales [M, K] uint8 (any strides) -> [Mp, Kp] uint8 in ``layout``, padding
    zero (see ``kernels.reference.swizzle_scales``); ``moe_a2a::swizzle_scales.triton``."""
    check_swizzle_args(sf, layout)
    if library.eager_bypass(sf):
        return _launch_relayout(sf.contiguous(), layout, sf.shape[0], sf.shape[1], True,
                                traced=False)
    return SWIZZLE_SCALES.triton(sf, layout)


def _unswizzle_face(traced: bool):
    def unswizzle_scales_op(sf_swizzled: torch.Tensor, layout: str, num_rows: int,
                            num_blocks: int) -> torch.Tensor:
        """``moe_a2a::unswizzle_scales``: [Mp, Kp] (or flat) in ``layout`` ->
        [num_rows, num_blocks] linear."""
        check_unswizzle_args(sf_swizzled, layout, num_rows, num_blocks)
        return _launch_relayout(sf_swizzled.contiguous(), layout, num_rows, num_blocks, False,
                                traced)
    return unswizzle_scales_op


def _unswizzle_torch(sf_swizzled: torch.Tensor, layout: str, num_rows: int,
                     num_blocks: int) -> torch.Tensor:
    return reference.unswizzle_scales(sf_swizzled, layout, num_rows, num_blocks)


def _unswizzle_fake(sf_swizzled, layout, num_rows, num_blocks):
    return sf_swizzled.new_empty((num_rows, num_blocks))


UNSWIZZLE_SCALES = library.register("unswizzle_scales", triton=_unswizzle_face(True),
                                    launch=_unswizzle_face(False), torch_face=_unswizzle_torch,
                                    fake=_unswizzle_fake)


def unswizzle_scales(sf_swizzled: torch.Tensor, layout: str, num_rows: int,
                     num_blocks: int) -> torch.Tensor:
    """[Mp, Kp] (or flat) uint8 scales in ``layout``, any strides -> [num_rows, num_blocks]
    linear; ``moe_a2a::unswizzle_scales.triton``."""
    check_unswizzle_args(sf_swizzled, layout, num_rows, num_blocks)
    if library.eager_bypass(sf_swizzled):
        return _launch_relayout(sf_swizzled.contiguous(), layout, num_rows, num_blocks, False,
                                traced=False)
    return UNSWIZZLE_SCALES.triton(sf_swizzled, layout, num_rows, num_blocks)


def _launch_dequantize(packed, scales, global_scale, layout, dtype, fmt, hidden, block,
                       launch, traced):
    """The dequantize launch on checked arguments (copied to contiguous tensors here)."""
    packed, scales = packed.contiguous(), scales.contiguous()
    num_rows = packed.shape[0]
    padded_blocks = swizzled_scale_shape(num_rows, hidden // block, layout)[1]
    out = torch.empty((num_rows, hidden), dtype=dtype, device=packed.device)
    block_rows, blocks, warps = tile_shape(num_rows, hidden // block, block, packed.device,
                                           launch)
    grid = (cdiv(num_rows, block_rows), cdiv(hidden // block, blocks))
    if num_rows and hidden:
        kernel = wrap_triton(dequantize_kernel) if traced else dequantize_kernel
        kernel[grid](packed, scales, global_scale, out, num_rows, hidden, padded_blocks,
                     FORMAT=fmt, LAYOUT=LAYOUT_IDS[layout], BLOCK_ROWS=block_rows,
                     BLOCKS=blocks, BLOCK=block, num_warps=warps, enable_fp_fusion=False,
                     **hardware.grid_dependency(packed.device, traced))
    return out


def _dequantize_nvfp4_face(traced: bool):
    def dequantize_nvfp4_op(packed: torch.Tensor, scales: torch.Tensor,
                            global_scale: torch.Tensor, layout: str, dtype: torch.dtype,
                            ptx: Optional[bool], num_sms: Optional[int], tile_elements: int,
                            max_blocks: int, num_warps: int, hardware_e4m3: bool,
                            word_asm: bool) -> torch.Tensor:
        """``moe_a2a::dequantize_nvfp4``: the arguments, then the fields of
        :class:`BlockLaunch` -> [M, H] ``dtype``."""
        _, hidden = check_dequantize_nvfp4_args(packed, scales, global_scale, layout, dtype)
        launch = BlockLaunch(ptx, num_sms, tile_elements, max_blocks, num_warps,
                             hardware_e4m3, word_asm)
        return _launch_dequantize(packed, scales, global_scale, layout, dtype, 0, hidden,
                                  NVFP4_BLOCK, launch, traced)
    library.check_config_parameters(dequantize_nvfp4_op, BlockLaunch)
    return dequantize_nvfp4_op


def _dequantize_nvfp4_torch(packed: torch.Tensor, scales: torch.Tensor,
                            global_scale: torch.Tensor, layout: str,
                            dtype: torch.dtype) -> torch.Tensor:
    return reference.dequantize_nvfp4(packed, scales, global_scale, layout=layout, dtype=dtype,
                                      check_values=False)


def _dequantize_nvfp4_fake(packed, scales, global_scale, layout, dtype, *launch_fields):
    return packed.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=dtype)


DEQUANTIZE_NVFP4 = library.register(
    "dequantize_nvfp4", triton=_dequantize_nvfp4_face(True),
    launch=_dequantize_nvfp4_face(False), torch_face=_dequantize_nvfp4_torch,
    fake=_dequantize_nvfp4_fake)
library.register_value_check("dequantize_nvfp4", check_global_scale_values)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     layout: str = "linear", dtype: torch.dtype = torch.float32,
                     check_values: bool = True,
                     launch: BlockLaunch = DEFAULT_BLOCK) -> torch.Tensor:
    """[M, H/2] uint8 codes, scales in ``layout`` ([Mp, Kp] or flat), [1] fp32 encode scale
    (any strides) -> [M, H] ``dtype``, ``(e2m1 * f32(sf)) * (1 / gs)``; bit-exact to the
    reference, with its checks (``check_values``: read and check the global scale);
    ``moe_a2a::dequantize_nvfp4.triton``."""
    _, hidden = check_dequantize_nvfp4_args(packed, scales, global_scale, layout, dtype)
    if check_values:
        library.run_value_check("dequantize_nvfp4", [global_scale], [])
    if library.eager_bypass(packed, scales, global_scale):
        return _launch_dequantize(packed, scales, global_scale, layout, dtype, 0, hidden,
                                  NVFP4_BLOCK, launch, traced=False)
    return DEQUANTIZE_NVFP4.triton(packed, scales, global_scale, layout, dtype,
                                   *library.config_fields(launch))


def _dequantize_mx_face(fp4: bool, traced: bool):
    def dequantize_mx_op(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                         ptx: Optional[bool], num_sms: Optional[int], tile_elements: int,
                         max_blocks: int, num_warps: int, hardware_e4m3: bool,
                         word_asm: bool) -> torch.Tensor:
        """``moe_a2a::dequantize_mxfp4`` (codes [M, H/2] uint8) / ``dequantize_mxfp8``
        (codes [M, H] float8_e4m3fn or uint8), scales [M, H/32] e8m0, then the fields of
        :class:`BlockLaunch` -> [M, H] ``dtype``."""
        _, hidden = check_dequantize_mx_args(codes, scales, dtype, fp4=fp4)
        launch = BlockLaunch(ptx, num_sms, tile_elements, max_blocks, num_warps,
                             hardware_e4m3, word_asm)
        return _launch_dequantize(codes.view(torch.uint8), scales, scales, "linear", dtype,
                                  1 if fp4 else 2, hidden, MX_BLOCK, launch, traced)
    library.check_config_parameters(dequantize_mx_op, BlockLaunch)
    return dequantize_mx_op


def _dequantize_mxfp8_torch(codes: torch.Tensor, scales: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    return reference.dequantize_mxfp8(codes, scales, dtype=dtype)


def _dequantize_mxfp4_torch(codes: torch.Tensor, scales: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    return reference.dequantize_mxfp4(codes, scales, dtype=dtype)


def _dequantize_mx_fake(codes, scales, dtype, *launch_fields):
    return codes.new_empty((codes.shape[0], scales.shape[1] * MX_BLOCK), dtype=dtype)


DEQUANTIZE_MXFP8 = library.register(
    "dequantize_mxfp8", triton=_dequantize_mx_face(False, True),
    launch=_dequantize_mx_face(False, False), torch_face=_dequantize_mxfp8_torch,
    fake=_dequantize_mx_fake)
DEQUANTIZE_MXFP4 = library.register(
    "dequantize_mxfp4", triton=_dequantize_mx_face(True, True),
    launch=_dequantize_mx_face(True, False), torch_face=_dequantize_mxfp4_torch,
    fake=_dequantize_mx_fake)


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32,
                     launch: BlockLaunch = DEFAULT_BLOCK) -> torch.Tensor:
    """[M, H] float8_e4m3fn (or uint8 bits), exactly [M, H/32] e8m0 (any strides) -> [M, H]
    ``dtype``; bit-exact to the reference; ``moe_a2a::dequantize_mxfp8.triton``."""
    _, hidden = check_dequantize_mx_args(values, scales, dtype, fp4=False)
    if library.eager_bypass(values, scales):
        return _launch_dequantize(values.view(torch.uint8), scales, scales, "linear", dtype, 2,
                                  hidden, MX_BLOCK, launch, traced=False)
    return DEQUANTIZE_MXFP8.triton(values, scales, dtype, *library.config_fields(launch))


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32,
                     launch: BlockLaunch = DEFAULT_BLOCK) -> torch.Tensor:
    """[M, H/2] uint8 codes, exactly [M, H/32] e8m0 (any strides) -> [M, H] ``dtype``;
    bit-exact to the reference; ``moe_a2a::dequantize_mxfp4.triton``."""
    _, hidden = check_dequantize_mx_args(packed, scales, dtype, fp4=True)
    if library.eager_bypass(packed, scales):
        return _launch_dequantize(packed, scales, scales, "linear", dtype, 1, hidden, MX_BLOCK,
                                  launch, traced=False)
    return DEQUANTIZE_MXFP4.triton(packed, scales, dtype, *library.config_fields(launch))
