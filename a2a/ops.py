"""The collective calls of :class:`~a2a.alltoall.MoEAlltoall` as registered operators, so that a
compiled model step (``torch.compile(fullgraph=True)``) holds prepare, dispatch and combine
without a graph break.

Ops (namespace ``moe_a2a``), opaque to the compiler (they are collectives: their kernels wait
for other ranks, and the torch transport reads counts to the host, all inside the op):

``moe_a2a::prepare(handle, topk_ids, topk_weights, state) -> (local, received)``
``moe_a2a::dispatch(handle, x, plan, state) -> rows``
``moe_a2a::dispatch_nvfp4(handle, x, global_scale, plan, state) -> (packed, scales)``
``moe_a2a::dispatch_mxfp8(handle, x, plan, state) -> (codes, scales)``
``moe_a2a::combine(handle, expert_out, plan, num_tokens, state) -> out``

``handle`` (int) names the MoEAlltoall object in a registry of this process (:func:`register`;
removed by ``close()``), so the op reads the object's configuration and its peer-mapped
workspaces there. ``plan`` is the list of :data:`PLAN_TENSORS` of an
:class:`~kernels.types.AlltoallPlan`. ``state`` is the list of tensors the call writes, declared
mutated in the schema (``Tensor(a!)[] state``; ``a2a.resources``): the device call counters and
the status buffer of the Triton prepare or transport, or, for the torch and FlashInfer
backends, the object's ``sequence`` counter, which the op increments. Declared mutations keep
the ops in the graph (an op that mutates nothing and whose result is unused would be deleted)
and in program order where no data orders them.

The workspaces are not op arguments: they are the collective's own memory, mapped into the
peers' address spaces (like a communicator's buffers); a compiled graph must never clone one,
which it would do to a functionalised argument it cannot reuse in place. They are made
before the compiled region (``MoEAlltoall.allocate``) and found through the handle.

Outputs are fresh tensors with static shapes (the capacity N*R of the object), so every fake
is exact. The prepare op returns its plan as two int32 buffers in the layout of
:func:`plan_layout` (the Triton prepare's own buffers, returned without a copy; the other
prepares copy into it), and :func:`plan_from_buffers` carves the plan's views out of them in
the traced code: a custom op may not return tensors that share storage.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import NamedTuple, Optional

import torch

from kernels.types import AlltoallPlan

# The tensors of a plan that dispatch and combine take, in this order (expert_counts is not
# read by any transport).
PLAN_TENSORS = ("send_rank_count_cumsum", "send_rank_local_indices",
                "backward_recv_rank_local_indices", "recv_rank_count_cumsum",
                "recv_rank_local_indices", "recv_expert_ids", "recv_weights")

# handle -> MoEAlltoall. Weak: an object that is dropped without close() is still freed.
_OBJECTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(owner) -> int:
    """Register ``owner`` (a MoEAlltoall) and return its handle, unique in this process."""
    handle = next(_HANDLES)
    _OBJECTS[handle] = owner
    return handle


def unregister(handle: int) -> None:
    """Forget the object of ``handle`` (a no-op when it is not registered)."""
    _OBJECTS.pop(handle, None)


def registered(handle: int):
    """The MoEAlltoall of ``handle``; RuntimeError when it was closed or garbage-collected."""
    owner = _OBJECTS.get(handle)
    if owner is None:
        raise RuntimeError(f"no MoEAlltoall has handle {handle} in this process (it was closed "
                           f"or garbage-collected); a compiled graph that calls it must be "
                           f"re-traced with a live object (torch._dynamo.reset())")
    return owner


# ---------------------------------------------------------------------------------------------
# The plan as two buffers
# ---------------------------------------------------------------------------------------------

class PlanLayout(NamedTuple):
    """Where the plan's tensors lie in the prepare op's two int32 buffers.

    local:    split sizes of the local buffer (``kernels.prepare.plan_config(...).pieces``:
              send_counts, send_cumsum, send_indices, backward, expert_counts [S], scratch,
              each followed by its padding to 16 bytes).
    received: split sizes of the received buffer (``a2a.triton_prepare.exchange_config``'s
              pieces: recv_cumsum, recv_local, recv_ids, recv_weights (float32 bits),
              expert_counts [R, S], status, each with its padding).
    """

    local: tuple
    received: tuple

    @property
    def local_words(self) -> int:
        return sum(self.local)

    @property
    def received_words(self) -> int:
        return sum(self.received)


# Index of each plan tensor among the split pieces of its buffer (even entries are the parts,
# odd ones their padding).
_LOCAL_PARTS = {"send_rank_count_cumsum": 2, "send_rank_local_indices": 4,
                "backward_recv_rank_local_indices": 6}
_RECEIVED_PARTS = {"recv_rank_count_cumsum": 0, "recv_rank_local_indices": 2,
                   "recv_expert_ids": 4, "recv_weights": 6, "expert_counts": 8}


@functools.lru_cache(maxsize=64)
def plan_layout(ep_size: int, max_tokens_per_rank: int, top_k: int, slot_count: int
                ) -> PlanLayout:
    """The buffers' layout for R, N, k, S (the Triton prepare's; no dependence on T)."""
    from a2a.triton_prepare import exchange_config
    from kernels.prepare import plan_config
    local = plan_config(max_tokens_per_rank, ep_size, top_k, slot_count).pieces
    # The pieces of the received buffer do not depend on the exchange's grid bound.
    received = exchange_config(ep_size, max_tokens_per_rank, top_k, slot_count, 1).pieces
    return PlanLayout(local=local, received=received)


def plan_from_buffers(local: torch.Tensor, received: torch.Tensor, layout: PlanLayout, *,
                      ep_rank: int, ep_size: int, max_tokens_per_rank: int, num_tokens,
                      top_k: int, slot_count: int) -> AlltoallPlan:
    """The :class:`AlltoallPlan` whose tensors are views of the prepare op's two buffers
    (only splits and views: traceable, no copy). ``num_tokens`` may be symbolic."""
    local_parts = local.split(layout.local)
    received_parts = received.split(layout.received)
    rows = max_tokens_per_rank * ep_size
    fields = {name: local_parts[index] for name, index in _LOCAL_PARTS.items()}
    fields.update({name: received_parts[index] for name, index in _RECEIVED_PARTS.items()})
    fields["recv_expert_ids"] = fields["recv_expert_ids"].view(rows, top_k)
    fields["recv_weights"] = fields["recv_weights"].view(torch.float32).view(rows, top_k)
    fields["expert_counts"] = fields["expert_counts"].view(ep_size, slot_count)
    return AlltoallPlan(**fields, ep_rank=ep_rank, ep_size=ep_size,
                        max_tokens_per_rank=max_tokens_per_rank, num_tokens=num_tokens,
                        top_k=top_k, slot_count=slot_count)


def _whole_buffer(plan: AlltoallPlan, parts: dict, pieces: tuple) -> Optional[torch.Tensor]:
    """The int32 buffer whose split by ``pieces`` holds the plan's ``parts`` as its own views,
    or None when they are not laid out so."""
    first = getattr(plan, next(iter(parts)))
    storage = first.untyped_storage()
    words = sum(pieces)
    if storage.nbytes() != 4 * words:
        return None
    starts = list(itertools.accumulate((0,) + tuple(pieces)))
    for name, index in parts.items():
        tensor = getattr(plan, name)
        if (tensor.untyped_storage().data_ptr() != storage.data_ptr()
                or tensor.storage_offset() * tensor.element_size() != 4 * starts[index]
                or tensor.numel() != pieces[index] or not tensor.is_contiguous()):
            return None
    return first.view(torch.int32).as_strided((words,), (1,), 0)


def plan_buffers(plan: AlltoallPlan, layout: PlanLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepare op's result for ``plan``: (local, received) int32 buffers in ``layout``.

    A plan of the Triton prepare already lies in two such buffers: they are returned as they
    are (no copy; the padding words are left unwritten). Other plans (torch, FlashInfer) are
    copied into zeroed buffers. Either way :func:`plan_from_buffers` gives back the plan's
    values bit for bit (expert_counts, when None, as zeros).
    """
    local = _whole_buffer(plan, _LOCAL_PARTS, layout.local)
    received = None
    if plan.expert_counts is not None:
        received = _whole_buffer(plan, _RECEIVED_PARTS, layout.received)
    device = plan.send_rank_count_cumsum.device
    if local is None:
        local = torch.zeros(layout.local_words, dtype=torch.int32, device=device)
        parts = local.split(layout.local)
        for name, index in _LOCAL_PARTS.items():
            parts[index].copy_(getattr(plan, name))
    if received is None:
        received = torch.zeros(layout.received_words, dtype=torch.int32, device=device)
        parts = received.split(layout.received)
        for name, index in _RECEIVED_PARTS.items():
            tensor = getattr(plan, name)
            if tensor is not None:
                if tensor.dtype == torch.float32:
                    tensor = tensor.view(torch.int32)
                parts[index].copy_(tensor.reshape(-1))
    return local, received


