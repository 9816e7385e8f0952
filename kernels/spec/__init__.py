"""The contract of every op: the formats' numbers, the limits and the argument checks.

Every face of an op (the plain-torch oracle in ``kernels.reference``, the Triton launcher in
``kernels/<op>.py`` and the FlashInfer adapter in ``a2a/``) calls the same check from here, so
that all of them accept and refuse the same arguments with the same exception and message.
Nothing here launches a kernel or imports Triton.
"""

from kernels.spec.permute import (UNPERMUTE_DTYPES, check_gather_inputs,  # noqa: F401
                                  check_permute_inputs, check_unpermute_inputs,
                                  local_expert_count, permutation_capacity)
from kernels.spec.prepare import PREPARE_MAX_TOP_K, check_prepare_inputs  # noqa: F401
from kernels.spec.quant import (E2M1_MAX, E2M1_VALUES, E4M3_MAX, FLT_MAX,  # noqa: F401
                                INV_E2M1_MAX, INV_E4M3_MAX, LAYOUT_BLOCK_TILE, LAYOUT_ROW_TILE,
                                MX_BLOCK, NVFP4_BLOCK, NVFP4_GLOBAL_NUMERATOR,
                                QUANT_INPUT_DTYPES, SCALE_LAYOUTS, check_global_scale,
                                check_layout, check_mx_scales, check_out, check_quant_input,
                                round_up, swizzled_scale_shape)
from kernels.spec.routing import (LOGIT_DTYPES, MAX_TOP_K, ROUTING_METHODS,  # noqa: F401
                                  check_routing_args)
from kernels.spec.tensors import (FLOAT_TOLERANCES, check_expert_ids, check_tensor,  # noqa: F401
                                  check_top_k)
