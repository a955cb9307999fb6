"""Policy behaviour: differential tests against the reference loops, refusals, layout."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvviz.core.check import SYNTHETIC_ROPE_THETA, _key, _query, compare, scenarios
from kvviz.core.policies import POLICIES, check_declaration, make_policy, param_specs, reference_class
from kvviz.core.policies.vectors import use_rope_theta
from kvviz.core.reference import make_reference


def norms(p, t):
    """Key and value norms, key and query vectors, for a policy that reads them (varied,
    deterministic), else nothing."""
    out = {"key_norm": float(1 + (t * 7919) % 13) / 4} if p.reads_key_norms else {}
    if p.reads_value_norms:
        out["value_norm"] = float(1 + (t * 104729) % 7) / 8
    if p.reads_keys:
        out["keys"] = _key(np.append(np.asarray(p.kept, np.int64), t))
    if p.reads_queries:
        out["query"] = _query(t)
    return out


_SETTINGS = dict(deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, **_SETTINGS)
@given(data=st.data())
def test_matches_reference(name, data):
    """Every registered policy against the slow reference its class names, on the scenarios
    `kvviz check --reference` draws, compared by its one harness. (Drawing a scenario costs
    three times its replay: 150 here, 1000 more in the slow tier below.)"""
    cls = POLICIES[name]
    compare(cls, reference_class(name), data.draw(scenarios(cls)))


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=1000, **_SETTINGS)
@given(data=st.data())
def test_matches_reference_on_a_thousand_more_scenarios(name, data, long_run):
    """The same comparison on 1000 scenarios of its own (another test, so Hypothesis's
    derandomized draws differ from the 150 above)."""
    cls = POLICIES[name]
    compare(cls, reference_class(name), data.draw(scenarios(cls)))


def test_every_registered_policy_is_declared_and_has_a_reference():
    for name, cls in POLICIES.items():
        check_declaration(cls)
        assert reference_class(name) is not None, f"{name} names no reference"
        assert make_reference(name).params == make_policy(name).params


def test_snapkv_sums_in_ring_order():
    """The card pins slot 0 upward in float64; pairwise summation would not lose the tiny adds.

    Ring of 16: 1.0 then fifteen 2**-53. Sequentially each 1 + 2**-53 rounds back to 1.0
    (ties to even); numpy's 8-way pairwise reduction would land on 1 + 7 * 2**-52.
    """
    p = make_policy("snapkv", budget=64, obs_window=16, pool_kernel=1, recent_window=0)
    p.on_decode_step(0, [])
    tiny = np.float32(2.0**-53)
    for t in range(1, 17):
        attn = np.zeros(t, np.float32)
        attn[0] = 1.0 if t == 1 else tiny
        p.on_decode_step(t, attn)
    assert p.scores()["sums"][0] == 1.0
    assert sum([1.0] + [float(tiny)] * 15) == 1.0  # the order the card asks for


@pytest.mark.parametrize("name, expected", [
    ("tova", 13), ("h2o", 13), ("snapkv", 21 + 4 * 16), ("streaming-llm", 4), ("random", 4),
    ("scissorhands", 13), ("knorm", 9),
])
def test_bytes_per_slot(name, expected):
    assert make_policy(name).bytes_per_slot == expected


@pytest.mark.parametrize("obs_window", [1, 4, 16, 64])
def test_snapkv_bytes_follow_obs_window(obs_window):
    assert make_policy("snapkv", obs_window=obs_window).bytes_per_slot == 21 + 4 * obs_window


def test_documented_defaults():
    assert make_policy("snapkv").params == {"obs_window": 16, "pool_kernel": 5, "recent_window": 32,
                                            "pooling": "max"}
    assert make_policy("h2o").params == {"recent_window": 32}
    assert make_policy("streaming-llm").params == {"sinks": 4}
    for name in POLICIES:
        for spec in param_specs(name):
            assert spec.default == make_policy(name).params[spec.name]
            assert spec.source, f"{name}.{spec.name} must cite where its default comes from"
            assert spec.label and spec.help


@pytest.mark.parametrize("name, params, rule", [
    ("snapkv", {"pool_kernel": 4}, "odd"),
    ("snapkv", {"pool_kernel": 0}, "odd"),
    ("snapkv", {"obs_window": 0}, "obs_window"),
    ("snapkv", {"recent_window": 512}, "recent_window"),
    ("h2o", {"recent_window": 600}, "recent_window"),
    ("scissorhands", {"history_window": 0}, "history_window"),
    ("streaming-llm", {"sinks": 512}, "sinks"),
    ("tova", {"pool_kernel": 3}, "pool_kernel"),
    ("nope", {}, "policy"),
])
def test_refusals_name_the_rule(name, params, rule):
    with pytest.raises(ValueError, match=rule):
        make_policy(name, budget=512, **params)


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_budget_must_be_positive_integer(budget):
    with pytest.raises(ValueError, match="budget"):
        make_policy("tova", budget=budget)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_bad_steps_are_refused_and_change_nothing(name):
    p = make_policy(name)  # defaults at the default budget (a declaration rule)
    p.on_decode_step(0, [], **norms(p, 0))
    p.on_decode_step(1, [1.0], **norms(p, 1))
    before = p.kept.tolist()
    for pos, attn, rule in [(2, [0.5], "length"), (2, [0.5, -0.5], "negative"),
                            (2, [np.nan, 0.5], "finite"), (2, [np.inf, 0.0], "finite"),
                            (1, [0.5, 0.5], "pos"), (-1, None, "pos")]:
        with pytest.raises(ValueError, match=rule):
            p.on_decode_step(pos, attn, **norms(p, pos))
        assert p.kept.tolist() == before
    with pytest.raises(ValueError, match="budget"):
        p.evict(-1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_scores_align_with_kept(name):
    p = make_policy(name, budget=40)
    use_rope_theta(p, SYNTHETIC_ROPE_THETA, "the synthetic vectors")  # for one that undoes RoPE
    rng = np.random.default_rng(1)
    for t in range(60):
        p.on_decode_step(t, rng.dirichlet(np.ones(len(p.kept))).astype(np.float32) if t else [],
                         **norms(p, t))
        p.evict(40)
    scores = p.scores()
    assert "candidate" in scores
    for key, value in scores.items():
        assert len(value) == len(p.kept), key


def test_kept_is_read_only():
    p = make_policy("tova", budget=4)
    p.on_decode_step(0, [])
    with pytest.raises(ValueError):
        p.kept[0] = 5


def test_random_is_seeded_and_uses_its_rng():
    def victims(rng):
        p = make_policy("random", budget=8, rng=rng)
        out = []
        for t in range(200):
            p.on_decode_step(t, None)
            out += p.evict(8).tolist()
        return out

    assert victims(None) == victims(None)
    assert victims(np.random.default_rng(1)) == victims(np.random.default_rng(1))
    assert victims(np.random.default_rng(1)) != victims(np.random.default_rng(2))


def test_random_evicts_uniformly():
    """Budget 1 of 2 held slots: each is the victim about half the time."""
    p = make_policy("random", budget=1)
    p.on_decode_step(0, None)
    older = 0
    for t in range(1, 4001):
        p.on_decode_step(t, None)
        older += int(p.evict(1)[0] != t)
    assert 1850 < older < 2150  # 4000 fair coin flips: +-4.7 sigma


def test_knorm_refuses_a_missing_or_bad_key_norm_and_changes_nothing():
    p = make_policy("knorm", budget=4)
    p.on_decode_step(0, None, key_norm=1.0)
    for value, rule in [(None, "key norms"), (-1.0, "non-negative"), (np.nan, "finite")]:
        with pytest.raises(ValueError, match=rule):
            p.on_decode_step(1, None, key_norm=value)
        assert p.kept.tolist() == [0]


def test_knorm_keeps_the_lowest_norms_and_breaks_ties_low():
    """Devoto et al.: low-norm keys are the ones attention seeks; the highest norm goes first,
    and it may be the newest position (its norm is known on admission)."""
    p = make_policy("knorm", budget=3)
    for t, kn in enumerate([2.0, 1.0, 3.0, 1.0]):
        p.on_decode_step(t, None, key_norm=kn)
    assert p.evict(3).tolist() == [2]          # the 3.0
    p.on_decode_step(4, None, key_norm=5.0)
    assert p.evict(3).tolist() == [4]          # the newcomer itself
    p.on_decode_step(5, None, key_norm=2.0)
    assert p.evict(3).tolist() == [0]          # 2.0 at 0 and 5 tie: the lower position
    assert p.kept.tolist() == [1, 3, 5]


def test_config_label_names_a_configuration_one_way():
    """Tables, figures, reports and CSVs name a configuration alike: the non-default
    parameters by their control labels, in declaration order, whatever the input's spelling."""
    from kvviz.core.policies import config_label, defaults, parse_params

    assert config_label("tova") == config_label("tova", {}) == "tova"
    assert config_label("snapkv", defaults("snapkv")) == "snapkv"
    given = {"pooling": "avg", "pool_kernel": 1, "obs_window": 16}
    assert config_label("snapkv", given) == "snapkv (poolKernel=1, pooling=avg)"
    assert config_label("snapkv", {"poolKernel": "1", "pooling": "avg"}) == config_label("snapkv", given)
    assert config_label("snapkv", parse_params("snapkv", {"poolKernel": "1"})) == "snapkv (poolKernel=1)"
    assert config_label("snapkv", {"pool_kernel": 5}, keep=("pool_kernel",)) == "snapkv (poolKernel=5)"
    assert config_label("streaming-llm", {"sinks": 0}, budget=64) == "streaming-llm (sinks=0) @ 64"
    assert config_label("tova", {}, budget=64.0) == "tova @ 64"  # a column with gaps is float
    assert config_label("tova", {}, budget=float("nan")) == "tova"
    assert config_label("full", {}, budget=64) == "full cache"
    assert config_label("not-registered", {"b": 2, "a": 1}) == "not-registered (a=1, b=2)"
