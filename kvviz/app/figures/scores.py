"""Views 3 and 4b: what a policy's scores looked like at one step (from `Replay.peek`).

A "panel" is one policy's view of one step, as a dict:
    label    str, e.g. "B: snapkv"
    policy   registry name
    kept     int positions held after admitting `step`, before evicting (ascending)
    scores   the policy's `scores()` dict at that moment, aligned with `kept`
    victims  positions the policy evicted during `step` (from its run's eviction log)
    colour   optional line colour
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.app import explain
from kvviz.app.explain import visible_token
from kvviz.app.figures.common import DEFENDED_COLOUR, base_layout, log_ticks
from kvviz.core.policies import POLICIES, rank_of, score_labels

# Which score decides eviction, and in which direction, as each policy class declares it
# (`Policy.rank`, `Policy.score_labels`), read from the registry when drawn so plugins show.
# Display only: the ranking shown is the policy's documented order, ties to the lower position.
_NO_SCORE = "no scores: ranks without attention"


def _key(policy: str):
    r = rank_of(policy)
    return r.key if r is not None else None


def _is_count(key) -> bool:
    return any(r.count for r in (c.rank for c in POLICIES.values()) if r is not None and r.key == key)


def score_label(key, default=None, policy=None):
    """The label of a scores() entry: the policy's own, else any registered policy's."""
    return score_labels(policy).get(key, key if default is None else default)


def eviction_order(policy: str, kept, scores) -> np.ndarray:
    """Indices into `kept` of the eviction candidates, first-to-go first (documented order)."""
    kept = np.asarray(kept)
    cand = np.asarray(scores.get("candidate", np.ones(len(kept), bool)), bool)
    idx = np.flatnonzero(cand)
    rank = rank_of(policy)
    key = rank.key if rank is not None else None
    if key is None or key not in scores:
        return idx
    vals = np.asarray(scores[key], dtype=np.float64)[idx]
    if rank.descending:
        vals = -vals
    return idx[np.lexsort((kept[idx], vals))]


def defended_positions(kept, scores, victims) -> np.ndarray:
    """SnapKV's "defended" slots at one step: kept only because pooling lifted them
    (`kvviz.app.explain.defended`)."""
    return explain.defended(kept, scores, victims)


def pooled_from(kept, scores, radius: int | None = None) -> np.ndarray:
    """Per slot, the position whose own window sum is its pooled score: the nearest held
    slot within `radius` slots with that sum (ties to the lower position), itself when
    pooling did not lift it. Without `radius`, any held slot (nearest)."""
    kept = np.asarray(kept)
    sums = np.asarray(scores["sums"], float)
    pooled = np.asarray(scores["pooled"], float)
    r = len(kept) if radius is None else int(radius)
    out = kept.copy()
    for i in np.flatnonzero(pooled != sums):
        src = explain.pooling_source(kept, sums, pooled, int(i), r)
        if src is not None:
            out[i] = kept[src[0]]
    return out


def pooling_explanation(kept, scores, victims, position: int, params=None):
    """Why pooling kept `position` at this step (`kvviz.app.explain.Pooling` facts, step
    unset), or None unless it is a defended slot. `params`: the SnapKV policy or its
    parameters (those not given at their declared defaults)."""
    return explain.pooling_facts(kept, scores, victims, position, params or {}, -1)


def explain_text(e, step: int) -> str:
    """The defended slot's sentences (the guided experiment, the Scores view, the hover)."""
    from dataclasses import replace

    return explain.pooling_text(replace(e, step=int(step)))


def slot_hover(kept, scores, victims, step: int, params=None) -> np.ndarray:
    """Hover text per slot of a pooled policy: its window sum and pooled score, the
    position the pooled score comes from, and for a defended slot the full explanation."""
    kept = np.asarray(kept)
    sums = np.asarray(scores["sums"], float)
    pooled = np.asarray(scores["pooled"], float)
    radius = explain.snapkv_pooling(params)[1]  # the neighbourhood SnapKV declares
    src = pooled_from(kept, scores, radius)
    defended = set(defended_positions(kept, scores, victims).tolist())
    out = []
    for i, pos in enumerate(kept):
        t = (f"position {pos}<br>own window sum {sums[i]:.4g}<br>pooled score {pooled[i]:.4g}"
             + (f" (position {src[i]}'s sum)" if src[i] != pos else " (its own sum)"))
        if int(pos) in defended:
            e = pooling_explanation(kept, scores, victims, int(pos), params)
            t += "<br><b>defended by pooling</b>: " + "<br>".join(_wrap(explain_text(e, step)))
        out.append(t)
    return np.asarray(out, dtype=object)


