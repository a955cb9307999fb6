"""The sidebar: trace, layer, budget, policies A/B and their parameters (from the registry)."""
from __future__ import annotations

import re

import streamlit as st

from kvviz.app.state import default_budget
from kvviz.app.ui import compute, session
from kvviz.app.ui.present import sidebar
from kvviz.app.ui.session import S, keep, note, pkey, restore, set_value, widget, wkey
from kvviz.app.ui.upload import validate_upload
from kvviz.core.budget import parse_budget
from kvviz.core.policies import POLICIES, make_policy, param_specs
from kvviz.core.replay import Replay, can_drive


def _on_upload():
    f = S.get("w.upload")
    if f is None:
        return
    key, err = validate_upload(f.getvalue(), f.name)
    if err:
        S[session.UPLOAD_MSG] = ("error", err)
        return
    S.setdefault(session.UPLOADS, [])
    if key not in S[session.UPLOADS]:
        S[session.UPLOADS].append(key)
    set_value("trace", key)
    set_value("layer", 0)
    S[session.UPLOAD_MSG] = ("success", f"loaded {f.name}")


def trace_controls(draw: bool = True):
    """Trace chooser + upload + layer. Returns (trace key, layer, version, trace).
    `draw=False` (presentation mode): the same values from the session, nothing drawn."""
    side = sidebar(draw)
    side.header("Trace")
    files = compute.list_trace_files()
    options = ["canonical"] + [f"file:{n}" for n in files] + list(S.get(session.UPLOADS, []))

    def fit_trace(cur):
        if cur in options:
            return cur
        if cur.startswith("upload:") and cur[7:] in compute.upload_store():
            S.setdefault(session.UPLOADS, []).append(cur)  # an upload on this server
            options.append(cur)
            return cur
        side.error(f"Trace {cur!r} is not available here; showing the canonical trace.")
        return "canonical"

    key = widget(side.selectbox, "trace", "trace", options, fit=fit_trace,
                 format_func=compute.trace_label,
                 help="The canonical synthetic trace, every file in traces/, or a file you "
                      "upload.")
    side.file_uploader("upload a trace (.npz, kvviz format)", key="w.upload",
                       on_change=_on_upload,
                       help="Loaded with allow_pickle=False and validated; a bad file "
                            "is refused with the reason and the current trace stays.")
    msg = S.pop(session.UPLOAD_MSG, None)
    if msg:
        (side.error if msg[0] == "error" else side.success)(msg[1])
    version = compute.trace_version(key)
    try:
        layers = compute.trace_layers(key, version)
    except ValueError as exc:
        side.error(f"{compute.trace_label(key)}: {exc}. Showing the canonical trace.")
        key, version, layers = "canonical", "", []
        S["kv"]["trace"] = key
    layer = layers[0] if layers else 0  # a model layer number (the URL's `layer`)
    if len(layers) > 1:
        def fit_layer(cur, first=layer):
            if cur in layers:
                return cur
            if session.from_link("layer"):
                note(f"layer={cur} is not stored in this trace (layers "
                     f"{', '.join(map(str, layers))}); using {first}")
            return first

        layer = widget(side.selectbox, "layer", "layer", layers, fit=fit_layer,
                       format_func=lambda n: f"model layer {n}")
    else:
        S["kv"]["layer"] = layer
    head = head_control(key, layer, version, side)
    trace = compute.get_trace(key, layer, version, head)
    meta = trace.meta or {}
    bits = [f"{trace.steps} steps"]
    if meta.get("model"):
        bits.append(str(meta["model"]))
    if meta.get("source"):
        bits.append(str(meta["source"]))
    side.caption(" · ".join(bits))
    return key, layer, version, trace


HEAD_HELP = ("Which attention the policies see: the mean over all heads, one KV head's group "
             "(kv0..: the mean of the query heads sharing that KV head, the unit a real cache "
             "evicts by) or a single query head (q0..). Every view follows it.")


def head_label(label: str) -> str:
    """'kv1' -> 'kv1 · KV head 1'; 'q4' -> 'q4 · query head 4' (short: the sidebar's box
    is narrow, and the help says what a KV head's attention is)."""
    if label == "mean":
        return "mean · all heads"
    if label.startswith("kv") and label[2:].isdigit():  # the mean of its query heads (help)
        return f"{label} · KV head {label[2:]}"
    if label.startswith("q") and label[1:].isdigit():
        return f"{label} · query head {label[1:]}"
    return label


