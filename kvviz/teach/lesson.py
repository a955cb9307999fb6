"""A lesson: a playlist of saved page states, each with a speaker note (no Streamlit here).

A lesson is a TOML file in lessons/ (kvviz.paths.lessons_dir):

    title = "TOVA against SnapKV"
    minutes = 50
    [[scene]]
    title = "Sixteen tokens, four slots"
    minutes = 4
    note = "TOVA evicts {victims.a} at step {step}; SnapKV {victims.b}. Ask: why?"
    [scene.state]                 # the page's own query keys (kvviz.ui.state)
    trace = "file:toy.npz"
    budget = 4
    step = 6

A scene's state is read with kvviz.ui.state.from_query, exactly as a link is: a key the
page does not know, or any value it would drop or change (a note), is an error here.
A note is text with placeholders from PLACEHOLDERS, computed from the library at the
scene's state (the policies replayed with the page's engine, the explanations'
sentences), so its numbers are right by construction. Every error is a ValueError that
names the file, the scene, the field and the rule.
"""
from __future__ import annotations

import string
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvviz.ui.state import VIEWS, ViewState, from_query

# set by the lesson bar, never by a scene (the scene is where they point)
NOT_IN_SCENE = ("lesson", "scene", "follow", "present")
NEEDLE_CELL = ("nbudget", "nmode", "ngran", "nlen", "ndepth", "nseed")
# what each kind of placeholder needs in the scene's state
NEEDS = {"trace": ("trace", "budget", "step"), "loop": ("view", "loop", "loop.policy", "loop.budget"),
         "needle": ("view",) + NEEDLE_CELL}


@dataclass(frozen=True)
class Scene:
    number: int          # 1-based
    title: str
    minutes: float
    query: dict          # the page's query keys -> str values
    note: str            # the speaker note's template (placeholders unfilled)
    state: ViewState


@dataclass(frozen=True)
class Lesson:
    name: str            # the file's stem: `?lesson=NAME`
    path: Path
    title: str
    minutes: float
    scenes: tuple

    def scene(self, n: int) -> Scene:
        if not 1 <= int(n) <= len(self.scenes):
            raise ValueError(f"{self.path.name}: scene {n}: the lesson has scenes 1–"
                             f"{len(self.scenes)}")
        return self.scenes[int(n) - 1]


def link(name: str, n: int) -> str:
    """The scene's short link (a query string): opening it applies the scene's state."""
    return f"?lesson={name}&scene={int(n)}"


# --- finding and loading ----------------------------------------------------------------
def lessons_folder() -> Path:
    from kvviz.paths import lessons_or_default

    return lessons_or_default()


def names() -> list[str]:
    """The lessons shipped (file stems of lessons/*.toml), sorted."""
    d = lessons_folder()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def path_of(name: str) -> Path:
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"lesson {name!r}: not a lesson name (a file in lessons/)")
    path = lessons_folder() / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"lesson {name!r}: no file {path}")
    return path


def load(where) -> Lesson:
    """A lesson by name (`tova-vs-snapkv`) or by path, validated."""
    path = Path(where) if str(where).endswith(".toml") or "/" in str(where) else path_of(str(where))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path.name}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path.name}: not valid TOML ({exc})") from None
    return parse(data, path)


def _fail(path: Path, where: str, rule: str):
    raise ValueError(f"{path.name}: {where}: {rule}")


def _title(path, where, value):
    if not isinstance(value, str) or not value.strip():
        _fail(path, where, "title is missing (a non-empty string is required)")
    return value.strip()


