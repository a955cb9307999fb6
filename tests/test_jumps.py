"""The navigator's jumps (kvviz.app.jumps) against brute-force definitions, the toy trace, the
tracked-position drawing helpers and the policies' glossary entries."""
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvviz.app import jumps as J
from kvviz.core.metrics import _top_k
from kvviz.core.policies import POLICIES
from kvviz.core.replay import NEVER, run_policy
from kvviz.core.trace import CanonicalTrace, canonical, load_trace

REPO = Path(__file__).resolve().parents[1]


def held_when_queried(ev, p, s):
    """Held after step s-1 (when query s is made), by the harness's rule, spelled out."""
    return p <= s - 1 and (ev[p] == NEVER or ev[p] > s - 1)


def brute_notable(trace, ea, eb, share):
    peak = {}
    for s in range(1, trace.steps):
        row = trace.row(s).astype(np.float64)
        for p in range(s):
            if held_when_queried(ea, p, s) != held_when_queried(eb, p, s) and ea[p] != eb[p]:
                peak[p] = max(peak.get(p, 0.0), row[p] / row.sum())
    best = {}
    for p, v in peak.items():
        if v > share:
            first = min(e for e in (int(ea[p]), int(eb[p])) if e != NEVER)
            cur = best.get(first)
            if cur is None or v > cur[0] or (v == cur[0] and p < cur[1]):
                best[first] = (v, p)
    steps = sorted(best)
    return steps, [best[s][1] for s in steps]


@pytest.mark.parametrize("seed", range(6))
def test_notable_divergences_match_the_definition(seed):
    rng = np.random.default_rng(seed)
    trace = CanonicalTrace(steps=int(rng.integers(60, 110)), seed=seed, epoch=30, recent=10,
                           hh_per_epoch=4)
    budget = int(rng.integers(8, 24))
    ea = run_policy(trace, "tova", budget).evicted_at
    eb = run_policy(trace, "h2o", budget, recent_window=4).evicted_at
    share = float(rng.choice([0.005, 0.02, 0.05]))
    steps, positions = J.notable_divergences(trace, ea, eb, share)
    want_steps, want_pos = brute_notable(trace, ea, eb, share)
    assert steps.tolist() == want_steps and positions.tolist() == want_pos
    # each lands on a step at which one policy evicts that position and the other keeps it
    for s, p in zip(steps, positions):
        assert s in (ea[p], eb[p]) and ea[p] != eb[p]


def test_notable_divergence_is_not_every_step():
    """TOVA and SnapKV evict differently at every step from 512 on, so a plain "next
    divergence" would move one step; the notable jump skips the quiet positions."""
    from kvviz.app.figures.states import divergence_steps

    trace = canonical().keep_rows()
    ea = run_policy(trace, "tova", 512).evicted_at
    eb = run_policy(trace, "snapkv", 512).evicted_at
    every = divergence_steps(ea, eb)
    assert np.array_equal(every[every >= 923][:4], [923, 924, 925, 926])
    steps, _ = J.notable_divergences(trace, ea, eb, J.NOTABLE_SHARE)
    assert 0 < len(steps) < len(every) / 50
    assert not np.any(np.diff(steps) == 0)


def test_epoch_boundaries():
    assert J.epoch_boundaries(canonical(1500)).tolist() == [512, 1024]
    assert J.epoch_boundaries(load_trace(REPO / "traces" / "toy.npz")).tolist() == []


@pytest.mark.parametrize("seed", range(3))
def test_heavy_hitters_match_the_metrics_definition(seed):
    trace = CanonicalTrace(steps=80, seed=seed, epoch=25, recent=8, hh_per_epoch=4)
    k = 5
    first = J.first_heavy(trace, k)
    received = np.zeros(trace.steps)
    want = np.full(trace.steps, NEVER)
    for t in range(1, trace.steps):
        if t > k:
            for p in _top_k(received[:t], k):
                if want[p] == NEVER:
                    want[p] = t
        received[:t] += trace.row(t)
    assert first.tolist() == want.tolist()
    ea = run_policy(trace, "tova", 20).evicted_at
    eb = run_policy(trace, "streaming-llm", 20, sinks=2).evicted_at
    got = J.heavy_hitter_evictions(first, ea, eb).tolist()
    brute = sorted({int(e) for ev in (ea, eb) for p, e in enumerate(ev)
                    if e != NEVER and want[p] != NEVER and want[p] <= e})
    assert got == brute


