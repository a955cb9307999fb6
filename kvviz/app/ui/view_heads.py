"""Heads view: an allocator's held slots per KV head over time, beside its plain scorer,
on a trace captured per KV head (traces/code-kv.npz). The numbers come from
kvviz.core.layers.replay_layers and kvviz.core.replay.run_policy: nothing is re-implemented."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app.figures.heads import heads_figure
from kvviz.app.ui.context import CHART, Ctx
from kvviz.app.ui.present import chart

TRACE = "code-kv.npz"
SCORERS = ("tova", "snapkv", "h2o")


@st.cache_data(show_spinner=False, max_entries=16)
def _runs(path: str, allocator: str, scorer: str, budget: int):
    from kvviz.core.layers import load_layers, replay_layers
    from kvviz.core.policies import make_policy
    from kvviz.core.replay import run_policy

    grid = load_layers(path)
    found = replay_layers(grid, make_policy(allocator, budget, scorer=scorer))
    plain = np.array([[run_policy(tr, scorer, budget).held for tr in row] for row in grid])
    roles = [getattr(s, "retrieval", None) for s in (found.states or [None] * len(grid))]
    return found.held, plain, found.layer_numbers, found.budgets, roles


def render(ctx: Ctx):
    from kvviz.core.paths import traces_dir
    from kvviz.core.policies import ALLOCATORS

    st.caption("How an allocator shares a layer's budget across its KV heads: each head's held "
               "slots after every step (solid) beside the same scorer on each head alone at the "
               "same budget (dashed), on a trace captured per KV head.")
    folder = traces_dir()
    path = folder / TRACE if folder else None
    if path is None or not path.is_file():
        st.info(f"The Heads view needs {TRACE} (a trace captured per KV head) in the traces folder.")
        return
    cols = st.columns(3)
    allocator = cols[0].selectbox("allocator", sorted(ALLOCATORS), key="heads.allocator")
    scorer = cols[1].selectbox("scorer", SCORERS, key="heads.scorer")
    budget = int(cols[2].number_input("budget (mean slots per head)", min_value=8, max_value=512,
                                      value=64, step=8, key="heads.budget"))
    try:
        held, plain, layers, budgets, roles = _runs(str(path), allocator, scorer, budget)
    except ValueError as exc:
        st.error(f"Refused: {exc}")
        return
    chart(heads_figure(held, plain, layers, budgets, label=f"{allocator} ({scorer})",
                       plain_label=f"{scorer} alone", budget=budget,
                       roles=roles if any(r is not None for r in roles) else None),
          key="chart.heads", **CHART)
    end = held[:, :, -1]
    st.caption("At the last step: " + "; ".join(
        f"layer {lay}: " + ", ".join(f"kv{g}={int(n)}" for g, n in enumerate(end[d]))
        + f" (total {int(end[d].sum())} of {budgets[d] * end.shape[1]})"
        for d, lay in enumerate(layers)))
