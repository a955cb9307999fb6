"""The main area: step navigation, guided experiments and the views (Streamlit side)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import streamlit as st

from kvviz import views as V
from kvviz.policies import POLICIES, param_specs
from kvviz.ui import compute, experiments
from kvviz.ui.export import eviction_log, metrics_frame, run_json
from kvviz.ui.session import S, apply_state, keep, restore, set_value, view_state, wkey
from kvviz.ui.state import VIEW_LABELS, VIEWS, ViewState, to_query
from kvviz.views.common import A_COLOUR, B_COLOUR

PLAY_SPEEDS = (1, 4, 16, 64)
PLAY_INTERVAL_S = 1.0
CHART = dict(width="stretch", config={"displaylogo": False, "scrollZoom": False})


def policy_label(name: str, params: dict) -> str:
    specs = {s.name: s for s in param_specs(name)}
    diff = [f"{specs[k].label}={v}" for k, v in params.items() if k in specs and v != specs[k].default]
    return name + (f" ({', '.join(diff)})" if diff else "")


@dataclass
class Ctx:
    key: str
    layer: int
    version: str
    trace: object
    budget: int
    a: str
    b: str
    pa: tuple
    pb: tuple
    eng_a: object
    eng_b: object
    label_a: str
    label_b: str
    step: int = 0

    @property
    def ev_a(self):
        return self.eng_a.evicted_at

    @property
    def ev_b(self):
        return self.eng_b.evicted_at

    def peek(self, which: str, step: int):
        name, params = (self.a, self.pa) if which == "a" else (self.b, self.pb)
        return compute.peek(self.key, self.layer, self.version, name, params, self.budget, step)

    def panel(self, which: str, step: int) -> dict:
        kept, scores = self.peek(which, step)
        eng = self.eng_a if which == "a" else self.eng_b
        return dict(label=f"{which.upper()}: {self.label_a if which == 'a' else self.label_b}",
                    policy=self.a if which == "a" else self.b, kept=kept, scores=scores,
                    victims=eng.victims(step), colour=A_COLOUR if which == "a" else B_COLOUR)


# --- experiments -------------------------------------------------------------------------
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


# --- step navigation ---------------------------------------------------------------------
def _shift(delta: int, steps: int):
    set_value("step", int(np.clip(int(S.get(wkey("step"), 0)) + delta, 0, steps - 1)))


def _goto(step: int):
    set_value("step", int(step))


def advance(step: int, speed: int, steps: int) -> tuple[int, bool]:
    """One play tick: (new step, still playing)."""
    new = min(step + speed, steps - 1)
    return new, new < steps - 1


def navigator(ctx: Ctx) -> int:
    steps = ctx.trace.steps
    for field in ("focus", "why"):  # positions kept from another trace
        if not -1 <= int(S["kv"].get(field, -1)) < steps:
            S["kv"][field] = -1
            S.pop(wkey(field), None)
    if S["kv"].get("step") is None and wkey("step") not in S:
        first = V.first_divergence(ctx.ev_a, ctx.ev_b)
        S["kv"]["step"] = first if first >= 0 else steps - 1
    restore(wkey("step"), steps - 1)
    S[wkey("step")] = int(np.clip(int(S[wkey("step")]), 0, steps - 1))
    nxt = V.next_divergence(ctx.ev_a, ctx.ev_b, int(S[wkey("step")]))
    step = st.slider("step", 0, steps - 1, key=wkey("step"),
                     help="the decode step shown (state after that step's eviction)")
    cols = st.columns([1.35, 1.35, 1, 0.9, 2.4, 1.6], vertical_alignment="center")
    cols[0].button("prev", key="nav.prev", on_click=_shift, args=(-1, steps), width="stretch",
                   icon=":material/chevron_left:", help="previous step (key J)", shortcut="J")
    cols[1].button("next", key="nav.next", on_click=_shift, args=(1, steps), width="stretch",
                   icon=":material/chevron_right:", help="next step (key K)", shortcut="K")
    cols[2].toggle("play", key="w.play")
    cols[3].selectbox("speed", PLAY_SPEEDS, key="w.speed", label_visibility="collapsed",
                      format_func=lambda v: f"+{v}", help="steps per tick while playing "
                      "(one tick a second)")
    cols[4].button("next divergence", key="nav.div", on_click=_goto, args=(nxt,),
                   disabled=nxt < 0, width="stretch", icon=":material/fast_forward:",
                   shortcut="D",
                   help=f"jump to the next step where A and B evict differently: {nxt}"
                   if nxt >= 0 else "A and B make no different eviction after this step")
    keep(wkey("step"), int(step))
    if S.get("w.play"):
        _ticker(steps)
    return int(step)


def _fragment_run() -> bool:
    """True when only fragments are re-running (a timer tick), not the whole page."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return bool(ctx is not None and getattr(ctx, "fragment_ids_this_run", None))


