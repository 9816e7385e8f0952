"""The project's performance targets, checked with ``--targets``.

Each target names a stage, the shape entries it applies to and a bound on the ``triton`` row.
The shapes are added to the sweep as explicit extra shapes (``Stage.extra`` in bench/stages.py),
so a full run always has a row to judge.

The absolute bounds (:data:`ABSOLUTE_KINDS`: a time, a bandwidth) were set on the project's GPU,
an H200 (:data:`BOUNDS_GPU`), and only a row timed on one is judged against them: on another GPU
(an H100, with less memory bandwidth) the verdict is "not judged" and the target's text says
why. A bound relative to another row of the same run (FlashInfer's, another backend's) is
judged on any GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The GPU the absolute bounds were set on (a substring of the rows' "gpu", e.g. "NVIDIA H200").
BOUNDS_GPU = "H200"
# The kinds of target whose bound is a number of this GPU, not a ratio to another row of the run.
ABSOLUTE_KINDS = ("max_us", "min_gbps", "max_us_with_partner")
# The verdict of a row, by its ``target_pass``.
VERDICTS = {True: "PASS", False: "FAIL", None: "not judged"}


@dataclass(frozen=True)
class Target:
    """``kind``: ``max_us`` (time <= value), ``min_gbps`` (GB/s >= value),
    ``max_ratio_vs_flashinfer`` (time <= value * FlashInfer's time on the same shape),
    ``max_ratio_vs_best_flashinfer`` (the same against the fastest of FlashInfer's rows, e.g.
    its two transports) or ``max_us_with_partner`` (time + the ``partner`` row's time <= value;
    partner = (stage, shape entries added to this row's shape), same backend),
    ``max_ratio_vs_backend`` (time <= value * the time of the ``versus`` backend's row of the
    same stage and shape) or ``max_extra_us_vs_backend`` (time - that row's time <= value);
    where the row carries ``paired_us`` with both backends (the two timed in alternation), the
    two use those times instead."""

    stage: str
    match: dict
    kind: str
    value: float
    text: str
    backend: str = "triton"
    partner: Optional[tuple] = None
    versus: str = ""

    def judged_on(self, gpu: Optional[str]) -> bool:
        """Whether a row timed on ``gpu`` (its name; None: not recorded) is judged against this
        target: everywhere for a bound relative to another row, on :data:`BOUNDS_GPU` (or
        where the GPU is not recorded) for an absolute one."""
        return self.kind not in ABSOLUTE_KINDS or gpu is None or BOUNDS_GPU in gpu

    def applies(self, record: dict) -> bool:
        return (record["stage"] == self.stage and record["backend"] == self.backend
                and all(record["shape"].get(k) == v for k, v in self.match.items()))

    def judge(self, record: dict, records: list[dict]) -> Optional[bool]:
        """True / False, or None when the row (or its FlashInfer twin) was not timed."""
        if record["time_us"] is None:
            return None
        if self.kind == "max_us":
            return record["time_us"] <= self.value
        if self.kind == "min_gbps":
            return record["gbps"] >= self.value
        if self.kind in ("max_ratio_vs_backend", "max_extra_us_vs_backend"):
            mine, twin = record["time_us"], None
            paired = record.get("paired_us") or {}
            if record["backend"] in paired and self.versus in paired:
                # both timed in alternation (bench.decode.paired_times): these, not the rows'
                # own times from different minutes
                mine, twin = paired[record["backend"]], paired[self.versus]
            else:
                twin = next((r["time_us"] for r in records
                             if r["stage"] == record["stage"] and r["shape"] == record["shape"]
                             and r["backend"] == self.versus and r["time_us"]), None)
            if not twin:
                return None
            if self.kind == "max_ratio_vs_backend":
                return mine <= self.value * twin
            return mine - twin <= self.value
        if self.kind == "max_us_with_partner":
            stage, extra = self.partner
            shape = {**record["shape"], **extra}
            partners = [r["time_us"] for r in records
                        if r["stage"] == stage and r["shape"] == shape
                        and r["backend"] == record["backend"] and r["time_us"]]
            return record["time_us"] + partners[0] <= self.value if partners else None
        best = self.kind == "max_ratio_vs_best_flashinfer"
        twins = [r["time_us"] for r in records
                 if r["stage"] == record["stage"] and r["shape"] == record["shape"]
                 and (r["backend"].startswith("flashinfer") if best
                      else r["backend"] == "flashinfer") and r["time_us"]]
        return record["time_us"] <= self.value * min(twins) if twins else None


_BIG = dict(tokens=8192, hidden=7168)
TARGETS = (
    Target("quantize", dict(op="nvfp4_linear", **_BIG), "max_us", 40.0,
           "NVFP4 [8192,7168] <= 40 us"),
    Target("quantize", dict(op="nvfp4_swizzled", **_BIG), "max_us", 40.0,
           "NVFP4 [8192,7168] swizzled scales <= 40 us"),
    Target("quantize", dict(op="nvfp4_linear", tokens=128, hidden=7168), "max_us", 6.0,
           "NVFP4 [128,7168] <= 6 us"),
    Target("quantize", dict(op="mxfp8", **_BIG), "min_gbps", 3600.0,
           "MXFP8 [8192,7168] >= 3.6 TB/s"),
    Target("quantize", dict(op="global_scale", **_BIG), "max_us", 35.0,
           "global scale [8192,7168] <= 35 us"),
    Target("routing", dict(method="deepseek_v3", tokens=8192, experts=256, top_k=8,
                           routing="uniform"),
           "max_ratio_vs_flashinfer", 0.8,
           "DeepSeek-V3 routing T=8192 E=256 k=8 <= 0.8x FlashInfer"),
) + tuple(
    # issue 18: DeepSeek-V3 routing at most 0.9x FlashInfer's fused_topk_deepseek at every
    # decode and prefill size (T=8192 keeps its tighter bound above)
    Target("routing", dict(method="deepseek_v3", tokens=t, experts=256, top_k=8,
                           routing="uniform"),
           "max_ratio_vs_flashinfer", 0.9,
           f"DeepSeek-V3 routing T={t} E=256 k=8 <= 0.9x FlashInfer")
    for t in (1, 16, 64, 128, 512, 2048)
) + tuple(
    # issue 18: the expert-major permutation at decode sizes and at T=8192
    Target("permute", dict(op="permute_by_expert", tokens=t, experts=256, top_k=8,
                           routing="uniform"),
           "max_us", bound, f"permute_by_expert T={t} E=256 k=8 <= {bound:g} us")
    for t, bound in ((1, 5.0), (16, 5.0), (64, 5.0), (128, 5.0), (256, 5.0), (8192, 25.0))
) + (
    Target("routing", dict(method="softmax_topk", tokens=8192, experts=128, top_k=4,
                           routing="uniform"),
           "max_us", 15.0, "softmax_topk T=8192 E=128 k=4 <= 15 us"),
    Target("permute", dict(op="gather_rows", tokens=8192, hidden=7168, top_k=8,
                           routing="uniform"),
           "min_gbps", 2800.0, "gather_rows [65536,7168] bf16 >= 2.8 TB/s"),
    Target("permute", dict(op="unpermute_and_reduce", tokens=8192, hidden=7168, top_k=8,
                           routing="uniform"),
           "min_gbps", 2800.0, "unpermute_and_reduce [65536,7168] bf16 >= 2.8 TB/s"),
    Target("dispatch", dict(quant="bf16", tokens=2048, hidden=7168, experts=32, top_k=8,
                            routing="uniform"),
           "max_us", 90.0, "Triton transport bf16 dispatch T=2048 E=32 k=8 <= 90 us"),
    Target("dispatch", dict(quant="nvfp4", tokens=2048, hidden=7168, experts=32, top_k=8,
                            routing="uniform"),
           "max_us", 35.0, "Triton transport NVFP4 fused dispatch T=2048 E=32 k=8 <= 35 us",
           backend="triton_fused"),
    Target("combine", dict(tokens=2048, hidden=7168, experts=32, top_k=8, routing="uniform"),
           "max_us", 100.0, "Triton transport combine T=2048 E=32 k=8 <= 100 us"),
    Target("combine", dict(tokens=16, hidden=7168, experts=32, top_k=8, routing="uniform"),
           "max_us_with_partner", 20.0,
           "Triton transport bf16 dispatch + combine T=16 E=32 k=8 <= 20 us together",
           partner=("dispatch", {"quant": "bf16"})),
    # every token count of the transport sweep: faster than FlashInfer's faster transport
    Target("dispatch", dict(quant="bf16", hidden=7168, experts=32, top_k=8, routing="uniform"),
           "max_ratio_vs_best_flashinfer", 1.0,
           "Triton transport bf16 dispatch faster than the best FlashInfer transport"),
    Target("combine", dict(hidden=7168, experts=32, top_k=8, routing="uniform"),
           "max_ratio_vs_best_flashinfer", 1.0,
           "Triton transport combine faster than the best FlashInfer transport"),
) + tuple(
    Target("prepare", dict(tokens=t, experts=256, top_k=8, routing="uniform"), "max_us", 25.0,
           f"Triton prepare E=256 k=8 T={t} <= 25 us") for t in (16, 512, 8192)
) + tuple(
    # The decode chain (bench/decode.py), both payloads. T=2048's bound is the chain's time
    # (bf16 payload) when the stage was added: no slower than before.
    # The same bounds for the chain with the quantize and the plan on side streams beside its
    # critical path (route, permute, gather, unpermute).
    Target("decode", dict(tokens=t, hidden=7168, experts=256, top_k=8), "max_us", bound,
           f"decode chain{what} T={t} E=256 k=8 H=7168 <= {bound:g} us{why}", backend=backend)
    for t, bound, why in ((16, 12.0, ""), (64, 15.0, ""), (256, 25.0, ""),
                          (2048, 218.4, " (no slower than before)"))
    for backend, what in (("triton", ""), ("triton_overlap", " overlapped"))
) + tuple(
    # issue 17: the chain compiled by torch.compile (default mode), replayed as one CUDA
    # graph, no slower than the uncompiled chain replayed as one CUDA graph
    Target("decode", dict(tokens=t, hidden=7168, experts=256, top_k=8), "max_ratio_vs_backend",
           1.0, f"decode chain compiled T={t} (CUDA graph) <= uncompiled (CUDA graph)",
           backend="triton_compiled_graph", versus="triton")
    for t in (16, 64, 256)  # (bench.decode.PAIRED_TOKENS: tests/test_bench.py checks)
) + tuple(
    # issue 17: an eager call through the registered op (the dispatcher) at most 2 us more
    # than the raw launch of the same kernels (bench/ops.py)
    Target("ops", dict(tokens=16, op=name), "max_extra_us_vs_backend", 2.0,
           f"{name}: {what} <= raw launch + 2 us", backend=backend, versus="triton_raw")
    for backend, what in (("triton_op", "op call"), ("triton_public", "public function"))
    # (kernels.ops.OP_NAMES: tests/test_bench.py checks)
    for name in ("route_topk", "local_send_plan", "permute_by_expert", "gather_rows",
                 "permute_and_gather", "unpermute_and_reduce", "nvfp4_global_scale",
                 "quantize_nvfp4", "quantize_nvfp4_out", "scale_and_quantize_nvfp4",
                 "quantize_mxfp8", "quantize_mxfp4", "dequantize_nvfp4", "dequantize_mxfp8",
                 "dequantize_mxfp4", "swizzle_scales", "unswizzle_scales"))


def judge_targets(records: list[dict]) -> None:
    """Set ``target`` (the stated texts, joined by "; ") and ``target_pass`` on every record a
    target applies to: False if one fails, else None if one could not be judged (untimed row or
    twin, or an absolute bound and a row timed on another GPU than :data:`BOUNDS_GPU`, whose
    text then says so), else True. Records no current target applies to lose both (a result
    file read again, e.g. by --readme-from, may carry verdicts of older targets)."""
    for record in records:
        hits = [target for target in TARGETS if target.applies(record)]
        if not hits:
            record.pop("target", None)
            record.pop("target_pass", None)
            continue
        here = [target.judged_on(record.get("gpu")) for target in hits]
        verdicts = [target.judge(record, records) if judged else None
                    for target, judged in zip(hits, here)]
        record["target"] = "; ".join(
            target.text + ("" if judged else f" (a bound for an {BOUNDS_GPU}: not judged on "
                                             f"{record['gpu']})")
            for target, judged in zip(hits, here))
        record["target_pass"] = (False if False in verdicts else
                                 None if None in verdicts else True)
