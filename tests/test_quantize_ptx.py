"""The inline PTX of the NVFP4 word path (``kernels.quantize._e2m1_words_ptx``), run on CPU by a
small emulator of the instructions it uses, against the reference e2m1 rounding.

On a GPU the kernels run that PTX (tests/test_quantize.py compares it with the oracle there);
this test keeps its logic (candidate roundings, nibble positions, the sum's base, the sign
gathering by prmt, the NaN-block masks) checked in CPU-only CI too. The emulator follows the
PTX ISA: fp32 ops round to nearest even (numpy float32; an fma's product here is exact, so a
float64 product and sum rounded once to float32 is the fused result), integers are 32-bit.
"""

import numpy as np
import pytest
import torch

from kernels import reference as R
from kernels.quantize_details.words import e2m1_words_ptx

MASK = 0xFFFFFFFF


def _f32(bits: int) -> np.float32:
    return np.array([bits & MASK], dtype=np.uint32).view(np.float32)[0]


def _bits(value) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def _signed(bits: int) -> int:
    return bits - (1 << 32) if bits & 0x80000000 else bits


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 (default mode): result byte i = byte (sel_i & 7) of {b, a}, or that byte's
    sign bit replicated when sel_i & 8."""
    source = (a & MASK) | ((b & MASK) << 32)
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run_ptx(program: str, operands: dict) -> int:
    """Run ``program`` with operands $1.. (ints: 32-bit patterns); return $0."""
    regs = dict(operands)

    def value(token: str) -> int:
        token = token.strip()
        if token in regs:
            return regs[token]
        if token.startswith("0f"):
            return int(token[2:], 16)
        return int(token, 0) & MASK

    for statement in program.replace("{", " ").replace("}", " ").split(";"):
        parts = statement.split(None, 1)
        if not parts or parts[0] == ".reg":
            continue
        op, args = parts[0], [a.strip() for a in parts[1].split(",")] if len(parts) > 1 else []
        if op == "mov.b32" and args[0].startswith("h0"):  # mov.b32 {h0, h1}, word
            word = value(args[2])
            regs["h0"], regs["h1"] = word & 0xFFFF, word >> 16
            continue
        dst, srcs = args[0], [value(a) for a in args[1:]]
        if op == "mov.b32":
            result = srcs[0]
        elif op == "shl.b32":
            result = srcs[0] << srcs[1]
        elif op == "and.b32":
            result = srcs[0] & srcs[1]
        elif op == "or.b32":
            result = srcs[0] | srcs[1]
        elif op == "cvt.f32.f16":
            result = _bits(np.array([srcs[0]], dtype=np.uint16).view(np.float16)[0])
        elif op == "mul.rn.f32":
            result = _bits(_f32(srcs[0]) * _f32(srcs[1]))
        elif op == "add.rn.f32":
            result = _bits(_f32(srcs[0]) + _f32(srcs[1]))
        elif op == "fma.rn.f32":
            product = np.float64(_f32(srcs[0])) * np.float64(_f32(srcs[1]))
            result = _bits(np.float32(product + np.float64(_f32(srcs[2]))))
        elif op == "abs.f32":
            result = srcs[0] & 0x7FFFFFFF
        elif op == "min.s32":
            result = min(_signed(srcs[0]), _signed(srcs[1]))
        elif op == "mad.lo.u32":
            result = srcs[0] * srcs[1] + srcs[2]
        elif op == "prmt.b32":
            result = _prmt(srcs[0], srcs[1], srcs[2])
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
        regs[dst] = result & MASK
    return regs["$0"]


def _expected_bytes(elements: torch.Tensor, scale: float) -> list[int]:
    """Reference packed bytes of 8 elements (4 words) times ``scale``; a NaN scale gives the
    GPU's NaN product, which has no sign: code 7."""
    if scale != scale:
        return [0x77] * 4
    codes = R.e2m1_code(elements.float() * torch.tensor(scale, dtype=torch.float32))
    return [int(codes[2 * i]) | int(codes[2 * i + 1]) << 4 for i in range(4)]


@pytest.mark.parametrize("dtype,in_kind", [(torch.bfloat16, 0), (torch.float16, 1)])
def test_word_ptx_packs_like_the_reference(dtype, in_kind):
    program = e2m1_words_ptx(in_kind)
    generator = torch.Generator().manual_seed(7)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.0, -0.0, -0.25,
                         -1.25, -5.0, 1e-3, 1e4])
    groups = [ties[:8], ties[8:], -ties[:8]]
    groups += [torch.randn(8, generator=generator) * 3 for _ in range(60)]
    groups += [torch.tensor([float("inf"), -float("inf")] + [1.0] * 6)]
    scales = [1.0, 0.5, 2.0, 0.0, 1.7, 3e-3, 1e30, float("nan")]
    for group_index, group in enumerate(groups):
        elements = group.to(dtype)
        words = elements.view(torch.int16).to(torch.int32) & 0xFFFF
        words = [int(words[2 * i]) | int(words[2 * i + 1]) << 16 for i in range(4)]
        for scale in scales + [float(torch.rand(1, generator=generator)) * 4]:
            if scale == 0 and bool(group.isinf().any()):
                continue  # a block holding inf has amax inf, so its scale is never 0
            signed = scale == scale
            operands = {f"${1 + i}": w for i, w in enumerate(words)}
            operands.update({f"${5 + i}": _bits(scale) for i in range(4)})
            operands.update({f"${9 + i}": 0x08080808 if signed else 0 for i in range(4)})
            operands.update({f"${13 + i}": 0x80808080 if signed else 0 for i in range(4)})
            out = run_ptx(program, operands)
            got = [(out >> (8 * i)) & 0xFF for i in range(4)]
            assert got == _expected_bytes(elements, scale), (group_index, scale, elements)
