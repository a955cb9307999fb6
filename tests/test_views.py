"""The explorer's pure parts, without Streamlit: views, state arithmetic, engine, URL state,
exports. Expectations are derived by hand (tiny runs) or by brute force over the held rule."""
import json

import numpy as np
import plotly.graph_objects as go
import pytest
from figurehelp import png_to_codes
from hypothesis import given, settings
from hypothesis import strategies as hst

from kvviz.app import figures as V
from kvviz.app.engine import Engine
from kvviz.app.figures.states import BOTH, NEITHER, NOT_YET, ONLY_A, ONLY_B, bin_edges, dominant_state, state_counts
from kvviz.app.state import ViewState, from_query, to_query
from kvviz.app.ui.export import eviction_log, run_json
from kvviz.core.policies import POLICIES, make_policy
from kvviz.core.replay import Replay, Run, run_policy
from kvviz.core.trace import canonical

# Tiny hand-built runs, T = 6 (held after s  iff  p <= s and (ev == -1 or ev > s)):
#   A: p1 evicted at step 3, p3 at step 5.      B: p2 evicted at step 4, p3 at step 5.
EA = np.array([-1, 3, -1, 5, -1, -1])
EB = np.array([-1, -1, 4, 5, -1, -1])
# held sets written out by hand
HELD_A = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 2, 3}, 4: {0, 2, 3, 4}, 5: {0, 2, 4, 5}}
HELD_B = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 1, 2, 3}, 4: {0, 1, 3, 4}, 5: {0, 1, 4, 5}}


def brute_state(ea, eb, s, p):
    if p > s:
        return NOT_YET
    a = ea[p] == -1 or ea[p] > s
    b = eb[p] == -1 or eb[p] > s
    return BOTH if a and b else ONLY_A if a else ONLY_B if b else NEITHER


def test_held_mask_matches_hand_table():
    for s in range(6):
        assert set(np.flatnonzero(V.held_mask(EA, s))) == HELD_A[s]
        assert set(np.flatnonzero(V.held_mask(EB, s))) == HELD_B[s]


def test_states_at_hand_table():
    assert V.states_at(EA, EB, 4).tolist() == [BOTH, ONLY_B, ONLY_A, BOTH, BOTH, NOT_YET]
    assert V.states_at(EA, EB, 5).tolist() == [BOTH, ONLY_B, ONLY_A, NEITHER, BOTH, BOTH]


def test_symmetric_difference_and_divergence_by_hand():
    assert V.symmetric_difference(EA, EB).tolist() == [0, 0, 0, 1, 2, 2]
    assert V.first_divergence(EA, EB) == 3
    assert V.next_divergence(EA, EB, 0) == 3
    assert V.next_divergence(EA, EB, 3) == 4
    assert V.next_divergence(EA, EB, 4) == -1
    assert V.first_divergence(EA, EA) == -1
    assert V.divergent_positions(EA, EB).tolist() == [1, 2]
    assert V.decision_step(EA, EB, 1) == 3 and V.decision_step(EA, EB, 2) == 4
    assert V.decision_step(EA, EB, 3) == -1
    only_a, only_b = V.only_sets(EA, EB, 4)
    assert only_a.tolist() == [2] and only_b.tolist() == [1]


def test_survival_by_hand():
    assert V.sinks_held(EA, sinks=2).tolist() == [1, 2, 2, 1, 1, 1]
    assert V.sinks_held(EB, sinks=2).tolist() == [1, 2, 2, 2, 2, 2]
    # newest 3 positions at step 3 are 1, 2, 3: A holds 2 and 3
    frac = V.recent_held_fraction(EA, recent=3)
    assert frac[0] == 1.0 and frac[3] == pytest.approx(2 / 3)
    assert frac[5] == pytest.approx(2 / 3)  # 3, 4, 5: p3 evicted at 5


@settings(max_examples=40, deadline=None)
@given(hst.integers(2, 40).flatmap(lambda n: hst.tuples(
    hst.lists(hst.integers(-1, n - 1), min_size=n, max_size=n),
    hst.lists(hst.integers(-1, n - 1), min_size=n, max_size=n),
    hst.integers(1, n), hst.integers(1, n))))
