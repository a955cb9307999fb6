"""The Heads view: the pure figure on hand-built counts, and the page's view under AppTest on
the shipped multi-head trace (its numbers checked against kvviz.core.layers directly)."""
from __future__ import annotations

import json

import apphelp
import numpy as np
import pytest
from apphelp import arr, ok

from kvviz.app.figures.heads import heads_figure


def test_heads_figure_draws_each_head_solid_and_its_plain_scorer_dashed():
    held = np.array([[[1, 2, 2], [1, 2, 3]]])  # one layer, two heads, three steps
    plain = np.array([[[1, 2, 2], [1, 2, 2]]])
    fig = heads_figure(held, plain, [14], [2], label="adakv (tova)", plain_label="tova alone",
                       budget=2, roles=[(True, False)], step=1)
    lines = fig.data
    assert len(lines) == 4  # per head: the allocator, then the plain scorer
    assert [tr.name for tr in lines] == ["kv0 retrieval: adakv (tova)", "kv0: tova alone",
                                         "kv1 streaming: adakv (tova)", "kv1: tova alone"]
    assert lines[2].y.tolist() == [1, 2, 3] and lines[3].y.tolist() == [1, 2, 2]
    assert lines[1].line.dash == "dash" and lines[0].line.dash is None
    assert lines[0].line.color == lines[1].line.color != lines[2].line.color
    assert fig.layout.annotations[0].text == "layer 14 (per-head budget 2)"
    assert fig.layout.title.text == "Held slots per KV head: adakv (tova) vs tova alone @ 2"


def test_heads_figure_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="held and plain must both be"):
        heads_figure(np.zeros((1, 2, 3)), np.zeros((1, 2, 4)), [0], [2], label="a",
                     plain_label="b", budget=2)
    with pytest.raises(ValueError, match="layers and budgets must name the 1 layers"):
        heads_figure(np.zeros((1, 2, 3)), np.zeros((1, 2, 3)), [0, 1], [2], label="a",
                     plain_label="b", budget=2)


def test_the_heads_view_shows_the_allocators_counts(apptest):
    from kvviz.core.layers import load_layers, replay_layers
    from kvviz.core.policies import make_policy

    at = apphelp.app(timeout=180, view="heads")
    ok(at)
    at.selectbox(key="heads.allocator").set_value("headroles").run()
    ok(at)
    spec = json.loads(at.get("plotly_chart")[-1].proto.spec)
    assert spec["layout"]["title"]["text"] == ("Held slots per KV head: headroles (tova) vs "
                                               "tova alone @ 64")
    want = replay_layers(load_layers("traces/code-kv.npz"), make_policy("headroles", 64))
    solid = [t for t in spec["data"] if "alone" not in t["name"]]
    assert len(solid) == 9  # three layers x three KV heads
    for d in range(3):
        for g in range(3):
            assert arr(solid[3 * d + g]["y"]).tolist() == want.held[d, g].tolist()
    assert sum("retrieval" in t["name"] for t in solid) == 6  # two of three heads per layer
    assert any("total 192 of 192" in c.value for c in at.caption)
