"""The allocator study's answer functions on hand-built inputs (no model)."""
import numpy as np
import pytest

from lab.alloc_report import (
    accuracy_table,
    config_specs,
    kept_diff,
    key_mass,
    leading_digits,
    pearson,
    picked_top,
    roles_from_held,
    spearman,
    summarise,
    versus,
)


def test_leading_digits_counts_the_key_prefix_of_the_first_number():
    assert leading_digits(" 42400. Remember", "42400") == 5
    assert leading_digits(" 424. The pass key", "42400") == 3
    assert leading_digits(" 5555555", "53053") == 1
    assert leading_digits(" the pass key.", "53053") == 0
    assert leading_digits(" 9 and 42400", "42400") == 0  # only the first number counts


def test_key_mass_averages_question_rows_and_query_heads_of_a_kv_head():
    T, H, G = 6, 4, 2
    a = np.zeros((H, T, T))
    # question rows 4 and 5; key at positions 1 and 2
    a[0, 4, 1], a[0, 5, 2] = 0.5, 0.25     # query head 0 -> KV head 0: rows give 0.5 and 0.25
    a[1, 4, 0] = 1.0                        # query head 1 -> KV head 0: nothing on the key
    a[2, 4, 1], a[2, 4, 2] = 0.3, 0.3       # query head 2 -> KV head 1: 0.6 then 0
    a[3, 3, 1] = 1.0                        # a row before the question does not count
    m = key_mass([a, a * 0], question_start=4, key_positions=[1, 2], kv_heads=G)
    assert m.shape == (2, G)
    assert m[0, 0] == pytest.approx(((0.5 + 0.25) / 2 + 0) / 2)
    assert m[0, 1] == pytest.approx((0.6 / 2 + 0) / 2)
    assert (m[1] == 0).all()


def test_correlations_on_known_orders():
    x = [1, 2, 3, 4]
    assert pearson(x, [2, 4, 6, 8]) == pytest.approx(1)
    assert spearman(x, [1, 10, 100, 1000]) == pytest.approx(1)  # monotone, not linear
    assert spearman(x, [4, 3, 2, 1]) == pytest.approx(-1)
    assert np.isnan(pearson(x, [5, 5, 5, 5]))
    assert spearman([1, 1, 2], [1, 1, 2]) == pytest.approx(1)  # ties share a rank


def test_accuracy_table_and_versus():
    recs = [{"name": "tova", "budget": 64, "correct": c, "digits": d} for c, d in ((True, 5), (False, 1))]
    recs += [{"name": "adakv:tova", "budget": 64, "correct": False, "digits": 2}] * 2
    t = accuracy_table(recs)
    assert t["tova"][64] == (0.5, 3.0, 2)
    assert t["adakv:tova"][64] == (0.0, 2.0, 2)
    assert versus(t, "adakv:tova", "tova") == {64: (-0.5, -1.0)}
    assert versus(t, "adakv:tova", "absent") == {}


def test_roles_read_off_held_counts():
    held = np.array([[32, 80, 80], [80, 32, 80]])
    ret = roles_from_held(held, 64)
    assert ret.tolist() == [[False, True, True], [True, False, True]]
    with pytest.raises(ValueError, match="not visible"):
        roles_from_held(held, 32)
    mass = np.array([[0.9, 0.1, 0.2], [0.1, 0.2, 0.9]])
    assert picked_top(ret, mass) == pytest.approx(0.5)  # layer 0's top head streams, layer 1's retrieves


def test_kept_diff_names_the_cells_and_positions_that_differ():
    a = {(0, 0): [1, 2, 3], (0, 1): [4, 5]}
    b = {(0, 0): [1, 2, 3], (0, 1): [4, 6]}
    d = kept_diff(a, b)
    assert d["cells"] == 2 and d["same_cells"] == 1
    assert d["only_a"] == {(0, 1): [5]} and d["only_b"] == {(0, 1): [6]}
    assert d["kept_a"] == d["kept_b"] == 5


def test_summarise_on_hand_built_prompts():
    L, G = 2, 3
    mass = [[0.0, 0.1, 0.5], [0.3, 0.0, 0.0]]

    def held(name, b):
        if name.startswith("adakv"):  # the key-attending heads gain, the others lose
            return [[b - 10, b, b + 10], [b + 10, b - 5, b - 5]]
        if name.startswith("headroles") and b > 32:
            return [[32, b + 16, b + 16], [b + 16, b + 16, 32]]
        return [[b] * G] * L

    rows = [{"name": n, "spec": s, "budget": b, "correct": n == "tova" and b == 256,
             "digits": 5 if (n == "tova" and b == 256) else 1, "held": held(n, b)} for n, s, b in config_specs()]
    prompts = [{"depth": 50, "seed": s, "key_mass": mass, "rows": rows, "full_correct": True} for s in (0, 1)]
    s = summarise(prompts, None)
    assert s["prompts"] == 2 and s["full_correct"] == 2
    assert s["adakv_vs_plain"]["tova"]["256"][0] == -1.0
    assert s["pyramid_vs_uniform"]["64"] == (0.0, 0.0)
    h = s["heads"]["adakv:tova@64"]
    assert h["spearman_mean_cells"] > 0.9  # gains ordered as the key mass
    assert h["max_gain"] == 10 and h["min_gain"] == -10
    r = s["roles"]["64"]
    assert r["retrieval_per_layer"] == [2]
    assert r["picked_top_key_head"] == 1.0
    assert r["key_mass_retrieval"] > r["key_mass_streaming"]