def test_position_evictions():
    ea, eb = np.array([-1, 5, 3]), np.array([-1, 5, 7])
    assert J.position_evictions(ea, eb, 0).tolist() == []
    assert J.position_evictions(ea, eb, 1).tolist() == [5]
    assert J.position_evictions(ea, eb, 2).tolist() == [3, 7]


# --- the toy trace ------------------------------------------------------------------------
def test_shipped_toy_trace_is_the_generator():
    from kvviz.app.toy import BUDGET, TOKENS, toy_rows
    from kvviz.app.ui.experiments import TOY_PARAMS
    from kvviz.app.ui.sidebar import default_budget

    t = load_trace(REPO / "traces" / "toy.npz")
    rows = toy_rows()
    assert t.steps == len(TOKENS) == 16 and t.tokens == TOKENS
    for s in range(1, 16):
        assert np.array_equal(t.row(s), rows[s, :s])
        assert abs(float(rows[s, :s].sum(dtype=np.float64)) - 1) < 1e-6
    assert default_budget(t.steps) == BUDGET == 4  # the picker opens it at budget 4
    run_policy(t, "snapkv", BUDGET, **TOY_PARAMS)  # the experiment's SnapKV fits budget 4
    assert "traces/toy.npz" in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["kvviz"]["bundle"]


def test_labelled_heatmap_shows_every_weight():
    from kvviz.app.figures.states import states_at
    from kvviz.app.figures.toy import label_bars, labelled_heatmap

    t = load_trace(REPO / "traces" / "toy.npz")
    ea = run_policy(t, "tova", 4).evicted_at
    eb = run_policy(t, "h2o", 4, recent_window=1).evicted_at
    fig = labelled_heatmap(t, ea, eb, 6, track=5)
    text = next(d for d in fig.data if d.name == "weights")
    assert len(text.text) == 16 * 15 // 2  # every cell of every row
    for x, y, label in zip(text.x, text.y, text.text):
        assert label == f"{t.row(int(y))[int(x)]:.2f}"
    z = np.asarray(fig.data[0].z)
    for s in (0, 6, 15):
        assert z[s].tolist() == states_at(ea, eb, s).tolist()
    assert {sh.name for sh in fig.layout.shapes} == {"step", "track"}
    import plotly.graph_objects as go
    bars = label_bars(go.Figure(go.Bar(x=[1, 2], y=[0.25, np.nan])))
    assert list(bars.data[0].text) == ["0.25", ""]


# --- tracked position helpers ------------------------------------------------------------
def test_heatmap_track_markers_and_strip_outline():
    from kvviz.app.figures.cache import cache_heatmap
    from kvviz.app.figures.tokens import token_strip_html
    from kvviz.app.figures.track import heatmap_with_track, strip_track_css

    ea, eb = np.array([-1, 3, -1, -1, -1, -1]), np.array([-1, -1, 4, -1, -1, -1])
    base = cache_heatmap(ea, eb, 2).to_dict()
    fig = heatmap_with_track(base, 1, ea, eb, 6).to_dict()
    marks = fig["data"][len(base["data"]):]
    assert [(m["x"], m["y"]) for m in marks] == [([1], [3]), ([1], [5])]  # A at 3, B holds
    assert "evicts it at step 3" in marks[0]["hovertemplate"]
    assert len(base["data"]) + 2 == len(fig["data"])  # the cached figure is not modified
    html = token_strip_html(["a"] * 12, np.full(12, -1), np.full(12, -1), 11)
    sel = re.search(r"title\^='([^']*)'", strip_track_css(1))[1]
    titles = re.findall(r'title="([^"]*)"', html)
    assert sum(t.startswith(sel) for t in titles) == 1  # position 1, not 10 or 11


def test_track_text_states():
    from kvviz.app.explain import track_text

    ea, eb = np.array([-1, 3, -1]), np.array([-1, -1, -1])
    assert track_text(1, None, ea, eb, 2) == "tracked position **1**: A held · B held"
    assert track_text(1, None, ea, eb, 3).endswith("A evicted at step 3 · B held")
    assert "not yet generated" in track_text(2, None, ea, eb, 1)
    assert "“\\*\\_”" in track_text(0, ["*_", "b", "c"], ea, eb, 2)  # markdown escaped


# --- the glossary -------------------------------------------------------------------------
def test_glossary_has_every_registered_policy():
    from kvviz.app.ui.glossary import GLOSSARY, entries

    e = entries()
    assert set(GLOSSARY) <= set(e)
    for name, cls in POLICIES.items():
        key = f"{cls.label} ({name})"
        assert key in e
        if cls.rank is not None:
            assert cls.rank.order in e[key]
        for spec in cls.specs:
            assert f"{spec.label} (default {spec.default})" in e[key]
