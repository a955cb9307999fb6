"""A shared figure's data serialised once per server process, not once per page run.

`st.plotly_chart` turns its figure into JSON on every run of every page (plotly's
`to_json`: orjson, then a pass that escapes `<`, `>` and `/` over the whole string). A class's
students all draw the same cached figures (the whole-run heatmap, the question's evidence:
`kvviz.app.figures.cache.Prebuilt`, whose traces are shared read-only), so after a lecturer's
move that work was done once per student for the same bytes. `shared` hands Streamlit a copy
of such a figure whose large trace values are `orjson.Fragment`s: JSON made once, with
plotly's own serialiser and escaping, that orjson copies into the output as it is. The JSON
that reaches the browser is the same.

Keyed by the trace dicts' identity (a Prebuilt's traces are never modified), in a small
least-recently-used table that holds the traces it was made from.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import orjson
from plotly.io.json import to_json_plotly

from kvviz.app.figures.cache import Prebuilt

BIG = 2048          # a trace value whose JSON is longer than this is kept as a fragment
KEEP = 64           # traces remembered (a few figures of a few configurations)
_table: OrderedDict = OrderedDict()  # id(trace) -> (trace, its wire copy)
_lock = threading.Lock()


def _wire_trace(trace: dict) -> dict:
    out = {}
    for k, v in trace.items():
        text = to_json_plotly(v, engine="orjson") if not isinstance(v, (int, float, bool)) \
            else None
        out[k] = orjson.Fragment(text) if text is not None and len(text) > BIG else v
    return out


def _trace(trace: dict) -> dict:
    key = id(trace)
    with _lock:
        hit = _table.get(key)
        if hit is not None and hit[0] is trace:
            _table.move_to_end(key)
            return hit[1]
    wired = _wire_trace(trace)
    with _lock:
        _table[key] = (trace, wired)
        _table.move_to_end(key)
        while len(_table) > KEEP:
            _table.popitem(last=False)
    return wired


def shared(figure):
    """`figure` as `st.plotly_chart` should get it: a Prebuilt's traces as cached wire copies
    (its layout, which moves with the step, as it is); anything else unchanged."""
    if not isinstance(figure, Prebuilt):
        return figure
    spec = figure.to_dict()
    data = spec.get("data")
    if not isinstance(data, (list, tuple)) or not all(isinstance(t, dict) for t in data):
        return figure
    return Prebuilt({**spec, "data": [_trace(t) for t in data]})
