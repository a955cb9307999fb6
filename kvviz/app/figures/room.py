"""Any view's figure re-sized for a projected room (presentation mode, kvviz.app.ui.present).

Pure: a figure (go.Figure, a kvviz `Prebuilt` or its dict) in, a new figure dict out; the
input (often a server-wide cached dict) is never modified and its data arrays are shared,
not copied. Every text size becomes at least FLOOR CSS pixels (and at least SCALE times what
the view chose, so the view's own hierarchy survives); marker sizes, line widths and the
margins that hold the larger labels grow by SCALE. Axis labels get `automargin` so a larger
tick label pushes the plot inward instead of being cut at the figure's edge.
"""
from __future__ import annotations

import numpy as np

FLOOR = 18      # px: read from the back of a room on a 1024x768 projector
SCALE = 1.4     # of the view's own sizes (its base font, 14 px, becomes 20 px)
PLOTLY_FONT = 12  # plotly.js's default font size, where a figure sets none
TITLE = 1.15    # a title's size against the base font (plotly's own 1.4 cuts long titles)
WRAP = 48       # characters: a longer title is broken into lines (a 683 px wide chart at 150 %)
WIDTH = 620     # px: the narrowest chart a room sees (1024x768 at 150 % zoom: 683 CSS px)


def wrap(text: str, width: int = WRAP) -> str:
    """A plain title broken at spaces into lines of at most `width` characters (<br>), since
    plotly never wraps one and a room-sized title runs off a narrow chart."""
    if "<br" in text or len(text) <= width:
        return text
    lines, cur = [], ""
    for word in text.split(" "):
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    return "<br>".join(lines + [cur])


def _size(v, scale: float, floor: float) -> float:
    return max(float(floor), round(float(v) * scale))


def _font(font, inherited: float) -> dict:
    """A copy of a font dict: its own size times SCALE, else the (already scaled) size it
    would inherit; never under FLOOR."""
    out = dict(font or {})
    own = out.get("size")
    out["size"] = _size(own, SCALE, FLOOR) if isinstance(own, (int, float)) else max(
        float(FLOOR), float(inherited))
    return out


def _grow(v, scale: float):
    """A marker size or a line width (number or array) times `scale`; None stays None."""
    if v is None or isinstance(v, (str, dict)):  # dict: an already encoded array, left as is
        return v
    if isinstance(v, (list, tuple, np.ndarray)):
        return (np.asarray(v, dtype=float) * scale).tolist()
    return round(float(v) * scale, 2)


def _line(line, scale: float) -> dict | None:
    if not isinstance(line, dict):
        return line
    out = dict(line)
    if "width" in out:
        out["width"] = _grow(out["width"], scale)
    return out


def _trace(tr: dict, base: float) -> dict:
    t = dict(tr)  # shallow: the arrays stay shared with the input
    if isinstance(t.get("marker"), dict):
        m = dict(t["marker"])
        if "size" in m:
            m["size"] = _grow(m["size"], SCALE)
        if "line" in m:
            m["line"] = _line(m["line"], SCALE)
        if isinstance(m.get("colorbar"), dict):
            m["colorbar"] = _colorbar(m["colorbar"], base)
        t["marker"] = m
    if isinstance(t.get("line"), dict):
        t["line"] = _line(t["line"], SCALE)
    for k in ("textfont", "insidetextfont", "outsidetextfont"):
        if k in t or (k == "textfont" and ("text" in t or "texttemplate" in t)):
            t[k] = _font(t.get(k), base)
    if isinstance(t.get("colorbar"), dict):
        t["colorbar"] = _colorbar(t["colorbar"], base)
    if isinstance(t.get("hoverlabel"), dict) and "font" in t["hoverlabel"]:
        t["hoverlabel"] = dict(t["hoverlabel"], font=_font(t["hoverlabel"]["font"], base))
    return t


def _title(title, inherited: float) -> dict:
    out = {"text": title} if isinstance(title, str) else dict(title or {})
    out["font"] = _font(out.get("font"), inherited)
    return out


def _colorbar(cb: dict, base: float) -> dict:
    out = dict(cb)
    out["tickfont"] = _font(out.get("tickfont"), base)
    if "title" in out:
        out["title"] = _title(out["title"], base)
    return out


def _chars(px: float, size: float) -> int:
    """How many characters of a `size` px font fit in `px` (half an em each, with room)."""
    return max(12, int(px / (0.58 * size)))


