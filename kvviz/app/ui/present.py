"""Presentation mode (`present=1`): no sidebar, no controls but step navigation,
the one selected view at full width, every chart re-sized for the room.

The sidebar's functions take `draw=False` here and hand their widgets to `QUIET`, which
draws nothing and returns the value the widget would hold (the session's state, fitted and
clamped exactly as when drawn), so the page computes the same trace, budget and policies.
A view's own settings (zoom, the compared policies, ...) keep their values from the state
and are hidden by the page's CSS (kvviz.app.ui.layout.PRESENT_CSS); its charts go through
`kvviz.app.figures.room.for_room`.
"""
from __future__ import annotations

import contextlib

import streamlit as st

from kvviz.app.figures.cache import Prebuilt
from kvviz.app.figures.room import for_room
from kvviz.app.ui import layout, wire
from kvviz.app.ui.session import S, note

# Every key the page answers in presentation mode, said in its "keys" line. Another part of
# the page that adds a key adds its line here (e.g. "N / B": "next / previous scene"); the
# button holding it is drawn by that part.
KEYS = {"K or →": "next step", "J or ←": "previous step", "D": "next divergence",
        "E": "next epoch", "H": "next heavy-hitter eviction",
        "T": "next eviction of the tracked position", "P": "leave presentation",
        "N / B": "next / previous scene of a lesson (kvviz.app.ui.lesson; PageDown and "
                 "PageUp scroll the page)",
        "V": "reveal the answer of a class's question (kvviz.app.ui.predict)"}
TOGGLE = "P"


def active() -> bool:
    """This run is in presentation mode (the link's or the button's `present`)."""
    try:
        return int(S.get("kv", {}).get("present", 0) or 0) == 1
    except (TypeError, ValueError):
        return False


def _set(on: bool) -> None:
    S["kv"]["present"] = int(on)
    if on:
        S["present"] = 1  # the plain key's own session key (kvviz.app.ui.session.PLAIN_KEYS)
    else:
        S.pop("present", None)


def button() -> None:
    """"Present" at the head of the sidebar (normal mode; key P)."""
    st.sidebar.button("Present", key="nav.present", on_click=_set, args=(True,), shortcut=TOGGLE,
                      icon=":material/slideshow:", width="stretch",
                      help="Presentation mode (key P): no sidebar, one view at full width, "
                           "large type for a projector; in the link as present=1.")


FIT = "present.fit"  # the next chart this run draws is fitted to the window (`chart`)


def bar():
    """In presentation mode, at the top: the page's CSS for the room and the one compact row
    (returned) that the lesson's scene, the class's code and count, the step navigation, the
    ask buttons and the way back (key P, `leave`) share, so the chart is on the first screen."""
    st.html(f"<style>{layout.PRESENT_CSS}</style>")
    return st.container(key="kv-top", horizontal=True, wrap=True, vertical_alignment="center",
                        gap="small")


def leave(row) -> None:
    """The way back to the explorer (key P), the row's last item."""
    row.button(
        "Leave", key="nav.leave", on_click=_set, args=(False,), shortcut=TOGGLE,
        icon=":material/close_fullscreen:", width="content",
        help="Leave presentation: back to the explorer, with the sidebar and every control "
             "(key P). Keys: " + "; ".join(f"{k}: {what}" for k, what in KEYS.items()) + ".")


def keys_line() -> None:
    st.caption("keys: " + " · ".join(f"**{k}** {what}" for k, what in KEYS.items()))


@contextlib.contextmanager
def frame(view: str):
    """The view's container: in presentation mode one the CSS can find (the view's own
    settings are hidden there), whose first chart is fitted to the window (`chart`),
    followed by the keys line; else no container at all (the explorer's page is unchanged)."""
    if not active():
        yield
        return
    fit_next(view)
    with st.container(key=f"room-{view}"):
        yield
    S.pop(FIT, None)
    keys_line()


def fit_next(view: str = "") -> None:
    """The next chart drawn (in presentation mode) fills the window's height below the
    page's top rows (above `view`), whatever height its figure asked for (`chart`)."""
    S[FIT] = view or "-"


