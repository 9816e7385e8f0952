"""Golden cases for the routing oracle (kernels.reference.route_topk), worked out by hand.

Expected weights are written from the method's formula with Python's math module, not from the
code under test.
"""

import math

import pytest
import torch

from kernels.reference import route_topk
from kernels.spec import ROUTING_METHODS
from kernels.spec.routing import NAN_WEIGHT_BITS
from tests.support import assert_close

NAN = float("nan")


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# One row with a tie (experts 1 and 2 both at 3.0) inside the top 3.
LOGITS = [1.0, 3.0, 3.0, 0.0, 2.0]
E1, E2, E3 = math.exp(1.0), math.exp(2.0), math.exp(3.0)
FULL_SUM = E1 + 2 * E3 + 1.0 + E2
GOLDEN = {
    "softmax_topk": [E3 / FULL_SUM, E3 / FULL_SUM, E2 / FULL_SUM],
    "softmax_topk_renorm": [E3 / (2 * E3 + E2), E3 / (2 * E3 + E2), E2 / (2 * E3 + E2)],
    "topk_softmax": [E3 / (2 * E3 + E2), E3 / (2 * E3 + E2), E2 / (2 * E3 + E2)],
    "sigmoid_topk": [sigmoid(3.0), sigmoid(3.0), sigmoid(2.0)],
    "sigmoid_topk_renorm": [s / (2 * sigmoid(3.0) + sigmoid(2.0))
                            for s in (sigmoid(3.0), sigmoid(3.0), sigmoid(2.0))],
}


@pytest.mark.parametrize("method", sorted(GOLDEN))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_method_on_a_tiny_row(method, dtype):
    ids, weights = route_topk(torch.tensor([LOGITS], dtype=dtype), 3, method)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 2, 4]]  # the tie 1 / 2 goes to the smaller id first
    assert_close(weights, torch.tensor([GOLDEN[method]]))


def test_routed_scaling_multiplies_every_weight():
    _, weights = route_topk(torch.tensor([LOGITS]), 3, "sigmoid_topk", routed_scaling=2.5)
    assert_close(weights, torch.tensor([[2.5 * w for w in GOLDEN["sigmoid_topk"]]]))


def test_llama4_takes_the_top_logit_with_its_sigmoid():
    ids, weights = route_topk(torch.tensor([[0.5, -2.0, 1.5, 1.5], [-3.0, -1.0, -2.0, -4.0]]),
                              1, "llama4")
    assert ids.tolist() == [[2], [1]]
    assert_close(weights, torch.tensor([[sigmoid(1.5)], [sigmoid(-1.0)]]))


