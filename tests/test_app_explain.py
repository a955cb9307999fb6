"""Explanations on the page (AppTest): the toy trace and its guided experiment, the tracked
position across views, and the new jumps. Expected values come from kvviz.core.replay runs
and hand pooling here, not from the page's own helpers."""
import json
import shutil

import numpy as np
import pytest
from apphelp import REPO, app, arr, ok, traces_dir

from kvviz.app import jumps as J
from kvviz.core.policies import make_policy
from kvviz.core.replay import NEVER, Replay, run_policy
from kvviz.core.trace import canonical, load_trace


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    shutil.copy(REPO / "traces" / "toy.npz", d / "toy.npz")
    with traces_dir(d):
        yield d


def specs(at):
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def qp(at):
    return {k: at.query_params[k][0] if isinstance(at.query_params[k], list) else at.query_params[k]
            for k in at.query_params}


def text_of(at):
    return " ".join(m.value for m in at.markdown)


def test_toy_trace_and_its_experiment(traces, apptest):
    from kvviz.app.ui.experiments import TOY_PARAMS

    at = app()
    ok(at)
    assert "traces/toy.npz" in at.selectbox(key="w.trace").options  # the picker offers it
    at.button(key="exp.toy").click().run()
    ok(at)
    q = qp(at)
    assert (q["trace"], q["budget"], q["a"], q["b"], q["view"]) == ("file:toy.npz", "4", "tova",
                                                                    "snapkv", "cache")
    step, track = int(q["step"]), int(q["track"])
    assert q["focus"] == str(track)
    trace = load_trace(traces / "toy.npz")
    # the heatmap: every cell of every row labelled with the trace's own weight
    heat = specs(at)[0]
    cells = next(d for d in heat["data"] if d.get("name") == "weights")
    xs, ys = arr(cells["x"]).tolist(), arr(cells["y"]).tolist()
    assert len(cells["text"]) == 120
    for x, y, label in zip(xs, ys, cells["text"]):
        assert label == f"{trace.row(int(y))[int(x)]:.2f}"
    # the experiment's text against SnapKV replayed here, pooled by hand (kernel 3: radius 1)
    rp = Replay(trace, make_policy("snapkv", budget=4, **TOY_PARAMS))
    rp.seek(step - 1)
    kept, sc = rp.peek(step)
    victims = rp.step().tolist()
    sums = np.asarray(sc["sums"])
    pooled = [sums[max(0, i - 1):i + 2].max() for i in range(len(sums))]
    i = kept.tolist().index(track)
    assert track not in victims
    assert sums[i] == min(sums[j] for j in range(len(kept)) if sc["candidate"][j])
    text = next(m.value for m in at.markdown if "Experiment: Start here" in m.value)
    assert f"At step **{step}**" in text
    assert f"position {track}'s own window sum is {sums[i]:.4g}" in text
    assert f"gives {track} the pooled score {pooled[i]:.4g} and it stays" in text
    tova = run_policy(trace, "tova", 4).evicted_at
    for p in np.flatnonzero(tova == step):
        assert f"Position {p}: A, tova, ranks it" in text
    # the Scores view: every bar carries its value
    at.segmented_control(key="w.view").set_value("scores").run()
    ok(at)
    bars = [d for d in specs(at)[0]["data"] if d["type"] == "bar"]
    assert bars
    for b in bars:
        y = arr(b["y"]).astype(float)
        assert [t for t in b["text"]] == ["" if not np.isfinite(v) else f"{v:.3g}" for v in y]
    assert f"Tracked position {track}" in text_of(at)


def test_tracked_position_across_views(traces, apptest):
    trace = canonical()
    ea = run_policy(trace, "tova", 512).evicted_at
    eb = run_policy(trace, "snapkv", 512).evicted_at
    at = app(track=40, step=520)
    ok(at)
    assert qp(at)["track"] == "40"

    def said(e, step):
        return "held" if e == NEVER or e > step else f"evicted at step {e}"

    assert (f"tracked position **40**: A {said(ea[40], 520)} · B {said(eb[40], 520)}"
            in text_of(at))
    heat = specs(at)[0]
    marks = [d for d in heat["data"] if str(d.get("name", "")).startswith("tracked 40")]
    assert [m["y"][0] for m in marks] == [int(e) if e != NEVER else trace.steps - 1
                                          for e in (ea[40], eb[40])]
    nxt = min(e for e in (int(ea[40]), int(eb[40])) if e > 520)
    at.button(key="nav.track").click().run()
    ok(at)
    assert qp(at)["step"] == str(nxt)
    assert f"evicted at step {nxt}" in text_of(at)
    at.segmented_control(key="w.view").set_value("scores").run()
    ok(at)
    assert "Tracked position 40" in text_of(at)
    # a tracked position the trace does not have is dropped with a note
    at = app(track=99999)
    ok(at)
    assert "track" not in qp(at)
    assert any("track=99999 is not a position" in w.value for w in at.warning)


