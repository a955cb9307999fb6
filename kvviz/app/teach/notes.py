"""Speaker notes: the placeholder vocabulary and its values at a scene's state.

A note is text with {placeholders}; each is computed from the library at the scene's state
(the policies replayed with the page's own engine, kvviz.app.engine.Engine; the sentences of
kvviz.app.explain; the loop and needle results as their loaders read them), so a note's numbers
are right by construction. PLACEHOLDERS is the whole vocabulary, one docstring per entry;
NEEDS says which state keys each kind reads (kvviz.app.teach.lesson checks both on load).
No Streamlit here.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvviz.app.state import ViewState

NEEDLE_CELL = ("nbudget", "nmode", "ngran", "nlen", "ndepth", "nseed")
# what each kind of placeholder needs in the scene's state
NEEDS = {"trace": ("trace", "budget", "step"), "loop": ("view", "loop", "loop.policy", "loop.budget"),
         "needle": ("view",) + NEEDLE_CELL, "tasks": (), "study": ()}

# --- placeholders -----------------------------------------------------------------------
@dataclass(frozen=True)
class Placeholder:
    name: str
    kind: str     # "trace", "loop", "needle", "tasks" or "study": what it reads (NEEDS)
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


STUDY_DOC = ("{primary.STUDY.ID} or {secondary.STUDY.ID}: result ID of a pre-registered study "
             "(traces/studies/STUDY/answers.json, written by lab/study_report.py): its sentence, "
             "which carries its mark; the mark in the placeholder must be the one the answers "
             "file gives the result (a secondary result is never quoted as primary)")


def lookup(name: str) -> Placeholder | None:
    """The placeholder {name}: one of PLACEHOLDERS, or a study's result quoted with its mark,
    {primary.STUDY.ID} / {secondary.STUDY.ID} (study__quote); None when neither."""
    if name in PLACEHOLDERS:
        return PLACEHOLDERS[name]
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] in ("primary", "secondary") and all(parts):
        return Placeholder(name, "study", lambda f, n=name: study__quote(n), STUDY_DOC)
    return None


def study__quote(name: str) -> str:
    """{primary.STUDY.ID} / {secondary.STUDY.ID}: the result's sentence from the study's
    answers file; ValueError when the file marks the result otherwise than the placeholder."""
    from kvviz.studies.stats import study_result

    mark, study, rid = name.split(".", 2)
    path, r = study_result(study, rid)
    if r["status"] != mark:
        holm = f", Holm p = {r['holm_p']:.2g}" if "holm_p" in r else ""
        raise ValueError(f"quotes a {r['status']} result as {mark}: {path} marks {rid} "
                         f"{r['status']}{holm} (quote it as {{{r['status']}.{study}.{rid}}})")
    text = r.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{path}: result {rid} has no sentence (text)")
    return text.strip()


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
    kvviz.app.engine.Engine, a checkpointed kvviz.core.replay.Replay) and their peeks."""

    def __init__(self, scene):  # a kvviz.app.teach.lesson.Scene
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
            from kvviz.app.engine import Engine

            name = getattr(self.vs, which)
            self._eng[which] = Engine(self.trace, name, int(self.vs.budget),
                                      self.vs.params(which))
        return self._eng[which]

    def label(self, which: str) -> str:
        """The policy on side `which` as every table and figure names it."""
        from kvviz.core.policies import config_label

        return config_label(getattr(self.vs, which), self.vs.params(which))

    def panel(self, which: str, step: int) -> dict:
        """A policy at `step` as the page's views see it (kvviz.app.ui.context.Ctx.panel)."""
        kept, scores = self.engine(which).peek(step)
        return dict(label=f"{which.upper()}: {self.label(which)}", policy=getattr(self.vs, which),
                    kept=kept, scores=scores, victims=self.engine(which).victims(step),
                    params=self.vs.params(which))

    def loop_row(self):
        from kvviz.core.paths import loop_or_default

        res = _loop(str(loop_or_default() / f"{self.vs.loop}.npz"))
        rows = res.results
        hit = [r for r in rows if r["policy"] != "full" and _line(r) == self.vs.loop_policy
               and r["budget"] == self.vs.loop_budget]
        return rows[res.full_index], hit[0]

    def needle_rows(self):
        from kvviz.studies.forgetting import at_budget

        n = self.vs.needle
        t = _needle_table(n.get("ntask", "passkey"))
        if t is None:
            raise ValueError(f"state.ntask: no results of task {n.get('ntask', 'passkey')!r} "
                             "(no results.csv, or none of its rows)")
        r = at_budget(t, int(n["nbudget"]), n["nmode"], n["ngran"])
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
    """The positions the policy evicts at the scene's step, from the page's engine; a
    victim the tie-break chose (kvviz.app.explain.tie_facts) is said to be one."""
    from kvviz.app.explain import tie_facts

    return positions_text(f.engine(w).victims(f.step)) + tie_words(
        tie_facts(w.upper(), f.panel(w, f.step)))


