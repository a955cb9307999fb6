"""Heads view: an allocator's held slots per KV head over time, beside its plain scorer,
on a trace captured per KV head (traces/code-kv.npz), and where one position was evicted on
each head. The numbers come from kvviz.core.layers.replay_layers and
kvviz.core.replay.run_policy: nothing is re-implemented. Below, the shipped pass-key results
(traces/alloc/needle/*.json, written by lab.alloc_report) per (layer, KV head)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import streamlit as st

from kvviz.app.figures.heads import eviction_grid, heads_figure, needle_heads_figure, position_figure
from kvviz.app.ui import present
from kvviz.app.ui.context import CHART, Ctx
from kvviz.app.ui.present import chart
from kvviz.app.ui.session import fits, from_link, note, widget

TRACE = "code-kv.npz"


@st.cache_data(show_spinner=False, max_entries=16)
def _runs(path: str, allocator: str, scorer: str, budget: int):
    from kvviz.app.engine import allocator_runs
    from kvviz.core.layers import load_layers

    r = allocator_runs(load_layers(path), allocator, scorer, budget)
    return r["held"], r["plain"], r["layers"], r["budgets"], r["roles"], r["runs"], r["alone"]


@st.cache_data(show_spinner=False, max_entries=64)
def _needle(path: str) -> dict:
    return json.loads(Path(path).read_text())


def render(ctx: Ctx):
    from kvviz.core.paths import traces_dir
    folder = traces_dir()
    path = folder / TRACE if folder else None
    if path is None or not path.is_file():
        st.info(f"The Heads view needs {TRACE} (a trace captured per KV head) in the traces folder.")
        return
    # in presentation mode (no sidebar) the link's values, as the quiet sidebar returns them
    allocator, scorer, budget = controls(present.sidebar(not present.active()))
    try:
        held, plain, layers, budgets, roles, runs, alone = _runs(str(path), allocator, scorer, budget)
    except ValueError as exc:
        st.error(f"Refused: {exc}")
        return
    chart(heads_figure(held, plain, layers, budgets, label=f"{allocator} ({scorer})",
                       plain_label=f"{scorer} alone", budget=budget,
                       roles=roles if any(r is not None for r in roles) else None),
          key="chart.heads", **CHART)
    st.caption("How an allocator shares a layer's budget across its KV heads: each head's held "
               "slots after every step (solid) beside the same scorer on each head alone at the "
               "same budget (dashed), on a trace captured per KV head.")
    end = held[:, :, -1]
    st.caption("At the last step: " + "; ".join(
        f"layer {lay}: " + ", ".join(f"kv{g}={int(n)}" for g, n in enumerate(end[d]))
        + f" (total {int(end[d].sum())} of {budgets[d] * end.shape[1]})"
        for d, lay in enumerate(layers)))
    position_section(runs, alone, layers, allocator, scorer)
    needle_section(folder)


def choices() -> tuple[list[str], list[str]]:
    """(the allocators, the scorers) the sidebar offers: every registered allocator, plugins
    included (--plugin, $KVVIZ_PLUGINS, entry points), by name, and every registered
    per-stream policy in the registry's order."""
    from kvviz.core.policies import ALLOCATORS, POLICIES

    return sorted(ALLOCATORS), list(POLICIES)


def controls(side):
    """The allocator, its scorer (any registered per-stream policy, plugins included) and the
    budget, in the sidebar and in the link (heads.allocator, heads.scorer, heads.budget)."""
    side.header("Heads")
    allocators, scorers = choices()
    allocator = widget(side.selectbox, "heads_alloc", "allocator", allocators,
                       fit=fits(allocators, "heads_alloc", "adakv", "allocator"),
                       help="shares each layer's budget across its KV heads")
    scorer = widget(side.selectbox, "heads_scorer", "scorer", scorers,
                    fit=fits(scorers, "heads_scorer", "tova" if "tova" in scorers else scorers[0],
                              "policy"),
                    help="the per-stream policy whose scores choose the victims")
    budget = widget(side.number_input, "heads_budget", "budget (mean slots per head)",
                    min_value=8, max_value=BUDGET_MAX, step=8,
                    fit=lambda v: _budget_fit(v), help="the mean number of slots per KV head")
    return allocator, scorer, int(budget)


BUDGET_MAX = 512