def test_state_counts_equal_brute_force(args):
    ea, eb, sb, pb = args
    n = len(ea)
    # an eviction can only happen at or after admission: clamp to a valid log
    ea = np.array([e if e == -1 or e >= p else p for p, e in enumerate(ea)])
    eb = np.array([e if e == -1 or e >= p else p for p, e in enumerate(eb)])
    se, pe = bin_edges(n, sb), bin_edges(n, pb)
    counts = state_counts(ea, eb, se, pe)
    for i in range(len(se) - 1):
        for j in range(len(pe) - 1):
            want = np.zeros(5, int)
            for s in range(se[i], se[i + 1]):
                for p in range(pe[j], pe[j + 1]):
                    want[brute_state(ea, eb, s, p)] += 1
            assert counts[:, i, j].tolist() == want.tolist()
    sym = V.symmetric_difference(ea, eb)
    for s in range(n):
        assert sym[s] == sum(brute_state(ea, eb, s, p) in (ONLY_A, ONLY_B) for p in range(n))


def test_zoomed_grid_is_the_sub_block_of_the_states():
    rng = np.random.default_rng(3)
    n = 50
    ea = np.array([-1 if rng.random() < 0.3 else int(rng.integers(p, n)) for p in range(n)])
    eb = np.array([-1 if rng.random() < 0.3 else int(rng.integers(p, n)) for p in range(n)])
    g = V.heatmap_grid(ea, eb, max_bins=64, hover_bins=4, steps_range=(10, 30),
                       pos_range=(5, 25))
    want = [[brute_state(ea, eb, s, p) for p in range(5, 25)] for s in range(10, 30)]
    assert g["codes"].tolist() == want
    fig = V.cache_heatmap(ea, eb, 20, grid=g)
    assert fig.data[0].x0 == 5 and fig.data[0].y0 == 10
    assert png_to_codes(fig.data[0].source).tolist() == want
    assert tuple(fig.layout.xaxis.range) == (4.5, 24.5)


def test_bin_edges_cover_and_bound():
    for n, m in ((4096, 1024), (4096, 512), (1000, 1024), (7, 3), (1, 5)):
        e = bin_edges(n, m)
        assert e[0] == 0 and e[-1] == n and np.all(np.diff(e) > 0) and len(e) - 1 <= m


def test_display_state_keeps_one_line_disagreements_visible():
    from kvviz.app.figures.states import display_state
    counts = np.zeros((5, 1, 3), int)
    counts[NEITHER, 0, 0], counts[ONLY_B, 0, 0] = 12, 4    # 4x4 block, one column only B
    counts[NEITHER, 0, 1], counts[ONLY_A, 0, 1] = 13, 3    # less than a full line: mode
    counts[BOTH, 0, 2], counts[ONLY_A, 0, 2], counts[ONLY_B, 0, 2] = 8, 4, 4  # tie -> A
    codes = display_state(counts, [0, 4], [0, 4, 8, 12])
    assert codes.tolist() == [[ONLY_B, NEITHER, ONLY_A]]


def test_dominant_state_picks_mode_and_share():
    counts = np.zeros((5, 1, 2), int)
    counts[BOTH, 0, 0], counts[ONLY_A, 0, 0] = 3, 1
    counts[NOT_YET, 0, 1] = 4
    code, share = dominant_state(counts)
    assert code.tolist() == [[BOTH, NOT_YET]] and share.tolist() == [[0.75, 1.0]]


# --- view 1: heatmap -------------------------------------------------------------------
def test_cache_heatmap_pixels_are_the_states():
    fig = V.cache_heatmap(EA, EB, 4, label_a="tova", label_b="snapkv")
    codes = png_to_codes(fig.data[0].source)
    want = np.array([[brute_state(EA, EB, s, p) for p in range(6)] for s in range(6)])
    assert codes.tolist() == want.tolist()
    # the current step is marked, legend names the policies
    assert any(s.type == "line" and s.y0 == 4 == s.y1 for s in fig.layout.shapes)
    names = [t.name for t in fig.data if t.type == "scatter"]
    assert "only A (tova)" in names and "only B (snapkv)" in names
    hover = fig.data[1]
    assert "steps 4" in hover.text[4][2] and "positions 2" in hover.text[4][2]
    assert "only A (tova)" in hover.text[4][2]


def test_cache_heatmap_hover_shows_tokens():
    g = V.heatmap_grid(EA, EB, hover_bins=3, tokens=["a", " b", "\n", "<c>", "d", "e"])
    assert "tokens: <i>a·b</i>" in g["hover_text"][0][0]
    assert "tokens: <i>⏎&lt;c&gt;</i>" in g["hover_text"][0][1]