def _wrap(text: str, width: int = 70) -> list[str]:
    import textwrap
    return textwrap.wrap(text, width)


def slot_window(kept, center: int, half_width: int) -> tuple[int, int]:
    """Slot indices [lo, hi) of `half_width` held slots either side of the slot nearest
    `center` (ties to the lower position): a policy's own cache neighbourhood."""
    kept = np.asarray(kept)
    if len(kept) == 0:
        return 0, 0
    i = int(np.clip(np.searchsorted(kept, center), 0, len(kept) - 1))
    if i > 0 and abs(kept[i - 1] - center) <= abs(kept[i] - center):
        i -= 1
    return max(0, i - half_width), min(len(kept), i + half_width + 1)


def _tick_token(tok) -> str:
    """A token short enough to sit under its column, horizontal, at 13 px."""
    t = visible_token(tok)
    return t if len(t) <= 4 else t[:3] + "…"


def _positive(v):
    """Scores for a log axis: zero, negative and unobserved (NaN) become gaps."""
    v = np.asarray(v, float)
    return np.where(np.isfinite(v) & (v > 0), v, np.nan)


TICK_FONT = 13  # x labels a projector shows: horizontal, at least 12 px


CENTRE_COLOUR = "#CC0000"  # the dotted line at the neighbourhood's centre
MAX_TICKS = 24  # labelled slots at most on one panel's axis


