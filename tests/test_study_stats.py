"""kvviz.studies.stats against values worked independently: published worked examples, hand
arithmetic, and brute-force enumeration written here (exact fractions, every outcome summed),
never the module's own output."""
from __future__ import annotations

import math
from fractions import Fraction
from itertools import product

import pandas as pd
import pytest

from kvviz.studies import stats as S


def exact_p(b: int, c: int) -> Fraction:
    """Two-sided exact sign test by enumeration: the probability, under a fair coin, of every
    split of b + c at least as far from even as (b, c)."""
    m = b + c
    far = abs(b - m / 2)
    return min(Fraction(1), sum((Fraction(math.comb(m, i), 2 ** m) for i in range(m + 1)
                                 if abs(i - m / 2) >= far), Fraction(0)))


@pytest.mark.parametrize("b,c", [(8, 1), (1, 8), (0, 0), (5, 5), (0, 6), (13, 2), (30, 12)])
def test_mcnemar_exact_is_the_enumerated_sign_test(b, c):
    assert S.mcnemar_exact(b, c) == pytest.approx(float(exact_p(b, c)), rel=1e-12)


def test_mcnemar_hand_values():
    # 8 against 1: 2 * (C(9,0) + C(9,1)) / 2^9 = 2 * 10 / 512
    assert S.mcnemar_exact(8, 1) == 20 / 512
    assert S.mcnemar_exact(0, 0) == 1.0
    assert S.mcnemar_exact(3, 3) == 1.0
    # large counts go through log-space terms: 600 against 500, against the exact sum
    assert S.mcnemar_exact(600, 500) == pytest.approx(float(exact_p(600, 500)), rel=1e-9)