def test_cache_heatmap_aggregates_large_runs():
    t = canonical(1500)
    a, b = run_policy(t, "tova", 128), run_policy(t, "h2o", 128)
    g = V.heatmap_grid(a.evicted_at, b.evicted_at, max_bins=256, hover_bins=16)
    fig = V.cache_heatmap(a.evicted_at, b.evicted_at, 700, grid=g)
    codes = png_to_codes(fig.data[0].source)
    assert codes.shape[0] <= 256 and codes.shape[1] <= 256 and (codes >= 0).all()
    assert np.array_equal(codes, g["codes"])
    assert np.asarray(fig.data[1].z).shape == (16, 16)
    # a mixed hover block reports shares that add up to 100%
    assert "%" in "".join("".join(r) for r in fig.data[1].text)


# --- view 2 ---------------------------------------------------------------------------
def test_survival_figure_data():
    fig = V.survival_figure(EA, EB, 3, sinks=2, recent=3)
    assert list(fig.data[0].y) == [1, 2, 2, 1, 1, 1]  # A sinks
    assert list(fig.data[2].y) == [1, 2, 2, 2, 2, 2]  # B sinks
    assert fig.data[0].name.startswith("A") and fig.data[2].name.startswith("B")


# --- view 3: scores ---------------------------------------------------------------------
def snap_panel():
    # sums by hand; pooled with poolKernel 3 = max over neighbours: [5, 5, 3, 3, 9, 9]
    kept = np.array([0, 1, 2, 3, 4, 5])
    sums = np.array([5, 0.1, 3, 0.2, 0.05, 9])
    pooled = np.array([5, 5, 3, 3, 9, 9.0])
    cand = np.array([True] * 5 + [False])
    return dict(label="B: snapkv", policy="snapkv", kept=kept,
                scores={"sums": sums, "pooled": pooled, "candidate": cand},
                victims=np.array([2]))  # lowest pooled, tie 2/3 -> lower position


def test_defended_is_kept_only_because_of_pooling():
    p = snap_panel()
    # own sum ranks position 4 (0.05) lowest, but pooling lifted it to 9: defended
    assert V.defended_positions(p["kept"], p["scores"], p["victims"]).tolist() == [4]
    assert V.defended_positions(p["kept"], p["scores"], np.array([], int)).tolist() == []
    # without pooling scores there is no notion of defended
    assert V.defended_positions(p["kept"], {"last": p["scores"]["sums"],
                                            "candidate": p["scores"]["candidate"]}, [2]).size == 0


def test_eviction_order_directions():
    kept = np.array([0, 1, 2, 3])
    tova = {"last": np.array([0.2, 0.1, 0.1, np.nan]), "candidate": np.array([1, 1, 1, 0], bool)}
    assert V.eviction_order("tova", kept, tova).tolist() == [1, 2, 0]  # ties to lower position
    sc = {"low_count": np.array([1, 5, 5, 0]), "candidate": np.ones(4, bool)}
    assert V.eviction_order("scissorhands", kept, sc).tolist() == [1, 2, 0, 3]


def test_neighbourhood_figure_marks_victims_and_defended():
    tova = dict(label="A: tova", policy="tova", kept=np.array([0, 1, 3, 4, 5]),
                scores={"last": np.array([0.5, 0.1, 0.2, 0.15, np.nan]),
                        "candidate": np.array([1, 1, 1, 1, 0], bool)}, victims=np.array([1]))
    fig = V.neighbourhood_figure([snap_panel(), tova], step=5, center=3, half_width=10)
    by = {(t.name, t.yaxis): t for t in fig.data}
    assert list(by[("victim of B this step", "y")].x) == [2]
    assert list(by[("defended (kept by pooling)", "y")].x) == [4]
    assert list(by[("pooled envelope", "y")].y) == [5, 5, 3, 3, 9, 9]
    assert list(by[("victim of A this step", "y2")].x) == [1]
    tova_bar = by[("current-step weight", "y2")]
    assert list(tova_bar.x) == [0, 1, 3, 4, 5]
    fig = V.neighbourhood_figure([snap_panel(), tova], step=5, center=3, half_width=10,
                                 tokens=["a", " b", "c", "\nd", "e", "f"])
    # A's axis is A's own cache: position 2 (held by B only) is not a column of it
    assert list(fig.layout.xaxis2.ticktext) == ["0<br>a", "1<br>·b", "3<br>⏎d", "4<br>e", "5<br>f"]


