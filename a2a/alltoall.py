"""``MoEAlltoall``: the EP all-to-all of one MoE layer over a process group.

One object per (group, layer shape). It owns the backends of two stages, each resolved once at
construction through ``a2a.backends.resolve``:

``prepare``   who sends which token where (an :class:`AlltoallPlan`):
              ``"triton"``      ``a2a.triton_prepare`` on a peer-mapped workspace (GPU);
              ``"flashinfer"``  FlashInfer's ``moe_prepare`` on a peer-mapped workspace (GPU);
              ``"torch"``       ``kernels.reference.local_send_plan`` + torch.distributed
                                collectives (gloo on CPU, NCCL on GPU).
``transport`` moving rows (dispatch) and returning them (combine):
              ``"triton"``      ``a2a.triton_transport``: direct stores into the peers'
                                MNNVL inboxes (GPU), no host sync;
              ``"flashinfer"``  FlashInfer's ``moe_comm`` over an MNNVL FIFO workspace;
              ``"torch"``       ``all_to_all_single`` with the plan's counts.
and, for ``dispatch(quant=...)``, the ``quantize`` stage. Any prepare works with any transport:
the plan is the contract (docs/design.md, "prepare contract").

Combine's reduction over k has one order (``kernels.reduce.sum_slots_in_order``: float32,
slot order, rounded once to the payload dtype), so the transports give bit-identical results;
how each backend moves the data is :mod:`a2a.movement`.

No rank left hanging: every collective call (construction, ``prepare``, ``dispatch``,
``combine``) first makes the ranks agree, over the process group's store and within the
object's ``timeout``, that every rank reached the same call and that every rank's arguments
passed its checks (:mod:`a2a.agreement`). One rank's bad argument raises on every rank, naming
it and the reason, before any data moves; a rank that does not arrive is named after
``timeout`` seconds, and the object then refuses every later call on every rank (a rank that
broke, e.g. by a timeout of the Triton transport, makes the others' next call fail). Objects
made with ``agree=False`` skip the per-call agreement (see :class:`MoEAlltoall`).

Workspaces (:mod:`a2a.workspace`) are made on first use, collectively, or all at once by
:meth:`MoEAlltoall.allocate`, and freed by :meth:`MoEAlltoall.close` (the object's device state
is :class:`a2a.resources.AlltoallResources`). The Triton transport makes one per transfer kind
and row size (dispatch of bf16 rows, of nvfp4 codes, of nvfp4 scales, combine of bf16 rows,
...), each with its own device-side call counter; the waits of the Triton prepare and transport
record timeouts in status buffers that :meth:`MoEAlltoall.check_transport` (and every
``prepare(check_inputs=True)``) reads (``a2a.protocol``). How the Triton prepare and transport
run (grid and spin bounds, the one-launch transfer, the quantizing send) is the object's
:class:`~a2a.config.PrepareConfig` and :class:`~a2a.config.TransportConfig`, fixed at
construction and agreed on by the ranks.

Compiled regions (``torch.compile``) and CUDA graphs
----------------------------------------------------
``prepare``, ``dispatch`` and ``combine`` may be called inside ``torch.compile(fullgraph=True)``:
there each call is one registered op (``a2a.ops``: ``moe_a2a::prepare``, ``::dispatch``,
``::dispatch_nvfp4``, ``::dispatch_mxfp8``, ``::combine``), opaque to the compiler, with
outputs of static shapes (the capacity N*R) and T symbolic, so T may change between calls
without a recompile (mark it dynamic: ``torch._dynamo.maybe_mark_dynamic(topk_ids, 0)``, same
for x). Such a *traced* call (``torch.compiler.is_compiling()``, or an argument that is not a
plain tensor, e.g. a fake tensor of ``make_fx``):

- needs its workspaces made before the region: call :meth:`MoEAlltoall.allocate` on every rank
  first (a missing one raises :class:`~a2a.resources.NotAllocated` while tracing);
- runs the host checks (dtypes, shapes, T <= N, the plan's object) while tracing, where a
  failure raises on that rank only; symbolic sizes become guards;
- never agrees with the other ranks and never reads device memory, whatever ``agree`` and
  ``check_inputs`` say, as a CUDA-graph replay: ids outside ``[0, S]`` are treated as padding,
  timeouts of the Triton waits stay in the status buffers until :meth:`check_transport` or an
  eager ``prepare(check_inputs=True)`` reads them, and a rank that errs or is missing is not
  detected (the others wait in the data movement: the Triton transports until their spin
  bound, the torch and FlashInfer ones until the process group's timeout). Every rank must
  run the same calls traced: an eager call of an ``agree=True`` object on one rank meets no
  agreement on the others and raises :class:`~a2a.agreement.PeerTimeout` (or, on the torch
  transport, waits for the peers' next eager call).

Eager calls do not go through the ops (the registered-op dispatch costs several microseconds
of host time per call): they run the same functions directly, with the same results bit for
bit. Prepare, dispatch and combine can also be captured in a CUDA graph, eagerly (with
``check_inputs=False``) or compiled; replays neither agree nor check.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from a2a import ops
from a2a.backends import resolve
from a2a.config import DEFAULT_TIMEOUT_S, PrepareConfig, TransportConfig
from a2a.resources import AlltoallResources
from a2a.movement import AlltoallMovement
from kernels.types import AlltoallPlan
from kernels.spec.prepare import PREPARE_MAX_TOP_K
from kernels.spec.quant import check_global_scale, check_global_scale_values
from kernels.spec.tensors import check_expert_ids, check_tensor, check_top_k

# Stages a MoEAlltoall runs, and the keys its ``backends`` dict may hold (a subset of
# ``a2a.backends.STAGES``).
ALLTOALL_STAGES = ("prepare", "transport", "quantize")
# Payload dtypes that dispatch and combine take unquantized.
PAYLOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANT_FORMATS = ("nvfp4", "mxfp8")


def _default_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """The device whose tensors ``group`` moves: the current accelerator for NCCL, else CPU."""
    if "nccl" in str(dist.get_backend(group)):
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _traced(*tensors) -> bool:
    """Whether a call is traced: inside torch.compile / export, or given tensors that are not
    plain (fake tensors of make_fx, subclasses); such calls go through the registered ops.
    (A loop, not a generator: this is on every eager call's path.)"""
    if torch.compiler.is_compiling():
        return True
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return True
    return False


class MoEAlltoall:
    """The dispatch / combine all-to-all of one MoE layer over ``ep_group``.

    Collective: every rank of ``ep_group`` constructs it with the same arguments, and calls
    ``prepare``, ``dispatch``, ``combine`` and ``close`` in the same order.

    Args:
        ep_group:            the expert-parallel process group (None = the default group);
                             R = its size, this rank = its rank in it.
        num_experts:         E, experts of the layer; must be a multiple of R.
        top_k:               k, experts per token.
        max_tokens_per_rank: N, the most tokens any rank passes to ``prepare`` (sizes buffers).
        hidden_size:         H, the row length of dispatch's ``x`` and combine's ``expert_out``.
        slot_count:          S >= E, slots (experts plus redundant copies), a multiple of R;
                             default E. Placement: ``rank(slot) = slot // (S // R)``.
        backends:            ``{"prepare": ..., "transport": ..., "quantize": ...}``, each
                             ``"triton"``, ``"flashinfer"``, ``"torch"`` or ``"auto"``; missing
                             keys take the default of ``MOE_A2A_BACKENDS`` (``a2a.backends``).
        device:              where the inputs live; default the current GPU for an NCCL group,
                             else the CPU.
        transport_config:    :class:`~a2a.config.TransportConfig` of the Triton transport
                             (default: every default); ignored by the other transports.
        prepare_config:      :class:`~a2a.config.PrepareConfig` of the Triton prepare (default:
                             every default); ignored by the other prepares.
        timeout:             seconds every collective call waits for the other ranks before it
                             raises :class:`~a2a.agreement.PeerTimeout` naming the missing ones
                             (default ``a2a.config.DEFAULT_TIMEOUT_S``, 300: room for a rank
                             that compiles kernels in its first call).
        agree:               True (default): every prepare / dispatch / combine first agrees
                             with the other ranks (about five round trips to the group's store
                             per call, a host cost). False, for a hot loop that must not pay
                             it: a bad argument then raises only on its rank while
                             the others enter the data movement and wait there (the torch and
                             FlashInfer transports until the process group's timeout, the Triton
                             ones until their spin bound, then with zeros), a missing or
                             out-of-step rank is not detected, and a broken object is known
                             only on its rank. Construction always agrees. A CUDA graph
                             captures no agreement either way: replays do not agree; nor do
                             traced (compiled) calls (see the module docstring).

    Raises (on every rank, before anything is sent) when the ranks disagree on the
    configuration, when one rank rejects it (E % R, FlashInfer's limits: E % 4 == 0 and
    k <= 32, an unavailable backend), when a backend cannot run here, or when a rank does not
    construct it within ``timeout``. A bad ``ep_group`` raises on its rank alone (there is no
    group to agree over).

    Attributes: ``ep_rank``, ``ep_size``, ``device``, ``backends`` (the resolved names),
    ``transport_config``, ``prepare_config``, ``timeout``, ``agree``, ``handle`` (the int the
    registered ops name this object by, ``a2a.ops``), ``plan_layout`` (``a2a.ops.PlanLayout``).
    """

    def __init__(self, ep_group: Optional[dist.ProcessGroup], num_experts: int, top_k: int,
                 max_tokens_per_rank: int, hidden_size: int, *, slot_count: Optional[int] = None,
                 backends: Optional[dict] = None, device: Optional[torch.device] = None,
                 transport_config: Optional[TransportConfig] = None,
                 prepare_config: Optional[PrepareConfig] = None,
                 timeout: float = DEFAULT_TIMEOUT_S, agree: bool = True):
        from a2a.agreement import Agreement
        self.group = ep_group
        self.ep_rank = dist.get_rank(ep_group)
        self.ep_size = dist.get_world_size(ep_group)
        self.num_experts = num_experts
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.hidden_size = hidden_size
        self.slot_count = num_experts if slot_count is None else slot_count
        self.transport_config = transport_config
        self.prepare_config = prepare_config
        self.timeout = timeout
        self.agree = agree
        self.backends: dict[str, str] = {}
        self.handle: Optional[int] = None
        self._closed = False
        error: Optional[Exception] = None
        try:
            self.device = (torch.device(device) if device is not None
                           else _default_device(ep_group))
            self._check_config(backends)
        except Exception as exc:  # agreed on below: raised on every rank
            error = exc
        self._agreement = Agreement(ep_group, self.ep_rank, self.ep_size,
                                    timeout if _valid_timeout(timeout) else DEFAULT_TIMEOUT_S)
        self._agreement.agree("construct", repr(self._configuration(backends)), error)
        self._resources = AlltoallResources(
            ep_group, self.device, ep_rank=self.ep_rank, ep_size=self.ep_size,
            max_tokens_per_rank=max_tokens_per_rank, top_k=top_k, num_experts=num_experts,
            slot_count=self.slot_count, backends=self.backends)
        # Where the prepare op's two buffers hold the plan (a2a.ops); the op's handle.
        self.plan_layout = ops.plan_layout(self.ep_size, max_tokens_per_rank, top_k,
                                           self.slot_count)
        self._movement = AlltoallMovement(
            ep_group, ep_rank=self.ep_rank, ep_size=self.ep_size, num_experts=num_experts,
            max_tokens_per_rank=max_tokens_per_rank, hidden_size=hidden_size,
            slot_count=self.slot_count, backends=self.backends,
            transport_config=self.transport_config, prepare_config=self.prepare_config,
            resources=self._resources)
        self.handle = ops.register(self)

    # -----------------------------------------------------------------------------------------
    # Construction helpers
    # -----------------------------------------------------------------------------------------

    def _check_config(self, backends) -> None:
        if backends is not None and not isinstance(backends, dict):
            raise TypeError(f"backends must be a dict {{stage: backend}} with stages "
                            f"{ALLTOALL_STAGES}, or None; got {type(backends).__name__} "
                            f"{backends!r} (e.g. backends={{'prepare': 'torch', 'transport': "
                            f"'torch'}})")
        requested = dict(backends or {})
        unknown = set(requested) - set(ALLTOALL_STAGES)
        if unknown:
            raise ValueError(f"backends has unknown stage(s) {sorted(unknown)}; the stages are "
                             f"{ALLTOALL_STAGES}")
        for name, value in (("num_experts", self.num_experts),
                            ("max_tokens_per_rank", self.max_tokens_per_rank),
                            ("hidden_size", self.hidden_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} must be a multiple of the group "
                             f"size {self.ep_size} (linear expert placement)")
        if not isinstance(self.slot_count, int) or self.slot_count < self.num_experts \
                or self.slot_count % self.ep_size:
            raise ValueError(f"slot_count={self.slot_count!r} must be an int >= num_experts="
                             f"{self.num_experts} and a multiple of the group size "
                             f"{self.ep_size}; leave it None for S = E")
        check_top_k(self.top_k, self.slot_count, limit=PREPARE_MAX_TOP_K,
                    limit_reason="FlashInfer's moe_prepare and the contract")
        if not _valid_timeout(self.timeout):
            raise ValueError(f"timeout={self.timeout!r} must be a positive number of seconds")
        if not isinstance(self.agree, bool):
            raise TypeError(f"agree={self.agree!r} must be True or False")
        if self.transport_config is None:
            self.transport_config = TransportConfig()
        if self.prepare_config is None:
            self.prepare_config = PrepareConfig()
        for name, value, kind in (("transport_config", self.transport_config, TransportConfig),
                                  ("prepare_config", self.prepare_config, PrepareConfig)):
            if not isinstance(value, kind):
                raise TypeError(f"{name} must be an a2a.config.{kind.__name__} (or None), got "
                                f"{type(value).__name__}")
        self.backends = {stage: resolve(stage, requested.get(stage), self.device)
                         for stage in ALLTOALL_STAGES}
        if self.backends["prepare"] == "flashinfer":
            from a2a.flashinfer_comm import check_flashinfer_prepare_limits
            check_flashinfer_prepare_limits(self.num_experts, self.slot_count, self.top_k)

    def _configuration(self, backends) -> tuple:
        """What every rank must construct alike (compared by the construction agreement)."""
        chosen = tuple(sorted(self.backends.items())) or repr(backends)
        return (("num_experts", self.num_experts), ("top_k", self.top_k),
                ("max_tokens_per_rank", self.max_tokens_per_rank),
                ("hidden_size", self.hidden_size), ("slot_count", self.slot_count),
                ("backends", chosen), ("transport_config", self.transport_config),
                ("prepare_config", self.prepare_config), ("timeout", self.timeout),
                ("agree", self.agree))

    # -----------------------------------------------------------------------------------------
    # State
    # -----------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> Optional[str]:
        """Why this object is unusable on this rank (a peer timed out, data movement failed,
        a Triton wait timed out), or None."""
        return self._agreement.broken

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this MoEAlltoall is closed (its workspaces are freed); "
                               "construct a new one")
        self._agreement.check_usable()

    def _agree(self, what: str, signature: str, error: Optional[Exception]) -> None:
        """Before any data moves: agree with every rank (raises on every rank when a rank
        rejected its arguments, is at another call, or is missing), or, with ``agree=False``,
        raise this rank's own ``error``."""
        if self.agree:
            self._agreement.agree(what, signature, error)
        elif error is not None:
            raise error

    def _break(self, reason: str) -> None:
        """This rank's object broke: refuse every later call here and (agreeing objects) make
        the other ranks' next call fail, naming this rank."""
        self._agreement.poison(f"rank {self.ep_rank}: {reason}", tell_peers=self.agree)

    def _moving(self, what: str, move: Callable):
        """Run ``move`` (the data movement of an agreed call); an error while data moves leaves
        the ranks out of step, so it breaks the object."""
        from a2a.agreement import describe
        try:
            return move()
        except Exception as exc:
            self._break(f"{what} failed while moving data: {describe(exc)}")
            raise

    def flashinfer_comm_workspace(self) -> torch.Tensor:
        """FlashInfer's ``moe_comm`` workspace of this object ([R, words] uint64, made on first
        use: collective), for driving FlashInfer's own ``MnnvlMoe`` alltoallv with this
        object's plans (``a2a.flashinfer_comm.to_flashinfer_info``)."""
        self._check_usable()
        return self._resources.workspace("comm")

    def allocate(self, dtypes=(torch.bfloat16,), quant=()) -> None:
        """Make now every workspace that ``prepare`` and the dispatches and combines of
        ``dtypes`` payloads, and ``dispatch(quant=q)`` for each q in ``quant``, use
        (collective: every rank calls it with the same arguments; the ranks first agree, as
        at every collective call, unless ``agree=False``). Eager calls make what they use on
        first use; a compiled region cannot (see the module docstring), so call this before
        it. Calling again only makes what is missing.

        dtypes: payload dtypes of dispatch's x and combine's expert_out (bfloat16, float16,
                float32).
        quant:  quantized dispatch formats: "nvfp4", "mxfp8".
        Raises before anything is made, on every rank, when a rank's arguments are bad or
        its rows do not suit the transport (the MNNVL transports move rows of 16n bytes).
        """
        self._check_usable()
        error: Optional[Exception] = None
        try:
            dtypes, quant = tuple(dtypes), tuple(quant)
            for dtype in dtypes:
                if dtype not in PAYLOAD_DTYPES:
                    raise TypeError(f"allocate: dtype {dtype} must be one of {PAYLOAD_DTYPES}")
            for fmt in quant:
                if fmt not in QUANT_FORMATS:
                    raise ValueError(f"allocate: quant={fmt!r} must be one of {QUANT_FORMATS}")
            transfers = [(kind, self._movement.transfers(kind, None, dtype))
                         for kind in ("dispatch", "combine") for dtype in dtypes]
            transfers += [("dispatch", self._movement.transfers("dispatch", fmt, None))
                          for fmt in quant]
            for _, parts in transfers:
                for name, row_bytes in parts:
                    self._movement.check_row_bytes(name, row_bytes)
        except Exception as exc:  # agreed on below: raised on every rank
            error = exc
        self._agree("allocate", repr((dtypes, quant)), error)

        def make():
            self._resources.prepare_state()
            for kind, parts in transfers:
                self._resources.transport_state(kind, [row_bytes for _, row_bytes in parts])
        self._moving("allocate", make)

    def check_transport(self) -> None:
        """Raise ``a2a.protocol.PrepareTimeout`` or ``TransportTimeout`` naming the source
        ranks when a wait of the Triton prepare or transport timed out since construction
        (reads the status buffers: a host sync each); the object is then broken (its
        workspaces are stale). Also done by every ``prepare(check_inputs=True)``, where it
        raises on every rank. A no-op for the other backends. Traced (compiled) and captured
        calls record their timeouts there too, unread until this is called."""
        error = self._resources.timeout()
        if error is not None:
            self._break(str(error))
            raise error

    def close(self) -> None:
        """Free the workspaces (collective when it holds any: the ranks first agree, like the
        other collective calls); the object is unusable after, and its handle is no longer
        registered (a compiled graph calling it raises). Closing twice is a no-op. A
        broken object, or one whose closing agreement fails (a peer missing or at another
        call), frees nothing collectively (freeing waits for every rank): its workspaces are
        released when they are garbage-collected, or at exit."""
        if self._closed:
            return
        self._closed = True
        ops.unregister(self.handle)
        workspaces = self._resources.release()
        if not workspaces or self.broken is not None:
            return
        if self.agree:
            from a2a.agreement import BrokenAlltoall, PeerRejected, PeerTimeout
            try:
                self._agreement.agree("close", "", None)
            except (BrokenAlltoall, PeerRejected, PeerTimeout) as exc:
                self._agreement.poison(f"rank {self.ep_rank}: close: {exc}")
                return
        for kind in sorted(workspaces):
            workspaces[kind].close()

    def __enter__(self) -> "MoEAlltoall":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else (", broken" if self.broken else "")
        return (f"MoEAlltoall(rank {self.ep_rank}/{self.ep_size}, E={self.num_experts}, "
                f"k={self.top_k}, N={self.max_tokens_per_rank}, H={self.hidden_size}, "
                f"S={self.slot_count}, backends={self.backends}{state})")

    # -----------------------------------------------------------------------------------------
    # prepare
    # -----------------------------------------------------------------------------------------

    def prepare(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                sanitize: bool = False, check_inputs: bool = True) -> AlltoallPlan:
        """Who sends which token where, and what each rank receives (collective).

        topk_ids:     [T, k] int32 contiguous on ``device``, T <= N; slot ids in ``[0, S)``,
                      or S for "no expert" (padding, sent nowhere).
        topk_weights: [T, k] float32 contiguous, the routing weights.
        sanitize:     map every id outside ``[0, S]`` (e.g. -1) to S instead of raising; such
                      slots are sent nowhere and contribute nothing to combine.
        check_inputs: the checks that read device memory (a host sync each): range-check the
                      ids (an id outside ``[0, S]`` raises on every rank before anything is
                      sent); read the timeout status of the Triton prepare and transport
                      (timeouts of earlier calls, see :meth:`check_transport`: raised on
                      every rank, the object is then broken); the Triton prepare also reads
                      its status after the exchange and raises naming missing ranks.
                      False (benchmarks, CUDA graphs): none of these; an id outside
                      ``[0, S]`` is then treated as padding (sent nowhere) on every prepare
                      backend. The host checks (dtypes, shapes, T <= N) and the agreement
                      with the other ranks run either way (unless ``agree=False``). A traced
                      (compiled) call runs as with False and never agrees (module docstring).
        Returns this rank's :class:`AlltoallPlan` (expert_counts [R, S] filled).
        """
        if _traced(topk_ids, topk_weights):
            return self._traced_prepare(topk_ids, topk_weights, sanitize)
        self._check_usable()
        error: Optional[Exception] = None
        try:
            topk_ids = self._checked_routing(topk_ids, topk_weights, sanitize, check_inputs)
        except Exception as exc:  # agreed on below: raised on every rank
            error = exc
        if check_inputs and error is None:
            timed_out = self._resources.timeout()
            if timed_out is not None:  # the other ranks' agreement raises, naming this rank
                self._break(str(timed_out))
                raise timed_out
        self._agree("prepare", "", error)
        return self._moving("prepare", lambda: self._movement.prepare(
            topk_ids, topk_weights, self._resources.prepare_state(), check_inputs))

    def _traced_prepare(self, topk_ids, topk_weights, sanitize: bool) -> AlltoallPlan:
        """prepare inside a compiled region: host checks, then the op (no agreement, no device
        read); the plan is carved out of the op's two buffers."""
        self._check_usable()
        topk_ids = self._checked_routing(topk_ids, topk_weights, sanitize, False)
        state = self._resources.prepare_state(create=False)
        local, received = torch.ops.moe_a2a.prepare(self.handle, topk_ids, topk_weights, state)
        return ops.plan_from_buffers(
            local, received, self.plan_layout, ep_rank=self.ep_rank, ep_size=self.ep_size,
            max_tokens_per_rank=self.max_tokens_per_rank, num_tokens=topk_ids.shape[0],
            top_k=self.top_k, slot_count=self.slot_count)

    def _checked_routing(self, topk_ids, topk_weights, sanitize: bool,
                         check_ids: bool) -> torch.Tensor:
        check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2, device=self.device,
                     contiguous=True)
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2,
                     device=self.device, contiguous=True)
        num_tokens, top_k = topk_ids.shape
        if top_k != self.top_k:
            raise ValueError(f"topk_ids has {top_k} columns but this MoEAlltoall has "
                             f"top_k={self.top_k}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)} but topk_ids "
                             f"has {tuple(topk_ids.shape)}; they must match")
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(f"got {num_tokens} tokens but max_tokens_per_rank="
                             f"{self.max_tokens_per_rank}; construct the MoEAlltoall with a "
                             f"larger max_tokens_per_rank (it sizes every buffer)")
        slots = self.slot_count
        if check_ids and not sanitize:
            try:
                check_expert_ids("topk_ids", topk_ids, slots, allow_padding=True)
            except ValueError as exc:
                raise ValueError(f"{exc}; pass sanitize=True to map such ids to {slots} "
                                 f"(no expert)") from None
            return topk_ids
        if sanitize or self.backends["prepare"] != "triton":
            # Unchecked ids outside [0, S] become padding, as the Triton prepare's kernel
            # treats them (FlashInfer's would send a negative id to rank 0, the torch one
            # would index with it); no host sync.
            outside = (topk_ids < 0) | (topk_ids > slots)
            return torch.where(outside, torch.full_like(topk_ids, slots), topk_ids)
        return topk_ids

    # -----------------------------------------------------------------------------------------
    # dispatch / combine
    # -----------------------------------------------------------------------------------------

    def _check_plan(self, plan: AlltoallPlan) -> None:
        if not isinstance(plan, AlltoallPlan):
            raise TypeError(f"plan must be an AlltoallPlan (from prepare), got "
                            f"{type(plan).__name__}")
        mine = (self.ep_rank, self.ep_size, self.max_tokens_per_rank, self.top_k,
                self.slot_count)
        theirs = (plan.ep_rank, plan.ep_size, plan.max_tokens_per_rank, plan.top_k,
                  plan.slot_count)
        if theirs != mine:
            raise ValueError(f"plan was made for (ep_rank, ep_size, N, k, S) = {theirs}, this "
                             f"MoEAlltoall is {mine}")
        if plan.send_rank_count_cumsum.device != self.device:
            raise ValueError(f"plan is on {plan.send_rank_count_cumsum.device}, this "
                             f"MoEAlltoall on {self.device}")

    def dispatch(self, x: torch.Tensor, plan: AlltoallPlan, *, quant: Optional[str] = None,
                 global_scale: Optional[torch.Tensor] = None, check_values: bool = True):
        """Send every token's row to the ranks the plan names (collective).

        x:            [T, H] bfloat16 / float16 / float32 contiguous, T = plan.num_tokens.
        plan:         this rank's plan from :meth:`prepare`.
        quant:        None: move x as is. ``"nvfp4"``: quantize locally (quantize stage,
                      linear scale layout), move packed rows and scale rows as two tensors
                      (or, with ``TransportConfig.fused_nvfp4_dispatch``, quantize in the
                      Triton send kernel: one transfer).
                      ``"mxfp8"``: likewise with MXFP8 codes and e8m0 scales (blocks of 32).
                      The same on every rank.
        global_scale: [1] float32, the NVFP4 global encode scale (448*6 / amax); nvfp4 only.
        check_values: nvfp4: read the global scale (one host sync) and raise ValueError on every
                      rank unless it is finite and in [2^-126, 2^126]
                      (``kernels.spec.check_global_scale_value``); False skips the read (CUDA
                      graph capture; a traced call never reads it).
        Every argument is checked, and x quantized locally, before the agreement with the
        other ranks: a rejection on any rank raises on every rank before anything is sent.
        (A traced call checks while tracing, quantizes inside its op and never agrees.)
        Returns, rows by source rank then the source's send order, rows past total_recv 0:
        quant None: [N*R, H] of x's dtype; ``"nvfp4"``: (packed [N*R, H/2] uint8, two e2m1 per
        byte, scales [N*R, H/16] uint8 e4m3 bits); ``"mxfp8"``: (codes [N*R, H] and scales
        [N*R, H/32] uint8 e8m0, codes in the quantizer's dtype, float8_e4m3fn).
        """
        if _traced(x, global_scale):
            return self._traced_dispatch(x, plan, quant, global_scale)
        self._check_usable()
        error: Optional[Exception] = None
        move = None
        try:
            self._check_dispatch(x, plan, quant, global_scale)
            if quant == "nvfp4" and check_values:
                check_global_scale_values(global_scale)
            move = self._movement.stage_dispatch(x, plan, quant, global_scale, None)
        except Exception as exc:  # agreed on below: raised on every rank
            error = exc
        dtype = getattr(x, "dtype", None)
        self._agree("dispatch", f"quant={quant!r}" + (f", x {dtype}" if quant is None else ""),
                    error)
        return self._moving("dispatch", move)

    def _check_dispatch(self, x, plan, quant, global_scale) -> None:
        """dispatch's host checks (shapes, dtypes, devices: no device read)."""
        self._check_plan(plan)
        check_tensor("x", x, dtype=PAYLOAD_DTYPES, ndim=2, device=self.device, contiguous=True)
        if tuple(x.shape) != (plan.num_tokens, self.hidden_size):
            raise ValueError(f"x has shape {tuple(x.shape)} but the plan is for "
                             f"{plan.num_tokens} tokens and hidden_size={self.hidden_size}: "
                             f"expected {(plan.num_tokens, self.hidden_size)}")
        if quant is not None and quant not in QUANT_FORMATS:
            raise ValueError(f"quant={quant!r} must be None or one of {QUANT_FORMATS}")
        if quant != "nvfp4" and global_scale is not None:
            raise ValueError("global_scale is only used with quant='nvfp4'")
        if quant is None:
            self._movement.check_rows(x, "x")
        elif quant == "nvfp4":
            if global_scale is None:
                raise ValueError("quant='nvfp4' needs global_scale ([1] float32, 448*6 / amax)")
            check_global_scale(global_scale, self.device)

    def _traced_dispatch(self, x, plan, quant, global_scale):
        """dispatch inside a compiled region: host checks, then one op (which quantizes)."""
        self._check_usable()
        self._check_dispatch(x, plan, quant, global_scale)
        if quant is not None:
            for name, row_bytes in self._movement.transfers("dispatch", quant, x.dtype):
                self._movement.check_row_bytes(name, row_bytes)
        state = self._movement.transport_state("dispatch", quant, x.dtype, create=False)
        tensors = ops.plan_tensors(plan)
        if quant is None:
            return torch.ops.moe_a2a.dispatch(self.handle, x, tensors, state)
        if quant == "nvfp4":
            return torch.ops.moe_a2a.dispatch_nvfp4(self.handle, x, global_scale, tensors,
                                                    state)
        return torch.ops.moe_a2a.dispatch_mxfp8(self.handle, x, tensors, state)

    def combine(self, expert_out: torch.Tensor, plan: AlltoallPlan) -> torch.Tensor:
        """Return every received row to its source and sum over k (collective).

        expert_out: [N*R, H] bfloat16 / float16 / float32 contiguous: for each row this rank
                    received (dispatch's row order), the sum over its local slots j of
                    ``recv_weights[i, j] * expert(recv_expert_ids[i, j])(row)``; rows past
                    total_recv are not read. The same dtype on every rank.
        plan:       the plan the rows were dispatched with.
        The arguments are checked before the agreement with the other ranks (a rejection on
        any rank raises on every rank before anything is sent; a traced call checks while
        tracing and never agrees).
        Returns [T, H] of expert_out's dtype: per token, the rows returned by every rank it
        went to, summed in float32 in slot order and rounded once
        (:func:`a2a.movement.sum_over_slots`).
        """
        if _traced(expert_out):
            return self._traced_combine(expert_out, plan)
        self._check_usable()
        error: Optional[Exception] = None
        try:
            self._check_combine(expert_out, plan)
        except Exception as exc:  # agreed on below: raised on every rank
            error = exc
        self._agree("combine", f"expert_out {getattr(expert_out, 'dtype', None)}", error)
        return self._moving("combine", lambda: self._movement.combine(
            expert_out, plan, self._movement.transport_state("combine", None, expert_out.dtype)))

    def _check_combine(self, expert_out, plan) -> None:
        """combine's host checks (shapes, dtypes, devices: no device read)."""
        self._check_plan(plan)
        check_tensor("expert_out", expert_out, dtype=PAYLOAD_DTYPES, ndim=2,
                     device=self.device, contiguous=True)
        rows = self.max_tokens_per_rank * self.ep_size
        if tuple(expert_out.shape) != (rows, self.hidden_size):
            raise ValueError(f"expert_out has shape {tuple(expert_out.shape)}, expected "
                             f"{(rows, self.hidden_size)} (dispatch's rows, N*R)")
        self._movement.check_rows(expert_out, "expert_out")

    def _traced_combine(self, expert_out, plan) -> torch.Tensor:
        """combine inside a compiled region: host checks, then the op."""
        self._check_usable()
        self._check_combine(expert_out, plan)
        state = self._movement.transport_state("combine", None, expert_out.dtype, create=False)
        return torch.ops.moe_a2a.combine(self.handle, expert_out, ops.plan_tensors(plan),
                                         plan.num_tokens, state)

    # -----------------------------------------------------------------------------------------
    # What the registered ops run (a2a.ops)
    # -----------------------------------------------------------------------------------------

    def _op_plan(self, tensors: list, num_tokens: int) -> AlltoallPlan:
        return ops.plan_of(tensors, ep_rank=self.ep_rank, ep_size=self.ep_size,
                           max_tokens_per_rank=self.max_tokens_per_rank,
                           num_tokens=num_tokens, top_k=self.top_k,
                           slot_count=self.slot_count)

    def _op_moved(self, stage: str, state: list) -> None:
        """After an op's data movement: count it in the sequence counter when that is the
        state the op declares (torch and FlashInfer backends)."""
        if self.backends[stage] != "triton":
            state[0].add_(1)

    def move_prepare(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     state: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The body of ``moe_a2a::prepare``: the prepare's data movement on checked arguments
        (as ``check_inputs=False``; no agreement), writing ``state``
        (``a2a.resources``); returns the plan as ``a2a.ops.plan_buffers``."""
        self._check_usable()

        def move():
            plan = self._movement.prepare(topk_ids, topk_weights, state, False)
            self._op_moved("prepare", state)
            return ops.plan_buffers(plan, self.plan_layout)
        return self._moving("prepare", move)

    def move_dispatch(self, x: torch.Tensor, tensors: list, quant: Optional[str],
                      global_scale: Optional[torch.Tensor], state: list):
        """The body of the ``moe_a2a::dispatch*`` ops: quantize (``quant``) and move x's rows
        with the plan of ``tensors`` (``a2a.ops.plan_tensors``), writing ``state``."""
        self._check_usable()
        plan = self._op_plan(tensors, x.shape[0])
        staged = self._movement.stage_dispatch(x, plan, quant, global_scale, state)

        def move():
            moved = staged()
            self._op_moved("transport", state)
            return moved
        return self._moving("dispatch", move)

    def move_combine(self, expert_out: torch.Tensor, tensors: list, num_tokens: int,
                     state: list) -> torch.Tensor:
        """The body of ``moe_a2a::combine``: return and reduce the rows with the plan of
        ``tensors`` for ``num_tokens`` tokens, writing ``state``."""
        self._check_usable()
        plan = self._op_plan(tensors, num_tokens)

        def move():
            out = self._movement.combine(expert_out, plan, state)
            self._op_moved("transport", state)
            return out
        return self._moving("combine", move)


def _valid_timeout(timeout) -> bool:
    return (not isinstance(timeout, bool) and isinstance(timeout, (int, float))
            and math.isfinite(timeout) and timeout > 0)