class Quiet:
    """A sidebar that draws nothing: each widget returns the value its session key holds
    (the sidebar's code fits and clamps it there before drawing, as it does for a drawn
    widget), and its messages become the page's notes, said above the view."""

    def _value(self, *args, key=None, **kw):
        return S.get(key) if key else None

    selectbox = slider = number_input = multiselect = segmented_control = _value

    def file_uploader(self, *args, **kw):
        return None

    def _say(self, body, *args, **kw):
        note(str(body))

    error = warning = info = success = _say

    def _nothing(self, *args, **kw):
        return None

    header = subheader = caption = markdown = write = _nothing

    def container(self, *args, **kw):
        return contextlib.nullcontext()


QUIET = Quiet()


def sidebar(draw: bool = True):
    return st.sidebar if draw else QUIET


# --- the room's charts ------------------------------------------------------------------------
def chart(figure, **kw):
    """`st.plotly_chart`, with the figure re-sized for the room (`for_room`) when this run's
    session presents; every view draws its charts through it (no other session changes).
    The first chart of a presented view is fitted to the window: its container's height is
    the window's less the page's top rows (kvviz.app.ui.layout.FIT_CSS), and the chart
    stretches to it, so its title, plot and legend are on the first screen at any size."""
    if not active():
        return st.plotly_chart(wire.shared(figure), **kw)  # (shared data: serialised once)
    spec = for_room(figure)
    height = (spec.get("layout") or {}).get("height")
    fit = S.pop(FIT, "")
    if fit and _rows(spec) > 1:  # stacked plots squeezed are unreadable: their own height,
        spec = _legend_beside(spec)  # and the legend at the top right, on the first screen
    if not fit or not isinstance(height, (int, float)) or _rows(spec) > 1:
        return st.plotly_chart(Prebuilt(spec), **kw)
    st.html(f"<style>{layout.fit_css(int(height), fit)}</style>")
    with st.container(key="kv-fit", height=layout.FIT_FALLBACK, border=False):
        return st.plotly_chart(Prebuilt(spec), **{**kw, "height": "stretch"})


def _rows(spec: dict) -> int:
    """How many plots a figure stacks (distinct vertical domains of its y axes)."""
    lay = spec.get("layout") or {}
    return max(1, len({tuple((v.get("domain") or (0, 1))) for k, v in lay.items()
                       if k.startswith("yaxis") and isinstance(v, dict)}))


def _legend_beside(spec: dict) -> dict:
    """A figure whose legend sits under its plots, with the legend at its top instead, in
    rows under the title (the top margin grows by them), so it is on the first screen."""
    lay = dict(spec.get("layout") or {})
    legend = dict(lay.get("legend") or {})
    if legend.get("yref") != "container" or float(legend.get("y", 1)) > 0.5:
        return spec
    margin = dict(lay.get("margin") or {})
    height = lay.get("height")
    if not isinstance(height, (int, float)) or not isinstance(margin.get("t"), (int, float)):
        return spec
    names = {tr.get("name") for tr in spec.get("data") or () if tr.get("showlegend", True)
             and tr.get("name")}
    rows = -(-max(1, len(names)) // 3)  # three entries a row on the narrowest room chart
    size = float((legend.get("font") or {}).get("size") or 20)
    legend_px = round(rows * size * 1.6) + 8
    title = dict(lay.get("title") or {})
    tsize = float((title.get("font") or {}).get("size") or 23)
    title_px = round((str(title.get("text", "")).count("<br>") + 1) * tsize * 1.25) + 30
    # the title pinned to the top, the legend under it, then the old margin's room for the
    # first plot's own title: the top margin grows by the legend's rows
    top = max(int(margin["t"]), title_px + 36) + legend_px
    total = int(height) + top - int(margin["t"])
    title.update(yref="container", y=1 - 26 / total, yanchor="top")
    legend.update(orientation="h", yref="container", y=1 - title_px / total,
                  yanchor="top", x=0, xanchor="left")
    freed = max(0, int(margin.get("b", 0)) - 110)  # the legend's rows below the axis titles
    margin["t"] = top
    margin["b"] = int(margin.get("b", 0)) - freed
    lay.update(title=title, legend=legend, margin=margin, height=total - freed)
    return {**spec, "layout": lay}
