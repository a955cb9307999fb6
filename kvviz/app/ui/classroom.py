"""The page's side of a class: this server's registry, this session's token and membership.

One `Registry` per server process (a module global, like the model-run queue in jobs.py),
shared by every session; the classes themselves are in the store every process of the server
shares (kvviz.app.teach.store, chosen by KVVIZ_CLASSES). A session's member token, the code it
leads or follows and, for the lecturer, the class's lecturer key live in `st.session_state`
(the store keeps only digests of the token and the key); the token never goes into a link.
`?follow=CODE` puts a session in a class as a student (read once, on the session's first run).
"""
from __future__ import annotations

import streamlit as st

from kvviz.app.teach.classroom import Class, Refused, Registry, Unreachable, new_token, normal_code

REGISTRY = Registry()

S = st.session_state
TOKEN = "class.token"    # this session's member token (secret)
LEADS = "class.leads"    # the code of the class this session opened ("" = none)
FOLLOWS = "class.follows"  # the code this session follows as a student ("" = none)
REFUSED = "class.refused"  # init_follow's refusal of the link's code, until the page shows it
WAS_STUDENT = "class.was_student"  # this session joined a class as a student (never a note)
LEFT = "class.left"      # (code, round number): stopped following while that question was up
KEY = "class.key"        # the lecturer key of the class this session leads (secret)
DOWN = "class.down"      # the class store cannot be reached: its sentence, until the page says it
KEYS = (TOKEN, LEADS, FOLLOWS, REFUSED, WAS_STUDENT, LEFT, KEY, DOWN)  # for session.PAGE_KEYS


def token() -> str:
    if TOKEN not in S:
        S[TOKEN] = new_token()
    return S[TOKEN]


def init_follow(query) -> str | None:
    """First run: `follow=CODE` from the link. Returns a refusal sentence for an unknown code
    (the page shows it with st.error and carries on as a plain explorer), else None."""
    code = query.get("follow")
    code = normal_code(code[0] if isinstance(code, (list, tuple)) else code)
    if not code:
        return None
    try:
        REGISTRY.get(code)
    except Refused as exc:
        S[FOLLOWS] = ""
        return str(exc)
    S[FOLLOWS] = code
    S[WAS_STUDENT] = True
    return None


def open_class() -> Class:
    """This session opens a class (once; a second call returns the same class)."""
    led = leads()
    if led is not None:
        return led
    c = REGISTRY.open(token())
    S[LEADS], S[KEY] = c.code, c.key
    S[FOLLOWS] = ""
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
        S[LEADS] = S[KEY] = ""
        return None
    return c


def take_back(code: str, key: str) -> Class:
    """This session leads class `code` again, with its lecturer key (Refused otherwise)."""
    c = REGISTRY.get(code)
    c.take_back(key, token())
    S[LEADS], S[KEY] = c.code, normal_code(key).replace("-", "")
    S[FOLLOWS] = ""
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
