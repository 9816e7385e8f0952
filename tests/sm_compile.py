"""Compile every Triton kernel of the library for a GPU architecture, on any machine.

``python -m tests.sm_compile --arch 90`` (or 100) runs the public launchers on CPU tensors with
``JITFunction.run`` replaced by a compile-only stand-in: each launch is bound and specialized
as Triton would for a GPU, then compiled for ``cuda:<arch>`` down to a cubin (Triton's bundled
LLVM and ptxas; no GPU or driver needed) and not run. It prints one line per distinct kernel
variant. The interpreter (what CPU-only CI runs otherwise) never compiles a kernel, so this is
what catches code that runs there but does not build for a GPU: compile-time constexpr logic,
inline PTX, layouts. GPU-only paths are forced on where the launcher would pick them only for
a CUDA tensor (the NVFP4 word-level PTX path, the hardware e4m3 conversion, fast math), and
every kernel that takes ``PDL`` is built with it on and ``launch_pdl``, as an SM90 or later GPU
launches it (``kernels.hardware.grid_dependency``); its PTX must then hold the grid dependency
wait, and its line says where it lets the next kernel launch (``next:start``: its PTX signals
``launch_dependents``; ``next:exit``: it does not, the next kernel launches as it exits) and
whether it reads global memory before that wait (``reads:before-wait``: a load precedes the
wait in its PTX, as ``overlap_previous`` and the quantize's ``X_READY`` ask; else
``reads:after-wait``).

Runs without ``TRITON_INTERPRET``: when the variable is set, the module starts itself again
without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # Triton reads the variable when a kernel module is imported, and the interpreter compiles
    # nothing: start again without it (bash .ci/run sets it on a machine without a GPU).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    os.execve(sys.executable, [sys.executable, "-m", "tests.sm_compile", *sys.argv[1:]], env)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from tests.support import pdl_order  # noqa: E402


def install_compile_only(arch: int) -> list[str]:
    """Replace JITFunction.run: compile each distinct launch for ``cuda:<arch>``, launch
    nothing. Returns the list the compiled variants' descriptions are appended to."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binders: dict = {}
    seen: set = set()
    compiled: list[str] = []

    def run(self, *args, grid, warmup, **kwargs):
        kwargs.setdefault("debug", False)
        if "PDL" in kwargs:  # a CPU tensor's launch has it off; a GPU's has it on
            kwargs.update(PDL=True, launch_pdl=True)
        if self not in binders:
            binders[self] = create_function_from_signature(self.signature, self.params,
                                                           backend)
        bound_args, specialization, options = binders[self](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args,
                                                                specialization, options)
        key = (self.__name__, repr(sorted(signature.items())),
               repr(sorted(constexprs.items())), repr(sorted(attrs.items())),
               repr(sorted(options.__dict__.items())))
        if key in seen:
            return None
        seen.add(key)
        start = time.time()
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
        values = {self.params[path[0]].name: value for path, value in constexprs.items()
                  if len(path) == 1}
        order = ""
        if values.get("PDL"):
            if "griddepcontrol.wait" not in kernel.asm["ptx"]:
                raise AssertionError(f"{self.__name__}: PDL=True but no griddepcontrol.wait")
            launches_next, loads_first = pdl_order(kernel.asm["ptx"])
            order = (f" next:{'start' if launches_next else 'exit'}"
                     f" reads:{'before' if loads_first else 'after'}-wait")
        compiled.append(f"{self.__name__} sm_{arch} {len(kernel.asm['cubin'])} B cubin "
                        f"{time.time() - start:.1f} s{order} {values}")
        print(compiled[-1], flush=True)
        return None

    JITFunction.run = run
    return compiled