@pytest.mark.parametrize("method", [m for m in ROUTING_METHODS if m != "deepseek_v3"])
def test_logit_ties_go_to_the_smaller_id(method):
    top_k = 1 if method == "llama4" else 3
    logits = torch.tensor([[0.0, 5.0, 5.0, 5.0, 1.0, 5.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                           [-0.0, 0.0, -1.0, -0.0, 0.0, -2.0]])  # -0.0 ties with 0.0
    ids, _ = route_topk(logits, top_k, method)
    expected = [[1, 2, 3], [0, 1, 2], [0, 1, 3]]
    assert ids.tolist() == [row[:top_k] for row in expected]


def test_selection_ranks_logits_even_where_probabilities_underflow():
    # exp(-200 - 0) underflows to 0 for both experts 1 and 2; the logits still rank them.
    ids, weights = route_topk(torch.tensor([[0.0, -300.0, -200.0]]), 3, "softmax_topk")
    assert ids.tolist() == [[0, 2, 1]]
    assert weights.tolist() == [[1.0, 0.0, 0.0]]


def test_deepseek_v3_group_tie_keeps_the_smaller_groups():
    # Logits 0 give sigmoid 0.5 exactly; biases are powers of two, so every sum is exact.
    # Groups of 2: biased scores [.75 .5 | .5 .75 | .625 .625 | 1.0 0.0]
    # group scores (sum of top 2): 1.25, 1.25, 1.25, 1.0 -> three-way tie, keep groups 0 and 1.
    # Expert 6 (the best biased score, 1.0) and experts 4, 5 are dropped with their groups;
    # inside groups 0 and 1: .75 (ids 0, 3; tie to the smaller id) then .5 (id 1).
    bias = torch.tensor([0.25, 0.0, 0.0, 0.25, 0.125, 0.125, 0.5, -0.5])
    ids, weights = route_topk(torch.zeros(1, 8), 3, "deepseek_v3", bias=bias, num_groups=4,
                              topk_groups=2, routed_scaling=2.5)
    assert ids.tolist() == [[0, 3, 1]]
    assert_close(weights, torch.full((1, 3), 2.5 / 3))


def test_deepseek_v3_weights_use_the_unbiased_sigmoid():
    logits = [2.0, -1.0, 0.5, 0.4, 1.0, 3.0]
    bias = [0.0, 0.0, 0.0, 0.0, 0.5, -0.9]
    biased = [sigmoid(x) + b for x, b in zip(logits, bias)]
    # group scores: g0 = b0 + b1 = 1.150, g1 = b2 + b3 = 1.221, g2 = b4 + b5 = 1.284
    assert biased[0] + biased[1] < biased[2] + biased[3] < biased[4] + biased[5]
    # keep g1, g2; best biased there: expert 4 (1.231), expert 2 (0.622); expert 0 (0.881)
    # would beat expert 2 but its group is dropped.
    ids, weights = route_topk(torch.tensor([logits]), 2, "deepseek_v3",
                              bias=torch.tensor(bias), num_groups=3, topk_groups=2,
                              routed_scaling=1.5)
    assert ids.tolist() == [[4, 2]]
    total = sigmoid(1.0) + sigmoid(0.5)
    assert_close(weights, torch.tensor([[1.5 * sigmoid(1.0) / total,
                                         1.5 * sigmoid(0.5) / total]]))


def test_deepseek_v3_without_groups_ranks_every_expert():
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, -0.9])
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.4, 1.0, 3.0]])
    ids, _ = route_topk(logits, 3, "deepseek_v3", bias=bias)
    assert ids.tolist() == [[4, 0, 2]]  # biased: 1.231, 0.881, 0.622, 0.599, 0.269, 0.053


@pytest.mark.parametrize("method", [m for m in ROUTING_METHODS if m not in ("deepseek_v3",
                                                                            "llama4")])
def test_nan_ranks_below_minus_inf_ties_to_the_smaller_id(method):
    # Numbers first (best first), then -inf, then the NaNs by id: either sign of NaN.
    logits = torch.tensor([[NAN, 1.0, float("-inf"), -NAN, 0.0, NAN]])
    ids, weights = route_topk(logits, 6, method)
    assert ids.tolist() == [[1, 4, 2, 0, 3, 5]]
    assert weights.isnan().any()


def test_nan_weights_have_one_bit_pattern():
    # sigmoid_topk: only the NaN expert's weight is NaN (chosen last); the softmax of a row
    # holding a NaN, chosen or not, makes every weight of the row NaN. Each NaN is 0x7FC00000,
    # whatever the input NaN was.
    negative_nan = torch.tensor([0xFFC00001 - 2**32], dtype=torch.int32).view(torch.float32)
    logits = torch.tensor([[2.0, 0.0, 1.0, 0.0], [3.0, 1.0, 2.0, 0.0]])
    logits[0, 1] = negative_nan
    ids, weights = route_topk(logits, 4, "sigmoid_topk")
    assert ids[0].tolist() == [0, 2, 3, 1]
    assert weights.view(torch.int32)[0, 3] == NAN_WEIGHT_BITS
    assert not weights[0, :3].isnan().any() and not weights[1].isnan().any()
    _, weights = route_topk(logits, 2, "softmax_topk_renorm")
    assert (weights[0].view(torch.int32) == NAN_WEIGHT_BITS).all()
    assert not weights[1].isnan().any()


