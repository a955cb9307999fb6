"""Predict, then reveal: the lecturer asks "which position will A (or B) evict next?", each
student guesses from their own page, the lecturer reveals the answer, why, and the guesses.

The question, its votes and the reveal live in the class (kvviz.app.teach.classroom.Round); this
module only draws them. While a question is open, asked and until the lecturer closes it,
every page in the class shows the question panel instead of the selected view and draws no
step navigation and no status line: what the policy sees before the eviction (its own score
of every held slot, the attention rows up to the step), with no victim or marker; after the
reveal the answer and the class's guesses are marked on it and each guessed position gets
one sentence from the facts (kvviz.app.explain.guess_text). The lecturer's page is checked each run:
if its settings are no longer the ones the question was asked of, the question is closed
and the page says so. The server runs a student's page again when a question opens, is
revealed or closes (kvviz.app.ui.watch); the lecturer's histogram polls (a timer fragment)
and redraws as votes come.
"""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app import explain
from kvviz.app.figures.cache import Prebuilt
from kvviz.app.figures.votes import attention_rows_figure, evidence_figure, held_figure, votes_figure, votes_word
from kvviz.app.teach.classroom import Refused
from kvviz.app.teach.question import asked_at
from kvviz.app.ui import classroom
from kvviz.app.ui.context import CHART, Ctx
from kvviz.app.ui.present import chart
from kvviz.app.ui.session import S, fragment_run, set_value, timer_place

POLL_S = 1.0              # how often the lecturer's histogram looks at the votes
MAX_PILLS = 64            # more held slots than this: the number box only
MSG = "predict.msg"       # (kind, text) from a callback, shown once (top of the page)
REFUSED = "predict.refused"  # the student's last vote refusal, shown once under the box
ASKED = "predict.asked"   # lecturer: {round number: the run (RunKey) it was asked of}
DRAWN = "predict.drawn"   # (round number, revealed) this page last drew; (0, False): none
GUESS, PICK = "predict.guess", "predict.pick"  # the student's number box and held-slot pick
KIND = {"info": st.info, "warning": st.warning, "error": st.error}


def _round():
    """(class, a copy of its round or None, this session leads it); (None, None, False)
    outside a class."""
    c = classroom.leads()
    lead = c is not None
    c = c or classroom.follows()
    return c, (c.current_round() if c is not None else None), lead


def hidden():
    """A page without the lecturer key that knows a class it neither leads nor follows (it
    left it, its `lead=` link came without the key, or its browser's student followed it:
    kvviz.app.ui.classroom.known): that class's open, unrevealed
    question (kvviz.app.teach.classroom.Round), whose asked step and later ones the page
    does not show; else None."""
    code = classroom.known()
    if not code:
        return None
    try:
        r = classroom.REGISTRY.get(code).current_round()
    except Refused:
        return None
    return r if r is not None and not r.revealed else None


def active() -> bool:
    """A question is up in this session's class (the page hides what would answer it)."""
    return _round()[1] is not None


def marker(r) -> tuple:
    """What a student's page redraws on: a new round, the reveal, the close (not a vote)."""
    return (0, False) if r is None else (r.number, r.revealed)


def needs_redraw(c) -> bool:
    """A timer tick's question for class `c`: has its question opened, been revealed or
    closed since this page last drew (a vote does not count)? For the lecturer's timer."""
    return marker(c.current_round()) != S.get(DRAWN, (0, False))


def _who(r) -> str:
    return f"{r.who.upper()} ({r.label})"


def _label(ctx: Ctx, which: str) -> str:
    return ctx.label_a if which == "a" else ctx.label_b


# --- callbacks (they run before the page, so the step can still move) -----------------------
def _ask(which: str, ctx: Ctx) -> None:
    c = classroom.leads()
    if c is None:
        S[MSG] = ("error", "This page leads no class: open a class first.")
        return
    eng = ctx.eng_a if which == "a" else ctx.eng_b
    W = which.upper()
    q = asked_at(eng.evicted_at, ctx.step)  # the first eviction after the step shown
    if q is None:
        S[MSG] = ("info", f"{W} ({_label(ctx, which)}) evicts nothing after step {ctx.step}: "
                          "no question to ask here; go back to an earlier step.")
        return
    r = c.ask(classroom.token(), step=q.answer_step, who=which, label=_label(ctx, which),
              held=q.held, answer=q.answer, answer_step=q.answer_step)
    S.setdefault(ASKED, {})[r.number] = ctx.run(which)
    set_value("step", q.answer_step)
    S[MSG] = ("info", f"{W}'s next eviction after step {ctx.step} is at step {q.answer_step}: "
                      "the page moved there and shows the cache before it.")


