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
slot order, rounded once to the payload dtype): the flashinfer and torch transports scatter the
returned rows into zeros ``[T*k, H]`` (FlashInfer's layout) and reduce with
:func:`sum_over_slots`; the Triton transport does the same adds in its receive kernel. So the
transports give bit-identical results.

No rank left hanging: every collective call (construction, ``prepare``, ``dispatch``,
``combine``) first makes the ranks agree, over the process group's store and within the
object's ``timeout``, that every rank reached the same call and that every rank's arguments
passed its checks (:mod:`a2a.agreement`). One rank's bad argument raises on every rank, naming
it and the reason, before any data moves; a rank that does not arrive is named after
``timeout`` seconds, and the object then refuses every later call on every rank (a rank that
broke, e.g. by a timeout of the Triton transport, makes the others' next call fail). Objects
made with ``agree=False`` skip the per-call agreement (see :class:`MoEAlltoall`).

Workspaces (:mod:`a2a.workspace`) are made on first use, collectively, and freed by
:meth:`MoEAlltoall.close`. The Triton transport makes one per transfer kind and row size
(dispatch of bf16 rows, of nvfp4 codes, of nvfp4 scales, combine of bf16 rows, ...), each with
its own device-side call counter; its bounded waits record timeouts in a status buffer that
:meth:`MoEAlltoall.check_transport` (and every ``prepare(check_inputs=True)``) reads
(``a2a.protocol``). How the Triton prepare and transport run (grid and spin bounds, the
one-launch transfer, the quantizing send) is the object's :class:`~a2a.config.PrepareConfig`
and :class:`~a2a.config.TransportConfig`, fixed at construction and agreed on by the ranks.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from a2a.backends import resolve
from a2a.config import DEFAULT_TIMEOUT_S, PrepareConfig, TransportConfig
from a2a.workspace import check_row_bytes
from kernels.types import AlltoallPlan
from kernels.spec.prepare import PREPARE_MAX_TOP_K
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


def sum_over_slots(scattered: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Combine's reduction: [T*k, H] rows -> [T, H], summed over k in float32 in slot order
    (``kernels.reduce.sum_slots_in_order``, the order the Triton transport's fused reduction
    repeats) and rounded once to the dtype of ``scattered``."""
    from kernels.reduce import sum_slots_in_order
    rows = scattered.view(num_tokens, top_k, scattered.shape[1])
    return sum_slots_in_order(rows).to(scattered.dtype)


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[M, C] contiguous -> [M, C * itemsize] uint8 view (transports move bytes)."""
    return rows.view(torch.uint8)


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
                             captures no agreement either way: replays do not agree.

    Raises (on every rank, before anything is sent) when the ranks disagree on the
    configuration, when one rank rejects it (E % R, FlashInfer's limits: E % 4 == 0 and
    k <= 32, an unavailable backend), when a backend cannot run here, or when a rank does not
    construct it within ``timeout``. A bad ``ep_group`` raises on its rank alone (there is no
    group to agree over).

    Attributes: ``ep_rank``, ``ep_size``, ``device``, ``backends`` (the resolved names),
    ``transport_config``, ``prepare_config``, ``timeout``, ``agree``.
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
        self._workspaces: dict = {}
        self._call_counters: dict = {}
        self._transport_status: Optional[torch.Tensor] = None
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

    def _workspace(self, kind: str) -> torch.Tensor:
        """The [R, words] uint64 workspace of ``kind``, made on first use (collective)."""
        if kind not in self._workspaces:
            from a2a import workspace
            if kind == "comm":
                size = workspace.comm_workspace_bytes(self.ep_size)
            elif kind == "flashinfer_prepare":
                size = workspace.flashinfer_prepare_workspace_bytes(self.ep_size)
            else:
                size = workspace.triton_prepare_workspace_bytes(
                    self.ep_size, self.max_tokens_per_rank, self.top_k, self.num_experts,
                    self.slot_count)
            self._workspaces[kind] = workspace.MnnvlWorkspace(self.group, size, self.device)
        return self._workspaces[kind].tensor

    def flashinfer_comm_workspace(self) -> torch.Tensor:
        """FlashInfer's ``moe_comm`` workspace of this object ([R, words] uint64, made on first
        use: collective), for driving FlashInfer's own ``MnnvlMoe`` alltoallv with this
        object's plans (``a2a.flashinfer_comm.to_flashinfer_info``)."""
        self._check_usable()
        return self._workspace("comm")

    def _transport_workspace(self, kind: str, row_bytes: int):
        """(workspace [R, words] uint64, call counter [1] int64) of the Triton transport for
        ``kind`` ("dispatch" or "combine") rows of ``row_bytes`` bytes, made on first use
        (collective: every rank makes the same ones in the same order)."""
        key = f"triton_{kind}:{row_bytes}"
        if key not in self._workspaces:
            from a2a import workspace
            size = workspace.triton_transport_workspace_bytes(
                self.ep_size, self.max_tokens_per_rank, row_bytes)
            self._workspaces[key] = workspace.MnnvlWorkspace(self.group, size, self.device)
            self._call_counters[key] = torch.zeros(1, dtype=torch.int64, device=self.device)
            if self._transport_status is None:
                self._transport_status = torch.zeros(self.ep_size, dtype=torch.int64,
                                                     device=self.device)
        return self._workspaces[key].tensor, self._call_counters[key]

    def check_transport(self) -> None:
        """Raise ``a2a.protocol.TransportTimeout`` naming the source ranks when a wait of the
        Triton transport timed out since construction (reads a status buffer: a host sync);
        the object is then broken (its workspaces are stale). Also done by every
        ``prepare(check_inputs=True)``, where it raises on every rank. A no-op for the other
        transports."""
        error = self._transport_timeout()
        if error is not None:
            self._break(str(error))
            raise error

    def _transport_timeout(self) -> Optional[Exception]:
        if self._transport_status is None:
            return None
        from a2a.protocol import TransportTimeout, raise_on_timeout
        try:
            raise_on_timeout(self._transport_status, self.ep_rank, "transport")
        except TransportTimeout as exc:
            return exc
        return None

    def close(self) -> None:
        """Free the workspaces (collective when it holds any: the ranks first agree, like the
        other collective calls); the object is unusable after. Closing twice is a no-op. A
        broken object, or one whose closing agreement fails (a peer missing or at another
        call), frees nothing collectively (freeing waits for every rank): its workspaces are
        released when they are garbage-collected, or at exit."""
        if self._closed:
            return
        self._closed = True
        workspaces, self._workspaces = self._workspaces, {}
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
                      sent); read the Triton transport's timeout status (timeouts of earlier
                      dispatch/combine calls, see :meth:`check_transport`: raised on every
                      rank, the object is then broken); the Triton prepare also reads its own
                      timeout status after the exchange and raises naming missing ranks.
                      False (benchmarks, CUDA graphs): none of these; an id outside
                      ``[0, S]`` is then treated as padding (sent nowhere) on every prepare
                      backend. The host checks (dtypes, shapes, T <= N) and the agreement
                      with the other ranks run either way (unless ``agree=False``).
        Returns this rank's :class:`AlltoallPlan` (expert_counts [R, S] filled).
        """
        self._check_usable()
        error: Optional[Exception] = None
        try:
            topk_ids = self._checked_routing(topk_ids, topk_weights, sanitize, check_inputs)
        except Exception as exc:  # agreed on below: raised on every rank
            error = exc
        if check_inputs and error is None:
            timed_out = self._transport_timeout()
            if timed_out is not None:  # the other ranks' agreement raises, naming this rank
                self._break(str(timed_out))
                raise timed_out
        self._agree("prepare", "", error)
        return self._moving("prepare", lambda: self._run_prepare(topk_ids, topk_weights,
                                                                 check_inputs))

    def _run_prepare(self, topk_ids, topk_weights, check_inputs: bool) -> AlltoallPlan:
        backend = self.backends["prepare"]
        if backend == "torch":
            from a2a.torch_comm import torch_prepare
            return torch_prepare(topk_ids, topk_weights, group=self.group,
                                 num_experts=self.num_experts,
                                 max_tokens_per_rank=self.max_tokens_per_rank,
                                 slot_count=self.slot_count)
        if backend == "flashinfer":
            from a2a.flashinfer_comm import flashinfer_prepare
            return flashinfer_prepare(topk_ids, topk_weights,
                                      self._workspace("flashinfer_prepare"),
                                      ep_rank=self.ep_rank, ep_size=self.ep_size,
                                      max_tokens_per_rank=self.max_tokens_per_rank,
                                      slot_count=self.slot_count)
        from a2a.triton_prepare import triton_prepare
        workspace = self._workspace("triton_prepare")
        if "triton_prepare" not in self._call_counters:  # zeroed with the workspace
            self._call_counters["triton_prepare"] = torch.zeros(
                1, dtype=torch.int64, device=self.device)
        return triton_prepare(topk_ids, topk_weights, workspace,
                              ep_rank=self.ep_rank, ep_size=self.ep_size,
                              num_experts=self.num_experts,
                              max_tokens_per_rank=self.max_tokens_per_rank,
                              slot_count=self.slot_count,
                              call_counter=self._call_counters["triton_prepare"],
                              config=self.prepare_config, check=check_inputs, check_ids=False)

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

    def _check_rows(self, rows: torch.Tensor, name: str) -> None:
        """The row size the MNNVL transports need (checked before the agreement)."""
        if self.backends["transport"] in ("triton", "flashinfer"):
            check_row_bytes(name, rows.shape[1] * rows.element_size())

    def _dispatch_rows(self, rows: torch.Tensor, plan: AlltoallPlan) -> torch.Tensor:
        if self.backends["transport"] == "triton":
            from a2a import triton_transport
            byte_rows = _as_bytes(rows)
            workspace, counter = self._transport_workspace("dispatch", byte_rows.shape[1])
            moved = triton_transport.triton_dispatch_rows(
                byte_rows, plan, workspace, call_counter=counter,
                status=self._transport_status, check=False, config=self.transport_config)
        elif self.backends["transport"] == "flashinfer":
            from a2a.flashinfer_comm import flashinfer_dispatch_rows
            moved = flashinfer_dispatch_rows(_as_bytes(rows), plan, self._workspace("comm"))
        else:
            from a2a.torch_comm import torch_dispatch_rows
            moved = torch_dispatch_rows(_as_bytes(rows), plan, self.group)
        return moved.view(rows.dtype)

    def dispatch(self, x: torch.Tensor, plan: AlltoallPlan, *, quant: Optional[str] = None,
                 global_scale: Optional[torch.Tensor] = None):
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
        Every argument is checked, and x quantized locally, before the agreement with the
        other ranks: a rejection on any rank raises on every rank before anything is sent.
        Returns, rows by source rank then the source's send order, rows past total_recv 0:
        quant None: [N*R, H] of x's dtype; ``"nvfp4"``: (packed [N*R, H/2] uint8, two e2m1 per
        byte, scales [N*R, H/16] uint8 e4m3 bits); ``"mxfp8"``: (codes [N*R, H] and scales
        [N*R, H/32] uint8 e8m0, codes in the quantizer's dtype, float8_e4m3fn).
        """
        self._check_usable()
        error: Optional[Exception] = None
        move = None
        try:
            move = self._staged_dispatch(x, plan, quant, global_scale)
        except Exception as exc:  # agreed on below: raised on every rank
            error = exc
        dtype = getattr(x, "dtype", None)
        self._agree("dispatch", f"quant={quant!r}" + (f", x {dtype}" if quant is None else ""),
                    error)
        return self._moving("dispatch", move)

    def _staged_dispatch(self, x, plan, quant, global_scale) -> Callable:
        """Check dispatch's arguments and quantize locally; returns the data movement."""
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
            self._check_rows(x, "x")
            return lambda: self._dispatch_rows(x, plan)
        if quant == "nvfp4":
            from kernels.spec.quant import check_global_scale
            if global_scale is None:
                raise ValueError("quant='nvfp4' needs global_scale ([1] float32, 448*6 / amax)")
            check_global_scale(global_scale, self.device)
            if (self.transport_config.fused_nvfp4_dispatch
                    and self.backends["transport"] == "triton"
                    and self.backends["quantize"] == "triton" and x.shape[1] % 64 == 0):
                return lambda: self._dispatch_nvfp4_fused(x, global_scale, plan)
            from a2a.quantize import quantize_nvfp4
            packed, scales = quantize_nvfp4(x, global_scale, layout="linear",
                                            backend=self.backends["quantize"])
            parts = (packed, scales.view(torch.uint8))
            names = ("nvfp4 packed", "nvfp4 scales")
        else:
            from a2a.quantize import quantize_mxfp8
            parts = quantize_mxfp8(x, backend=self.backends["quantize"])
            names = ("mxfp8 codes", "mxfp8 scales")
        for part, name in zip(parts, names):
            self._check_rows(part, name)
        return lambda: tuple(self._dispatch_rows(part, plan) for part in parts)

    def _dispatch_nvfp4_fused(self, x, global_scale, plan):
        from a2a import triton_transport
        workspace, counter = self._transport_workspace(
            "dispatch", triton_transport.nvfp4_row_bytes(x.shape[1]))
        return triton_transport.triton_dispatch_nvfp4(
            x, global_scale, plan, workspace, call_counter=counter,
            status=self._transport_status, check=False, config=self.transport_config)

    def combine(self, expert_out: torch.Tensor, plan: AlltoallPlan) -> torch.Tensor:
        """Return every received row to its source and sum over k (collective).

        expert_out: [N*R, H] bfloat16 / float16 / float32 contiguous: for each row this rank
                    received (dispatch's row order), the sum over its local slots j of
                    ``recv_weights[i, j] * expert(recv_expert_ids[i, j])(row)``; rows past
                    total_recv are not read. The same dtype on every rank.
        plan:       the plan the rows were dispatched with.
        The arguments are checked before the agreement with the other ranks (a rejection on
        any rank raises on every rank before anything is sent).
        Returns [T, H] of expert_out's dtype: per token, the rows returned by every rank it
        went to, summed in float32 in slot order and rounded once (:func:`sum_over_slots`).
        """
        self._check_usable()
        error: Optional[Exception] = None
        try:
            self._check_plan(plan)
            check_tensor("expert_out", expert_out, dtype=PAYLOAD_DTYPES, ndim=2,
                         device=self.device, contiguous=True)
            rows = self.max_tokens_per_rank * self.ep_size
            if tuple(expert_out.shape) != (rows, self.hidden_size):
                raise ValueError(f"expert_out has shape {tuple(expert_out.shape)}, expected "
                                 f"{(rows, self.hidden_size)} (dispatch's rows, N*R)")
            self._check_rows(expert_out, "expert_out")
        except Exception as exc:  # agreed on below: raised on every rank
            error = exc
        self._agree("combine", f"expert_out {getattr(expert_out, 'dtype', None)}", error)
        return self._moving("combine", lambda: self._run_combine(expert_out, plan))

    def _run_combine(self, expert_out: torch.Tensor, plan: AlltoallPlan) -> torch.Tensor:
        if self.backends["transport"] == "triton":  # the reduction is fused: same adds
            from a2a import triton_transport
            rows = _as_bytes(expert_out)
            workspace, counter = self._transport_workspace("combine", rows.shape[1])
            return triton_transport.triton_combine(
                rows, plan, workspace, dtype=expert_out.dtype, call_counter=counter,
                status=self._transport_status, check=False, config=self.transport_config)
        if self.backends["transport"] == "flashinfer":
            from a2a.flashinfer_comm import flashinfer_combine_rows
            scattered = flashinfer_combine_rows(_as_bytes(expert_out), plan,
                                                self._workspace("comm"))
        else:
            from a2a.torch_comm import torch_combine_rows
            scattered = torch_combine_rows(_as_bytes(expert_out), plan, self.group)
        return sum_over_slots(scattered.view(expert_out.dtype), plan.num_tokens, plan.top_k)


def _valid_timeout(timeout) -> bool:
    return (not isinstance(timeout, bool) and isinstance(timeout, (int, float))
            and math.isfinite(timeout) and timeout > 0)