def tie_words(ties) -> str:
    """' (chosen by a tie-break: ...)' for tie-decided victims, '' without."""
    if not ties:
        return ""
    parts = [f"{t.position} scores exactly as {len(t.kept)} it keeps" for t in ties]
    return (" (not chosen by its score but by the tie-break, the lower position going first: "
            + "; ".join(parts) + ")")


@placeholder("trace", sides=True)
def held(f: Facts, w: str) -> str:
    """How many positions the policy holds after the scene's step."""
    from kvviz.core.replay import held_mask

    return str(int(held_mask(f.engine(w).evicted_at, f.step).sum()))


@placeholder("trace", sides=True)
def next_(f: Facts, w: str) -> str:
    """The answer to "which position will A (or B) evict next?" asked at the scene's step
    (kvviz.app.teach.question.asked_at, as the page's ask button): the positions and the step
    they go."""
    from kvviz.app.explain import tie_facts
    from kvviz.app.teach.question import asked_at

    q = asked_at(f.engine(w).evicted_at, f.step)
    return "nothing (it evicts nothing from here on)" if q is None else (
        f"{positions_text(q.answer)} at step {q.answer_step}"
        + tie_words(tie_facts(w.upper(), f.panel(w, q.answer_step))))


@placeholder("trace", sides=True)
def retained(f: Facts, w: str) -> str:
    """The run's retained attention mass (kvviz.core.metrics), 3 decimals, as a share of 1."""
    from kvviz.core.metrics import retained_mass

    return f"{retained_mass(f.engine(w).run):.3f}"


@placeholder("trace", sides=True)
def evictions(f: Facts, w: str) -> str:
    """What the policy evicts at the step and how it ranked each victim
    (kvviz.app.explain.evictions_text)."""
    from kvviz.app.explain import evictions_text

    return evictions_text(w.upper(), f.panel(w, f.step))


@placeholder("trace")
def diff(f: Facts) -> str:
    """|A Δ B| after the scene's step: positions exactly one of the two holds."""
    from kvviz.app.figures.states import symmetric_difference

    return str(int(symmetric_difference(f.engine("a").evicted_at,
                                        f.engine("b").evicted_at)[f.step]))


@placeholder("trace")
def first_divergence(f: Facts) -> str:
    """The first step at which A and B evict differently ('none' if never)."""
    from kvviz.app.figures.states import divergence_steps

    d = divergence_steps(f.engine("a").evicted_at, f.engine("b").evicted_at)
    return str(int(d[0])) if len(d) else "none"


@placeholder("trace")
def why(f: Facts) -> str:
    """The Divergence view's explanation (kvviz.app.explain.why_text) of the state's `why`
    position, or with why=-1 the one the view picks: the lowest position held by only one
    side after the step, else the first divergent one."""
    from kvviz.app import explain
    from kvviz.app import figures as V

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
    ties = [t for w, p in zip("AB", panels) for t in explain.tie_facts(w, p)]
    return explain.why_text(pos, ea, eb, facts, dstep, ties=ties)


