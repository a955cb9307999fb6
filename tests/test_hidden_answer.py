"""A page that knows a class with an open question (without leading or following it) sends
nothing of the asked step or later ones: not in the cache heatmap's image or hover, the
tracked position's marks and sentence, the jumps' targets, the first divergence, the link,
nor the whole-run views and downloads.

The question is asked straight on the class (kvviz.app.teach.classroom.Class.ask) from a fresh
replay's eviction log; the page knows the class by a `lead=` link without the lecturer key,
one of the ways a student's page comes to know it (kvviz.app.ui.classroom._init_lead).
"""
import base64
import io
import json
import re

import numpy as np
import pytest
from apphelp import REPO, arr, ok, softmax_rows, traces_dir
from PIL import Image

from kvviz.app.figures.cache import cache_heatmap, heatmap_grid, palette
from kvviz.app.figures.states import NOT_YET, divergence_steps, state_colours
from kvviz.app.teach.classroom import new_token
from kvviz.app.ui import compute
from kvviz.app.ui.classroom import REGISTRY
from kvviz.core.replay import NEVER, run_policy
from kvviz.core.trace import load_trace, save_trace

T, BUDGET = 200, 48
PAGE = dict(trace="file:hide.npz", budget=BUDGET, a="tova", b="h2o")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    save_trace(d / "hide.npz", softmax_rows(np.random.default_rng(11), T, 1),
               tokens=[f" w{i}" for i in range(T)], meta={"name": "hide"})
    with traces_dir(d):
        yield d


def question(ev, after):
    """The first eviction after step `after`, from the log alone: (step, held, answer)."""
    s = min(int(e) for e in ev if e != NEVER and e > after)
    held = {p for p in range(s + 1) if ev[p] == NEVER or ev[p] >= s}
    return s, held, {p for p in range(len(ev)) if ev[p] == s}


LECTURER = {}  # class code -> its lecturer's token


def ask(ev, after, label="tova"):
    """A class with an open question about A's first eviction after `after`."""
    s, held, answer = question(ev, after)
    tok = new_token()
    c = REGISTRY.open(tok)
    c.ask(tok, step=s, who="a", label=label, held=held, answer=answer, answer_step=s)
    LECTURER[c.code] = tok  # (for the reveal)
    return c, s, answer


def page(apptest, code, **query):
    at = apptest(**{**PAGE, "lead": code, **query})
    ok(at)
    return at


def figures(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def heatmap(at) -> dict:
    (fig,) = [f for f in figures(at) if f["layout"]["title"]["text"].startswith("Cache contents")]
    return fig


def pixels(fig) -> np.ndarray:
    """The heatmap image's pixels (rows: step blocks, columns: position blocks), RGB."""
    src = fig["data"][0]["source"]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))


def texts(at) -> str:
    out = []
    for kind in ("markdown", "caption", "info", "warning", "error"):
        out += [str(e.value) for e in getattr(at, kind)]
    return "\n".join(out)


def log(name):
    from kvviz.app.ui.compute import traces_dir as folder

    return run_policy(load_trace(folder() / "hide.npz"), name, BUDGET).evicted_at


# --- the heatmap's data, below the page ----------------------------------------------------
def _figure(ev_a, ev_b, cut, max_bins):
    """What compute.cache_figure builds for a page hiding steps `cut`.. (its steps, uncached)."""
    a, b = compute.seen(ev_a, cut), compute.seen(ev_b, cut)
    g = compute.blank_from(heatmap_grid(a, b, max_bins, label_a="tova", label_b="h2o"), cut)
    return cache_heatmap(a, b, 0, label_a="tova", label_b="h2o", grid=g).to_dict()


