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
from kvviz.app.figures.room import FLOOR, for_room, wrap
from kvviz.app.ui import layout, wire
from kvviz.app.ui.session import S, note

# Every key the page answers in presentation mode, said in its "keys" line. Another part of
# the page that adds a key adds its line here (e.g. "N / B": "next / previous scene"); the
# button holding it is drawn by that part.
KEYS = {"K or →": "next step", "J or ←": "previous step", "D": "next divergence",
        "E": "next epoch", "H": "next heavy-hitter eviction",
        "T": "next eviction of the tracked position", "P": "leave presentation",
        "N / B": "next / previous scene of a lesson (PageDown and PageUp scroll the page)",
        "V": "reveal the answer of a class's question"}
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


MORE = "kv-more"  # the room's one control holding a view's other charts (layout.PRESENT_CSS)
LEAD = "present.lead"  # the fit `more` kept for a main chart drawn from inside it (`lead`)


@contextlib.contextmanager
def more(label: str = "More of this view: its other charts and tables"):
    """What follows (or surrounds) a view's main chart: in presentation mode behind one
    control (a closed expander, shown in the room although a view's own controls are not),
    so the chart the scene is about is the first thing on the screen; elsewhere in place,
    unchanged. A chart drawn inside is never the fitted one, except through `lead`."""
    if not active():
        yield
        return
    if FIT in S:
        S[LEAD] = S.pop(FIT)
    try:
        with st.expander(label, expanded=False, key=MORE):
            yield
    finally:
        S.pop(LEAD, None)


@contextlib.contextmanager
def lead(box):
    """The view's main chart (and the captions the scene reads, `said`), drawn from inside
    `more` into `box`, a container placed above its control: fitted to the window. Outside
    presentation mode (or with no box) in place."""
    if not active() or box is None:
        yield
        return
    if LEAD in S:
        S[FIT] = S.pop(LEAD)
    with box:
        yield