def _pooled_side(f: Facts) -> str:
    for w in ("b", "a"):
        if "pooled" in f.panel(w, f.step)["scores"]:
            return w
    raise ValueError("note: {pooling}/{defended}: neither policy pools its scores (snapkv)")


@placeholder("trace")
def defended(f: Facts) -> str:
    """The slots SnapKV's pooling defends at the step (kvviz.app.explain.defended): their own
    window sum ranked among the victims, a neighbour's pooled score kept them."""
    p = f.panel(_pooled_side(f), f.step)
    from kvviz.app.explain import defended as find

    return positions_text(find(p["kept"], p["scores"], p["victims"]))


@placeholder("trace")
def pooling(f: Facts) -> str:
    """Why pooling kept a slot at the step, in SnapKV's own numbers
    (kvviz.app.explain.pooling_text): the state's `focus` if it is defended, else the first
    defended slot, as the Scores view explains it."""
    from kvviz.app.explain import defended as find
    from kvviz.app.explain import pooling_facts, pooling_text

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
    (kvviz.app.explain.survival_text, the Sinks & recent view's sentence)."""
    from kvviz.app.explain import survival_facts, survival_text

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
    from kvviz.studies.forgetting import FULL_LABEL
    from kvviz.studies.forgetting import right as verdicts

    r = f.needle_rows()
    ok = verdicts(r)
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
    from kvviz.studies.forgetting import FULL_LABEL, right

    r = f.needle_rows()
    return "right" if right(r[r["line"] == FULL_LABEL]).iloc[0] else "wrong"


# --- the tasks study's measured answers (traces/tasks/answers.json) -----------------------


def _answer(part: str) -> str:
    a = task_answers()
    try:
        text = a[part]["answer"]
    except (KeyError, TypeError):
        raise ValueError(f"{answers_path()}: no {part}.answer") from None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{answers_path()}: {part}.answer is not a sentence")
    return text.strip()


@placeholder("tasks")
def tasks__recall(f: Facts) -> str:
    """The tasks study's measured answer for the recall task (TOVA's warning about a token
    that matters intermittently): recall.answer in traces/tasks/answers.json."""
    return _answer("recall")


def _by_k_parts(by_k) -> list[str]:
    from kvviz.studies.forgetting import TRIO_NAMES

    parts = []
    for k in sorted(by_k, key=lambda k: int(k["reminder_every"])):
        acc = ", ".join(f"{TRIO_NAMES[p]} {int(k['accuracy'][p][0])}/{int(k['accuracy'][p][1])}"
                        for p in TRIO_NAMES)
        none = " (no reminder)" if int(k.get("reminders", 1)) == 0 else ""
        worse, better = (int(x) for x in k["against"]["h2o"])
        parts.append(f"K={int(k['reminder_every'])}{none}: {acc} (TOVA wrong where H2O right: "
                     f"{worse}, the reverse: {better})")
    return parts


@placeholder("tasks")
def tasks__recall_by_k(f: Facts) -> str:
    """The cell answers.json's recall.by_k was counted at (mode, length, budget), then per
    reminder spacing K: TOVA's, H2O's and Scissorhands' right answers over prompts and, paired
    prompt by prompt, how often TOVA was wrong where H2O was right and the reverse, e.g.
    'decode, 256 tokens, budget 192: K=3: TOVA 4/30, H2O 11/30, Scissorhands 0/30 (TOVA wrong
    where H2O right: 8, the reverse: 1); ...'; K in increasing order. Then the same for each
    longer decode cell in recall.longer ('<length>@<budget>')."""
    path = answers_path()
    answers = task_answers()  # its own error names a missing or unreadable file
    try:
        rec = answers["recall"]
        parts = _by_k_parts(rec["by_k"])
        longer = [(*map(int, c.split("@")), _by_k_parts(rows)) for c, rows in (rec.get("longer") or {}).items()]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ValueError(f"{path}: recall.by_k is not the study's table ({type(exc).__name__}: {exc})") from None
    if not parts:
        raise ValueError(f"{path}: recall.by_k is empty")
    try:
        cell = f"{rec['mode']}, {int(rec['length'])} tokens, budget {int(rec['budget'])}: "
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: recall has no mode, length and budget for its by_k table") from None
    return "; ".join([cell + "; ".join(parts)]
                     + [f"decode, {n} tokens, budget {b}: " + "; ".join(ps) for n, b, ps in sorted(longer) if ps])


@placeholder("tasks")
def tasks__phrase(f: Facts) -> str:
    """The tasks study's measured answer for the phrase task: phrase.answer in answers.json."""
    return _answer("phrase")


@placeholder("tasks")
def tasks__distractors(f: Facts) -> str:
    """The tasks study's measured answer for the distractors task: distractors.answer."""
    return _answer("distractors")


@placeholder("tasks")
def tasks__modes(f: Facts) -> str:
    """The tasks study's measured answer on decode against prefill mode: modes.answer."""
    return _answer("modes")


def answers_path() -> Path:
    """answers.json in the tasks folder (kvviz.core.paths.tasks_dir)."""
    from kvviz.studies.forgetting import answers_path as path

    return path()


def task_answers() -> dict:
    """The tasks study's answers.json (kvviz.studies.forgetting.load_answers, read again only
    when the file changes); ValueError naming the file when it is missing or not JSON."""
    path = answers_path()
    return _answers_cached(str(path.parent), path.stat().st_mtime if path.is_file() else -1.0)


@lru_cache(maxsize=2)
def _answers_cached(folder: str, mtime: float) -> dict:
    from kvviz.studies.forgetting import load_answers

    return load_answers(folder)


def note_text(lesson, n: int) -> str:
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
                values[f] = lookup(f).fn(facts)
            except ValueError as exc:
                raise ValueError(f"{lesson.path.name}: scene {n}: {{{f}}}: {exc}") from None
        out.append(values[f])
    return "".join(out).strip()



# --- shared readers (one per process; files change rarely) --------------------------------
def scene_trace(vs: ViewState, layer_given: bool):
    """The scene's trace as the page loads it: the state's layer if the scene names one,
    else the first stored; ValueError (the loader's) for a layer or head not stored."""
    from kvviz.core.paths import traces_or_default

    if vs.trace == "canonical":
        return _trace("canonical", 0.0, None, "mean")
    p = traces_or_default() / vs.trace[5:]
    return _trace(str(p), p.stat().st_mtime, vs.layer if layer_given else None, vs.head)


@lru_cache(maxsize=8)
def _trace(path: str, mtime: float, layer, head: str):
    from kvviz.core.trace import canonical, load_trace

    if path == "canonical":
        if head != "mean":
            raise ValueError(f"head must be one of ['mean'] for the canonical trace, got {head!r}")
        return canonical().keep_rows()
    return load_trace(path, layer=layer, name=Path(path).stem, head=head)


def _line(row: dict) -> str:
    from kvviz.core.policies import config_label

    return config_label(row["policy"], row["params"])


@lru_cache(maxsize=8)
def _loop(path: str):
    from kvviz.model.loop import load_loop_result

    return load_loop_result(path)


def _needle_table(task: str = "passkey"):
    """The rows of one task and option (kvviz.studies.forgetting.task_value): the pass key's
    from the needle folder, another task's from the tasks folder; None without any."""
    from kvviz.core.paths import needle_dir, tasks_dir
    from kvviz.studies.forgetting import task_rows

    folder = needle_dir() if task == "passkey" else tasks_dir()
    if not (folder / "results.csv").is_file():
        return None
    rows = task_rows(_needle_cached(str(folder), (folder / "results.csv").stat().st_mtime), task)
    return None if rows.empty else rows


@lru_cache(maxsize=2)
def _needle_cached(folder: str, mtime: float):
    from kvviz.model.needle.results import load_results
    from kvviz.studies.forgetting import with_lines

    return with_lines(load_results(folder))
