"""Compare view (Streamlit side): up to six policies on the page's trace and budget.

Each policy is the same cached engine the rest of the page uses (`compute.get_engine`): A's
and B's policies take their sidebar parameters, the others their registry defaults. The
small multiples are aggregated on the server (`views.compare.held_shares`, cached per run).
"""
from __future__ import annotations

import streamlit as st

from kvviz.app.figures import compare as C
from kvviz.app.figures.states import held_mask
from kvviz.app.state import default_cmp
from kvviz.app.ui import compute
from kvviz.app.ui.context import table
from kvviz.app.ui.present import chart, more
from kvviz.app.ui.session import widget
from kvviz.core.policies import POLICIES, param_specs

CONFIG = {"displaylogo": False, "scrollZoom": False}


def chart_config(name: str, ctx) -> dict:
    """Plotly config whose modebar camera saves a 2x PNG named after what is shown."""
    stem = f"kvviz_{getattr(ctx.trace, 'name', 'trace')}_{name}_b{ctx.budget}_step{ctx.step}"
    return {**CONFIG, "toImageButtonOptions": {"format": "png", "filename": stem, "scale": 2}}


@st.cache_data(max_entries=64, show_spinner=False)
def shares(rk: compute.RunKey) -> dict:
    """The run's aggregated held set and its small PNG (both independent of the step)."""
    sh = C.held_shares(rk.engine().evicted_at)
    return {**sh, "png": C.rgb_to_png(C.held_rgb(sh, C.policy_colour(rk.policy)))}


def config_for(ctx, name: str) -> tuple:
    """(run key, label): A's or B's sidebar parameters for their policies, else defaults."""
    for which, pol, label in (("a", ctx.a, ctx.label_a), ("b", ctx.b, ctx.label_b)):
        if pol == name:
            return ctx.run(which), label
    defaults = compute.params_key({s.name: s.default for s in param_specs(name)})
    return ctx.run("a").with_policy(name, defaults), name


def params_text(name: str, params: tuple) -> str:
    labels = {s.name: s.label for s in param_specs(name)}
    return ", ".join(f"{labels.get(k, k)}={v}" for k, v in params) or "–"


def chosen_policies(ctx) -> list[str]:
    """The multiselect, never holding more than its limit however many are registered."""
    names = list(POLICIES)
    default = default_cmp(ctx.a, ctx.b)

    def fit(held):
        if isinstance(held, list) and set(held) <= set(names) and len(held) <= C.MAX_POLICIES:
            return held
        held = [n for n in (held if isinstance(held, list) else []) if n in names]
        return held[:C.MAX_POLICIES] or default

    chosen = widget(st.multiselect, "cmp", "policies to compare (A's and B's take their "
                    "sidebar settings, the others their defaults)", names, fit=fit,
                    max_selections=C.MAX_POLICIES, store=list)
    if len(names) > C.MAX_POLICIES:
        st.caption(f"{len(names)} policies are registered and at most {C.MAX_POLICIES} are "
                   "compared at once: remove one from the box to add another.")
    return list(chosen)


def render(ctx) -> None:
    charts = st.container()  # above the chooser: the first chart on the first screen
    with st.expander("choose the policies compared", expanded=False, icon=":material/tune:"):
        chosen = chosen_policies(ctx)
    with charts:
        _draw(ctx, chosen)


def _draw(ctx, chosen: list) -> None:
    if not chosen:
        st.info("Choose at least one policy to compare.")
        return
    panels, rows = [], []
    bar = st.progress(0.0, text="replaying…")
    for i, name in enumerate(chosen):
        rk, label = config_for(ctx, name)
        bar.progress(i / len(chosen), text=f"replaying {name} ({i + 1}/{len(chosen)})…")
        try:
            eng = rk.engine()
        except ValueError as exc:
            st.warning(f"{name} refuses these settings: {exc}")
            continue
        sh = shares(rk)
        panels.append(dict(label=label, evicted_at=eng.evicted_at, shares=sh, png=sh["png"]))
        m = rk.summary()
        rows.append({"policy": name, "params": params_text(name, rk.params), "budget": str(ctx.budget),
                     "held now": int(held_mask(eng.evicted_at, ctx.step).sum()), **m})
    bar.empty()
    if not panels:
        return
    chart(C.small_multiples(panels, ctx.step), key="chart.compare",
                    config=chart_config("compare", ctx), width="stretch")
    st.caption("One small heatmap per policy: step down, position across, aggregated on the "
               "server into blocks of cells; a block's colour is the share of its cells held "
               "(square-root scale, so one position held through a block stays visible), grey "
               "evicted, white not yet generated. The red line is the current step.")
    with more():
        chart(C.survival_compare(panels, ctx.step), key="chart.compare_survival",
              config=chart_config("compare_survival", ctx), width="stretch")
        table(C.compare_table(rows).drop(columns=["budget"]))  # one budget: said below
        st.caption(f"All at budget {ctx.budget} on this trace; metrics from "
                   "kvviz.core.metrics.summary (the Metrics view's numbers). 'held now': slots "
                   "held after the current step.")