@st.fragment(run_every=PLAY_INTERVAL_S)
def _ticker(steps: int):
    """Runs inline on every page run (does nothing then) and alone every PLAY_INTERVAL_S while
    playing: each timer tick moves the step on and reruns the page."""
    if not S.get("w.play") or not _fragment_run():
        return
    new, more = advance(int(S["kv"].get("step", 0)), int(S.get("w.speed", 1)), steps)
    set_value("step", new)
    if not more:
        S["w.play"] = False
    st.rerun(scope="app")


def status(ctx: Ctx):
    s = ctx.step
    ha = V.held_mask(ctx.ev_a, s).sum()
    hb = V.held_mask(ctx.ev_b, s).sum()
    diff = int(V.symmetric_difference(ctx.ev_a, ctx.ev_b)[s])
    first = V.first_divergence(ctx.ev_a, ctx.ev_b)
    cols = st.columns(5)
    cols[0].metric(f"A holds · {ctx.label_a}", f"{ha}")
    cols[1].metric(f"B holds · {ctx.label_b}", f"{hb}")
    cols[2].metric("|A Δ B| now", f"{diff}")
    cols[3].metric("first divergence", "none" if first < 0 else f"step {first}")
    va, vb = ctx.eng_a.victims(s), ctx.eng_b.victims(s)

    def short(v):
        return "–" if not len(v) else ",".join(map(str, v[:3])) + ("…" if len(v) > 3 else "")

    cols[4].metric("evicted now (A / B)", f"{short(va)} / {short(vb)}",
                   help=f"A evicted {list(map(int, va))}; B evicted {list(map(int, vb))}")


# --- views -------------------------------------------------------------------------------
def view_selector(has_tokens: bool) -> str:
    options = [v for v in VIEWS if v != "tokens" or has_tokens]
    if restore(wkey("view"), "cache") not in options:
        S[wkey("view")] = "cache"
    view = st.segmented_control("view", options, key=wkey("view"), format_func=VIEW_LABELS.get,
                                label_visibility="collapsed", required=True)
    keep(wkey("view"), view)
    return view or "cache"


ZOOMS = (0, 32, 128, 512)


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
    return int(v.min()) if len(v) else max(0, ctx.step - ctx.budget)


def view_cache(ctx: Ctx):
    restore(wkey("zoom"), 0)
    if S[wkey("zoom")] not in ZOOMS:
        S[wkey("zoom")] = 0
    zoom = st.segmented_control("heatmap range", ZOOMS, key=wkey("zoom"), required=True,
                                format_func=lambda z: "whole run" if z == 0 else
                                f"zoom ±{z} steps", help="Zoom shows single cells around the "
                                "current step and the positions being evicted now (or the "
                                "zoom position set in the Scores view).")
    keep(wkey("zoom"), zoom)
    window = (zoom_window(ctx.step, ctx.trace.steps, zoom, zoom_centre(ctx)) if zoom else None)
    g = compute.grid(ctx.key, ctx.layer, ctx.version, (ctx.a, ctx.pa), (ctx.b, ctx.pb), ctx.budget,
                     (ctx.label_a, ctx.label_b), window=window)
    fig = V.cache_heatmap(ctx.ev_a, ctx.ev_b, ctx.step, label_a=ctx.label_a, label_b=ctx.label_b,
                          grid=g)
    st.plotly_chart(fig, key="chart.cache", **CHART)
    w = int(g["step_edges"][1] - g["step_edges"][0])
    st.caption(f"Each pixel is a block of {w}×{w} cells, coloured by its most frequent state, or "
               "by the disagreement (only A / only B) when the policies differ on a whole line "
               "of it, so one-position differences stay visible. Hover for exact shares of "
               "larger blocks. The red line is the current step."
               if w > 1 else "Each pixel is one (step, position) cell. The red line is the "
               "current step.")


