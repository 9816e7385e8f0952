"""The plain-torch oracle of every op: written for clarity, runs on CPU or GPU.

Tests compare the Triton kernels and the FlashInfer adapters against these functions: index
outputs exactly, NVFP4/MX codes and scales bit-exactly, floats with the tolerance table of
``kernels.spec.FLOAT_TOLERANCES``. The public names and signatures here are the ones the other
faces of each op share; the argument checks all faces call live in ``kernels.spec``.

One module per op family: ``routing``, ``permute``, ``prepare`` (the local plan and an R-rank
simulation of the all-to-all), ``quant`` (NVFP4 / MXFP8 / MXFP4 and the scale layouts).
"""

from kernels.reference.permute import (gather_rows, permute_and_gather,  # noqa: F401
                                       permute_by_expert, reduce_slots,
                                       unpermute_and_reduce)
from kernels.reference.prepare import (local_send_plan, simulate_alltoall,  # noqa: F401
                                       simulate_combine, simulate_dispatch)
from kernels.reference.quant import (dequantize_mxfp4, dequantize_mxfp8,  # noqa: F401
                                     dequantize_nvfp4, e2m1_code, e2m1_value, e4m3_code,
                                     e4m3_value, e8m0_code, e8m0_value, nvfp4_global_scale,
                                     quantize_mxfp4, quantize_mxfp8, quantize_nvfp4,
                                     scale_and_quantize_nvfp4, scale_offsets, swizzle_scales,
                                     unswizzle_scales)
from kernels.reference.routing import route_topk  # noqa: F401
