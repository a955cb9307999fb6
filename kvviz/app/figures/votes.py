"""Predict then reveal: the held slots a guess may name, and the class's guesses.

Pure: a round's data in (kvviz.app.teach.classroom.Round or anything with the same fields),
a Plotly figure out. Neither figure carries a score, and the guesses name the answer only
once the round is revealed, so a projected page gives nothing away before the reveal.
"""
from __future__ import annotations

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
    guessed them); before that every bar is grey."""
    tally = {}
    for p in r.votes.values():
        tally[int(p)] = tally.get(int(p), 0) + 1
    answer = {int(p) for p in r.answer} if r.revealed else set()
    xs = sorted(set(tally) | answer)
    fig = go.Figure(go.Bar(
        x=[str(p) for p in xs], y=[tally.get(p, 0) for p in xs],
        marker_color=[ANSWER_COLOUR if p in answer else GUESS_COLOUR for p in xs],
        text=["answer" if p in answer else "" for p in xs], textposition="outside",
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