def launch_everything() -> None:
    """Call every public launcher (and the transport/prepare warm-ups) on CPU tensors."""
    from a2a import triton_prepare, triton_transport
    from a2a.config import TransportConfig, default_send_nvfp4_launch
    from bench import floor
    from kernels import gather, permute, quantize as Q, routing
    from kernels.spec import SCALE_LAYOUTS, swizzled_scale_shape
    from kernels.types import AlltoallPlan

    # the launch choices a CUDA tensor would get (the GPU-only inline PTX paths)
    nvfp4, block = Q.NVFP4Launch(ptx=True), Q.BlockLaunch(ptx=True)
    gs = torch.ones(1)
    for rows, hidden in ((8192, 7168), (128, 7168), (7, 48)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.empty(rows, hidden, dtype=dtype)
            for layout in SCALE_LAYOUTS:
                Q.quantize_nvfp4(x, gs, layout=layout, launch=nvfp4)
                Q.quantize_nvfp4(x, gs, layout=layout, fast_math=True, launch=nvfp4)
            Q.nvfp4_global_scale(x)
            Q.scale_and_quantize_nvfp4(x, check_values=False, launch=nvfp4)
            Q.scale_and_quantize_nvfp4(x, check_values=False, launch=nvfp4,
                                       amax_launch=Q.AmaxLaunch(overlap_previous=True))
            if hidden % 32 == 0:
                Q.quantize_mxfp8(x, launch=block)
                Q.quantize_mxfp4(x, launch=block)
        x = torch.empty(rows, hidden, dtype=torch.bfloat16)
        Q.quantize_nvfp4(x, gs, rows=torch.zeros(5, dtype=torch.int32), launch=nvfp4)
        packed, scales = (torch.zeros(rows, hidden // 2, dtype=torch.uint8),
                          torch.zeros(swizzled_scale_shape(rows, hidden // 16, "swizzled_128x4"),
                                      dtype=torch.uint8))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # round_to's branches
            Q.dequantize_nvfp4(packed, scales, gs, layout="swizzled_128x4", dtype=dtype,
                               launch=block)
    floor.nvfp4_traffic(torch.empty(256, 7168, dtype=torch.bfloat16))  # (its ASM=False form)
    floor.empty_launch(torch.device("cpu"))()
    floor.row_ids(torch.zeros(16, 256), 8)
    for layout in SCALE_LAYOUTS[1:]:
        swizzled = Q.swizzle_scales(torch.zeros(300, 448, dtype=torch.uint8), layout)
        Q.unswizzle_scales(swizzled, layout, 300, 448)
    from bench import timing
    words = torch.zeros(1024, dtype=torch.int32)
    timing.peer_store_kernel()[(timing.PEER_STORE_CTAS,)](words, words, words.numel(),
                                                          BLOCK=timing.PEER_STORE_BLOCK)

    logits = torch.zeros(64, 256)
    # the default and each other value of every routing launch field; the sorted-queue rounds
    # and the branch-free sigmoid division with every compact form and weight source, with
    # 2 rows per program, with 16 values per lane (E=384) and with bf16 logits (8 per vector)
    fast = dict(keys=routing.KEYS_QUEUES, reciprocal=routing.RECIP_FMA,
                group_top2=routing.TOP2_PAIRS)
    for launch in (routing.RoutingLaunch(), routing.SPLIT32_ROUTING, routing.PACKED64_ROUTING,
                   routing.RoutingLaunch(compact=routing.COMPACT_GATHER,
                                         weights_from=routing.WEIGHTS_CARRY),
                   routing.RoutingLaunch(compact=routing.COMPACT_RELOAD,
                                         weights_from=routing.WEIGHTS_LOAD_EACH),
                   routing.RoutingLaunch(num_warps=2, rows_per_program=2),
                   routing.RoutingLaunch(**fast),
                   routing.RoutingLaunch(**fast, compact=routing.COMPACT_GATHER,
                                         weights_from=routing.WEIGHTS_CARRY),
                   routing.RoutingLaunch(**fast, compact=routing.COMPACT_RELOAD,
                                         weights_from=routing.WEIGHTS_LOAD_EACH),
                   routing.RoutingLaunch(**fast, rows_per_program=2,
                                         group_select=routing.GROUP_ROUNDS),
                   routing.RoutingLaunch(**fast, num_warps=2)):
        routing.route_topk(logits, 8, "deepseek_v3", bias=torch.zeros(256), num_groups=8,
                           topk_groups=4, routed_scaling=2.5, launch=launch)
    for experts, groups, dtype in ((384, 8, torch.float32), (256, 8, torch.bfloat16),
                                   (60, 5, torch.float32)):
        routing.route_topk(torch.zeros(64, experts, dtype=dtype), 8 if experts > 60 else 4,
                           "deepseek_v3", bias=torch.zeros(experts), num_groups=groups,
                           topk_groups=3, launch=routing.RoutingLaunch(**fast))
    routing.route_topk(torch.zeros(64, 128), 4, "softmax_topk")
    routing.route_topk(torch.zeros(64, 128), 4, "softmax_topk_renorm",
                       launch=routing.RoutingLaunch(weights_from=routing.WEIGHTS_CARRY))
    for method, experts, top_k in (("softmax_topk_renorm", 512, 32), ("sigmoid_topk", 128, 4),
                                   ("topk_softmax", 256, 8)):
        for weights_from in (routing.WEIGHTS_RELOAD, routing.WEIGHTS_LOAD_EACH):
            routing.route_topk(torch.zeros(64, experts), top_k, method,
                               launch=routing.RoutingLaunch(**fast, weights_from=weights_from))
    # permute_by_expert: the one-launch form (the rule at 512 pairs, with and without padding)
    # and the three-pass form with both ranks of pass 3
    ids = torch.zeros(64, 8, dtype=torch.int32)
    for align in (1, 128):
        permute.permute_by_expert(ids, 256, align=align, check_ids=False)
    # the one-launch form's wide programs (8 warps from 2048 ids) and both forms' first launch
    # reading the ids before its wait
    permute.permute_by_expert(torch.zeros(256, 8, dtype=torch.int32), 256, check_ids=False)
    early = permute.PermuteLaunch(overlap_previous=True)
    permute.permute_by_expert(ids, 256, check_ids=False, launch=early)
    permute.permute_by_expert(torch.zeros(8192, 8, dtype=torch.int32), 256, check_ids=False,
                              launch=early)
    for launch in (permute.PermuteLaunch(form="three_pass"), permute.ONEHOT_PERMUTE):
        permute.permute_by_expert(torch.zeros(8192, 8, dtype=torch.int32), 256, align=128,
                                  check_ids=False, launch=launch)
    perm = permute.permute_by_expert(ids, 256, check_ids=False)
    # check_values=False: nothing ran, so the permutation holds whatever memory held
    gather.gather_rows(torch.zeros(64, 7168, dtype=torch.bfloat16), perm, check_values=False)
    # the NVFP4 codes and their scales: the second table in the same launch
    gather.gather_rows(torch.zeros(64, 3584, dtype=torch.uint8), perm,
                       scales=torch.zeros(64, 448, dtype=torch.uint8), check_values=False)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        gather.unpermute_and_reduce(torch.zeros(512, 7168, dtype=dtype), perm,
                                    torch.zeros(64, 8), check_values=False)

    # the local send plan's one-launch form (N = 64 is one block) and two-launch form
    from kernels import prepare
    for max_tokens in (64, 8192):
        prepare.local_send_plan(torch.zeros(64, 8, dtype=torch.int32), 256, 8,
                                max_tokens_per_rank=max_tokens, check_ids=False)

    cpu = torch.device("cpu")
    triton_prepare.warmup_prepare(cpu, ep_size=2, num_experts=32, max_tokens_per_rank=64,
                                  top_k=8)
    for overlap in (False, True):  # the two-kernel and the one-launch transfer
        triton_transport.warmup_transport(cpu, ep_size=2, max_tokens_per_rank=64,
                                          row_bytes=7168 * 2, top_k=8,
                                          config=TransportConfig(overlap=overlap))
    counts = torch.zeros(2, dtype=torch.int32)
    unused = torch.zeros(128, dtype=torch.int32)
    plan = AlltoallPlan(counts, unused, unused, counts, unused,
                        torch.zeros(128, 8, dtype=torch.int32), torch.zeros(128, 8), None,
                        ep_rank=0, ep_size=2, max_tokens_per_rank=64, num_tokens=64, top_k=8,
                        slot_count=32)
    row_bytes = triton_transport.nvfp4_row_bytes(7168)
    words = triton_transport.transport_workspace_bytes(2, 64, row_bytes) // 8
    # the quantizing send without and with the word-level PTX path a CUDA tensor would get
    for ptx in (False, True):
        send_launch = dataclasses.replace(default_send_nvfp4_launch(), ptx=ptx)
        triton_transport.triton_dispatch_nvfp4(
            torch.zeros(64, 7168, dtype=torch.bfloat16), gs, plan,
            torch.zeros(2, words, dtype=torch.int64),
            call_counter=torch.zeros(1, dtype=torch.int64), check=False,
            config=TransportConfig(timeout_spins=0, nvfp4_launch=send_launch))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args = parser.parse_args(argv)
    compiled = install_compile_only(args.arch)
    launch_everything()
    print(f"compiled {len(compiled)} kernel variants for sm_{args.arch}")


if __name__ == "__main__":
    main()
