"""Quest view: at the chosen step, the positions Quest's query-aware page selection would read
against what policies A and B still hold, and the memory each costs, on a trace that carries
key and query vectors (traces/code-vec.npz). Quest frees nothing: it is a contrast, not a
policy. The reads come from kvviz.core.quest, the held sets from the runs' eviction logs,
the bytes from kvviz.core.quest's memory functions and each policy's bytes per slot."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app.figures.quest import Side, quest_figure, quest_table
from kvviz.app.ui.context import CHART, Ctx, table
from kvviz.app.ui.present import chart, more
from kvviz.app.ui.session import from_link, note, set_value, widget
from kvviz.core.quest import PAGE_SIZE, eviction_memory, quest_memory, quest_reads
from kvviz.core.replay import held_mask

TRACE = "code-vec.npz"
PAGE_MAX = 256


def render(ctx: Ctx):
    st.caption("Quest (Tang et al. 2024) keeps every position and, at each step, reads only the "
               "pages whose keys could score highest against the query (a bound from each "
               "page's per-channel min and max key). Eviction keeps fewer positions and reads "
               "all it keeps. Here: what each would read for this step's query.")
    trace = ctx.trace
    if trace.keys is None or trace.queries is None:
        _no_vectors(trace)
        return
    page_size, budget = controls(ctx)
    t = int(ctx.step)
    try:
        reads = quest_reads(trace, t, page_size=page_size, token_budget=budget, layer=ctx.layer,
                            head=ctx.head)
    except ValueError as exc:
        st.error(f"Refused: {exc}")
        return
    read = np.unique(np.concatenate(list(reads.values()))).astype(np.int64)
    row = trace.row(t).astype(np.float64)
    total = float(row.sum())

    def share(pos) -> float:
        return float(row[pos].sum()) / total if total > 0 else 0.0

    kv_heads, head_dim, item = len(reads), trace.keys.shape[3], trace.keys.dtype.itemsize
    one = head_dim * 2 * item  # one position's key and value in one KV head
    q_mem = quest_memory(t, kv_heads=kv_heads, head_dim=head_dim, itemsize=item,
                         page_size=page_size)
    q_read = sum(len(r) for r in reads.values()) * one + q_mem.metadata_bytes
    sides = []
    runs = (("A", ctx.label_a, ctx.ev_a, ctx.eng_a, ctx.colours[0]),
            ("B", ctx.label_b, ctx.ev_b, ctx.eng_b, ctx.colours[1]))
    for which, label, ev, eng, colour in runs[:1] if ctx.solo else runs:
        held = (np.flatnonzero(held_mask(ev, t - 1)) if t else np.zeros(0, np.int64)).astype(np.int64)
        mem = eviction_memory(len(held), kv_heads=kv_heads, head_dim=head_dim, itemsize=item,
                              bytes_per_slot=eng.bytes_per_slot)
        sides.append(Side(f"{which}: {label}", colour, held, share(held), mem, mem.kv_bytes))
    chart(quest_figure(t, read, sides, page_size=page_size, token_budget=budget),
          key="chart.quest", **CHART)
    st.caption(summary(t, read, page_size, budget, sides, share(read)))
    table(quest_table(t, read, share(read), q_mem, q_read, sides))
    with more():
        heads = ", ".join(f"kv{g}: {len(r)}" for g, r in sorted(reads.items()))
        st.caption(
            f"Model layer {ctx.layer}, head {ctx.head}: each of its query heads picks its own "
            f"pages over the keys of the KV head it reads; a position counts as read when any "
            f"does (positions read per KV head: {heads}). Bytes are this layer's, for "
            f"{kv_heads} KV head{'s' if kv_heads > 1 else ''} of {head_dim} channels in "
            f"{trace.keys.dtype} as captured ({one} bytes a position and head for its key and "
            f"value). Quest's metadata is a min and a max key per page and KV head, read in full "
            f"at every step to score the pages; a policy's bookkeeping is its bytes per slot "
            f"times the slots it holds. Attention read: the share of this step's attention "
            f"(over positions 0..{max(t - 1, 0)}) on the positions read.")


def summary(t: int, read, page_size: int, budget: int, sides: list[Side], mass: float) -> str:
    """One paragraph: what Quest reads at step t, and per policy the overlap and the two
    differences."""
    from kvviz.core.quest import contrast

    if t == 0:
        return "Step 0: the cache is empty; nothing to read."
    parts = [f"At step {t} the cache has positions 0..{t - 1}: Quest keeps all {t} and reads "
             f"{len(read)} of them (pages of {page_size}, {budget // page_size} pages per query "
             f"head, the newest always), {mass:.1%} of this step's attention."]
    for s in sides:
        c = contrast(read, s.held)
        parts.append(f"{s.label} holds {len(s.held)} ({s.mass:.1%} of the attention): "
                     f"{len(c['both'])} Quest reads too, {len(c['evicted_read'])} that Quest "
                     f"reads it has evicted, {len(c['held_skipped'])} it holds that Quest skips.")
    return " ".join(parts)


def controls(ctx: Ctx) -> tuple[int, int]:
    """Page size and token budget (quest.page, quest.budget in the link); the budget defaults
    to the page's, so Quest reads per query head about as many positions as a policy holds."""
    c1, c2 = st.columns(2)
    page = widget(c1.number_input, "quest_page", "Quest page size (positions)", min_value=1,
                  max_value=PAGE_MAX, step=1, fit=_page_fit,
                  help="positions per page; the paper's default is 16")
    budget = widget(c2.number_input, "quest_budget", "Quest token budget (positions read per "
                    "query head)", min_value=int(page), max_value=max(int(page), ctx.trace.steps),
                    step=int(page), fit=lambda v: _budget_fit(v, int(page), ctx),
                    help="budget // page size pages are read per query head, the newest "
                         "always; default: the page's budget")
    return int(page), int(budget)


def _page_fit(v) -> int:
    try:
        p = int(v)
    except (TypeError, ValueError):
        p = 0
    if 1 <= p <= PAGE_MAX:
        return p
    if p and from_link("quest.page"):
        note(f"quest.page={v} is outside 1–{PAGE_MAX}; using {PAGE_SIZE}")
    return PAGE_SIZE


def _budget_fit(v, page: int, ctx: Ctx) -> int:
    top = max(page, ctx.trace.steps)
    try:
        b = int(v)
    except (TypeError, ValueError):
        b = 0
    if page <= b <= top:
        return b
    fallback = min(max(int(ctx.budget), page), top)
    if b and from_link("quest.budget"):
        note(f"quest.budget={v} is outside {page}–{top} (at least one page of {page}); "
             f"using {fallback}")
    return fallback


def _no_vectors(trace) -> None:
    from kvviz.core.paths import traces_dir

    folder = traces_dir()
    shipped = folder is not None and (folder / TRACE).is_file()
    st.info(f"Quest scores pages from key and query vectors, and trace {trace.name!r} has none. "
            + (f"{TRACE} carries them (captured with `kvviz capture --vectors`)." if shipped else
               "Capture a trace with `kvviz capture --vectors` to see this view."))
    if shipped:
        st.button(f"open {TRACE}", key="quest.open", on_click=_open)


def _open() -> None:
    set_value("trace", f"file:{TRACE}")
    set_value("layer", 14)