def test_neighbourhood_columns_are_the_policys_own_cache_slots():
    # B (snapkv) holds 355 and 376 side by side in its cache; A holds four positions between
    snap_kept = np.array([350, 352, 355, 376, 380, 390])
    sums = np.array([0.3, 0.2, 0.01, 0.4, 0.2, 0.5])
    snap = dict(label="B: snapkv", policy="snapkv", kept=snap_kept, victims=np.array([352]),
                scores={"sums": sums, "pooled": np.array([0.3, 0.3, 0.4, 0.4, 0.5, 0.5]),
                        "candidate": np.array([1, 1, 1, 1, 1, 0], bool)})
    tova = dict(label="A: tova", policy="tova", kept=np.array([355, 360, 365, 370, 375, 390]),
                scores={"last": np.array([0.1, 0.2, 0.3, 0.4, 0.5, np.nan]),
                        "candidate": np.array([1, 1, 1, 1, 1, 0], bool)}, victims=np.array([]))
    fig = V.neighbourhood_figure([snap, tova], step=400, center=355, half_width=3,
                                 tokens=[f"t{i}" for i in range(400)])
    b_axis, a_axis = list(fig.layout.xaxis.categoryarray), list(fig.layout.xaxis2.categoryarray)
    assert b_axis == [350, 352, 355, 376, 380, 390]  # B's slots only, in cache order
    assert b_axis.index(376) - b_axis.index(355) == 1  # pooling neighbours drawn as neighbours
    assert a_axis == [355, 360, 365, 370]  # A's nearest slot to 355 and three after it
    for ax in (fig.layout.xaxis, fig.layout.xaxis2):  # readable from the back of the room
        assert ax.tickangle == 0 and ax.tickfont.size >= 12
        assert ax.matches is None  # each panel has its own axis
    bar = next(t for t in fig.data if t.name == "window sum")
    assert list(bar.x) == b_axis and list(bar.y) == pytest.approx(sums)


def test_why_rows_and_figure():
    p = snap_panel()
    rows = V.why_rows(4, 5, [p])
    assert rows[0]["held before eviction"] and not rows[0]["evicted at this step"]
    assert rows[0]["eviction rank"] == "5 of 5"  # pooled 9 is the safest candidate (tie 4 < 5)
    assert rows[0]["window sum"] == pytest.approx(0.05)
    rows = V.why_rows(2, 5, [p], tokens=list("abcdef"))
    assert rows[0]["evicted at this step"] and rows[0]["eviction rank"] == "1 of 5"
    assert rows[0]["token"] == "c"
    fig = V.why_figure(2, 5, [p])
    assert [t.name for t in fig.data][:2] == ["B: snapkv", "victim of B"]


def test_why_figure_plots_the_victim_at_rank_one_and_labels_fit():
    tova = dict(label="A: tova", policy="tova", kept=np.arange(40),
                scores={"last": np.r_[np.linspace(0.5, 0.01, 39), np.nan],
                        "candidate": np.r_[np.ones(39, bool), False]}, victims=np.array([38]))
    fig = V.why_figure(38, 5, [tova, snap_panel()])
    victims = [t for t in fig.data if t.name.startswith("victim")]
    assert [list(t.x) for t in victims] == [[1], [1]]  # the first to go is rank 1, not 0
    for ax in (fig.layout.xaxis, fig.layout.xaxis2):
        assert ax.tickvals[0] == 1 and 0 not in ax.tickvals and ax.range[0] < 1
    # the highlighted position's label is not clipped and has headroom above the top point
    mark = next(t for t in fig.data if t.name == "position 38")
    assert mark.cliponaxis is False and mark.text == ("p38",)
    top = np.log10(0.5)
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.range[1] > top + 0.1
    # the right panel's y title and ticks sit in the gap, not over the left panel's points
    gap = fig.layout.xaxis2.domain[0] - fig.layout.xaxis.domain[1]
    assert gap * 650 >= 100  # px at the page's chart width on a 1024-wide screen


def test_why_table_has_no_none():
    p = dict(snap_panel(), label="B: snapkv")
    tova = dict(label="A: tova", policy="tova", kept=np.array([0, 1, 2, 3, 4, 5]),
                scores={"last": np.array([0.5, 0.1, 0.2, 0.15, 0.3, np.nan]),
                        "candidate": np.array([1, 1, 1, 1, 1, 0], bool)}, victims=np.array([1]))
    df = V.why_table(5, 5, [tova, p], tokens=list("abcdef"))
    assert list(df.columns) == ["", "A: tova", "B: snapkv"]
    cells = df[["A: tova", "B: snapkv"]].to_numpy().ravel().tolist()
    assert all(isinstance(c, str) for c in cells) and "None" not in cells and "nan" not in cells
    row = dict(zip(df[""], df["A: tova"]))
    assert row["current-step weight"] == "unobserved (newest)"  # TOVA's newest slot, NaN
    assert row["window sum"] == "–"  # SnapKV's score, not TOVA's
    assert row["evicted at this step"] == "no" and row["held before eviction"] == "yes"
    assert dict(zip(df[""], df["B: snapkv"]))["window sum"] == "9"
    gone = V.why_table(7, 5, [dict(tova, kept=np.arange(6))], tokens=list("abcdefgh"))
    assert dict(zip(gone[""], gone["A: tova"]))["held before eviction"] == "no"


