"""The main area's registry: which glue module draws which view, plus the view selector.

Each view's Streamlit glue is its own module (kvviz/app/ui/view_*.py) exposing `render(ctx)`;
the figures come from kvviz/app/figures. Adding a view = a new module + one line in
kvviz.app.state.REGISTRY (name, label, module); `RENDER` is built from it. Ctx, navigation,
status and the experiments box are re-exported here so `app.py` needs one import.
"""
from __future__ import annotations

import importlib

import streamlit as st

from kvviz.app.state import REGISTRY, VIEW_LABELS
from kvviz.app.ui.context import Ctx, refusal_message  # noqa: F401
from kvviz.app.ui.guided import experiments_box  # noqa: F401
from kvviz.app.ui.guided import open_linked as open_linked_experiment  # noqa: F401
from kvviz.app.ui.navigation import advance, navigator, status  # noqa: F401
from kvviz.app.ui.session import S, note, widget, wkey

RENDER = {v.name: importlib.import_module(f"kvviz.app.ui.{v.glue}").render for v in REGISTRY}


def current_view(has_tokens: bool) -> str:
    """The view this run will draw, before its selector is drawn (the sidebar depends on it)."""
    cur = S.get(wkey("view"), S["kv"].get("view", "cache"))
    return cur if cur in RENDER and (cur != "tokens" or has_tokens) else "cache"


def loop_ctx(key, layer, version, trace) -> Ctx:
    """The loop view's context: the trace only (its runs come from its result files)."""
    return Ctx(key=key, layer=layer, version=version, trace=trace, budget=0, a="", b="",
               pa=(), pb=(), eng_a=None, eng_b=None, label_a="", label_b="")


def view_selector(has_tokens: bool) -> str:
    """The view chooser: every registered view (tokens only for traces with text)."""
    options = [v for v in RENDER if v != "tokens" or has_tokens]
    def fit(cur):
        if cur in options:
            return cur
        note(f"view={cur} is not available here"
             + (" (this trace has no tokens)" if cur == "tokens" else "")
             + "; showing the cache heatmap")
        return "cache"

    view = widget(st.segmented_control, "view", "view", options, required=True, fit=fit,
                  format_func=lambda v: VIEW_LABELS.get(v, v.title()),
                  label_visibility="collapsed")
    return view or "cache"
