"""CAKE (Qin et al., ICLR 2025): layer budgets from each layer's attention spread and shift
over the calibration rows' window, and within a layer the indicator mean + gamma x variance
over each head's ring. Expected values are worked by hand in the comments."""
import math

import numpy as np
import pytest

from kvviz.core import harness
from kvviz.core.check_alloc import check_reference
from kvviz.core.layers import load_layers, replay_layers
from kvviz.core.policies import make_policy
from kvviz.core.policies.cake import CAKE
from kvviz.core.reference_alloc import RefCAKE

# Two layers x two heads, calibration 4 rows (row t over positions 0..t-1), window 2: the
# window is rows 2 and 3, the prefix positions 0 and 1 (row 3's position 2 is left out).
ROWS = [
    [  # layer 0
        [[], [1.0], [0.5, 0.5], [0.5, 0.5, 0.0]],   # head 0: window [[.5, .5], [.5, .5]]
        [[], [1.0], [1.0, 0.0], [0.0, 1.0, 0.0]],   # head 1: window [[1, 0], [0, 1]]
    ],
    [  # layer 1
        [[], [1.0], [0.25, 0.75], [0.75, 0.25, 0.0]],  # head 0: window [[.25, .75], [.75, .25]]
        [[], [1.0], [0.0, 0.0], [0.0, 0.0, 1.0]],      # head 1: window of zeros
    ],
]
# Layer 0: spread H = -(4 x 0.5 ln 0.5) [head 0] - (2 x 1 ln(1 + 1e-10)) [head 1, ~0]
#   = 2 ln 2 = 1.386294; shift V = 0 [head 0: no change] + 2 columns x var(1, 0) = 2 x 0.5 = 1.0
# Layer 1: H = -(2 x .25 ln .25 + 2 x .75 ln .75) = 0.693147 + 0.431523 = 1.124670 [head 1: 0]
#   V = 2 columns x var(.25, .75) = 2 x 0.125 = 0.25 [head 1: 0]
H0, V0 = 2 * math.log(2), 1.0
H1, V1 = -(0.5 * math.log(0.25) + 1.5 * math.log(0.75)), 0.25


def cake(budget=10, **params):
    return make_policy("cake", budget, **{"window": 2, "calibration": 4, **params})


def test_the_layer_budgets_follow_the_preference_worked_by_hand():
    # tau1 = tau2 = 1: P0 = 1.386294 x 1.0 = 1.386294, P1 = 1.124670 x 0.25 = 0.281168.
    # budget 10, window w = 2: each layer w + 1 = 3, then L x (B - w - 1) = 2 x 7 = 14 shared:
    # floor(1.386294 / 1.667462 x 14) = floor(11.64) = 11, floor(0.281168 / 1.667462 x 14) =
    # floor(2.36) = 2; one slot left goes to layer 0 (shallowest first): 12 and 2.
    # Budgets 3 + 12 = 15 and 3 + 2 = 5 (sum 20 = 2 x 10).
    assert cake().planned_budgets(ROWS, 2) == [15, 5]
    # tau1 = 0.5 squares the spread: P0 = 1.921812, P1 = 1.264883 x 0.25 = 0.316221;
    # floor(0.858706 x 14) = floor(12.02) = 12, floor(0.141294 x 14) = floor(1.98) = 1, the
    # slot left to layer 0: 13 and 1, budgets 16 and 4.
    assert cake(tau1=0.5).planned_budgets(ROWS, 2) == [16, 4]
    assert RefCAKE(10, None, scorer="snapkv", window=2, calibration=4, tau1=0.5,
                   **make_policy("snapkv", 10, recent_window=2).params).plan_layers(ROWS) == [16, 4]


def test_too_few_rows_or_no_preference_keep_the_budget_everywhere():
    short = [[head[:2] for head in layer] for layer in ROWS]  # rows 0 and 1: no prefix before the window
    assert cake().planned_budgets(short, 2) == [10, 10]
    flat = [[[[], [1.0], [0.0, 0.0], [0.0, 0.0, 0.0]]] * 2] * 2  # no spread, no shift
    assert cake().planned_budgets(flat, 2) == [10, 10]


def feed_one(group, t, rows):
    for p, row in zip(group.policies, rows):
        harness.feed(p, t, None if row is None else np.asarray(row, np.float32))
    return [v.tolist() for v in harness.evict_layer(group, t)]


