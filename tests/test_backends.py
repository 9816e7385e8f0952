"""The stage switch: defaults from the environment, explicit choices, refusals with reasons."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from a2a import backends
from a2a.backends import BackendUnavailable, parse_backends, resolve, why_unavailable

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def test_parse_backends_reads_each_stage():
    assert parse_backends("prepare=flashinfer, quantize=triton") == {
        "prepare": "flashinfer", "quantize": "triton"}
    assert parse_backends("") == {}


@pytest.mark.parametrize("spec, message", [
    ("prepare", "MOE_A2A_BACKENDS: 'prepare' is not 'stage=backend'"),
    ("prepar=torch", "MOE_A2A_BACKENDS: stage='prepar'"),
    ("prepare=cuda", "backend 'cuda' for stage 'prepare'"),
])
def test_parse_backends_names_the_bad_part(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_backends(spec)


def test_torch_backend_runs_everywhere():
    for stage in backends.STAGES:
        assert resolve(stage, "torch", CPU) == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
        resolve("permute", "triton", CPU)
    assert resolve("permute", "auto", CPU) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve("permute", "triton", CPU) == "triton"
    assert resolve("permute", "auto", CPU) == "triton"


@pytest.mark.parametrize("sm", [None, 9])
def test_flashinfer_quantize_refuses_below_sm100(sm):
    """FlashInfer's fp4 quantize kernels are empty below SM100: asking for them must fail with
    the reason, on a CPU machine and on a Hopper (the capability given) alike, and list what
    can run."""
    device = torch.device("cuda", 0) if sm else CPU
    context = dict(capability=(sm, 0)) if sm else {}
    with pytest.raises(BackendUnavailable) as info:
        resolve("quantize", "flashinfer", device, **context)
    message = str(info.value)
    assert "SM100" in message and "uninitialised memory" in message
    assert ("SM90" if sm else "no CUDA device") in message
    assert "Backends that can:" in message and "torch" in message


def test_auto_never_picks_flashinfer_quantize_on_cpu():
    assert resolve("quantize", "auto", CPU) in ("triton", "torch")


def test_flashinfer_has_no_standalone_permute():
    assert "no standalone" in why_unavailable("permute", "flashinfer", CPU)


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="stage='shuffle'"):
        resolve("shuffle", "torch", CPU)
    with pytest.raises(ValueError, match="backend='cutlass'"):
        why_unavailable("prepare", "cutlass", CPU)


def test_environment_default_is_read_once_and_applied(monkeypatch):
    code = ("from a2a.backends import default_backends, resolve;"
            "import torch;"
            "print(default_backends()['prepare'], default_backends()['quantize'],"
            "      resolve('prepare', None, torch.device('cpu')))")
    env = {**os.environ, "MOE_A2A_BACKENDS": "prepare=torch,quantize=triton"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out == ["torch", "triton", "torch"]


def test_import_needs_neither_gpu_nor_flashinfer():
    code = ("import sys, kernels.reference, a2a;"
            "assert 'flashinfer' not in sys.modules, 'flashinfer imported';"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "ok"


def test_describe_names_every_stage_and_the_reasons():
    text = backends.describe(CPU)
    for stage in backends.STAGES:
        assert f"{stage}: 'auto' -> " in text
    assert "flashinfer: not here:" in text
    import a2a
    assert a2a.describe is backends.describe and "describe" in a2a.__all__


def test_resolve_logs_its_choice(caplog):
    import logging
    with caplog.at_level(logging.DEBUG, logger="a2a"):
        resolve("permute", "torch", CPU)
    assert "permute: 'torch' -> torch" in caplog.text


def test_import_names_the_other_kernels_package(tmp_path):
    """Another top-level 'kernels' (e.g. the Hugging Face hub loader) shadowing ours: import a2a
    says so instead of failing on a missing submodule."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-c", "import a2a"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert done.returncode != 0
    assert "is not triton-moe-a2a's" in done.stderr and "Hugging Face" in done.stderr


def test_install_holds_the_library_packages_only():
    """pyproject's package list: kernels and a2a with every subpackage; no bench, no tests."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    import setuptools
    with open(ROOT / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(setuptools.find_packages(str(ROOT), include=include))
    on_disk = {str(p.parent.relative_to(ROOT)).replace(os.sep, ".")
               for top in ("kernels", "a2a") for p in (ROOT / top).rglob("__init__.py")}
    assert found == on_disk and {"kernels.spec", "a2a.triton_transport"} <= found
    assert not any(name.split(".")[0] in ("bench", "tests") for name in found)
