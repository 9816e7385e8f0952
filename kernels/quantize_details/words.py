"""Reading x as words of two elements, and packing codes back into words, for the quantize
kernels (``@triton.jit`` helpers, plus :func:`as_pairs`, the host-side view they read).

x is read as words of two elements (int32 for bf16/fp16, int64 for fp32; :func:`as_pairs`): a
word's two elements become two fp32 values by bit operations, and their two codes one packed
byte (FP4) or one uint16 (MXFP8) at the word's index, so no tensor is split or reshaped. On a GPU,
NVFP4 of bf16/fp16 (IEEE recipe) can go further (the launch option ``word_asm``): the block amax
is taken on the packed pairs (``max.NaN.xorsign.abs.bf16x2``), and inline PTX turns 4 words into
4 packed bytes, signs included (:func:`e2m1_words`); the portable path computes the same in
Triton. MXFP8 elements on a GPU can use ``cvt.rn.satfinite.e4m3x2.f32`` (SM89+, the same
RNE-satfinite; launch option ``hardware_e4m3``) through inline PTX, one instruction per pair.
Not Triton's fp32 -> fp8e4nv cast: with Triton 3.6 it gave wrong codes on block-reduced
(sliced-layout) tensors on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quantize_details.formats import E4M3_MAX_C, e2m1_code, e4m3_code, max_nan


@triton.jit
def load_tile(x_ptr, row_start, col_start, num_rows, hidden, stride_row, stride_col,
              BLOCK_ROWS: tl.constexpr, COLS: tl.constexpr):
    """Rows [row_start, +BLOCK_ROWS) and columns [col_start, +COLS) of x as fp32 (zeros
    outside x)."""
    rows = row_start + tl.arange(0, BLOCK_ROWS)
    cols = col_start + tl.arange(0, COLS)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_row
                + cols[None, :].to(tl.int64) * stride_col, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def source_rows(rows_ptr, rows, num_rows, num_src_rows, HAS_ROWS: tl.constexpr):
    """(int64 rows of x to read, their mask) for output rows ``rows``: the rows themselves, or
    gathered through rows_ptr when HAS_ROWS (an id outside [0, num_src_rows) is masked, i.e.
    reads as a zero row)."""
    row_ok = rows < num_rows
    if HAS_ROWS:
        src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        return src, row_ok & (src >= 0) & (src < num_src_rows)
    return rows.to(tl.int64), row_ok


@triton.jit
def load_words(row_ptrs, row_ok, block_start, num_blocks, FIRST: tl.constexpr,
               BLOCKS: tl.constexpr, PAIRS: tl.constexpr, WIDTH: tl.constexpr):
    """Words [FIRST, FIRST + WIDTH) of scale blocks [block_start, +BLOCKS) (PAIRS words per
    block) of the rows starting at ``row_ptrs`` ([R] pointers into x read as words of two
    elements: int32 for bf16/fp16, int64 for fp32). Returns (words [R, BLOCKS, WIDTH], their
    int32 offsets [1, BLOCKS, WIDTH] within a row, which are the packed FP4 byte offsets too).
    Masked rows and blocks read zeros.

    A kernel reads a block in parts of WIDTH = 4 words (one 16-byte load): each thread then
    holds whole blocks, so the block reductions, the per-block scale math (done once per
    block, not once per thread sharing it) and the nibble packing need no data exchange."""
    blocks = block_start + tl.arange(0, BLOCKS)
    offsets = word_offsets(block_start, FIRST, BLOCKS, PAIRS, WIDTH)
    mask = row_ok[:, None, None] & (blocks < num_blocks)[None, :, None]
    return tl.load(row_ptrs[:, None, None] + offsets, mask=mask, other=0), offsets


@triton.jit
def word_offsets(block_start, FIRST: tl.constexpr, BLOCKS: tl.constexpr, PAIRS: tl.constexpr,
                 WIDTH: tl.constexpr):
    """The int32 offsets [1, BLOCKS, WIDTH] within a row of words [FIRST, FIRST + WIDTH) of
    scale blocks [block_start, +BLOCKS) (``load_words``'s second result). A kernel that stores
    at these offsets computes them itself rather than taking them from ``load_words``: an
    address from a helper that was given a pointer makes Inductor's mutation analysis count
    that pointer's tensor as written."""
    blocks = block_start + tl.arange(0, BLOCKS)
    return (blocks * PAIRS + FIRST)[None, :, None] + tl.arange(0, WIDTH)[None, None, :]


@triton.jit
def unpack_words(w, IN_KIND: tl.constexpr):
    """fp32 (lo, hi): elements 2i and 2i + 1 of words ``w`` (IN_KIND 0: bf16, 1: fp16 pairs
    in an int32; 2: fp32 pairs in an int64)."""
    if IN_KIND == 0:  # bf16: the fp32 bits are the bf16 bits followed by 16 zero bits
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:  # fp16
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # fp32 pairs in an int64
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def pair_amax(lo, hi):
    """Per-block amax of [R, B, W] element pairs: [R, B]. NaN propagates, as in torch.amax
    (``tl.max`` would skip it)."""
    return tl.reduce(max_nan(tl.abs(lo), tl.abs(hi)), 2, max_nan)


@triton.jit
def e2m1_pairs(lo, hi, scale):
    """Packed FP4 bytes of element pairs times ``scale``: element 2i low nibble."""
    return (e2m1_code(lo * scale) | (e2m1_code(hi * scale) << 4)).to(tl.uint8)


def e2m1_words_ptx(in_kind: int) -> str:
    """PTX of ``e2m1_words`` for bf16 (in_kind 0) or fp16 (1) words: operands $0 (out: 4
    packed FP4 bytes), $1-$4 the words, $5-$8 the block's out_scale, $9-$12 / $13-$16 the
    sign masks of the low / high elements (0x08080808 / 0x80808080, or 0 in a NaN block;
    $9 and $13 stand for all 4 words, which are one block's: see ``_word_asm``).

    Per element: unpack, y = x * scale (mul.rn), the three candidates of
    ``e2m1_magnitude_bits`` (two fma.rn and one add.rn on |y|), their minimum capped at
    2^23 + 7 (min.s32), and one mad.lo that adds those bits at the nibble's position; the
    2^23 base of all eight is taken off by starting the sum at its negation (mod 2^32). The
    signs are the words' own sign bits (bits 15 and 31): prmt replicates each into a byte
    (selector nibble 8 + byte), two more prmt gather the low and high elements' signs by
    pair, and the masks keep bit 3 / bit 7 of each byte. y = +-0 keeps x's sign; y is NaN
    only when the block's scale is (IEEE recipe), where the mask drops the signs, as the
    GPU's NaN product has none. Integer work: the three min.s32 (two instructions on SM90,
    a 3-input min and the cap) per element and 6 instructions per 8 elements; the rest runs
    on the FMA pipe."""
    base = (-(0x4B000000 * 0x11111111)) % (1 << 32)
    lines = ["{", ".reg .b32 lo, hi, y, f0, f1, f2, c, acc, sa, sb, s;", ".reg .b16 h0, h1;",
             f"mov.b32 acc, {base};"]
    for k in range(4):
        word = f"${1 + k}"
        if in_kind == 0:
            lines += [f"shl.b32 lo, {word}, 16;", f"and.b32 hi, {word}, -65536;"]
        else:
            lines += [f"mov.b32 {{h0, h1}}, {word};", "cvt.f32.f16 lo, h0;", "cvt.f32.f16 hi, h1;"]
        for element, shift in (("lo", 8 * k), ("hi", 8 * k + 4)):
            lines += [f"mul.rn.f32 y, {element}, ${5 + k};", "abs.f32 y, y;",
                      "fma.rn.f32 f0, y, 0f40000000, 0f4B000000;",
                      "add.rn.f32 f1, y, 0f4B000002;",
                      "fma.rn.f32 f2, y, 0f3F000000, 0f4B000004;",
                      "min.s32 c, f0, f1;", "min.s32 c, c, f2;", "min.s32 c, c, 0x4B000007;",
                      f"mad.lo.u32 acc, c, {1 << shift}, acc;"]
    lines += ["prmt.b32 sa, $1, $2, 0xFBD9;", "prmt.b32 sb, $3, $4, 0xFBD9;",
              "prmt.b32 s, sa, sb, 0x5410;", "and.b32 s, s, $9;", "or.b32 acc, acc, s;",
              "prmt.b32 s, sa, sb, 0x7632;", "and.b32 s, s, $13;", "or.b32 $0, acc, s;", "}"]
    return " ".join(lines)


_E2M1_WORDS_PTX = tl.constexpr(e2m1_words_ptx(0))


_E2M1_WORDS_PTX_F16 = tl.constexpr(e2m1_words_ptx(1))


_E2M1_WORDS_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 4 + ["f"] * 4 + ["r"] * 8))


