"""Guided experiments box: one click sets every control; the explanation stays while it holds."""
from __future__ import annotations

import streamlit as st

from kvviz.policies import param_specs
from kvviz.ui import compute, experiments
from kvviz.ui.session import S, apply_state
from kvviz.ui.state import ViewState


def _run_experiment(name: str):
    spec = experiments.EXPERIMENTS[name]
    vs = ViewState(**{**spec["state"], "exp": name})
    if name == "quiet-hh":
        trace = compute.get_trace("canonical", 0, "")
        ea = compute.get_engine("canonical", 0, "", "tova", (), vs.budget).evicted_at
        eb = compute.get_engine("canonical", 0, "", "h2o", compute.params_key(
            {s.name: s.default for s in param_specs("h2o")}), vs.budget).evicted_at
        found = experiments.quiet_heavy_hitter(trace, ea, eb)
        if found:
            vs.why, vs.step = found
            vs.focus = found[0]
    apply_state(vs)


def experiments_box():
    with st.expander("Guided experiments: one click reproduces a documented fact",
                     expanded=False, icon=":material/science:"):
        cols = st.columns(len(experiments.EXPERIMENTS))
        for col, (name, spec) in zip(cols, experiments.EXPERIMENTS.items()):
            col.button(spec["title"], key=f"exp.{name}", on_click=_run_experiment, args=(name,),
                       width="stretch")
    exp = S["kv"].get("exp")
    if exp in experiments.EXPERIMENTS:
        box = st.container(border=True)
        c1, c2 = box.columns([12, 1])
        c1.markdown(f"**Experiment: {experiments.EXPERIMENTS[exp]['title']}** — "
                    + experiments.EXPERIMENTS[exp]["text"])
        c2.button("✕", key="exp.close", help="hide this explanation",
                  on_click=lambda: S["kv"].__setitem__("exp", ""))
