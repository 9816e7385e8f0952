"""Top-k expert routing in Triton: router logits [T, E] -> topk_ids [T, k], topk_weights [T, k].

Same name, arguments and results as ``kernels.reference.route_topk`` (the oracle; its comment
block defines every method and the selection order). One program routes ``BLOCK_TOKENS`` tokens
and holds their whole logit rows in registers as a ``[BLOCK_TOKENS, GROUPS_PAD * GROUP_PAD]``
tile: expert ``g * experts_per_group + j`` sits in column ``g * GROUP_PAD + j`` (without groups:
one group of all E), each part padded to a power of two and the padding masked out.

Scores are compared as int32 keys, ``_ordered(score)``: the fp32 bits mapped so that signed
integer order is the float order, with -0.0 made +0.0 (the two zeros tie, as they compare in
torch) and every NaN mapped to ``NAN_KEY``, below the key of -inf; ``NONE_KEY``, lower still,
marks padding, dropped groups and experts already chosen. Equal keys go to the smaller id.

Selection is k rounds of argmax, in one of three forms (``RoutingLaunch.keys``):

- ``KEYS_SPLIT32``: per round, the int32 max of the keys, then the int32 min of the ids whose key
  is that max; the chosen expert's key becomes ``NONE_KEY``. A row sits in one warp, and Triton
  lowers a full-warp int32 max or min to one ``redux.sync`` on sm_80+, so a round is two
  warp-wide instructions after the per-thread part.
- ``KEYS_PACKED64``: per round, one max over int64 keys ``key << 32 | (ID_LIMIT - id)`` (ties
  to the smaller id inside the one reduction), reduced across lanes by five levels of two 32-bit
  shuffles each.
- ``KEYS_QUEUES``: the ``KEYS_SPLIT32`` reductions over one key per lane. Each lane first sorts
  the values it holds, in queues of 4 (one 16-byte vector of fp32 logits, half of one of bf16:
  ``_lane_queues`` views the tile as [B, 32] tensors without moving data), by a 5-comparator
  network in the selection order; a round then reduces the lanes' heads (the better of its
  queues' heads: one compare), and the lane whose head was chosen pops it (its queue moves up
  by one select per value). A round's own work is a few instructions instead of a pass over
  every value a lane holds (8 compares and selects twice, and a max tree, for DeepSeek-V3),
  for a sort done once (off the chain of the group scores, which it runs beside). For one-warp
  programs whose tile is a multiple of 128 columns (2 x 16 bytes per lane ... 512), else the
  ``KEYS_SPLIT32`` rounds.

Worked example, scores [1.0, 3.0, 3.0]: round 1 takes the max key k(3.0), held by ids 1 and 2,
and the smaller id, 1; round 2 finds k(3.0) again, now only at id 2.

DeepSeek-V3 first scores each group: the sum of its two best biased scores in the selection
order (the best, plus the best again if it occurs twice, else the best key below it), found on
the int32 keys and added in fp32, either by a max and then a count of its copies and a max
below it (``TOP2_COUNT``: two passes of reductions) or by one reduction of (largest, second
largest) pairs, which merges two pairs by three min/max (``TOP2_PAIRS``;
``RoutingLaunch.group_top2``). It keeps ``TOPK_GROUPS`` groups, either by rounds of argmax
over the group keys or by counting, for each group, the groups ranked above it (a
``[GROUPS_PAD, GROUPS_PAD]`` compare: no dependent rounds; ``RoutingLaunch.group_select``). It
then either sets the keys of the dropped groups to ``NONE_KEY`` (``COMPACT_NONE``) or builds a
narrower tile of the kept groups' candidates only (4 kept groups x 32 = 128 keys instead of 256
for DeepSeek-V3), by a register gather (``COMPACT_GATHER``) or by re-reading those logits
(``COMPACT_RELOAD``), so that the k rounds scan half as many keys.

The weights are formed after selection from the chosen experts' logits (DeepSeek-V3: their
sigmoid), taken in one of three ways (``RoutingLaunch.weights_from``): re-read from memory
after the rounds as a [B, k] tile (``WEIGHTS_RELOAD``); carried out of each round by one more
int32 max, of a bit-exact int32 image of each value, which no later round waits for
(``WEIGHTS_CARRY``); or loaded one per round as soon as the round has chosen
(``WEIGHTS_LOAD_EACH``). The last two form the weights slot by slot on [B] values and store
each slot as it is known. A NaN weight is stored as the one bit pattern ``NAN_WEIGHT_BITS`` of
``kernels.spec.routing``.

The sigmoid's IEEE division (``RoutingLaunch.reciprocal``): ptxas expands div.rn into a fast
path (MUFU.RCP, one Newton step, a correction of the quotient), a range check and a branch
around a slow path, so a thread's divisions run one after the other (8 per thread for
DeepSeek-V3's 256 sigmoids). ``RECIP_FMA`` writes the same fast path out without the branch,
for all of a thread's values at once, and redoes them by div.rn only where one of a thread's
denominators exceeds ``FAST_RECIPROCAL_LIMIT`` (a logit below about -86.6: 1 / d near or
below the smallest normal float, where MUFU.RCP flushes to zero): one rarely taken branch per
thread instead of one per value, and the same bits as div.rn for every value.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.language.extra import libdevice

from kernels import library, reference
from kernels.hardware import grid_dependency, grid_dependency_prologue, interpreting
from kernels.sizes import cdiv, next_power_of_2
from kernels.spec.launch import checked_launch
from kernels.spec.routing import NAN_WEIGHT_BITS, check_routing_args

# Low 16 bits of a packed key hold ID_LIMIT - id: larger for smaller ids, so ties go to the
# smaller id. 65535 bounds the expert (and group) ids we can pack; MAX_EXPERTS is far below it.
ID_LIMIT = tl.constexpr(65535)
NONE_KEY = tl.constexpr(-(2**31))       # padding, dropped, already chosen: below every score
NAN_KEY = tl.constexpr(-(2**31) + 1)    # a NaN score: below -inf, above NONE_KEY
NO_ID = tl.constexpr(2**31 - 1)         # above every id: what the min over ids ignores
NAN_WEIGHT = tl.constexpr(NAN_WEIGHT_BITS)
# 2**125: up to it MUFU.RCP's approximation of 1 / d (within 1 ulp) and the corrections of the
# division's fast path stay normal; above it (1 / d near or below the smallest normal, or
# d = +inf) only div.rn itself gives the IEEE result.
FAST_RECIPROCAL_LIMIT = tl.constexpr(2.0**125)

# 512: every row is held in registers as keys plus fp32 scores; with the launch rule below a
# warp then holds one row of 16 keys per thread. Larger E needs a chunked selection.
MAX_EXPERTS = 512

# How DeepSeek-V3 narrows the selection to the kept groups (the ``COMPACT`` constexpr).
COMPACT_NONE = 0     # keep the full-row tile, dropped groups' keys set to NONE_KEY
COMPACT_GATHER = 1   # tl.gather the kept groups' keys into a [B, KEEP_PAD * GROUP_PAD] tile
COMPACT_RELOAD = 2   # re-read the kept groups' logits (cached) and rebuild their keys

# The argmax rounds (the ``KEYS`` constexpr); see the module docstring.
KEYS_PACKED64 = 0
KEYS_SPLIT32 = 1
KEYS_QUEUES = 2

# Where the weights' values come from (the ``WEIGHTS_FROM`` constexpr); see the module docstring.
WEIGHTS_RELOAD = 0
WEIGHTS_CARRY = 1
WEIGHTS_LOAD_EACH = 2

# How the sigmoid's IEEE division is done on a GPU (the ``RECIPROCAL`` constexpr).
RECIP_DIV_RN = 0     # div.rn: a check and a branch per value
RECIP_FMA = 1        # its fast path written out, branch-free; div.rn only for subnormal 1/d
RECIP_FMA_TILE = 2   # the same, with one check and branch for the whole tile (traced launches)

# How DeepSeek-V3 finds each group's two best keys (the ``GROUP_TOP2`` constexpr).
TOP2_COUNT = 0       # the max; then the copies of it and the max below it (two reductions)
TOP2_PAIRS = 1       # one reduction of (largest, second largest) pairs

# How DeepSeek-V3 keeps its groups (the ``GROUP_SELECT`` constexpr).
GROUP_ROUNDS = 0     # topk_groups rounds of argmax over the group keys
GROUP_COUNT = 1      # rank of each group = groups ranked above it, by one [G, G] compare


@checked_launch(positive=("elements_per_program", "target_programs"),
                powers_of_two=("rows_per_program",), warps=("num_warps",),
                choices={"compact": (COMPACT_NONE, COMPACT_GATHER, COMPACT_RELOAD),
                         "keys": (KEYS_PACKED64, KEYS_SPLIT32, KEYS_QUEUES),
                         "group_select": (GROUP_ROUNDS, GROUP_COUNT),
                         "weights_from": (WEIGHTS_RELOAD, WEIGHTS_CARRY, WEIGHTS_LOAD_EACH),
                         "reciprocal": (RECIP_DIV_RN, RECIP_FMA, RECIP_FMA_TILE),
                         "group_top2": (TOP2_COUNT, TOP2_PAIRS)})
class RoutingLaunch:
    """Launch rule of ``route_topk`` (``python -m bench.tune`` times the alternatives and
    records them in bench/results/tune-*.json).

    num_warps: warps per program. One, so that every per-row reduction (k rounds of them) stays
        inside a warp: with more, Triton's default layout splits a 256-wide row over several
        warps and every round then goes through shared memory and a barrier.
    elements_per_program: tokens x padded experts one program holds at most: 256 = 8 per lane,
        one DeepSeek-V3 row per warp, 2 rows of E=128.
    target_programs: rows per program grow (up to the element bound) only while the grid has
        more programs than this (about 8 per SM of an H200): small batches get one row per
        program, whose time is the latency of one program's serial chain of reductions.
    rows_per_program: a fixed power of two instead of the rule above (None: the rule).
    compact: how DeepSeek-V3 narrows the selection to the kept groups (``COMPACT_*``).
    keys: the form of the argmax rounds (``KEYS_SPLIT32``: two int32 warp reductions a round,
        each one instruction on sm_80+; ``KEYS_PACKED64``: one int64 reduction of 5 shuffle
        levels a round; ``KEYS_QUEUES``: the two int32 reductions over each lane's head of
        its sorted queues, where the launch has one warp and a tile of 128, 256 or 512
        columns of 32 lanes x whole 16-byte vectors, else ``KEYS_SPLIT32``).
    group_select: how DeepSeek-V3 keeps its groups (``GROUP_COUNT``: ranks by one compare of
        all group pairs; ``GROUP_ROUNDS``: topk_groups dependent rounds).
    weights_from: where the weights' values come from (``WEIGHTS_RELOAD``: one [B, k] load
        after the rounds; ``WEIGHTS_CARRY``: one more int32 warp reduction a round, which no
        round waits for; ``WEIGHTS_LOAD_EACH``: one load a round, issued as the round ends).
    reciprocal: the sigmoid's IEEE division on a GPU (``RECIP_DIV_RN``: div.rn, a branch per
        value; ``RECIP_FMA``: its fast path written out, div.rn only where a thread's
        denominators reach ``FAST_RECIPROCAL_LIMIT``; ``RECIP_FMA_TILE``: the same, div.rn for
        the whole tile where any of its denominators does; the same bits every way). A traced
        launch (the registered op under torch.compile) takes ``RECIP_FMA_TILE`` in place of
        ``RECIP_FMA``: Inductor cannot analyse the latter's ``tl.map_elementwise``.
    group_top2: how DeepSeek-V3 finds each group's two best keys (``TOP2_COUNT``: a max, then
        the copies of it and the max below it; ``TOP2_PAIRS``: one reduction of pairs).
    """

    num_warps: int = 1
    elements_per_program: int = 256
    target_programs: int = 1024
    rows_per_program: Optional[int] = None
    compact: int = COMPACT_NONE
    keys: int = KEYS_QUEUES
    group_select: int = GROUP_COUNT
    weights_from: int = WEIGHTS_RELOAD
    reciprocal: int = RECIP_FMA
    group_top2: int = TOP2_PAIRS


# The default: the sorted per-lane queues, the branch-free sigmoid division and the one-pass
# group top-2 together were the fastest form at every DeepSeek-V3 token count bench.tune times
# (its JSON in bench/results).
DEFAULT_ROUTING = RoutingLaunch()
# Earlier forms, kept so that bench.tune times them beside the default: the int32 rounds over
# whole rows with div.rn and the two-step group top-2, and the int64 rounds before them.
SPLIT32_ROUTING = RoutingLaunch(keys=KEYS_SPLIT32, reciprocal=RECIP_DIV_RN, group_top2=TOP2_COUNT)
PACKED64_ROUTING = RoutingLaunch(keys=KEYS_PACKED64, group_select=GROUP_ROUNDS,
                                 reciprocal=RECIP_DIV_RN, group_top2=TOP2_COUNT)


def default_launch() -> RoutingLaunch:
    """The launch of ``route_topk(launch=None)``: :data:`DEFAULT_ROUTING` with compiled Triton;
    :data:`SPLIT32_ROUTING` under Triton's interpreter, where the sorted queues and the
    written-out division cost the most interpreted operations (every launch gives the same
    bits, so only the time differs; an explicit ``launch`` is always taken as given)."""
    return SPLIT32_ROUTING if interpreting() else DEFAULT_ROUTING


# How the weights are formed (the ``WEIGHTS`` constexpr of the kernel).
SOFTMAX_ALL = 0      # softmax over all E logits, at the chosen ids
SOFTMAX_CHOSEN = 1   # softmax over the k chosen logits
SIGMOID = 2          # sigmoid of each chosen logit
SIGMOID_RENORM = 3   # sigmoid of each chosen logit / their sum
# softmax over the k chosen logits (= softmax over all E, renormalised over the chosen), NaN for
# the whole row when any of its E logits is NaN, as the full softmax is
SOFTMAX_RENORM = 4

# method -> (selection on sigmoid(logit) + bias?, weights)
_METHODS = {
    "softmax_topk": (False, SOFTMAX_ALL),
    "softmax_topk_renorm": (False, SOFTMAX_RENORM),
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
def _rcp_approx(d):
    """MUFU.RCP: the hardware's approximate reciprocal (subnormal results flushed to 0)."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _div_rn_if_large1(d, q):
    """The reciprocal ``q`` of ``d``, redone by div.rn if ``d`` exceeds
    ``FAST_RECIPROCAL_LIMIT`` (a rarely taken branch)."""
    if d > FAST_RECIPROCAL_LIMIT:
        q = tl.math.div_rn(1.0, d)
    return q


