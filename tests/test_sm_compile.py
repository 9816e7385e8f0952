"""Every Triton kernel builds for Hopper (sm_90) and Blackwell (sm_100), on any machine.

The interpreter runs kernels as Python and compiles nothing, so a kernel can pass every CPU test
and still fail to build for a GPU (e.g. a constexpr branch that only the interpreter skips).
``tests.sm_compile`` runs the launchers with a compile-only ``JITFunction.run`` (Triton's own
binding, specialization and compile pipeline down to a cubin, no driver) in a subprocess without
``TRITON_INTERPRET``; this test requires every ``@triton.jit`` kernel of the library among the
variants it built.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def library_kernels() -> set[str]:
    """Names of the ``@triton.jit`` functions called ``*_kernel`` in kernels/, a2a/, bench/ (and
    their subpackages)."""
    names = set()
    for package in ("kernels", "a2a", "bench"):
        for path in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True):
            with open(path) as f:
                text = f.read()
            lines = text.splitlines()
            for number, line in enumerate(lines):
                match = re.match(r"def (\w+_kernel)\(", line)
                if match and any(previous.startswith("@triton.jit")
                                 for previous in lines[max(0, number - 3):number]):
                    names.add(match.group(1))
    return names


def test_library_kernels_are_found():
    names = library_kernels()
    assert {"nvfp4_quantize_kernel", "send_nvfp4_kernel", "_route_topk_kernel",
            "_exchange_kernel", "_traffic_kernel"} <= names, names


@pytest.mark.parametrize("arch", [90, 100])
def test_every_kernel_compiles_for(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.sm_compile", "--arch", str(arch)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    built = {line.split()[0] for line in result.stdout.splitlines()
             if f" sm_{arch} " in line}
    missing = library_kernels() - built
    assert not missing, f"kernels never launched by tests.sm_compile: {sorted(missing)}"
    # kernels.hardware: only the un-permute lets the next kernel launch as it exits
    lines = [line.split() for line in result.stdout.splitlines() if f" sm_{arch} " in line]
    at = {where: {words[0] for words in lines if f"next:{where}" in words}
          for where in ("start", "exit")}
    assert at["exit"] == {"_unpermute_and_reduce_kernel"}, sorted(at["exit"])
    assert {"_route_topk_kernel", "_gather_rows_kernel", "nvfp4_quantize_kernel"} <= at["start"]
    # kernels.hardware: a kernel reads before its wait exactly where overlap_previous (or the
    # quantize's X_READY) asks it to, and such a variant of each of those kernels was built
    flags = ("'OVERLAP_PREVIOUS': True", "'X_READY': True")

    def asks(words):
        return any(flag in " ".join(words) for flag in flags)
    assert {words[0] for words in lines if asks(words)} == {
        "amax_partial_kernel", "nvfp4_quantize_kernel", "_permute_single_kernel",
        "_count_block_experts_kernel"}
    wrong = [" ".join(words) for words in lines
             if ("reads:before-wait" in words) != asks(words)]
    assert not wrong, wrong[:3]
