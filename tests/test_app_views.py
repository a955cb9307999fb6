"""The compare view, the slides view and the head selector under AppTest.

Expected values come from the policy core directly (run_policy + kvviz.core.metrics.summary on the
same file), not from the page's own caches."""
import gc
import io
import json

import apphelp
import numpy as np
import pytest
from apphelp import arr, ok, softmax_rows, traces_dir
from figurehelp import png_to_codes
from PIL import Image
from streamlit.testing.v1 import AppTest

from kvviz.app import figures as V
from kvviz.app.state import default_cmp
from kvviz.core.metrics import summary
from kvviz.core.replay import run_policy
from kvviz.core.trace import load_trace, save_trace

T = 160


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces_views")
    rng = np.random.default_rng(11)
    tokens = [" the", "\n", "cat", "\tsat", "<b>"] * (T // 5)
    save_trace(d / "tiny.npz", softmax_rows(rng, T, 1), tokens=tokens, meta={"name": "tiny"})
    with traces_dir(d):
        yield d


def app(**query) -> AppTest:
    return apphelp.app(timeout=180, **query)


def specs(at):
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def heatmap(at) -> dict:
    return next(s for s in specs(at) if s["data"][0]["type"] == "image")


def download(button) -> bytes:
    """The bytes behind a download button, static or deferred (built on click)."""
    from streamlit.runtime.media_file_manager import MediaFileManager

    p = button.proto
    for mgr in (o for o in gc.get_objects() if isinstance(o, MediaFileManager)):
        try:
            if p.deferred_file_id:
                url = mgr.execute_deferred(p.deferred_file_id)
                file_id = url.rsplit("/", 1)[-1].split(".")[0]
            else:
                file_id = p.url.rsplit("/", 1)[-1].split(".")[0]
            return bytes(mgr._storage.get_file(file_id).content)
        except Exception:  # another manager's storage
            continue
    raise LookupError(p.label)


# --- compare -------------------------------------------------------------------------------
def test_compare_view_six_policies(traces, apptest):
    at = app(trace="file:tiny.npz", budget=48, view="compare", step=100)
    ok(at)
    shown = default_cmp("tova", "snapkv")  # eight registered: the first six every trace can run
    assert len(shown) == 6 and "knorm" not in shown
    sp = specs(at)
    small = next(s for s in sp if s["layout"]["title"]["text"].startswith("Held set over time"))
    assert sum(t["type"] == "image" for t in small["data"]) == 6
    titles = [a["text"] for a in small["layout"]["annotations"]]
    assert [t.split("<br>")[0] for t in titles] == shown
    surv = next(s for s in sp if s["layout"]["title"]["text"].startswith("Sinks and recent"))
    assert len(surv["data"]) == 12  # sinks + recent per policy
    df = at.table[0].value
    assert len(df) == 6 and df["policy"].tolist() == shown
    trace = load_trace(traces / "tiny.npz")
    for name, row in zip(shown, df.to_dict("records")):
        run = run_policy(trace, name, 48)
        m = summary(trace, run)
        assert row["retained mass"] == pytest.approx(m["retained_mass"], abs=1e-12), name
        assert row["heavy-hitter recall"] == pytest.approx(m["hh_recall"], abs=1e-12), name
        assert row["memory (bytes)"] == m["memory_bytes"]
        assert row["held now"] == int(run.held_mask(100).sum())
        # each panel's title says how many slots it holds at the current step
        assert titles[shown.index(name)].endswith(f"holds {int(run.held_mask(100).sum())}")
        # the survival chart's sinks line is the run's: positions 0-3 held per step
        sinks = arr(surv["data"][2 * shown.index(name)]["y"])
        want = [int(sum(run.held_mask(s)[:4])) for s in range(T)]
        assert sinks.tolist() == want, name


def test_compare_view_subset_and_sidebar_params(traces, apptest):
    at = app(trace="file:tiny.npz", budget=48, view="compare", cmp="snapkv,h2o",
             b__poolKernel=3)
    ok(at)
    df = at.table[0].value
    assert df["policy"].tolist() == ["snapkv", "h2o"]
    assert "poolKernel=3" in df["params"].iloc[0]  # B's sidebar setting, not the default
    trace = load_trace(traces / "tiny.npz")
    m = summary(trace, run_policy(trace, "snapkv", 48, pool_kernel=3))
    assert df["retained mass"].iloc[0] == pytest.approx(m["retained_mass"], abs=1e-12)
    assert at.query_params["cmp"] in ("snapkv,h2o", ["snapkv,h2o"])
    # choosing another set in the multiselect redraws and updates the link
    at.multiselect(key="w.cmp").set_value(["tova", "random", "h2o"]).run()
    ok(at)
    assert at.table[0].value["policy"].tolist() == ["tova", "random", "h2o"]
    assert at.query_params["cmp"] in ("tova,random,h2o", ["tova,random,h2o"])


# --- slides --------------------------------------------------------------------------------
def test_slides_gif_download(traces, apptest):
    at = app(trace="file:tiny.npz", budget=48, view="slides", step=90)
    ok(at)
    at.number_input(key="slides.frames").set_value(6).run()
    ok(at)
    buttons = {b.proto.label: b for b in at.get("download_button")}
    gif = next(b for label, b in buttons.items() if label.startswith("animated GIF: 6 frames"))
    data = download(gif)
    assert data[:6] == b"GIF89a"
    im = Image.open(io.BytesIO(data))
    assert im.format == "GIF" and im.n_frames == 6
    png = download(next(b for label, b in buttons.items() if label.startswith("PNG of step 90")))
    assert Image.open(io.BytesIO(png)).format == "PNG"
    # the token strip over the same steps
    at.segmented_control(key="slides.kind").set_value("tokens").run()
    ok(at)
    gif = next(b for b in at.get("download_button") if b.proto.label.startswith("animated GIF"))
    assert Image.open(io.BytesIO(download(gif))).n_frames == 6


def test_slides_bad_range_is_an_error_not_a_traceback(traces, apptest):
    at = app(trace="file:tiny.npz", budget=48, view="slides")
    ok(at)
    at.slider(key="slides.steps").set_value((10, 12)).run()
    at.number_input(key="slides.frames").set_value(30).run()
    ok(at)
    assert any("frames must be at most" in e.value for e in at.error)


def test_no_head_selector_for_single_head_traces(traces, apptest):
    at = app(trace="file:tiny.npz", budget=48)
    ok(at)
    assert not [s for s in at.sidebar.selectbox if s.label == "head"]


# --- head selector ---------------------------------------------------------------------------
HEADS = ["mean", "kv0", "kv1", "kv2"]


@pytest.fixture(scope="module")
def heads_trace(traces):
    """A version-2 trace with a head axis (kvviz.core.trace contract): three KV-head groups with
    different attention patterns and their mean."""
    rng = np.random.default_rng(5)
    groups = softmax_rows(rng, T, 3)  # (3, T, T): one pattern per KV head
    groups[1] = np.tril(groups[1][::-1, ::-1].T, -1)  # a different shape: rows renormalised below
    groups[1] /= np.maximum(groups[1].sum(axis=1, keepdims=True), 1e-30)
    attn = np.concatenate([groups.mean(axis=0, keepdims=True), groups])[None]  # (1, 4, T, T)
    save_trace(traces / "heads.npz", attn, heads=HEADS, layers=[29],
               tokens=[f"t{i}" for i in range(T)], meta={"name": "heads"})
    return traces / "heads.npz"


def states(trace, step):
    ea, eb = run_policy(trace, "tova", 48).evicted_at, run_policy(trace, "snapkv", 48).evicted_at
    return V.states_at(ea, eb, step)


def test_head_selector_drives_the_views(heads_trace, apptest):
    at = app(trace="file:heads.npz", budget=48, step=120)
    ok(at)
    box = at.selectbox(key="w.head")
    assert box.label == "head" and box.value == "mean"
    assert [o.split(" · ")[0] for o in box.options] == HEADS  # shown as "kv1 · KV head 1 …"
    mean_codes = png_to_codes(heatmap(at)["data"][0]["source"])
    assert mean_codes[120].tolist() == states(load_trace(heads_trace, head="mean"), 120).tolist()
    box.set_value("kv1").run()
    ok(at)
    assert at.query_params["head"] in ("kv1", ["kv1"])
    kv1_codes = png_to_codes(heatmap(at)["data"][0]["source"])
    kv1 = load_trace(heads_trace, head="kv1")
    assert kv1_codes[120].tolist() == states(kv1, 120).tolist()
    assert (kv1_codes != mean_codes).any()  # another head, another cache
    # the compare view follows the head too
    at2 = app(trace="file:heads.npz", budget=48, step=120, head="kv1", view="compare")
    ok(at2)
    assert at2.selectbox(key="w.head").value == "kv1"
    df = at2.table[0].value
    m = summary(kv1, run_policy(kv1, "h2o", 48))
    assert df.set_index("policy").loc["h2o", "retained mass"] == pytest.approx(
        m["retained_mass"], abs=1e-12)


def test_unknown_head_in_a_link_warns_and_shows_mean(heads_trace, apptest):
    at = app(trace="file:heads.npz", budget=48, head="q5")
    ok(at)
    assert at.selectbox(key="w.head").value == "mean"
    assert any("q5" in w.value for w in at.sidebar.warning)


def test_knorm_on_a_trace_without_key_norms_is_an_error_not_a_traceback(apptest):
    """A = knorm on the canonical trace: the page says why (the library's refusal) and
    B still draws; on code-kv (format 3, key norms) the same policy replays."""
    at = apphelp.app(a="knorm", b="tova", budget=256, step=600)
    ok(at)
    assert any("reads key norms" in e.value and "canonical" in e.value for e in at.error)
    from pathlib import Path

    with traces_dir(Path(__file__).resolve().parents[1] / "traces"):  # the shipped ones
        at = apphelp.app(trace="file:code-kv.npz", a="knorm", b="tova", budget=64, step=300)
    ok(at)
    assert not at.error
    assert at.get("plotly_chart") or at.get("html")  # the page drew its view