@triton.jit
def _div_rn_if_large4(d0, d1, d2, d3, q0, q1, q2, q3):
    """:func:`_div_rn_if_large1` for four of a thread's values: one branch for all four."""
    if tl.maximum(tl.maximum(d0, d1), tl.maximum(d2, d3)) > FAST_RECIPROCAL_LIMIT:
        q0 = tl.math.div_rn(1.0, d0)
        q1 = tl.math.div_rn(1.0, d1)
        q2 = tl.math.div_rn(1.0, d2)
        q3 = tl.math.div_rn(1.0, d3)
    return q0, q1, q2, q3


@triton.jit
def _div_rn_if_large8(d0, d1, d2, d3, d4, d5, d6, d7, q0, q1, q2, q3, q4, q5, q6, q7):
    """:func:`_div_rn_if_large4` for eight values."""
    if tl.maximum(tl.maximum(tl.maximum(d0, d1), tl.maximum(d2, d3)),
                  tl.maximum(tl.maximum(d4, d5), tl.maximum(d6, d7))) > FAST_RECIPROCAL_LIMIT:
        q0 = tl.math.div_rn(1.0, d0)
        q1 = tl.math.div_rn(1.0, d1)
        q2 = tl.math.div_rn(1.0, d2)
        q3 = tl.math.div_rn(1.0, d3)
        q4 = tl.math.div_rn(1.0, d4)
        q5 = tl.math.div_rn(1.0, d5)
        q6 = tl.math.div_rn(1.0, d6)
        q7 = tl.math.div_rn(1.0, d7)
    return q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _reciprocal(d, RECIPROCAL: tl.constexpr, PACK: tl.constexpr):
    """1 / d rounded to nearest (div.rn's result bits) for d >= 1 or NaN, the denominator of the
    sigmoid. ``RECIP_DIV_RN``: div.rn itself, whose fast path ptxas follows by a check and a
    branch per value, so that a thread's values are divided one after the other.
    ``RECIP_FMA``: the same fast path written out (MUFU.RCP, one Newton step, then the
    quotient's correction: the instructions, and so the bits, of div.rn wherever its range
    check passes), for all of a thread's values without a branch, and div.rn itself where a
    ``d`` exceeds ``FAST_RECIPROCAL_LIMIT`` (``_div_rn_if_large*``). ``PACK``: a thread's
    values per such check (8, 4 or 1: ``_values_per_check``; 0: none, the caller checks).
    ``RECIP_FMA_TILE``: the written-out fast path, and div.rn for the whole tile where any
    ``d`` of it exceeds the limit (one reduction and one uniform branch): the launches that
    Inductor compiles take it, since its analysis of which arguments a kernel writes cannot
    read tl.map_elementwise but reads an ``if``."""
    if RECIPROCAL == 1 or RECIPROCAL == 2:  # RECIP_FMA, RECIP_FMA_TILE
        y = _rcp_approx(d)
        y = tl.fma(y, tl.fma(-d, y, 1.0), y)
        q = tl.fma(y, tl.fma(-d, y, 1.0), y)
        if RECIPROCAL == 2:
            # (a count, not a max: a NaN d compares false and hides no other value)
            large = tl.sum(tl.reshape(d > FAST_RECIPROCAL_LIMIT, [d.numel]).to(tl.int32),
                           axis=0)
            if large > 0:
                q = tl.math.div_rn(tl.zeros_like(d) + 1.0, d)
        elif PACK == 8:
            q = tl.map_elementwise(_div_rn_if_large8, d, q, pack=8)[0]
        elif PACK == 4:
            q = tl.map_elementwise(_div_rn_if_large4, d, q, pack=4)[0]
        elif PACK == 1:
            q = tl.map_elementwise(_div_rn_if_large1, d, q)
        return q
    else:
        return tl.math.div_rn(tl.zeros_like(d) + 1.0, d)


