"""What ``torch.compile`` sees of the registered ops with compiled Triton, on any machine.

Under ``TRITON_INTERPRET=1`` (CPU CI) the ``.triton`` overloads are opaque custom ops, so the
interpreter never shows what Inductor would get from the triton_ops. This module runs without
the interpreter (``tests/test_ops_trace.py`` starts it so), with a stand-in Triton driver
whose target is sm_90 (generating a kernel's TTIR needs a target, not a GPU; nothing is
launched or compiled to a cubin), and checks two things:

``--check mutation``  Inductor's mutation analysis (``identify_accessed_tensors``, what decides
    which kernel arguments a compiled graph clones or copies back) of the first launch of
    each (op, kernel) pair, each op's default (``--every-variant``: every flag variant, tens
    of minutes on a CPU), through ``tests.sm_compile.launch_everything()`` run under a
    TorchDispatchMode (which turns the public functions' eager path off, so every launch
    comes from an op body):
    the analysis must succeed (no "every argument written" fallback) and must not count any
    input of the op as written, except the op's declared mutable arguments.
``--check guards``    the op bodies traced by ``make_fx`` with T dynamic at T=16 (and, where
    the guards of that trace fail at a larger T, at T=256): every T in (2, 7, 64, 255, 256)
    must be served by one of the two traces, i.e. a compiled region with a dynamic T compiles
    at most twice (the quantizers' tile rules have two buckets of M) for those T (the H200's
    132 SMs stand in for the SM count).
``--check views``     the op bodies traced by ``make_fx`` at T=16 and at T=2048 (where the
    large-T forms run: the three-pass permutation, the three-launch quantize): no kernel is
    handed a piece cut (split, slice) out of a buffer the body allocates. A kernel writing
    such a piece makes the functionalized graph scatter the write back into the buffer and cut
    the pieces out again: copies Inductor runs as kernels of its own (one read past the end of
    its buffer in the compiled decode chain at T=2048 on an H200, when the three-pass
    permutation's scratch was one buffer split in three).

Prints one line per kernel variant or op, then ``FAILED: ...`` lines and exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("tests.ops_trace needs compiled Triton: run it without TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# The H200's SM count, for the launch rules that aim at programs per SM.
H200_SMS = 132
GUARD_TOKENS = (2, 7, 64, 255, 256)
TRACE_TOKENS = 16


class StandInDriver:
    """A Triton driver that only names a target (sm_90): enough for TTIR generation."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class OpInputs(TorchDispatchMode):
    """Records, while a ``moe_a2a`` op runs, the storages of its inputs and which of them the
    op declares mutable. A ``.triton`` overload runs its traced body (``RegisteredOp.body``,
    the kernels launched through ``wrap_triton``, what Inductor compiles), not the eager
    launch its backend key holds: the launches analysed are the ones a compiled graph makes."""

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[str, dict[int, bool]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) != "moe_a2a":
            return func(*args, **kwargs)
        storages: dict[int, bool] = {}
        for argument, value in zip(func._schema.arguments, args):
            values = value if isinstance(value, (list, tuple)) else [value]
            mutable = argument.alias_info is not None and argument.alias_info.is_write
            for t in values:
                if isinstance(t, torch.Tensor) and t.numel():
                    storages[_storage(t)] = storages.get(_storage(t), False) or mutable
        self.stack.append((str(func), storages))
        from kernels import library
        name = func._schema.name.split("::")[-1]
        traced = (func._overloadname == library.TRITON and name in library.REGISTERED)
        try:
            if traced:
                return library.REGISTERED[name].body(*args, **kwargs)
            return func(*args, **kwargs)
        finally:
            self.stack.pop()