def test_deepseek_v3_nan_group_scores_rank_lowest():
    # Logits 0 give sigmoid 0.5; biases are powers of two, so every sum is exact. Groups of 3:
    #   group 0: biased [1.0, NaN, .75]     -> top two 1.0 + .75 = 1.75 (NaN is the lowest)
    #   group 1: biased [NaN, NaN, 4.5]     -> top two 4.5 + NaN = NaN: the lowest group score
    #   group 2: biased [.5, .5, .5]        -> 1.0
    # Keep 2 groups: 0 and 2; then by biased score, NaN after every number: 0, 2, 6, 7, 8, 1.
    bias = torch.tensor([0.5, NAN, 0.25, NAN, NAN, 4.0, 0.0, 0.0, 0.0])
    ids, weights = route_topk(torch.zeros(1, 9), 6, "deepseek_v3", bias=bias, num_groups=3,
                              topk_groups=2)
    assert ids.tolist() == [[0, 2, 6, 7, 8, 1]]
    # The weights use the unbiased sigmoid (0.5 each, no NaN): 1/6.
    assert_close(weights, torch.full((1, 6), 1 / 6))
    # A NaN logit makes its sigmoid, and so every renormalised weight of the row, NaN.
    logits = torch.zeros(1, 9)
    logits[0, 6] = NAN
    ids, weights = route_topk(logits, 3, "deepseek_v3", bias=bias, num_groups=3, topk_groups=2)
    assert ids.tolist() == [[0, 2, 7]]  # 6 is NaN now: after the numbers of the kept groups
    ids, weights = route_topk(logits, 6, "deepseek_v3", bias=bias, num_groups=3, topk_groups=2)
    assert ids.tolist() == [[0, 2, 7, 8, 1, 6]]
    assert (weights.view(torch.int32) == NAN_WEIGHT_BITS).all()


def test_zero_tokens_give_empty_outputs():
    ids, weights = route_topk(torch.zeros(0, 8), 2, "softmax_topk")
    assert ids.shape == (0, 2) and weights.shape == (0, 2) and ids.dtype == torch.int32


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(top_k=9), ValueError, r"top_k=9 must be <= the number of experts \(8\)"),
    (dict(top_k=0), ValueError, "top_k=0 must be a positive int"),
    (dict(method="softmax"), ValueError, "method='softmax' is not one of .*'softmax_topk'"),
    (dict(method="llama4", top_k=2), ValueError, "top_k=2 must be 1"),
    (dict(bias=torch.zeros(8)), ValueError, "bias is used only by method='deepseek_v3'"),
    (dict(num_groups=2), ValueError, "num_groups is used only by method='deepseek_v3'"),
    (dict(method="deepseek_v3"), ValueError, "method='deepseek_v3' needs bias"),
    (dict(method="deepseek_v3", bias=torch.zeros(7)), ValueError,
     "bias has 7 entries but logits have 8 experts"),
    (dict(method="deepseek_v3", bias=torch.zeros(8, dtype=torch.bfloat16)), TypeError,
     "bias must be float32"),
    (dict(method="deepseek_v3", bias=torch.zeros(8), num_groups=3), ValueError,
     "num_groups=3 must be a positive int that divides the number of experts"),
    (dict(method="deepseek_v3", bias=torch.zeros(8), num_groups=2, topk_groups=3), ValueError,
     r"topk_groups=3 must be an int in \[1, num_groups=2\]"),
    (dict(method="deepseek_v3", bias=torch.zeros(8), num_groups=8), ValueError,
     "each group needs >= 2"),
    (dict(method="deepseek_v3", bias=torch.zeros(8), num_groups=4, topk_groups=1, top_k=3),
     ValueError, "top_k=3 is more than the kept groups hold: topk_groups=1 x 2"),
    (dict(routed_scaling=float("nan")), ValueError, "routed_scaling=nan must be a finite"),
    (dict(logits=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "logits must be float32"),
    (dict(logits=torch.zeros(8)), ValueError, r"logits must be 2-D, got shape \(8,\)"),
])
def test_bad_arguments_are_named(kwargs, error, message):
    args = dict(logits=torch.zeros(4, 8), top_k=2, method="softmax_topk")
    args.update(kwargs)
    logits, top_k, method = args.pop("logits"), args.pop("top_k"), args.pop("method")
    with pytest.raises(error, match=message):
        route_topk(logits, top_k, method, **args)


def test_top_k_above_32_is_refused():
    with pytest.raises(ValueError, match=r"top_k=33 must be <= 32"):
        route_topk(torch.zeros(2, 64), 33, "softmax_topk")