def test_the_indicator_adds_the_variance_and_pools_by_average_worked_by_hand():
    # One layer, one head, budget 3, window 2 (SnapKV ring of 2 steps, 2 newest kept), gamma 10.
    alloc = cake(3, gamma=10.0)
    group = alloc.group(0, 1, 1)
    rows = [[], [1.0], [0.5, 0.5], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8], [0.5, 0.25, 0.25]]
    victims = [feed_one(group, t, [rows[t]]) for t in range(6)]
    # Ring slot t mod 2. After step 3 the rings are pos0 (.5, .2), pos1 (.5, .2), pos2 (0, .6),
    # pos3 (0, 0): mean + 10 x unbiased variance = .35 + 10 x .045 = .8, .8, .3 + 10 x .18 =
    # 2.1, 0. Averaged over the neighbours within 2 slots: pos0 (.8 + .8 + 2.1) / 3 = 1.233,
    # pos1 (.8 + .8 + 2.1 + 0) / 4 = .925; candidates pos0, pos1 (2 newest kept): pos1 goes.
    # Step 4 (held 0, 2, 3, 4): pos0 (.1, .2) -> .15 + 10 x .005 = .2, pos2 (.1, .6) -> .35 +
    # 1.25 = 1.6, pos3 (.8, 0) -> .4 + 3.2 = 3.6, pos4 0; pooled pos0 5.4 / 3 = 1.8, pos2
    # 5.4 / 4 = 1.35: pos2 goes.
    # Step 5 (held 0, 3, 4, 5): pos0 (.1, .5) -> .3 + .8 = 1.1, pos3 (.8, .25) -> .525 +
    # 1.5125 = 2.0375, pos4 (0, .25) -> .125 + .3125 = .4375, pos5 0; pooled pos0
    # 3.575 / 3 = 1.192, pos3 3.575 / 4 = .894: pos3 goes.
    assert victims == [[[]], [[]], [[]], [[1]], [[2]], [[3]]]
    assert group.policies[0].held().tolist() == [0, 4, 5]
    # SnapKV alone (window sums, max-pooled) ties pos0 and pos1 at step 3 and takes pos0
    snap = make_policy("snapkv", 3, obs_window=2, recent_window=2)
    for t in range(4):
        gone = harness.step(snap, t, np.asarray(rows[t], np.float32), 3)
    assert gone.tolist() == [0]


def test_it_matches_its_reference_with_planned_layers():
    assert check_reference(CAKE, RefCAKE, scenarios=40).passed


def test_a_reference_that_shares_out_differently_is_caught():
    class Even(RefCAKE):
        def plan_layers(self, rows_by_layer):
            return None

    result = check_reference(CAKE, Even, scenarios=40)
    assert not result.passed and "planned layer budgets" in result.detail


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="scorer must be snapkv"):
        make_policy("cake", 64, scorer="tova")
    with pytest.raises(ValueError, match="window must be below calibration"):
        make_policy("cake", 64, window=48, calibration=48)


def test_a_trace_replay_plans_its_stored_layers():
    grid = load_layers("traces/code-kv.npz")  # layers 0, 14, 29 x kv0..kv2
    run = replay_layers(grid, cake(64, window=8, calibration=32))
    assert sum(run.budgets) == 3 * 64 and len(set(run.budgets)) > 1
    assert run.held[:, :, -1].sum(axis=1).tolist() == [3 * b for b in run.budgets]


def test_the_model_loop_plans_every_layer_from_the_prompt(smollm):
    from kvviz.model.loop import LoopConfig, generate

    prompt = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is "
              "Berlin. Our meeting moved to Thursday at noon, in the blue room. The capital of Spain is")
    cfg = LoopConfig("cake", {"window": 4, "calibration": 16}, 12)
    gen = generate(prompt, [cfg], 2, granularity="kv-head", prompt_mode="prefill", model=smollm)
    held = gen.held(1, gen.prompt_len - 1).sum(axis=-1)  # (30, 3) after the prompt's eviction
    assert (held == held[:, :1]).all()  # every head of a layer holds its layer's budget
    assert len(set(held[:, 0].tolist())) > 1 and held.sum() <= 30 * 3 * 12
