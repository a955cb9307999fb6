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
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz import explain
from kvviz.policies import POLICIES, rank_of, score_labels

from .common import DEFENDED_COLOUR, base_layout, log_ticks, visible_token

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
    (`kvviz.explain.defended`)."""
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


def pooling_explanation(kept, scores, victims, position: int, params: dict | None = None):
    """Why pooling kept `position` at this step (`kvviz.explain.Pooling` facts, step
    unset), or None unless it is a defended slot. `params`: SnapKV's (pool_kernel)."""
    return explain.pooling_facts(kept, scores, victims, position, params or {}, -1)


def explain_text(e, step: int) -> str:
    """The defended slot's sentences (the guided experiment, the Scores view, the hover)."""
    from dataclasses import replace

    return explain.pooling_text(replace(e, step=int(step)))


def slot_hover(kept, scores, victims, step: int, params: dict | None = None) -> np.ndarray:
    """Hover text per slot of a pooled policy: its window sum and pooled score, the
    position the pooled score comes from, and for a defended slot the full explanation."""
    kept = np.asarray(kept)
    sums = np.asarray(scores["sums"], float)
    pooled = np.asarray(scores["pooled"], float)
    radius = (int((params or {}).get("pool_kernel", 5)) - 1) // 2
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


def window_positions(panels, center: int, half_width: int):
    """Position range [lo, hi] covering `half_width` kept slots either side of `center`
    in the reference panel (the first with pooled scores, else the first)."""
    ref = next((p for p in panels if "pooled" in p["scores"]), panels[0])
    kept = np.asarray(ref["kept"])
    if len(kept) == 0:
        return int(center), int(center)
    i = int(np.clip(np.searchsorted(kept, center), 0, len(kept) - 1))
    if i > 0 and abs(kept[i - 1] - center) <= abs(kept[i] - center):
        i -= 1
    lo = int(kept[max(0, i - half_width)])
    hi = int(kept[min(len(kept) - 1, i + half_width)])
    return lo, hi


def _positive(v):
    """Scores for a log axis: zero, negative and unobserved (NaN) become gaps."""
    v = np.asarray(v, float)
    return np.where(np.isfinite(v) & (v > 0), v, np.nan)


