"""What every page load costs: the cache heatmap is built once and moved per step, and its
hover says less where nothing has been generated yet."""
import copy
import json

import numpy as np
import plotly.io as pio
import plotly.tools

from kvviz.app.figures.cache import at_step, cache_heatmap, heatmap_grid
from kvviz.core.replay import run_policy
from kvviz.core.trace import canonical


def runs(n=300, budget=48):
    t = canonical(n)
    return run_policy(t, "tova", budget).evicted_at, run_policy(t, "h2o", budget).evicted_at


def as_sent(fig) -> dict:
    """What st.plotly_chart sends for a figure (its own two calls), parsed back."""
    fig = plotly.tools.return_figure_from_figure_or_data(fig, validate_figure=True)
    return json.loads(pio.to_json(fig, validate=False))


def test_moving_the_step_equals_rebuilding_the_figure():
    ea, eb = runs()
    for window in (None, ((100, 165), (40, 169))):
        sr, pr = window or (None, None)
        g = heatmap_grid(ea, eb, 128, label_a="tova", label_b="h2o", steps_range=sr,
                         pos_range=pr)
        base = cache_heatmap(ea, eb, 0, label_a="tova", label_b="h2o", grid=g).to_dict()
        kept = copy.deepcopy(base)
        for step in (0, 1, 120, 150, 299):
            rebuilt = cache_heatmap(ea, eb, step, label_a="tova", label_b="h2o", grid=g)
            assert as_sent(at_step(base, step)) == as_sent(rebuilt), (window, step)
        assert base == kept  # the shared figure is never modified


def test_the_moved_figure_marks_the_step():
    ea, eb = runs()
    lay = as_sent(at_step(cache_heatmap(ea, eb, 0).to_dict(), 123))["layout"]
    assert [(s["y0"], s["y1"]) for s in lay["shapes"] if s.get("name") == "step"] == [(123, 123)]
    assert [a["text"] for a in lay["annotations"] if a.get("name") == "step"] == ["step 123"]


def test_blocks_not_generated_yet_say_only_that():
    ea, eb = runs(n=256)
    g = heatmap_grid(ea, eb, 256, hover_bins=16)  # 16 x 16 positions per hover block
    text = g["hover_text"]
    for i in range(16):
        for j in range(16):
            s0, s1, p0 = 16 * i, 16 * i + 15, 16 * j
            # position p is generated at step p: a block is all future iff p0 > its last step
            if p0 > s1:
                assert text[i][j] == "not yet generated", (i, j)
            else:
                assert text[i][j].startswith(f"steps {s0}–{s1}<br>positions {p0}–"), (i, j)


def test_default_page_figure_is_smaller():
    """The canonical trace's whole-run heatmap, as sent: 549 KB before the future blocks lost
    their ranges (~560 KB of chart data per page load had been measured)."""
    t = canonical()
    ea = run_policy(t, "tova", 512).evicted_at
    eb = run_policy(t, "snapkv", 512).evicted_at
    g = heatmap_grid(ea, eb, 512, label_a="tova", label_b="snapkv")
    sent = pio.to_json(at_step(cache_heatmap(ea, eb, 0, label_a="tova", label_b="snapkv",
                                             grid=g).to_dict(), 1300), validate=False)
    assert len(sent) < 400_000, len(sent)
    assert np.asarray(json.loads(sent)["data"][1]["text"]).shape == (64, 64)


def test_the_moved_figure_is_sent_without_copying_the_shared_data():
    """st.plotly_chart turns a Figure into a dict with `to_dict()`, which for a plain Figure
    deep-copies all 4,096 hover strings of the whole-run heatmap per rerun; the moved figure
    hands over the shared data itself, and only its layout is new."""
    ea, eb = runs()
    base = cache_heatmap(ea, eb, 0).to_dict()
    sent = plotly.tools.return_figure_from_figure_or_data(at_step(base, 7), validate_figure=True)
    assert sent["data"] is base["data"]
    assert sent["layout"] is not base["layout"] and base["layout"]["annotations"][0]["y"] == 0


def test_warming_fills_the_server_caches_before_anyone_connects(monkeypatch, apptest):
    """`kvviz app` draws the default page once before it serves (kvviz.app.ui.warm): the replays
    of the default pair are then built, and a first visit builds none."""
    import sys

    import streamlit as st
    from apphelp import APP, ok
    from streamlit.testing.v1 import AppTest

    from kvviz.app.engine import Engine
    from kvviz.app.ui.warm import warm

    built, init = [], Engine.__init__

    def counting(self, trace, name, *a, **k):
        built.append(name)
        init(self, trace, name, *a, **k)

    monkeypatch.setattr(Engine, "__init__", counting)
    st.cache_resource.clear()
    main = sys.modules["__main__"]
    # the default page, then a compare link (two policies here, to keep the test short;
    # `kvviz app` opens Compare all: kvviz.app.ui.warm.FIRST_OPENED)
    warm(APP, queries=("", "view=compare&cmp=tova,h2o"))
    assert sys.modules["__main__"] is main
    assert sorted(built) == ["h2o", "snapkv", "tova"]  # tova against snapkv, then h2o
    built.clear()
    ok(AppTest.from_file(APP, default_timeout=120).run())
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["view"], at.query_params["cmp"] = "compare", "tova,h2o"
    ok(at.run())
    assert built == []
