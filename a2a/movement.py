"""How a :class:`~a2a.alltoall.MoEAlltoall`'s calls move data with its backends: the prepare,
the row transfers of dispatch (and its local quantization) and of combine, and combine's
reduction, on arguments its caller has checked (and, eagerly, agreed on).

Every function here writes a given *state* (``a2a.resources``: the device call counters and
status buffers of the Triton backends) and takes the workspaces from the object's
:class:`~a2a.resources.AlltoallResources`, so that the eager calls (which pass the object's
own state) and the registered ops (``a2a.ops``, which pass the state tensors the compiled graph
gives them) run the same code and give the same bits.

Combine's reduction over k has one order (``kernels.reduce.sum_slots_in_order``: float32,
slot order, rounded once to the payload dtype): the flashinfer and torch transports scatter the
returned rows into zeros ``[T*k, H]`` (FlashInfer's layout) and reduce with
:func:`sum_over_slots`; the Triton transport does the same adds in its receive kernel.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from a2a.config import PrepareConfig, TransportConfig
from a2a.resources import AlltoallResources
from a2a.workspace import check_row_bytes
from kernels.spec.quant import MX_BLOCK, NVFP4_BLOCK
from kernels.types import AlltoallPlan


def sum_over_slots(scattered: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Combine's reduction: [T*k, H] rows -> [T, H], summed over k in float32 in slot order
    (``kernels.reduce.sum_slots_in_order``, the order the Triton transport's fused reduction
    repeats) and rounded once to the dtype of ``scattered`` (nearest even, every NaN the
    canonical one: ``kernels.spec.round_to_dtype``, as the Triton reduction stores)."""
    from kernels.reduce import sum_slots_in_order
    from kernels.spec.casting import round_to_dtype
    rows = scattered.view(num_tokens, top_k, scattered.shape[1])
    return round_to_dtype(sum_slots_in_order(rows), scattered.dtype)


