"""The Triton transport: dispatch and combine as direct stores into the peers' mapped memory.

The device protocol (flags carrying c + 1, two parities, the device-side call counter, bounded
waits and the status buffer, co-residency) is :mod:`a2a.protocol`'s, shared with the Triton
prepare. This package adds the row transfers, read in this order:

``layout``   the inbox layout and its size, chunking, copy tiles, argument checks;
``send``     the send kernels: rows into the peers' inboxes, one flag per chunk (also the
             quantizing NVFP4 send);
``receive``  the receive kernel (rows out of our inbox into the outputs; it ends the call) and
             the one-launch form of a transfer (``TransportConfig.overlap``);
``combine``  the fused combine: the slot map and the receive kernel that sums each token's k
             slots straight from the inbox;
``api``      launchers and the public functions below.

A transfer is two kernels, the same pair for dispatch and combine (they differ only in the
cumsums and index lists they are given, exactly as FlashInfer's ``moe_comm`` is called):

dispatch: send = (send_rank_count_cumsum, send_rank_local_indices), recv =
(recv_rank_count_cumsum, recv_rank_local_indices = identity); output rows past total_recv are
zeroed by the receive kernel (spread over its programs): :func:`triton_dispatch_rows`, or
:func:`triton_dispatch_nvfp4`, which quantizes in the send kernel and splits each received
slot into codes and scales.
combine:  send = (recv_rank_count_cumsum, recv_rank_local_indices), then either
:func:`triton_combine_rows`: recv = (send_rank_count_cumsum,
backward_recv_rank_local_indices) into zeros ``[T*k, B]``, reduced by the caller
(``a2a.movement.sum_over_slots``); or :func:`triton_combine` (what ``MoEAlltoall`` uses),
which reduces in the receive kernel, in slot order in float32, bit-identical to the other
transports without the ``[T*k, B]`` buffer.

One workspace carries one kind of transfer (dispatch or combine) of one row size: its calls
are numbered by its own counter. Every rank must run the same sequence of transfers on a
workspace, with the same :class:`~a2a.config.TransportConfig`.

Why a source gets at most one call ahead (flag c + 2, not c + 3): source s's send of call
c + 1 needs only its own receive of call c, which needs our send of call c; its send of call
c + 2 needs our send of call c + 1, which runs after our receive of call c. Why two parities
suffice: s's send of call c + 2 runs after its receive of call c + 1 (same stream), which
waited for our call-c+1 flag; our send of call c + 1 runs after our receive of call c (same
stream) finished reading area[s][p].

Host syncs: none with ``check=False`` (two launches, caching-allocator allocations):
CUDA-graph capturable. R simulated ranks on one GPU call :func:`warmup_transport` first.
"""

from a2a.protocol import TransportTimeout
from a2a.triton_transport.api import (DEFAULT_TRANSPORT, triton_combine, triton_combine_rows,
                                      triton_dispatch_nvfp4, triton_dispatch_rows,
                                      warmup_transport)
from a2a.triton_transport.layout import (nvfp4_row_bytes, transport_chunks,
                                         transport_workspace_bytes)

__all__ = ["DEFAULT_TRANSPORT", "TransportTimeout", "nvfp4_row_bytes", "transport_chunks",
           "transport_workspace_bytes", "triton_combine", "triton_combine_rows",
           "triton_dispatch_nvfp4", "triton_dispatch_rows", "warmup_transport"]