# --- view 4 ---------------------------------------------------------------------------
def test_divergence_figure_data():
    fig = V.divergence_figure(EA, EB, 4)
    assert list(fig.data[0].y) == [0, 0, 0, 1, 2, 2]
    assert list(fig.data[1].x) == [2] and list(fig.data[2].x) == [1]
    assert any("first divergence: step 3" in a.text for a in fig.layout.annotations)


# --- view 5 ---------------------------------------------------------------------------
def test_sweep_figure_one_line_per_policy():
    rows = [{"policy": "tova", "budget": 64, "retained_mass": 0.5},
            {"policy": "tova", "budget": 32, "retained_mass": 0.4},
            {"policy": "h2o", "budget": 32, "retained_mass": 0.3}]
    fig = V.sweep_figure(rows, "budget")
    assert [t.name for t in fig.data] == ["tova", "h2o"]
    assert list(fig.data[0].x) == [32, 64] and list(fig.data[0].y) == [0.4, 0.5]
    df = V.metrics_table([{"run": "A", "policy": "tova", "params": "", "budget": 8,
                           "retained_mass": 1.0, "hh_recall": 0.5, "attention_loss": 0.0,
                           "memory_bytes": 104}])
    assert list(df.columns) == ["run", "policy", "params", "budget", "retained mass",
                                "heavy-hitter recall", "attention loss", "memory (bytes)"]


# --- token view --------------------------------------------------------------------------
def test_token_strip_visible_whitespace_and_states():
    toks = ["<b>", " the", "\n", "\tx", "y", "z"]
    html = V.token_strip_html(toks, EA, EB, 4)
    assert "&lt;b&gt;" in html and "<b>" not in html.split("kv-strip")[1]
    ws = '<span class="kv-ws">{}</span>'
    assert ws.format("·") + "the" in html and ws.format("⏎") + "<br>" in html
    assert ws.format("⇥") + "x" in html
    # position 2 held only by A at step 4, position 1 only by B, position 5 not yet
    assert 'title="position 2: only A (A)"' in html
    assert 'title="position 1: only B (B)"' in html
    assert 'title="position 5: not yet generated"' in html
    fig = V.token_timeline_figure(toks, EA, EB, 5, lo=0, hi=6)
    z = np.asarray(fig.data[0].z)
    assert z[-1].tolist() == V.states_at(EA, EB, 5).tolist()
    assert fig.data[0].x[2] == "2 ⏎"


def _rules(html: str) -> dict:
    css = html.split("<style>")[1].split("</style>")[0]
    return {sel.strip(): body for sel, body in (r.split("{") for r in css.split("}") if "{" in r)}


def test_token_strips_wrap_and_put_nothing_between_subwords():
    from kvviz.app.figures import loop as LV
    from kvviz.app.figures import tokens as TV

    toks = ["Top", "ological", " S", "orter", "\n", "np", "red", "ecess", "ors"]
    ev = np.full(len(toks), -1)
    strip = V.token_strip_html(toks, ev, ev, len(toks) - 1)
    d = np.zeros(len(toks) - 1)
    loop = LV.delta_strip_html(toks, d, d, d + 0.5, d + 0.5, label="x")
    for html in (strip, loop):
        rules = _rules(html)
        assert "overflow-wrap:anywhere" in rules[".kv-strip"]  # long lines wrap, never cut
        assert "white-space:normal" in rules[".kv-strip"] and "white-space:pre" not in html
        assert "margin:0" in rules[".kv-strip .kv-tok"] and "padding:1px 0" in rules[".kv-strip .kv-tok"]
        body = html.split('class="kv-strip')[1]
        spans = body.split('<span class="kv-tok')[1:]
        # subwords touch; a line may break only at a word boundary (around " S" and "\n")
        gaps = [sp.rsplit("</span>", 1)[1] for sp in spans[:-1]]
        assert gaps == ["", "<wbr>", "", "<wbr>", "<wbr>", "", "", ""], gaps
    # the Tokens strip opens at its end (the current step), the loop strip at the start
    assert 'class="kv-strip kv-end"' in strip and "column-reverse" in _rules(strip)[".kv-strip.kv-end"]
    assert LV.token_html is TV.token_html  # the loop view uses the public function