def as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[M, C] contiguous -> [M, C * itemsize] uint8 view (transports move bytes)."""
    return rows.view(torch.uint8)


class AlltoallMovement:
    """The data movement of one MoEAlltoall (see the module docstring).

    ``backends``: the resolved {"prepare", "transport", "quantize"} names; the other arguments
    are the object's group, rank, layer (E, N, H, S) and configs; ``resources`` its device
    state.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], *, ep_rank: int, ep_size: int,
                 num_experts: int, max_tokens_per_rank: int, hidden_size: int,
                 slot_count: int, backends: dict, transport_config: TransportConfig,
                 prepare_config: PrepareConfig, resources: AlltoallResources):
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self.num_experts, self.max_tokens_per_rank = num_experts, max_tokens_per_rank
        self.hidden_size, self.slot_count = hidden_size, slot_count
        self.backends = backends
        self.transport_config, self.prepare_config = transport_config, prepare_config
        self.resources = resources

    # -----------------------------------------------------------------------------------------
    # Transfers and their state
    # -----------------------------------------------------------------------------------------

    def check_row_bytes(self, name: str, row_bytes: int) -> None:
        """The row size the MNNVL transports need (callers check it before the agreement)."""
        if self.backends["transport"] in ("triton", "flashinfer"):
            check_row_bytes(name, row_bytes)

    def check_rows(self, rows: torch.Tensor, name: str) -> None:
        self.check_row_bytes(name, rows.shape[1] * rows.element_size())

    def fused_nvfp4(self) -> bool:
        """Whether dispatch(quant="nvfp4") quantizes in the Triton send kernel (one transfer)."""
        return (self.transport_config.fused_nvfp4_dispatch
                and self.backends["transport"] == "triton"
                and self.backends["quantize"] == "triton" and self.hidden_size % 64 == 0)

    def transfers(self, kind: str, quant: Optional[str],
                  dtype: Optional[torch.dtype]) -> list[tuple[str, int]]:
        """(name, row bytes) of each transfer of a dispatch (``kind`` "dispatch") of ``quant``
        rows, or of a combine, of ``dtype`` payloads, in the order they move."""
        hidden = self.hidden_size
        if quant is None:
            return [("x" if kind == "dispatch" else "expert_out", hidden * dtype.itemsize)]
        if quant == "nvfp4":
            if self.fused_nvfp4():
                from a2a.triton_transport import nvfp4_row_bytes
                return [("nvfp4 rows", nvfp4_row_bytes(hidden))]
            return [("nvfp4 packed", hidden // 2), ("nvfp4 scales", hidden // NVFP4_BLOCK)]
        return [("mxfp8 codes", hidden), ("mxfp8 scales", hidden // MX_BLOCK)]

    def transport_state(self, kind: str, quant: Optional[str], dtype, *,
                        create: bool = True) -> list:
        """The state of a dispatch or combine (``a2a.resources``); makes its workspaces when
        missing and ``create`` (collective)."""
        if self.backends["transport"] != "triton":  # its state does not depend on the rows
            return self.resources.transport_state(kind, (), create=create)
        return self.resources.transport_state(
            kind, [row_bytes for _, row_bytes in self.transfers(kind, quant, dtype)],
            create=create)

    # -----------------------------------------------------------------------------------------
    # prepare
    # -----------------------------------------------------------------------------------------

    def prepare(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, state: list,
                check: bool) -> AlltoallPlan:
        """The prepare's exchange, writing ``state``; ``check``: the Triton prepare reads its
        status after the exchange (a host sync) and raises naming missing ranks."""
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
                                      self.resources.workspace("flashinfer_prepare"),
                                      ep_rank=self.ep_rank, ep_size=self.ep_size,
                                      max_tokens_per_rank=self.max_tokens_per_rank,
                                      slot_count=self.slot_count)
        from a2a.triton_prepare import triton_prepare
        counter, status = state
        return triton_prepare(topk_ids, topk_weights, self.resources.workspace("triton_prepare"),
                              ep_rank=self.ep_rank, ep_size=self.ep_size,
                              num_experts=self.num_experts,
                              max_tokens_per_rank=self.max_tokens_per_rank,
                              slot_count=self.slot_count, call_counter=counter,
                              config=self.prepare_config, check=check, check_ids=False,
                              status=status)

    # -----------------------------------------------------------------------------------------
    # dispatch
    # -----------------------------------------------------------------------------------------

    def stage_dispatch(self, x: torch.Tensor, plan: AlltoallPlan, quant: Optional[str],
                       global_scale: Optional[torch.Tensor], state: Optional[list]) -> Callable:
        """Quantize x locally (``quant``) and check the quantized rows; returns the data
        movement, which writes ``state``, or, when None, the object's state, made when the
        movement starts (after the caller's agreement: making workspaces is collective)."""
        def state_now():
            return state if state is not None else self.transport_state(
                "dispatch", quant, x.dtype)
        if quant is None:
            return lambda: self.dispatch_rows((x,), plan, state_now())[0]
        if quant == "nvfp4":
            if self.fused_nvfp4():
                return lambda: self.dispatch_nvfp4_fused(x, global_scale, plan, state_now())
            from a2a.quantize import quantize_nvfp4
            # the global scale's value was checked by the caller (before the agreement)
            packed, scales = quantize_nvfp4(x, global_scale, layout="linear",
                                            backend=self.backends["quantize"],
                                            check_values=False)
            parts = (packed, scales.view(torch.uint8))
        else:
            from a2a.quantize import quantize_mxfp8
            parts = quantize_mxfp8(x, backend=self.backends["quantize"])
        for part, (name, _) in zip(parts, self.transfers("dispatch", quant, x.dtype)):
            self.check_rows(part, name)
        return lambda: self.dispatch_rows(parts, plan, state_now())

    def dispatch_rows(self, parts: tuple, plan: AlltoallPlan, state: list) -> tuple:
        """Move each of ``parts`` ([T, C] payloads) where the plan says, writing ``state``;
        returns the [N*R, C] received rows of each, in their dtypes."""
        backend = self.backends["transport"]
        moved = []
        for index, rows in enumerate(parts):
            byte_rows = as_bytes(rows)
            if backend == "triton":
                from a2a import triton_transport
                workspace, _ = self.resources.transport_workspace("dispatch",
                                                                  byte_rows.shape[1])
                out = triton_transport.triton_dispatch_rows(
                    byte_rows, plan, workspace, call_counter=state[index], status=state[-1],
                    check=False, config=self.transport_config)
            elif backend == "flashinfer":
                from a2a.flashinfer_comm import flashinfer_dispatch_rows
                out = flashinfer_dispatch_rows(byte_rows, plan,
                                               self.resources.workspace("comm"))
            else:
                from a2a.torch_comm import torch_dispatch_rows
                out = torch_dispatch_rows(byte_rows, plan, self.group)
            moved.append(out.view(rows.dtype))
        return tuple(moved)

    def dispatch_nvfp4_fused(self, x, global_scale, plan, state):
        """dispatch(quant="nvfp4") quantizing in the Triton send kernel: (packed, scales)."""
        from a2a import triton_transport
        workspace, _ = self.resources.transport_workspace(
            "dispatch", triton_transport.nvfp4_row_bytes(x.shape[1]))
        return triton_transport.triton_dispatch_nvfp4(
            x, global_scale, plan, workspace, call_counter=state[0], status=state[-1],
            check=False, config=self.transport_config)

    # -----------------------------------------------------------------------------------------
    # combine
    # -----------------------------------------------------------------------------------------

    def combine(self, expert_out: torch.Tensor, plan: AlltoallPlan,
                state: list) -> torch.Tensor:
        """The combine's transfer and reduction over k, writing ``state``: [T, H]."""
        if self.backends["transport"] == "triton":  # the reduction is fused: same adds
            from a2a import triton_transport
            rows = as_bytes(expert_out)
            workspace, _ = self.resources.transport_workspace("combine", rows.shape[1])
            return triton_transport.triton_combine(
                rows, plan, workspace, dtype=expert_out.dtype, call_counter=state[0],
                status=state[-1], check=False, config=self.transport_config)
        if self.backends["transport"] == "flashinfer":
            from a2a.flashinfer_comm import flashinfer_combine_rows
            scattered = flashinfer_combine_rows(as_bytes(expert_out), plan,
                                                self.resources.workspace("comm"))
        else:
            from a2a.torch_comm import torch_combine_rows
            scattered = torch_combine_rows(as_bytes(expert_out), plan, self.group)
        return sum_over_slots(scattered.view(expert_out.dtype), plan.num_tokens, plan.top_k)
