"""Small helpers shared by the figure builders."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

# Every policy has one colour in every view: its declared `Policy.colour` (the registry),
# or for a plugin that declares none a colour of PALETTE chosen from its name. A and B are
# drawn in their policies' colours (`pair_colours`). Categories that are no policy (right
# and wrong answers, a defended slot, a guess) use colours no policy uses (CATEGORY).
A_COLOUR = "#E69F00"   # TOVA's, A's default policy (kvviz.core.policies.tova)
B_COLOUR = "#0072B2"   # SnapKV's, B's default policy
RIGHT_COLOUR = "#117733"   # a right answer (dark green)
WRONG_COLOUR = "#882255"   # a wrong answer (wine)
DEFENDED_COLOUR = "#332288"  # a slot pooling defended (indigo)
NEUTRAL_COLOUR = "#BBBBBB"   # a category with no meaning of its own (a guess, not a candidate)
CATEGORY = (RIGHT_COLOUR, WRONG_COLOUR, DEFENDED_COLOUR, NEUTRAL_COLOUR)
# For policies that declare no colour: colour-blind-safe hues no built-in and no category uses.
PALETTE = ("#44AA99", "#AA4499", "#6699CC", "#888833", "#DDCC77", "#999933", "#CC6677",
           "#88CCEE", "#117799", "#AA7744")
KEY_COLOUR = "#F0E442"  # the pass key's tokens (yellow): a category
UNKNOWN_COLOUR = "#555555"  # a name the registry does not know


def _hash(name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")


def policy_colour(name) -> str:
    """A registered policy's declared colour. One that declares none (a plugin, an allocator)
    takes a PALETTE colour no declared colour takes: the one its name hashes to, or the next
    free one when a name hashed earlier took it (so two plugins never share a colour while
    the palette lasts, and the same registry gives the same colours in every process).
    UNKNOWN_COLOUR for a name not registered."""
    from kvviz.core.policies import ALLOCATORS, POLICIES

    every = {**POLICIES, **ALLOCATORS}
    cls = every.get(str(name))
    if cls is None:
        return UNKNOWN_COLOUR
    if getattr(cls, "colour", None):
        return cls.colour
    declared = {getattr(k, "colour", None) for k in every.values()}
    free = [c for c in PALETTE if c not in declared] or list(PALETTE)
    taken: dict[str, str] = {}
    for n in sorted((n for n, k in every.items() if not getattr(k, "colour", None)),
                    key=lambda n: (_hash(n), n)):
        i = _hash(n) % len(free)
        left = [c for c in free if c not in taken.values()] or free
        pick = free[i] if free[i] in left else left[i % len(left)]
        taken[n] = pick
    return taken[str(name)]


def policy_of(label: str) -> str:
    """The policy name in a run's label: 'A: snapkv (poolKernel=1)' -> 'snapkv'."""
    label = str(label).split(": ", 1)[-1] if str(label)[:3] in ("A: ", "B: ") else str(label)
    return label.strip().split(" ")[0]


def lighter(colour: str, share: float = 0.5) -> str:
    """`colour` mixed with white (share of white)."""
    rgb = [int(colour.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4)]
    return "#" + "".join(f"{round(v + (255 - v) * share):02X}" for v in rgb)


def darker(colour: str, share: float = 0.35) -> str:
    """`colour` mixed with black (share of black)."""
    rgb = [int(colour.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4)]
    return "#" + "".join(f"{round(v * (1 - share)):02X}" for v in rgb)


def setting_colour(policy: str, nth: int) -> str:
    """The colour of a policy's `nth` setting in one chart (0: its first): the policy's own
    colour, then shades of it, lighter and darker in turn, so two settings of one policy
    ("snapkv", "snapkv (poolKernel=1)") differ and both keep their policy's hue."""
    c = policy_colour(policy)
    if nth <= 0:
        return c
    step = (nth + 1) // 2
    return lighter(c, min(0.7, 0.4 * step)) if nth % 2 else darker(c, min(0.6, 0.35 * step))


