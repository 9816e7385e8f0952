"""The plain-torch oracle of every op: written for clarity, runs on CPU or GPU.

Tests compare the Triton kernels and the FlashInfer adapters against these functions: index
outputs exactly, NVFP4/MX codes and scales bit-exactly, floats with a per-dtype tolerance. The
public names and signatures here are the ones the other two faces of each op share.

Sections: routing, permutation, prepare (local plan and an R-rank simulation of the
all-to-all), NVFP4 / MXFP8 / MXFP4 quantization.
"""

from __future__ import annotations

import torch

from kernels.types import UNUSED, AlltoallPlan, LocalSendPlan, Permutation
from kernels.validate import check_expert_ids, check_tensor, check_top_k


# =============================================================================================
# Routing
# =============================================================================================

# (section: routing -- route_topk and its methods)


# =============================================================================================
# Permutation
# =============================================================================================

# (section: permutation -- permute_by_expert, gather_rows, unpermute_and_reduce)


# =============================================================================================
# Prepare
# =============================================================================================

# (section: prepare -- local_send_plan, simulate_alltoall, simulate_dispatch, simulate_combine)


# =============================================================================================
# NVFP4 / MXFP8 / MXFP4 quantization
# =============================================================================================

# (section: quantization -- nvfp4, swizzle, mxfp8, mxfp4)