@triton.jit
def e2m1_words(w, scale, sign_lo, sign_hi, IN_KIND: tl.constexpr):
    """[R, B, 4] int32 words of bf16/fp16 pairs times ``scale`` ([R, B, 4] fp32, one value
    per block) -> [R, B, 4] packed FP4 bytes (uint8), by inline PTX (``e2m1_words_ptx``) on
    each thread's 4 consecutive words; GPU only. ``sign_lo``/``sign_hi``: [R, B, 4] int32
    masks, 0x08080808 / 0x80808080 to keep the signs, 0 in blocks whose scale is NaN."""
    return tl.inline_asm_elementwise(_E2M1_WORDS_PTX if IN_KIND == 0 else _E2M1_WORDS_PTX_F16,
                                     _E2M1_WORDS_CONSTRAINTS, [w, scale, sign_lo, sign_hi],
                                     dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def bf16x2_absmax(a, b):
    """Per 16-bit half: max(|a|, |b|) of bf16 pairs, NaN propagating (sign bits: the xor of
    the inputs', not meaningful)."""
    return tl.inline_asm_elementwise("max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r",
                                     [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def f16x2_absmax(a, b):
    """``bf16x2_absmax`` for fp16 pairs."""
    return tl.inline_asm_elementwise("max.NaN.xorsign.abs.f16x2 $0, $1, $2;", "=r,r,r",
                                     [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def words_amax(w0, w1, IN_KIND: tl.constexpr):
    """Per-block amax (fp32 [R, B], NaN propagating) of the two [R, B, 4] halves of bf16/fp16
    blocks, reduced on the packed pairs (one instruction per two elements; GPU only)."""
    if IN_KIND == 0:
        m = bf16x2_absmax(tl.reduce(w0, 2, bf16x2_absmax), tl.reduce(w1, 2, bf16x2_absmax))
    else:
        m = f16x2_absmax(tl.reduce(w0, 2, f16x2_absmax), tl.reduce(w1, 2, f16x2_absmax))
    lo, hi = unpack_words(m, IN_KIND)
    return max_nan(tl.abs(lo), tl.abs(hi))


@triton.jit
def store_bytes(ptrs, values, mask, ASM: tl.constexpr):
    """Store the low bytes of int32 ``values`` at ``ptrs`` where ``mask``. ASM (GPU): by inline
    st.global.b8 in the tensors' own layout; a tl.store of this block-shaped (sliced-layout)
    tensor first moves it through shared memory into a store layout, two barriers each."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b8 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r", [ptrs.to(tl.int64), values, mask.to(tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1)
    else:
        tl.store(ptrs, values.to(tl.uint8), mask=mask)


@triton.jit
def e4m3_pairs(lo, hi, HARDWARE: tl.constexpr):
    """[.., W] fp32 pairs (no NaN) -> uint16 of their e4m3 bytes (RNE, saturating at +-448),
    element 2i in the low byte. HARDWARE: one cvt.rn.satfinite.e4m3x2.f32 per pair (SM89+),
    the same rounding as the software path."""
    if HARDWARE:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 pair; cvt.rn.satfinite.e4m3x2.f32 pair, $2, $1; cvt.u32.u16 $0, pair; }",
            "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1).to(tl.uint16)
    return (e4m3_code(lo) | (e4m3_code(hi) << 8)).to(tl.uint16)


@triton.jit
def nan_to_e4m3_max(y, GPU: tl.constexpr):
    """NaN -> +448, other values unchanged up to 448 (FlashInfer's fminf(y, 448)). GPU: that
    minimum itself, one instruction (min.f32 returns the number when one input is NaN);
    Triton's interpreter propagates NaN through minimum, so there: a select."""
    if GPU:
        return tl.minimum(y, E4M3_MAX_C)
    return tl.where(y != y, E4M3_MAX_C, y)


# x's dtype -> (IN_KIND of the kernels, the integer dtype of one word of two elements)
PAIR_VIEWS = {torch.bfloat16: (0, torch.int32), torch.float16: (1, torch.int32),
              torch.float32: (2, torch.int64)}


def as_pairs(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x [M, H] (H even) viewed as [M, H/2] words of two elements, for :func:`load_words`:
    (words, row stride in words, IN_KIND). x is copied first when its rows are not runs of
    whole words (column stride != 1, an odd row stride or an odd storage offset)."""
    in_kind, word = PAIR_VIEWS[x.dtype]
    if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        x = torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
    words = x.view(word)
    return words, words.stride(0), in_kind