def pair_colours(label_a: str, label_b: str) -> tuple[str, str]:
    """A's and B's colours: each its policy's. Both sides the same policy (two settings of
    SnapKV): B takes a lighter shade of it, so the two stay apart and keep their hue."""
    ca, cb = policy_colour(policy_of(label_a)), policy_colour(policy_of(label_b))
    # a figure drawn without its policies' names ("A", "B"): the default pair's colours
    ca = A_COLOUR if ca == UNKNOWN_COLOUR else ca
    cb = B_COLOUR if cb == UNKNOWN_COLOUR else cb
    return (ca, lighter(cb)) if ca == cb else (ca, cb)
FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=14)
_AXIS = dict(gridcolor="#EBF0F8", linecolor="#EBF0F8", zerolinecolor="#EBF0F8", ticks="",
             automargin=True, title=dict(standoff=12))
# A small white theme, laid on each figure as its values where the figure sets none (what a
# template does). Not as a template: assigning one to a figure, even this small dict, merges it
# into plotly's default template and validates the whole result, ~45 ms a figure, most of a
# small figure's cost (the class's question figure: 68 ms -> 39 ms).
LIGHT = dict(layout=dict(paper_bgcolor="white", plot_bgcolor="white", xaxis=_AXIS, yaxis=_AXIS,
                         colorway=["#333333", "#6A3D9A", "#777777"],  # no policy's colour
                         hovermode="closest"))


def _fill(obj, values: dict) -> None:
    """Set each of `values` on the plotly object `obj` where it has none (nested dicts
    likewise): a template's rule, that the figure's own values win."""
    for k, v in values.items():
        if isinstance(v, dict):
            _fill(obj[k], v)
        elif obj[k] is None:
            obj[k] = v


_LIGHT_TOP = {k: v for k, v in LIGHT["layout"].items() if k not in ("xaxis", "yaxis")}


def light(fig: go.Figure) -> go.Figure:
    """LIGHT on `fig`'s layout and every axis it has (call once its subplots exist)."""
    _fill(fig.layout, _LIGHT_TOP)
    fig.for_each_xaxis(lambda ax: _fill(ax, _AXIS))
    fig.for_each_yaxis(lambda ax: _fill(ax, _AXIS))
    return fig


def base_layout(fig: go.Figure, title: str, height: int = 360,
                legend_below: bool = False, bottom: int = 120) -> go.Figure:
    """Shared look. `legend_below` (figures with subplot titles, which a top legend would
    cover) pins the legend to the bottom edge of the figure, under the axis titles, inside a
    `bottom`-pixel margin."""
    legend = (dict(orientation="h", yref="container", yanchor="bottom", y=0.005, x=0,
                   xanchor="left") if legend_below
              else dict(orientation="h", yanchor="bottom", y=1.02, x=1, xanchor="right"))
    fig.update_layout(title=dict(text=title, x=0.0, xanchor="left"), height=height,
                      margin=dict(l=60, r=20, t=70, b=bottom if legend_below else 50), font=FONT,
                      hoverlabel=dict(font_size=14), legend=legend)
    return light(fig)


def range_label(lo: int, hi: int) -> str:
    """Inclusive label for the integer range [lo, hi)."""
    return f"{lo}" if hi - lo <= 1 else f"{lo}–{hi - 1}"


def plain_number(v: float) -> str:
    """0.002 -> '0.002', 5000 -> '5000': tick text a class reads without SI prefixes."""
    v = float(v)
    if v == 0 or 1e-5 <= abs(v) < 1e7:
        return np.format_float_positional(v, precision=6, trim="-")
    return f"{v:.0e}"


def log_ticks(values) -> dict:
    """Tick values and plain-number labels for a log axis over `values` (positive finite
    ones): 1-2-5 steps when the data spans up to 3 decades, powers of ten beyond."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v) & (v > 0)]
    if not len(v):
        return {}
    lo, hi = np.floor(np.log10(v.min())), np.ceil(np.log10(v.max()))
    mult = (1, 2, 5) if hi - lo <= 3 else (1,)
    ticks = [m * 10.0 ** e for e in range(int(lo), int(hi) + 1) for m in mult]
    ticks = [t for t in ticks if v.min() / 2.5 <= t <= v.max() * 2.5] or [10.0 ** lo]
    return dict(tickmode="array", tickvals=ticks, ticktext=[plain_number(t) for t in ticks])
