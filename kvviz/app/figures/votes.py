"""Predict then reveal: the held slots a guess may name, and the class's guesses.

Pure: a round's data in (kvviz.app.teach.classroom.Round or anything with the same fields),
a Plotly figure out. Neither figure carries a score, and the guesses name the answer only
once the round is revealed, so a projected page gives nothing away before the reveal.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from kvviz.app.explain import visible_token
from kvviz.app.figures.common import (
    A_COLOUR,
    B_COLOUR,
    NEUTRAL_COLOUR,
    RIGHT_COLOUR,
    UNKNOWN_COLOUR,
    base_layout,
    policy_colour,
    policy_of,
)
from kvviz.core.policies import rank_of

GUESS_COLOUR = NEUTRAL_COLOUR  # categories: no policy's colours
ANSWER_COLOUR = RIGHT_COLOUR


def votes_word(n: int) -> str:
    """'1 vote', '2 votes' (the load test reads this count from the chart's title)."""
    return f"{n} vote" if n == 1 else f"{n} votes"


def votes_title(r) -> str:
    n = len(r.votes)
    if not r.revealed:
        return f"The class's guesses so far: {votes_word(n)}"
    right = sum(1 for p in r.votes.values() if p in r.answer)
    share = f"{right / n:.0%}" if n else "–"
    return f"The class's guesses: {votes_word(n)}, {right} right ({share})"


def votes_figure(r, height: int = 320) -> go.Figure:
    """One bar per position guessed (its height: how many guessed it), in position order.
    Revealed, the answer's bars are green and labelled 'answer' (drawn even if nobody
    guessed them); before that every bar is grey. A vote cast by a student who left the
    class during the question and came back (`r.rejoined`) is counted and said on its bar
    ("1 after leaving")."""
    tally = {}
    for p in r.votes.values():
        tally[int(p)] = tally.get(int(p), 0) + 1
    back = {}
    for v in getattr(r, "rejoined", ()):
        back[int(r.votes[v])] = back.get(int(r.votes[v]), 0) + 1
    answer = {int(p) for p in r.answer} if r.revealed else set()
    xs = sorted(set(tally) | answer)

    def said(p):
        words = ["answer"] if p in answer else []
        if back.get(p):
            words.append(f"{back[p]} after leaving")
        return " · ".join(words)

    fig = go.Figure(go.Bar(
        x=[str(p) for p in xs], y=[tally.get(p, 0) for p in xs],
        marker_color=[ANSWER_COLOUR if p in answer else GUESS_COLOUR for p in xs],
        marker_pattern_shape=["/" if back.get(p) else "" for p in xs],
        text=[said(p) for p in xs], textposition="outside",
        hovertemplate="position %{x}: %{y} guesses<extra></extra>", cliponaxis=False))
    base_layout(fig, votes_title(r), height=height)
    fig.update_layout(showlegend=False, bargap=0.3)
    fig.update_xaxes(title_text="position guessed", type="category")
    top = max([1, *tally.values()])
    fig.update_yaxes(title_text="guesses", rangemode="tozero", dtick=max(1, top // 5),
                     range=[0, top * 1.25])
    return fig


def held_figure(held, step: int, label: str, who: str = "a", tokens=None,
                height: int = 200) -> go.Figure:
    """The slots a guess may name: one equal bar per held position (before the eviction at
    `step`), hover gives the position and its token; no score, nothing marked."""
    held = [int(p) for p in held]
    colour = policy_colour(policy_of(label))  # the side's policy's colour
    if colour == UNKNOWN_COLOUR:  # a label that names no policy: the side's default
        colour = A_COLOUR if who == "a" else B_COLOUR
    tok = ([visible_token(tokens[p]) if 0 <= p < len(tokens) else "" for p in held]
           if tokens is not None else None)
    fig = go.Figure(go.Bar(
        x=held, y=[1] * len(held), marker_color=colour, width=0.8,
        customdata=tok, hovertemplate=("position %{x}" + (" “%{customdata}”" if tok else "")
                                       + "<extra></extra>")))
    base_layout(fig, f"{who.upper()}: {label} holds {len(held)} positions before its "
                     f"eviction at step {step}", height=height)
    fig.update_layout(showlegend=False)
    fig.update_xaxes(title_text="position (a guess names one of these)",
                     range=[-0.5, max(held, default=0) + 0.5])
    fig.update_yaxes(visible=False, range=[0, 1.05])
    return fig


TOKEN_TICKS = 24  # more held slots than this: positions only under the bars


def evidence_figure(panel: dict, step: int, tokens=None, answer=(), votes=None,
                    height: int = 380) -> go.Figure:
    """What the policy sees at the question's step, for every slot it holds: its own scores
    (`panel["scores"]`, from the policy's `scores()`: the current-step weight for TOVA, the
    window sums and pooled envelope for SnapKV, the accumulated attention for H2O), one bar
    per held slot labelled with its position and token. Before the reveal nothing is marked;
    after it `answer` (the evicted positions) is marked as the policy's victims and `votes`
    ({position: how many guessed it}) above the bars."""
    from kvviz.app.figures.scores import neighbourhood_figure

    kept = np.asarray(panel["kept"])
    shown = dict(panel, victims=np.asarray(sorted(int(p) for p in answer), np.int64))
    centre = int(kept[len(kept) // 2]) if len(kept) else 0
    fig = neighbourhood_figure([shown], step, centre, half_width=len(kept) + 1, height=height,
                               tokens=tokens if len(kept) <= TOKEN_TICKS else None,
                               centre_line=False)  # every slot: no centre to mark
    fig.update_layout(title_text=f"What {panel['label']} sees at step {step}: its own "
                                 f"score of each of the {len(kept)} slots it holds")
    votes = {int(p): int(n) for p, n in (votes or {}).items() if int(p) in set(kept.tolist())}
    if votes:
        sc = panel["scores"]
        r = rank_of(panel["policy"])
        keys = [k for k in ("sums", r.key if r is not None else None) if k and k in sc]
        vals = np.concatenate([np.asarray(sc[k], float) for k in keys] or [np.ones(1)])
        vals = vals[np.isfinite(vals) & (vals > 0)]
        top = float(vals.max()) * 1.25 if len(vals) else 1.0
        xs = sorted(votes)
        fig.add_trace(go.Scatter(
            x=xs, y=[top] * len(xs), mode="markers+text", name="the class's guesses",
            marker=dict(symbol="triangle-down", size=14, color=GUESS_COLOUR,
                        line=dict(color="black", width=1)),
            text=[votes_word(votes[p]) for p in xs], textposition="top center",
            hovertemplate="position %{x}: %{text}<extra></extra>", cliponaxis=False))
    return fig


def attention_rows_figure(rows, held, first_step: int, step: int, tokens=None,
                          height: int = 300) -> go.Figure:
    """The attention rows the policy has read up to `step` (one row per step from
    `first_step`, the trace's own weights), over the positions it holds: the input every
    score above is computed from. Pure: `rows` is a (steps, len(held)) array."""
    held = [int(p) for p in held]
    rows = np.asarray(rows, float)
    labels = [f"{p} {visible_token(tokens[p])}" if tokens is not None and len(held) <= TOKEN_TICKS
              else str(p) for p in held]
    fig = go.Figure(go.Heatmap(
        z=rows, x=labels, y=list(range(int(first_step), int(first_step) + len(rows))),
        colorscale="Greys", zmin=0, colorbar=dict(title="weight", thickness=12),
        hovertemplate="step %{y}, position %{x}: weight %{z:.4f}<extra></extra>"))
    base_layout(fig, f"Attention rows up to step {step}, over the held positions", height=height)
    fig.update_xaxes(title_text="held position", type="category")
    fig.update_yaxes(title_text="step (row)", autorange="reversed")
    return fig