def view_survival(ctx: Ctx):
    st.plotly_chart(V.survival_figure(ctx.ev_a, ctx.ev_b, ctx.step, label_a=ctx.label_a,
                                      label_b=ctx.label_b), key="chart.survival", **CHART)
    s = ctx.step
    rows = []
    for lab, ev in ((f"A: {ctx.label_a}", ctx.ev_a), (f"B: {ctx.label_b}", ctx.ev_b)):
        rows.append({"policy": lab, "sinks held": int(V.sinks_held(ev)[s]),
                     "recent-64 held": f"{V.recent_held_fraction(ev)[s]:.0%}"})
    st.dataframe(pd.DataFrame(rows), hide_index=True)


def _restore_position(field: str, steps: int) -> None:
    """A kept position that does not exist in this trace (after switching trace) becomes -1."""
    v = restore(wkey(field), -1)
    try:
        v = int(v)
    except (TypeError, ValueError):
        v = -1
    S[wkey(field)] = v if -1 <= v < steps else -1


def _focus_input(ctx: Ctx, default_pos: int) -> int:
    _restore_position("focus", ctx.trace.steps)
    c1, c2 = st.columns([2, 5])
    focus = c1.number_input("zoom to position (-1 follows this step's victim)", min_value=-1,
                            max_value=ctx.trace.steps - 1, step=1, key=wkey("focus"))
    keep(wkey("focus"), int(focus))
    c2.caption("Plotly click selection on heatmaps does not reach Streamlit, so positions are "
               "chosen by number.")
    return default_pos if focus < 0 else int(focus)


