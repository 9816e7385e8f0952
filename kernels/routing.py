"""Top-k expert routing in Triton: router logits [T, E] -> topk_ids [T, k], topk_weights [T, k].

Same name, arguments and results as ``kernels.reference.route_topk`` (the oracle; its comment
block defines every method). One program (one warp) routes ``BLOCK_TOKENS`` tokens and holds
their whole logit rows in registers as a ``[BLOCK_TOKENS, GROUPS_PAD * GROUP_PAD]`` tile:
expert ``g * experts_per_group + j`` sits in column ``g * GROUP_PAD + j`` (without groups: one
group of all E), each part padded to a power of two and the padding masked out.

Selection is k rounds of one ``tl.max`` per row over packed int64 keys::

    key = (order-preserving int32 of the fp32 score) << 32 | (ID_LIMIT - expert id)

so the largest key is the best score, and among equal scores the smaller id (its low part is
larger): ties are broken in the same single reduction, deterministically. The chosen key is
then replaced by ``KEY_NONE`` (keys are unique, so exactly one entry goes). Worked example,
scores [1.0, 3.0, 3.0] (ID_LIMIT - id = 65535, 65534, 65533): keys (k(1), 65535),
(k(3), 65534), (k(3), 65533); round 1 takes (k(3), 65534) = id 1, round 2 (k(3), 65533) = id 2.

DeepSeek-V3 first scores each group (top-2 sum of its biased scores: the max, plus the max
again if it occurs twice, else the largest score below it -- fp32 reductions only), keeps
``TOPK_GROUPS`` groups by the same packed-key rounds over group indices, and then either sets
the keys of the dropped groups to ``KEY_NONE`` (``COMPACT = COMPACT_NONE``) or builds a
narrower tile of the kept groups' candidates only (4 kept groups x 32 = 128 keys instead of 256
for DeepSeek-V3), by a register gather (``COMPACT_GATHER``) or by re-reading those logits
(``COMPACT_RELOAD``), so that the k argmax rounds scan half as many keys.

The weights are formed after selection from the chosen logits, re-read from memory (a few
cached loads per row) rather than carried through the selection rounds.
"""

from __future__ import annotations


from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.hardware import interpreting
from kernels.spec.routing import check_routing_args

# Low 16 bits of a key hold ID_LIMIT - id: larger for smaller ids, so ties go to the smaller id.
# 65535 bounds the expert (and group) ids we can pack; MAX_EXPERTS is far below it.
ID_LIMIT = tl.constexpr(65535)

# 512: every row is held in registers as int64 keys plus fp32 scores; with the launch rule
# below a warp then holds one row of 16 keys per thread. Larger E needs a chunked selection.
MAX_EXPERTS = 512

# How DeepSeek-V3 narrows the selection to the kept groups (the ``COMPACT`` constexpr).
COMPACT_NONE = 0     # keep the full-row tile, dropped groups' keys set to KEY_NONE
COMPACT_GATHER = 1   # tl.gather the kept groups' keys into a [B, KEEP_PAD * GROUP_PAD] tile
COMPACT_RELOAD = 2   # re-read the kept groups' logits (cached) and rebuild their keys


@dataclass(frozen=True)
class RoutingLaunch:
    """Launch rule of ``route_topk`` (``python -m bench.tune`` times the alternatives; the
    defaults are the best rows of its run on an H200, recorded in bench/results/tune-*.json).

    num_warps: warps per program. One, so that every per-row reduction (k rounds of them) stays
        inside a warp: with 4 warps Triton's default layout splits a 256-wide fp32 row over 2
        warps and every round then goes through shared memory and a barrier.
    elements_per_program: tokens x padded experts one program holds at most: 256 = 8 per lane,
        one DeepSeek-V3 row of int64 keys plus fp32 scores per warp, 2 rows of E=128.
    target_programs: rows per program grow (up to the element bound) only while the grid has
        more programs than this (about 8 per SM of an H200): small batches get one row per
        program, whose time is the latency of one program's serial chain of reductions.
    rows_per_program: a fixed power of two instead of the rule above (None: the rule).
    compact: how DeepSeek-V3 narrows the selection to the kept groups (``COMPACT_*``).
    """

    num_warps: int = 1
    elements_per_program: int = 256
    target_programs: int = 1024
    rows_per_program: Optional[int] = None
    compact: int = COMPACT_NONE


DEFAULT_ROUTING = RoutingLaunch()