def _reveal(ctx: Ctx) -> None:
    c, r, lead = _round()
    if not lead or r is None:
        return
    panel = ctx.panel(r.who, r.answer_step)  # the policy's own scores at the eviction
    c.reveal(classroom.token(), explain.evictions_text(r.who.upper(), panel))


def _close() -> None:
    c, r, lead = _round()
    if lead:
        c.close_round(classroom.token())
        S.get(ASKED, {}).pop(getattr(r, "number", None), None)


def _vote(number: int) -> None:
    c = classroom.follows()
    try:
        if c is None:
            raise Refused("this page is not in a class any more (the class was closed)")
        c.vote(classroom.me(), number, S.get(GUESS))
    except Refused as exc:
        S[REFUSED] = str(exc)


def _pick() -> None:
    if S.get(PICK) is not None:
        S[GUESS] = int(S[PICK])


# --- the page ---------------------------------------------------------------------------------
def locked(ctx: Ctx) -> int | None:
    """With a question up: the step the page stays at (no navigation is drawn), said on the
    page; None otherwise. The lecturer's question closes if its run left the page."""
    c, r, lead = _round()
    if r is None:
        if c is not None and not lead and S.get(DRAWN, (0, False))[0]:  # this page drew a question: it closed
            st.info("The lecturer closed the question: the page is back to the lesson.",
                    icon=":material/quiz:")
        msg = S.pop(REFUSED, None)  # a vote that arrived after the question closed
        if msg:
            st.warning(f"Vote refused: {msg}.", icon=":material/how_to_vote:")
        _hide(ctx)
        return None
    # (a tab that took the class back, at the class's page, finds the question: its own now)
    if lead and S.setdefault(ASKED, {}).setdefault(r.number, ctx.run(r.who)) != ctx.run(r.who):
        c.close_round(classroom.token())
        S[MSG] = ("warning", f"The question about {_who(r)} was closed: the page's trace, "
                             "policy, parameters or budget changed since it was asked.")
        return None
    step = min(r.step, ctx.trace.steps - 1)
    if lead:
        S["kv"]["step"] = step
        st.caption(f"Step navigation is locked at step {step} while the question is up: "
                   "reveal (key V), then close the question to move on.")
    else:
        st.caption(f"The lecturer's question holds the page at step {step} until they "
                   "close it.")
    return step


def _hide(ctx: Ctx) -> None:
    """A page that knows a class with an open question (`hidden`): the page stays before the
    asked step (the status line would name the victim) and the whole-run views leave out
    that step and later ones (`Ctx.hide_from`)."""
    r = hidden()
    if r is None:
        return
    last = max(0, min(int(r.answer_step), ctx.trace.steps) - 1)
    ctx.hide_from = last + 1
    cur = S.get("w.step", S["kv"].get("step"))
    if cur is None or int(cur) > last:
        set_value("step", last)
    st.caption(f"Class {classroom.known()}'s question about {_who(r)} at step {r.answer_step} "
               f"is open: this page stays at step {last} or before and hides the steps from "
               f"{r.answer_step} on until the lecturer reveals the answer.")


WHOLE_RUN_SHOWN = ("cache", "scores")  # views drawn while hiding (the heatmap cut)


def controls(ctx: Ctx, row=None) -> None:
    """The lecturer's ask buttons (no question up), and the last callback's message.
    `row`: presentation mode's compact row, where the buttons go with short labels."""
    msg = S.pop(MSG, None)
    if msg:
        KIND[msg[0]](msg[1])
    c, r, lead = _round()
    if not lead or r is not None:
        return
    short = row is not None
    row = row if short else st.container(horizontal=True, wrap=True, gap="small")
    for which in ("a", "b"):
        if ctx.solo and which != ctx.solo:
            continue
        row.button(f"Ask {which.upper()}" if short else
                   f"Ask: which position will {which.upper()} evict next?",
                   key=f"predict.ask.{which}", on_click=_ask, args=(which, ctx),
                   icon=":material/quiz:", width="content",
                   help=f"Ask the class which position {which.upper()} ({_label(ctx, which)}) "
                        "evicts at its next eviction after this step. Every page in the class "
                        "shows the cache before it, with nothing that gives the answer away.")