def _minutes(path, where, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        _fail(path, where, f"minutes must be a positive number, got {value!r}")
    return float(value)


def parse(data: dict, path: Path) -> Lesson:
    path = Path(path)
    unknown = set(data) - {"title", "minutes", "scene"}
    if unknown:
        _fail(path, "lesson", f"unknown field {sorted(unknown)[0]!r} (fields: title, minutes, "
                              "scene)")
    title = _title(path, "lesson", data.get("title"))
    minutes = _minutes(path, "lesson", data.get("minutes"))
    raw = data.get("scene")
    if not isinstance(raw, list) or not raw or not all(isinstance(s, dict) for s in raw):
        _fail(path, "lesson", "no scenes ([[scene]] tables are required)")
    scenes = tuple(_scene(path, i + 1, s) for i, s in enumerate(raw))
    total = sum(s.minutes for s in scenes)
    if abs(total - minutes) > 1e-9:
        _fail(path, "lesson", f"the scenes' minutes sum to {total:g}, not the lesson's "
                              f"{minutes:g}")
    return Lesson(name=path.stem, path=path, title=title, minutes=minutes, scenes=scenes)


def _scene(path: Path, n: int, s: dict) -> Scene:
    where = f"scene {n}"
    unknown = set(s) - {"title", "minutes", "note", "state"}
    if unknown:
        _fail(path, where, f"unknown field {sorted(unknown)[0]!r} (fields: title, minutes, "
                           "note, state)")
    title = _title(path, where, s.get("title"))
    minutes = _minutes(path, where, s.get("minutes"))
    note = s.get("note")
    if not isinstance(note, str) or not note.strip():
        _fail(path, where, "note is missing (the speaker note, a non-empty string)")
    state = s.get("state", {})
    if not isinstance(state, dict):
        _fail(path, where, "state must be a table of the page's query keys")
    query = {}
    for k, v in state.items():
        if isinstance(v, dict):  # TOML reads `a.poolKernel = 3` as a table a = {poolKernel}
            items = [(f"{k}.{k2}", v2) for k2, v2 in v.items()]
        else:
            items = [(k, v)]
        for key, val in items:
            if isinstance(val, bool) or not isinstance(val, (str, int, float)):
                _fail(path, where, f"state.{key}: must be a string or a number, got {val!r}")
            query[key] = str(val)
    for key in NOT_IN_SCENE:
        if key in query:
            _fail(path, where, f"state.{key}: set by the lesson bar, not by a scene")
    vs, notes = from_query(query)
    for msg in notes:
        if msg.startswith("unknown key"):
            _fail(path, where, f"state: {msg.replace('unknown key', 'unknown query key')}")
        _fail(path, where, f"state: {msg} (a scene must open exactly as written)")
    _check_state(path, where, query, vs)
    _check_note(path, where, note, query)
    return Scene(number=n, title=title, minutes=minutes, query=query, note=note, state=vs)


def _check_state(path, where, query, vs: ViewState) -> None:
    """What from_query leaves to the page: the view, the trace, the policies at the budget,
    the loop result and the needle cell (the page would say each, then show another)."""
    from kvviz.paths import loop_or_default, traces_or_default

    if vs.view not in VIEWS:
        _fail(path, where, f"state.view: unknown view {vs.view!r} (views: {', '.join(VIEWS)})")
    if vs.trace != "canonical":
        files = sorted(p.name for p in traces_or_default().glob("*.npz"))
        if not vs.trace.startswith("file:") or vs.trace[5:] not in files:
            _fail(path, where, f"state.trace: unknown trace {vs.trace!r} (canonical or "
                               f"file:NAME with NAME one of {', '.join(files)})")
    try:
        trace = scene_trace(vs, "layer" in query)
    except ValueError as exc:
        _fail(path, where, f"state.{'head' if 'head' in str(exc) else 'layer'}: {exc}")
    T = trace.steps
    if vs.view == "tokens" and trace.tokens is None:
        _fail(path, where, f"state.view: {vs.trace} has no tokens for the tokens view")
    if vs.budget is not None and not 1 <= vs.budget <= T:
        _fail(path, where, f"state.budget: {vs.budget} is outside 1–{T} ({vs.trace})")
    if vs.step is not None and not 0 <= vs.step < T:
        _fail(path, where, f"state.step: {vs.step} is not a step of {vs.trace} (0–{T - 1})")
    for key in ("focus", "why", "track"):
        v = getattr(vs, key)
        if not -1 <= v < T:
            _fail(path, where, f"state.{key}: {v} is not a position of {vs.trace} (0–{T - 1})")
        if key != "track" and vs.step is not None and v > vs.step:
            _fail(path, where, f"state.{key}: position {v} is not generated until step {v} "
                               f"(the scene shows step {vs.step})")
    if vs.slides_steps and not 0 <= vs.slides_steps[0] <= vs.slides_steps[1] < T:
        _fail(path, where, f"state.slides.steps: {vs.slides_steps[0]},{vs.slides_steps[1]} is not "
                           f"a range of steps S0,S1 with 0 <= S0 <= S1 <= {T - 1}")
    kinds = ("", "heatmap") + (("tokens",) if trace.tokens is not None else ())
    if vs.slides_kind not in kinds:
        _fail(path, where, f"state.slides.kind: {vs.slides_kind!r} is not one of "
                           f"{', '.join(k for k in kinds if k)}")
    from kvviz.views.slides import MAX_FRAMES

    if not 0 <= vs.slides_frames <= MAX_FRAMES:
        _fail(path, where, f"state.slides.frames: {vs.slides_frames} is outside 0–{MAX_FRAMES}")
    if vs.budget is not None:
        from kvviz.policies import make_policy

        for which in ("a", "b"):
            try:
                make_policy(getattr(vs, which), budget=int(vs.budget), **vs.params(which))
            except ValueError as exc:
                _fail(path, where, f"state.{which}: {getattr(vs, which)} refuses budget "
                                   f"{vs.budget}: {exc}")
    if vs.view == "loop" or "loop" in query:
        stems = sorted(p.stem for p in loop_or_default().glob("*.npz"))
        if vs.loop not in stems:
            _fail(path, where, f"state.loop: unknown loop result {vs.loop!r} (results: "
                               f"{', '.join(stems) or 'none'})")
        rows = [r for r in _loop(str(loop_or_default() / f"{vs.loop}.npz")).results
                if r["policy"] != "full"]
        lines = sorted({_line(r) for r in rows})
        if "loop.policy" in query and vs.loop_policy not in lines:
            _fail(path, where, f"state.loop.policy: {vs.loop_policy!r} is not a policy line of "
                               f"{vs.loop} ({', '.join(lines)})")
        if "loop.budget" in query:
            buds = sorted({r["budget"] for r in rows if _line(r) == (vs.loop_policy or "tova")})
            if vs.loop_budget not in buds:
                _fail(path, where, f"state.loop.budget: {vs.loop_budget} is not a budget of "
                                   f"{vs.loop_policy or 'tova'} in {vs.loop} "
                                   f"({', '.join(map(str, buds))})")
    if vs.needle:
        table = _needle_table()
        if table is None:
            _fail(path, where, "state: needle keys given, and no needle results are shipped")
        cols = {"nbudget": "budget", "nmode": "prompt_mode", "ngran": "granularity",
                "nlen": "length", "ndepth": "depth", "nseed": "seed"}
        for k, col in cols.items():
            if k in vs.needle:
                vals = sorted({str(v) for v in table[col]})
                if not any(_same(vs.needle[k], v) for v in vals):
                    _fail(path, where, f"state.{k}: {vs.needle[k]!r} is not one of the needle "
                                       f"results' values ({', '.join(vals)})")
        lines = sorted(set(table["line"]))
        for k in ("npol", "nvs"):
            if k in vs.needle and vs.needle[k] not in lines:
                _fail(path, where, f"state.{k}: {vs.needle[k]!r} is not a policy line of the "
                                   f"needle results ({', '.join(lines)})")


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def _check_note(path, where, note: str, query: dict) -> None:
    try:
        parsed = list(string.Formatter().parse(note))
    except ValueError as exc:
        _fail(path, where, f"note: {exc} (write a literal brace as {{{{ or }}}})")
    for _, f, spec, conv in parsed:
        if f is None:
            continue
        if f not in PLACEHOLDERS:
            _fail(path, where, f"note: unknown placeholder {{{f}}} (known: "
                               f"{', '.join('{' + k + '}' for k in PLACEHOLDERS)})")
        if spec or conv:
            _fail(path, where, f"note: placeholder {{{f}}} takes no format or conversion")
        missing = [k for k in NEEDS[PLACEHOLDERS[f].kind] if k not in query]
        if missing:
            _fail(path, where, f"note: placeholder {{{f}}} needs state.{missing[0]} "
                               f"(a {PLACEHOLDERS[f].kind} placeholder reads "
                               f"{', '.join(NEEDS[PLACEHOLDERS[f].kind])})")


# --- placeholders -----------------------------------------------------------------------
@dataclass(frozen=True)
class Placeholder:
    name: str
    kind: str     # "trace", "loop" or "needle": what it reads (NEEDS)
    fn: object    # (Facts) -> str
    doc: str


PLACEHOLDERS: dict[str, Placeholder] = {}


def placeholder(kind: str, sides: bool = False):
    """Register `fn(facts[, which])` as {name} (or {name.a} and {name.b} with `sides`); its
    docstring is the vocabulary's entry."""
    def deco(fn):
        base = fn.__name__.strip("_").replace("__", ".")
        doc = " ".join((fn.__doc__ or "").split())
        if sides:
            for w in ("a", "b"):
                PLACEHOLDERS[f"{base}.{w}"] = Placeholder(f"{base}.{w}", kind,
                                                          lambda f, fn=fn, w=w: fn(f, w), doc)
        else:
            PLACEHOLDERS[base] = Placeholder(base, kind, fn, doc)
        return fn
    return deco


def positions_text(ps) -> str:
    """'nothing', 'position 5', 'positions 3, 7 and 9' (every position, none left out)."""
    ps = [int(p) for p in ps]
    if not ps:
        return "nothing"
    if len(ps) == 1:
        return f"position {ps[0]}"
    return "positions " + ", ".join(map(str, ps[:-1])) + f" and {ps[-1]}"


class Facts:
    """The library at one scene's state: the trace, both policies' engines (the page's own
    kvviz.ui.engine.Engine, a checkpointed kvviz.replay.Replay) and their peeks."""

    def __init__(self, scene: Scene):
        self.scene, self.vs, self.query = scene, scene.state, scene.query
        self._eng, self._trace = {}, None

    @property
    def trace(self):
        if self._trace is None:
            self._trace = scene_trace(self.vs, "layer" in self.query)
        return self._trace

    @property
    def step(self) -> int:
        s = int(self.vs.step)
        if not 0 <= s < self.trace.steps:
            raise ValueError(f"state.step: {s} is not a step of this trace (0–"
                             f"{self.trace.steps - 1})")
        return s

    def engine(self, which: str):
        if which not in self._eng:
            from kvviz.ui.engine import Engine

            name = getattr(self.vs, which)
            self._eng[which] = Engine(self.trace, name, int(self.vs.budget),
                                      self.vs.params(which))
        return self._eng[which]

    def label(self, which: str) -> str:
        from kvviz.policies import param_specs

        name = getattr(self.vs, which)
        p = self.vs.params(which)
        diff = [f"{s.label}={p[s.name]}" for s in param_specs(name) if p[s.name] != s.default]
        return name + (f" ({', '.join(diff)})" if diff else "")

    def panel(self, which: str, step: int) -> dict:
        """A policy at `step` as the page's views see it (kvviz.ui.context.Ctx.panel)."""
        kept, scores = self.engine(which).peek(step)
        return dict(label=f"{which.upper()}: {self.label(which)}", policy=getattr(self.vs, which),
                    kept=kept, scores=scores, victims=self.engine(which).victims(step),
                    params=self.vs.params(which))

    def loop_row(self):
        from kvviz.paths import loop_or_default

        res = _loop(str(loop_or_default() / f"{self.vs.loop}.npz"))
        rows = res.results
        hit = [r for r in rows if r["policy"] != "full" and _line(r) == self.vs.loop_policy
               and r["budget"] == self.vs.loop_budget]
        return rows[res.full_index], hit[0]

    def needle_rows(self):
        from kvviz.views import needle as NV

        t, n = _needle_table(), self.vs.needle
        r = NV.at_budget(t, int(n["nbudget"]), n["nmode"], n["ngran"])
        r = r[(r["length"] == int(n["nlen"])) & (r["depth"] == float(n["ndepth"]))
              & (r["seed"] == int(n["nseed"]))]
        if r.empty:
            raise ValueError("state: no needle run at this cell (nlen, ndepth, nseed, nmode, "
                             "ngran)")
        return r


@placeholder("trace")
def step(f: Facts) -> str:
    """The scene's step."""
    return str(f.step)


@placeholder("trace")
def budget(f: Facts) -> str:
    """The scene's budget (slots each policy holds)."""
    return str(int(f.vs.budget))


@placeholder("trace")
def steps(f: Facts) -> str:
    """The trace's length in steps (= positions)."""
    return str(f.trace.steps)


@placeholder("trace", sides=True)
def policy(f: Facts, w: str) -> str:
    """The policy's label as the page shows it: its name and non-default parameters."""
    return f.label(w)


@placeholder("trace", sides=True)
def victims(f: Facts, w: str) -> str:
    """The positions the policy evicts at the scene's step, from the page's engine."""
    return positions_text(f.engine(w).victims(f.step))


@placeholder("trace", sides=True)
def held(f: Facts, w: str) -> str:
    """How many positions the policy holds after the scene's step."""
    from kvviz.replay import held_mask

    return str(int(held_mask(f.engine(w).evicted_at, f.step).sum()))


@placeholder("trace", sides=True)
def next_(f: Facts, w: str) -> str:
    """The answer to "which position will A (or B) evict next?" asked at the scene's step
    (kvviz.teach.question.next_eviction): the positions and the step they go."""
    from kvviz.teach.question import next_eviction

    q = next_eviction(f.engine(w).evicted_at, f.step)
    return "nothing (it evicts nothing from here on)" if q is None else (
        f"{positions_text(q.answer)} at step {q.answer_step}")


@placeholder("trace", sides=True)
def retained(f: Facts, w: str) -> str:
    """The run's retained attention mass (kvviz.metrics), 3 decimals, as a share of 1."""
    from kvviz.metrics import retained_mass

    return f"{retained_mass(f.engine(w).run):.3f}"


@placeholder("trace", sides=True)
def evictions(f: Facts, w: str) -> str:
    """What the policy evicts at the step and how it ranked each victim
    (kvviz.explain.evictions_text)."""
    from kvviz.explain import evictions_text

    return evictions_text(w.upper(), f.panel(w, f.step))


@placeholder("trace")
def diff(f: Facts) -> str:
    """|A Δ B| after the scene's step: positions exactly one of the two holds."""
    from kvviz.views.states import symmetric_difference

    return str(int(symmetric_difference(f.engine("a").evicted_at,
                                        f.engine("b").evicted_at)[f.step]))


@placeholder("trace")
def first_divergence(f: Facts) -> str:
    """The first step at which A and B evict differently ('none' if never)."""
    from kvviz.views.states import divergence_steps

    d = divergence_steps(f.engine("a").evicted_at, f.engine("b").evicted_at)
    return str(int(d[0])) if len(d) else "none"


@placeholder("trace")
def why(f: Facts) -> str:
    """The Divergence view's explanation (kvviz.explain.why_text) of the state's `why`
    position, or with why=-1 the one the view picks: the lowest position held by only one
    side after the step, else the first divergent one."""
    from kvviz import explain
    from kvviz import views as V

    ea, eb = f.engine("a").evicted_at, f.engine("b").evicted_at
    cands = V.divergent_positions(ea, eb)
    if not len(cands):
        raise ValueError("note: {why}: A and B never evict differently at this state")
    if f.vs.why >= 0:
        pos = int(f.vs.why)
    else:
        only_a, only_b = V.only_sets(ea, eb, f.step)
        now = np.concatenate([only_a, only_b])
        pos = int(now.min()) if len(now) else int(cands[0])
    dstep = V.decision_step(ea, eb, pos)
    if dstep < 0:
        raise ValueError(f"note: {{why}}: A and B treat position {pos} the same way")
    panels = [f.panel("a", dstep), f.panel("b", dstep)]
    facts = [explain.decision(w, p, pos) for w, p in zip("AB", panels)]
    return explain.why_text(pos, ea, eb, facts, dstep)


def _pooled_side(f: Facts) -> str:
    for w in ("b", "a"):
        if "pooled" in f.panel(w, f.step)["scores"]:
            return w
    raise ValueError("note: {pooling}/{defended}: neither policy pools its scores (snapkv)")


@placeholder("trace")
def defended(f: Facts) -> str:
    """The slots SnapKV's pooling defends at the step (kvviz.explain.defended): their own
    window sum ranked among the victims, a neighbour's pooled score kept them."""
    p = f.panel(_pooled_side(f), f.step)
    from kvviz.explain import defended as find

    return positions_text(find(p["kept"], p["scores"], p["victims"]))


@placeholder("trace")
def pooling(f: Facts) -> str:
    """Why pooling kept a slot at the step, in SnapKV's own numbers
    (kvviz.explain.pooling_text): the state's `focus` if it is defended, else the first
    defended slot, as the Scores view explains it."""
    from kvviz.explain import defended as find, pooling_facts, pooling_text

    p = f.panel(_pooled_side(f), f.step)
    d = find(p["kept"], p["scores"], p["victims"])
    if not len(d):
        raise ValueError(f"note: {{pooling}}: no slot is defended by pooling at step {f.step}")
    pos = f.vs.focus if f.vs.focus in set(d.tolist()) else int(d[0])
    return pooling_text(pooling_facts(p["kept"], p["scores"], p["victims"], pos, p["params"],
                                      f.step))


@placeholder("trace")
def survival(f: Facts) -> str:
    """What each policy holds of the 4 sinks and the 64 newest positions after the step
    (kvviz.explain.survival_text, the Sinks & recent view's sentence)."""
    from kvviz.explain import survival_facts, survival_text

    facts = [survival_facts(w.upper(), f.label(w), f.engine(w).evicted_at, f.step)
             for w in ("a", "b")]
    return survival_text(facts, f.step)


@placeholder("loop")
def loop__line(f: Facts) -> str:
    """The loop view's chosen run: 'policy line @ budget'."""
    return f"{f.vs.loop_policy} @ {f.vs.loop_budget}"


@placeholder("loop")
def loop__ppl(f: Facts) -> str:
    """That run's perplexity over all predicted tokens, 3 decimals (as the view says)."""
    return f"{f.loop_row()[1]['perplexity']:.3f}"


@placeholder("loop")
def loop__full_ppl(f: Facts) -> str:
    """The full cache's perplexity in the same result, 3 decimals."""
    return f"{f.loop_row()[0]['perplexity']:.3f}"


@placeholder("loop")
def loop__top1(f: Facts) -> str:
    """That run's top-1 agreement with the full cache, as a percentage with 1 decimal."""
    return f"{f.loop_row()[1]['top1_agreement']:.1%}"


@placeholder("loop")
def loop__kl(f: Facts) -> str:
    """That run's mean KL(full ‖ evicted) in nats, 4 decimals."""
    return f"{f.loop_row()[1]['kl']:.4f}"


@placeholder("loop")
def loop__first_eviction(f: Facts) -> str:
    """The step of that run's first eviction."""
    return str(f.loop_row()[1]["first_eviction"])


@placeholder("needle")
def needle__budget(f: Facts) -> str:
    """The needle cell's budget (positions each layer keeps)."""
    return str(int(f.needle_rows()["budget"].max()))


@placeholder("needle")
def needle__length(f: Facts) -> str:
    """The needle cell's prompt length in tokens."""
    return str(int(f.needle_rows()["length"].iloc[0]))


@placeholder("needle")
def needle__key(f: Facts) -> str:
    """The pass key hidden in the needle cell's prompt."""
    return str(f.needle_rows()["key"].iloc[0])


def _needle_lines(f: Facts, right: bool) -> str:
    from kvviz.views.needle import FULL_LABEL

    r = f.needle_rows()
    ok = r["correct"].astype(str).str.lower().isin(["true", "1"])
    lines = sorted(set(r.loc[(ok == right) & (r["line"] != FULL_LABEL), "line"]))
    return ", ".join(lines) or "none"


@placeholder("needle")
def needle__right(f: Facts) -> str:
    """The policies whose answer holds the key at the needle cell and budget (comma-
    separated, 'none')."""
    return _needle_lines(f, True)


@placeholder("needle")
def needle__wrong(f: Facts) -> str:
    """The policies whose answer misses the key at the needle cell and budget."""
    return _needle_lines(f, False)


@placeholder("needle")
def needle__full(f: Facts) -> str:
    """'right' or 'wrong': the full cache's answer at the needle cell."""
    from kvviz.views.needle import FULL_LABEL

    r = f.needle_rows()
    full = r[r["line"] == FULL_LABEL]
    return "right" if str(full["correct"].iloc[0]).lower() in ("true", "1") else "wrong"


def note_text(lesson: Lesson, n: int) -> str:
    """Scene n's speaker note with every placeholder computed. ValueError names the file,
    the scene and the placeholder when one cannot be (e.g. no slot defended at the step)."""
    scene = lesson.scene(n)
    facts = Facts(scene)
    values, out = {}, []
    for text, f, _, _ in string.Formatter().parse(scene.note):
        out.append(text)  # literal text, with {{ and }} already undone
        if f is None:
            continue
        if f not in values:
            try:
                values[f] = PLACEHOLDERS[f].fn(facts)
            except ValueError as exc:
                raise ValueError(f"{lesson.path.name}: scene {n}: {{{f}}}: {exc}") from None
        out.append(values[f])
    return "".join(out).strip()


def summary(lesson: Lesson, n: int) -> str:
    """One line for `kvviz lesson check`: number, minutes, view, trace, title."""
    s = lesson.scene(n)
    where = (s.state.loop if s.state.view == "loop" else "needle results"
             if s.state.view == "needle" else s.state.trace)
    return f"scene {n:2d} · {s.minutes:g} min · {s.state.view} · {where} · {s.title}"


# --- shared readers (one per process; files change rarely) --------------------------------
def scene_trace(vs: ViewState, layer_given: bool):
    """The scene's trace as the page loads it: the state's layer if the scene names one,
    else the first stored; ValueError (the loader's) for a layer or head not stored."""
    from kvviz.paths import traces_or_default

    if vs.trace == "canonical":
        return _trace("canonical", 0.0, None, "mean")
    p = traces_or_default() / vs.trace[5:]
    return _trace(str(p), p.stat().st_mtime, vs.layer if layer_given else None, vs.head)


@lru_cache(maxsize=8)
def _trace(path: str, mtime: float, layer, head: str):
    from kvviz.trace import canonical, load_trace

    if path == "canonical":
        if head != "mean":
            raise ValueError(f"head must be one of ['mean'] for the canonical trace, got {head!r}")
        return canonical().keep_rows()
    return load_trace(path, layer=layer, name=Path(path).stem, head=head)


def _line(row: dict) -> str:
    from kvviz.views.loop import policy_line_label

    return policy_line_label(row["policy"], row["params"])


@lru_cache(maxsize=8)
def _loop(path: str):
    from kvviz.loop import load_loop_result

    return load_loop_result(path)


def _needle_table():
    import os

    from kvviz.paths import traces_or_default

    folder = (Path(os.environ["KVVIZ_NEEDLE_DIR"]) if os.environ.get("KVVIZ_NEEDLE_DIR")
              else traces_or_default() / "needle")
    if not (folder / "results.csv").is_file():
        return None
    return _needle_cached(str(folder), (folder / "results.csv").stat().st_mtime)


@lru_cache(maxsize=2)
def _needle_cached(folder: str, mtime: float):
    from kvviz.needle.results import load_results
    from kvviz.views.needle import with_lines

    return with_lines(load_results(folder))