# How the weights are formed (the ``WEIGHTS`` constexpr of the kernel).
SOFTMAX_ALL = 0      # softmax over all E logits, at the chosen ids
SOFTMAX_CHOSEN = 1   # softmax over the k chosen logits
SIGMOID = 2          # sigmoid of each chosen logit
SIGMOID_RENORM = 3   # sigmoid of each chosen logit / their sum

# method -> (selection on sigmoid(logit) + bias?, weights)
_METHODS = {
    "softmax_topk": (False, SOFTMAX_ALL),
    "softmax_topk_renorm": (False, SOFTMAX_CHOSEN),
    "topk_softmax": (False, SOFTMAX_CHOSEN),
    "sigmoid_topk": (False, SIGMOID),
    "sigmoid_topk_renorm": (False, SIGMOID_RENORM),
    "llama4": (False, SIGMOID),
    "deepseek_v3": (True, SIGMOID_RENORM),
}


@triton.jit
def _exp(x, PRECISE_MATH: tl.constexpr):
    # libdevice expf is the expf torch's CUDA kernels call, so exp (and the sigmoid built on
    # it) rounds as the oracle does on the same GPU. The interpreter has no libdevice.
    if PRECISE_MATH:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _sigmoid(x, PRECISE_MATH: tl.constexpr):
    # 1 / (1 + exp(-x)) with an IEEE division (Triton's "/" is approximate for fp32), the
    # formula of the oracle's _sigmoid. (libdevice.rcp_rn(d), the same fp32, was measured no
    # faster on H200: bench.tune, 2026-11-30.)
    denominator = 1.0 + _exp(-x, PRECISE_MATH)
    return tl.math.div_rn(tl.zeros_like(denominator) + 1.0, denominator)


