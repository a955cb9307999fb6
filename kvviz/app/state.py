"""The explorer's whole state and its URL form (no Streamlit here; pure and testable).

Query string keys (all optional; anything missing takes its default, anything invalid is
dropped with a note):
    trace   canonical | file:NAME.npz | upload:SHA   layer  model layer number
    budget  int        a, b  policy names             a.<label>, b.<label>  policy parameters
            (labels are the cards' names: a.poolKernel=3, b.obsWindow=4, b.recentWindow=32)
    step    int        focus  zoom position (-1 follows the current victim)
    why     divergent position to explain (-1 = automatic)   view  which view is shown
    zoom    cache heatmap range: 0 = whole run, N = +-N steps around the current step
    exp     the guided experiment in effect (explanation shown)
    track   the tracked position, shown in every view (-1 = none)
    follow  a class code: this page follows that class's lecturer (kvviz.app.ui.classroom)
    head    which attention head of a per-head trace: mean (default), kv0.., q0..
    cmp     compare view: the policies shown, comma-separated (default: every registered
            policy, or A, B and the first others when more than MAX_COMPARE are registered)
    and the plain keys of `PLAIN` (one view's own choices: loop, loop.policy, slides.steps ...)

A key given twice is said, and its first value used.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvviz.app.jumps import NOTABLE_SHARE
from kvviz.core.policies import POLICIES, defaults, param_specs, parse_params


@dataclass(frozen=True)
class View:
    """One view of the page: its name (the URL's view=, a lesson's state.view), the label its
    selector shows, and the kvviz.app.ui module whose `render(ctx)` draws it."""

    name: str
    label: str
    glue: str


# The one list of views, in the selector's order: the URL check, lessons, the selector and
# the page's dispatch (kvviz.app.ui.panels.RENDER) all read it.
REGISTRY = (
    View("cache", "Cache heatmap", "view_cache"),
    View("survival", "Sinks & recent", "view_survival"),
    View("scores", "Scores", "view_scores"),
    View("divergence", "Divergence", "view_divergence"),
    View("metrics", "Metrics & sweeps", "view_metrics"),
    View("tokens", "Tokens", "view_tokens"),
    View("compare", "Compare all", "view_compare"),
    View("slides", "Slides", "view_slides"),
    View("export", "Export", "view_export"),
    View("heads", "Heads", "view_heads"),
    View("loop", "Model in the loop", "view_loop"),
    View("needle", "Forgetting", "view_needle"),
)
VIEWS = tuple(v.name for v in REGISTRY)
VIEW_LABELS = {v.name: v.label for v in REGISTRY}


ZOOMS = (0, 32, 128, 512)
MAX_COMPARE = 6  # the compare view's limit (kvviz.app.figures.compare.MAX_POLICIES)


def default_cmp(a: str = "tova", b: str = "snapkv") -> list[str]:
    """The compare view's default: every policy while they fit, else A, B and the first
    registered others up to the limit, in registry order."""
    names = list(POLICIES)
    pick = [n for n in (a, b) if n in POLICIES]
    # fill with policies every trace can run first (knorm needs key norms, vatp value norms;
    # most traces have none)
    for n in sorted(names, key=lambda n: POLICIES[n].reads_key_norms or POLICIES[n].reads_value_norms):
        if len(set(pick)) >= MAX_COMPARE:
            break
        pick.append(n)
    return [n for n in names if n in pick]

# Query keys the page understands (a.<label>/b.<label> are checked against the policy's
# parameters); anything else is reported. A new key = one entry here.
# Plain keys: a view's own choice, one ViewState field each, parsed with the type of the
# field's default and written to the link only when it is not the default. Adding one = a
# line here + the field below; the view reads and draws it with `session.widget`.
PLAIN = {
    "loop": "loop",                # loop view: the result's name ("" = the first)
    "loop.policy": "loop_policy",  # ... its policy line ("" = tova, else the first)
    "loop.budget": "loop_budget",  # ... and budget (0 = the middle one)
    "slides.kind": "slides_kind",  # slides view: what is animated ("" = the heatmap)
    "slides.steps": "slides_steps",  # ... over which steps, "S0,S1" (() = the whole run)
    "slides.frames": "slides_frames",  # ... in how many frames (0 = 48, or fewer steps)
    "nav.share": "share",  # the next-divergence jump: the attention share it looks for
    "present": "present",  # presentation mode: 1 = no sidebar, one view, large type
    "lesson": "lesson",    # the lesson being taught (a file name in lessons/, "" = none)
    "scene": "scene",      # ... and its scene (1-based; 0 = none)
    "heads.allocator": "heads_alloc",  # Heads view: the allocator ("" = adakv)
    "heads.scorer": "heads_scorer",    # ... its scorer, any per-stream policy ("" = tova)
    "heads.budget": "heads_budget",    # ... the mean slots per head (0 = 64)
}
KNOWN_KEYS = {"trace", "layer", "head", "budget", "a", "b", "step", "focus", "why", "view",
              "zoom", "exp", "cmp", "embed", "embed_options", "track", "follow", *PLAIN}
# the Forgetting view's choices (kvviz.app.ui.view_needle checks them against its results)
NEEDLE_KEYS = ("ntask", "nbudget", "nmode", "ngran", "nlen", "ndepth", "nseed", "npol", "nvs",
               "nlayer", "nhead", "nalayer")
KNOWN_KEYS |= set(NEEDLE_KEYS)


@dataclass
class ViewState:
    trace: str = "canonical"
    layer: int = 0
    budget: int | None = None  # None: the trace's default (kvviz.app.ui.sidebar.default_budget)
    a: str = "tova"
    b: str = "snapkv"
    pa: dict = field(default_factory=dict)  # parameter *name* -> value (only non-defaults needed)
    pb: dict = field(default_factory=dict)
    step: int | None = None  # None: choose (first divergence) once the runs exist
    focus: int = -1
    why: int = -1
    view: str = "cache"
    exp: str = ""
    zoom: int = 0  # cache heatmap: 0 = whole run, else +-zoom steps around the current step
    head: str = "mean"  # attention head of a per-head trace
    cmp: list = field(default_factory=default_cmp)  # compare view's policies
    track: int = -1  # the tracked position (-1 = none)
    loop: str = ""
    loop_policy: str = ""
    loop_budget: int = 0
    slides_kind: str = ""
    slides_steps: tuple = ()
    slides_frames: int = 0
    share: float = NOTABLE_SHARE
    present: int = 0
    lesson: str = ""
    scene: int = 0
    needle: dict = field(default_factory=dict)  # NEEDLE_KEYS -> str (the Forgetting view's)
    heads_alloc: str = ""
    heads_scorer: str = ""
    heads_budget: int = 0

    def params(self, which: str) -> dict:
        """Full parameter dict (defaults filled in) for policy 'a' or 'b'."""
        name = self.a if which == "a" else self.b
        given = self.pa if which == "a" else self.pb
        full = defaults(name)
        return {**full, **{k: v for k, v in given.items() if k in full}}


def _first(v):
    return v[0] if isinstance(v, (list, tuple)) else v


def _int(v):
    return int(str(_first(v)).strip())


def _plain(text: str, like):
    """A plain key's value in the type of its field's default `like`; ValueError if not."""
    if isinstance(like, tuple):
        parts = [p for p in str(text).split(",") if p.strip()]
        if len(parts) != 2:
            raise ValueError(text)
        return tuple(int(p) for p in parts)
    return type(like)(str(text).strip())


def plain_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def from_query(query) -> tuple[ViewState, list[str]]:
    """Parse a query mapping (values str or list of str). Returns (state, notes on dropped keys)."""
    st, notes = ViewState(), []
    for k, v in dict(query).items():
        if isinstance(v, (list, tuple)) and len(v) > 1:
            notes.append(f"{k} is given {len(v)} times ({', '.join(map(repr, v))}); "
                         f"using the first, {v[0]!r}")
    q = {k: _first(v) for k, v in dict(query).items()}
    for k, f in PLAIN.items():
        if k in q:
            try:
                setattr(st, f, _plain(q[k], getattr(st, f)))
            except ValueError:
                rule = ("two integers S0,S1" if f == "slides_steps" else "a number"
                        if isinstance(getattr(st, f), float) else "an integer")
                notes.append(f"{k}={q[k]!r} is not {rule}; ignored")
    for key in ("a", "b"):
        if key in q:
            if q[key] in POLICIES:
                setattr(st, key, q[key])
            else:
                notes.append(f"unknown policy {q[key]!r} for {key}; using {getattr(st, key)}")
    for key in ("layer", "budget", "step", "focus", "why", "zoom", "track"):
        if key in q:
            try:
                setattr(st, key, _int(q[key]))
            except ValueError:
                notes.append(f"{key}={q[key]!r} is not an integer; ignored")
    if "trace" in q and q["trace"]:
        st.trace = str(q["trace"])
    if q.get("view"):
        st.view = str(q["view"])  # checked against the registered views by the page
    if "zoom" in q and st.zoom not in ZOOMS:
        notes.append(f"zoom={q['zoom']} is not one of {', '.join(map(str, ZOOMS))}; "
                     "showing the whole run")
        st.zoom = 0
    for k in q:
        if k not in KNOWN_KEYS and not k.startswith(("a.", "b.")):
            notes.append(f"unknown key {k!r} ignored")
    if "exp" in q:
        st.exp = str(q["exp"])
    st.needle = {k: str(q[k]) for k in NEEDLE_KEYS if k in q}
    if q.get("head"):
        st.head = str(q["head"])
    if "cmp" in q:
        names = [n for n in str(q["cmp"]).split(",") if n]
        bad = [n for n in names if n not in POLICIES]
        if bad:
            notes.append(f"cmp: unknown policies {', '.join(map(repr, bad))}; ignored")
        st.cmp = ([n for n in dict.fromkeys(names) if n in POLICIES][:MAX_COMPARE]
                  or default_cmp(st.a, st.b))
    else:
        st.cmp = default_cmp(st.a, st.b)
    for which in ("a", "b"):
        name = getattr(st, which)
        by_key = {**{s.label: s for s in param_specs(name)}, **{s.name: s for s in param_specs(name)}}
        out = {}
        for k, v in q.items():
            if not k.startswith(which + "."):
                continue
            spec = by_key.get(k[2:])
            if spec is None:
                notes.append(f"{name} has no parameter {k[2:]!r}; ignored")
                continue
            try:  # the type here; the rule is the policy's, refused on the page like a control
                val = parse_params(name, {spec.name: v}, check=False)[spec.name]
            except ValueError as exc:
                notes.append(f"{k}={v!r}: {exc}; ignored")
                continue
            if spec.kind != "choice" and not spec.low <= val <= spec.high:
                clamped = min(max(val, spec.low), spec.high)
                notes.append(f"{which}.{spec.label}={val} is outside {spec.low}–{spec.high}; "
                             f"using {clamped}")
                val = clamped
            out[spec.name] = val
        setattr(st, "pa" if which == "a" else "pb", out)
    return st, notes


def to_query(st: ViewState) -> dict[str, str]:
    """Every field explicitly (a link keeps meaning the same view even if defaults change)."""
    q = {"trace": st.trace, "layer": str(st.layer), "a": st.a, "b": st.b}
    if st.budget is not None:
        q["budget"] = str(st.budget)
    for which in ("a", "b"):
        name = getattr(st, which)
        params = st.params(which)
        for spec in param_specs(name):
            q[f"{which}.{spec.label}"] = str(params[spec.name])
    if st.step is not None:
        q["step"] = str(st.step)
    q["focus"] = str(st.focus)
    q["why"] = str(st.why)
    q["view"] = st.view
    q["zoom"] = str(st.zoom)
    if st.exp:
        q["exp"] = st.exp
    if st.track >= 0:
        q["track"] = str(st.track)
    if st.head != "mean":
        q["head"] = st.head
    if list(st.cmp) != default_cmp(st.a, st.b):
        q["cmp"] = ",".join(st.cmp)
    blank = ViewState()
    for k, f in PLAIN.items():
        if getattr(st, f) != getattr(blank, f):
            q[k] = plain_text(getattr(st, f))
    q.update({k: str(v) for k, v in st.needle.items() if k in NEEDLE_KEYS})
    return q