def said(name: str):
    """A container whose captions stay shown in presentation mode: the lines a scene's text
    depends on (a chart's "B loses the key at step N"), under its chart."""
    return st.container(key=f"kv-said-{name}")


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
    The first chart of a presented view is fitted to the window (`fitted`): its container's
    height is the window's less the page's top rows (kvviz.app.ui.layout.fit_css), and the
    chart stretches to it, so its title, legend and whole plot are on the first screen."""
    if not active():
        return st.plotly_chart(wire.shared(figure), **kw)  # (shared data: serialised once)
    spec = for_room(figure)
    fit = S.pop(FIT, "")
    if not fit:
        return st.plotly_chart(Prebuilt(spec), **kw)
    st.html(f"<style>{layout.fit_css(fit)}</style>")
    with st.container(key="kv-fit", height=layout.FIT_FALLBACK, border=False):
        return st.plotly_chart(Prebuilt(fitted(spec)), **{**kw, "height": "stretch"})


# the narrowest window the room's fitted chart is laid out for (1024x768 at 125 % zoom: 819
# CSS px, less the page's side padding and the plot's own margins)
FIT_WIDTH = 740
LEGEND_CHARS = 24  # a fitted chart's legend names wrap at this many characters
TITLE_PX = 21  # a fitted chart's title (the scene's title is said above it)
Y_TITLE_CHARS = 26  # a fitted chart's y axis titles wrap at this many characters


def _legend_names(spec: dict) -> list[str]:
    seen = []
    for tr in spec.get("data") or ():
        name = tr.get("name")
        if name and tr.get("showlegend", True) is not False and str(name) not in seen:
            seen.append(str(name))
    return seen


def _bottom_x(lay: dict) -> set:
    """The x axes of the lowest row of plots (the others' titles would stand in the gap
    where the next row's plot titles are)."""
    ys = {k: tuple((v.get("domain") or (0, 1))) for k, v in lay.items()
          if k.startswith("yaxis") and isinstance(v, dict)}
    low = min((d[0] for d in ys.values()), default=0)
    out = set()
    for k, v in lay.items():
        if k.startswith("xaxis") and isinstance(v, dict):
            anchor = str(v.get("anchor") or "y")
            y = "yaxis" + anchor[1:]
            if ys.get(y, (0, 1))[0] <= low + 1e-6:
                out.add(k)
    return out


def fitted(spec: dict) -> dict:
    """A room figure laid out to fill whatever height its box has: its title pinned to the
    top of the box and its legend a column at the right (so neither covers a plot's title,
    an axis title or another row's plots, whatever the height), every label wrapped to the
    width it has, the margins just what the labels need, the plots every other pixel."""
    lay = dict(spec.get("layout") or {})
    base = float((lay.get("font") or {}).get("size") or 20)
    title = dict(lay.get("title") or {})
    tsize = TITLE_PX
    text = wrap(str(title.get("text") or "").replace("<br>", " "),
                int(FIT_WIDTH / (0.55 * tsize)))
    title.update(text=text, font=dict(title.get("font") or {}, size=tsize))
    lines = text.count("<br>") + 1 if text else 0
    top = lines * tsize * 1.3 + 14 if text else 10
    if text:  # (plotly sets a title of several lines a line higher than its anchor says)
        title.update(yref="container", y=1, yanchor="top", x=0, xanchor="left",
                     pad=dict(t=round(6 + (lines - 1) * tsize * 1.3)))
        lay["title"] = title
    legend = dict(lay.get("legend") or {})
    names = _legend_names(spec) if lay.get("showlegend", True) is not False else []
    data = spec.get("data") or []
    width = FIT_WIDTH - 90  # the plots' width: less the y tick labels and title
    if names:  # a column at the right, its names wrapped: the plots keep the whole height
        legend.update(orientation="v", yref="paper", y=1, yanchor="top", x=1.02,
                      xanchor="left", valign="middle", tracegroupgap=4)
        legend.pop("entrywidth", None)
        legend["font"] = dict(legend.get("font") or {}, size=FLOOR)  # the room's least
        lay["legend"] = legend
        data = [dict(tr, name=wrap(str(tr["name"]), LEGEND_CHARS)) if tr.get("name") else tr
                for tr in data]
        size = float((legend.get("font") or {}).get("size") or base)
        width -= 0.58 * size * min(LEGEND_CHARS, max(len(n) for n in names)) + 60
    cols = max(1, len({tuple(v.get("domain") or (0, 1)) for k, v in lay.items()
                       if k.startswith("xaxis") and isinstance(v, dict)}))
    low = _bottom_x(lay)
    for k in list(lay):
        ax = lay[k]
        if not (k.startswith(("xaxis", "yaxis")) and isinstance(ax, dict)):
            continue
        ax = dict(ax)
        t = ax.get("title")
        t = dict(t) if isinstance(t, dict) else {"text": t} if t else None
        if t and t.get("text"):
            if k.startswith("xaxis") and k not in low:
                t["text"] = ""  # the lowest row's says it
            elif k.startswith("xaxis"):
                t["standoff"] = 4  # close under its tick labels
            elif k.startswith("yaxis"):  # a vertical title as long as a short plot
                t["text"] = wrap(str(t["text"]).replace("<br>", " "), Y_TITLE_CHARS)
            ax["title"] = t
        lay[k] = ax
    # the first row's subplot titles stand in the top margin, under the title; each wrapped
    # to its plot's width
    sub, notes = 0.0, []
    for a in lay.get("annotations") or ():
        a = dict(a)
        fs = float((a.get("font") or {}).get("size") or base)
        if isinstance(a.get("text"), str) and a.get("name") != "step":
            a["text"] = wrap(a["text"].replace("<br>", " "),
                             max(12, int(width / cols / (0.58 * fs))))
        if (a.get("yanchor") == "bottom" and a.get("yref", "paper") == "paper"
                and float(a.get("y", 0) or 0) >= 0.99 and a.get("text")):
            sub = max(sub, (str(a["text"]).count("<br>") + 1) * fs * 1.3 + 6)
        notes.append(a)
    if notes:
        lay["annotations"] = notes
    margin = dict(lay.get("margin") or {})
    margin.update(l=10, r=10, b=20)  # automargin: as wide and tall as the labels need
    margin["t"] = round(top + sub)
    lay["margin"] = margin
    return {**spec, "data": data, "layout": lay}