def plan_tensors(plan: AlltoallPlan) -> list[torch.Tensor]:
    """The plan's :data:`PLAN_TENSORS`, the ``plan`` argument of dispatch and combine."""
    return [getattr(plan, name) for name in PLAN_TENSORS]


def plan_of(tensors: list[torch.Tensor], *, ep_rank: int, ep_size: int,
            max_tokens_per_rank: int, num_tokens: int, top_k: int,
            slot_count: int) -> AlltoallPlan:
    """The :class:`AlltoallPlan` of :func:`plan_tensors` (expert_counts None)."""
    return AlltoallPlan(**dict(zip(PLAN_TENSORS, tensors)), expert_counts=None,
                        ep_rank=ep_rank, ep_size=ep_size,
                        max_tokens_per_rank=max_tokens_per_rank, num_tokens=num_tokens,
                        top_k=top_k, slot_count=slot_count)


# ---------------------------------------------------------------------------------------------
# The ops: defined on a fragment of the namespace (the single-GPU ops of the library register
# there too), implemented for every device by one CompositeExplicitAutograd kernel that calls
# the object's ``move_*`` method (the data movement of one call on checked arguments, without
# the agreement, writing ``state``); each fake allocates the result's static shape.
#
# Why not torch.library.custom_op: for an op that mutates an argument it dispatches through
# Python autograd and ADInplaceOrView kernels, adding several tens of microseconds of host time
# per call, paid by every compiled call that is not replayed from a CUDA graph; a kernel
# registered directly costs a few. These ops have no autograd formula (a collective has none
# here) and launch no triton_op kernels, so nothing is lost.
# ---------------------------------------------------------------------------------------------

