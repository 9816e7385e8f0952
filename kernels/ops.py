"""Every public single-GPU op of the library as a ``torch.library`` op, namespace ``moe_a2a``
(``kernels.library`` explains the overloads, fakes and the eager path). Importing this module
registers them all; each kernel module registers its own ops when it is imported.

=========================  ===========================================================
op                         public functions (kernels / a2a stage)
=========================  ===========================================================
``route_topk``             ``kernels.routing.route_topk``, ``a2a.routing.route_topk``
``local_send_plan``        ``kernels.prepare.local_send_plan``
``permute_by_expert``      ``kernels.permute.permute_by_expert``, ``a2a.permute...``
``gather_rows``            ``kernels.gather.gather_rows``, ``a2a.permute.gather_rows``
``permute_and_gather``     the two above in one op (``kernels.permute...``, ``a2a.permute...``)
``unpermute_and_reduce``   ``kernels.gather.unpermute_and_reduce``, ``a2a.permute...``
``nvfp4_global_scale``     ``kernels.quantize.nvfp4_global_scale``, ``a2a.quantize...``
``quantize_nvfp4``         ``kernels.quantize.quantize_nvfp4`` (``a2a.quantize...``)
``quantize_nvfp4_out``     the same with ``out=`` / ``out_scales=``
``scale_and_quantize_nvfp4``  the two above in two launches (``kernels.quantize...``,
                           ``a2a.quantize...``)
``quantize_mxfp8/mxfp4``   ``kernels.quantize.quantize_mxfp8/4``, ``a2a.quantize...``
``dequantize_nvfp4``       ``kernels.quantize.dequantize_nvfp4``
``dequantize_mxfp8/mxfp4``  ``kernels.quantize.dequantize_mxfp8/4``
``swizzle_scales``         ``kernels.quantize.swizzle_scales``, ``a2a.quantize...``
``unswizzle_scales``       ``kernels.quantize.unswizzle_scales``
``check_values``           the device-read checks while tracing (``kernels.library``)
=========================  ===========================================================
"""

from __future__ import annotations

from kernels import gather, permute, prepare, quantize, routing  # noqa: F401  (registers)
from kernels.library import REGISTERED, RegisteredOp

# The registered ops by name, in the order of the table above.
OP_NAMES = ("route_topk", "local_send_plan", "permute_by_expert", "gather_rows",
            "permute_and_gather", "unpermute_and_reduce", "nvfp4_global_scale", "quantize_nvfp4",
            "quantize_nvfp4_out", "scale_and_quantize_nvfp4", "quantize_mxfp8",
            "quantize_mxfp4", "dequantize_nvfp4", "dequantize_mxfp8", "dequantize_mxfp4",
            "swizzle_scales", "unswizzle_scales")


def registered_ops() -> dict[str, RegisteredOp]:
    """Every registered op by name (:data:`OP_NAMES` order)."""
    return {name: REGISTERED[name] for name in OP_NAMES}
