"""Session state <-> widgets <-> st.query_params.

Widgets use keys "w.<field>" (parameters: "w.pa.<name>", "w.pb.<name>"). On a session's
first run the URL is parsed into those keys. Streamlit forgets a widget's value when the
widget is not drawn in a run (e.g. the zoom box on another view), so every value is also
kept in a plain dict (`kv`) and restored when its widget key is missing. After the page
is drawn, the state is written back to the URL, so the address bar is always a link to
exactly this view.
"""
from __future__ import annotations

import streamlit as st

from kvviz.policies import param_specs
from kvviz.ui.state import ViewState, default_cmp, from_query, to_query

S = st.session_state
FIELDS = ("trace", "layer", "budget", "a", "b", "step", "focus", "why", "view", "exp", "zoom",
          "head", "cmp", "needle")


def note(msg: str) -> None:
    """A warning for the page's notice area (a clamped or ignored value), shown this run."""
    S.setdefault("notes", [])
    if msg not in S["notes"]:
        S["notes"].append(msg)


def from_link(field: str) -> bool:
    """True on a session's first run when the link set `field` (a value to check and, if
    out of range, to warn about; later resets after a trace switch are not warned)."""
    return field in S.get("from_link", ())


def pop_notes() -> list[str]:
    return S.pop("notes", [])


def wkey(field: str) -> str:
    return f"w.{field}"


def pkey(which: str, name: str) -> str:
    return f"w.p{which}.{name}"


def init() -> list[str]:
    """First run of a session: URL -> session state. Returns notes about ignored keys."""
    if "kv" in S:
        return []
    st_, notes = from_query(st.query_params.to_dict())
    S["from_link"] = set(st.query_params.to_dict())
    S["kv"] = {}
    apply_state(st_)
    return notes


def apply_state(vs: ViewState, clear_exp: bool = False) -> None:
    """Put a whole ViewState into the widget keys (call from callbacks or before widgets)."""
    kv = S["kv"]
    S["budget_trace"] = vs.trace  # the budget comes with this trace (see sidebar)
    for f in FIELDS:
        v = getattr(vs, f)
        if f == "step" and v is None:
            kv.pop("step", None)
            S.pop(wkey("step"), None)
            continue
        kv[f] = v
        S[wkey(f)] = v
    for which in ("a", "b"):
        name = getattr(vs, which)
        given = vs.pa if which == "a" else vs.pb
        for spec in param_specs(name):
            val = given.get(spec.name, spec.default)
            kv[pkey(which, spec.name)] = val
            S[pkey(which, spec.name)] = val


def restore(key: str, default):
    """Before drawing a widget: make sure its key holds a value (the kept one or `default`)."""
    if key not in S:
        S[key] = S["kv"].get(key, default) if key.startswith("w.p") else S["kv"].get(
            key[2:], default)
    return S[key]


def keep(key: str, value) -> None:
    """After drawing a widget: remember its value across runs where it is not drawn."""
    if key.startswith("w.p"):
        S["kv"][key] = value
    else:
        S["kv"][key[2:]] = value


def set_value(field: str, value) -> None:
    """From a callback: change a field (widget key and kept copy)."""
    S[wkey(field)] = value
    S["kv"][field] = value


def current(which: str) -> dict:
    """Parameter dict of policy 'a' or 'b' as the widgets hold it."""
    name = S["kv"].get(which)
    out = {}
    for spec in param_specs(name):
        k = pkey(which, spec.name)
        try:  # a key another policy's parameter of the same name left behind may not fit
            out[spec.name] = spec.coerce(S.get(k, S["kv"].get(k, spec.default)))
        except ValueError:
            out[spec.name] = spec.default
    return out


def view_state() -> ViewState:
    kv = S["kv"]
    return ViewState(trace=kv.get("trace", "canonical"), layer=int(kv.get("layer", 0)),
                     budget=int(kv.get("budget", 512)), a=kv.get("a", "tova"),
                     b=kv.get("b", "snapkv"), pa=current("a"), pb=current("b"),
                     step=kv.get("step"), focus=int(kv.get("focus", -1)),
                     why=int(kv.get("why", -1)), view=kv.get("view", "cache"),
                     exp=kv.get("exp", ""), zoom=int(kv.get("zoom", 0)),
                     head=kv.get("head", "mean"), cmp=list(kv.get("cmp") or default_cmp(kv.get("a", "tova"),
                                                                             kv.get("b", "snapkv"))),
                     needle=dict(kv.get("needle") or {}))


def write_url() -> None:
    S.pop("from_link", None)  # the link's values have been checked
    q = to_query(view_state())
    if st.query_params.to_dict() != q:
        st.query_params.from_dict(q)