def check_mutation(every_variant: bool = False) -> list[str]:
    """Inductor's mutation analysis of the kernels the ops launch: the first launch of each
    (op, kernel) pair (``launch_everything`` launches each op's default first), or, with
    ``every_variant``, every distinct set of the kernel's constexpr flags (slow: a TTIR per
    variant)."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
    mode = OpInputs()
    seen: set = set()
    failures: list[str] = []

    def run(self, *args, grid, warmup, **kwargs):
        if not mode.stack:
            return None  # launched outside an op (the transport's warm-ups): not ours
        op, storages = mode.stack[-1]
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        flags = tuple((k, v) for k, v in sorted(bound.items())
                      if k.isupper() and isinstance(v, (bool, int, str)))
        key = (op, self.__name__, flags) if every_variant else (op, self.__name__)
        if key in seen:
            return None
        seen.add(key)
        name = f"{op} {self.__name__} {dict(flags)}"
        try:  # the steps of identify_accessed_tensors, without its catch-all fallback
            ttir, names = tkw.generate_ttir(self, bound, {})
            functions = tkw.ttir_to_functions(ttir)
            tkw.analyze_kernel_access.reset()
            tkw.get_tma_stores.reset()
            tensor_idx = frozenset(i for i, n in enumerate(names)
                                   if isinstance(bound.get(n), torch.Tensor))
            accesses = tkw.analyze_kernel_access(functions, next(iter(functions)), len(names),
                                                 tuple(names), tensor_idx)
        except Exception as error:  # noqa: BLE001 - report why the analysis gives up
            missing = [p for p in self.arg_names if p not in bound]
            failures.append(f"{name}: the analysis falls back to 'every argument written': "
                            f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                            + (f" (parameters not passed: {missing})" if missing else ""))
            return None
        writes = sorted(dep.name for dep in accesses.read_writes.writes)
        wrong = [w for w in writes if isinstance(bound.get(w), torch.Tensor)
                 and bound[w].numel() and storages.get(_storage(bound[w])) is False]
        print(f"{name}: writes {writes}", flush=True)
        if wrong:
            failures.append(f"{name}: writes {wrong}, inputs of the op it does not declare "
                            f"mutable (a compiled graph would clone or copy them)")
        return None

    JITFunction.run = run
    from tests.sm_compile import launch_everything
    with mode:
        launch_everything()
    print(f"{len(seen)} kernel variants analysed")
    return failures


def guard_cases(tokens: int) -> dict:
    """name -> (function of tensors, tensors) for one T: the op bodies (``RegisteredOp.body``)
    on DeepSeek-R1's decode shapes, launch configs with the H200's SM count."""
    from kernels import library, ops
    from kernels import quantize as Q

    registered = ops.registered_ops()
    fields = library.config_fields
    nvfp4 = Q.NVFP4Launch(num_sms=H200_SMS)
    block = Q.BlockLaunch(num_sms=H200_SMS)
    amax = Q.AmaxLaunch(num_sms=H200_SMS)
    from kernels import permute, routing
    hidden, experts, k = 7168, 256, 8
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    ids = torch.zeros(tokens, k, dtype=torch.int32)
    gs = torch.ones(1)
    packed = torch.zeros(tokens, hidden // 2, dtype=torch.uint8)
    scales = torch.zeros(tokens, hidden // 16, dtype=torch.uint8)
    mx_scales = torch.zeros(tokens, hidden // 32, dtype=torch.uint8)

    def body(name, *constants):
        return lambda *tensors: registered[name].body(*tensors, *constants)

    return {
        "route_topk": (lambda logits, bias: registered["route_topk"].body(
            logits, k, "deepseek_v3", bias, 8, 4, 2.5, *fields(routing.DEFAULT_ROUTING)),
            (torch.zeros(tokens, experts), torch.zeros(experts))),
        "local_send_plan": (body("local_send_plan", experts, 1, max(256, tokens), experts),
                            (ids,)),
        "permute_by_expert": (body("permute_by_expert", experts, 0, experts, 1,
                                   *fields(permute.DEFAULT_PERMUTE)), (ids,)),
        "gather_rows": (lambda table, rows, sf: registered["gather_rows"].body(table, rows, sf, k),
                        (packed, torch.zeros(tokens * k, dtype=torch.int32), scales)),
        "permute_and_gather": (body("permute_and_gather", experts, 0, experts, 1,
                                    *fields(permute.DEFAULT_PERMUTE),
                                    *fields(permute.DEFAULT_GATHER)), (ids, packed, scales)),
        "unpermute_and_reduce": (body("unpermute_and_reduce"),
                                 (torch.zeros(tokens * k, hidden, dtype=torch.bfloat16),
                                  torch.zeros(tokens * k, dtype=torch.int32),
                                  torch.zeros(tokens, k))),
        "nvfp4_global_scale": (body("nvfp4_global_scale", *fields(amax)), (x,)),
        "quantize_nvfp4": (lambda x_, gs_: registered["quantize_nvfp4"].body(
            x_, gs_, "linear", False, None, *fields(nvfp4)), (x, gs)),
        "quantize_nvfp4 swizzled_128x4": (lambda x_, gs_: registered["quantize_nvfp4"].body(
            x_, gs_, "swizzled_128x4", False, None, *fields(nvfp4)), (x, gs)),
        "scale_and_quantize_nvfp4": (body("scale_and_quantize_nvfp4", "linear", False,
                                          *fields(amax), *fields(nvfp4)), (x,)),
        "quantize_mxfp8": (body("quantize_mxfp8", *fields(block)), (x,)),
        "quantize_mxfp4": (body("quantize_mxfp4", *fields(block)), (x,)),
        "dequantize_nvfp4": (lambda p, s, g: registered["dequantize_nvfp4"].body(
            p, s, g, "linear", torch.bfloat16, *fields(block)), (packed, scales, gs)),
        "quantize_nvfp4_out": (lambda x_, gs_, out, sf: registered["quantize_nvfp4_out"].body(
            x_, gs_, "linear", False, None, out, sf, *fields(nvfp4)), (x, gs, packed, scales)),
        "dequantize_mxfp4": (lambda p, s: registered["dequantize_mxfp4"].body(
            p, s, torch.bfloat16, *fields(block)), (packed, mx_scales)),
        "dequantize_mxfp8": (lambda c, s: registered["dequantize_mxfp8"].body(
            c, s, torch.bfloat16, *fields(block)),
            (torch.zeros(tokens, hidden, dtype=torch.float8_e4m3fn), mx_scales)),
        "swizzle_scales": (body("swizzle_scales", "swizzled_128x4"), (scales,)),
    }


def check_guards() -> list[str]:
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    def trace(name: str, tokens: int):
        """The shape environment of op ``name``'s body traced at ``tokens``, only T dynamic
        (dim 0 of the tensors sized T or T*k, k = 8 in guard_cases), as under torch.compile
        with T marked: H, E and k stay static, as the launch rules expect."""
        function, tensors = guard_cases(tokens)[name]
        shape_env = ShapeEnv()
        mode = FakeTensorMode(shape_env=shape_env)
        fakes = [mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=[
            DimDynamic.DYNAMIC if i == 0 and t.shape[0] in (tokens, tokens * 8)
            else DimDynamic.STATIC for i in range(t.dim())])) for t in tensors]
        with mode:
            make_fx(function, tracing_mode="fake")(*fakes)
        return shape_env, fakes

    failures: list[str] = []
    cases = {t: guard_cases(t) for t in GUARD_TOKENS}
    for name in guard_cases(TRACE_TOKENS):
        # A trace at T=16, then (for the tile rules with two buckets of M) one at the largest T:
        # every T must be served by one of them, i.e. at most two compiled graphs over T.
        served: dict[int, int] = {}
        for traced in (TRACE_TOKENS, max(GUARD_TOKENS)):
            shape_env, fakes = trace(name, traced)
            for t in GUARD_TOKENS:
                if t not in served and shape_env.evaluate_guards_for_args(
                        fakes, list(cases[t][name][1])):
                    served[t] = traced
            if len(served) == len(GUARD_TOKENS):
                break
        missing = [t for t in GUARD_TOKENS if t not in served]
        graphs = len(set(served.values()))
        print(f"{name}: {graphs} graph(s) over T in {GUARD_TOKENS} (traced at "
              f"{sorted(set(served.values()))}); T not served: {missing}", flush=True)
        if missing:
            failures.append(f"{name}: traces at T={TRACE_TOKENS} and T={max(GUARD_TOKENS)} do "
                            f"not serve T={missing} (more than two compiled graphs over T)")
    return failures


# Tokens of the views check: a decode size and one where the large-T forms run.
VIEW_TOKENS = (16, 2048)
# The ops of make_fx's graph that cut a piece out of a tensor, and the allocations.
_CUTS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.slice.Tensor",
         "aten.narrow.default", "aten.as_strided.default", "aten.select.int")
_ALLOCATIONS = ("aten.empty.memory_format", "aten.empty_strided.default",
                "aten.zeros.default", "aten.full.default", "aten.empty_like.default")


def _cut_from_allocation(node) -> bool:
    """Whether fx ``node`` is a piece cut (split, slice, ...) out of a tensor that the traced
    body allocated (through any chain of views)."""
    import operator
    cut = False
    while True:
        if node.op != "call_function":
            return False               # an input of the body
        if node.target is operator.getitem:
            node = node.args[0]        # one piece of a split
            continue
        name = str(node.target)
        if name in _ALLOCATIONS:
            return cut
        if name in _CUTS:
            cut = True
        elif not name.startswith("aten.view") and name not in ("aten.reshape.default",
                                                               "aten._unsafe_view.default"):
            return False               # computed by an op, not a view
        node = node.args[0]


def check_views() -> list[str]:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def kernel_name(launch) -> str:
        kernel = kernel_side_table.get_kernel(launch.kwargs["kernel_idx"])
        return getattr(kernel, "__name__", str(kernel))

    failures: list[str] = []
    for tokens in VIEW_TOKENS:
        for name, (function, tensors) in guard_cases(tokens).items():
            graph = make_fx(function, tracing_mode="fake")(*tensors).graph
            launches = [n for n in graph.nodes if "triton_kernel_wrapper" in str(n.target)]
            cut = sorted({f"{kernel_name(launch)}({arg})"
                          for launch in launches
                          for arg, value in launch.kwargs["kwargs"].items()
                          if isinstance(value, torch.fx.Node) and _cut_from_allocation(value)})
            print(f"{name} T={tokens}: {len(launches)} launch(es), pieces of the body's own "
                  f"buffers handed to kernels: {cut or 'none'}", flush=True)
            if not launches:
                failures.append(f"{name} T={tokens}: no kernel launch in the trace")
            if cut:
                failures.append(f"{name} T={tokens}: kernels handed pieces of one buffer the "
                                f"body allocates ({cut}): allocate each piece on its own")
    return failures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", choices=("mutation", "guards", "views"), required=True)
    parser.add_argument("--every-variant", action="store_true",
                        help="mutation: analyse every flag variant of each kernel, not only "
                             "the first launch of each (op, kernel) (tens of minutes)")
    args = parser.parse_args(argv)
    triton.runtime.driver.set_active(StandInDriver())
    checks = {"mutation": lambda: check_mutation(args.every_variant), "guards": check_guards,
              "views": check_views}
    failures = checks[args.check]()
    for failure in failures:
        print(f"FAILED: {failure}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
