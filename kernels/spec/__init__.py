"""The contract of every op: the formats' numbers, the limits and the argument checks.

Every face of an op (the plain-torch oracle in ``kernels.reference``, the Triton launcher in
``kernels/<op>.py`` and the FlashInfer adapter in ``a2a/``) calls the same check from here, so
that all of them accept and refuse the same arguments with the same exception and message.
Nothing here launches a kernel or imports Triton.

What every face does alike (each op's docstring repeats its part):

- Views: every face takes inputs of any strides (a Triton launcher copies to a contiguous
  tensor where its kernel needs one). Caller buffers (``out=``, ``out_scales=`` of
  ``quantize_nvfp4``) must be exactly the written shape and dtype (uint8), contiguous, on the
  input's device: no conversion, no broadcasting; the result is written there and returned.
- Index tensors (``rows`` of ``gather_rows`` and ``quantize_nvfp4``, ``permutation.inverse``,
  ``topk_ids``) are int32; int64 and int16 are refused (TypeError), as the library's index
  buffers are int32. An entry is UNUSED (-1: a zero row, or a skipped slot) or in range
  (``[0, T*top_k)``, ``[0, M)``, ``[0, P)``). ``check_values=True`` (the default; the same
  read is called ``check_ids`` in ``permute_by_expert`` and ``local_send_plan``) reads the
  range on the device in one host read and raises ValueError naming a bad entry;
  ``check_values=False`` reads nothing (CUDA-graph capture, compiled code) and every face then
  treats an out-of-range entry as UNUSED (``values``).
- ``gather_rows`` takes the Permutation itself (its top_k; a different top_k or an x of
  another T is refused); with a tensor, a top_k smaller than the permutation's gives rows past
  T*top_k, refused by the range check.
- The NVFP4 global scale is one fp32 element in [2^-126, 2^126] (finite, > 0, with a normal
  reciprocal), read under ``check_values`` by ``quantize_nvfp4`` and ``dequantize_nvfp4``;
  ``nvfp4_global_scale`` gives 1.0 for all-zero (or empty) x.
- Dequantizers refuse scales of any shape but the format's ([M, H/32] for MX; [Mp, Kp] or flat
  for NVFP4) and an output dtype other than float32/bf16/fp16.
- Launch configurations (``PermuteLaunch``, ``GatherLaunch``, ``NVFP4Launch``, ``BlockLaunch``,
  ``AmaxLaunch``, ``RoutingLaunch``) refuse a field of the wrong type (TypeError) or out of
  range (ValueError) where they are made (``launch``), so the eager launch and the registered
  op see the same configs.
- Float results are rounded to nearest even once, every NaN written as one canonical NaN per
  dtype (``casting``); byte movers (``gather_rows``) keep the bytes. An e2m1 code of a NaN is
  0x7 (no sign), e4m3 0x7F; the swizzled padding of NVFP4 scales is 0.
"""

from kernels.spec.casting import (BITS_DTYPES, CANONICAL_NAN_BITS,  # noqa: F401
                                  round_to_dtype)
from kernels.spec.permute import (UNPERMUTE_DTYPES, check_gather_inputs,  # noqa: F401
                                  check_gather_values, check_permute_inputs,
                                  check_inverse_values, check_unpermute_inputs,
                                  check_unpermute_tensors, check_unpermute_values,
                                  local_expert_count, permutation_capacity)
from kernels.spec.prepare import PREPARE_MAX_TOP_K, check_prepare_inputs  # noqa: F401
from kernels.spec.quant import (DEQUANT_DTYPES, E2M1_MAX, E2M1_VALUES, E4M3_MAX,  # noqa: F401
                                FLT_MAX, GLOBAL_SCALE_MAX, GLOBAL_SCALE_MIN, INV_E2M1_MAX,
                                INV_E4M3_MAX, LAYOUT_BLOCK_TILE, LAYOUT_ROW_TILE, MX_BLOCK,
                                NVFP4_BLOCK, NVFP4_GLOBAL_NUMERATOR, QUANT_INPUT_DTYPES,
                                SCALE_LAYOUTS, check_dequantize_mx_args,
                                check_dequantize_nvfp4_args, check_global_scale,
                                check_global_scale_value, check_global_scale_values,
                                check_layout, check_mx_scales, check_out, check_output_dtype,
                                check_quant_input, check_quantize_nvfp4_args,
                                check_quantize_nvfp4_values, check_scale_buffer,
                                check_swizzle_args, check_unswizzle_args, round_up,
                                swizzled_scale_shape)
from kernels.spec.routing import (LOGIT_DTYPES, MAX_TOP_K, ROUTING_METHODS,  # noqa: F401
                                  check_routing_args)
from kernels.spec.tensors import (FLOAT_TOLERANCES, check_expert_ids, check_tensor,  # noqa: F401
                                  check_top_k)
from kernels.spec.values import (check_index_range, index_extremes,  # noqa: F401
                                 read_to_host)