# --- engine: fast peek equals the contract's Replay.peek --------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_engine_peek_equals_replay_peek(name):
    from kvviz.core.check import truncated  # the canonical rows, with key norms for knorm

    t = truncated(canonical(300), 300)
    eng = Engine(t, name, 40, every=64)
    ref = Replay(t, make_policy(name, budget=40))
    run = run_policy(t, name, 40)
    assert np.array_equal(eng.evicted_at, run.evicted_at)
    assert np.array_equal(eng.run.evicted_at, run.evicted_at)
    assert np.array_equal(eng.run.retained, run.retained, equal_nan=True)
    assert (eng.run.policy, eng.run.params, eng.run.budget, eng.run.bytes_per_slot) == (
        run.policy, run.params, run.budget, run.bytes_per_slot)
    for step in (0, 1, 39, 40, 41, 63, 64, 65, 200, 299):
        k1, s1 = eng.peek(step)
        k2, s2 = ref.peek(step)
        assert np.array_equal(k1, k2)
        assert s1.keys() == s2.keys()
        for key in s2:
            assert np.array_equal(np.asarray(s1[key]), np.asarray(s2[key]), equal_nan=True)
        assert set(eng.victims(step)) <= set(k1)


def test_engine_refuses_like_make_policy():
    with pytest.raises(ValueError, match="recent_window"):
        Engine(canonical(50), "h2o", 16, {"recent_window": 16})


# --- URL state ---------------------------------------------------------------------------
def test_query_round_trip_and_tolerance():
    st, notes = from_query({"a": "snapkv", "a.poolKernel": "3", "b": "h2o", "b.recentWindow": "8",
                            "budget": "256", "step": "99", "view": "scores", "focus": "12"})
    assert not notes
    assert st.params("a")["pool_kernel"] == 3 and st.params("b") == {"recent_window": 8}
    q = to_query(st)
    assert q["a.poolKernel"] == "3" and q["b.recentWindow"] == "8" and q["step"] == "99"
    assert to_query(from_query(q)[0]) == q
    st2, notes = from_query({"a": "nope", "budget": "x", "b.poolKernel": "3", "view": "bad"})
    # the view name is checked by the page against its registry (tests/test_app.py)
    # a budget that is not a number is dropped: the page opens at the trace's default (None)
    assert st2.a == "tova" and st2.budget is None and st2.view == "bad"
    assert any(n.startswith("budget=") for n in notes)
    assert len(notes) == 2 and st2.params("b")["pool_kernel"] == 3  # b stays snapkv
    _, notes = from_query({"b.poolKernel": "99", "zoom": "7", "colour": "red"})
    assert notes == ["zoom=7 is not one of 0, 32, 128, 512; showing the whole run",
                     "unknown key 'colour' ignored",
                     "b.poolKernel=99 is outside 1–15; using 15"]
    _, notes = from_query({"b": "h2o", "b.poolKernel": "3"})
    assert notes == ["h2o has no parameter 'poolKernel'; ignored"]
    assert ViewState().params("b") == {"obs_window": 16, "pool_kernel": 5, "recent_window": 32,
                                       "pooling": "max"}


# --- exports -----------------------------------------------------------------------------
def test_exports():
    ra = Run("tova", {}, 2, 6, EA, np.r_[np.nan, np.ones(5)])
    rb = Run("h2o", {"recent_window": 1}, 2, 6, EB, np.r_[np.nan, np.ones(5)])
    log = eviction_log(ra, rb, tokens=list("abcdef"))
    assert len(log) == 6 and log["A_evicted_at"].tolist() == EA.tolist()
    assert log["A_steps_held"].tolist() == [6, 2, 4, 2, 2, 1]
    assert log["token"].tolist() == list("abcdef")
    doc = json.loads(run_json({"budget": 2}, ra, rb, [{"run": "A"}]))
    assert doc["A"]["evicted_at"] == EA.tolist() and doc["A"]["retained"][0] is None
    assert doc["B"]["params"] == {"recent_window": 1}


