"""The "Model in the loop" view: its figure builders, and the page under AppTest with torch
blocked (the view must draw from result files alone).

The fixtures in tests/fixtures/loop/ are real closed-loop results: 64 tokens of
traces/sources/execmodel.txt, SmolLM2-135M, tova / snapkv(poolKernel 1, obsWindow 8,
recentWindow 8) / streaming-llm at budgets 16 and 32, at layer and kv-head granularity,
written by kvviz.model.loop (see tests/fixtures/loop/README.md). Expected values are computed
here from the files' raw arrays with numpy, not through the view's own code.
"""
import json
import math
import sys
import time

import numpy as np
import pytest
from apphelp import APP, REPO, arr, ok
from figurehelp import png_to_codes
from streamlit.testing.v1 import AppTest

from kvviz.app.figures import loop as LV
from kvviz.app.figures.states import BOTH, NEITHER, NOT_YET, ONLY_A, ONLY_B

FIX = REPO / "tests" / "fixtures" / "loop"
KV_HEAD = FIX / "prose64_kv-head.npz"
LAYER = FIX / "prose64_layer.npz"


def raw(path):
    """The fixture's arrays and config list, read without kvviz."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        return meta, {k: z[k] for k in z.files if k != "meta"}


# --- figure builders ---------------------------------------------------------------------
def test_nice_log_ticks_are_round_and_inside():
    assert LV.nice_log_ticks(5, 500) == [5, 10, 20, 50, 100, 200, 500]
    narrow = LV.nice_log_ticks(10.4, 13.9)
    assert len(narrow) >= 3 and all(10.4 <= v <= 13.9 for v in narrow)
    assert narrow == [11, 12, 13]
    assert LV.nice_log_ticks(0.9, 120) == [1, 10, 100]
    assert [LV.tick_text(v) for v in (12.0, 1.5, 2000.0, 0.25)] == ["12", "1.5", "2,000", "0.25"]
    with pytest.raises(ValueError, match="positive"):
        LV.nice_log_ticks(0, 10)


def test_perplexity_figure_one_line_per_policy():
    rows = [{"policy": "full", "params": {}, "budget": None, "perplexity": 10.0},
            {"policy": "tova", "params": {}, "budget": 128, "perplexity": 11.0},
            {"policy": "tova", "params": {}, "budget": 64, "perplexity": 13.0},
            {"policy": "snapkv", "params": {"obs_window": 16, "pool_kernel": 1,
                                            "recent_window": 32}, "budget": 64,
             "perplexity": 14.0},
            {"policy": "snapkv", "params": {"obs_window": 16, "pool_kernel": 5,
                                            "recent_window": 32}, "budget": 64,
             "perplexity": 12.5}]
    fig = LV.perplexity_figure(rows).to_plotly_json()
    lines = {d["name"]: d for d in fig["data"]}
    assert set(lines) == {"tova", "snapkv (poolKernel=1)", "snapkv", "full cache"}
    assert list(arr(lines["tova"]["x"])) == [64, 128]          # sorted by budget
    assert list(arr(lines["tova"]["y"])) == [13.0, 11.0]
    assert list(arr(lines["full cache"]["y"])) == [10.0, 10.0]
    assert lines["full cache"]["line"]["dash"] == "dash"
    y, x = fig["layout"]["yaxis"], fig["layout"]["xaxis"]
    assert y["type"] == "log" and x["type"] == "log"
    assert "perplexity" in y["title"]["text"] and "budget" in x["title"]["text"]
    assert y["ticktext"] == [LV.tick_text(v) for v in y["tickvals"]]
    assert all("e" not in t and not t.endswith("k") for t in y["ticktext"])
    assert min(y["tickvals"]) >= 10 and max(y["tickvals"]) <= 14 and len(y["tickvals"]) >= 3
    assert x["ticktext"] == ["64", "128"]
    with pytest.raises(ValueError, match="metric"):
        LV.perplexity_figure(rows, metric="kl")


def test_delta_strip_colours_and_hover():
    tokens = ["The", " cat", "<b>", "\n"]
    nll_full = np.array([1.0, 2.0, 0.5])
    nll_ev = np.array([3.5, 1.0, 0.5])          # token 1 hurt (+2.5), token 2 helped (-1)
    p_full, p_ev = np.exp(-nll_full), np.exp(-nll_ev)
    h = LV.delta_strip_html(tokens, nll_full, nll_ev, p_full, p_ev, label="tova @ 64")
    spans = h.split('<div class="kv-strip"')[1].split('<span class="kv-tok"')[1:]
    assert "not predicted" in spans[0] and "#eeeeee" in spans[0]
    # saturated wrong-wine (#882255) for +2.5 nats (clipped at 2), halfway from white to
    # right-green (17,119,51) for -1 (half the clip), white for 0: no policy's colours
    assert "rgb(136,34,85)" in spans[1] and f"{p_full[0]:.4f}" in spans[1] \
        and f"{p_ev[0]:.4f}" in spans[1] and "+2.500" in spans[1]
    assert "rgb(136,187,153)" in spans[2] and "&lt;b&gt;" in spans[2]
    assert "rgb(255,255,255)" in spans[3] and "⏎" in spans[3]
    with pytest.raises(ValueError, match="same shape"):
        LV.delta_nll([1.0], [1.0, 2.0])


def test_delta_figure_and_worst_tokens():
    tokens = ["a", "b", "c", "d"]
    full, ev = np.array([1.0, 1.0, 1.0]), np.array([1.5, 3.0, 1.5])
    fig = LV.delta_figure(tokens, full, ev, np.exp(-full), np.exp(-ev), label="x").to_plotly_json()
    bars = fig["data"][0]
    assert list(arr(bars["x"])) == [1, 2, 3] and np.allclose(arr(bars["y"]), [0.5, 2.0, 0.5])
    assert np.allclose(arr(fig["data"][1]["y"]), [0.5, 1.25, 1.0])  # running mean
    worst = LV.worst_tokens(tokens, full, ev, np.exp(-full), np.exp(-ev), k=2)
    assert [w["position"] for w in worst] == [2, 1]  # tie 0.5 / 0.5: the earlier one


# --- the page ----------------------------------------------------------------------------
@pytest.fixture
def no_torch(monkeypatch):
    """Make torch (and transformers) unimportable for the duration of the test."""
    for name in ("torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(FIX))


def loop_page(**query) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["view"] = "loop"
    for k, v in query.items():
        at.query_params[k] = str(v)
    return at.run()


def charts(at) -> dict:
    out = {}
    for c in at.get("plotly_chart"):
        spec = json.loads(c.proto.spec)
        out[spec["layout"]["title"]["text"]] = spec
    return out


def test_view_draws_from_results_without_torch(no_torch, apptest):
    import importlib.util

    assert importlib.util.find_spec("torch") is None  # the block works
    at = loop_page()
    ok(at)
    src = at.selectbox(key="loop.source")
    assert src.options == sorted(src.options)
    at.selectbox(key="loop.source").set_value(
        next(o for o in src.options if "kv-head" in o)).run()
    ok(at)
    meta, a = raw(KV_HEAD)
    cfgs = meta["configs"]
    figs = charts(at)
    ppl = next(v for k, v in figs.items() if k.startswith("What eviction costs"))
    by_name = {d["name"]: d for d in ppl["data"]}
    # every policy's line: perplexity = exp(mean NLL) of its row in the file, at its budget
    assert any(c["policy"] == "full" for c in cfgs)  # the full cache's line is checked too
    for i, c in enumerate(cfgs):
        expect = math.exp(a["nll"][i].mean())
        if c["policy"] == "full":
            assert np.allclose(arr(by_name["full cache"]["y"]), expect)
            continue
        name = "snapkv (obsWindow=8, poolKernel=1, recentWindow=8)" if c["policy"] == "snapkv" \
            else c["policy"]
        x, y = list(arr(by_name[name]["x"])), arr(by_name[name]["y"])
        assert np.isclose(y[x.index(c["budget"])], expect)
    # the ΔNLL chart for the chosen policy and budget: NLL row minus the full row
    at.selectbox(key="loop.policy").set_value("tova").run()
    at.selectbox(key="loop.budget").set_value(16).run()
    ok(at)
    ci = next(i for i, c in enumerate(cfgs) if c["policy"] == "tova" and c["budget"] == 16)
    f = next(i for i, c in enumerate(cfgs) if c["policy"] == "full")
    delta = next(v for k, v in charts(at).items() if k.startswith("Where eviction hurt"))
    assert np.allclose(arr(delta["data"][0]["y"]), a["nll"][ci] - a["nll"][f])
    hover = arr(delta["data"][0]["customdata"])
    assert np.allclose(hover[:, 0], a["p_true"][f]) and np.allclose(hover[:, 1], a["p_true"][ci])
    strip = [h.proto.body for h in at.get("html") if "kv-loop-strip" in h.proto.body]
    assert len(strip) == 1 and "p(true token) full cache" in strip[0]
    # no torch: the run button is replaced by the install note
    assert not [b for b in at.button if b.key == "loop.new.run"]
    assert any("pip install" in c.value for c in at.caption)


def test_heatmap_shows_the_runs_log_per_kv_head(no_torch, apptest):
    at = loop_page()
    src = at.selectbox(key="loop.source")
    at.selectbox(key="loop.source").set_value(
        next(o for o in src.options if "kv-head" in o)).run()
    at.selectbox(key="loop.policy").set_value("tova").run()
    at.selectbox(key="loop.budget").set_value(16).run()
    meta, a = raw(KV_HEAD)
    cfgs = meta["configs"]
    ci = next(i for i, c in enumerate(cfgs) if c["policy"] == "tova" and c["budget"] == 16)
    at.selectbox(key="loop.layer").set_value(14).run()
    at.selectbox(key="loop.head_a").set_value(0).run()
    at.selectbox(key="loop.b").set_value(ci).run()
    at.selectbox(key="loop.head_b").set_value(2).run()
    ok(at)
    li = meta["layers"].index(14)
    ev_a, ev_b = a["evicted_at"][ci, li, 0], a["evicted_at"][ci, li, 2]
    T = ev_a.shape[0]
    heat = next(v for k, v in charts(at).items() if k.startswith("Cache contents"))
    codes = png_to_codes(heat["data"][0]["source"], "tova", "tova")
    assert codes.shape == (T, T)
    # expected states from the raw log: held after step s iff p <= s and not evicted by s
    steps, pos = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    held = lambda ev: (pos <= steps) & ((ev[pos] < 0) | (ev[pos] > steps))  # noqa: E731
    ha, hb = held(ev_a), held(ev_b)
    expect = np.where(pos > steps, NOT_YET, np.where(ha & hb, BOTH, np.where(
        ha, ONLY_A, np.where(hb, ONLY_B, NEITHER))))
    assert np.array_equal(codes, expect)
    assert (ha != hb).any()  # the two KV heads really keep different positions


def test_layer_result_and_metric_switch(no_torch, apptest):
    at = loop_page(trace="canonical")
    ok(at)
    src = at.selectbox(key="loop.source")
    at.selectbox(key="loop.source").set_value(
        next(o for o in src.options if "· layer ·" in o)).run()
    at.radio(key="loop.metric").set_value("perplexity_after_eviction").run()
    ok(at)
    meta, a = raw(LAYER)
    ppl = next(v for k, v in charts(at).items() if k.startswith("What eviction costs"))
    assert "after the first eviction" in ppl["layout"]["yaxis"]["title"]["text"]
    assert at.selectbox(key="loop.head_a").disabled  # one "mean" head at layer granularity


def test_missing_results_dir_is_a_note(monkeypatch, tmp_path, apptest):
    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(tmp_path / "none"))
    at = loop_page()
    ok(at)
    assert any("No closed-loop results" in i.value for i in at.info)


def test_run_button_runs_in_background(monkeypatch, tmp_path, apptest, torch_stack):
    """With torch present the button starts a loop in a thread (here a stand-in for
    run_loop that replays the fixture), the page stays up, and the result is shown."""
    import kvviz.model.loop
    from kvviz.model.loop import load_loop_result

    calls = []

    def fake_run_loop(text, configs, granularity="layer", max_tokens=1024, progress=None,
                      **kw):
        calls.append((text, [c.label for c in configs], granularity, max_tokens))
        for i in range(max_tokens):
            progress(i + 1, max_tokens)
        return load_loop_result(LAYER)

    monkeypatch.setattr(kvviz.model.loop, "run_loop", fake_run_loop)
    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(FIX))
    at = loop_page(trace="file:prose.npz", budget=128)
    ok(at)
    at.multiselect(key="loop.new.policies").set_value(["tova", "snapkv"])
    at.multiselect(key="loop.new.budgets").set_value([32, 64])
    at.number_input(key="loop.new.tokens").set_value(48)
    at.button(key="loop.new.run").click().run()
    ok(at)
    # snapkv at budget 32 refuses (recentWindow 32): left out, said so
    assert any("snapkv at budget 32" in w.value for w in at.warning)
    for _ in range(50):
        if calls and not at.session_state["loop.job"]["running"]:
            break
        time.sleep(0.1)
    text, labels, gran, n = calls[0]
    assert n == 48 and gran == "layer" and labels[0] == "full"
    assert labels[1:] == ["tova@32", "tova@64",
                          "snapkv(obs_window=16,pool_kernel=5,recent_window=32,pooling=max)@64"]
    assert text.startswith("Execution model")
    at.run()
    ok(at)
    assert at.selectbox(key="loop.source").value.startswith("your run")


def test_run_button_runs_the_real_model(monkeypatch, torch_stack, apptest):
    """The button end to end with SmolLM2 itself: 48 tokens of the prose trace, tova at
    budget 32, in the page's background thread. A causal model's prediction at t depends
    only on tokens <= t, and tova's choices only on rows <= t, so the first 47 per-token
    NLLs must equal the recorded 64-token fixture's (written by `kvviz loop`) for both the
    full cache and tova@32 (whose evictions start at step 32)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(FIX))
    at = loop_page(trace="file:prose.npz", budget=128)
    ok(at)
    at.multiselect(key="loop.new.policies").set_value(["tova"])
    at.multiselect(key="loop.new.budgets").set_value([32])
    at.number_input(key="loop.new.tokens").set_value(48)
    at.button(key="loop.new.run").click().run()
    ok(at)
    job = at.session_state["loop.job"]
    deadline = time.time() + 600
    while job["running"] and time.time() < deadline:
        time.sleep(0.5)
    assert not job["running"] and job["error"] is None, job["error"]
    res = job["result"]
    meta, a = raw(LAYER)
    want = {(c["policy"], c["budget"]): i for i, c in enumerate(meta["configs"])}
    assert [c.label for c in res.configs] == ["full", "tova@32"]
    assert list(res.token_ids) == list(a["token_ids"][:48])
    for i, key in enumerate([("full", None), ("tova", 32)]):
        np.testing.assert_allclose(res.nll[i], a["nll"][want[key], :47], atol=1e-4)
    assert not np.allclose(res.nll[1, 32:], res.nll[0, 32:], atol=1e-3)  # eviction mattered
    at.run()
    ok(at)
    assert at.selectbox(key="loop.source").value.startswith("your run")