SCHEMAS = {
    "prepare": "prepare(int handle, Tensor topk_ids, Tensor topk_weights, Tensor(a!)[] state) "
               "-> (Tensor, Tensor)",
    "dispatch": "dispatch(int handle, Tensor x, Tensor[] plan, Tensor(a!)[] state) -> Tensor",
    "dispatch_nvfp4": "dispatch_nvfp4(int handle, Tensor x, Tensor global_scale, Tensor[] plan, "
                      "Tensor(a!)[] state) -> (Tensor, Tensor)",
    "dispatch_mxfp8": "dispatch_mxfp8(int handle, Tensor x, Tensor[] plan, Tensor(a!)[] state) "
                      "-> (Tensor, Tensor)",
    "combine": "combine(int handle, Tensor expert_out, Tensor[] plan, SymInt num_tokens, "
               "Tensor(a!)[] state) -> Tensor",
}

# Kept alive for the process: dropping the Library would unregister the ops.
LIBRARY = torch.library.Library("moe_a2a", "FRAGMENT")
for _schema in SCHEMAS.values():
    LIBRARY.define(_schema)


def _impl(name: str):
    def register(fn):
        LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return register


def _fake(name: str):
    def register(fn):
        torch.library.register_fake(f"moe_a2a::{name}", fn, lib=LIBRARY)
        return fn
    return register