def view_scores(ctx: Ctx):
    s = ctx.step
    pa, pb = ctx.panel("a", s), ctx.panel("b", s)
    # show the pooled policy first (the neighbourhood is built around its slots)
    panels = [pb, pa] if "pooled" in pb["scores"] and "pooled" not in pa["scores"] else [pa, pb]
    victims = np.concatenate([panels[0]["victims"], panels[1]["victims"]])
    auto = int(victims[0]) if len(victims) else int(s // 2)
    center = _focus_input(ctx, auto)
    st.plotly_chart(V.neighbourhood_figure(panels, s, center, tokens=ctx.trace.tokens),
                    key="chart.scores", **CHART)
    for p in panels:
        if "pooled" in p["scores"]:
            d = V.defended_positions(p["kept"], p["scores"], p["victims"])
            if len(d):
                c1, c2 = st.columns([5, 1])
                c1.markdown(f"**{p['label']}** at step {s}: defended by pooling: "
                            f"{', '.join(map(str, d))} (own window sum ranked among the "
                            "victims; a neighbour's pooled score kept it).")
                c2.button(f"zoom to {int(d[0])}", key="scores.defended", on_click=set_value,
                          args=("focus", int(d[0])))
            else:
                st.caption(f"{p['label']} at step {s}: no slot defended by pooling at this step.")


def view_divergence(ctx: Ctx):
    s = ctx.step
    st.plotly_chart(V.divergence_figure(ctx.ev_a, ctx.ev_b, s, label_a=ctx.label_a,
                                        label_b=ctx.label_b), key="chart.divergence", **CHART)
    only_a, only_b = V.only_sets(ctx.ev_a, ctx.ev_b, s)
    cands = V.divergent_positions(ctx.ev_a, ctx.ev_b)
    st.subheader("Why? The scores each policy gave a divergent position")
    if not len(cands):
        st.info("A and B never evict differently on this trace and budget.")
        return
    _restore_position("why", ctx.trace.steps)
    c1, c2 = st.columns([2, 5])
    why = c1.number_input("divergent position (-1: first one held by only one side now)",
                          min_value=-1, max_value=ctx.trace.steps - 1, step=1, key=wkey("why"))
    keep(wkey("why"), int(why))
    if why < 0:
        now = np.concatenate([only_a, only_b])
        pos = int(now.min()) if len(now) else int(cands[0])
    else:
        pos = int(why)
    dstep = V.decision_step(ctx.ev_a, ctx.ev_b, pos)
    if dstep < 0:
        c2.warning(f"A and B treat position {pos} the same way (both evict it at step "
                   f"{int(ctx.ev_a[pos])}, -1 = never). Divergent positions include "
                   f"{', '.join(map(str, cands[:8]))}…")
        return
    who = "A" if int(ctx.ev_a[pos]) == dstep else "B"
    c2.markdown(f"Position **{pos}**: A evicted it at step {int(ctx.ev_a[pos])}, B at step "
                f"{int(ctx.ev_b[pos])} (-1 = never). **{who}** evicted it first, at step "
                f"**{dstep}**; below, both policies' candidates at that step.")
    c2.button(f"go to step {dstep}", key="why.go", on_click=_goto, args=(dstep,))
    panels = [ctx.panel("a", dstep), ctx.panel("b", dstep)]
    st.plotly_chart(V.why_figure(pos, dstep, panels), key="chart.why", **CHART)
    st.dataframe(pd.DataFrame(V.why_rows(pos, dstep, panels, tokens=ctx.trace.tokens)),
                 hide_index=True)


SWEEP_BUDGETS = (64, 128, 256, 512, 1024, 2048)
POOL_KERNELS = (1, 3, 5, 7, 9, 11, 15)
OBS_WINDOWS = (1, 2, 4, 8, 16, 32, 64, 128)


def _sweep(ctx: Ctx, points):
    rows = []
    bar = st.progress(0.0, text="sweeping…")
    for i, (name, params, budget) in enumerate(points):
        try:
            rows.append(compute.evaluate_one(ctx.key, ctx.layer, ctx.version, name,
                                             compute.params_key(params), budget))
        except ValueError as exc:
            rows.append({"policy": name, "budget": budget, **params, "refused": str(exc)})
        bar.progress((i + 1) / len(points), text=f"sweeping… {i + 1}/{len(points)}")
    bar.empty()
    return [r for r in rows if "refused" not in r]


def metrics_rows(ctx: Ctx) -> list[dict]:
    rows = []
    for which, name, params, lab in (("a", ctx.a, ctx.pa, ctx.label_a), ("b", ctx.b, ctx.pb, ctx.label_b)):
        m = compute.run_summary(ctx.key, ctx.layer, ctx.version, name, params, ctx.budget)
        specs = {sp.name: sp.label for sp in param_specs(name)}
        shown = ", ".join(f"{specs.get(k, k)}={v}" for k, v in params) or "–"
        rows.append({"run": which.upper(), "policy": name, "params": shown,
                     "budget": ctx.budget, **m})
    return rows


def view_metrics(ctx: Ctx):
    rows = metrics_rows(ctx)
    st.dataframe(V.metrics_table(rows), hide_index=True,
                 column_config={"retained mass": st.column_config.NumberColumn(format="%.6f"),
                                "heavy-hitter recall": st.column_config.NumberColumn(format="%.6f"),
                                "attention loss": st.column_config.NumberColumn(format="%.6f")})
    same = {k: rows[0][k] == rows[1][k] for k in ("retained_mass", "hh_recall")}
    st.caption("retained mass: A and B " + ("identical to the last digit" if same["retained_mass"]
                                            else f"differ by {rows[1]['retained_mass'] - rows[0]['retained_mass']:+.6f}")
               + " · heavy-hitter recall: " + ("identical" if same["hh_recall"] else
                                               f"differ by {rows[1]['hh_recall'] - rows[0]['hh_recall']:+.6f}")
               + ". Definitions: kvviz.metrics.")
    st.subheader("Sweeps (cached; all on the current trace)")
    metric = st.radio("metric", ["retained_mass", "hh_recall", "memory_bytes"], horizontal=True,
                      key="w.sweep_metric", format_func=lambda m: V.metrics.METRIC_LABELS[m])
    c = st.columns(3)
    budgets = tuple(b for b in SWEEP_BUDGETS if b < ctx.trace.steps)
    if c[0].button("sweep budgets (all policies)", key="sweep.budget", width="stretch"):
        S["sweep_on.budget"] = (ctx.key, ctx.layer)
    if c[1].button("sweep poolKernel (snapkv)", key="sweep.pool", width="stretch"):
        S["sweep_on.pool"] = (ctx.key, ctx.layer, ctx.budget)
    if c[2].button("sweep obsWindow (snapkv)", key="sweep.obs", width="stretch"):
        S["sweep_on.obs"] = (ctx.key, ctx.layer, ctx.budget)
    defaults = {n: {s.name: s.default for s in param_specs(n)} for n in POLICIES}
    if S.get("sweep_on.budget") == (ctx.key, ctx.layer):
        pts = [(n, defaults[n], b) for n in POLICIES for b in budgets]
        rows = _sweep(ctx, pts)
        st.plotly_chart(V.sweep_figure(rows, "budget", metric, title="All policies across budgets "
                                       "(registry defaults)", mark_x=ctx.budget),
                        key="chart.sweep_budget", **CHART)
    snap = dict(ctx.pb) if ctx.b == "snapkv" else dict(ctx.pa) if ctx.a == "snapkv" else defaults["snapkv"]
    for tag, param, label, values in (("pool", "pool_kernel", "poolKernel", POOL_KERNELS),
                                      ("obs", "obs_window", "obsWindow", OBS_WINDOWS)):
        if S.get(f"sweep_on.{tag}") != (ctx.key, ctx.layer, ctx.budget):
            continue
        rows = _sweep(ctx, [("snapkv", {**snap, param: v}, ctx.budget) for v in values])
        st.plotly_chart(V.sweep_figure(rows, param, metric,
                                       title=f"SnapKV across {label}, budget {ctx.budget}"),
                        key=f"chart.sweep_{tag}", **CHART)
    from kvviz.ui import sweep_view  # a sweep's results.parquet, small multiples
    sweep_view.render(ctx)


def view_tokens(ctx: Ctx):
    tokens = ctx.trace.tokens
    s = ctx.step
    st.html(V.token_strip_html(tokens, ctx.ev_a, ctx.ev_b, s, label_a=ctx.label_a,
                               label_b=ctx.label_b, hi=min(len(tokens), s + 1 + 24)))
    centre = zoom_centre(ctx)
    lo = int(np.clip(centre - 30, 0, max(0, len(tokens) - 60)))
    st.plotly_chart(V.token_timeline_figure(tokens, ctx.ev_a, ctx.ev_b, s, lo=lo, hi=lo + 60,
                                            label_a=ctx.label_a, label_b=ctx.label_b),
                    key="chart.tokens", **CHART)
    st.caption("Top: the text up to the current step, each token coloured by its state after "
               "this step (· space, ⏎ newline, ⇥ tab); the box opens at the current step, scroll "
               "up for the start. Bottom: 60 tokens around the zoom position (Scores view) or "
               "around the positions being evicted now, from their creation to this step.")


def view_export(ctx: Ctx):
    rows = metrics_rows(ctx)
    vs = view_state()
    config = {"trace": ctx.key, "trace_name": getattr(ctx.trace, "name", ""), "layer": ctx.layer,
              "budget": ctx.budget, "A": {"policy": ctx.a, "params": dict(ctx.pa)},
              "B": {"policy": ctx.b, "params": dict(ctx.pb)}, "step": ctx.step,
              "url_query": to_query(vs)}
    log = eviction_log(ctx.eng_a.run, ctx.eng_b.run, ctx.trace.tokens)
    stem = f"kvviz_{getattr(ctx.trace, 'name', 'trace')}_{ctx.a}_vs_{ctx.b}_b{ctx.budget}"
    c = st.columns(3)
    c[0].download_button("eviction log (CSV)", log.to_csv(index=False), f"{stem}_evictions.csv",
                         "text/csv", key="dl.log", width="stretch")
    c[1].download_button("metrics (CSV)", metrics_frame(rows).to_csv(index=False),
                         f"{stem}_metrics.csv", "text/csv", key="dl.metrics", width="stretch")
    c[2].download_button("run (JSON)", run_json(config, ctx.eng_a.run, ctx.eng_b.run, rows),
                         f"{stem}.json", "application/json", key="dl.json", width="stretch")
    st.caption("The CSV has one row per position: the step each policy evicted it (-1 = never) "
               "and how many steps it was held. The JSON holds the configuration, metrics and "
               "both full eviction logs.")
    st.dataframe(log.head(200), hide_index=True)


RENDER = {"cache": view_cache, "survival": view_survival, "scores": view_scores,
          "divergence": view_divergence, "metrics": view_metrics, "tokens": view_tokens,
          "export": view_export}
