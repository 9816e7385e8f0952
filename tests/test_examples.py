"""The examples run as written (the README's "Using it" is taken from them)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_example_runs_and_checks_itself():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "cpu_two_ranks.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if "matches the plain computation" in line]
    assert len(lines) == 2, done.stdout
    assert "Warning" not in done.stderr, done.stderr[-2000:]


@pytest.mark.gpu
def test_gpu_example_runs_and_checks_itself():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "gpu_layer_step.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "matches the plain computation" in done.stdout, done.stdout