def test_views_and_pure_ui_modules_do_not_import_streamlit():
    import subprocess
    import sys
    code = ("import sys, kvviz.app.figures, kvviz.app.engine, kvviz.app.state, kvviz.app.ui.export; "
            "assert 'streamlit' not in sys.modules, 'streamlit imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=__import__("pathlib").Path(__file__).resolve().parents[1])


def test_state_counts_on_a_long_trace_use_wide_integers():
    n = 40_000  # positions and steps beyond int16
    ea = np.full(n, -1)
    eb = np.full(n, -1)
    ea[5] = 39_999  # A evicts position 5 at the very last step
    se = np.array([0, 39_999, n])
    pe = np.array([0, 10, n])
    c = state_counts(ea, eb, se, pe)
    # last step bin (step 39,999 only), positions 0..9: 9 held by both, position 5 only B
    assert c[BOTH, 1, 0] == 9 and c[ONLY_B, 1, 0] == 1
    assert c[:, 0, 1].sum() == 39_999 * (n - 10)


# --- readable charts, pooling explained --------------------------------------------------
def test_pooling_explanation_in_the_policys_numbers():
    p = snap_panel()  # pooled by hand above: 4 (sum 0.05) is lifted by 5 (sum 9); 2 goes
    assert V.scores.pooled_from(p["kept"], p["scores"]).tolist() == [0, 0, 2, 2, 5, 5]
    e = V.scores.pooling_explanation(p["kept"], p["scores"], p["victims"], 4, {"pool_kernel": 3})
    d, v = e.defended, e.victim
    assert (d.position, d.own, d.source, d.source_sum, d.pooled, d.distance) == (4, 0.05, 5, 9.0, 9.0, 1)
    assert (v.position, v.own, v.pooled, v.source) == (2, 3.0, 3.0, 2)
    assert v.by_pooled.ties == (3,)  # 2 and 3 both pool to 3; the lower position goes
    assert V.scores.pooling_explanation(p["kept"], p["scores"], p["victims"], 3) is None
    text = V.scores.explain_text(e, 5)
    for s in ("position 4's own window sum is 0.05", "Position 5, the next held slot in the "
              "cache, has the window sum 9", "pooled score 9", "Position 2 is evicted instead: "
              "its own sum 3 is higher than 4's", "1 other candidate (3) has exactly 3 too"):
        assert s in text, s
    # the hover over slot 4 says the same numbers
    fig = V.neighbourhood_figure([p], step=5, center=3, half_width=10)
    bar = next(t for t in fig.data if t.name == "window sum")
    hover = dict(zip(bar.x, bar.customdata))[4].replace("<br>", " ")
    assert "own window sum 0.05" in hover and "pooled score 9 (position 5's sum)" in hover
    assert "Position 2 is evicted instead" in hover


def test_victim_marker_takes_the_policy_colour_and_log_ticks_are_plain():
    p = dict(snap_panel(), colour="#0072B2")
    fig = V.neighbourhood_figure([p], step=5, center=3, half_width=10)
    victim = next(t for t in fig.data if t.name.startswith("victim"))
    assert victim.marker.color == "#0072B2"
    ax = fig.layout.yaxis
    assert ax.type == "log" and "log" in ax.title.text
    assert all(not any(c in t for c in "μkme") for t in ax.ticktext)
    assert "0.05" in ax.ticktext and "5" in ax.ticktext


def test_counts_on_a_linear_axis():
    sc = dict(label="A: scissorhands", policy="scissorhands", kept=np.array([0, 1, 2]),
              scores={"low_count": np.array([0, 3, 7]), "candidate": np.ones(3, bool)},
              victims=np.array([2]))
    fig = V.neighbourhood_figure([sc], step=3, center=1)
    assert fig.layout.yaxis.type != "log"
    assert list(fig.data[0].y) == [0, 3, 7]  # a zero count is drawn, not dropped


def test_sweep_marks_the_current_value_and_keeps_shares_honest():
    rows = [{"policy": "snapkv", "pool_kernel": k, "retained_mass": 0.9 + 0.001 * k}
            for k in (1, 3, 5)]
    fig = V.sweep_figure(rows, "pool_kernel", x_label="poolKernel", mark_x=3)
    assert fig.layout.xaxis.title.text == "poolKernel"
    assert list(fig.layout.xaxis.tickvals) == [1, 3, 5]  # odd kernels only
    assert any("poolKernel=3" in a.text for a in fig.layout.annotations)
    lo, hi = fig.layout.yaxis.range
    assert hi <= 1.0 and hi - lo >= 0.2 - 1e-9  # a 0.004 change stays small, a share stays <= 1
    mem = V.sweep_figure([{"policy": "snapkv", "b": 1, "memory_bytes": 100},
                          {"policy": "snapkv", "b": 2, "memory_bytes": 101}], "b", "memory_bytes")
    assert mem.layout.yaxis.range[0] == 0


def test_obs_window_sweep_is_on_a_log_axis_and_bytes_have_separators():
    rows = [{"policy": "snapkv", "obs_window": w, "retained_mass": 0.9} for w in (1, 2, 4, 8, 16)]
    fig = V.sweep_figure(rows, "obs_window", x_label="obsWindow", mark_x=4)
    ax = fig.layout.xaxis
    # 1, 2, 4, 8 a decade apart at most: on a linear axis their labels ran into "124 8"
    assert ax.type == "log" and list(ax.tickvals) == [1, 2, 4, 8, 16]
    assert list(ax.ticktext) == ["1", "2", "4", "8", "16"]
    kernels = [{"policy": "snapkv", "k": k, "retained_mass": 0.9} for k in (1, 3, 5, 7, 9)]
    assert V.sweep_figure(kernels, "k").layout.xaxis.type == "linear"  # evenly spaced
    mem = V.sweep_figure([{"policy": "snapkv", "b": b, "memory_bytes": 85 * b} for b in (64, 512)],
                         "b", "memory_bytes")
    assert mem.layout.yaxis.tickformat == "," and "%{y:,}" in mem.data[0].hovertemplate
    df = V.metrics_table([{"run": "A", "policy": "snapkv", "params": "", "budget": 512,
                           "retained_mass": 1.0, "hh_recall": 0.5, "attention_loss": 0.0,
                           "memory_bytes": 43520}])
    numeric = [c for c in df.columns if df[c].dtype.kind in "if" and c != "budget"]
    assert set(numeric) <= set(V.metrics.TABLE_FORMATS)  # every metric column has a format
    assert V.metrics.TABLE_FORMATS["memory (bytes)"] == "%,d"  # 43,520: Streamlit's printf


def _effective(fig, axis: str, key: str):
    """What plotly draws for layout[axis][key]: the figure's own value, else its template's."""
    own = fig.layout[axis][key]
    return own if own is not None else fig.layout.template.layout[axis.rstrip("0123456789")][key]


def test_light_look_is_the_template_it_replaced():
    """base_layout lays LIGHT on as values where the figure has none; the look is the one
    the template `update_layout(template=LIGHT)` gave, axis by axis, own values winning."""
    from plotly.subplots import make_subplots

    from kvviz.app.figures.common import LIGHT, base_layout

    def fig():
        f = make_subplots(rows=2, cols=2)
        f.add_trace(go.Scatter(x=[0, 1], y=[1, 2]), row=2, col=2)
        f.update_xaxes(ticks="outside", row=1, col=1)  # its own value: kept either way
        f.update_yaxes(gridcolor="#123456", row=2, col=1)
        return f

    new = base_layout(fig(), "t")
    old = fig().update_layout(template=LIGHT)
    axes = [k for k in new.layout if k.startswith(("xaxis", "yaxis"))]
    assert len(axes) == 8
    for ax in axes:
        for key in ("gridcolor", "linecolor", "zerolinecolor", "ticks", "automargin"):
            assert _effective(new, ax, key) == _effective(old, ax, key), (ax, key)
        assert new.layout[ax].title.standoff == old.layout.template.layout.xaxis.title.standoff
    assert new.layout.xaxis.ticks == "outside" and new.layout.yaxis3.gridcolor == "#123456"
    for key in ("paper_bgcolor", "plot_bgcolor", "colorway", "hovermode"):
        assert new.layout[key] == old.layout.template.layout[key]


def test_every_mark_of_the_scores_is_in_the_legend_and_labels_never_run_together():
    """The dotted line at the neighbourhood's centre is named in the legend; a figure of
    every held slot (the class's evidence) draws none; 129 slots get at most MAX_TICKS labels,
    evenly spaced."""
    from kvviz.app.figures.scores import MAX_TICKS
    from kvviz.app.figures.votes import evidence_figure

    fig = V.neighbourhood_figure([snap_panel()], step=5, center=3, half_width=10)
    dotted = [s for s in fig.layout.shapes if s.line.dash == "dot"]
    assert len(dotted) == 1
    named = [t.name for t in fig.data if t.type == "scatter" and t.line.dash == "dot"]
    assert named == ["dotted: the slots' centre, position 3"]
    n = 129
    kept = np.arange(n)
    panel = dict(label="A: tova", policy="tova", kept=kept, victims=np.array([], np.int64),
                 scores={"last": np.linspace(0.01, 1, n), "candidate": np.ones(n, bool)})
    ev = evidence_figure(panel, step=200)
    assert not [s for s in ev.layout.shapes if s.line.dash == "dot"]
    assert not [t for t in ev.data if (t.name or "").startswith("dotted")]
    ticks = list(ev.layout.xaxis.tickvals)
    assert len(ticks) <= MAX_TICKS and ticks[0] == 0
    assert len({b - a for a, b in zip(ticks, ticks[1:])}) == 1  # evenly spaced