def test_wilson_published_values():
    # Newcombe (1998), single proportion, Wilson score method: 81/263 and 0/20
    lo, hi = S.wilson(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    lo, hi = S.wilson(0, 20)
    assert lo == 0.0 and round(hi, 4) == 0.1611


def test_paired_interval_published_example():
    # Fagerland, Lydersen and Laake, Statistical Analysis of Contingency Tables, ch. 8:
    # complete response before and after consolidation (Cavo et al. 2012), table 59 6 / 16 80,
    # Newcombe square-and-add: -0.0621 (95 % CI -0.1186 to -0.0046)
    lo, hi = S.paired_diff_interval(59, 6, 16, 80)
    assert (round(lo, 4), round(hi, 4)) == (-0.1186, -0.0046)


def test_paired_interval_matches_wald_at_large_n():
    # Agresti's approval ratings (n = 1600: 794, 150, 86, 570): the Wald interval
    # 0.04 +/- 1.96 * sqrt(236 - 64^2 / 1600) / 1600 = 0.0213 to 0.0587; score and Wald agree
    # to the third decimal at this n
    lo, hi = S.paired_diff_interval(794, 150, 86, 570)
    half = 1.959963984540054 * math.sqrt(236 - 64 ** 2 / 1600) / 1600
    assert lo == pytest.approx(0.04 - half, abs=1e-3) and hi == pytest.approx(0.04 + half, abs=1e-3)


def test_paired_interval_exact_coverage_by_enumeration():
    """Every table of n = 20 prompts, weighted by its multinomial chance: the share of tables
    whose interval holds the true difference is close to 95 % (Newcombe reports coverage near
    nominal for this method), far above a Wald interval's at this n."""
    n = 20
    probs = (0.45, 0.25, 0.1, 0.2)  # both right, A only, B only, neither
    true = probs[1] - probs[2]
    cover = wald = 0.0
    for a, b, c in product(range(n + 1), repeat=3):
        d = n - a - b - c
        if d < 0:
            continue
        w = (math.factorial(n) / (math.factorial(a) * math.factorial(b) * math.factorial(c)
                                  * math.factorial(d))
             * probs[0] ** a * probs[1] ** b * probs[2] ** c * probs[3] ** d)
        lo, hi = S.paired_diff_interval(a, b, c, d)
        assert lo <= (b - c) / n <= hi
        cover += w * (lo <= true <= hi)
        est = (b - c) / n
        se = math.sqrt(max((b + c) / n - est ** 2, 0) / n)
        wald += w * (est - 1.96 * se <= true <= est + 1.96 * se)
    assert 0.93 <= cover <= 0.985
    assert cover > wald


def test_paired_interval_degenerate_tables():
    lo, hi = S.paired_diff_interval(10, 0, 0, 0)  # no discordant pair: an interval around 0
    assert lo < 0 < hi and lo == pytest.approx(-hi)
    lo, hi = S.paired_diff_interval(0, 10, 0, 0)  # A right everywhere, B nowhere
    assert hi == 1.0 and 0.5 < lo < 1.0
    assert all(math.isnan(x) for x in S.paired_diff_interval(0, 0, 0, 0))


def brute_power(n: int, p_b: float, p_c: float, alpha: float) -> float:
    """Every outcome (b, c, the rest) of n prompts, its multinomial chance, and whether the
    enumerated exact sign test rejects."""
    rest = 1 - p_b - p_c
    total = 0.0
    for b in range(n + 1):
        for c in range(n + 1 - b):
            if exact_p(b, c) <= Fraction(alpha):
                total += (math.comb(n, b) * math.comb(n - b, c) * p_b ** b * p_c ** c
                          * rest ** (n - b - c))
    return total


@pytest.mark.parametrize("n,p_b,p_c", [(12, 0.3, 0.1), (25, 0.3, 0.1), (30, 0.2, 0.1), (18, 0.5, 0.0)])
def test_power_is_the_enumerated_rejection_chance(n, p_b, p_c):
    assert S.power_paired(n, p_b, p_c) == pytest.approx(brute_power(n, p_b, p_c, 0.05), abs=1e-12)


def test_power_no_gap_is_at_most_alpha_and_zero_discordance_is_zero():
    # under "no difference" the exact test's rejection chance is its size, at most alpha
    assert S.power_paired(40, 0.2, 0.2) <= 0.05
    assert S.power_paired(40, 0.0, 0.0) == 0.0


def test_n_for_power_is_the_first_n_reaching_it():
    gap, disc = 0.3, 0.5
    n = S.n_for_power(gap, disc, power=0.8)
    p_b, p_c = (disc + gap) / 2, (disc - gap) / 2
    assert brute_power(n, p_b, p_c, 0.05) >= 0.8
    assert all(brute_power(m, p_b, p_c, 0.05) < 0.8 for m in range(max(1, n - 8), n))
    # Connor's (1987) normal approximation, worked by hand: (1.96 sqrt(.5) + 0.8416 sqrt(.41))^2
    # / .09 = (1.3859 + 0.5389)^2 / .09 = 41.2; the exact test needs a few more prompts
    assert 42 <= n <= 50


def test_twenty_point_gap_needs_well_above_thirty_prompts():
    # a 20-point gap at 40 % discordance: Connor's approximation gives 77 prompts by hand
    n = S.n_for_power(0.2, 0.4, power=0.8)
    assert 77 <= n <= 95
    assert S.power_at_gap(30, 0.2, 0.4) < 0.5


def test_holm_hand_values():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1: 0.02, 0.03, 0.06, 0.04 -> monotone 0.06
    assert S.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert S.holm([0.039] + [0.5] * 15)[0] == pytest.approx(0.624)
    assert S.holm([0.9, 0.8]) == [1.0, 1.0]
    assert S.holm([]) == []


@pytest.mark.parametrize("call,match", [
    (lambda: S.mcnemar_exact(-1, 2), "b must be a count"),
    (lambda: S.mcnemar_exact(1.5, 2), "b must be a count"),
    (lambda: S.power_paired(10, 0.7, 0.5), "discordance and must be at most 1"),
    (lambda: S.power_paired(10, 0.2, 0.1, alpha=0), r"alpha must lie in \(0, 1\)"),
    (lambda: S.n_for_power(0.5, 0.3), "gap must be non-zero and at most the discordance"),
    (lambda: S.holm([0.1, 1.5]), r"pvalues\[1\] must lie in \[0, 1\]"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def table(rows):
    return pd.DataFrame(rows, columns=["id", "policy", "label", "correct"])


def test_full_cache_gate_sets_prompts_apart():
    rows = table([
        ("p1", "full", "full", True), ("p1", "tova", "tova@8", False), ("p1", "h2o", "h2o@8", True),
        ("p2", "full", "full", False), ("p2", "tova", "tova@8", False), ("p2", "h2o", "h2o@8", False),
        ("p3", "full", "full", True), ("p3", "tova", "tova@8", True), ("p3", "h2o", "h2o@8", False),
        ("p4", "full", "full", True), ("p4", "tova", "tova@8", False), ("p4", "h2o", "h2o@8", False),
    ])
    kept, apart = S.full_cache_gate(rows)
    assert sorted(set(kept.id)) == ["p1", "p3", "p4"] and set(apart.id) == {"p2"}
    t = S.paired_table(rows, "tova@8", "h2o@8")
    # p2 is the model's error, not eviction's: it is not one of TOVA's failures
    assert (t.a, t.b, t.c, t.d, t.dropped) == (0, 1, 1, 1, 1)
    assert t.diff == 0 and t.p == 1.0


def test_full_cache_gate_reads_the_column_when_there():
    rows = table([("p1", "tova", "tova@8", False), ("p2", "tova", "tova@8", False)])
    rows["full_cache_correct"] = [True, False]
    kept, apart = S.full_cache_gate(rows)
    assert list(kept.id) == ["p1"] and list(apart.id) == ["p2"]
    with pytest.raises(ValueError, match="no full_cache_correct column and no full-cache rows"):
        S.full_cache_gate(rows.drop(columns="full_cache_correct"))


def test_paired_table_refuses_two_settings_in_one_cell():
    rows = table([("p1", "full", "full", True), ("p1", "tova", "tova", True),
                  ("p1", "tova", "tova", False), ("p1", "h2o", "h2o", True)])
    with pytest.raises(ValueError, match=r"a: two rows for one prompt \(id p1\)"):
        S.paired_table(rows, "tova", "h2o", by="policy")
    with pytest.raises(ValueError, match="b: no rows with policy == 'snapkv'"):
        S.paired_table(rows, "h2o", "snapkv", by="policy")


def test_paired_sides_pairs_two_variants_of_a_prompt_and_gates_both():
    # H2O with returns (ids r3-*) against H2O without (r0-*), paired by haystack and depth;
    # a pair enters only where the full cache answered both prompts
    cols = ["id", "haystack", "depth", "correct", "full_cache_correct"]
    with_returns = pd.DataFrame([("r3-a", "a", 10, True, True), ("r3-b", "b", 10, True, True),
                                 ("r3-c", "c", 10, False, True), ("r3-d", "d", 10, True, False)], columns=cols)
    without = pd.DataFrame([("r0-a", "a", 10, False, True), ("r0-b", "b", 10, True, True),
                            ("r0-c", "c", 10, False, False), ("r0-d", "d", 10, False, True),
                            ("r0-e", "e", 10, False, True)], columns=cols)
    t = S.paired_sides(with_returns, without, on=("haystack", "depth"))
    # a: right/wrong, b: both right; c and d set apart (one prompt each the full cache missed);
    # e has no partner
    assert (t.a, t.b, t.c, t.d, t.dropped) == (1, 1, 0, 0, 2)
    with pytest.raises(ValueError, match=r"b: two rows for one prompt \(haystack a, depth 10\)"):
        S.paired_sides(with_returns, pd.concat([without, without.iloc[:1]]), on=("haystack", "depth"))
