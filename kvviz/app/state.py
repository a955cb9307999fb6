"""The explorer's whole state and its URL form (no Streamlit here; pure and testable).

Query string keys (all optional; anything missing takes its default, anything invalid is
dropped with a note):
    trace   canonical | file:NAME.npz | upload:SHA   layer  model layer number
    budget  int        a, b  policy names             a.<label>, b.<label>  policy parameters
            (labels are the cards' names: a.poolKernel=3, b.obsWindow=4, b.recentWindow=32)
    step    int        focus  zoom position (-1 follows the current victim)
    why     divergent position to explain (-1 = automatic)   view  which view is shown
    exp     the guided experiment in effect (explanation shown)
    track   the tracked position, shown in every view (-1 = none)
    follow  a class code: this page follows that class's lecturer (kvviz.app.ui.classroom)
    lead    a class code: this page leads that class, if this browser keeps its lecturer key
    head    which attention head of a per-head trace: mean (default), kv0.., q0..
    and each view's own keys (kvviz.app.slices: zoom, cmp, loop.policy, slides.steps ...)

The page-wide fields are `ViewState`'s own; each view's choices are its slice's
(kvviz.app.slices), which parses and writes its own keys. A key given twice is said, and its
first value used.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace

from kvviz.app.slices import MAX_COMPARE, NEEDLE_KEYS, SLICES, ZOOMS, default_cmp  # noqa: F401
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
    View("quest", "Quest", "view_quest"),
    View("loop", "Model in the loop", "view_loop"),
    View("needle", "Forgetting", "view_needle"),
)
VIEWS = tuple(v.name for v in REGISTRY)
VIEW_LABELS = {v.name: v.label for v in REGISTRY}


# Each view's plain keys (URL key -> field), from its slice (kvviz.app.slices): the session
# keeps a view's widget under its key
PLAIN = {k: f for cls in SLICES for k, f in cls.KEYS.items()}
# the page-wide query keys (a view's own are its slice's)
PAGE_QUERY_KEYS = ("trace", "layer", "head", "budget", "a", "b", "step", "focus", "why", "view",
                   "exp", "track", "follow", "lead", "embed", "embed_options")
# Query keys the page understands (a.<label>/b.<label> are checked against the policy's
# parameters); anything else is reported.
KNOWN_KEYS = {*PAGE_QUERY_KEYS, *(k for cls in SLICES for k in cls.url_keys())}
# the view's own field -> its slice
OWNER = {name: cls for cls in SLICES for name in cls.names()}


def default_budget(steps: int) -> int:
    """The budget a trace of `steps` steps opens at when no link sets one."""
    return 512 if steps > 512 else max(1, steps // 4)


@dataclass(init=False)
class ViewState:
    """The page's state: the page-wide fields here, each view's own in its slice (`views`,
    by slice name). A view's field reads and writes through its slice (`vs.zoom`,
    `vs.loop_policy`), and `ViewState(zoom=32, ...)` takes any field by name."""

    trace: str = "canonical"
    layer: int = 0
    budget: int | None = None  # None: the trace's default (default_budget below)
    a: str = "tova"
    b: str = "snapkv"
    pa: dict = field(default_factory=dict)  # parameter *name* -> value (only non-defaults needed)
    pb: dict = field(default_factory=dict)
    step: int | None = None  # None: choose (first divergence) once the runs exist
    focus: int = -1
    why: int = -1
    view: str = "cache"
    exp: str = ""
    head: str = "mean"  # attention head of a per-head trace
    track: int = -1  # the tracked position (-1 = none)
    views: dict = field(default_factory=dict)  # slice name -> that view's slice

    def __init__(self, **given):
        unknown = set(given) - {f.name for f in fields(self)} - set(OWNER)
        if unknown:
            raise TypeError(f"ViewState has no field {', '.join(sorted(unknown))}")
        for f in fields(self):
            if f.name == "views":
                continue
            if f.name in given:
                value = given[f.name]
            else:
                value = f.default_factory() if f.default_factory is not MISSING else f.default
            object.__setattr__(self, f.name, value)
        views = {cls.NAME: cls(**{k: given[k] for k in cls.names() if k in given})
                 for cls in SLICES}
        # a whole ViewState's slices (dataclasses.replace passes them): copies, not shared
        views.update({k: replace(v) for k, v in (given.get("views") or {}).items()})
        object.__setattr__(self, "views", views)

    def __getattr__(self, name):  # only for names that are not the page's own
        views, cls = self.__dict__.get("views"), OWNER.get(name)
        if views is None or cls is None:
            raise AttributeError(f"ViewState has no field {name!r}")
        return getattr(views[cls.NAME], name)

    def __setattr__(self, name, value):
        cls = OWNER.get(name)
        if cls is None:
            object.__setattr__(self, name, value)
        else:
            setattr(self.views[cls.NAME], name, value)

    def slice(self, cls):
        """This page's slice of one view (`vs.slice(LoopState)`)."""
        return self.views[cls.NAME]

    def settle(self) -> None:
        """Types back after a round through the session (numbers, tuples, the defaults of
        fields left empty)."""
        for f in ("layer", "budget", "focus", "why", "track"):
            if getattr(self, f) is not None:
                setattr(self, f, int(getattr(self, f)))
        for part in self.views.values():
            part.settle(self)

    def params(self, which: str) -> dict:
        """Full parameter dict (defaults filled in) for policy 'a' or 'b'."""
        name = self.a if which == "a" else self.b
        given = self.pa if which == "a" else self.pb
        full = defaults(name)
        return {**full, **{k: v for k, v in given.items() if k in full}}