def head_control(key: str, layer: int, version: str, side=st.sidebar) -> str:
    """Head selector under the layer selector, shown only for traces storing several heads.
    Returns the head label ("mean" otherwise)."""
    heads = compute.trace_heads(key, layer, version)
    if len(heads) <= 1:
        S["kv"]["head"] = "mean"
        S.pop(wkey("head"), None)
        return "mean"
    def fit(cur):
        if cur in heads:
            return cur
        side.warning(f"Head {cur!r} is not stored in this trace (it has "
                     f"{', '.join(heads)}); showing mean.")
        return "mean"

    return widget(side.selectbox, "head", "head", heads, fit=fit, help=HEAD_HELP,
                  format_func=head_label)


def current_head() -> str:
    """The head chosen this run (after `trace_controls`)."""
    return S["kv"].get("head", "mean")


def _clamp_restore(key, default, lo, hi, label=None, cast=int):
    """Restore a number widget's value inside lo..hi; a value outside is said (with the
    value as typed) when `label` names the control."""
    v = restore(key, default)
    try:
        v = cast(v)
    except (TypeError, ValueError):
        v = default
    if label and not lo <= v <= hi:
        note(f"{label}={v} is outside {lo}–{hi}; using {min(max(v, lo), hi)}")
    S[key] = min(max(v, lo), hi)
    return S[key]


def _budget_for_trace(steps: int) -> None:
    """A budget belongs to its trace: switching traces brings back the budget last used on
    the new one, else its default (never a budget cut to fit a short trace)."""
    key = S["kv"].get("trace", "canonical")
    prev = S.get(session.BUDGET_TRACE)
    if prev is not None and prev != key:
        b = S.setdefault(session.BUDGET_BY_TRACE, {}).get(key, default_budget(steps))
        S[wkey("budget")] = S["kv"]["budget"] = b
    S[session.BUDGET_TRACE] = key


def labelled(name: str, message: str) -> str:
    """A policy's refusal with its parameter names replaced by the controls' labels."""
    for spec in param_specs(name):
        message = re.sub(rf"\b{spec.name}\b", spec.label, message)
    return message


def param_control(which: str, spec, side=st.sidebar):
    """One parameter's control, built from its declaration: a slider for int and float,
    a select box for a choice, a checkbox for a bool, a text box for a string or a value.
    Returns the value as the widget holds it."""
    k = pkey(which, spec.name)
    help_ = spec.help + (" · odd values only" if spec.odd_only else "")
    if spec.source:
        help_ += f" · default: {spec.source}"
    if spec.kind == "choice":
        if restore(k, spec.default) not in spec.choices:
            S[k] = spec.default
        value = side.selectbox(spec.label, spec.choices, key=k, help=help_)
    elif spec.kind == "bool":
        restore(k, spec.default)
        value = bool(side.checkbox(spec.label, key=k, help=help_))
    elif not spec.numeric:  # a free string or a value: its text, checked by its validator
        if not isinstance(restore(k, str(spec.default)), str):
            S[k] = str(spec.default)
        value = side.text_input(spec.label, key=k, help=help_)
    elif spec.kind == "float":
        lo, hi = float(spec.low), float(spec.high)
        _clamp_restore(k, float(spec.default), lo, hi, label=f"{which}.{spec.label}", cast=float)
        value = float(side.slider(spec.label, min_value=lo, max_value=hi,
                                  step=float(spec.step or (hi - lo) / 100), key=k, help=help_))
    else:
        _clamp_restore(k, spec.default, spec.low, spec.high, label=f"{which}.{spec.label}")
        value = int(side.slider(spec.label, min_value=spec.low, max_value=spec.high,
                                step=spec.step or 1, key=k, help=help_))
    keep(k, value)
    return value


def loop_note() -> None:
    """In place of the budget and policies on the loop and Forgetting views, which have their
    own."""
    st.sidebar.header("Cache")
    st.sidebar.caption("The model-in-the-loop and pass-key results carry their own policies "
                       "and budgets: "
                       "choose them in the view. The page's budget and policies A/B come back "
                       "on the other views, as they were.")