def neighbourhood_figure(panels, step: int, center: int, half_width: int = 7,
                         height: int | None = None, log: bool = True,
                         tokens=None, side_by_side: bool = False,
                         centre_line: bool = True) -> go.Figure:
    """Per panel, the scores of the policy's own held slots near `center` at `step`,
    victims marked; for a pooled policy also the pooled envelope and the defended slots.

    Each panel's x axis is that policy's cache: one column per slot it holds, in cache
    order, labelled with the position (and token), so the slots pooling looks at are
    drawn side by side however far apart their positions are; `half_width` slots each
    side of the slot nearest `center`. Scores are on a log axis by default: eviction
    happens among the smallest scores, which a linear axis squashes to zero; a panel
    whose shown scores go below zero (R-KV's) is drawn on a linear axis instead.
    `side_by_side`: the panels in one row (a projector's short window), else one a row.
    The dotted red line marks `center` (the Scores view's zoom position), said in the legend;
    `centre_line=False` draws none (a figure of every held slot has no centre to mark). With
    more slots than MAX_TICKS, every k-th slot is labelled, so no two labels run together.
    """
    titles = []
    for p in panels:
        r = rank_of(p["policy"])
        order = r.order if r is not None else _NO_SCORE
        # side by side (a projector): the side and its policy; the rule is the title's
        titles.append(p["label"].split(" (")[0] if side_by_side else f"{p['label']}: {order}")
    n = len(panels)
    fig = (make_subplots(rows=1, cols=n, horizontal_spacing=0.2, subplot_titles=titles)
           if side_by_side else
           make_subplots(rows=n, cols=1, shared_xaxes=False, vertical_spacing=0.2,
                         subplot_titles=titles))
    for r, p in enumerate(panels, start=1):
        at = dict(row=1, col=r) if side_by_side else dict(row=r, col=1)
        kept = np.asarray(p["kept"])
        sc = p["scores"]
        lo, hi = slot_window(kept, center, half_width)
        sel = np.zeros(len(kept), bool)
        sel[lo:hi] = True
        x = kept[sel]
        victims = np.intersect1d(np.asarray(p["victims"], np.int64), x)
        cand = np.asarray(sc.get("candidate", np.ones(len(kept), bool)), bool)[sel]
        colour = p.get("colour", "#555555")
        main = _key(p["policy"])
        row_log = log and not _is_count(main) and ("pooled" in sc or (main and main in sc))
        if row_log and "pooled" not in sc and np.any(np.asarray(sc[main], float)[sel] < 0):
            row_log = False  # a score that goes negative (R-KV's importance minus redundancy)
        fix = _positive if row_log else (lambda v: np.asarray(v, float))
        if "pooled" in sc and "sums" in sc:
            sums = np.asarray(sc["sums"], float)[sel]
            pooled = np.asarray(sc["pooled"], float)[sel]
            defended = np.intersect1d(defended_positions(kept, sc, p["victims"]), x)
            hover = slot_hover(kept, sc, p["victims"], step, p.get("params"))[sel]
            fig.add_trace(go.Bar(x=x, y=fix(sums), name="window sum", marker_color=np.where(
                cand, colour, "#bbbbbb").tolist(), opacity=0.85, customdata=hover,
                hovertemplate="%{customdata}<extra></extra>"), **at)
            envelope = (f"pooled envelope ({explain.kernel_label()} 1: the window sum itself)"
                        if explain.unpooled(p.get("params")) else "pooled envelope")
            fig.add_trace(go.Scatter(x=x, y=fix(pooled), name=envelope,
                                     mode="lines+markers", customdata=hover,
                                     line=dict(color="#222222", width=2, shape="hvh"),
                                     marker=dict(size=5),
                                     hovertemplate="%{customdata}<extra></extra>"), **at)
            if len(defended):
                m = np.isin(x, defended)
                fig.add_trace(go.Scatter(
                    x=x[m], y=fix(sums[m]), mode="markers", name="defended (kept by pooling)",
                    marker=dict(symbol="diamond", size=15, color=DEFENDED_COLOUR,
                                line=dict(color="black", width=1)), customdata=hover[m],
                    hovertemplate="%{customdata}<extra></extra>"), **at)
            yv = fix(pooled)
            yall = np.concatenate([sums, pooled])
        elif main and main in sc:
            vals = np.asarray(sc[main], float)[sel]
            fig.add_trace(go.Bar(x=x, y=fix(vals), name=score_label(main, policy=p["policy"]),
                                 marker_color=np.where(cand, colour, "#bbbbbb").tolist(),
                                 customdata=np.where(np.isnan(vals), "unobserved (newest)",
                                                     np.char.mod("%.4g", np.nan_to_num(vals))))
                          .update(hovertemplate="position %{x}<br>" + score_label(main, policy=p["policy"])
                                  + " %{customdata}<extra></extra>"), **at)
            yv = yall = fix(vals)
        else:
            yv = np.zeros(len(x))
            fig.add_trace(go.Scatter(x=x, y=yv, mode="markers", name="held",
                                     marker=dict(color=colour, size=8, symbol="square"),
                                     hovertemplate="position %{x} held<extra></extra>"),
                          **at)
        if len(victims):
            m = np.isin(x, victims)
            fig.add_trace(go.Scatter(x=x[m], y=yv[m], mode="markers",
                                     name=f"victim of {p['label'].split(':')[0]} this step",
                                     marker=dict(symbol="x", size=16, color=colour,
                                                 line=dict(width=2, color="black")),
                                     hovertemplate="position %{x}: evicted at step " + str(step)
                                     + "<extra></extra>"), **at)
        ytitle = ("window sum" if "pooled" in sc and explain.unpooled(p.get("params")) else
                  "window sum / pooled" if "pooled" in sc else score_label(main, "held", p["policy"])
                  if main in sc else "held")
        if side_by_side and r > 1:  # its legend entry names the score: no title in the gap
            ytitle = ""
        if row_log:
            pos = np.asarray(yall, float)
            pos = pos[np.isfinite(pos) & (pos > 0)]
            rng = ([np.log10(pos.min() / 2), np.log10(pos.max() * 1.6)] if len(pos) else None)
            fig.update_yaxes(type="log", title=ytitle + " (log)" if ytitle else "", **at, range=rng,
                             **log_ticks(np.r_[pos, pos.min() / 2] if len(pos) else pos))
        else:
            fig.update_yaxes(title=ytitle, rangemode="tozero", **at,
                             **({"showticklabels": False} if ytitle == "held" else {}))
        cats = [int(v) for v in x]
        text = ([f"{c}<br>{_tick_token(tokens[c])}" for c in cats] if tokens is not None
                else [str(c) for c in cats])
        every = -(-len(cats) // MAX_TICKS)  # a label every k-th slot: never run together
        fig.update_xaxes(type="category", categoryorder="array", categoryarray=cats,
                         tickmode="array", tickvals=cats[::every], ticktext=text[::every],
                         tickangle=-50 if side_by_side else 0,  # narrow panels side by side
                         tickfont=dict(size=TICK_FONT), **at,
                         title=dict(text=f"{p['label'].split(':')[0]}'s held slots"
                                    + ("" if side_by_side else " in cache order (label: position)"),
                                    font=dict(size=13),
                                    standoff=4))
        if cats and centre_line:  # the centre position, or where it would sit between two
            where = (cats.index(center) if center in cats
                     else float(np.searchsorted(cats, center)) - 0.5)
            fig.add_vline(x=where, line=dict(color=CENTRE_COLOUR, width=1, dash="dot"), **at)
    if centre_line:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", showlegend=True,
                                 name=f"dotted: the slots' centre, position {center}",
                                 line=dict(color=CENTRE_COLOUR, width=1.5, dash="dot"),
                                 hoverinfo="skip"))
    if side_by_side:  # the grey bars said in the legend: the title stays one line
        fig.add_trace(go.Bar(x=[None], y=[None], name="grey: protected or not yet ranked",
                             marker_color="#bbbbbb", showlegend=True, hoverinfo="skip"))
    base_layout(fig, f"Scores at step {step} around position {center} (lowest goes first)"
                if side_by_side else f"Scores of the slots around position {center} at step "
                f"{step} (grey = protected or not yet ranked)",
                height or (470 if side_by_side else 300 * len(panels) + 170),
                legend_below=True, bottom=150 if tokens is not None else 130)
    fig.update_layout(barmode="overlay", bargap=0.2)
    seen = set()
    for tr in fig.data:
        tr.showlegend = tr.name not in seen
        seen.add(tr.name)
    return fig