# every field by name, page-wide and the views' own, but the parameter dicts (kept per
# parameter) and the slices themselves
FIELDS = (*(f.name for f in fields(ViewState) if f.name not in ("pa", "pb", "views")), *OWNER)


def _first(v):
    return v[0] if isinstance(v, (list, tuple)) else v


def _int(v):
    return int(str(_first(v)).strip())


def from_query(query) -> tuple[ViewState, list[str]]:
    """Parse a query mapping (values str or list of str). Returns (state, notes on dropped keys)."""
    st, notes = ViewState(), []
    for k, v in dict(query).items():
        if isinstance(v, (list, tuple)) and len(v) > 1:
            notes.append(f"{k} is given {len(v)} times ({', '.join(map(repr, v))}); "
                         f"using the first, {v[0]!r}")
    q = {k: _first(v) for k, v in dict(query).items()}
    for key in ("a", "b"):
        if key in q:
            if q[key] in POLICIES:
                setattr(st, key, q[key])
            else:
                notes.append(f"unknown policy {q[key]!r} for {key}; using {getattr(st, key)}")
    for key in ("layer", "budget", "step", "focus", "why", "track"):
        if key in q:
            try:
                setattr(st, key, _int(q[key]))
            except ValueError:
                notes.append(f"{key}={q[key]!r} is not an integer; ignored")
    if "trace" in q and q["trace"]:
        st.trace = str(q["trace"])
    if q.get("view"):
        st.view = str(q["view"])  # checked against the registered views by the page
    if "exp" in q:
        st.exp = str(q["exp"])
    if q.get("head"):
        st.head = str(q["head"])
    for part in st.views.values():  # each view reads its own keys
        part.parse(q, notes, st)
    for k in q:
        if k not in KNOWN_KEYS and not k.startswith(("a.", "b.")):
            notes.append(f"unknown key {k!r} ignored")
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
            if spec.numeric and not spec.low <= val <= spec.high:
                clamped = min(max(val, spec.low), spec.high)
                notes.append(f"{which}.{spec.label}={val} is outside {spec.low}–{spec.high}; "
                             f"using {clamped}")
                val = clamped
            out[spec.name] = val
        setattr(st, "pa" if which == "a" else "pb", out)
    return st, notes


def to_query(st: ViewState) -> dict[str, str]:
    """Every page-wide field explicitly (a link keeps meaning the same view even if defaults
    change), then each view's own keys (its slice's `query`)."""
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
    if st.exp:
        q["exp"] = st.exp
    if st.track >= 0:
        q["track"] = str(st.track)
    if st.head != "mean":
        q["head"] = st.head
    for part in st.views.values():
        q.update(part.query(st))
    return q