def test_run_box_offers_a_model_choice_when_there_is_one(monkeypatch, tmp_path, apptest, torch_stack):
    """One model: no choice shown. A second (a folder in $KVVIZ_MODELS): a selectbox, and the
    run gets the chosen model's folder."""
    import kvviz.model.loop
    from kvviz.model.loop import load_loop_result

    calls = []

    def fake_run_loop(text, configs, progress=None, max_tokens=1024, **kw):
        calls.append(kw.get("model"))
        progress(max_tokens, max_tokens)
        return load_loop_result(LAYER)

    monkeypatch.setattr(kvviz.model.loop, "run_loop", fake_run_loop)
    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(FIX))
    monkeypatch.delenv("KVVIZ_MODELS", raising=False)
    at = loop_page(trace="file:prose.npz", budget=128)
    ok(at)
    assert not [s for s in at.selectbox if s.key == "loop.new.model"]
    mine = tmp_path / "mine"  # what resolve checks: config, weights, tokenizer
    mine.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (mine / name).write_text("{}")
    monkeypatch.setenv("KVVIZ_MODELS", str(mine))
    at = loop_page(trace="file:prose.npz", budget=128)
    ok(at)
    box = at.selectbox(key="loop.new.model")
    assert box.options == ["SmolLM2-135M (bundled)", "mine"]
    box.set_value("mine")
    at.multiselect(key="loop.new.policies").set_value(["tova"])
    at.multiselect(key="loop.new.budgets").set_value([32])
    at.number_input(key="loop.new.tokens").set_value(32)
    at.button(key="loop.new.run").click().run()
    ok(at)
    for _ in range(50):
        if calls:
            break
        time.sleep(0.1)
    assert calls == [str(mine.resolve())]