@triton.jit
def _pack(score, index):
    """int64 keys whose signed order is (score, then smaller index) -- see the module doc.
    -0.0 is first made +0.0 so that the two zeros tie, as they compare in torch."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    # Tensor first: ``constexpr - tensor`` fails in the interpreter.
    low = (-index + ID_LIMIT).to(tl.int64)
    return (ordered.to(tl.int64) << 32) | low


@triton.jit
def _route_topk_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr,
    num_tokens, stride_token, stride_expert, routed_scaling,
    EXPERTS_PER_GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    KEEP_PAD: tl.constexpr, COMPACT: tl.constexpr,
    SELECT_BIASED_SIGMOID: tl.constexpr, WEIGHTS: tl.constexpr, PRECISE_MATH: tl.constexpr,
):
    KEY_NONE: tl.constexpr = -(2**63)  # below every packed key: removed / padding / dropped

    rows = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    row_ok = rows < num_tokens
    # Rows past the end re-read the last token (never stored): no -inf-only rows, no NaN.
    load_rows = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    # Column c of the tile is slot c % GROUP_PAD of group c // GROUP_PAD (powers of two: the
    # [B, GROUPS_PAD, GROUP_PAD] view below is a free reshape). A flat 2-D tile lets every warp
    # own whole rows, so the per-row reductions stay inside a warp.
    columns = tl.arange(0, GROUPS_PAD * GROUP_PAD)
    group_of = columns // GROUP_PAD
    slot_of = columns % GROUP_PAD
    expert = group_of * EXPERTS_PER_GROUP + slot_of                              # [C]
    expert_ok = (group_of < NUM_GROUPS) & (slot_of < EXPERTS_PER_GROUP)

    row_base = logits_ptr + load_rows * stride_token                            # [B]
    x = tl.load(row_base[:, None] + expert[None, :] * stride_expert,
                mask=expert_ok[None, :], other=float("-inf")).to(tl.float32)     # [B, C]

    if SELECT_BIASED_SIGMOID:
        bias = tl.load(bias_ptr + expert, mask=expert_ok, other=0.0)
        score = _sigmoid(x, PRECISE_MATH) + bias[None, :]
    else:
        score = x
    score = tl.where(expert_ok[None, :], score, float("-inf"))
    keys = tl.where(expert_ok[None, :], _pack(score, expert[None, :]), KEY_NONE)

    if TOPK_GROUPS < NUM_GROUPS:
        # Group score = best + second best biased score of the group. The second best is the
        # best again when it occurs twice (one copy is removed, as the oracle's topk(2) does).
        score3 = tl.reshape(score, [BLOCK_TOKENS, GROUPS_PAD, GROUP_PAD])
        first = tl.max(score3, axis=2)                                           # [B, G]
        is_first = score3 == first[:, :, None]
        copies = tl.sum(is_first.to(tl.int32), axis=2)
        below = tl.max(tl.where(is_first, float("-inf"), score3), axis=2)
        second = tl.where(copies >= 2, first, below)
        groups = tl.arange(0, GROUPS_PAD)[None, :]
        group_keys = tl.where(groups < NUM_GROUPS, _pack(first + second, groups), KEY_NONE)
        # Kept groups, in order of group score: column s * GROUP_PAD + j of the compact tile
        # is slot j of the s-th kept group.
        compact_columns = tl.arange(0, KEEP_PAD * GROUP_PAD)
        compact_rank = compact_columns // GROUP_PAD
        compact_slot = compact_columns % GROUP_PAD
        compact_group = tl.zeros([BLOCK_TOKENS, KEEP_PAD * GROUP_PAD], dtype=tl.int32)
        kept = tl.zeros([BLOCK_TOKENS, GROUPS_PAD], dtype=tl.int1)
        for r in tl.static_range(TOPK_GROUPS):
            best_group = tl.max(group_keys, axis=1)
            hit = group_keys == best_group[:, None]
            kept = kept | hit
            group_keys = tl.where(hit, KEY_NONE, group_keys)
            if COMPACT != 0:
                group_id = -(best_group & 0xFFFF).to(tl.int32) + ID_LIMIT            # [B]
                compact_group = tl.where(compact_rank[None, :] == r, group_id[:, None],
                                         compact_group)
        if COMPACT == 0:  # COMPACT_NONE
            kept3 = tl.broadcast_to(kept[:, :, None], [BLOCK_TOKENS, GROUPS_PAD, GROUP_PAD])
            kept_columns = tl.reshape(kept3, [BLOCK_TOKENS, GROUPS_PAD * GROUP_PAD])
            keys = tl.where(kept_columns, keys, KEY_NONE)
        else:
            compact_ok = ((compact_rank < TOPK_GROUPS)
                          & (compact_slot < EXPERTS_PER_GROUP))[None, :]          # [1, C']
            if COMPACT == 1:  # COMPACT_GATHER
                source = compact_group * GROUP_PAD + compact_slot[None, :]
                keys = tl.where(compact_ok, tl.gather(keys, source, axis=1), KEY_NONE)
            else:  # COMPACT_RELOAD
                expert2 = compact_group * EXPERTS_PER_GROUP + compact_slot[None, :]  # [B, C']
                x2 = tl.load(row_base[:, None] + expert2 * stride_expert, mask=compact_ok,
                             other=float("-inf")).to(tl.float32)
                bias2 = tl.load(bias_ptr + expert2, mask=compact_ok, other=0.0)
                score2 = _sigmoid(x2, PRECISE_MATH) + bias2
                keys = tl.where(compact_ok, _pack(score2, expert2), KEY_NONE)

    # k rounds of argmax; ids[:, j] = the j-th best expert of each row.
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros([BLOCK_TOKENS, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)                                              # [B]
        # Keys are unique per row in their low word (ID_LIMIT - id; KEY_NONE's is 0, which no
        # id gives): one 32-bit compare finds the chosen entry.
        keys = tl.where(keys.to(tl.int32) == best.to(tl.int32)[:, None], KEY_NONE, keys)
        chosen = -(best & 0xFFFF).to(tl.int32) + ID_LIMIT
        ids = tl.where(slots[None, :] == j, chosen[:, None], ids)

    slot_ok = slots[None, :] < TOP_K                                             # [1, K]
    chosen_x = tl.load(row_base[:, None] + ids * stride_expert, mask=slot_ok,
                       other=float("-inf")).to(tl.float32)                       # [B, K]
    if WEIGHTS == 0:  # SOFTMAX_ALL
        row_max = tl.max(x, axis=1)
        total = tl.sum(_exp(x - row_max[:, None], PRECISE_MATH), axis=1)
        weights = _exp(chosen_x - row_max[:, None], PRECISE_MATH) / total[:, None]
    elif WEIGHTS == 1:  # SOFTMAX_CHOSEN
        row_max = tl.max(chosen_x, axis=1)
        numerator = tl.where(slot_ok, _exp(chosen_x - row_max[:, None], PRECISE_MATH), 0.0)
        weights = numerator / tl.sum(numerator, axis=1)[:, None]
    elif WEIGHTS == 2:  # SIGMOID
        weights = _sigmoid(chosen_x, PRECISE_MATH)
    else:  # SIGMOID_RENORM
        numerator = tl.where(slot_ok, _sigmoid(chosen_x, PRECISE_MATH), 0.0)
        weights = numerator / tl.sum(numerator, axis=1)[:, None]
    weights = weights * routed_scaling

    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_ok = row_ok[:, None] & slot_ok
    tl.store(ids_ptr + out, ids, mask=out_ok)
    tl.store(weights_ptr + out, weights, mask=out_ok)


def _launch(logits: torch.Tensor, top_k: int, method: str, bias, num_groups: int,
            topk_groups: int, routed_scaling: float, launch: RoutingLaunch):
    """Allocate the outputs and launch the kernel on checked arguments (``num_groups`` and
    ``topk_groups`` already filled in by ``check_routing_args``)."""
    num_tokens, num_experts = logits.shape
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights
    select_biased, weight_rule = _METHODS[method]
    if bias is None:
        bias = weights  # never read (SELECT_BIASED_SIGMOID is off); any pointer will do
    elif not bias.is_contiguous():
        bias = bias.contiguous()
    # Only DeepSeek-V3 with dropped groups needs the group axis; otherwise one group of all E.
    grouped = topk_groups < num_groups
    groups = num_groups if grouped else 1
    experts_per_group = num_experts // groups
    groups_pad = triton.next_power_of_2(groups)
    group_pad = triton.next_power_of_2(experts_per_group)
    rows_per_program = launch.rows_per_program
    if rows_per_program is None:
        rows_per_program = max(1, min(launch.elements_per_program // (groups_pad * group_pad),
                                      triton.next_power_of_2(-(-num_tokens
                                                               // launch.target_programs))))
    grid = (-(-num_tokens // rows_per_program),)
    _route_topk_kernel[grid](
        logits, bias, ids, weights,
        num_tokens, logits.stride(0), logits.stride(1), float(routed_scaling),
        EXPERTS_PER_GROUP=experts_per_group, NUM_GROUPS=groups,
        TOPK_GROUPS=topk_groups if grouped else 1,
        GROUPS_PAD=groups_pad, GROUP_PAD=group_pad,
        TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), BLOCK_TOKENS=rows_per_program,
        KEEP_PAD=triton.next_power_of_2(topk_groups) if grouped else 1,
        COMPACT=launch.compact,
        SELECT_BIASED_SIGMOID=select_biased, WEIGHTS=weight_rule,
        PRECISE_MATH=not interpreting(),
        num_warps=launch.num_warps,
    )
    return ids, weights


def route_topk(logits: torch.Tensor, top_k: int, method: str, *, bias=None, num_groups=None,
               topk_groups=None, routed_scaling: float = 1.0,
               launch: RoutingLaunch = DEFAULT_ROUTING):
    """Top-k expert routing (Triton). Same contract as ``kernels.reference.route_topk``.

    Args:
        logits: [T, E] float32, bfloat16 or float16, the router logits; E <= 512; any strides.
        top_k: k, experts per token, 1 <= k <= min(E, 32).
        method: one of ``kernels.reference.ROUTING_METHODS``.
        bias: [E] float32, DeepSeek-V3's selection bias; required for ``deepseek_v3`` only.
        num_groups: DeepSeek-V3 expert groups (divides E); default 1.
        topk_groups: DeepSeek-V3 groups kept per token; default ``num_groups`` (all).
        routed_scaling: factor applied to every weight.
        launch: the launch rule (:class:`RoutingLaunch`); the default is the fixed rule.

    Returns:
        topk_ids: [T, k] int32, expert ids in descending selection score, ties to the smaller
            id (identical to the oracle's).
        topk_weights: [T, k] float32, the weight of each chosen expert.

    No host synchronisation: safe to capture in a CUDA graph.
    """
    num_groups, topk_groups = check_routing_args(logits, top_k, method, bias, num_groups,
                                                 topk_groups, routed_scaling)
    if logits.shape[1] > MAX_EXPERTS:
        raise ValueError(f"logits have {logits.shape[1]} experts; the Triton routing kernel "
                         f"holds a row in registers and takes E <= {MAX_EXPERTS} "
                         f"(use backend='torch')")
    return _launch(logits, top_k, method, bias, num_groups, topk_groups, routed_scaling, launch)
