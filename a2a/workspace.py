"""Peer-mapped MNNVL workspaces: one buffer per rank that every rank of the group can address.

FlashInfer's ``MnnvlMemory`` does the mapping (``cuMemCreate`` + handle exchange + ``cuMemMap``
of every peer's segment into one reserved address range). On one host without the NVLink fabric
it exchanges POSIX file descriptors over Unix sockets, through a ``CommBackend``; we give it
``TorchDistBackend(group)``, so no MPI is involved.

``MnnvlMemory`` keeps its communicator and its current address reservation in class attributes
(FlashInfer's ``MnnvlMoe`` holds one workspace per process for that reason). To allow several
groups, and workspaces that are closed and made again, :class:`MnnvlWorkspace`

- sets the class communicator right before each allocation, directly rather than through
  ``MnnvlMemory.set_comm_from_config``: that one calls ``CommBackend.Split``, which creates a new
  torch.distributed sub-group on every call (a communicator leaked per workspace); with
  ``Mapping(tp_size=R)`` the split has a single colour ordered by rank, i.e. it is the group
  itself;
- starts a fresh address reservation for each workspace, so that one reservation never holds
  segments of two groups of different sizes, and closing a workspace frees its whole range;
- frees with ``MnnvlMemory.close_mnnvl_memory`` after a device sync and a group barrier (no peer
  may still be writing into our segment), then drops ``ptr`` so that ``MnnvlMemory.__del__``
  does not close it a second time.

FlashInfer is imported inside the functions (``import a2a`` never imports it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# Bytes of one workspace word: FlashInfer's kernels and the Triton prepare address the workspace
# as uint64.
WORD_BYTES = 8
# Both MNNVL transports (the Triton transport and FlashInfer's moe_comm) move rows as 16-byte
# vectors, so that every dtype (bf16, packed nvfp4, scale bytes) moves bit-exactly.
ROW_ALIGN_BYTES = 16


def check_row_bytes(name: str, row_bytes: int) -> None:
    """Raise ValueError unless rows of ``row_bytes`` bytes are a positive multiple of 16, as
    both MNNVL transports need."""
    if row_bytes <= 0 or row_bytes % ROW_ALIGN_BYTES:
        raise ValueError(f"{name}: rows of {row_bytes} bytes; the MNNVL transports (Triton's and "
                         f"FlashInfer's moe_comm) move rows of a positive multiple of "
                         f"{ROW_ALIGN_BYTES} bytes: pad the hidden size or use the 'torch' "
                         f"transport")


class MnnvlWorkspace:
    """A zeroed peer-mapped buffer of ``bytes_per_rank`` bytes on every rank of ``group``.

    Collective: every rank of ``group`` must create (and close) it at the same time, with the
    same size, with its own GPU current (``torch.cuda.set_device``).

    Attributes:
        tensor: ``[R, bytes_per_rank // 8]`` uint64, row r is rank r's segment (a strided view of
                one address range; row ``ep_rank`` is local memory, the others are the peers').
        ep_rank, ep_size: this rank and the group size.
        bytes_per_rank: the requested size of each segment.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], bytes_per_rank: int,
                 device: torch.device):
        if bytes_per_rank <= 0 or bytes_per_rank % WORD_BYTES:
            raise ValueError(f"bytes_per_rank={bytes_per_rank} must be a positive multiple of "
                             f"{WORD_BYTES}")
        device = torch.device(device)
        if device.type == "cpu":
            raise ValueError("MNNVL workspaces need a GPU device; the CPU (gloo) path uses the "
                             "torch prepare and transport, which need no workspace")
        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlConfig, MnnvlMemory, TorchDistBackend

        self.group = group
        self.device = device
        self.ep_rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)
        self.bytes_per_rank = bytes_per_rank
        self._comm = TorchDistBackend(group)
        mapping = Mapping(world_size=self.ep_size, rank=self.ep_rank, gpus_per_node=self.ep_size,
                          tp_size=self.ep_size)
        config = MnnvlConfig(comm_backend=self._comm)

        MnnvlMemory.initialize()
        # The class-level communicator (see the module docstring for why not Split).
        MnnvlMemory.config = config
        MnnvlMemory.comm = self._comm
        # A full current reservation makes open_mnnvl_memory reserve a fresh address range.
        MnnvlMemory.current_mem_offset = MnnvlMemory.current_rank_stride
        self._memory = MnnvlMemory(mapping, bytes_per_rank)
        self.tensor: Optional[torch.Tensor] = self._memory.as_torch_strided_tensor(torch.uint64)
        if tuple(self.tensor.shape) != (self.ep_size, bytes_per_rank // WORD_BYTES):
            raise RuntimeError(f"MnnvlMemory gave a workspace of shape {tuple(self.tensor.shape)}, "
                               f"expected {(self.ep_size, bytes_per_rank // WORD_BYTES)}")
        # Every rank zeroes its own segment; nobody writes into a peer before all are zero.
        # (Through an int64 view: torch implements few kernels for uint64.)
        self.tensor[self.ep_rank].view(torch.int64).zero_()
        torch.cuda.synchronize(device)
        self._comm.barrier()

    @property
    def closed(self) -> bool:
        return self.tensor is None

    def close(self) -> None:
        """Unmap and release the buffer on this rank (collective; a no-op when closed).

        Waits for this rank's device work and for every rank to arrive first, so that no peer
        still reads or writes this segment.
        """
        if self.tensor is None:
            return
        from flashinfer.comm.mnnvl import MnnvlMemory

        torch.cuda.synchronize(self.device)
        self._comm.barrier()
        self.tensor = None
        MnnvlMemory.close_mnnvl_memory(self._memory.ptr)
        # MnnvlMemory.__del__ closes again when it still has ``ptr``.
        del self._memory.ptr
        self._memory = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.bytes_per_rank} B/rank"
        return f"MnnvlWorkspace(rank {self.ep_rank}/{self.ep_size}, {state})"


def comm_workspace_bytes(ep_size: int) -> int:
    """Bytes per rank of FlashInfer's ``moe_comm`` FIFO workspace (builds its module once)."""
    from flashinfer.comm.trtllm_alltoall import get_moe_commworkspace_size_per_rank
    return int(get_moe_commworkspace_size_per_rank(ep_size))


def flashinfer_prepare_workspace_bytes(ep_size: int) -> int:
    """Bytes per rank of FlashInfer's ``moe_prepare`` workspace (builds its module once)."""
    from flashinfer.comm.trtllm_alltoall import get_moe_prepare_workspace_size_per_rank
    return int(get_moe_prepare_workspace_size_per_rank(ep_size))
