"""Triton kernels for MoE expert parallelism, and their plain-torch oracle (``kernels.reference``).

Pure compute: nothing here imports torch.distributed, FlashInfer or ``a2a``. One module per op
holds its ``@triton.jit`` kernels and launcher; ``kernels.types`` holds the shared result types.
Every public op is also a ``torch.library`` op, ``torch.ops.moe_a2a.<op>.triton`` / ``.torch``
(``kernels.ops`` lists them, ``kernels.library`` explains the registration; docs/design.md,
"Registered ops").
"""

# Marks this package as triton-moe-a2a's ``kernels`` (another distribution, the Hugging Face
# hub loader, installs a top-level ``kernels`` too; ``a2a`` checks for this mark).
PROJECT = "triton-moe-a2a"
