"""Metrics & sweeps view: summary metrics of A and B, cached sweeps on the current trace."""
from __future__ import annotations

from dataclasses import replace

import streamlit as st

from kvviz.app import explain
from kvviz.app import figures as V
from kvviz.app.ui import compute
from kvviz.app.ui.context import CHART, Ctx, table
from kvviz.app.ui.present import chart
from kvviz.app.ui.session import SWEEP_ON, S
from kvviz.core.budget import as_given, is_ratio
from kvviz.core.policies import POLICIES, param_specs

SWEEP_BUDGETS = (64, 128, 256, 512, 1024, 2048)


def _spec(param: str):
    return next(s for s in param_specs("snapkv") if s.name == param)


def _pool_kernels() -> tuple:
    """Every poolKernel SnapKV's control offers: its declared range and step (odd values)."""
    k = _spec("pool_kernel")
    return tuple(range(int(k.low), int(k.high) + 1, int(k.step or 1)))


def _obs_windows() -> tuple:
    """obsWindow at powers of two across its declared range (the sweep's log axis)."""
    w = _spec("obs_window")
    out, v = [], max(1, int(w.low))
    while v <= w.high:
        out.append(v)
        v *= 2
    return tuple(out)


# SnapKV's two sweeps: (tag, parameter, values), every label and value from its declaration
SNAP_SWEEPS = (("pool", "pool_kernel", _pool_kernels()), ("obs", "obs_window", _obs_windows()))


def _sweep(ctx: Ctx, points):
    """Evaluate every point, saying which one runs (a cold sweep of all policies across
    budgets took 55 s on 2 cores); points already computed on this server are instant."""
    import time

    rows, t0 = [], time.perf_counter()
    status = st.status(f"Sweeping {len(points)} settings on this trace…", expanded=False)
    bar = status.progress(0.0)
    for i, (name, params, budget) in enumerate(points):
        bar.progress(i / len(points), text=f"{i}/{len(points)}: {name} at budget {budget}")
        try:
            rk = replace(ctx.run("a"), policy=name, params=compute.params_key(params),
                         budget=budget)
            rows.append(rk.evaluate())
        except ValueError as exc:
            rows.append({"policy": name, "budget": budget, **params, "refused": str(exc)})
    bar.progress(1.0, text=f"{len(points)}/{len(points)}")
    refused = sum("refused" in r for r in rows)
    status.update(label=f"Swept {len(points)} settings in {time.perf_counter() - t0:.1f} s"
                  + (f" ({refused} refused by their policy)" if refused else ""),
                  state="complete")
    return [r for r in rows if "refused" not in r]


def metrics_rows(ctx: Ctx) -> list[dict]:
    rows = []
    for which, name, params in (("a", ctx.a, ctx.pa), ("b", ctx.b, ctx.pb)):
        if ctx.solo and which != ctx.solo:
            continue  # that policy refused its settings
        m = ctx.run(which).summary()
        specs = {sp.name: sp.label for sp in param_specs(name)}
        shown = ", ".join(f"{specs.get(k, k)}={v}" for k, v in params) or "–"
        rows.append({"run": which.upper(), "policy": name, "params": shown,
                     "budget": as_given(ctx.budget), **m})
    return rows


def metrics_difference(a: dict, b: dict) -> str:
    """The table's two rows compared, said with its sign's meaning: B minus A, and which
    one is higher (or that they are identical)."""
    parts = []
    for key, word in (("retained_mass", "retained mass"), ("hh_recall", "heavy-hitter recall")):
        va, vb = float(a[key]), float(b[key])
        if va == vb:
            parts.append(f"{word}: A and B identical to the last digit")
        else:
            parts.append(f"{word}: B minus A = {vb - va:+.6f} (B's is {explain.relation(vb, va)} A's)")
    return " · ".join(parts) + "."


def render(ctx: Ctx):
    st.caption("How much of the attention each cache kept, and what it costs; the sweeps rerun "
               "one setting across values on this trace (terms: Glossary).")
    rows = metrics_rows(ctx)
    table(V.metrics_table(rows))
    st.caption("" if len(rows) < 2 else metrics_difference(rows[0], rows[1]))
    st.subheader("Sweeps (cached; all on the current trace)")
    metric = st.radio("metric", ["retained_mass", "hh_recall", "memory_bytes"], horizontal=True,
                      key="w.sweep_metric", format_func=lambda m: V.metrics.METRIC_LABELS[m])
    row = st.container(horizontal=True, wrap=True)  # whole labels at 125 % zoom
    budgets = tuple(b for b in SWEEP_BUDGETS if b < ctx.trace.steps)
    if row.button("sweep budgets (all policies)", key="sweep.budget", width="content"):
        S[SWEEP_ON + "budget"] = (ctx.key, ctx.layer)
    for tag, param, _ in SNAP_SWEEPS:
        if row.button(f"sweep {_spec(param).label} (snapkv)", key=f"sweep.{tag}",
                      width="content"):
            S[SWEEP_ON + tag] = (ctx.key, ctx.layer, ctx.budget)
    defaults = {n: {s.name: s.default for s in param_specs(n)} for n in POLICIES}
    if S.get(SWEEP_ON + "budget") == (ctx.key, ctx.layer):
        pts = [(n, defaults[n], b) for n in POLICIES for b in budgets]
        rows = _sweep(ctx, pts)
        chart(V.sweep_figure(rows, "budget", metric, title="All policies across budgets "
                                       "(registry defaults)",
                                       mark_x=None if is_ratio(ctx.budget) else ctx.budget,
                                       log_x=True),
                        key="chart.sweep_budget", **CHART)
    snap = dict(ctx.pb) if ctx.b == "snapkv" else dict(ctx.pa) if ctx.a == "snapkv" else defaults["snapkv"]
    for tag, param, values in SNAP_SWEEPS:
        if S.get(SWEEP_ON + tag) != (ctx.key, ctx.layer, ctx.budget):
            continue
        label = _spec(param).label
        rows = _sweep(ctx, [("snapkv", {**snap, param: v}, ctx.budget) for v in values])
        chart(V.sweep_figure(rows, param, metric, x_label=label, mark_x=snap.get(param),
                                       title=f"SnapKV across {label}, budget {ctx.budget}"),
                        key=f"chart.sweep_{tag}", **CHART)
    from kvviz.app.ui import sweep_view  # a sweep's results.parquet, small multiples

    sweep_view.render(ctx)