@pytest.mark.parametrize("max_bins", [300, 64])  # one pixel per cell; 5x5 blocks across the cut
def test_the_hidden_heatmap_is_the_same_whatever_happens_from_the_asked_step_on(max_bins):
    rng = np.random.default_rng(3)
    steps, cut = 300, 137
    ev_a = np.where(rng.random(steps) < 0.6, rng.integers(0, steps, steps), NEVER)
    ev_a = np.where((ev_a >= 0) & (ev_a < np.arange(steps)), NEVER, ev_a)  # never before its birth
    ev_b = np.roll(ev_a, 1)
    ev_b[0] = NEVER
    other = ev_a.copy()  # another future: what A evicts from `cut` on is changed
    late = np.flatnonzero(ev_a >= cut)
    assert len(late) > 10
    other[late] = NEVER
    other[late[:5]] = cut  # a different victim at the asked step itself
    hidden = _figure(ev_a, ev_b, cut, max_bins)
    assert json.dumps(hidden, default=str) == json.dumps(_figure(other, ev_b, cut, max_bins),
                                                         default=str)
    # the steps before the cut: as the whole run's figure draws them
    full = cache_heatmap(ev_a, ev_b, 0, label_a="tova", label_b="h2o",
                         grid=heatmap_grid(ev_a, ev_b, max_bins, label_a="tova",
                                           label_b="h2o")).to_dict()
    px, whole = pixels(hidden), pixels(full)
    edges = np.asarray(heatmap_grid(ev_a, ev_b, max_bins)["step_edges"])
    before = edges[1:] <= cut  # blocks wholly before the cut
    assert before.sum() > 0 and np.array_equal(px[before], whole[before])
    assert not np.array_equal(px, whole)
    blank = palette(state_colours("tova", "h2o"))[NOT_YET]
    after = edges[:-1] >= cut  # blocks from the cut on: blank
    assert after.sum() > 0 and (px[after] == blank).all()
    hover = next(t for t in hidden["data"] if t.get("name") == "hover")
    cells = [t for row in hover["text"] for t in row]
    assert compute.HIDDEN_CELL in cells  # the hover blocks from the cut on say only that
    assert all(int(m) < cut for t in cells for m in re.findall(r"steps (\d+)", t))


def test_seen_keeps_the_evictions_before_the_step_only():
    ev = np.array([NEVER, 3, 5, 6, NEVER, 9])
    assert compute.seen(ev, 6).tolist() == [NEVER, 3, 5, NEVER, NEVER, NEVER]
    assert compute.seen(ev, None) is not None and compute.seen(ev, None).tolist() == ev.tolist()


# --- the page -------------------------------------------------------------------------------
def test_the_cache_heatmap_sends_nothing_of_the_asked_step_or_later(traces, apptest):
    ev = log("tova")
    c, s, answer = ask(ev, 120)
    victim = min(answer)
    full = heatmap(apptest(**PAGE, step=s - 1, track=victim))
    at = page(apptest, c.code, step=190, track=victim)
    assert at.session_state["kv"]["step"] == s - 1  # the link's later step: not shown
    assert str(at.query_params["step"]).strip("[]'") == str(s - 1)  # and its link
    fig = heatmap(at)
    assert any(sh.get("name") == "hidden" for sh in fig["layout"]["shapes"])
    px, whole = pixels(fig), pixels(full)
    assert px.shape == whole.shape  # one pixel per cell: rows are steps
    assert np.array_equal(px[:s], whole[:s])
    assert (px[s:] == px[-1, -1]).all() and not np.array_equal(px[s:], whole[s:])
    assert not [t for t in fig["data"] if t.get("name") == "hover"]
    # the tracked position (the answer): no mark of when A evicts it
    names = " ".join(str(t.get("name", "")) for t in fig["data"])
    hovers = " ".join(str(t.get("hovertemplate", "")) for t in fig["data"])
    assert f"tracked {victim}: A" not in names and "holds it" not in names, names
    assert all(int(n) < s for n in re.findall(r"evicts (?:it )?at (?:step )?(\d+)", names + hovers))
    full_names = " ".join(str(t.get("name", "")) for t in heatmap(apptest(
        **PAGE, step=T - 1, track=victim))["data"])
    assert f"tracked {victim}: A evicts at {s}" in full_names  # (what the page left out)
    # the status line: the tracked position held, nothing said of step s or later
    said = texts(at)
    assert f"tracked position **{victim}**" in said
    assert f"evicted at step {s}" not in said
    first = re.search(r"first\u00a0divergence:\u00a0([^\n]*)", said).group(1)
    steps = [int(n) for n in re.findall(r"\d+", first)]
    assert steps == [s] if "none before" in first else all(n < s for n in steps), first
    # the jumps: none leads to, or names, step s or later
    for b in at.button:
        if b.key in ("nav.div", "nav.hh", "nav.track", "nav.epoch"):
            named = [int(n) for n in re.findall(r"Next: step (\d+)", b.help or "")]
            assert all(n < s for n in named), (b.key, b.help)
    track = at.button(key="nav.track")
    assert track.disabled and "Hidden from step" in track.help
    track = apptest(**PAGE, step=s - 1, track=victim).button(key="nav.track")
    assert f"Next: step {s}." in track.help  # (what the page left out)