def _axis(ax: dict, base: float, cols: int, x: bool) -> dict:
    out = dict(ax)
    out["tickfont"] = _font(out.get("tickfont"), base)
    if "title" in out:
        out["title"] = _title(out["title"], base)
        if x and cols > 1 and out["title"].get("text"):  # a side-by-side subplot's width
            out["title"]["text"] = wrap(out["title"]["text"], _chars(
                0.8 * WIDTH / cols, out["title"]["font"]["size"]))
    out["automargin"] = True
    return out


def _plain(fig) -> dict:
    if isinstance(fig, dict):
        return fig
    if hasattr(fig, "to_dict"):  # go.Figure (copies) or Prebuilt (its dict, no copy)
        return fig.to_dict()
    raise TypeError(f"for_room: a figure or a figure dict, not {type(fig).__name__}")


def for_room(fig) -> dict:
    """`fig` with every text at least FLOOR px and marks SCALE times larger (see module)."""
    spec = _plain(fig)
    lay = dict(spec.get("layout") or {})
    tmpl_font = (((lay.get("template") or {}).get("layout") or {}).get("font") or {})
    given = (lay.get("font") or {}).get("size") or tmpl_font.get("size") or PLOTLY_FONT
    lay["font"] = dict(lay.get("font") or {}, size=_size(given, SCALE, FLOOR))
    base = lay["font"]["size"]
    extra = 0  # px of title lines added by wrapping
    if "title" in lay:
        lay["title"] = _title(lay["title"], round(base * TITLE))
        text = lay["title"].get("text") or ""
        lay["title"]["text"] = wrap(text)
        extra = lay["title"]["text"].count("<br>") * round(lay["title"]["font"]["size"] * 1.3)
    cols = max(1, len({tuple(v.get("domain", (0, 1))) for k, v in lay.items()
                       if k.startswith("xaxis") and isinstance(v, dict)}))
    for k in list(lay):
        if k.startswith(("xaxis", "yaxis")) and isinstance(lay[k], dict):
            lay[k] = _axis(lay[k], base, cols, k.startswith("xaxis"))
        elif k.startswith("coloraxis") and isinstance(lay[k], dict) and "colorbar" in lay[k]:
            lay[k] = dict(lay[k], colorbar=_colorbar(lay[k]["colorbar"], base))
    legend = dict(lay.get("legend") or {})
    legend["font"] = _font(legend.get("font"), base)
    if "title" in legend:
        legend["title"] = _title(legend["title"], base)
    lay["legend"] = legend
    hover = dict(lay.get("hoverlabel") or {})
    hover["font"] = _font(hover.get("font"), base)
    lay["hoverlabel"] = hover
    if lay.get("annotations"):  # subplot titles among them: wrapped to their column
        notes = []
        for a in lay["annotations"]:
            a = dict(a, font=_font(a.get("font"), base))
            if isinstance(a.get("text"), str) and a.get("name") != "step":
                a["text"] = wrap(a["text"], _chars(0.95 * WIDTH / cols, a["font"]["size"]))
                if a["text"].count("<br>") and a.get("yanchor") == "bottom" and float(
                        a.get("y", 0)) >= 0.99:  # a top row's title: the margin holds it
                    extra = max(extra, a["text"].count("<br>") * round(a["font"]["size"] * 1.3))
            notes.append(a)
        lay["annotations"] = notes
    if lay.get("shapes"):
        lay["shapes"] = [dict(s, line=_line(s["line"], SCALE)) if "line" in s else s
                         for s in lay["shapes"]]
    old = lay.get("margin") if isinstance(lay.get("margin"), dict) else {}
    lay["margin"] = {k: (round(v * SCALE) if k in "lrtb" and isinstance(v, (int, float))
                         else v) for k, v in old.items()}
    if extra:
        lay["margin"]["t"] = lay["margin"].get("t", round(100 * SCALE)) + extra
    if isinstance(lay.get("height"), (int, float)):
        rows = len({v.get("domain", (0, 1))[0] for k, v in lay.items()
                    if k.startswith("yaxis") and isinstance(v, dict)})
        if rows > 1:  # subplots: their gaps hold titles and tick labels too, so all grows
            lay["height"] = round(lay["height"] * SCALE) + extra
        else:  # one plot keeps its own height; the margins grow round it
            grown = sum(lay["margin"].get(k, 0) - old.get(k, 0) for k in "tb")
            lay["height"] = round(lay["height"] + grown)
    data = [_trace(t, base) for t in spec.get("data") or ()]
    return {**{k: v for k, v in spec.items() if k not in ("data", "layout")}, "data": data,
            "layout": lay}
