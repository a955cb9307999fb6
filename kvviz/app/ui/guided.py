"""Guided experiments box: one click sets every control; the explanation stays while the
settings are the experiment's and goes (with `exp` leaving the link) once one changes."""
from __future__ import annotations

import streamlit as st

from kvviz.app import explain
from kvviz.app.explain import pooling_text
from kvviz.app.state import ViewState
from kvviz.app.ui import compute, experiments
from kvviz.app.ui.session import S, apply_state, from_link, note, view_state
from kvviz.core.policies import param_specs

# what an explanation depends on; the step, the view and chosen positions may move freely
SETTINGS = ("trace", "layer", "head", "budget", "a", "b")


def _defaults(name: str) -> tuple:
    return compute.params_key({s.name: s.default for s in param_specs(name)})


def _pooling(vs: ViewState):
    """(step, explanation) for the pooling experiment on its trace, or None."""
    key = vs.trace
    version = compute.trace_version(key)
    if version == "missing":
        return None
    return compute.pooling_example(key, vs.layer, version, compute.params_key(vs.params("b")),
                                   vs.budget)


def _toy(vs: ViewState):
    """(step, Pooling facts): the toy trace's first step where SnapKV's pooling defends a
    slot (16 steps: searched directly, no cache needed), or None."""
    version = compute.trace_version(vs.trace)
    if version == "missing":
        return None
    trace = compute.get_trace(vs.trace, vs.layer, version)
    return experiments.pooling_example(trace, vs.budget, vs.params("b"), start=0)


def _toy_text(vs: ViewState) -> str:
    """What both policies do at the experiment's step, from their own scores."""
    found = _toy(vs)
    if found is None:
        return "no step on this trace where pooling defends a slot."
    step, facts = found
    version = compute.trace_version(vs.trace)
    words = []
    for which in ("a", "b"):
        name = getattr(vs, which)
        params = compute.params_key(vs.params(which))
        kept, scores = compute.peek(vs.trace, vs.layer, version, name, params, vs.budget, step)
        victims = compute.get_engine(vs.trace, vs.layer, version, name, params,
                                     vs.budget).victims(step)
        panel = dict(label=f"{which.upper()}: {name}", policy=name, kept=kept, scores=scores,
                     victims=victims)
        words.append(explain.evictions_text(which.upper(), panel))
    return (f"  \nAt step **{step}** (boxed in red; position {facts.defended.position} is "
            "tracked): " + " ".join(words) + "  \n" + pooling_text(facts))


def _engine(vs: ViewState, which: str):
    name = getattr(vs, which)
    return compute.get_engine(vs.trace, vs.layer, compute.trace_version(vs.trace), name,
                              compute.params_key(vs.params(which)), vs.budget)


def _from_runs(exp: str, vs: ViewState) -> str:
    """The numbers an experiment's text points at, read from the runs on the page now."""
    labels = {w: f"{w.upper()}, {getattr(vs, w)}" for w in ("a", "b")}
    if exp in ("pooling-off", "obswindow"):
        m = {w: compute.run_summary(vs.trace, vs.layer, compute.trace_version(vs.trace),
                                    getattr(vs, w), compute.params_key(vs.params(w)), vs.budget)
             for w in ("a", "b")}
        ra, rb = m["a"]["retained_mass"], m["b"]["retained_mass"]
        n = explain.number_format([ra, rb])
        same = ("identical to the last digit" if ra == rb else
                f"A's is {explain.relation(ra, rb)} B's")
        return (f"**From the runs:** retained mass A {n(ra)}, B {n(rb)}: {same}; memory "
                f"{m['a']['memory_bytes']:,} vs {m['b']['memory_bytes']:,} bytes.")
    if exp == "budget-256":
        step = vs.step if vs.step is not None else -1
        facts = [explain.survival_facts(w.upper(), getattr(vs, w), _engine(vs, w).evicted_at,
                                        step) for w in ("a", "b")]
        return "**From the runs:** " + explain.survival_text(facts, step)
    if exp == "quiet-hh" and vs.why >= 0 and vs.step is not None:
        ea, eb = _engine(vs, "a").evicted_at, _engine(vs, "b").evicted_at
        dstep = min((e for e in (int(ea[vs.why]), int(eb[vs.why])) if e >= 0), default=-1)
        if dstep < 0 or int(ea[vs.why]) == int(eb[vs.why]):
            return ""
        version = compute.trace_version(vs.trace)
        panels = []
        for w in ("a", "b"):
            kept, scores = compute.peek(vs.trace, vs.layer, version, getattr(vs, w),
                                        compute.params_key(vs.params(w)), vs.budget, dstep)
            panels.append(dict(label=labels[w], policy=getattr(vs, w), kept=kept,
                               scores=scores, victims=_engine(vs, w).victims(dstep)))
        facts = [explain.decision(w, p, vs.why) for w, p in zip("AB", panels)]
        ties = [t for w, p in zip("AB", panels) for t in explain.tie_facts(w, p)]
        return "**From the runs:** " + explain.why_text(vs.why, ea, eb, facts, dstep, ties=ties)
    return ""


