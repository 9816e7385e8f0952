"""The device state of one :class:`~a2a.alltoall.MoEAlltoall`: its peer-mapped workspaces, the
device call counters and status buffers of the Triton prepare and transport, and the sequence
counter of the registered ops (``a2a.ops``).

Workspaces are made on first use by eager calls (collective: every rank makes the same ones in
the same order, after the call's agreement), or all at once by ``MoEAlltoall.allocate``. A
compiled region cannot make them (making one is a collective of host calls), so a traced call
asks for them with ``create=False``, which raises :class:`NotAllocated` naming what to
allocate.

The call's *state* is the list of tensors a collective call writes besides its outputs, the
``state`` argument of the ops (declared mutated):

- Triton prepare: [call counter [1] int64, prepare status [R] int64];
- Triton transport: [one call counter per transfer of the call (one per row size), transport
  status [R] int64];
- torch and FlashInfer prepares and transports: [sequence [1] int64], which the ops increment
  (they write nothing else the graph sees; the eager calls leave it alone).

A status entry s becomes c + 1 when a wait for source s timed out in call c (``a2a.protocol``);
:meth:`AlltoallResources.timeout` reads both statuses.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


class NotAllocated(RuntimeError):
    """A traced (compiled) call needs a workspace that was not made before the compiled region;
    call ``MoEAlltoall.allocate`` on every rank first."""


class AlltoallResources:
    """Workspaces, counters and statuses of one MoEAlltoall on this rank (see the module
    docstring). ``backends``: the object's resolved backends; the other arguments describe the
    layer (R, N, k, E, S) and where its tensors live."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, *,
                 ep_rank: int, ep_size: int, max_tokens_per_rank: int, top_k: int,
                 num_experts: int, slot_count: int, backends: dict):
        self.group, self.device = group, device
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.max_tokens_per_rank, self.top_k = max_tokens_per_rank, top_k
        self.num_experts, self.slot_count = num_experts, slot_count
        self.backends = backends
        self.workspaces: dict = {}          # kind -> a2a.workspace.MnnvlWorkspace
        self.counters: dict = {}            # kind -> [1] int64, zeroed with its workspace
        self.prepare_status: Optional[torch.Tensor] = None
        self.transport_status: Optional[torch.Tensor] = None
        self.sequence = torch.zeros(1, dtype=torch.int64, device=device)

    # -----------------------------------------------------------------------------------------
    # Workspaces
    # -----------------------------------------------------------------------------------------

    def _missing(self, what: str) -> NotAllocated:
        return NotAllocated(f"rank {self.ep_rank}: the {what} is not allocated, and a traced "
                            f"(compiled) call cannot make it (it is collective): call "
                            f"MoEAlltoall.allocate(dtypes=..., quant=...) on every rank before "
                            f"the compiled region, with every payload dtype and quantized "
                            f"format the region dispatches")

    def workspace(self, kind: str, *, create: bool = True) -> torch.Tensor:
        """The [R, words] uint64 workspace of ``kind`` ("comm", "flashinfer_prepare",
        "triton_prepare"), made now when missing and ``create`` (collective)."""
        if kind not in self.workspaces:
            if not create:
                raise self._missing(f"{kind} workspace")
            from a2a import workspace
            if kind == "comm":
                size = workspace.comm_workspace_bytes(self.ep_size)
            elif kind == "flashinfer_prepare":
                size = workspace.flashinfer_prepare_workspace_bytes(self.ep_size)
            else:
                from a2a.triton_prepare import prepare_workspace_words
                size = workspace.WORD_BYTES * int(prepare_workspace_words(
                    self.ep_size, self.max_tokens_per_rank, self.top_k, self.num_experts,
                    self.slot_count))
            self.workspaces[kind] = workspace.MnnvlWorkspace(self.group, size, self.device)
        return self.workspaces[kind].tensor

    def transport_workspace(self, kind: str, row_bytes: int, *, create: bool = True):
        """(workspace [R, words] uint64, call counter [1] int64) of the Triton transport for
        ``kind`` ("dispatch" or "combine") rows of ``row_bytes`` bytes, made now when missing
        and ``create`` (collective)."""
        key = f"triton_{kind}:{row_bytes}"
        if key not in self.workspaces:
            if not create:
                raise self._missing(f"Triton transport's {kind} workspace for rows of "
                                    f"{row_bytes} bytes")
            from a2a import workspace
            from a2a.triton_transport import transport_workspace_bytes
            size = int(transport_workspace_bytes(self.ep_size, self.max_tokens_per_rank,
                                                 row_bytes))
            self.workspaces[key] = workspace.MnnvlWorkspace(self.group, size, self.device)
            self.counters[key] = torch.zeros(1, dtype=torch.int64, device=self.device)
            if self.transport_status is None:
                self.transport_status = torch.zeros(self.ep_size, dtype=torch.int64,
                                                    device=self.device)
        return self.workspaces[key].tensor, self.counters[key]

    # -----------------------------------------------------------------------------------------
    # The state of a call
    # -----------------------------------------------------------------------------------------

    def prepare_state(self, *, create: bool = True) -> list[torch.Tensor]:
        """The state a prepare writes (module docstring); makes the prepare's workspace when
        missing and ``create`` (collective)."""
        backend = self.backends["prepare"]
        if backend == "triton":
            self.workspace("triton_prepare", create=create)
            if "triton_prepare" not in self.counters:  # zeroed with the workspace
                self.counters["triton_prepare"] = torch.zeros(1, dtype=torch.int64,
                                                              device=self.device)
                self.prepare_status = torch.zeros(self.ep_size, dtype=torch.int64,
                                                  device=self.device)
            return [self.counters["triton_prepare"], self.prepare_status]
        if backend == "flashinfer":
            self.workspace("flashinfer_prepare", create=create)
        return [self.sequence]

    def transport_state(self, kind: str, row_bytes: Sequence[int], *,
                        create: bool = True) -> list[torch.Tensor]:
        """The state of a dispatch or combine (``kind``) whose transfers move rows of
        ``row_bytes`` bytes each, in order (module docstring); makes the workspaces when
        missing and ``create`` (collective)."""
        backend = self.backends["transport"]
        if backend == "triton":
            counters = [self.transport_workspace(kind, size, create=create)[1]
                        for size in row_bytes]
            return counters + [self.transport_status]
        if backend == "flashinfer":
            self.workspace("comm", create=create)
        return [self.sequence]

    # -----------------------------------------------------------------------------------------
    # Timeouts and release
    # -----------------------------------------------------------------------------------------

    def timeout(self) -> Optional[Exception]:
        """The :class:`~a2a.protocol.PrepareTimeout` or :class:`~a2a.protocol.TransportTimeout`
        recorded by the Triton prepare's or transport's waits since construction, or None
        (reads the status buffers: a host sync each)."""
        from a2a.protocol import CollectiveTimeout, raise_on_timeout
        for status, what in ((self.prepare_status, "prepare"),
                             (self.transport_status, "transport")):
            if status is None:
                continue
            try:
                raise_on_timeout(status, self.ep_rank, what)
            except CollectiveTimeout as exc:
                return exc
        return None

    def release(self) -> dict:
        """Forget the workspaces and return them ({kind: MnnvlWorkspace}) for the caller to
        close (collectively) or drop."""
        workspaces, self.workspaces = self.workspaces, {}
        return workspaces