def policy_controls(steps: int, trace=None, draw: bool = True):
    """Budget, policy A/B and their parameters. Returns (budget, {'a': (name, params, error)...},
    {'a': the policy object built to check the settings, None if refused ...}): the page
    replays with those objects, so a page run builds each configuration once.
    With `trace`, a policy the trace cannot drive (knorm without key norms) is refused too,
    in the replay's own words. `draw=False`: the same, nothing drawn (presentation mode)."""
    side = sidebar(draw)
    side.header("Cache")
    _budget_for_trace(steps)
    default = default_budget(steps)
    asked = restore(wkey("budget"), default)
    if session.from_link("budget") and not 1 <= int(asked) <= steps:
        # a budget cut to 1 or to the trace's length shows nothing worth seeing
        note(f"budget={asked} is outside 1–{steps}; using this trace's default, {default}")
        S[wkey("budget")] = default
    _clamp_restore(wkey("budget"), default, 1, steps)
    budget = side.number_input("budget (slots held)", min_value=1, max_value=steps, step=32,
                               key=wkey("budget"),
                               help="How many key/value positions each policy may hold.")
    keep(wkey("budget"), int(budget))
    S.setdefault(session.BUDGET_BY_TRACE, {})[S["kv"].get("trace", "canonical")] = int(budget)
    budget = ratio_control(side, int(budget))
    out, built = {}, {}
    names = list(POLICIES)
    for which, default in (("a", "tova"), ("b", "snapkv")):
        side.header(f"Policy {which.upper()}")
        name = widget(side.selectbox, which, f"policy {which.upper()}", names,
                      fit=lambda v, d=default: v if v in names else d,
                      label_visibility="collapsed")
        params = {spec.name: param_control(which, spec, side) for spec in param_specs(name)}
        if not param_specs(name):
            side.caption(f"{name} has no parameters.")
        error, policy, vectors = None, None, False
        try:
            policy = make_policy(name, budget=budget, **params)
            # a trace without the vectors it reads: the refusal offers the shipped one
            vectors = (policy.reads_keys or policy.reads_queries) and trace is not None \
                and not can_drive(trace, type(policy))
            if trace is not None and (policy.reads_key_norms or policy.reads_value_norms or vectors):
                Replay(trace, policy)  # refuses a trace without the norms it reads; runs nothing
        except ValueError as exc:
            error, policy = labelled(name, str(exc)), None
            side.error(f"Refused: {error}")
            if vectors:
                offer_vector_trace(which, side)
        out[which] = (name, params, error)
        built[which] = policy
    return budget, out, built


# The shipped trace that drives the policies reading key and query vectors: per KV head, with
# every head's vectors and its model's RoPE base (traces/README.md), which Expected
# Attention's rope_theta takes by default.
VECTOR_TRACE, VECTOR_HEAD = "code-kv-vec.npz", "kv0"


def offer_vector_trace(which: str, side) -> None:
    """Under the refusal of a policy that reads key and query vectors: a button that opens
    the shipped vector trace at one KV head (where the shipped file is here)."""
    if VECTOR_TRACE not in compute.list_trace_files():
        side.caption("Capture a trace per KV head with its vectors (`kvviz capture --heads kv "
                     "--vectors`) and pick a KV head to run it.")
        return
    side.button(f"open {VECTOR_TRACE} at head {VECTOR_HEAD}", key=f"vectors.open.{which}",
                on_click=_open_vector_trace,
                help="SmolLM2-135M's keys and queries per KV head: the policies that read them "
                     "replay one KV head's keys and its group's queries")


def _open_vector_trace() -> None:
    key = f"file:{VECTOR_TRACE}"
    layers = compute.trace_layers(key, compute.trace_version(key))
    if S["kv"].get("layer") not in layers:
        set_value("layer", layers[-1])
    set_value("trace", key)
    set_value("head", VECTOR_HEAD)


SHARES = ("0.05", "0.1", "0.125", "0.2", "0.25", "0.3", "0.4", "0.5", "0.75", "1")
RATIO_ON, RATIO_SHARE = "budget_share.on", "budget_share.value"  # widget keys; kept in RATIO_KEPT
RATIO_KEPT = "budget_share.kept"
RATIO_MODES = ("slots", "share of tokens seen")


def ratio_control(side, budget: int):
    """The budget as a share of the tokens seen instead of a count (kvviz.core.budget: '0.25x',
    resolved at every step): a switch and the share. Returns the count `budget`, or the
    ratio when the switch is on. Kept across runs where the sidebar is not drawn."""
    on, share = S.setdefault(RATIO_KEPT, (False, "0.25"))
    S.setdefault(RATIO_ON, RATIO_MODES[int(on)])
    S.setdefault(RATIO_SHARE, share if share in SHARES else "0.25")
    on = side.segmented_control("budget as", RATIO_MODES, key=RATIO_ON,
                                help="A count of slots, or a share of the positions seen so far, "
                                     "re-counted at every step (rounded down, never below what a "
                                     "policy's sinks and recent window need)") == RATIO_MODES[1]
    share = S[RATIO_SHARE]
    if on:
        share = side.selectbox("share kept", SHARES, key=RATIO_SHARE, format_func=lambda v: f"{v}x")
    S[RATIO_KEPT] = (on, share)
    return parse_budget(f"{share}x") if on else budget