def _run_experiment(name: str):
    spec = experiments.EXPERIMENTS[name]
    vs = ViewState(**{**spec["state"], "exp": name})
    if name == "quiet-hh":
        trace = compute.get_trace("canonical", 0, "")
        ea = compute.get_engine("canonical", 0, "", "tova", (), vs.budget).evicted_at
        eb = compute.get_engine("canonical", 0, "", "h2o", _defaults("h2o"), vs.budget).evicted_at
        found = experiments.quiet_heavy_hitter(trace, ea, eb)
        if found:
            vs.why, vs.step = found
            vs.focus = found[0]
    if name == "toy":
        found = _toy(vs)
        if found is None:
            S["exp_msg"] = (f"The toy experiment needs traces/{experiments.TOY_TRACE}, "
                            "which is not on this server.")
            return
        vs.step, vs.focus = found[0], found[1].defended.position
        vs.track = vs.focus
    if name == "pool-defends":
        found = _pooling(vs)
        if found is None:
            S["exp_msg"] = (f"The pooling experiment needs traces/{experiments.POOLING_TRACE}, "
                            "which is not on this server.")
            return
        vs.step, vs.focus = found[0], found[1].defended.position
    apply_state(vs)


def stale(name: str, now: ViewState) -> bool:
    """True once a setting differs from what the experiment set."""
    spec = experiments.EXPERIMENTS[name]["state"]
    exp = ViewState(**spec)
    return (any(getattr(exp, f) != getattr(now, f) for f in SETTINGS if f in spec or f != "layer")
            or exp.params("a") != now.params("a") or exp.params("b") != now.params("b"))


def experiments_box():
    with st.expander("Guided experiments: one click reproduces a documented fact",
                     expanded=False, icon=":material/science:"):
        row = st.container(horizontal=True, wrap=True)  # whole titles, wrapping at 1024 px
        for name, spec in experiments.EXPERIMENTS.items():
            row.button(spec["title"], key=f"exp.{name}", on_click=_run_experiment, args=(name,),
                       width="content")
    msg = S.pop("exp_msg", None)
    if msg:
        st.error(msg)
    exp = S["kv"].get("exp")
    if exp and exp not in experiments.EXPERIMENTS:
        note(f"exp={exp!r} is not a guided experiment; ignored")
        S["kv"]["exp"] = exp = ""
    if exp and stale(exp, view_state()):
        title = experiments.EXPERIMENTS[exp]["title"]
        if from_link("exp"):
            note(f"exp={exp}: this link's settings are not the experiment's, so its "
                 f"explanation is not shown; open “{title}” from Guided experiments")
        st.caption(f"Settings changed since the experiment “{title}”: its explanation no longer "
                   "applies, so it is hidden.")
        S["kv"]["exp"] = exp = ""
    if exp:
        spec = experiments.EXPERIMENTS[exp]
        text = spec["text"]
        if exp == "toy":
            text = text + " " + _toy_text(view_state())
        extra = _from_runs(exp, view_state())
        if extra:
            text = text + "  \n" + extra
        if exp == "pool-defends":
            found = _pooling(view_state())
            text = text.format(trace=experiments.POOLING_TRACE) + " " + (
                pooling_text(found[1]) if found else "no such step on this trace.")
        box = st.container(border=True)
        c1, c2 = box.columns([12, 1])
        c1.markdown(f"**Experiment: {spec['title']}** — " + text)
        c2.button("✕", key="exp.close", help="hide this explanation",
                  on_click=lambda: S["kv"].__setitem__("exp", ""))


def open_linked() -> None:
    """A link naming an experiment and none of its settings (`?exp=pool-defends`) opens
    that experiment, as its button would."""
    exp = S["kv"].get("exp")
    given = S.get("from_link", set())
    if (exp in experiments.EXPERIMENTS and "exp" in given  # a session's first run only
            and not any(k in SETTINGS or k.startswith(("a.", "b.")) for k in given)):
        _run_experiment(exp)
