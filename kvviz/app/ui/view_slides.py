"""Slides view (Streamlit side): the cache heatmap or the token strip over a step range as
an animated GIF, and the current step as a PNG, drawn on the server (kvviz.app.figures.slides).

The files are built only when a download button is clicked (Streamlit's deferred download:
the button gets a callable), so opening the view costs one small preview image. Every
Plotly chart on the page also has the modebar's camera button, which saves that chart as a
PNG in the browser.
"""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app.figures import slides as SL
from kvviz.app.ui.session import S, widget

FRAME_MS = (80, 150, 300, 600)
MAX_TOKENS = 600


@st.cache_data(max_entries=16, show_spinner=False)
def _preview(kind: str, ev_a, ev_b, step: int, s0: int, s1: int, p0: int, p1: int,
             labels: tuple, tokens: tuple | None) -> bytes:
    if kind == "tokens":
        return SL.token_png(list(tokens), ev_a, ev_b, step, lo=p0, hi=p1, label_a=labels[0],
                            label_b=labels[1])
    return SL.heatmap_png(ev_a, ev_b, step, start=s0, stop=s1, pos_range=(p0, p1),
                          label_a=labels[0], label_b=labels[1])


def _fit_range(v, lo: int, hi: int, default: tuple) -> tuple:
    """A range slider's value inside [lo, hi] (the trace may have changed), else `default`."""
    try:
        a, b = sorted(int(x) for x in v)
    except (TypeError, ValueError):
        a, b = default
    a, b = min(max(a, lo), hi), min(max(b, lo), hi)
    return (a, b) if a < b else default


def _range(key: str, lo: int, hi: int, default: tuple) -> None:
    """Keep a range slider's stored value inside [lo, hi]."""
    S[key] = _fit_range(S.get(key, default), lo, hi, default)


def render(ctx) -> None:
    T = ctx.trace.steps
    src = (ctx.key, ctx.layer, T)
    if S.get("slides.src") != src:  # another trace: start from its defaults
        for k in ("slides.steps", "slides.pos", "slides.tokens", "slides.frames"):
            S.pop(k, None)
        if S.get("slides.src") is not None:  # (a link's own values are kept)
            S["kv"].update(slides_steps=(), slides_frames=0)
        S["slides.src"] = src
    if T < 2:
        st.info("Slides need a trace of at least two steps.")
        return
    kinds = ["heatmap"] + (["tokens"] if ctx.trace.tokens is not None else [])
    # kind, steps and frames are in the link (session.widget); the rest is the view's own
    kind = widget(st.segmented_control, "slides_kind", "animate", kinds, key="slides.kind",
                  required=True, fit=lambda v: v if v in kinds else "heatmap",
                  format_func={"heatmap": "cache heatmap", "tokens": "token strip"}.get)
    kind = kind if kind in kinds else "heatmap"
    c = st.columns([3, 3, 1.1, 1.3])
    s0, s1 = widget(c[0].slider, "slides_steps", "steps", 0, T - 1, key="slides.steps",
                    fit=lambda v: _fit_range(v, 0, T - 1, (0, T - 1)),
                    help="The animation runs over these steps.")
    if kind == "tokens":
        _range("slides.tokens", 0, T - 1, (0, min(T, 300) - 1))  # the text appears, then goes
        p0, last = c[1].slider("tokens", 0, T - 1, key="slides.tokens",
                               help=f"The token positions shown, first to last (at most "
                                    f"{MAX_TOKENS}).")
    else:
        _range("slides.pos", 0, T - 1, (0, T - 1))
        p0, last = c[1].slider("positions", 0, T - 1, key="slides.pos",
                               help="The positions shown, first to last (the heatmap's columns).")
    p1 = int(last) + 1  # positions are chosen first to last, like steps; the library takes [p0, p1)
    auto = min(48, s1 - s0 + 1)  # the state's 0: follows the step range until chosen
    if not S["kv"].get("slides_frames") and S.get("slides.frames") == S.get("slides.auto"):
        S.pop("slides.frames", None)  # not chosen (the box still shows the last automatic)
    S["slides.auto"] = auto
    frames = int(widget(c[2].number_input, "slides_frames", "frames", min_value=1,
                        max_value=SL.MAX_FRAMES, key="slides.frames",
                        show=lambda v: int(v) or auto,
                        fit=lambda v: min(max(int(v), 1), SL.MAX_FRAMES),
                        store=lambda v: 0 if v == auto else int(v)))
    ms = c[3].selectbox("ms/frame", FRAME_MS, index=1, key="slides.ms",
                        help="How long each frame is shown.")
    step = int(np.clip(ctx.step, s0, s1))
    labels = (ctx.label_a, ctx.label_b)
    try:
        SL.frame_steps(s0, s1, frames)
        if kind == "tokens":
            if p1 - p0 > MAX_TOKENS:
                raise ValueError(f"token positions: at most {MAX_TOKENS} tokens, got {p1 - p0}")
            SL.token_layout(ctx.trace.tokens, p0, p1)
        else:
            SL.heatmap_layout(T, s0, s1, (p0, p1))
    except ValueError as exc:
        st.error(f"Cannot build these slides: {exc}")
        return
    ev_a, ev_b = ctx.ev_a, ctx.ev_b
    tokens = tuple(ctx.trace.tokens) if kind == "tokens" else None
    stem = (f"kvviz_{getattr(ctx.trace, 'name', 'trace')}_{ctx.a}_vs_{ctx.b}_b{ctx.budget}_"
            f"{kind}")

    def gif() -> bytes:
        if kind == "tokens":
            return SL.token_gif(list(tokens), ev_a, ev_b, s0, s1, frames, lo=p0, hi=p1,
                                label_a=labels[0], label_b=labels[1], duration_ms=ms)
        return SL.heatmap_gif(ev_a, ev_b, s0, s1, frames, pos_range=(p0, p1),
                              label_a=labels[0], label_b=labels[1], duration_ms=ms)

    d = st.columns(2)
    d[0].download_button(f"animated GIF: {frames} frames, steps {s0}–{s1}", gif,
                         f"{stem}_steps{s0}-{s1}.gif", "image/gif", key="dl.gif",
                         on_click="ignore", width="stretch", icon=":material/animation:")
    png = _preview(kind, ev_a, ev_b, step, s0, s1, p0, p1, labels, tokens)
    d[1].download_button(f"PNG of step {step}", png, f"{stem}_step{step}.png", "image/png",
                         key="dl.png", on_click="ignore", width="stretch",
                         icon=":material/image:")
    st.image(png, caption=f"Step {step} (the page's current step, within the range)")
    st.caption("The GIF is drawn on the server from the two eviction logs when you click: "
               "the heatmap fills in row by row as the steps pass, or the tokens change colour "
               "as they are evicted. Any chart on the other views can be saved as a PNG with "
               "the camera button in its top-right toolbar.")