@_impl("prepare")
def prepare_op(handle, topk_ids, topk_weights, state):
    """MoEAlltoall.prepare of object ``handle``: (local [L] int32, received [M] int32), the
    plan in :func:`plan_layout` (see :func:`plan_from_buffers`)."""
    return registered(handle).move_prepare(topk_ids, topk_weights, state)


@_fake("prepare")
def prepare_fake(handle, topk_ids, topk_weights, state):
    layout = registered(handle).plan_layout
    return (topk_ids.new_empty(layout.local_words, dtype=torch.int32),
            topk_ids.new_empty(layout.received_words, dtype=torch.int32))


@_impl("dispatch")
def dispatch_op(handle, x, plan, state):
    """MoEAlltoall.dispatch(x, plan) of object ``handle``: [N*R, H] of x's dtype."""
    return registered(handle).move_dispatch(x, plan, None, None, state)


@_fake("dispatch")
def dispatch_fake(handle, x, plan, state):
    owner = registered(handle)
    return x.new_empty((owner.max_tokens_per_rank * owner.ep_size, x.shape[1]))


@_impl("dispatch_nvfp4")
def dispatch_nvfp4_op(handle, x, global_scale, plan, state):
    """MoEAlltoall.dispatch(x, plan, quant="nvfp4", global_scale=...) of object ``handle``:
    (packed [N*R, H/2] uint8, scales [N*R, H/16] uint8 e4m3 bits)."""
    return registered(handle).move_dispatch(x, plan, "nvfp4", global_scale, state)


@_fake("dispatch_nvfp4")
def dispatch_nvfp4_fake(handle, x, global_scale, plan, state):
    from kernels.spec.quant import NVFP4_BLOCK
    owner = registered(handle)
    rows, hidden = owner.max_tokens_per_rank * owner.ep_size, x.shape[1]
    return (x.new_empty((rows, hidden // 2), dtype=torch.uint8),
            x.new_empty((rows, hidden // NVFP4_BLOCK), dtype=torch.uint8))


@_impl("dispatch_mxfp8")
def dispatch_mxfp8_op(handle, x, plan, state):
    """MoEAlltoall.dispatch(x, plan, quant="mxfp8") of object ``handle``: (codes [N*R, H]
    float8_e4m3fn, scales [N*R, H/32] uint8 e8m0)."""
    return registered(handle).move_dispatch(x, plan, "mxfp8", None, state)


@_fake("dispatch_mxfp8")
def dispatch_mxfp8_fake(handle, x, plan, state):
    from kernels.spec.quant import MX_BLOCK
    owner = registered(handle)
    rows, hidden = owner.max_tokens_per_rank * owner.ep_size, x.shape[1]
    return (x.new_empty((rows, hidden), dtype=torch.float8_e4m3fn),
            x.new_empty((rows, hidden // MX_BLOCK), dtype=torch.uint8))


@_impl("combine")
def combine_op(handle, expert_out, plan, num_tokens, state):
    """MoEAlltoall.combine(expert_out, plan) of object ``handle`` (``num_tokens`` = the plan's
    T): [T, H] of expert_out's dtype."""
    return registered(handle).move_combine(expert_out, plan, num_tokens, state)


@_fake("combine")
def combine_fake(handle, expert_out, plan, num_tokens, state):
    return expert_out.new_empty((num_tokens, expert_out.shape[1]))