@st.cache_resource(max_entries=16, show_spinner=False)
def _held(code: str, number: int, held: frozenset, step: int, label: str, who: str,
          trace: tuple, _tokens):
    """The question's held slots, built once per question server-wide: every page in the
    class draws the same figure (only read), and a vote reruns the voter's page."""
    return held_figure(sorted(held), step, label, who, tokens=_tokens)


ROWS = 24  # attention rows shown up to the question's step (the newest; TOVA reads the last)


def _panel(ctx: Ctx, r):
    """The asked policy's own state at the question's step (kept slots, its scores, the
    victims), from the page's replay; None when this page no longer draws that run (a
    student exploring other settings)."""
    if r.label != _label(ctx, r.who):
        return None
    try:
        return ctx.panel(r.who, r.answer_step)
    except (IndexError, ValueError):
        return None


def _evidence(ctx: Ctx, code: str, r, panel, revealed: bool) -> None:
    """What the policy sees: its own score of every held slot (marked with the answer and
    the class's guesses once revealed), then the attention rows up to the step. Built once
    per question, run and reveal server-wide (`_evidence_figures`): every page of the class
    draws the same two figures."""
    tally = tuple(sorted(r.tally().items())) if revealed else None
    scores, rows = _evidence_figures(ctx.run(r.who), code, r.number, r.answer_step, revealed, tally,
                                     _held=r.held, _answer=r.answer, _panel=panel,
                                     _trace=ctx.trace)
    chart(scores, key="predict.evidence", **CHART)
    chart(rows, key="predict.rows", **CHART)


@st.cache_resource(max_entries=32, show_spinner=False)
def _evidence_figures(run, code: str, number: int, step: int, revealed: bool,
                      tally: tuple | None, _held, _answer, _panel, _trace
                      ) -> tuple[Prebuilt, Prebuilt]:
    """The evidence's two figures for question `number` of class `code` on one run (`run`,
    the asked policy's compute.RunKey), as finished dicts shared
    read-only by every page. The question's held positions and answer come with its number
    (not hashed: hashing 512 positions was a sixth of a student's page run)."""
    tokens = _trace.tokens
    scores = evidence_figure(_panel, step, tokens=tokens,
                             answer=_answer if revealed else frozenset(),
                             votes=dict(tally) if tally is not None else None)
    held = sorted(_held)
    first = max(0, int(step) - ROWS + 1)
    rows = [np.asarray(_trace.row(i), float) for i in range(first, int(step) + 1)]
    rows = [np.pad(row, (0, max(0, held[-1] + 1 - len(row))))[held] for row in rows]
    return (Prebuilt(scores.to_dict()),
            Prebuilt(attention_rows_figure(rows, held, first, step, tokens=tokens).to_dict()))


