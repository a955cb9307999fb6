"""The explorer page under AppTest (streamlit.testing.v1): every control, every view, the URL
round trip, refused parameters, guided experiments and downloads. Figures are checked
through their JSON (`at.get("plotly_chart")[i].proto.spec`), not just their presence."""
import json
import shutil

import numpy as np
import pytest
from apphelp import REPO, app, arr, ok, softmax_rows, traces_dir
from figurehelp import png_to_codes
from streamlit.testing.v1 import AppTest

from kvviz.core.trace import save_trace

T = 160


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    rng = np.random.default_rng(7)
    tokens = [" the", "\n", "cat", "\tsat", "<b>"] * (T // 5)
    save_trace(d / "tiny.npz", softmax_rows(rng, T, 2), tokens=tokens, layers=[3, 7],
               meta={"name": "tiny", "model": "test-model", "source": "random test rows"})
    save_trace(d / "plain.npz", softmax_rows(rng, 90, 1), meta={"name": "plain"})
    shutil.copy(REPO / "traces" / "prose.npz", d / "prose.npz")  # the pooling experiment's
    with traces_dir(d):
        yield d


def tiny(**query) -> AppTest:
    return app(trace="file:tiny.npz", budget=48, **query)


def specs(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def qp(at: AppTest) -> dict:
    return {k: at.query_params[k][0] if isinstance(at.query_params[k], list) else at.query_params[k]
            for k in at.query_params}


def heatmap(at: AppTest) -> dict:
    return next(s for s in specs(at) if s["data"][0]["type"] == "image")


def title(spec) -> str:
    return spec["layout"]["title"]["text"]


# --- default page (canonical trace) -----------------------------------------------------
def test_default_page_canonical(traces, apptest):
    at = app()
    ok(at)
    q = qp(at)
    assert q["trace"] == "canonical" and q["a"] == "tova" and q["b"] == "snapkv"
    assert q["budget"] == "512" and q["b.poolKernel"] == "5" and q["b.obsWindow"] == "16"
    assert q["step"] == "512"  # opens at the first divergence
    spec = heatmap(at)
    codes = png_to_codes(spec["data"][0]["source"])
    assert codes.shape == (512, 512) and (codes >= 0).all()  # 4096 steps -> 8x8 blocks
    assert title(spec) == "Cache contents over time: A = tova, B = snapkv"
    labels = [s.label for s in at.sidebar.slider]
    assert labels == ["obsWindow", "poolKernel", "recentWindow"]
    pool = at.slider(key="w.pb.pool_kernel")
    assert (pool.min, pool.max, pool.step) == (1, 15, 2)  # odd values only
    assert "traces/tiny.npz" in at.selectbox(key="w.trace").options


def test_a_page_run_builds_each_policy_once(traces, apptest, monkeypatch):
    """The sidebar builds A's and B's policies to check their settings, and the replays use
    those objects: one construction per configuration per run, cold or cached."""
    from kvviz.core.policies.base import Policy

    built, original = [], Policy.__post_init__

    def counted(self):
        original(self)
        built.append((self.name, self.budget))

    monkeypatch.setattr(Policy, "__post_init__", counted)
    at = app(trace="file:tiny.npz", budget=47, step=60)  # a budget no other test replays
    ok(at)
    assert sorted(built) == [("snapkv", 47), ("tova", 47)]
    built.clear()
    at.slider(key="w.step").set_value(61).run()  # the replays are cached now
    ok(at)
    assert sorted(built) == [("snapkv", 47), ("tova", 47)]


# --- every view ------------------------------------------------------------------------
def test_cache_view_heatmap_matches_states(traces, apptest):
    at = tiny(step=100)
    ok(at)
    spec = heatmap(at)
    codes = png_to_codes(spec["data"][0]["source"])
    assert codes.shape == (T, T)  # below 1024: one pixel per cell
    # upper triangle (position > step) is "not yet generated" (code 0)
    assert (codes[np.triu_indices(T, 1)] == 0).all()
    shapes = spec["layout"]["shapes"]
    assert any(s.get("y0") == 100 == s.get("y1") for s in shapes)


def test_cache_view_zoom(traces, apptest):
    at = tiny(step=100)
    at.segmented_control(key="w.zoom").set_value(32).run()
    ok(at)
    spec = heatmap(at)
    assert qp(at)["zoom"] == "32"
    codes = png_to_codes(spec["data"][0]["source"])
    # steps 68..132; positions: 129 around the positions evicted at step 100
    assert codes.shape == (65, 129)
    x0 = int(spec["data"][0]["x0"])
    assert spec["data"][0]["y0"] == 68
    whole = tiny(step=100)
    full = png_to_codes(heatmap(whole)["data"][0]["source"])
    assert np.array_equal(codes, full[68:133, x0:x0 + 129])
    # the zoom follows a chosen position (set in the Scores view)
    at2 = tiny(step=100, zoom=32, focus=70)
    assert int(heatmap(at2)["data"][0]["x0"]) == 6  # 70 - 2*32


def test_each_view_present(traces, apptest):
    at = tiny(step=90)
    ok(at)
    seg = at.segmented_control(key="w.view")
    assert set(seg.options) >= {"Cache heatmap", "Sinks & recent", "Scores", "Divergence",
                                "Metrics & sweeps", "Tokens", "Export"}
    seen = {}
    for view in ("survival", "scores", "divergence", "metrics", "tokens", "export"):
        at.segmented_control(key="w.view").set_value(view).run()
        ok(at)
        assert qp(at)["view"] == view
        seen[view] = specs(at)
    surv = seen["survival"][0]
    sinks_a = arr(surv["data"][0]["y"])
    assert len(sinks_a) == T and sinks_a.max() <= 4
    scores = seen["scores"][0]
    names = {d.get("name") for d in scores["data"]}
    assert {"window sum", "pooled envelope", "current-step weight"} <= names
    div = seen["divergence"]
    assert "|A Δ B|" in div[0]["data"][0]["name"]
    assert len(div) == 2 and "Why position" in title(div[1])  # the "why" chart
    assert "Tokens" in title(seen["tokens"][0])
    assert seen["export"] == []  # downloads and a table, no chart
    assert len(at.get("download_button")) == 3


def test_token_view_follows_step(traces, apptest):
    at = tiny(step=50, view="tokens")
    ok(at)
    html = at.get("html")[0].proto.body
    assert "step 50" in html and "⏎" in html and "&lt;b&gt;" in html
    tl = specs(at)[0]
    z = arr(tl["data"][0]["z"])
    assert z.shape[1] == 60
    at.slider(key="w.step").set_value(120).run()
    assert "step 120" in at.get("html")[0].proto.body


def test_metrics_and_sweeps(traces, apptest):
    at = tiny(view="metrics")
    ok(at)
    df = at.table[0].value
    assert list(df["run"]) == ["A", "B"] and 0 < df["retained mass"].iloc[0] <= 1
    for key in ("sweep.budget", "sweep.pool", "sweep.obs"):
        at.button(key=key).click().run()
        ok(at)
    charts = specs(at)
    titles = [title(c) for c in charts]
    assert any("across budgets" in t for t in titles)
    pool = next(c for c in charts if "poolKernel" in title(c))
    assert arr(pool["data"][0]["x"]).tolist() == [1, 3, 5, 7, 9, 11, 13, 15]  # odd only
    assert pool["layout"]["xaxis"]["title"]["text"] == "poolKernel"
    marks = [a.get("text", "").strip() for a in pool["layout"]["annotations"]]
    assert "now: poolKernel=5" in marks
    obs = next(c for c in charts if "obsWindow" in title(c))
    assert arr(obs["data"][0]["x"]).tolist()[:3] == [1, 2, 4]
    budgets = next(c for c in charts if "across budgets" in title(c))
    # every built-in policy that runs on this trace (the ones reading key or value norms refuse it)
    assert {d["name"] for d in budgets["data"]} == {"tova", "snapkv", "h2o", "streaming-llm",
                                                     "scissorhands", "random", "raas"}


def download_bytes(button) -> bytes:
    """The bytes behind an AppTest download button (AppTest keeps them in the in-memory media
    file storage of the one MediaFileManager it creates)."""
    import gc

    from streamlit.runtime.media_file_manager import MediaFileManager
    file_id = button.proto.url.rsplit("/", 1)[-1].split(".")[0]
    for mgr in (o for o in gc.get_objects() if isinstance(o, MediaFileManager)):
        try:
            return bytes(mgr._storage.get_file(file_id).content)
        except Exception:  # another manager's storage
            continue
    raise LookupError(file_id)


def test_downloads(traces, apptest):
    import io

    import pandas as pd

    from kvviz.core.replay import run_policy
    from kvviz.core.trace import load_trace

    at = tiny(view="export")
    ok(at)
    dl = at.get("download_button")
    labels = [d.proto.label for d in dl]
    assert labels == ["eviction log (CSV)", "metrics (CSV)", "run (JSON)"]
    assert [d.proto.url.rsplit(".", 1)[-1] for d in dl] == ["csv", "csv", "json"]
    # independently: the same runs straight from the policy core
    trace = load_trace(traces / "tiny.npz")
    ra, rb = run_policy(trace, "tova", 48), run_policy(trace, "snapkv", 48)
    log = pd.read_csv(io.BytesIO(download_bytes(dl[0])), keep_default_na=False)
    assert log["A_evicted_at"].tolist() == ra.evicted_at.tolist()
    assert log["B_evicted_at"].tolist() == rb.evicted_at.tolist()
    assert log["token"].tolist()[:3] == [" the", "\n", "cat"]
    metrics = pd.read_csv(io.BytesIO(download_bytes(dl[1])))
    assert metrics["run"].tolist() == ["A", "B"] and "retained_mass" in metrics
    doc = json.loads(download_bytes(dl[2]))
    assert doc["A"]["evicted_at"] == ra.evicted_at.tolist()
    assert doc["config"]["budget"] == 48 and doc["config"]["url_query"]["b"] == "snapkv"


# --- controls --------------------------------------------------------------------------
def test_step_navigation_buttons(traces, apptest):
    at = tiny(step=60)
    ok(at)
    at.button(key="nav.next").click().run()
    assert at.slider(key="w.step").value == 61 and qp(at)["step"] == "61"
    at.button(key="nav.prev").click().run()
    at.button(key="nav.prev").click().run()
    assert at.slider(key="w.step").value == 59
    before = at.slider(key="w.step").value
    at.button(key="nav.div").click().run()
    ok(at)
    after = at.slider(key="w.step").value
    assert after > before
    # the status line reports a different eviction at the divergence step
    assert at.slider(key="w.step").value == int(qp(at)["step"])
    at.slider(key="w.step").set_value(T - 1).run()
    assert qp(at)["step"] == str(T - 1)


def test_play_toggle_and_tick(traces, apptest):
    from kvviz.app.ui.panels import advance
    assert advance(10, 4, 100) == (14, True)
    assert advance(98, 4, 100) == (99, False)
    at = tiny(step=10)
    at.toggle(key="w.play").set_value(True).run()
    ok(at)  # a page run while playing does not advance by itself (only timer ticks do)
    assert at.slider(key="w.step").value == 10
    at.selectbox(key="w.speed").set_value(16).run()
    ok(at)
    at.toggle(key="w.play").set_value(False).run()
    ok(at)


def test_budget_policy_and_param_controls(traces, apptest):
    at = tiny()
    at.number_input(key="w.budget").set_value(40).run()
    ok(at)
    assert qp(at)["budget"] == "40"
    at.selectbox(key="w.a").set_value("h2o").run()
    ok(at)
    assert "b.poolKernel" in qp(at) and qp(at)["a"] == "h2o" and "a.recentWindow" in qp(at)
    at.slider(key="w.pb.pool_kernel").set_value(1).run()
    at.slider(key="w.pb.obs_window").set_value(4).run()
    ok(at)
    assert qp(at)["b.poolKernel"] == "1" and qp(at)["b.obsWindow"] == "4"
    assert "snapkv (obsWindow=4, poolKernel=1)" in title(heatmap(at))


def test_layer_select(traces, apptest):
    at = tiny()
    ok(at)
    layer = at.selectbox(key="w.layer")
    assert layer.options == ["model layer 3", "model layer 7"]
    first = heatmap(at)["data"][0]["source"]
    layer.set_value(7).run()  # options are model layer numbers
    ok(at)
    assert qp(at)["layer"] == "7"
    assert heatmap(at)["data"][0]["source"] != first  # different attention, different caches
    at.selectbox(key="w.trace").set_value("file:plain.npz").run()
    ok(at)
    with pytest.raises(KeyError):  # a one-layer trace offers no layer choice
        at.selectbox(key="w.layer")
    assert all(s.key != "w.layer" for s in at.selectbox)


def test_scores_zoom_position(traces, apptest):
    at = tiny(step=100, view="scores", focus=30)
    ok(at)
    spec = specs(at)[0]
    xs = np.concatenate([arr(d["x"]) for d in spec["data"] if "x" in d and d.get("type") == "bar"])
    assert xs.min() <= 30 <= xs.max()
    at.number_input(key="w.focus").set_value(90).run()
    spec = specs(at)[0]
    xs = np.concatenate([arr(d["x"]) for d in spec["data"] if d.get("type") == "bar"])
    assert xs.min() <= 90 <= xs.max() and qp(at)["focus"] == "90"
    assert xs.min() > 30


# --- URL -------------------------------------------------------------------------------
def test_url_round_trip(traces, apptest):
    at = tiny(a="h2o", a__recentWindow=8, b="snapkv", b__poolKernel=3, b__obsWindow=2, step=77,
              view="divergence", why=-1)
    ok(at)
    assert at.selectbox(key="w.a").value == "h2o"
    assert at.slider(key="w.pa.recent_window").value == 8
    assert at.slider(key="w.pb.pool_kernel").value == 3
    assert at.slider(key="w.step").value == 77
    q = qp(at)
    figs = specs(at)
    # opening the same link in a fresh session reproduces the view exactly
    again = app(**{k.replace(".", "__"): v for k, v in q.items()})
    ok(again)
    assert qp(again) == q
    assert specs(again) == figs


def test_bad_link_values_are_reported_not_fatal(traces, apptest):
    at = app(a="nonsense", budget="lots", trace="file:missing.npz")
    ok(at)
    warnings = " ".join(w.value for w in at.warning)
    assert "unknown policy" in warnings and "not an integer" in warnings
    assert any("not available" in e.value for e in at.sidebar.error)
    assert qp(at)["trace"] == "canonical"


def test_both_policies_refused_still_finish_the_run(traces, apptest):
    """Nothing to draw: both refusals said, no view, and the run still ends as every run
    does (the link written, so the next setting brings the page back)."""
    at = tiny(a="h2o", a__recentWindow=60, b__recentWindow=50)  # budget 48
    ok(at)
    errors = [e.value for e in at.error]
    assert sum("refuses these settings" in e for e in errors) == 2
    assert any("Neither policy can run" in e for e in errors)
    assert not at.get("plotly_chart")
    q = qp(at)
    assert (q["a"], q["a.recentWindow"], q["b.recentWindow"]) == ("h2o", "60", "50")
    at.slider(key="w.pa.recent_window").set_value(8).run()
    ok(at)
    errors = " ".join(e.value for e in at.error)
    assert "Policy B (snapkv) refuses" in errors
    assert "Policy A (h2o (recentWindow=8)) is drawn alone" in errors
    assert "A = h2o (recentWindow=8), B = h2o (recentWindow=8)" in title(heatmap(at))
    assert qp(at)["a.recentWindow"] == "8"


def test_refused_parameters_keep_page_up(traces, apptest):
    at = tiny(b__recentWindow=60)  # budget 48
    ok(at)
    errors = " ".join(e.value for e in at.error)
    assert "recentWindow must be smaller than budget" in errors and "recent_window" not in errors
    assert "Policy A (tova) is drawn alone" in errors
    assert "A = tova, B = tova" in title(heatmap(at))  # A's views stay up
    at.slider(key="w.pb.recent_window").set_value(8).run()
    ok(at)
    assert not at.error and "B = snapkv" in title(heatmap(at))
    at = tiny(a="snapkv", a__poolKernel=4)
    ok(at)
    assert any("poolKernel must be odd" in e.value for e in at.error)
    # an experiment button still works from the refused state
    at.button(key="exp.budget-256").click().run()
    ok(at)
    assert not at.error


# --- guided experiments ----------------------------------------------------------------
def test_experiment_pooling_off(traces, apptest):
    at = tiny()
    at.button(key="exp.pooling-off").click().run()
    ok(at)
    q = qp(at)
    assert (q["trace"], q["a"], q["b"], q["b.poolKernel"], q["budget"]) == (
        "canonical", "tova", "snapkv", "1", "512")
    df = at.table[0].value
    assert df["retained mass"].iloc[0] == df["retained mass"].iloc[1]
    assert "Pooling off" in " ".join(m.value for m in at.markdown)


def test_experiment_obswindow(traces, apptest):
    at = tiny()
    at.button(key="exp.obswindow").click().run()
    ok(at)
    q = qp(at)
    assert q["a"] == q["b"] == "snapkv" and q["a.obsWindow"] == "1" and q["b.obsWindow"] == "64"
    df = at.table[0].value
    assert df["retained mass"].iloc[0] == df["retained mass"].iloc[1]
    assert df["memory (bytes)"].iloc[1] > df["memory (bytes)"].iloc[0]


def test_experiment_budget_256(traces, apptest):
    at = tiny()
    at.button(key="exp.budget-256").click().run()
    ok(at)
    q = qp(at)
    assert (q["budget"], q["a"], q["step"], q["view"]) == ("256", "tova", "4095", "survival")
    spec = specs(at)[0]
    sinks_a, recent_a = arr(spec["data"][0]["y"]), arr(spec["data"][1]["y"])
    assert sinks_a[-1] == 4 and recent_a[-1] == 1.0


def test_experiment_quiet_heavy_hitter(traces, apptest):
    at = tiny()
    at.button(key="exp.quiet-hh").click().run()
    ok(at)
    q = qp(at)
    assert (q["a"], q["b"], q["view"]) == ("tova", "h2o", "divergence")
    pos, step = int(q["why"]), int(q["step"])
    table = at.table[0].value  # one row per quantity, one column per policy
    tova, h2o = (dict(zip(table[""], table[c])) for c in table.columns[1:3])
    assert tova["evicted at this step"] == "yes" and h2o["evicted at this step"] == "no"
    assert h2o["held before eviction"] == "yes"
    assert tova["position"] == str(pos) and tova["step"] == str(step)
    assert step >= 512  # after the heavy hitters are redrawn


# --- every policy in every view -----------------------------------------------------------
VIEWS = ("cache", "survival", "scores", "divergence", "metrics", "tokens", "export")


@pytest.mark.parametrize("name", ["tova", "snapkv", "h2o", "streaming-llm", "scissorhands",
                                  "random"])
def test_every_policy_in_every_view(traces, name, apptest):
    at = tiny(a=name, b="h2o" if name != "h2o" else "scissorhands", step=120)
    ok(at)
    for view in VIEWS:
        at.segmented_control(key="w.view").set_value(view).run()
        ok(at)
        assert not at.error, (name, view, [e.value for e in at.error])
        # every view: a one-line caption first, and the glossary one click away
        assert at.caption, view
        assert any("**heavy-hitter recall**" in m.value for m in at.markdown), view


def test_budget_larger_than_the_trace(traces, apptest):
    at = app(trace="file:plain.npz", budget=90)  # 90 steps: nothing is ever evicted
    ok(at)
    assert qp(at)["budget"] == "90"
    assert "nothing is ever evicted" in warnings(at)
    for view in VIEWS[:5]:
        at.segmented_control(key="w.view").set_value(view).run()
        ok(at)
        if view == "divergence":
            assert any("never evict differently" in i.value for i in at.info)


def test_remaining_controls(traces, apptest):
    at = tiny(step=100, view="divergence")
    ok(at)
    # policy B by its selectbox
    at.selectbox(key="w.b").set_value("scissorhands").run()
    ok(at)
    assert qp(at)["b"] == "scissorhands" and "b.historyWindow" in qp(at)
    # the "why" position by its number box, then "go to step"
    why = dict(zip(*at.table[0].value.iloc[:, :2].T.values))  # quantity -> A's value
    pos = int(why["position"])
    at.number_input(key="w.why").set_value(pos).run()
    ok(at)
    assert qp(at)["why"] == str(pos)
    why = dict(zip(*at.table[0].value.iloc[:, :2].T.values))
    dstep = int(why["step"])
    at.button(key="why.go").click().run()
    ok(at)
    assert at.slider(key="w.step").value == dstep
    # sweep metric radio redraws the sweep with another metric
    at.segmented_control(key="w.view").set_value("metrics").run()
    at.button(key="sweep.pool").click().run()
    at.radio(key="w.sweep_metric").set_value("memory_bytes").run()
    ok(at)
    pool = next(c for c in specs(at) if "poolKernel" in title(c))
    assert pool["layout"]["yaxis"]["title"]["text"] == "memory (bytes)"
    mem = arr(pool["data"][0]["y"])
    assert np.all(mem == mem[0])  # poolKernel does not change SnapKV's memory
    # an experiment's explanation can be closed
    at.button(key="exp.budget-256").click().run()
    assert any("Experiment:" in m.value for m in at.markdown)
    at.button(key="exp.close").click().run()
    ok(at)
    assert not any("Experiment:" in m.value for m in at.markdown) and "exp" not in qp(at)


def test_zoom_to_defended_slot(traces, apptest):
    # canonical, SnapKV, a step where pooling defends a slot (found from the page itself)
    at = app(step=1304, view="scores")
    ok(at)
    buttons = [b for b in at.button if b.key.startswith("scores.defended.")]
    assert buttons, "no defended slot at step 1304 on the canonical trace"
    target = int(buttons[0].label.split()[-1])
    buttons[0].click().run()
    ok(at)
    assert qp(at)["focus"] == str(target)
    spec = specs(at)[0]
    d = next(t for t in spec["data"] if t.get("name", "").startswith("defended"))
    assert target in arr(d["x"]).tolist()


def test_both_policies_defending_a_slot_each_get_their_zoom_button(traces, apptest):
    # A and B both SnapKV (kernels 9 and 5): at step 900 pooling defends position 5 in each,
    # so the page draws one zoom button per policy, and neither run may raise
    at = app(view="scores", a="snapkv", a__poolKernel=9, b="snapkv", budget=256, step=900)
    ok(at)
    buttons = {b.key: b for b in at.button if b.key.startswith("scores.defended.")}
    assert sorted(buttons) == ["scores.defended.a", "scores.defended.b"]
    target = int(buttons["scores.defended.b"].label.split()[-1])
    buttons["scores.defended.b"].click().run()
    ok(at)
    assert qp(at)["focus"] == str(target)


def test_positions_beyond_a_new_trace_are_reset(traces, apptest):
    at = app(step=3000, view="scores", focus=3000, why=2500)
    ok(at)
    at.selectbox(key="w.trace").set_value("file:plain.npz").run()  # 90 steps
    ok(at)
    assert qp(at)["focus"] == "-1" and int(qp(at)["step"]) == 89
    at.segmented_control(key="w.view").set_value("divergence").run()
    ok(at)
    assert qp(at)["why"] == "-1"


# --- a class's first minutes -----------------------------------------------------------------
def warnings(at: AppTest) -> str:
    return " ".join(w.value for w in at.warning)


def test_refusal_keeps_the_valid_policys_views(traces, apptest):
    at = app(b__poolKernel=4, view="scores", step=1304)
    ok(at)
    err = " ".join(e.value for e in at.error)
    assert "Policy B (snapkv)" in err and "poolKernel" in err and "got 4" in err
    assert "pool_kernel" not in err
    spec = specs(at)[0]  # the scores chart, with TOVA's panel only
    assert spec["layout"]["annotations"][0]["text"].startswith("A: tova")
    assert not any(a["text"].startswith("B:") for a in spec["layout"]["annotations"]
                   if "text" in a)
    at.segmented_control(key="w.view").set_value("divergence").run()
    ok(at)
    assert any("needs two policies" in i.value for i in at.info)


def test_budget_clamped_and_unevictable_is_said(traces, apptest):
    # a link's budget outside the trace falls back to the trace's default, said (cut to 1 or
    # to the trace's length it shows nothing: SnapKV refuses 1, nothing is evicted at 4096)
    for asked in (999999, -5):
        at = app(budget=asked)
        ok(at)
        assert f"budget={asked} is outside 1–4096; using this trace's default, 512" in \
            warnings(at)
        assert qp(at)["budget"] == "512" and not at.error
    at = app(budget=4096)
    ok(at)
    assert "nothing is ever evicted" in warnings(at)


def test_switching_traces_does_not_carry_a_cut_budget(traces, apptest):
    at = tiny()  # budget 48 on tiny (160 steps)
    at.selectbox(key="w.trace").set_value("file:plain.npz").run()  # 90 steps
    ok(at)
    assert qp(at)["budget"] == "22"  # plain's own default (a quarter of its 90 steps)
    at.number_input(key="w.budget").set_value(90).run()
    assert "nothing is ever evicted" in warnings(at)
    at.selectbox(key="w.trace").set_value("canonical").run()
    ok(at)
    assert qp(at)["budget"] == "512" and "nothing is ever evicted" not in warnings(at)
    at.selectbox(key="w.trace").set_value("file:plain.npz").run()
    assert qp(at)["budget"] == "90"  # remembered per trace


def test_stale_experiment_text_goes(traces, apptest):
    at = tiny()
    at.button(key="exp.obswindow").click().run()
    ok(at)
    assert any("identical to the last digit" in m.value for m in at.markdown)
    at.slider(key="w.step").set_value(100).run()  # moving the step keeps it
    assert any("Experiment: obsWindow" in m.value for m in at.markdown) and qp(at)["exp"]
    at.selectbox(key="w.trace").set_value("file:tiny.npz").run()
    ok(at)
    assert not any("Experiment:" in m.value for m in at.markdown)
    assert "exp" not in qp(at)
    assert any("Settings changed since the experiment" in c.value for c in at.caption)
    # a link whose settings do not match its experiment opens without the explanation
    at = app(exp="pooling-off", budget=100)
    ok(at)
    assert not any("Experiment:" in m.value for m in at.markdown) and "exp" not in qp(at)
    at = app(exp="nonsense")
    assert "exp='nonsense' is not a guided experiment" in warnings(at) and "exp" not in qp(at)


def test_out_of_range_link_values_warn(traces, apptest):
    at = tiny(step=999, focus=500, why=-7, zoom=7, view="nope", layer=5, b__obsWindow=500,
              colour="red")
    ok(at)
    w = warnings(at)
    for s in ("step=999 is not a step of this trace (0–159)", "focus=500", "why=-7",
              "zoom=7", "view=nope", "layer=5", "b.obsWindow=500 is outside 1–128",
              "unknown key 'colour'"):
        assert s in w, s
    at = app(trace="file:plain.npz", view="tokens")
    assert "view=tokens is not available here (this trace has no tokens)" in warnings(at)


def test_pooling_experiment_explains_with_the_policys_numbers(traces, apptest):
    from kvviz.core.policies import make_policy
    from kvviz.core.replay import Replay
    from kvviz.core.trace import load_trace

    at = tiny()
    at.button(key="exp.pool-defends").click().run()
    ok(at)
    q = qp(at)
    assert (q["trace"], q["view"], q["b"]) == ("file:prose.npz", "scores", "snapkv")
    step, pos = int(q["step"]), int(q["focus"])
    text = next(m.value for m in at.markdown if "Experiment: Pooling defends" in m.value)
    # independently: replay SnapKV to that step and pool its window sums by hand (radius 2)
    rp = Replay(load_trace(traces / "prose.npz", layer=0),
                make_policy("snapkv", budget=int(q["budget"])))
    rp.seek(step - 1)
    kept, sc = rp.peek(step)
    victims = rp.step()
    sums = sc["sums"]
    pooled = np.array([sums[max(0, i - 2):i + 3].max() for i in range(len(sums))])
    i = int(np.flatnonzero(kept == pos)[0])
    nb = kept[max(0, i - 2) + int(np.argmax(sums[max(0, i - 2):i + 3]))]
    v = int(victims[0])
    j = int(np.flatnonzero(kept == v)[0])
    assert pos not in victims and sums[i] < sums[j]  # kept although its own sum is lower
    for s in (f"position {pos}'s own window sum is {sums[i]:.4g}",
              f"Position {nb}, the next held slot in the cache, has the window sum {pooled[i]:.4g}",
              f"pooled score {pooled[i]:.4g}",
              f"Position {v} is evicted instead: its own sum {sums[j]:.4g} is higher than",
              f"{pooled[j]:.4g}"):
        assert s in text, s
    # hovering that slot in the Scores view says the same
    spec = specs(at)[0]
    bar = next(d for d in spec["data"] if d.get("name") == "window sum")
    hover = dict(zip(arr(bar["x"]).tolist(), bar["customdata"]))[pos].replace("<br>", " ")
    assert f"own window sum {sums[i]:.4g}" in hover and f"Position {v} is evicted instead" in hover
