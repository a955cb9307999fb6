"""The page's side of a class: this server's registry, this session's token and membership.

One `Registry` per server process (a module global, like the model-run queue in jobs.py),
shared by every session; the classes themselves are in the store every process of the server
shares (kvviz.app.teach.store, chosen by KVVIZ_CLASSES). A session's member token, the code it
leads or follows and, for the lecturer, the class's lecturer key live in `st.session_state`
(the store keeps only digests of the token and the key); the token never goes into a link.
`?follow=CODE` puts a session in a class as a student (read once, on the session's first run).

What outlives a session (a reload, the page reconnecting to a restarted server) is kept by the
browser: the link (`follow=CODE` for a student, `lead=CODE` for the lecturer: session.write_url
keeps them in the address bar) and cookies (`remember` writes them): a student's identity
(`me`: their votes and presence are by it, so a reloaded page cannot vote twice) and the
class they last followed, and, per class the browser opened, its lecturer key (so the
lecturer's page, run again with `lead=CODE`, leads its class again: `init_follow`). A page
that knows a class it does not lead or follow (it left it, its `lead=` came without the key,
or its browser's student followed it) is `known`: while that class's question is open it
hides the answer (kvviz.app.ui.predict.hidden).
"""
from __future__ import annotations

import json
import re

import streamlit as st

from kvviz.app.teach.classroom import CODE_LEN, Class, Refused, Registry, Unreachable, new_token, normal_code

REGISTRY = Registry()

S = st.session_state
TOKEN = "class.token"    # this session's member token (secret)
LEADS = "class.leads"    # the code of the class this session opened ("" = none)
FOLLOWS = "class.follows"  # the code this session follows as a student ("" = none)
REFUSED = "class.refused"  # init_follow's refusal of the link's code, until the page shows it
UNLED = "class.unled"      # a `lead=` link without its key: said as a warning, the page works on
WAS_STUDENT = "class.was_student"  # this session joined a class as a student (never a note)
LEFT = "class.left"      # (code, round number): stopped following while that question was up
KEY = "class.key"        # the lecturer key of the class this session leads (secret)
DOWN = "class.down"      # the class store cannot be reached: its sentence, until the page says it
ME = "class.me"          # this browser's student identity (secret; its cookie keeps it)
KNOWN = "class.known"    # a class this page knows without leading or following it
KEYS = (TOKEN, LEADS, FOLLOWS, REFUSED, WAS_STUDENT, LEFT, KEY, DOWN, ME, KNOWN)  # session.PAGE_KEYS

STUDENT_COOKIE = "kvviz_student"  # the student's identity
CLASS_COOKIE = "kvviz_class"      # the class the student last followed (its code)
LEAD_COOKIE = "kvviz_lead_"       # + the class code: that class's lecturer key
STUDENT_DAYS = 30
_SECRET = re.compile(r"[A-Za-z0-9_-]{8,64}")
_CODE = re.compile(r"[A-Z2-9]{%d}" % CODE_LEN)


def token() -> str:
    if TOKEN not in S:
        S[TOKEN] = new_token()
    return S[TOKEN]


def _cookie(name: str, form: re.Pattern = _SECRET) -> str:
    """A cookie the browser sent when this session connected ("" if none, not of `form`, or
    outside a run)."""
    try:
        got = st.context.cookies.get(name)
    except Exception:  # noqa: BLE001 (no browser: AppTest, a bare script)
        return ""
    got = str(got or "")
    return got if form.fullmatch(got) else ""


def me() -> str:
    """This browser's student identity: the one its cookie keeps (`remember`), else a new one
    (secret; the store keeps its digest). A student's votes and presence are by it."""
    if ME not in S:
        S[ME] = _cookie(STUDENT_COOKIE) or new_token()
    return S[ME]


def remember(where=None) -> None:
    """End of a run: the cookies this browser lacks (the student's identity, the lecturer key
    of the class this page leads), written by a script in an invisible frame (the server sees
    them when the page next connects: a reload, a restarted server)."""
    from kvviz.app.teach.classroom import IDLE_SECONDS

    want = []
    if S.get(FOLLOWS) or S.get(WAS_STUDENT):
        want.append((STUDENT_COOKIE, me(), STUDENT_DAYS * 86400))
    if S.get(FOLLOWS):
        want.append((CLASS_COOKIE, S[FOLLOWS], int(IDLE_SECONDS)))
    code, k = S.get(LEADS, ""), S.get(KEY, "")
    if code and k:
        want.append((LEAD_COOKIE + code, k, int(IDLE_SECONDS)))
    want = [w for w in want if _cookie(w[0]) != w[1]]
    if not want:
        return
    script = ("<!doctype html><html><body style='margin:0'><script>"
              "for (const [n, v, age] of " + json.dumps(want) + ") {"
              "if (!document.cookie.split('; ').includes(n + '=' + v)) document.cookie = "
              "n + '=' + v + '; path=/; max-age=' + age + '; SameSite=Strict';}</script></body></html>")
    with where if where is not None else st.container():
        st.iframe(script, height="content")


