"""The ``@triton.jit`` code behind ``kernels.quantize``: number formats and scale layouts
(``formats``), reading and packing words (``words``), the NVFP4 kernel and tile (``nvfp4``),
the MX and dequantize kernels (``mx``), the global scale and layout kernels (``scales``)."""