def test_tracked_token_in_the_strip(traces, apptest):
    at = app(trace="file:toy.npz", budget=4, b__recentWindow=1, view="tokens", track=5, step=9)
    ok(at)
    strip = " ".join(h.proto.body for h in at.get("html"))
    assert "title^='position 5:'" in strip and 'title="position 5:' in strip
    assert "tracked position **5** “·mat”" in text_of(at).replace("\\", "")


def test_jumps(traces, apptest):
    trace = canonical().keep_rows()
    ea = run_policy(trace, "tova", 512).evicted_at
    eb = run_policy(trace, "snapkv", 512).evicted_at
    steps, positions = J.notable_divergences(trace, ea, eb, J.NOTABLE_SHARE)
    at = app(step=512)
    ok(at)
    nav = at.button(key="nav.div")
    assert "0.5%" in nav.help and "attention" in nav.help  # the page says what it looks for
    nav.click().run()
    ok(at)
    k = int(np.searchsorted(steps, 512, side="right"))
    assert qp(at)["step"] == str(steps[k]) and qp(at)["why"] == str(positions[k])
    at.button(key="nav.epoch").click().run()
    ok(at)
    assert qp(at)["step"] == str((int(steps[k]) // 512 + 1) * 512)
    here = int(qp(at)["step"])
    hh = J.heavy_hitter_evictions(J.first_heavy(trace, 128), ea, eb)
    at.button(key="nav.hh").click().run()
    ok(at)
    assert qp(at)["step"] == str(int(hh[np.searchsorted(hh, here, side="right")]))
    # the threshold is a choice on the page
    here = int(qp(at)["step"])
    at.selectbox(key="nav.share").set_value(0.002).run()
    assert qp(at)["nav.share"] == "0.002"  # the choice is in the link
    ok(at)
    s2, p2 = J.notable_divergences(trace, ea, eb, 0.002)
    k = int(np.searchsorted(s2, here, side="right"))
    assert "0.2%" in at.button(key="nav.div").help
    at.button(key="nav.div").click().run()
    ok(at)
    assert qp(at)["step"] == str(s2[k]) and qp(at)["why"] == str(p2[k])


def test_glossary_lists_the_policies(traces, apptest):
    at = app(trace="file:toy.npz", budget=4, b__recentWindow=1)
    ok(at)
    gloss = text_of(at)
    for key in ("**TOVA (tova)**", "**SnapKV (snapkv)**", "**H2O (h2o)**"):
        assert key in gloss


def test_experiment_texts_say_the_runs_numbers(traces, apptest):
    from kvviz.core.metrics import retained_mass

    trace = canonical()
    at = app()
    at.button(key="exp.budget-256").click().run()
    ok(at)
    text = next(m.value for m in at.markdown if "Experiment: Budget 256" in m.value)
    for who, name, kw in (("A", "tova", {}), ("B", "h2o", {})):
        ev = run_policy(trace, name, 256, **kw).evicted_at
        held = [p for p in range(4096) if ev[p] == NEVER]  # at the last step
        sinks, recent = sum(p < 4 for p in held), sum(p > 4095 - 64 for p in held)
        assert f"{who} ({name}) holds {sinks} of the 4 sinks and {recent} of the 64 newest" in text
    at.button(key="exp.pooling-off").click().run()
    ok(at)
    text = next(m.value for m in at.markdown if "Experiment: Pooling off" in m.value)
    ra = retained_mass(run_policy(trace, "tova", 512))
    rb = retained_mass(run_policy(trace, "snapkv", 512, pool_kernel=1))
    assert ra == rb and f"retained mass A {ra:.4g}, B {rb:.4g}: identical to the last digit" in text
    at.button(key="exp.quiet-hh").click().run()
    ok(at)
    q = qp(at)
    text = next(m.value for m in at.markdown if "Experiment: The quiet" in m.value)
    pos, step = int(q["why"]), int(q["step"])
    ea = run_policy(trace, "tova", 512).evicted_at
    assert int(ea[pos]) == step
    assert f"Position {pos}: A evicted it at step {step}" in text
    assert "A, tova, ranks it" in text and text.rstrip(".").split("B, h2o,")[1].endswith("it stays")


def test_the_divergence_threshold_comes_from_the_link(traces, apptest):
    """A shared link carries the next-divergence jump's threshold; a bad one falls back, said."""
    at = app(nav__share="0.02")
    ok(at)
    assert at.selectbox(key="nav.share").value == 0.02
    assert "2.0%" in at.button(key="nav.div").label
    at = app(nav__share="lots")
    assert not at.exception
    assert at.selectbox(key="nav.share").value == 0.005
    assert any("nav.share='lots' is not a number" in w.value for w in at.warning)