def known() -> str:
    """The code of a class this page knows but neither leads nor follows ("" if none)."""
    if S.get(LEADS) or S.get(FOLLOWS):
        return ""
    return S.get(KNOWN, "")


def was_student() -> bool:
    """This page, or its browser, has been a class's student, and the page leads no class:
    it never shows a speaker note (the notes name the answers; they need the lecturer key)."""
    if S.get(FOLLOWS) or S.get(WAS_STUDENT):
        return True
    return bool(_cookie(STUDENT_COOKIE)) and not S.get(LEADS)


def _first(v) -> str:
    return normal_code(v[0] if isinstance(v, (list, tuple)) and v else v)


def init_follow(query) -> str | None:
    """First run: `follow=CODE` (a student) or `lead=CODE` (the lecturer, when this browser
    keeps the class's key) from the link. Returns a refusal sentence for an unknown code
    (the page shows it with st.error and carries on as a plain explorer), else None."""
    code = _first(query.get("follow"))
    if not code:
        lead = _first(query.get("lead"))
        if not lead:  # a student's browser on any other link: their class's question is hidden
            S[KNOWN] = _cookie(CLASS_COOKIE, _CODE)
        return _init_lead(lead)
    try:
        REGISTRY.get(code)
    except Refused as exc:
        S[FOLLOWS] = ""
        return str(exc)
    S[FOLLOWS] = code
    S[WAS_STUDENT] = True
    return None


def _init_lead(code: str) -> str | None:
    """`lead=CODE`: the lecturer's page run again (a reload, a restarted server) leads its
    class again with the key this browser keeps; without it the page knows the class only."""
    if not code:
        return None
    k = _cookie(LEAD_COOKIE + code)
    if k:
        try:
            take_back(code, k)
            return None
        except Unreachable as exc:
            S[KNOWN] = code
            return str(exc)
        except Refused:
            pass
    try:
        REGISTRY.get(code)
    except Refused as exc:
        return str(exc)
    S[KNOWN] = code
    S[UNLED] = (f"Class {code}: this browser does not keep its lecturer key, so this page does not "
                "lead it (Take back a class, with the key, does).")
    return None


def open_class() -> Class:
    """This session opens a class (once; a second call returns the same class)."""
    led = leads()
    if led is not None:
        return led
    c = REGISTRY.open(token())
    S[LEADS], S[KEY] = c.code, c.key
    S[FOLLOWS] = S[KNOWN] = ""
    return c


def _lookup(key: str) -> Class | None:
    code = S.get(key, "")
    if not code:
        return None
    try:
        return REGISTRY.get(code)
    except Unreachable as exc:  # the store is down: the code is kept, the page says why
        S[DOWN] = str(exc)
        return None
    except Refused:  # closed (server-side expiry) since: forget it
        S[key] = ""
        return None


def leads() -> Class | None:
    """The class this session leads, or None (also when another tab took it back with the
    lecturer's key: this one is a plain page again)."""
    c = _lookup(LEADS)
    if c is not None and not c.led_by(token()):
        S[KNOWN] = c.code  # (still hides the class's open question's answer)
        S[LEADS] = S[KEY] = ""
        return None
    return c


def take_back(code: str, key: str) -> Class:
    """This session leads class `code` again, with its lecturer key (Refused otherwise)."""
    c = REGISTRY.get(code)
    c.take_back(key, token())
    S[LEADS], S[KEY] = c.code, normal_code(key).replace("-", "")
    S[FOLLOWS] = S[KNOWN] = ""
    return c


def key() -> str:
    """The lecturer key of the class this session leads ("" if none): the page shows it."""
    return S.get(KEY, "") if leads() is not None else ""


def follows() -> Class | None:
    """The class this session follows as a student, or None."""
    return _lookup(FOLLOWS)


def member() -> Class | None:
    """The class this session is in, as lecturer or student."""
    return leads() or follows()
