"""A lesson: a playlist of saved page states, each with a speaker note (no Streamlit here).

A lesson is a TOML file in lessons/ (kvviz.core.paths.lessons_dir):

    title = "TOVA against SnapKV"
    minutes = 50
    [[scene]]
    title = "Sixteen tokens, four slots"
    minutes = 4
    note = "TOVA evicts {victims.a} at step {step}; SnapKV {victims.b}. Ask: why?"
    [scene.state]                 # the page's own query keys (kvviz.app.state)
    trace = "file:toy.npz"
    budget = 4
    step = 6

A scene's state is read with kvviz.app.state.from_query, exactly as a link is: a key the
page does not know, or any value it would drop or change (a note), is an error here.
A note is text with placeholders from PLACEHOLDERS (kvviz.app.teach.notes), computed from the
library at the scene's state (the policies replayed with the page's engine, the
explanations' sentences), so its numbers are right by construction. Every error is a ValueError that
names the file, the scene, the field and the rule.
"""
from __future__ import annotations

import re
import string
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from kvviz.app.state import VIEWS, ViewState, from_query
from kvviz.app.teach.notes import (  # noqa: F401 (the API)
    NEEDS,
    PLACEHOLDERS,
    Facts,
    _line,
    _loop,
    _needle_table,
    lookup,
    note_text,
    positions_text,
    scene_trace,
)

# set by the lesson bar, never by a scene (the scene is where they point)
NOT_IN_SCENE = ("lesson", "scene", "follow", "present")


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
    from kvviz.core.paths import lessons_or_default

    return lessons_or_default()


def names(files: list[str] | None = None) -> list[str]:
    """The lessons shipped (file stems of lessons/*.toml, or of `files`: that folder's names
    as the page lists them), sorted."""
    if files is None:
        d = lessons_folder()
        files = [p.name for p in d.glob("*.toml")] if d.is_dir() else []
    return sorted(Path(f).stem for f in files if f.endswith(".toml"))


def path_of(name: str) -> Path:
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"lesson {name!r}: not a lesson name (a file in lessons/)")
    path = lessons_folder() / f"{name}.toml"
    if not path.is_file():
        # the folder's own path is the server's business, not the page's reader's
        raise ValueError(f"lesson {name!r}: no file {name}.toml in the lessons folder "
                         f"(lessons: {', '.join(names()) or 'none'})")
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
    from kvviz.core.paths import loop_or_default, traces_or_default

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
    from kvviz.app.figures.slides import MAX_FRAMES

    if not 0 <= vs.slides_frames <= MAX_FRAMES:
        _fail(path, where, f"state.slides.frames: {vs.slides_frames} is outside 0–{MAX_FRAMES}")
    if vs.budget is not None:
        from kvviz.core.policies import make_policy

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
        task = vs.needle.get("ntask", "passkey")
        table = _needle_table(task)
        if table is None:
            _fail(path, where, "state: needle keys given, and no needle results are shipped"
                  if task == "passkey" else f"state.ntask: {task!r}: no results of that task "
                  "and option in the tasks folder")
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
        ph = lookup(f)
        if ph is None:
            _fail(path, where, f"note: unknown placeholder {{{f}}} (known: "
                               f"{', '.join('{' + k + '}' for k in PLACEHOLDERS)}, and a study's "
                               "result as {primary.STUDY.ID} or {secondary.STUDY.ID})")
        if spec or conv:
            _fail(path, where, f"note: placeholder {{{f}}} takes no format or conversion")
        missing = [k for k in NEEDS[ph.kind] if k not in query]
        if missing:
            _fail(path, where, f"note: placeholder {{{f}}} needs state.{missing[0]} "
                               f"(a {ph.kind} placeholder reads "
                               f"{', '.join(NEEDS[ph.kind])})")


def summary(lesson: Lesson, n: int) -> str:
    """One line for `kvviz lesson check`: number, minutes, view, trace, title."""
    s = lesson.scene(n)
    where = (s.state.loop if s.state.view == "loop" else "needle results"
             if s.state.view == "needle" else s.state.trace)
    return f"scene {n:2d} · {s.minutes:g} min · {s.state.view} · {where} · {s.title}"




