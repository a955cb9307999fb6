"""Shared by several views: the zoom window and choosing a position by number."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app.state import ZOOMS  # noqa: F401  (the heatmap's zoom choices)
from kvviz.app.ui.context import Ctx
from kvviz.app.ui.session import S, keep, restore, wkey


def zoom_window(step: int, steps: int, half: int, centre: int):
    """Steps step-half..step+half; positions centre-2*half..centre+2*half (clipped)."""
    sr = (max(0, step - half), min(steps, step + half + 1))
    lo = int(np.clip(centre - 2 * half, 0, max(0, steps - 4 * half - 1)))
    pr = (lo, min(steps, lo + 4 * half + 1))
    return sr, pr


def zoom_centre(ctx: "Ctx") -> int:
    """The zoom position if one is set, else where the policies are evicting now."""
    focus = int(S["kv"].get("focus", -1))
    if focus >= 0:
        return focus
    v = np.concatenate([ctx.eng_a.victims(ctx.step), ctx.eng_b.victims(ctx.step)])
    return int(v.min()) if len(v) else max(0, ctx.step - ctx.held_budget)

def restore_position(field: str, steps: int) -> None:
    """A kept position that does not exist in this trace (after switching trace) becomes -1."""
    v = restore(wkey(field), -1)
    try:
        v = int(v)
    except (TypeError, ValueError):
        v = -1
    S[wkey(field)] = v if -1 <= v < steps else -1


def focus_input(ctx: Ctx, default_pos: int) -> int:
    restore_position("focus", ctx.trace.steps)
    c1, c2 = st.columns([2, 5])
    focus = c1.number_input("zoom to position (-1 follows this step's victim)", min_value=-1,
                            max_value=ctx.trace.steps - 1, step=1, key=wkey("focus"))
    keep(wkey("focus"), int(focus))
    c2.caption("Plotly click selection on heatmaps does not reach Streamlit, so positions are "
               "chosen by number.")
    return default_pos if focus < 0 else int(focus)
