"""Helpers for the tests: the float tolerance table, the multi-rank runner and the patch of
Triton's interpreter that the CPU emulations of the Triton prepare and transport need."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import socket
import time
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.spec import FLOAT_TOLERANCES as TOLERANCES  # the one table


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **kwargs) -> None:
    """``torch.testing.assert_close`` with the tolerance of ``expected``'s dtype."""
    torch.testing.assert_close(actual, expected, **{**TOLERANCES[expected.dtype], **kwargs})


def pdl_order(ptx: str) -> tuple[bool, bool]:
    """Where a kernel built with ``PDL`` stands against the kernels around it, read from its
    PTX: (whether it signals ``launch_dependents``, i.e. lets the next kernel launch at its
    start rather than as it exits; whether a global load comes before its
    ``griddepcontrol.wait``, i.e. it reads while the kernel before it may still run)."""
    first_load = ptx.find("ld.global")
    return ("griddepcontrol.launch_dependents" in ptx,
            0 <= first_load < ptx.find("griddepcontrol.wait"))


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, use_cuda: bool, timeout: Optional[float],
               body: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if use_cuda:
        torch.cuda.set_device(rank)
    limit = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank) if use_cuda else None, **limit)
    try:
        body(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(world_size: int, body: Callable, *args, cuda: bool = False,
                    timeout: Optional[float] = None) -> None:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` processes in one process group:
    NCCL with one GPU per rank when ``cuda``, else gloo on CPU. ``body`` must be a module-level
    function (it is pickled). Skips with the reason when there are too few GPUs; an exception in
    any rank fails the test.

    ``timeout`` (seconds): a hard bound for tests of hangs. The group's collectives then time
    out after ``timeout`` (raising in the rank), and when the ranks have not all ended
    ``timeout`` seconds after they started, every one of them is killed and the test fails, so
    that a hang fails the test instead of hanging CI."""
    if cuda and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA GPUs, {torch.cuda.device_count()} visible")
    context = mp.start_processes(_rank_main, args=(world_size, free_port(), cuda, timeout, body,
                                                   args),
                                 nprocs=world_size, join=False, start_method="spawn")
    if timeout is None:
        while not context.join():
            pass
        return
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
            for process in context.processes:  # only the processes this call started
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join()
            pytest.fail(f"rank(s) {alive} of {world_size} still running after {timeout} s: "
                        f"a hang (killed)")


@contextlib.contextmanager
def watchdog(seconds: float):
    """Within the block, a hard bound on this process: after ``seconds`` it prints every
    thread's traceback and exits with status 1 (``faulthandler``), which fails a
    :func:`run_distributed` test. For the hang tests: not a timed assertion, a guard."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def interpreter_with_runtime_loops(monkeypatch) -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with ``int(array)``, which numpy 2
    refuses for the 1-element arrays it holds; patch that one conversion of Triton's own
    interpreter for the calling test only (``monkeypatch`` undoes it)."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter
    patch_lang = interpreter._patch_lang

    def patched(fn):
        scope = patch_lang(fn)  # restoring the scope also undoes the line below
        tl.core.tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        return scope
    monkeypatch.setattr(interpreter, "_patch_lang", patched)
