"""The ``torch.library`` registration of every public single-GPU op: one namespace, ``moe_a2a``.

Each op has two overloads, one per face, so that ``torch.compile`` and serving engines see one
operator with the library's contract (the faces accept the same arguments and return the same
bits; ``kernels.spec``):

``torch.ops.moe_a2a.<op>.triton``  the Triton launcher. With compiled Triton it is a
                                   ``torch.library.triton_op``: its body launches the kernels
                                   through ``wrap_triton``, so Inductor sees them, schedules
                                   them and compiles them itself. Under ``TRITON_INTERPRET=1``
                                   ``@triton.jit`` makes interpreted functions, which
                                   ``wrap_triton`` cannot trace (a triton_op's fake and its
                                   decomposition would run the interpreter on fake tensors), so
                                   there the same body is an opaque ``custom_op``.
``torch.ops.moe_a2a.<op>.torch``   the plain-torch oracle (``kernels.reference``), an opaque
                                   ``custom_op`` (it reads values: boolean masks, sorts).

An eager call of a ``.triton`` overload on CPU or CUDA tensors runs the op's launch (the body's
kernels launched directly, without ``wrap_triton``: :class:`RegisteredOp`) from the device's
backend key, with the autograd key falling through (:func:`register`): the cost of a low-level
op's dispatch instead of a custom op's Python layers, and none of ``wrap_triton``'s.

Call an overload explicitly: where the two have the same schema (ops without a launch config)
the packet ``torch.ops.moe_a2a.<op>(...)`` cannot tell them apart. The ``.triton`` overload
takes the op's launch config unpacked into plain arguments (a schema cannot hold a dataclass),
in the order of the config's fields (:func:`config_fields`).

Every op has one fake (meta) implementation, shared by both overloads: the output shapes,
strides and dtypes from the argument shapes alone (capacities are static: nothing depends on
values). The ``out=`` form of ``quantize_nvfp4`` is its own op, ``quantize_nvfp4_out``, which
declares the buffers it writes (``mutates_args``) and returns nothing (an op's result may not
alias an input).

The public functions (the launchers in ``kernels/<op>.py``, the stage functions in ``a2a/``)
keep their signatures: they run the shared argument checks (shape, dtype and device reads only,
which ``torch.compile`` traces), then call the op. In eager mode, with plain tensors and no
dispatch mode active, they skip the dispatcher and run the op's launch directly
(:func:`eager_bypass`): the same kernels with the same arguments, so the same bits, without
even the dispatcher's cost (the bench's ``ops`` stage measures the three: op, public function,
raw launch). Under ``torch.compile`` (and any tracing, fake or
functional tensors, a TorchDispatchMode) the op itself is called.

Device-read checks (``check_values`` / ``check_ids``) read tensors on the host. Eagerly they run
as before; while tracing they become calls of the opaque op ``moe_a2a::check_values``
(:func:`run_value_check`), which reads the values when the compiled code runs and raises the
same ValueError; it is registered as side-effecting so that no compiler removes it, and tagged
``cudagraph_unsafe`` (a host read cannot be captured: pass ``check_values=False`` there).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.library import Library, custom_op, fallthrough_kernel, triton_op

from kernels.hardware import interpreting

NAMESPACE = "moe_a2a"
TRITON = "triton"
TORCH = "torch"
FACES = (TRITON, TORCH)


@dataclass(frozen=True)
class RegisteredOp:
    """One registered op: its name, its two overloads, the Triton face's function and its raw
    launch.

    triton: ``torch.ops.moe_a2a.<name>.triton``; torch: ``torch.ops.moe_a2a.<name>.torch``.
    body: the function registered as ``triton`` (its kernels launched through
        ``wrap_triton``): what ``torch.compile`` traces (tests trace it with ``make_fx``).
    launch: the same function without the dispatcher and ``wrap_triton`` (the argument checks,
        then the kernels launched directly): the same arguments and results, outputs that
        never share storage as the op's; what an eager call of ``triton`` runs (the kernel at
        the CPU and CUDA keys), and the bench's "raw" row. Where ``body`` picks a kernel form
        for Inductor's analysis (the routing's division, the quantize's scale stores), this
        keeps the faster form of the same bits.
    """

    name: str
    triton: torch._ops.OpOverload
    torch: torch._ops.OpOverload
    body: Callable
    launch: Callable

    def overload(self, face: str) -> torch._ops.OpOverload:
        """The overload of ``face`` ("triton" or "torch")."""
        if face not in FACES:
            raise ValueError(f"face={face!r} must be one of {FACES}")
        return self.triton if face == TRITON else self.torch


# Every op registered so far, by name (filled as the kernel modules are imported;
# ``kernels.ops`` imports them all).
REGISTERED: dict[str, RegisteredOp] = {}

# The eager kernels of the ``.triton`` overloads (:func:`register`): on a fragment of their own,
# under the custom ops' registrations. The devices whose backend keys get them.
_EAGER_KERNELS = Library(NAMESPACE, "IMPL")
EAGER_DEVICES = ("CPU", "CUDA")


def register(name: str, *, triton: Callable, launch: Callable, torch_face: Callable,
             fake: Callable, mutates_args: Sequence[str] = ()) -> RegisteredOp:
    """Register ``moe_a2a::<name>.triton`` (``triton``) and ``moe_a2a::<name>.torch``
    (``torch_face``), both with the fake ``fake``; ``launch`` is ``triton``'s body without the
    dispatcher (see :class:`RegisteredOp`). The schemas come from the functions' annotations.

    ``triton`` must launch every kernel as ``wrap_triton(<module-level kernel name>)[grid](...)``
    in its own source or in functions it calls that are defined before this registration:
    ``triton_op`` finds the kernels by reading that source (they key the compile cache)."""
    if name in REGISTERED:
        raise ValueError(f"op {NAMESPACE}::{name} is registered twice")
    qualname = f"{NAMESPACE}::{name}"
    mutates = tuple(mutates_args)
    if interpreting():
        triton_def = custom_op(f"{qualname}.{TRITON}", triton, mutates_args=mutates)
    else:
        triton_def = triton_op(f"{qualname}.{TRITON}", triton, mutates_args=mutates)
    triton_def.register_fake(fake)  # replaces triton_op's body-as-fake: one fake per op
    # An eager call of the .triton overload on real tensors runs ``launch`` (the kernels
    # launched directly: the body's results without wrap_triton's wrappers, which cost host
    # time on every launch; the op's outputs, which never alias) from the device's backend
    # key, and its autograd key falls through: the custom op's Python autograd wrapper and
    # output aliasing check are skipped, the dispatcher's cost of a low-level op. The ops have
    # no derivatives (their outputs never require grad, as on the public functions' eager
    # path). Tracing (fake tensors, functionalization, proxies) dispatches at the Python key
    # above the backend keys, to the fake and triton_op's own decomposition of the body. A
    # mutating op's ADInplaceOrView kernel bumps the version counters of what it writes
    # (_version_bump).
    for device_key in EAGER_DEVICES:
        _EAGER_KERNELS.impl(f"{name}.{TRITON}", launch, device_key)
        _EAGER_KERNELS.impl(f"{name}.{TRITON}", fallthrough_kernel, f"Autograd{device_key}")
    torch_def = custom_op(f"{qualname}.{TORCH}", torch_face, mutates_args=mutates)
    torch_def.register_fake(fake)
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    if mutates:
        _replace_kernel(f"{name}.{TRITON}", _version_bump(getattr(packet, TRITON)),
                        "ADInplaceOrView")
    op = RegisteredOp(name=name, triton=getattr(packet, TRITON), torch=getattr(packet, TORCH),
                      body=triton, launch=launch)
    REGISTERED[name] = op
    return op


def _replace_kernel(op_name: str, kernel: Callable, dispatch_key: str) -> None:
    """Register ``kernel`` (taking the dispatch keyset first) for ``op_name`` at
    ``dispatch_key``, where the custom op registered one of its own (a mutating custom op's
    ADInplaceOrView kernel). torch 2.13's ``Library.impl`` replaces it when given
    ``allow_override=True`` (its default), which is passed wherever ``Library.impl`` takes it.
    The GPU host's torch 2.11 refused the key here at import (one that
    ``torch.library._impls`` records as registered from Python before): a ``Library.impl``
    without that argument gets the key taken out of that record first; the dispatcher itself
    lets a later registration replace the kernel."""
    if "allow_override" in inspect.signature(Library.impl).parameters:
        _EAGER_KERNELS.impl(op_name, kernel, dispatch_key, with_keyset=True,
                            allow_override=True)
    else:
        torch.library._impls.discard(f"{NAMESPACE}/{op_name}/{dispatch_key}")
        _EAGER_KERNELS.impl(op_name, kernel, dispatch_key, with_keyset=True)


def _version_bump(overload: torch._ops.OpOverload) -> Callable:
    """The ADInplaceOrView kernel of a mutating ``.triton`` overload: bump the version counter
    of every argument its schema writes, then run the kernels below that key. The custom op's
    own kernel does the same after normalizing the arguments against the schema on every call
    (most of an eager call's host time for ``quantize_nvfp4_out``); the written arguments'
    positions and names are read from the schema once, here."""
    arguments = overload._schema.arguments
    written = tuple((i, a.name) for i, a in enumerate(arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    below = torch._C._after_ADInplaceOrView_keyset

    def bump_versions(keyset, *args, **kwargs):
        for index, name in written:
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                torch.autograd.graph.increment_version(value)
        # (below the key, as torch's own kernel of earlier versions redispatched)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return overload.redispatch(keyset & below, *args, **kwargs)
    return bump_versions


def check_config_parameters(fn: Callable, *config_classes: type,
                            prefixes: Sequence[str] = ()) -> None:
    """Raise TypeError unless the last parameters of the op function ``fn`` are the fields of
    the launch config classes ``config_classes``, one class after the other, by name (each
    field's name after the class's prefix in ``prefixes``, "" by default) and in order (so
    that a field added to a config cannot be dropped silently on its way through the op)."""
    names = []
    for i, config_cls in enumerate(config_classes):
        prefix = prefixes[i] if i < len(prefixes) else ""
        names += [prefix + field.name for field in dataclasses.fields(config_cls)]
    params = list(inspect.signature(fn).parameters)[-len(names):]
    if params != names:
        classes = " + ".join(config_cls.__name__ for config_cls in config_classes)
        raise TypeError(f"{fn.__name__} takes {params} as its launch parameters but "
                        f"{classes} has the fields {names}: make the op's trailing "
                        f"parameters the config's fields")


def config_fields(config) -> tuple:
    """The values of a frozen launch config's fields, in field order: the trailing arguments
    of a ``.triton`` overload (rebuild the config with ``type(config)(*values)``)."""
    return tuple(getattr(config, field.name) for field in dataclasses.fields(config))


def eager_bypass(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a public function may run its op's launch directly instead of calling the op:
    not being traced (``torch.compile``, export), no TorchDispatchMode active (a profiler by op
    name, fake or functional tensors), and plain tensors (no subclass). The launch is then
    exactly the op's, so the results are the same bits.

    The op's own eager dispatch is cheap too (a backend kernel under a fallthrough autograd
    key: :func:`register`), but the bypass skips the dispatcher altogether; docs/design.md,
    "Registered ops"."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return False
    return True


# =============================================================================================
# Device-read checks as an op
# =============================================================================================

# name -> the check (reads tensors on the host, raises ValueError); filled by the kernel
# modules with :func:`register_value_check`.
VALUE_CHECKS: dict[str, Callable[..., None]] = {}


def register_value_check(name: str, check: Callable[..., None]) -> None:
    """Register ``check(*tensors, *sizes)``, the device-read check called ``name``."""
    if name in VALUE_CHECKS:
        raise ValueError(f"value check {name!r} is registered twice")
    VALUE_CHECKS[name] = check


_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


@custom_op(f"{NAMESPACE}::check_values", mutates_args=(),
           tags=(_CUDAGRAPH_UNSAFE,) if _CUDAGRAPH_UNSAFE is not None else ())
def check_values_op(check: str, tensors: list[Optional[torch.Tensor]],
                    sizes: list[int]) -> None:
    """Run the device-read check ``check`` (one host read) on ``tensors`` and ``sizes``;
    raises its ValueError. Returns nothing: registered as side-effecting, so that dead-code
    elimination keeps it."""
    VALUE_CHECKS[check](*tensors, *sizes)


@check_values_op.register_fake
def _check_values_fake(check, tensors, sizes):
    return None


torch.fx.node.has_side_effect(torch.ops.moe_a2a.check_values.default)


def run_value_check(check: str, tensors: Sequence[Optional[torch.Tensor]],
                    sizes: Sequence[int]) -> None:
    """The device-read check ``check``: called directly in eager mode (:func:`eager_bypass`),
    through ``moe_a2a::check_values`` while tracing (the values are then read when the
    compiled code runs)."""
    if eager_bypass(*tensors):
        VALUE_CHECKS[check](*tensors, *sizes)
    else:
        torch.ops.moe_a2a.check_values(check, list(tensors), list(sizes))