def question(ctx: Ctx) -> bool:
    """The question panel in place of the view; False (nothing drawn) with no question up.
    Its controls come first (the lecturer's Reveal and the votes so far, a student's guess),
    then the evidence: the policy's own scores of the held slots and the attention rows."""
    c, r, lead = _round()  # a student's page is run again on a new round (ui/watch.py)
    if marker(r)[0] != S.get(DRAWN, (0, False))[0]:  # a new question: an empty guess box
        S.pop(GUESS, None)
        S.pop(PICK, None)
    S[DRAWN] = marker(r)
    if r is None:
        return False
    st.markdown(f"#### Which position will {_who(r)} evict next?")
    panel = _panel(ctx, r)
    if not r.revealed:
        st.caption(f"Step {r.answer_step}, before {r.who.upper()} evicts: it holds "
                   f"{len(r.held)} positions. Guess the one it evicts"
                   + (f" (it evicts {len(r.answer)} here)" if len(r.answer) > 1 else "")
                   + ", from its own scores below and the rule in their title.")
        if lead:
            st.button("Reveal the answer", key="predict.reveal", on_click=_reveal, args=(ctx,),
                      shortcut="V", type="primary", icon=":material/visibility:",
                      help="Show the answer, why, and the class's guesses (key V).")
            with timer_place():  # (why: kvviz.app.ui.session.timer_place)
                _live(c.code)
        else:
            _guess(c, r, ctx)
        if panel is not None:
            _evidence(ctx, c.code, r, panel, revealed=False)
        else:
            chart(_held(c.code, r.number, r.held, r.answer_step, r.label, r.who,
                        (ctx.key, ctx.layer, ctx.version), ctx.trace.tokens),
                  key="predict.held", **CHART)
        return True
    answer = sorted(r.answer)
    st.markdown(f"**Answer:** {_who(r)} evicts "
                f"{'position' if len(answer) == 1 else 'positions'} "
                f"**{', '.join(map(str, answer))}** at step {r.answer_step}.")
    n = len(r.votes)
    mine = None if lead else r.mine(classroom.me())
    if lead:
        st.button("Close the question", key="predict.close", on_click=_close,
                  icon=":material/close:", help="Back to the views; the class's pages follow.")
    else:
        st.markdown("You did not vote on this question." if mine is None else
                    f"You guessed position {mine}: "
                    + ("right." if mine in r.answer else "not the answer."))
        _refusal()
    if panel is not None and r.votes:  # one sentence per position guessed, from the facts
        lines = [("**You:** " if p == mine else "") + explain.guess_text(panel, p, ctx.trace.tokens)
                 + f" ({votes_word(k)})" for p, k in sorted(r.tally().items())]
        st.markdown("**Why each guess was or was not evicted:**\n\n"
                    + "\n".join(f"- {line}" for line in lines))
    st.markdown(f"**{r.right} of {n}** guessed right ({r.share_right:.0%})." if n else
                "Nobody voted on this question.")
    if panel is not None:
        _evidence(ctx, c.code, r, panel, revealed=True)
    if r.why:
        st.info(r.why, icon=":material/lightbulb:")
    chart(votes_figure(r), key="predict.votes", **CHART)
    _rejoined(r)
    return True



def _refusal() -> None:
    msg = S.pop(REFUSED, None)
    if msg:
        st.error(f"Vote refused: {msg}.")


def _guess(c, r, ctx: Ctx) -> None:
    """The guess: a held slot's pill, or a number (any number: a position not held is
    refused once, in the class's own words, when voting)."""
    held = sorted(r.held)
    span = f"{held[0]}–{held[-1]}" if len(held) > 1 else str(held[0])
    if len(held) <= MAX_PILLS:
        st.pills(f"pick one of the {len(held)} held positions", held, key=PICK, on_change=_pick)
    st.number_input("your guess: the position it evicts", step=1, value=None, key=GUESS,
                    placeholder=f"a held position ({span})")
    st.button("Vote", key="predict.vote", on_click=_vote, args=(r.number,), type="primary",
              icon=":material/how_to_vote:")
    mine = r.mine(classroom.me())
    if mine is not None:
        st.caption(f"You voted for position {mine}; one vote each. The lecturer reveals.")
    _refusal()


@st.fragment(run_every=POLL_S)
def _live(code: str) -> None:
    """The lecturer's histogram while votes come in (redrawn on every tick; an unchanged
    figure is not sent again); the page reruns if the round itself changed."""
    try:
        c = classroom.REGISTRY.get(code)
    except Refused:
        st.rerun(scope="app")
    r = c.current_round()
    if fragment_run() and needs_redraw(c):
        st.rerun(scope="app")
    if r is not None:
        chart(votes_figure(r), key="predict.votes", **CHART)
        _rejoined(r)


def _rejoined(r) -> None:
    """The votes cast by students who left the class during the question and came back
    (they may have seen more than the question showed): counted, and said."""
    n = sum(r.rejoined_tally().values())
    if n:
        st.caption(f"{n} of the {len(r.votes)} votes came from students who left the class "
                   "during this question and came back (marked on their bars): they may have "
                   "seen its answer.")