@triton.jit
def _sigmoid(x, PRECISE_MATH: tl.constexpr, RECIPROCAL: tl.constexpr = 0,
             PACK: tl.constexpr = 1):
    # 1 / (1 + exp(-x)) with an IEEE division (Triton's "/" is approximate for fp32), the
    # formula of the oracle's _sigmoid. (libdevice.rcp_rn(d) gives the same fp32 and was timed
    # no faster on an H200.)
    denominator = 1.0 + _exp(-x, PRECISE_MATH)
    if PRECISE_MATH:
        return _reciprocal(denominator, RECIPROCAL, PACK)
    else:  # the interpreter: numpy's IEEE division
        return tl.math.div_rn(tl.zeros_like(denominator) + 1.0, denominator)


@triton.jit
def _sigmoid_values(x, PRECISE_MATH: tl.constexpr, RECIPROCAL: tl.constexpr):
    """:func:`_sigmoid` of each tensor of the tuple ``x``; ``RECIP_FMA`` checks eight of them
    for a subnormal reciprocal by one branch (the tensors are [B], one value per thread)."""
    if PRECISE_MATH and RECIPROCAL == 1:  # RECIP_FMA
        ones = tl.full(x[0].shape, 1.0, tl.float32)
        d = ()
        for j in tl.static_range(len(x)):
            d = d + (1.0 + _exp(-x[j], PRECISE_MATH),)
        for _ in tl.static_range((8 - len(x) % 8) % 8):
            d = d + (ones,)
        q = ()
        for j in tl.static_range(len(d)):
            q = q + (_reciprocal(d[j], RECIPROCAL, 0),)
        result = ()
        for c in tl.static_range(len(d) // 8):
            result = result + tl.map_elementwise(
                _div_rn_if_large8, d[8 * c], d[8 * c + 1], d[8 * c + 2], d[8 * c + 3],
                d[8 * c + 4], d[8 * c + 5], d[8 * c + 6], d[8 * c + 7], q[8 * c], q[8 * c + 1],
                q[8 * c + 2], q[8 * c + 3], q[8 * c + 4], q[8 * c + 5], q[8 * c + 6],
                q[8 * c + 7])
        return result[:len(x)]
    else:
        result = ()
        for j in tl.static_range(len(x)):
            result = result + (_sigmoid(x[j], PRECISE_MATH, RECIPROCAL),)
        return result


@triton.jit
def _bits_key(value):
    """int32 whose signed order is the order of the fp32 ``value``s; a bijection, so
    :func:`_key_value` gives every bit back (NaN payloads and -0.0 included)."""
    bits = value.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits


@triton.jit
def _key_value(key):
    """The fp32 of a :func:`_bits_key` (the map is its own inverse); ``NAN_KEY`` and
    ``NONE_KEY`` give NaNs."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _ordered(score):
    """The selection key of an fp32 score: -0.0 ties +0.0, every NaN is ``NAN_KEY``."""
    key = _bits_key(tl.where(score == 0.0, 0.0, score))
    return tl.where(score != score, NAN_KEY, key)


@triton.jit
def _has_nan(x):
    """[B] bool: the row of ``x`` [B, C] holds a NaN."""
    return tl.max((x != x).to(tl.int32), axis=1) > 0


@triton.jit
def _canonical_nan(weights):
    """``weights`` with every NaN replaced by the one pattern ``NAN_WEIGHT``."""
    nan = tl.full(weights.shape, NAN_WEIGHT, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(weights != weights, nan, weights)


@triton.jit
def _take_best(keys, ids):
    """One round of argmax per row: the id of the best key (ties to the smaller id) and a mask
    of the entries holding that id. ``ids`` broadcasts against ``keys`` [B, C]."""
    best = tl.max(keys, axis=1)                                                  # [B]
    chosen = tl.min(tl.where(keys == best[:, None], ids, NO_ID), axis=1)         # [B]
    return chosen, ids == chosen[:, None]


@triton.jit
def _top2(first_a, second_a, first_b, second_b):
    """The two largest of the multiset union of two (largest, second largest) pairs."""
    return (tl.maximum(first_a, first_b),
            tl.maximum(tl.minimum(first_a, first_b), tl.maximum(second_a, second_b)))


@triton.jit
def _pack(keys, ids):
    """int64 keys whose signed order is (key, then smaller id): see the module docstring."""
    # Tensor first: ``constexpr - tensor`` fails in the interpreter.
    return (keys.to(tl.int64) << 32) | (-ids + ID_LIMIT).to(tl.int64)


@triton.jit
def _lane_queues(x, BLOCK_TOKENS: tl.constexpr, COLUMNS: tl.constexpr, VECTOR: tl.constexpr):
    """The tile ``x`` [B, C] of a one-warp program as what each lane holds: a tuple of C // 32
    tensors [B, 32], element [b, l] of tensor ``q * 4 + j`` being value j of lane l's queue q,
    column ``(q // (V // 4)) * 32 * V + l * V + (q % (V // 4)) * 4 + j`` (V = ``VECTOR``, the
    contiguous columns per thread of the tile's layout: these reshapes, the permutes and the
    splits move no data)."""
    PER_LANE: tl.constexpr = COLUMNS // 32
    y = tl.reshape(x, [BLOCK_TOKENS, COLUMNS // (32 * VECTOR), 32, VECTOR])
    y = tl.permute(y, (0, 2, 1, 3))
    # One axis of 2 per bit of the index q * 4 + j, the highest bit last: splitting it first
    # leaves the tensors in index order.
    if PER_LANE == 4:
        y = tl.permute(tl.reshape(y, [BLOCK_TOKENS, 32, 2, 2]), (0, 1, 3, 2))
    elif PER_LANE == 8:
        y = tl.permute(tl.reshape(y, [BLOCK_TOKENS, 32, 2, 2, 2]), (0, 1, 4, 3, 2))
    else:
        tl.static_assert(PER_LANE == 16, "a lane holds 4, 8 or 16 columns")
        y = tl.permute(tl.reshape(y, [BLOCK_TOKENS, 32, 2, 2, 2, 2]), (0, 1, 5, 4, 3, 2))
    parts = (y,)
    LEVELS: tl.constexpr = 2 if PER_LANE == 4 else 3 if PER_LANE == 8 else 4
    for _ in tl.static_range(LEVELS):
        halves = ()
        for p in tl.static_range(len(parts)):
            low, high = tl.split(parts[p])
            halves = halves + (low, high)
        parts = halves
    return parts


@triton.jit
def _before(key_a, id_a, key_b, id_b):
    """a precedes b in the selection order (larger key, then smaller id)."""
    return (key_a > key_b) | ((key_a == key_b) & (id_a < id_b))


@triton.jit
def _sort_queues(keys, ids, ORDERED: tl.constexpr):
    """Each queue of 4 (``_lane_queues``' tuples) sorted into the selection order, by the
    network (0, 1) (2, 3), (0, 2) (1, 3), (1, 2). ``ORDERED``: the ids of a queue increase
    along it, so that the first level compares keys only."""
    sorted_keys = ()
    sorted_ids = ()
    for q in tl.static_range(len(keys) // 4):
        k0, k1, k2, k3 = keys[4 * q], keys[4 * q + 1], keys[4 * q + 2], keys[4 * q + 3]
        i0, i1, i2, i3 = ids[4 * q], ids[4 * q + 1], ids[4 * q + 2], ids[4 * q + 3]
        if ORDERED:
            swap01 = k1 > k0
            swap23 = k3 > k2
        else:
            swap01 = _before(k1, i1, k0, i0)
            swap23 = _before(k3, i3, k2, i2)
        k0, k1 = tl.where(swap01, k1, k0), tl.where(swap01, k0, k1)
        i0, i1 = tl.where(swap01, i1, i0), tl.where(swap01, i0, i1)
        k2, k3 = tl.where(swap23, k3, k2), tl.where(swap23, k2, k3)
        i2, i3 = tl.where(swap23, i3, i2), tl.where(swap23, i2, i3)
        swap02 = _before(k2, i2, k0, i0)
        swap13 = _before(k3, i3, k1, i1)
        k0, k2 = tl.where(swap02, k2, k0), tl.where(swap02, k0, k2)
        i0, i2 = tl.where(swap02, i2, i0), tl.where(swap02, i0, i2)
        k1, k3 = tl.where(swap13, k3, k1), tl.where(swap13, k1, k3)
        i1, i3 = tl.where(swap13, i3, i1), tl.where(swap13, i1, i3)
        swap12 = _before(k2, i2, k1, i1)
        k1, k2 = tl.where(swap12, k2, k1), tl.where(swap12, k1, k2)
        i1, i2 = tl.where(swap12, i2, i1), tl.where(swap12, i1, i2)
        sorted_keys = sorted_keys + (k0, k1, k2, k3)
        sorted_ids = sorted_ids + (i0, i1, i2, i3)
    return sorted_keys, sorted_ids


@triton.jit
def _queues_take_best(keys, ids, ORDERED: tl.constexpr):
    """One round of argmax over sorted queues: the chosen id [B] (as ``_take_best``) from the
    queues' heads only, and the queues with the chosen head popped (the values behind it move
    up; ``NONE_KEY`` enters at the back). ``ORDERED``: a lane's queues hold increasing ids, so
    that equal heads go to the earlier queue without comparing ids."""
    head_key = keys[0]
    head_id = ids[0]
    for q in tl.static_range(1, len(keys) // 4):
        if ORDERED:
            better = keys[4 * q] > head_key
        else:
            better = _before(keys[4 * q], ids[4 * q], head_key, head_id)
        head_key = tl.where(better, keys[4 * q], head_key)
        head_id = tl.where(better, ids[4 * q], head_id)
    chosen, _ = _take_best(head_key, head_id)
    popped_keys = ()
    popped_ids = ()
    for q in tl.static_range(len(keys) // 4):
        pop = ids[4 * q] == chosen[:, None]
        for p in tl.static_range(3):
            popped_keys = popped_keys + (tl.where(pop, keys[4 * q + p + 1], keys[4 * q + p]),)
            popped_ids = popped_ids + (tl.where(pop, ids[4 * q + p + 1], ids[4 * q + p]),)
        popped_keys = popped_keys + (tl.where(pop, NONE_KEY, keys[4 * q + 3]),)
        popped_ids = popped_ids + (ids[4 * q + 3],)
    return chosen, popped_keys, popped_ids


@triton.jit
def _route_topk_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr,
    num_tokens, stride_token, stride_expert, routed_scaling,
    EXPERTS_PER_GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    KEEP_PAD: tl.constexpr, COMPACT: tl.constexpr, KEYS: tl.constexpr,
    GROUP_SELECT: tl.constexpr, WEIGHTS_FROM: tl.constexpr,
    SELECT_BIASED_SIGMOID: tl.constexpr, WEIGHTS: tl.constexpr, PRECISE_MATH: tl.constexpr,
    RECIPROCAL: tl.constexpr, SIGMOID_PACK: tl.constexpr, COMPACT_PACK: tl.constexpr,
    VECTOR: tl.constexpr, GROUP_TOP2: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency_prologue(PDL)
    KEY64_NONE: tl.constexpr = -(2**63)  # below every packed key

    rows = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    row_ok = rows < num_tokens
    # Rows past the end re-read the last token (never stored).
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

    # value: what the weights are made of (DeepSeek-V3: the unbiased sigmoid; else the logit)
    if SELECT_BIASED_SIGMOID:
        bias = tl.load(bias_ptr + expert, mask=expert_ok, other=0.0)
        logit = x
        if RECIPROCAL == 1 and (NUM_GROUPS < GROUPS_PAD or EXPERTS_PER_GROUP < GROUP_PAD):
            # padding: 0, not -inf (an infinite denominator would take the div.rn branch)
            logit = tl.where(expert_ok[None, :], x, 0.0)
        value = _sigmoid(logit, PRECISE_MATH, RECIPROCAL, SIGMOID_PACK)
        score = value + bias[None, :]
    else:
        value = x
        score = x
    keys = tl.where(expert_ok[None, :], _ordered(score), NONE_KEY)                # [B, C]
    ids_of = expert[None, :]                  # the expert of each column (per row once compact)
    if WEIGHTS_FROM == 1:  # WEIGHTS_CARRY
        values = tl.where(expert_ok[None, :], _bits_key(value), NONE_KEY)

    if TOPK_GROUPS < NUM_GROUPS:
        # Group score = the sum of the group's two best biased scores; the second best is the
        # best again when it occurs twice (one copy is removed, as the oracle's sort does).
        keys3 = tl.reshape(keys, [BLOCK_TOKENS, GROUPS_PAD, GROUP_PAD])
        if GROUP_TOP2 == 1:  # TOP2_PAIRS
            first, second = tl.reduce((keys3, tl.full(keys3.shape, NONE_KEY, tl.int32)), 2,
                                      _top2)                                     # [B, G]
        else:  # TOP2_COUNT
            first = tl.max(keys3, axis=2)                                        # [B, G]
            is_first = keys3 == first[:, :, None]
            copies = tl.sum(is_first.to(tl.int32), axis=2)
            below = tl.max(tl.where(is_first, NONE_KEY, keys3), axis=2)
            second = tl.where(copies >= 2, first, below)
        groups = tl.arange(0, GROUPS_PAD)[None, :]                               # [1, G]
        group_keys = tl.where(groups < NUM_GROUPS,
                              _ordered(_key_value(first) + _key_value(second)), NONE_KEY)
        # group_rank[b, g] < TOPK_GROUPS: g is kept, the group_rank-th best of its row.
        if GROUP_SELECT == 1:  # GROUP_COUNT
            other = group_keys[:, None, :]                                       # [B, 1, G]
            this = group_keys[:, :, None]                                        # [B, G, 1]
            other_index = tl.arange(0, GROUPS_PAD)[None, None, :]
            this_index = tl.arange(0, GROUPS_PAD)[None, :, None]
            above = (other > this) | ((other == this) & (other_index < this_index))
            group_rank = tl.sum(above.to(tl.int32), axis=2)                      # [B, G]
        else:  # GROUP_ROUNDS
            group_rank = tl.full([BLOCK_TOKENS, GROUPS_PAD], GROUPS_PAD, tl.int32)
            if KEYS != 0:  # KEYS_SPLIT32, KEYS_QUEUES
                for r in tl.static_range(TOPK_GROUPS):
                    _, taken = _take_best(group_keys, groups)
                    group_rank = tl.where(taken, r, group_rank)
                    group_keys = tl.where(taken, NONE_KEY, group_keys)
            else:
                packed_groups = _pack(group_keys, groups)
                for r in tl.static_range(TOPK_GROUPS):
                    best_group = tl.max(packed_groups, axis=1)
                    taken = packed_groups == best_group[:, None]
                    group_rank = tl.where(taken, r, group_rank)
                    packed_groups = tl.where(taken, KEY64_NONE, packed_groups)
        if COMPACT == 0:  # COMPACT_NONE
            kept = group_rank < TOPK_GROUPS
            kept3 = tl.broadcast_to(kept[:, :, None], [BLOCK_TOKENS, GROUPS_PAD, GROUP_PAD])
            kept_columns = tl.reshape(kept3, [BLOCK_TOKENS, GROUPS_PAD * GROUP_PAD])
            unmasked_keys = keys
            keys = tl.where(kept_columns, keys, NONE_KEY)
        else:
            # Column s * GROUP_PAD + j of the compact tile is slot j of the s-th kept group.
            compact_columns = tl.arange(0, KEEP_PAD * GROUP_PAD)
            compact_rank = compact_columns // GROUP_PAD
            compact_slot = compact_columns % GROUP_PAD
            compact_group = tl.zeros([BLOCK_TOKENS, KEEP_PAD * GROUP_PAD], dtype=tl.int32)
            for r in tl.static_range(TOPK_GROUPS):
                group_id = tl.sum(tl.where(group_rank == r, groups, 0), axis=1)      # [B]
                compact_group = tl.where(compact_rank[None, :] == r, group_id[:, None],
                                         compact_group)
            compact_ok = ((compact_rank < TOPK_GROUPS)
                          & (compact_slot < EXPERTS_PER_GROUP))[None, :]          # [1, C']
            ids_of = compact_group * EXPERTS_PER_GROUP + compact_slot[None, :]       # [B, C']
            if COMPACT == 1:  # COMPACT_GATHER
                source = compact_group * GROUP_PAD + compact_slot[None, :]
                keys = tl.where(compact_ok, tl.gather(keys, source, axis=1), NONE_KEY)
                if WEIGHTS_FROM == 1:
                    values = tl.where(compact_ok, tl.gather(values, source, axis=1), NONE_KEY)
            else:  # COMPACT_RELOAD
                x2 = tl.load(row_base[:, None] + ids_of * stride_expert, mask=compact_ok,
                             other=float("-inf")).to(tl.float32)
                bias2 = tl.load(bias_ptr + ids_of, mask=compact_ok, other=0.0)
                value2 = _sigmoid(x2, PRECISE_MATH, RECIPROCAL, COMPACT_PACK)
                keys = tl.where(compact_ok, _ordered(value2 + bias2), NONE_KEY)
                if WEIGHTS_FROM == 1:
                    values = tl.where(compact_ok, _bits_key(value2), NONE_KEY)

    # k rounds of argmax: the j-th round's chosen is the j-th best expert of each row.
    slots = tl.arange(0, K_PAD)[None, :]                                         # [1, K]
    slot_ok = slots < TOP_K
    out = rows.to(tl.int64) * TOP_K                                              # [B]
    ids = tl.zeros([BLOCK_TOKENS, K_PAD], dtype=tl.int32)
    chosen_values = ()     # WEIGHTS_FROM != 0: per slot, the chosen experts' values [B]
    if KEYS == 0:  # KEYS_PACKED64
        packed = _pack(keys, ids_of)
    if KEYS == 2:  # KEYS_QUEUES
        SCAN_COLUMNS: tl.constexpr = keys.shape[1]
        # A queue lies inside one group where groups are padded to a multiple of 4 columns:
        # it is then sorted before the groups are kept (off their chain of reductions) and
        # only its head is masked once its group is dropped (what lies behind a masked head
        # is never reached). Otherwise the queues are built from the masked keys.
        HEAD_MASK: tl.constexpr = (TOPK_GROUPS < NUM_GROUPS) and (COMPACT == 0) and (
            GROUP_PAD % 4 == 0)
        # The ids of a lane's queues increase along them, and from one queue to the next
        # (the compact tile holds its groups in rank order: only the former).
        ALONG: tl.constexpr = (TOPK_GROUPS == NUM_GROUPS) or (GROUP_PAD % 4 == 0)
        ACROSS: tl.constexpr = (TOPK_GROUPS == NUM_GROUPS) or (COMPACT == 0)
        all_ids = tl.broadcast_to(ids_of, [BLOCK_TOKENS, SCAN_COLUMNS])
        queue_ids = _lane_queues(all_ids, BLOCK_TOKENS, SCAN_COLUMNS, VECTOR)
        if HEAD_MASK:
            queue_keys = _lane_queues(unmasked_keys, BLOCK_TOKENS, SCAN_COLUMNS, VECTOR)
        else:
            queue_keys = _lane_queues(keys, BLOCK_TOKENS, SCAN_COLUMNS, VECTOR)
        queue_keys, queue_ids = _sort_queues(queue_keys, queue_ids, ALONG)
        if HEAD_MASK:
            queue_kept = _lane_queues(kept_columns, BLOCK_TOKENS, SCAN_COLUMNS, VECTOR)
            masked = ()
            for q in tl.static_range(SCAN_COLUMNS // 128):
                masked = masked + (tl.where(queue_kept[4 * q], queue_keys[4 * q], NONE_KEY),
                                   queue_keys[4 * q + 1], queue_keys[4 * q + 2],
                                   queue_keys[4 * q + 3])
            queue_keys = masked
    for j in tl.static_range(TOP_K):
        if KEYS == 1:  # KEYS_SPLIT32
            chosen, taken = _take_best(keys, ids_of)
            keys = tl.where(taken, NONE_KEY, keys)
        elif KEYS == 2:  # KEYS_QUEUES
            chosen, queue_keys, queue_ids = _queues_take_best(queue_keys, queue_ids, ACROSS)
            taken = ids_of == chosen[:, None]
        else:
            best = tl.max(packed, axis=1)                                        # [B]
            # Packed keys are unique per row in their low word (ID_LIMIT - id; KEY64_NONE's is
            # 0, which no id gives): one 32-bit compare finds the chosen entry.
            taken = packed.to(tl.int32) == best.to(tl.int32)[:, None]
            packed = tl.where(taken, KEY64_NONE, packed)
            chosen = -(best & 0xFFFF).to(tl.int32) + ID_LIMIT
        if WEIGHTS_FROM == 0:  # WEIGHTS_RELOAD
            ids = tl.where(slots == j, chosen[:, None], ids)
        else:
            tl.store(ids_ptr + out + j, chosen, mask=row_ok)
            if WEIGHTS_FROM == 1:  # WEIGHTS_CARRY
                # (padding that shares the chosen id holds NONE_KEY: the max is the chosen's)
                carried = tl.max(tl.where(taken, values, NONE_KEY), axis=1)
                chosen_values = chosen_values + (_key_value(carried),)
            else:  # WEIGHTS_LOAD_EACH: issued now, waited for after the rounds
                loaded = tl.load(row_base + chosen * stride_expert).to(tl.float32)
                chosen_values = chosen_values + (loaded,)

    if WEIGHTS_FROM == 0:
        chosen_x = tl.load(row_base[:, None] + ids * stride_expert, mask=slot_ok,
                           other=float("-inf")).to(tl.float32)                   # [B, K]
        if WEIGHTS == 0:  # SOFTMAX_ALL
            row_max = tl.max(x, axis=1)
            total = tl.sum(_exp(x - row_max[:, None], PRECISE_MATH), axis=1)
            weights = _exp(chosen_x - row_max[:, None], PRECISE_MATH) / total[:, None]
        elif WEIGHTS == 1 or WEIGHTS == 4:  # SOFTMAX_CHOSEN, SOFTMAX_RENORM
            row_max = tl.max(chosen_x, axis=1)
            numerator = tl.where(slot_ok, _exp(chosen_x - row_max[:, None], PRECISE_MATH), 0.0)
            weights = numerator / tl.sum(numerator, axis=1)[:, None]
        elif WEIGHTS == 2:  # SIGMOID
            weights = _sigmoid(chosen_x, PRECISE_MATH, RECIPROCAL)
        else:  # SIGMOID_RENORM
            numerator = tl.where(slot_ok, _sigmoid(chosen_x, PRECISE_MATH, RECIPROCAL), 0.0)
            weights = numerator / tl.sum(numerator, axis=1)[:, None]
        if WEIGHTS == 4:
            weights = tl.where(_has_nan(x)[:, None], float("nan"), weights)
        weights = _canonical_nan(weights * routed_scaling)
        out_ok = row_ok[:, None] & slot_ok
        tl.store(ids_ptr + out[:, None] + slots, ids, mask=out_ok)
        tl.store(weights_ptr + out[:, None] + slots, weights, mask=out_ok)
    else:
        # The same formulas on the k values of each row, slot by slot ([B] each).
        numerators = ()
        if WEIGHTS == 0:  # SOFTMAX_ALL
            row_max = tl.max(x, axis=1)
            total = tl.sum(_exp(x - row_max[:, None], PRECISE_MATH), axis=1)
            for j in tl.static_range(TOP_K):
                numerators = numerators + (_exp(chosen_values[j] - row_max, PRECISE_MATH),)
        elif WEIGHTS == 1 or WEIGHTS == 4:  # SOFTMAX_CHOSEN, SOFTMAX_RENORM
            row_max = chosen_values[0]
            for j in tl.static_range(1, TOP_K):
                row_max = tl.maximum(row_max, chosen_values[j])
            total = tl.zeros_like(row_max)
            for j in tl.static_range(TOP_K):
                numerators = numerators + (_exp(chosen_values[j] - row_max, PRECISE_MATH),)
                total += numerators[j]
        else:  # SIGMOID, SIGMOID_RENORM
            if SELECT_BIASED_SIGMOID and WEIGHTS_FROM == 1:  # carried: the sigmoid
                numerators = chosen_values
            else:
                numerators = _sigmoid_values(chosen_values, PRECISE_MATH, RECIPROCAL)
            total = tl.zeros_like(chosen_values[0])
            for j in tl.static_range(TOP_K):
                total += numerators[j]
        row_nan = _has_nan(x) if WEIGHTS == 4 else None
        for j in tl.static_range(TOP_K):
            if WEIGHTS == 2:  # SIGMOID
                weight = numerators[j]
            else:
                weight = numerators[j] / total
            if WEIGHTS == 4:
                weight = tl.where(row_nan, float("nan"), weight)
            tl.store(weights_ptr + out + j, _canonical_nan(weight * routed_scaling),
                     mask=row_ok)


def tokens_per_program(num_tokens: int, row_elements: int, launch: RoutingLaunch) -> int:
    """Rows per program: ``launch.rows_per_program``, else the rule: one row per program until
    the grid has more than ``target_programs`` programs, then twice as many rows per step (a
    power of two) while the tile stays within ``elements_per_program`` (``row_elements`` per
    row). Written as a loop of comparisons on T (not a power of two of a size), so that a traced
    T only adds a guard per doubling: one compiled kernel per T range, none below
    ``target_programs`` tokens (DeepSeek-V3's 256-wide row never doubles)."""
    if launch.rows_per_program is not None:
        return launch.rows_per_program
    cap = max(1, launch.elements_per_program // row_elements)
    rows = 1
    while rows * 2 <= cap and num_tokens > rows * launch.target_programs:
        rows *= 2
    return rows


def _values_per_check(tile_elements: int, num_warps: int) -> int:
    """``RECIP_FMA``'s values per subnormal check: 8 or 4 where each thread of the program holds
    that many of its [B, C] tile (powers of two, spread evenly), else 1."""
    per_thread = tile_elements // (32 * num_warps)
    return 8 if per_thread >= 8 else 4 if per_thread >= 4 else 1


def _launch(logits: torch.Tensor, top_k: int, method: str, bias, num_groups: int,
            topk_groups: int, routed_scaling: float, launch: RoutingLaunch, traced: bool):
    """Allocate the outputs and launch the kernel on checked arguments (``num_groups`` and
    ``topk_groups`` already filled in by ``check_routing_args``); ``traced``: launch through
    ``wrap_triton`` (the op's body), else the kernel itself."""
    num_tokens, num_experts = logits.shape
    # E is static: a traced E is specialised here, before the launch constants are taken from
    # it (next_power_of_2 of a symbolic size builds expressions sympy takes minutes on)
    num_experts = int(num_experts)
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
    groups_pad = next_power_of_2(groups)
    group_pad = next_power_of_2(experts_per_group)
    rows_per_program = tokens_per_program(num_tokens, groups_pad * group_pad, launch)
    grid = (cdiv(num_tokens, rows_per_program),)
    keep_pad = next_power_of_2(topk_groups) if grouped else 1
    compact = launch.compact if grouped else COMPACT_NONE
    # KEYS_QUEUES: one warp whose lanes each hold whole queues of 4 (16-byte vectors of the
    # logits' dtype); other launches take the KEYS_SPLIT32 rounds.
    vector = 16 // logits.element_size()
    scan_columns = (keep_pad if compact != COMPACT_NONE else groups_pad) * group_pad
    keys = launch.keys
    if keys == KEYS_QUEUES and (launch.num_warps != 1 or scan_columns % (32 * vector)
                                or scan_columns > 512):
        keys = KEYS_SPLIT32
    kernel = wrap_triton(_route_topk_kernel) if traced else _route_topk_kernel
    # Traced (Inductor compiles the kernel): the written-out fast path with one check per tile
    # instead of tl.map_elementwise's per thread, the same bits. Inductor's analysis of which
    # arguments a user kernel writes cannot read tl.map_elementwise (RECIP_FMA's rare-case
    # branch); it would then take every argument as written and copy the inputs around the
    # kernel.
    reciprocal = (RECIP_FMA_TILE if traced and launch.reciprocal == RECIP_FMA
                  else launch.reciprocal)
    kernel[grid](
        logits, bias, ids, weights,
        num_tokens, logits.stride(0), logits.stride(1), float(routed_scaling),
        EXPERTS_PER_GROUP=experts_per_group, NUM_GROUPS=groups,
        TOPK_GROUPS=topk_groups if grouped else 1,
        GROUPS_PAD=groups_pad, GROUP_PAD=group_pad,
        TOP_K=top_k, K_PAD=max(2, next_power_of_2(top_k)), BLOCK_TOKENS=rows_per_program,
        KEEP_PAD=keep_pad,
        COMPACT=compact, KEYS=keys,
        GROUP_SELECT=launch.group_select if grouped else GROUP_ROUNDS,
        WEIGHTS_FROM=launch.weights_from,
        SELECT_BIASED_SIGMOID=select_biased, WEIGHTS=weight_rule,
        PRECISE_MATH=not interpreting(), RECIPROCAL=reciprocal,
        SIGMOID_PACK=_values_per_check(rows_per_program * groups_pad * group_pad,
                                       launch.num_warps),
        COMPACT_PACK=_values_per_check(rows_per_program * keep_pad * group_pad, launch.num_warps),
        VECTOR=vector, GROUP_TOP2=launch.group_top2,
        num_warps=launch.num_warps, **grid_dependency(logits.device, traced),
    )
    return ids, weights


def _check_route(logits, top_k, method, bias, num_groups, topk_groups, routed_scaling):
    """The shared checks plus the kernel's limit on E; returns (num_groups, topk_groups)."""
    num_groups, topk_groups = check_routing_args(logits, top_k, method, bias, num_groups,
                                                 topk_groups, routed_scaling)
    if logits.shape[1] > MAX_EXPERTS:
        raise ValueError(f"logits have {logits.shape[1]} experts; the Triton routing kernel "
                         f"holds a row in registers and takes E <= {MAX_EXPERTS} "
                         f"(use backend='torch')")
    return num_groups, topk_groups


def _route_topk_face(traced: bool):
    def route_topk_op(logits: torch.Tensor, top_k: int, method: str, bias: Optional[torch.Tensor],
                      num_groups: Optional[int], topk_groups: Optional[int],
                      routed_scaling: float, num_warps: int,
                      elements_per_program: int, target_programs: int,
                      rows_per_program: Optional[int], compact: int, keys: int,
                      group_select: int, weights_from: int, reciprocal: int,
                      group_top2: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``moe_a2a::route_topk``: the routing arguments, then the fields of
        :class:`RoutingLaunch` -> (topk_ids [T, k] int32, topk_weights [T, k] fp32)."""
        num_groups, topk_groups = _check_route(logits, top_k, method, bias, num_groups,
                                               topk_groups, routed_scaling)
        launch = RoutingLaunch(num_warps, elements_per_program, target_programs,
                               rows_per_program, compact, keys, group_select, weights_from,
                               reciprocal, group_top2)
        return _launch(logits, top_k, method, bias, num_groups, topk_groups, routed_scaling,
                       launch, traced)
    library.check_config_parameters(route_topk_op, RoutingLaunch)
    return route_topk_op


def _route_topk_torch(logits: torch.Tensor, top_k: int, method: str,
                      bias: Optional[torch.Tensor], num_groups: Optional[int],
                      topk_groups: Optional[int],
                      routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = reference.route_topk(logits, top_k, method, bias=bias, num_groups=num_groups,
                                        topk_groups=topk_groups, routed_scaling=routed_scaling)
    # dense row-major strides, as the Triton face's and the fake's (the oracle's ids may be a
    # view of its [T, E] sort, which .contiguous() keeps as it is when T == 1)
    return (ids.clone(memory_format=torch.contiguous_format),
            weights.clone(memory_format=torch.contiguous_format))


def _route_topk_fake(logits, top_k, method, bias, num_groups, topk_groups, routed_scaling,
                     *launch_fields):
    num_tokens = logits.shape[0]
    return (logits.new_empty((num_tokens, top_k), dtype=torch.int32),
            logits.new_empty((num_tokens, top_k), dtype=torch.float32))


ROUTE_TOPK = library.register("route_topk", triton=_route_topk_face(True),
                              launch=_route_topk_face(False), torch_face=_route_topk_torch,
                              fake=_route_topk_fake)


def route_topk(logits: torch.Tensor, top_k: int, method: str, *, bias=None, num_groups=None,
               topk_groups=None, routed_scaling: float = 1.0,
               launch: Optional[RoutingLaunch] = None):
    """Top-k expert routing (Triton). Same contract as ``kernels.reference.route_topk``.

    Args:
        logits: [T, E] float32, bfloat16 or float16, the router logits; E <= 512; any strides.
        top_k: k, experts per token, 1 <= k <= min(E, 32).
        method: one of ``kernels.spec.ROUTING_METHODS``.
        bias: [E] float32, DeepSeek-V3's selection bias; required for ``deepseek_v3`` only.
        num_groups: DeepSeek-V3 expert groups (divides E); default 1.
        topk_groups: DeepSeek-V3 groups kept per token; default ``num_groups`` (all).
        routed_scaling: factor applied to every weight.
        launch: the launch rule (:class:`RoutingLaunch`); None: :func:`default_launch`.

    Returns:
        topk_ids: [T, k] int32, expert ids in descending selection score (NaN lowest), ties
            to the smaller id (identical to the oracle's).
        topk_weights: [T, k] float32, the weight of each chosen expert; a NaN is stored as
            ``kernels.spec.routing.NAN_WEIGHT_BITS``.

    No host synchronisation: safe to capture in a CUDA graph. Runs the registered op
    ``moe_a2a::route_topk.triton`` (directly in eager mode: ``kernels.library``).
    """
    launch = default_launch() if launch is None else launch
    groups, kept = _check_route(logits, top_k, method, bias, num_groups, topk_groups,
                                routed_scaling)
    if library.eager_bypass(logits, bias):
        return _launch(logits, top_k, method, bias, groups, kept, routed_scaling, launch,
                       traced=False)
    # the arguments as given (None where not given): the op runs the same checks
    return ROUTE_TOPK.triton(logits, top_k, method, bias, num_groups, topk_groups,
                             float(routed_scaling), *library.config_fields(launch))