# --- questions decided by evidence ---------------------------------------------------------
# The views beside which the page offers "Ask: which position will A (or B) evict next?"
# (a model-run view, loop or needle, replays no step).
ASK_VIEWS = ("cache", "scores", "divergence", "survival", "metrics", "compare", "tokens")
CLEAR = 0.05  # the answer's score at least this far (relative) below the runner-up's


@dataclass(frozen=True)
class Evidence:
    """What decides the question "which position will W evict next?" at a scene's step: the
    answer's score (the highest among the positions evicted, the policy evicting its lowest)
    against the runner-up's (the lowest score among the candidates it keeps)."""

    which: str           # "a" or "b"
    step: int            # the step the page shows when the question is asked
    answer_step: int     # the step the eviction happens
    answer: tuple        # the positions evicted there
    score: float         # the answer's score (its rank key)
    runner_up: int       # the candidate kept with the lowest score
    runner_score: float
    score_name: str      # what the policy ranks by

    @property
    def margin(self) -> float:
        """(runner-up − answer) / |runner-up|: 0 for a tie; inf when the runner-up scores 0
        and the answer less."""
        gap = self.runner_score - self.score
        if gap == 0:
            return 0.0
        return gap / abs(self.runner_score) if self.runner_score else float("inf")


def question_evidence(facts, which: str) -> Evidence | None:
    """The evidence of the question asked of side `which` at the scene's step (the page's ask
    button, kvviz.app.teach.question.asked_at); None when the policy evicts nothing later, ranks
    by no score, or keeps no other candidate."""
    import numpy as np

    from kvviz.app.explain import score_name
    from kvviz.app.teach.question import asked_at
    from kvviz.core.policies import rank_of

    q = asked_at(facts.engine(which).evicted_at, facts.step)
    if q is None:
        return None
    panel = facts.panel(which, q.answer_step)
    r = rank_of(panel["policy"])
    if r is None or r.key not in panel["scores"]:
        return None
    kept = np.asarray(panel["kept"])
    vals = np.asarray(panel["scores"][r.key], np.float64)
    cand = np.asarray(panel["scores"].get("candidate", np.ones(len(kept), bool)), bool)
    gone = np.isin(kept, q.answer)
    rest = np.flatnonzero(cand & ~gone)
    if not len(rest) or not (cand & gone).any():
        return None
    low = rest[np.lexsort((kept[rest], vals[rest]))[0]]
    return Evidence(which=which, step=facts.step, answer_step=q.answer_step, answer=q.answer,
                    score=float(np.nanmax(vals[cand & gone])), runner_up=int(kept[low]),
                    runner_score=float(vals[low]),
                    score_name=score_name(r.label, r.key, panel.get("params")) or "score")


# the views that replay a trace step by step (the others show a model run)
STEP_VIEWS = ASK_VIEWS


def opening_eviction(facts, which: str) -> tuple[int, list]:
    """The first eviction a page opens on, side `which`: (its step, the victims a tie decided
    there, kvviz.app.explain.tie_facts). The step is the page's own (the state's step, else,
    as the page chooses, the first step the two policies differ); when the policy evicts
    nothing there, its next eviction. (-1, []) when it evicts nothing from there on."""
    from kvviz.app.explain import tie_facts
    from kvviz.app.figures.states import divergence_steps
    from kvviz.app.teach.question import asked_at

    step = facts.vs.step
    if step is None:
        div = divergence_steps(facts.engine("a").evicted_at, facts.engine("b").evicted_at)
        step = int(div[0]) if len(div) else 0
    else:
        step = facts.step
    if not len(facts.engine(which).victims(step)):
        q = asked_at(facts.engine(which).evicted_at, step)
        if q is None:
            return -1, []
        step = q.answer_step
    return step, tie_facts(which.upper(), facts.panel(which, step))


def default_page() -> Scene:
    """The page a link without keys opens (kvviz.app.state's defaults, the trace's default
    budget), as a scene, to read with Facts and opening_eviction."""
    return with_budget(Scene(number=0, title="the default page", minutes=0.0, query={},
                             note="", state=ViewState()))