def first_divergence(at) -> str:
    return re.search(r"first\u00a0divergence:\u00a0([^\n]*)", texts(at)).group(1).strip()


def test_the_first_divergence_at_the_asked_step_is_not_named(traces, apptest):
    ea, eb = log("tova"), log("h2o")
    first = int(divergence_steps(ea, eb)[0])
    c, s, _ = ask(ea, first - 1)
    assert s == first  # (A evicts at every step once its cache is full)
    assert first_divergence(apptest(**PAGE)) == f"step\u00a0{first}"
    assert first_divergence(page(apptest, c.code)) == f"none before step\u00a0{s}"


# (the Heads view, like the loop's and the Forgetting view, draws its own runs on its own
# trace and settings, never the page's policies: it holds nothing of the question's run)
@pytest.mark.parametrize("view", ["export", "survival", "divergence", "metrics", "tokens",
                                  "compare", "slides"])
def test_whole_run_views_and_downloads_wait_for_the_reveal(traces, apptest, view):
    c, s, answer = ask(log("tova"), 120)
    at = page(apptest, c.code, view=view, track=min(answer))
    assert any("This view shows the whole run" in i.value for i in at.info)
    assert not at.get("download_button") and not figures(at)
    assert f"evicted at step {s}" not in texts(at)
    if view != "export":
        return
    c.reveal(LECTURER[c.code], "")  # revealed: the page shows the view and its downloads
    at = page(apptest, c.code, view=view)
    assert not any("This view shows the whole run" in i.value for i in at.info)
    assert len(at.get("download_button")) == 3


def test_the_toy_heatmap_keeps_no_weight_or_state_of_hidden_steps(apptest):

    toy = dict(trace="file:toy.npz", budget=4, b__recentWindow=1)
    ev = run_policy(load_trace(REPO / "traces" / "toy.npz"), "tova", 4).evicted_at
    c, s, answer = ask(ev, 6)
    with traces_dir(REPO / "traces"):  # (the shipped ones, whatever another test set)
        at = apptest(**toy, lead=c.code)
    ok(at)  # a lead= link without the key is no error: the page works on, knowing the class
    assert any(f"Class {c.code}: this browser does not keep its lecturer key" in w.value for w in at.warning)
    (fig,) = [f for f in figures(at) if f["layout"]["title"]["text"].startswith("Who holds")]
    cells = next(t for t in fig["data"] if t.get("name") == "cache states")

    z = np.asarray([arr(r) for r in cells["z"]]) if isinstance(cells["z"], list) else arr(cells["z"])
    assert (z[s:] == NOT_YET).all() and (z[:s] != NOT_YET).any()
    assert all(set(row) == {"hidden while the class's question is open"} for row in cells["text"][s:])
    weights = next(t for t in fig["data"] if t.get("name") == "weights")
    assert arr(weights["y"]).max() < s and len(arr(weights["y"])) > 0


def test_an_experiment_that_names_the_asked_eviction_is_not_shown(apptest):
    with traces_dir(REPO / "traces"):
        shown = apptest(exp="toy")  # the toy experiment: A's and B's victims at its step
    ok(shown)
    step, victim = map(int, re.search(r"At step \*\*(\d+)\*\*.*?Position (\d+): A,",
                                       texts(shown)).groups())
    ev = run_policy(load_trace(REPO / "traces" / "toy.npz"), "tova", 4).evicted_at
    assert ev[victim] == step  # (the log says what the experiment's text says)
    c, s, answer = ask(ev, step - 1)
    assert s == step and victim in answer  # the question asks what the text tells
    with traces_dir(REPO / "traces"):
        at = apptest(exp="toy", lead=c.code)
    ok(at)
    said = texts(at)
    assert "Experiment:" not in said and f"At step **{s}**" not in said, said
    assert at.session_state["kv"]["step"] == s - 1


def test_the_zoomed_heatmap_is_cut_at_the_asked_step_too(traces, apptest):
    c, s, _ = ask(log("tova"), 120)
    at = page(apptest, c.code, zoom=32)
    fig = heatmap(at)
    img = fig["data"][0]
    dy = int(img["dy"])
    first = int(round(img["y0"] - (dy - 1) / 2))  # the image's first row's step
    px = pixels(fig)
    starts = first + dy * np.arange(len(px))
    assert starts.min() < s - 8 and starts.max() >= s + 8  # the window spans the cut
    white = (px == px[starts >= s][0, 0]).all(axis=(1, 2))
    assert white[starts >= s].all() and not white[starts < s].any()