def _budget_fit(v) -> int:
    """The link's budget if it is in 8..BUDGET_MAX, else 64 (said when a link asked for it)."""
    try:
        b = int(v)
    except (TypeError, ValueError):
        b = 0
    if 8 <= b <= BUDGET_MAX:
        return b
    if b and from_link("heads.budget"):
        note(f"heads.budget={v} is outside 8–{BUDGET_MAX}; using 64")
    return 64


def position_section(runs, alone, layers, allocator: str, scorer: str):
    steps = int(runs[0][0].steps)
    st.markdown("**One position across the heads**")
    pos = int(st.number_input("position", min_value=0, max_value=steps - 1, value=min(100, steps - 1),
                              step=1, key="heads.position"))
    ev, pl = eviction_grid(runs, pos), eviction_grid(alone, pos)
    label, plain_label = f"{allocator} ({scorer})", f"{scorer} alone"
    chart(position_figure(ev, pl, layers, position=pos, steps=steps, label=label,
                          plain_label=plain_label), key="chart.heads.position", **CHART)

    def line(grid):
        return "; ".join(f"layer {lay}: " + ", ".join(
            f"kv{g}={'held' if v < 0 else int(v)}" for g, v in enumerate(grid[d]))
            for d, lay in enumerate(layers))

    st.caption(f"The step at which each KV head evicted position {pos} of {steps} (held: kept "
               f"to the end), from each run's eviction log. {label}: {line(ev)}. "
               f"{plain_label}: {line(pl)}.")


def needle_section(folder):
    st.markdown("**On a pass-key prompt: each head's slots and the key's attention**")
    found = sorted((Path(folder) / "alloc" / "needle").glob("*.json")) if folder else []
    if not found:
        st.info("No pass-key results (alloc/needle/*.json, written by lab.alloc_report) "
                "in the traces folder.")
        return
    cols = st.columns(3)
    name = cols[0].selectbox("pass-key prompt", [p.stem for p in found], key="heads.needle.prompt")
    data = _needle(str(next(p for p in found if p.stem == name)))
    configs = [f"{r['name']} @ {r['budget']}" for r in data["rows"] if r.get("held") is not None]
    if not configs:
        st.info(f"{name} records no held counts.")
        return

    def default(want):
        return configs.index(want) if want in configs else 0

    a = cols[1].selectbox("configuration", configs, index=default("adakv:tova @ 128"),
                          key="heads.needle.a")
    b = cols[2].selectbox("beside", configs, index=default("tova @ 128"), key="heads.needle.b")
    rows = {f"{r['name']} @ {r['budget']}": r for r in data["rows"]}
    ra, rb = rows[a], rows[b]
    n_key = len(data["key_positions"])
    keyed = ra.get("key_held") is not None and rb.get("key_held") is not None
    chart(needle_heads_figure(ra["held"], rb["held"], data["key_mass"], label_a=a, label_b=b,
                              key_held_a=ra["key_held"] if keyed else None,
                              key_held_b=rb["key_held"] if keyed else None,
                              key_tokens=n_key if keyed else None),
          key="chart.heads.needle", **CHART)
    if keyed:
        shown = ("Left and middle: how many of the key's tokens each (layer, KV head) still held "
                 "after the prompt under each configuration (hover: the slots it held). "
                 + key_holding(a, ra["key_held"], n_key) + " " + key_holding(b, rb["key_held"], n_key))
    else:
        shown = ("Left and middle: the slots each (layer, KV head) held after the prompt under "
                 "each configuration; this file records no count of the key's tokens per head.")
    st.caption(
        f"Prompt of {data['prompt_len']} tokens, key {data['key']} in {n_key} tokens at positions "
        f"{data['key_positions'][0]}..{data['key_positions'][-1]}. {shown} Right: the full "
        "cache's attention mass from the question's tokens onto the key's tokens (mean over the "
        "question's rows and the query heads sharing the KV head). Answers: "
        f"{a}: {ra['answer']!r} ({ra['digits']} leading digits); "
        f"{b}: {rb['answer']!r} ({rb['digits']} leading digits); "
        f"full cache: {data['full_answer']!r}.")


def key_holding(label: str, key_held, n_key: int) -> str:
    """One sentence: how many (layer, KV head) streams hold all, part and none of the key."""
    k = np.asarray(key_held)
    whole, none = int((k == n_key).sum()), int((k == 0).sum())
    return (f"{label}: {whole} of {k.size} heads hold the whole key, {k.size - whole - none} "
            f"part of it, {none} none of it.")