def with_budget(scene: Scene) -> Scene:
    """`scene` itself, or, when its state sets no budget, a copy at its trace's default
    budget (as the page opens it)."""
    import copy

    from kvviz.app.state import default_budget

    if scene.state.budget is not None:
        return scene
    vs = copy.deepcopy(scene.state)
    vs.budget = default_budget(scene_trace(vs, "layer" in scene.query).steps)
    return replace(scene, state=vs)


def check_opening(path: Path, where: str, facts) -> None:
    """A ValueError when the first eviction the page opens on is decided by a tie-break (for
    either side), not by the policy's score: the first thing a class sees must show the
    score at work."""
    for which in ("a", "b"):
        step, ties = opening_eviction(facts, which)
        if ties:
            t = ties[0]
            score = "no observed weight" if t.score is None else f"{t.score_label} {t.score:.4g}"
            held = ", ".join(map(str, t.kept[:5])) + (", …" if len(t.kept) > 5 else "")
            _fail(path, where,
                  f"the first eviction the page shows is a tie: {which.upper()} "
                  f"({facts.label(which)}) evicts position {t.position} at step {step} with "
                  f"{score}, exactly as {len(t.kept)} held position"
                  f"{'s' if len(t.kept) > 1 else ''} ({held}); its score did not "
                  "choose it, the tie-break did (choose another step, budget or policy)")


def check_evidence(lesson: Lesson) -> None:
    """Every question a scene lets the lecturer ask (A and B, in the views that offer the ask
    buttons) is decided by clear evidence: a ValueError naming the scene, the side, both
    positions and scores when the answer is tied with, or within CLEAR of, the runner-up.
    Then every scene that replays a trace opens on a first eviction its score decided
    (check_opening)."""
    for s in lesson.scenes:
        if s.state.view not in ASK_VIEWS or s.state.step is None:
            continue
        facts = Facts(s)
        for which in ("a", "b"):
            e = question_evidence(facts, which)
            if e is None or e.margin >= CLEAR:
                continue
            ask = f"which position will {which.upper()} evict next? (asked at step {e.step})"
            how = ("ties with" if e.margin == 0 else
                   f"is only {100 * e.margin:.1f} % below")
            answer = positions_text(e.answer)
            _fail(lesson.path, f"scene {s.number}",
                  f"question \"{ask}\": the answer, {answer} at step {e.answer_step} "
                  f"({e.score_name} {e.score:.4g}), {how} position {e.runner_up} "
                  f"({e.runner_score:.4g}); a question needs its answer at least "
                  f"{100 * CLEAR:g} % below the runner-up (choose another step)")
    for s in lesson.scenes:
        if s.state.view in STEP_VIEWS:
            check_opening(lesson.path, f"scene {s.number}", Facts(with_budget(s)))


# --- what the scenes claim against what the studies support ---------------------------------
PRIMARY_WORD = re.compile(r"\bprimary\b", re.I)
# a scene's claim that a policy forgets (the Forgetting view's name is not a claim)
FORGETS_TITLE = re.compile(r"\bforg(?:et|ets|ot|otten|etting)\b(?!\s+view)", re.I)
FORGETS_NOTE = re.compile(r"\b(?:forgets|forgot|forgotten)\b", re.I)
LEAST_RETURNS = 2  # returns inside the eviction window: a quiet stretch between two of them
RETURN_TASKS = ("recall", "returns")  # tasks whose key the text returns to (reminder_positions)


