"""What Inductor would get from the registered ops with compiled Triton, checked on a CPU.

``tests.ops_trace`` runs without ``TRITON_INTERPRET`` (in a subprocess, as
``tests/test_sm_compile.py`` runs ``tests.sm_compile``) with a stand-in sm_90 driver: Inductor's
mutation analysis of the kernels the ops launch, each op's default launch (exact, no input
counted as written that the op does not declare mutable; ``--every-variant`` for all
variants), the op bodies' guards over T (a trace at T=16 serves the other token counts), and
that no op body hands its kernels pieces cut out of one buffer of its own (at T=16 and at
T=2048, where the large-T forms run). Nothing is launched.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Inductor's mutation analysis of the routing kernel alone runs for over an hour on a CPU core
# under torch 2.13 (CI's): the check runs when asked for.
MUTATION_ENV = "OPS_TRACE_MUTATION"
mutation_check = pytest.param(
    "mutation", marks=pytest.mark.skipif(
        os.environ.get(MUTATION_ENV) != "1",
        reason=f"Inductor's mutation analysis takes over an hour on a CPU: set "
               f"{MUTATION_ENV}=1, or run python -m tests.ops_trace --check mutation"))


@pytest.mark.parametrize("check", [mutation_check, "guards", "views"])
def test_ops_trace(check):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.ops_trace", "--check", check],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    if check == "mutation":
        analysed = [line for line in lines if line.endswith("kernel variants analysed")]
        # one per (op, kernel) pair: every op launches at least one kernel
        from kernels.ops import OP_NAMES
        assert analysed and int(analysed[-1].split()[0]) >= len(OP_NAMES), result.stdout[-2000:]
    elif check == "views":
        from kernels.ops import OP_NAMES
        # (tests.ops_trace.VIEW_TOKENS: that module exits under the interpreter, CI's mode)
        for tokens in (16, 2048):
            traced = {line.split()[0] for line in lines if f" T={tokens}: " in line}
            # (unswizzle_scales takes T as an int argument: not among the traced cases)
            untraced = set(OP_NAMES) - traced - {"unswizzle_scales"}
            assert not untraced, f"ops never traced at T={tokens}: {sorted(untraced)}"
    else:
        from kernels.ops import OP_NAMES
        traced = {line.split(":")[0].split()[0] for line in lines if " graph(s) over T" in line}
        # (unswizzle_scales takes T as an int argument, not as a size: nothing to guard)
        untraced = set(OP_NAMES) - traced - {"unswizzle_scales"}
        assert not untraced, f"ops never traced: {sorted(untraced)}"
