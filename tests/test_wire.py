"""A shared figure's data serialised once (kvviz.app.ui.wire): the same JSON as plotly's own,
made once per trace and reused while the figure's traces are the same objects."""
import json

import numpy as np
import orjson
import plotly.graph_objects as go
import plotly.io as pio

from kvviz.app.figures.cache import Prebuilt, at_step, without_hover
from kvviz.app.ui import wire


def figure() -> Prebuilt:
    rng = np.random.default_rng(0)
    text = [[f"<b>cell {i},{j}</b><br>share {rng.random():.3f}" for j in range(40)]
            for i in range(40)]
    fig = go.Figure([go.Heatmap(z=rng.random((40, 40)), text=text, name="hover",
                                hovertemplate="%{text}<extra></extra>"),
                     go.Scatter(x=[0, 1], y=[1, 0], name="small")])
    fig.add_hline(y=3, name="step")
    fig.add_annotation(x=0, y=3, text="step 3", name="step")
    return Prebuilt(fig.to_dict())


def test_the_json_is_plotlys_own_byte_for_byte():
    base = figure().to_dict()
    for step in (3, 17):
        fig = at_step(base, step)
        assert pio.to_json(wire.shared(fig), validate=False) == pio.to_json(fig, validate=False)


def test_large_values_are_made_once_and_reused_while_the_traces_are_the_same():
    base = figure().to_dict()
    a, b = wire.shared(at_step(base, 3)), wire.shared(at_step(base, 9))
    hover_a, hover_b = a.to_dict()["data"][0], b.to_dict()["data"][0]
    assert hover_a is hover_b  # one wire copy for both steps (the data is shared)
    assert isinstance(hover_a["text"], orjson.Fragment) and isinstance(hover_a["z"], orjson.Fragment)
    assert hover_a["name"] == "hover"  # small values as they are
    assert a.to_dict()["data"][1] is b.to_dict()["data"][1]
    # the layout (the step line) is the figure's own, not cached
    assert a.to_dict()["layout"]["shapes"][0]["y0"] == 3 and b.to_dict()["layout"]["shapes"][0]["y0"] == 9


def test_new_traces_are_not_served_an_older_figures_json():
    one, two = figure(), figure()
    two.to_dict()["data"][1]["x"] = [5, 6]  # a different figure with equal-looking traces
    j1, j2 = (json.loads(pio.to_json(wire.shared(f), validate=False)) for f in (one, two))
    assert j1["data"][1]["x"] == [0, 1] and j2["data"][1]["x"] == [5, 6]


def test_plain_figures_and_dicts_pass_through():
    fig = go.Figure(go.Scatter(x=[1], y=[2]))
    assert wire.shared(fig) is fig
    d = {"data": [], "layout": {}}
    assert wire.shared(d) is d


def test_without_hover_drops_only_the_hover_layer_and_shares_the_rest():
    fig = figure()
    out = without_hover(fig).to_dict()
    assert [t.get("name") for t in out["data"]] == ["small"]
    assert out["data"][0] is fig.to_dict()["data"][1] and out["layout"] is fig.to_dict()["layout"]