def why_rows(position: int, step: int, panels, tokens=None) -> list[dict]:
    """For each panel: did it hold / rank / evict `position` at `step`, with its scores."""
    rows = []
    for p in panels:
        kept = np.asarray(p["kept"])
        row = {"policy": p["label"], "step": int(step), "position": int(position),
               **({"token": visible_token(tokens[position])} if tokens is not None else {}),
               "held before eviction": bool(np.isin(position, kept)),
               "evicted at this step": bool(np.isin(position, np.asarray(p["victims"])))}
        hit = np.flatnonzero(kept == position)
        if len(hit):
            i = int(hit[0])
            for key, vals in p["scores"].items():
                if key == "candidate":
                    row["candidate"] = bool(np.asarray(vals)[i])
                else:
                    v = float(np.asarray(vals, float)[i])
                    row[score_label(key, policy=p["policy"])] = None if np.isnan(v) else v
            order = eviction_order(p["policy"], kept, p["scores"])
            where = np.flatnonzero(order == i)
            row["eviction rank"] = (f"{int(where[0]) + 1} of {len(order)}" if len(where)
                                    else "not a candidate")
        rows.append(row)
    return rows


def why_table(position: int, step: int, panels, tokens=None):
    """`why_rows` as a table a class reads: one column per policy, one row per quantity,
    every cell text ("–" where a quantity is not that policy's, "unobserved (newest)" for
    a score not yet computed), so no cell shows None."""
    rows = why_rows(position, step, panels, tokens)
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "policy"))

    def cell(r, k):
        if k not in r:  # a score of the other policy's, or none: the slot is not held
            return "–" if r["held before eviction"] else "not held"
        v = r[k]
        if v is None:
            return "unobserved (newest)"
        if isinstance(v, (bool, np.bool_)):
            return "yes" if v else "no"
        if isinstance(v, float):
            return f"{v:.6g}"
        return str(v)

    return pd.DataFrame({"": keys, **{r["policy"]: [cell(r, k) for k in keys] for r in rows}})


