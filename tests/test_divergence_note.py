"""The next-divergence jump explains where it stopped: which position, the attention share
that makes it count, each policy's score for it, and a mark on the heatmap."""
import json
from pathlib import Path

import numpy as np
from apphelp import app, ok

from kvviz.app import jumps
from kvviz.app.engine import Engine
from kvviz.core.policies import defaults
from kvviz.core.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]


def runs():
    trace = load_trace(ROOT / "traces" / "prose.npz", layer=0)
    ea = Engine(trace, "tova", 128, defaults("tova"))
    eb = Engine(trace, "snapkv", 128, defaults("snapkv"))
    return trace, ea, eb


def by_hand(trace, ev_a, ev_b, p):
    """The largest share of a step's attention p got while exactly one policy held it."""
    best, at = 0.0, -1
    for s in range(1, trace.steps):
        held_a = p <= s - 1 and (ev_a[p] < 0 or ev_a[p] > s - 1)  # held when s queried
        held_b = p <= s - 1 and (ev_b[p] < 0 or ev_b[p] > s - 1)
        if held_a != held_b:
            row = trace.row(s).astype(np.float64)
            if row[p] / row.sum() > best:
                best, at = row[p] / row.sum(), s
    return best, at


def test_the_share_is_what_the_jump_compares_with_its_threshold():
    trace, ea, eb = runs()
    steps, positions = jumps.notable_divergences(trace, ea.evicted_at, eb.evicted_at, 0.005)
    for p in positions[:5]:
        got = jumps.divergence_share(trace, ea.evicted_at, eb.evicted_at, int(p))
        want = by_hand(trace, ea.evicted_at, eb.evicted_at, int(p))
        assert got[1] == want[1] and np.isclose(got[0], want[0]), (p, got, want)
        assert got[0] > 0.005


def test_the_page_at_a_divergence_names_it_says_why_and_marks_it(apptest):
    trace, ea, eb = runs()
    steps, positions = jumps.notable_divergences(trace, ea.evicted_at, eb.evicted_at, 0.005)
    step, p = int(steps[0]), int(positions[0])
    share, at_step = by_hand(trace, ea.evicted_at, eb.evicted_at, p)
    who = "A" if ea.evicted_at[p] == step else "B"
    page = app(trace="file:prose.npz", layer=0, budget=128, step=step, why=p)  # where D lands
    ok(page)
    note = next(m.value for m in page.markdown if "Next divergence" in m.value)
    assert f"**Next divergence, step {step}:** {who} evicts position {p};" in note
    assert f"step {at_step}'s query gave it {share:.2%} of its attention" in note
    assert "higher than the 0.5% the jump looks for" in note
    # each policy's score for it, read from its own scores at the step
    for e, side in ((ea, "A"), (eb, "B")):
        kept, sc = e.peek(step)
        key = "last" if e.name == "tova" else "pooled"
        v = float(np.asarray(sc[key], np.float64)[int(np.flatnonzero(kept == p)[0])])
        assert f"{side}, {e.name}, ranks it" in note
        assert f"{v:.4g}" in note, (side, v, note)
    heat = [json.loads(c.proto.spec) for c in page.get("plotly_chart")][0]
    marks = [t for t in heat["data"] if str(t.get("name", "")).startswith("next divergence")]
    assert len(marks) == 1 and marks[0]["x"] == [p] and marks[0]["y"] == [step]
    # the same step opened without the jump (no position to explain): no note
    quiet = app(trace="file:prose.npz", layer=0, budget=128, step=step)
    ok(quiet)
    assert not [m for m in quiet.markdown if "Next divergence" in m.value]


def test_pressing_d_lands_on_the_note(apptest):
    trace, ea, eb = runs()
    steps, positions = jumps.notable_divergences(trace, ea.evicted_at, eb.evicted_at, 0.005)
    page = app(trace="file:prose.npz", layer=0, budget=128, step=int(steps[0]) - 1)
    ok(page)
    page.button(key="nav.div").click().run()
    ok(page)
    assert page.session_state["kv"]["step"] == int(steps[0])
    note = next(m.value for m in page.markdown if "Next divergence" in m.value)
    assert f"evicts position {int(positions[0])};" in note
