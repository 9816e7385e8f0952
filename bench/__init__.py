"""The benchmark: every stage and the whole MoE layer, per backend, side by side."""