def neighbourhood_figure(panels, step: int, center: int, half_width: int = 20,
                         height: int | None = None, log: bool = True,
                         tokens=None) -> go.Figure:
    """Per panel, the scores of the kept slots near `center` at `step`, victims marked;
    for a pooled policy also the pooled envelope and the defended slots.

    The x axis has one category per slot held by any panel in the window, so slots that
    are adjacent in the cache (what pooling looks at) are adjacent on the page, and both
    panels line up position by position. Scores are on a log axis by default: eviction
    happens among the smallest scores, which a linear axis squashes to zero.
    """
    lo, hi = window_positions(panels, center, half_width)
    titles = []
    for p in panels:
        r = rank_of(p["policy"])
        titles.append(f"{p['label']}: {r.order if r is not None else _NO_SCORE}")
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.14,
                        subplot_titles=titles)
    union = set()
    for r, p in enumerate(panels, start=1):
        kept = np.asarray(p["kept"])
        sc = p["scores"]
        sel = (kept >= lo) & (kept <= hi)
        x = kept[sel]
        union.update(int(v) for v in x)
        victims = np.intersect1d(np.asarray(p["victims"], np.int64), x)
        cand = np.asarray(sc.get("candidate", np.ones(len(kept), bool)), bool)[sel]
        colour = p.get("colour", "#555555")
        main = _key(p["policy"])
        row_log = log and not _is_count(main) and ("pooled" in sc or (main and main in sc))
        fix = _positive if row_log else (lambda v: np.asarray(v, float))
        if "pooled" in sc and "sums" in sc:
            sums = np.asarray(sc["sums"], float)[sel]
            pooled = np.asarray(sc["pooled"], float)[sel]
            defended = np.intersect1d(defended_positions(kept, sc, p["victims"]), x)
            hover = slot_hover(kept, sc, p["victims"], step, p.get("params"))[sel]
            fig.add_trace(go.Bar(x=x, y=fix(sums), name="window sum", marker_color=np.where(
                cand, colour, "#bbbbbb").tolist(), opacity=0.85, customdata=hover,
                hovertemplate="%{customdata}<extra></extra>"), row=r, col=1)
            fig.add_trace(go.Scatter(x=x, y=fix(pooled), name="pooled envelope",
                                     mode="lines+markers", customdata=hover,
                                     line=dict(color="#222222", width=2, shape="hvh"),
                                     marker=dict(size=5),
                                     hovertemplate="%{customdata}<extra></extra>"), row=r, col=1)
            if len(defended):
                m = np.isin(x, defended)
                fig.add_trace(go.Scatter(
                    x=x[m], y=fix(sums[m]), mode="markers", name="defended (kept by pooling)",
                    marker=dict(symbol="diamond", size=15, color=DEFENDED_COLOUR,
                                line=dict(color="black", width=1)), customdata=hover[m],
                    hovertemplate="%{customdata}<extra></extra>"), row=r, col=1)
            yv = fix(pooled)
            yall = np.concatenate([sums, pooled])
        elif main and main in sc:
            vals = np.asarray(sc[main], float)[sel]
            fig.add_trace(go.Bar(x=x, y=fix(vals), name=score_label(main, policy=p["policy"]),
                                 marker_color=np.where(cand, colour, "#bbbbbb").tolist(),
                                 customdata=np.where(np.isnan(vals), "unobserved (newest)",
                                                     np.char.mod("%.4g", np.nan_to_num(vals))))
                          .update(hovertemplate="position %{x}<br>" + score_label(main, policy=p["policy"])
                                  + " %{customdata}<extra></extra>"), row=r, col=1)
            yv = yall = fix(vals)
        else:
            yv = np.zeros(len(x))
            fig.add_trace(go.Scatter(x=x, y=yv, mode="markers", name="held",
                                     marker=dict(color=colour, size=8, symbol="square"),
                                     hovertemplate="position %{x} held<extra></extra>"),
                          row=r, col=1)
        if len(victims):
            m = np.isin(x, victims)
            fig.add_trace(go.Scatter(x=x[m], y=yv[m], mode="markers",
                                     name=f"victim of {p['label'].split(':')[0]} this step",
                                     marker=dict(symbol="x", size=16, color=colour,
                                                 line=dict(width=2, color="black")),
                                     hovertemplate="position %{x}: evicted at step " + str(step)
                                     + "<extra></extra>"), row=r, col=1)
        ytitle = ("window sum / pooled" if "pooled" in sc else score_label(main, "held", p["policy"])
                  if main in sc else "held")
        if row_log:
            pos = np.asarray(yall, float)
            pos = pos[np.isfinite(pos) & (pos > 0)]
            rng = ([np.log10(pos.min() / 2), np.log10(pos.max() * 1.6)] if len(pos) else None)
            fig.update_yaxes(type="log", title=ytitle + " (log)", row=r, col=1, range=rng,
                             **log_ticks(np.r_[pos, pos.min() / 2] if len(pos) else pos))
        else:
            fig.update_yaxes(title=ytitle, rangemode="tozero", row=r, col=1,
                             **({"showticklabels": False} if ytitle == "held" else {}))
    cats = sorted(union)
    if center in union:
        for r in range(1, len(panels) + 1):
            fig.add_vline(x=cats.index(center), line=dict(color="#CC0000", width=1, dash="dot"),
                          row=r, col=1)
    base_layout(fig, f"Scores of the slots around position {center} at step {step} "
                     f"(grey = protected or not yet ranked)", height or 270 * len(panels) + 170,
                legend_below=True, bottom=190 if tokens is not None else 130)
    ticks = {}
    if tokens is not None:
        ticks = dict(tickmode="array", tickvals=cats,
                     ticktext=[f"{p} {visible_token(tokens[p])[:12]}" for p in cats])
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=cats,
                     tickangle=-90 if len(cats) > 30 or tokens is not None else None,
                     tickfont=dict(size=11), **ticks)
    fig.update_xaxes(title="position (one column per held slot)", row=len(panels), col=1)
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


def why_figure(position: int, step: int, panels) -> go.Figure:
    """Each policy's candidates at `step` in eviction order (first to go on the left) with
    their ranking score; victims marked, `position` highlighted."""
    fig = make_subplots(rows=1, cols=len(panels), horizontal_spacing=0.08,
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
                                     hovertemplate="evicted: position %{customdata}<extra></extra>"),
                          row=1, col=c)
        pm = pos == position
        if pm.any():
            fig.add_trace(go.Scatter(x=ranks[pm], y=vals[pm], mode="markers+text",
                                     name=f"position {position}", text=[f"p{position}"],
                                     textposition="top center", showlegend=c == 1,
                                     marker=dict(symbol="circle-open", size=20, color="#CC0000",
                                                 line=dict(width=3))), row=1, col=c)
        fig.update_xaxes(title="eviction rank (1 = first to go)", row=1, col=c)
        ytitle = score_label(key, "no score", p["policy"]) if key is not None else "no score"
        if not _is_count(key) and len(vals) and np.all(np.isfinite(vals) & (vals > 0)):
            fig.update_yaxes(type="log", title=ytitle + " (log)", row=1, col=c, **log_ticks(vals))
        else:
            fig.update_yaxes(title=ytitle, row=1, col=c)
    base_layout(fig, f"Why position {position} diverged: the candidates each policy ranked "
                     f"at step {step}", 440, legend_below=True)
    return fig