def _sentences(note: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+|\n", note) if s.strip()]


def quote_status(name: str) -> str | None:
    """The mark of the study result placeholder {name} quotes: "primary" or "secondary" for
    {primary.*} / {secondary.*} (the answers file's mark), "not pre-registered" for the tasks
    study's answers ({tasks.*}) unless answers.json marks that part primary; None for a
    placeholder that quotes no study result."""
    ph = lookup(name)
    if ph is None or ph.kind not in ("study", "tasks"):
        return None
    if ph.kind == "study":
        from kvviz.studies.stats import study_result

        _, study, rid = name.split(".", 2)
        return study_result(study, rid)[1]["status"]
    from kvviz.app.teach.notes import task_answers

    part = name.split(".")[1].split("_")[0]
    entry = task_answers().get(part)
    return "primary" if isinstance(entry, dict) and entry.get("status") == "primary" else \
        "not pre-registered"


def check_claims(lesson: Lesson) -> None:
    """A ValueError naming the scene when (1) a sentence of its note calls a result it quotes
    primary while the study marks it secondary (or it was not pre-registered), or (2) it
    claims a policy forgets (its title or note) without showing a prompt where the full cache
    answers and, on a task whose key the text returns to, where at least LEAST_RETURNS returns
    fall inside the eviction window of the policy shown (decode mode: the returns after its
    first eviction)."""
    for s in lesson.scenes:
        where = f"scene {s.number}"
        for sentence in _sentences(s.note):
            fields = [f for _, f, _, _ in string.Formatter().parse(sentence) if f]
            words = re.sub(r"\{[^{}]*\}", "", sentence)
            if not PRIMARY_WORD.search(words):
                continue
            for f in fields:
                try:
                    status = quote_status(f)
                except ValueError as exc:
                    _fail(lesson.path, where, f"{{{f}}}: {exc}")
                if status is not None and status != "primary":
                    _fail(lesson.path, where,
                          f"note: the sentence \"{sentence.strip()}\" calls {{{f}}} primary, and "
                          f"that result is {status} (say it is secondary, with its Holm-"
                          "corrected p, or quote the claim's primary contrast)")
        if FORGETS_TITLE.search(s.title) or FORGETS_NOTE.search(re.sub(r"\{[^{}]*\}", "", s.note)):
            _check_forgets(lesson.path, where, s)


def _check_forgets(path, where, s: Scene) -> None:
    import json

    from kvviz.core.paths import needle_dir, tasks_dir
    from kvviz.model.needle.results import load_run
    from kvviz.studies.forgetting import FULL_LABEL, right

    claim = f"it claims a policy forgets ({s.title!r})"
    if s.state.view != "needle" or not s.state.needle:
        _fail(path, where, f"{claim} and shows no prompt: a forgetting scene is a needle view "
                           "at one prompt (nbudget, nmode, ngran, nlen, ndepth, nseed)")
    rows = Facts(s).needle_rows()
    full = rows[rows["line"] == FULL_LABEL]
    if full.empty or not bool(right(full).iloc[0]):
        _fail(path, where, f"{claim} on a prompt the full cache gets wrong: that is the model's "
                           "error, not eviction's (choose a prompt the full cache answers)")
    task = s.state.needle.get("ntask", "passkey")
    if not task.startswith(RETURN_TASKS):
        return
    if s.state.needle.get("nmode") != "decode":
        _fail(path, where, f"{claim} in prefill mode, where every return precedes the one "
                           "eviction (choose nmode = \"decode\")")
    line = s.state.needle.get("npol", "tova")
    row = rows[rows["line"] == line]
    if row.empty:
        _fail(path, where, f"state.npol: {line!r} has no run at this cell")
    row = row.iloc[0]
    folder = needle_dir() if task == "passkey" else tasks_dir()
    run = load_run(folder, row["id"])
    labels = [c["label"] for c in run["meta"]["configs"]]
    if row["label"] not in labels:
        _fail(path, where, f"run {row['id']}: no config {row['label']!r}")
    e = run["evicted_at"][labels.index(row["label"])]
    first = int(e[e >= 0].min()) if (e >= 0).any() else None
    returns = row["reminder_positions"]
    returns = json.loads(returns) if isinstance(returns, str) else list(returns)
    inside = [int(p) for p in returns if first is not None and int(p) >= first]
    if len(inside) < LEAST_RETURNS:
        when = "never evicts" if first is None else f"first evicts at step {first}"
        _fail(path, where,
              f"{claim}, and at this prompt {line} {when}: {len(inside)} of the key's "
              f"{len(returns)} returns {'falls' if len(inside) == 1 else 'fall'} inside the "
              "eviction window (at least "
              f"{LEAST_RETURNS} are needed for a quiet stretch between two returns; choose a "
              "prompt, spacing or budget where they do, or drop the claim)")