def _rank_ticks(n: int) -> dict:
    """Rank ticks that start at 1 (the first to go) and never show a rank 0."""
    if n <= 1:
        return dict(tickmode="array", tickvals=[1], ticktext=["1"], range=[0.5, 1.5])
    raw = n / 4
    mag = 10 ** np.floor(np.log10(raw))
    step = int(next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw))
    vals = [1] + [v for v in range(step, n + 1, step) if v - 1 > step / 3]
    pad = max(0.5, 0.06 * n)  # room for the rank-1 marker beside the y tick labels
    return dict(tickmode="array", tickvals=vals, ticktext=[str(v) for v in vals],
                range=[1 - pad, n + pad])


def why_figure(position: int, step: int, panels) -> go.Figure:
    """Each policy's candidates at `step` in eviction order (rank 1, the first to go, on
    the left) with their ranking score; victims marked, `position` highlighted."""
    fig = make_subplots(rows=1, cols=len(panels), horizontal_spacing=0.17,
                        subplot_titles=[p["label"] for p in panels])
    for c, p in enumerate(panels, start=1):
        kept = np.asarray(p["kept"])
        order = eviction_order(p["policy"], kept, p["scores"])
        key = _key(p["policy"])
        vals = (np.asarray(p["scores"][key], float)[order] if key in p["scores"]
                else np.zeros(len(order)))
        ranks = np.arange(1, len(order) + 1)
        pos = kept[order]
        colour = p.get("colour", "#555555")
        fig.add_trace(go.Scatter(x=ranks, y=vals, mode="markers", name=p["label"],
                                 marker=dict(color=colour, size=5), customdata=pos,
                                 hovertemplate="rank %{x}: position %{customdata}, score %{y:.4g}"
                                 "<extra></extra>"), row=1, col=c)
        vm = np.isin(pos, np.asarray(p["victims"]))
        if vm.any():
            fig.add_trace(go.Scatter(x=ranks[vm], y=vals[vm], mode="markers",
                                     name=f"victim of {p['label'].split(':')[0]}",
                                     marker=dict(symbol="x", size=14, color=colour,
                                                 line=dict(width=1, color="black")),
                                     customdata=pos[vm],
                                     hovertemplate="rank %{x}, evicted: position %{customdata}"
                                     "<extra></extra>"), row=1, col=c)
        pm = pos == position
        if pm.any():
            fig.add_trace(go.Scatter(x=ranks[pm], y=vals[pm], mode="markers+text",
                                     name=f"position {position}", text=[f"p{position}"],
                                     textposition="top center", showlegend=c == 1,
                                     cliponaxis=False, textfont=dict(size=14),
                                     marker=dict(symbol="circle-open", size=20, color="#CC0000",
                                                 line=dict(width=3))), row=1, col=c)
        fig.update_xaxes(title="eviction rank (1 = first to go)", row=1, col=c,
                         **_rank_ticks(len(order)))
        ytitle = (explain.score_name(score_label(key, "no score", p["policy"]), key, p.get("params"))
                  if key is not None else "no score")
        fin = vals[np.isfinite(vals)]
        if not _is_count(key) and len(vals) and np.all(np.isfinite(vals) & (vals > 0)):
            lo, hi = np.log10(vals.min()), np.log10(vals.max())
            span = max(hi - lo, 0.5)  # headroom above the top point for its label
            fig.update_yaxes(type="log", title=ytitle + " (log)", row=1, col=c,
                             range=[lo - 0.08 * span, hi + 0.2 * span], **log_ticks(vals))
        else:
            lo, hi = (float(fin.min()), float(fin.max())) if len(fin) else (0.0, 1.0)
            span = (hi - lo) or max(abs(hi), 1.0)  # equal scores: a unit of room
            fig.update_yaxes(title=ytitle, row=1, col=c,
                             range=[lo - 0.08 * span, hi + 0.2 * span])
    base_layout(fig, f"Why position {position} diverged: each policy's candidates at "
                     f"step {step}", 440, legend_below=True)
    return fig
