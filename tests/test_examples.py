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


def readme_lines(example: str) -> str:
    """The lines of ``examples/<example>`` between its "# README begin" and "# README end"
    comments, dedented by the function body's four spaces."""
    lines = (ROOT / "examples" / example).read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if line.strip().startswith("# README begin"))
    end = next(i for i, line in enumerate(lines) if line.strip() == "# README end")
    body = lines[begin + 1:end]
    assert body and all(line[:4] == "    " or not line for line in body), example
    return "\n".join(line[4:] for line in body)


@pytest.mark.parametrize("example", ["cpu_two_ranks.py", "gpu_layer_step.py"])
def test_readme_quotes_the_examples_verbatim(example):
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{readme_lines(example)}\n```" in readme, example
    assert f"examples/{example}" in readme


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks (comments stripped)."""
    import re
    readme = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    return commands


def test_readme_commands_name_what_exists():
    """Every script and module the README's commands run exists (the commands themselves run
    in CI: the test command, the CPU example here, the sm_90 build in test_sm_compile)."""
    import importlib.util
    commands = readme_commands()
    assert "bash .ci/run python -m pytest" in commands
    assert "bash .ci/run python -m bench" in commands
    for command in commands:
        words = command.split()
        if "python" not in words or "my_job.py" in words:  # my_job.py: the user's own script
            continue
        after = words[words.index("python") + 1:]
        if after[:1] == ["-m"]:
            assert importlib.util.find_spec(after[1]) is not None, command
        elif after:
            assert (ROOT / after[0]).is_file(), command
