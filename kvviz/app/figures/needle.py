"""The "Forgetting" view: pass-key results as figures (pure: data in, Plotly figure/HTML out).

Inputs are `kvviz needle`'s records: the results table (one row per run and configuration:
length, depth, seed, prompt_mode, granularity, policy, params, budget, answer, correct, ...)
and one run's arrays (`tokens`, `evicted_at` (C, L, G, T), meta with key_positions,
question_start, prompt_len, configs, answers, correct).
"""
from __future__ import annotations

import html
import json

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.app.figures.cache import cache_heatmap
from kvviz.app.figures.common import (
    KEY_COLOUR,
    RIGHT_COLOUR,
    WRONG_COLOUR,
    base_layout,
    pair_colours,
    policy_colour,
    policy_of,
)
from kvviz.app.figures.tokens import _token_html
from kvviz.core.policies import FULL, FULL_LABEL, POLICIES, config_label

# accuracy 0 -> wrong's wine, 1 -> right's green, through a light grey: colours no policy has
ACCURACY_SCALE = [[0, WRONG_COLOUR], [0.5, "#eeeeee"], [1, RIGHT_COLOUR]]


def _params(v) -> dict:
    if isinstance(v, dict):
        return v
    if v is None or (isinstance(v, float) and np.isnan(v)) or v == "":
        return {}
    return json.loads(v)


def line_label(policy: str, params) -> str:
    """A results row's configuration label (kvviz.core.policies.config_label), its
    params given as the table's JSON text."""
    return config_label(policy, _params(params))


def with_lines(rows: pd.DataFrame) -> pd.DataFrame:
    """The table with a `line` column (policy and non-default parameters)."""
    out = rows.copy()
    out["line"] = [line_label(p, q) for p, q in zip(out["policy"], out["params"])]
    return out


def budgets(rows: pd.DataFrame) -> list[int]:
    b = rows.loc[rows["policy"] != FULL, "budget"]
    return sorted({int(x) for x in b.dropna()})


def at_budget(rows: pd.DataFrame, budget: int, prompt_mode: str, granularity: str) -> pd.DataFrame:
    """The full cache's rows and every policy's rows at `budget`, in one mode and granularity."""
    r = with_lines(rows)
    r = r[(r["prompt_mode"] == prompt_mode) & (r["granularity"] == granularity)]
    full = r["policy"] == FULL
    return r[full | (pd.to_numeric(r["budget"], errors="coerce") == budget)]


def lines_order(r: pd.DataFrame) -> list[str]:
    names = sorted(set(r["line"]) - {FULL_LABEL})
    return ([FULL_LABEL] if FULL_LABEL in set(r["line"]) else []) + names


def accuracy(r: pd.DataFrame) -> pd.DataFrame:
    """Share of correct answers (over seeds) per line, depth and length: columns line,
    depth, length, accuracy, right, n."""
    c = r.assign(correct=r["correct"].astype(str).str.lower().isin(["true", "1"]))
    g = c.groupby(["line", "depth", "length"])["correct"]
    return pd.DataFrame({"right": g.sum(), "n": g.size()}).reset_index().assign(
        accuracy=lambda d: d["right"] / d["n"])


PANELS_PER_ROW = 4  # beyond this the panels wrap: their titles stay readable at 1024 px


def needle_figure(rows: pd.DataFrame, budget: int, prompt_mode: str, granularity: str,
                  row_height: int = 250, what: str = "Pass-key") -> go.Figure:
    """The classic needle chart: depth (y) x context length (x), coloured by the share of
    correct answers over seeds; one panel per configuration at `budget` (full cache first),
    PANELS_PER_ROW to a row. `what` names the task in the title."""
    r = at_budget(rows, budget, prompt_mode, granularity)
    acc = accuracy(r)
    lines = lines_order(r)
    lengths = sorted(int(x) for x in r["length"].unique())
    depths = sorted(float(x) for x in r["depth"].unique())
    n = max(1, len(lines))
    cols = min(n, PANELS_PER_ROW)
    nrows = -(-n // cols)
    titles = [ln.replace(" (", "<br>(") for ln in lines]  # parameters on a second line
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=titles or ["no results"],
                        shared_yaxes=True, horizontal_spacing=min(0.04, 0.4 / cols),
                        vertical_spacing=min(0.16, 0.6 / nrows))
    for i, line in enumerate(lines):
        row, col = i // cols + 1, i % cols + 1
        a = acc[acc["line"] == line].set_index(["depth", "length"])
        z = [[a["accuracy"].get((d, n_), np.nan) for n_ in lengths] for d in depths]
        text = [[f"{int(a['right'][(d, n_)])}/{int(a['n'][(d, n_)])}" if (d, n_) in a.index
                 else "" for n_ in lengths] for d in depths]
        fig.add_trace(go.Heatmap(
            z=z, x=[str(x) for x in lengths], y=[f"{d:g}%" for d in depths], text=text,
            texttemplate="%{text}", zmin=0, zmax=1, colorscale=ACCURACY_SCALE,
            showscale=i == 0, name=line, xgap=2, ygap=2,
            colorbar=dict(title="correct", tickformat=".0%", len=min(0.9, 1.2 / nrows), y=1,
                          yanchor="top"),
            hovertemplate=f"<b>{html.escape(line)}</b><br>length %{{x}} tokens<br>depth %{{y}}"
                          "<br>%{text} correct<extra></extra>"), row=row, col=col)
        bottom = i + cols >= len(lines)
        fig.update_xaxes(title="context length" if bottom and col == (cols + 1) // 2 else None,
                         type="category", row=row, col=col)
    for row in range(1, nrows + 1):
        fig.update_yaxes(title="key depth", type="category", row=row, col=1)
    fig.update_annotations(font_size=13)  # the panel titles
    base_layout(fig, f"{what} accuracy by depth and context length: budget {budget}, "
                     f"{prompt_mode} prompt, {granularity} granularity", 110 + row_height * nrows)
    return fig


# the task's other marked tokens in the prompt strip: pale backgrounds no policy or category uses
REMINDER_COLOUR = "#CFE8FF"    # the recall task's reminder sentences (pale blue)
DISTRACTOR_COLOUR = "#FFD6CC"  # another person's key (pale red)

TASK_NAMES = {"passkey": "pass key", "recall": "recall", "distractors": "distractors",
              "phrase": "phrase"}


def task_value(task: str, option=None) -> str:
    """A task and its option as the URL keeps it: "passkey", "recall5", "phrase4"."""
    return "passkey" if task == "passkey" else f"{task}{int(option)}"


def task_label(task: str, option=None) -> str:
    """A task and its option said readably: "recall: a reminder every 5 sentences"."""
    if task == "passkey":
        return "pass key"
    n = int(option)
    if task == "recall":
        return f"recall: a reminder every {n} sentence{'s' if n != 1 else ''}"
    if task == "phrase":
        return f"phrase: {n} word{'s' if n != 1 else ''}"
    if task == "distractors":
        return f"distractors: {n} look-alike{'s' if n != 1 else ''}"
    return f"{task} {n}"


OPTION_COLUMN = {"recall": "reminder_every", "distractors": "distractors", "phrase": "phrase_words"}


def task_values(rows: pd.DataFrame) -> pd.Series:
    """Each row's task and option as task_value writes it ("passkey", "recall5")."""
    task = rows["task"] if "task" in rows else pd.Series("passkey", index=rows.index)
    out = pd.Series("passkey", index=rows.index, dtype=object)
    for t, col in OPTION_COLUMN.items():
        m = task == t
        if m.any():
            out[m] = t + pd.to_numeric(rows.loc[m, col]).astype(int).astype(str)
    return out


def task_options(rows: pd.DataFrame) -> list[tuple[str, str]]:
    """(value, label) of each task and option in a results table, pass key first, then
    recall, distractors and phrase, each by its option."""
    if rows is None or rows.empty:
        return []
    task = rows["task"] if "task" in rows else pd.Series("passkey", index=rows.index)
    found = set()
    for t, v in set(zip(task, task_values(rows))):
        t = t if t in OPTION_COLUMN else "passkey"
        found.add((list(TASK_NAMES).index(t), t, int(v[len(t):]) if t != "passkey" else 0))
    return [(task_value(t, o), task_label(t, o)) for _, t, o in sorted(found)]


def task_rows(rows: pd.DataFrame, value: str) -> pd.DataFrame:
    """The rows of one task and option (value as task_value writes it)."""
    return rows[task_values(rows) == value]


def task_marks(meta: dict) -> tuple[str, list[tuple[str, str, dict]]]:
    """What the prompt strip marks beside the question, from a run's meta: (the key's name in
    the legend, [(css class, legend label, {position: tooltip})]): the recall task's reminder
    sentences, the distractors task's other keys (each named), the phrase as the key."""
    task = meta.get("task") or "passkey"
    if task == "phrase":
        return "the pass phrase", []
    if task == "recall":
        tips = {p: "a reminder" for a, b in meta.get("reminders") or [] for p in range(int(a), int(b))}
        return "the key", [("kv-rem", "a reminder", tips)] if tips else []
    if task == "distractors":
        tips = {int(p): f"{name}'s key (a distractor)"
                for name, ps in zip(meta.get("distractor_names") or [], meta.get("distractor_positions") or [])
                for p in ps}
        target = meta.get("target") or "the asked person"
        return f"{target}'s key (asked)", [("kv-dis", "another person's key (a distractor)", tips)] if tips else []
    return "the key", []


def key_strip_html(tokens, key_positions, question_start: int, marks=(), key_label: str = "the key") -> str:
    """The prompt's tokens with the key highlighted and the question underlined; `marks`
    ([(css class kv-rem or kv-dis, legend label, {position: tooltip})], task_marks) shaded in
    their own colours, and a legend of what is marked."""
    keys = set(int(p) for p in key_positions)
    other = {}
    for cls, _, tips in marks:
        for p, tip in tips.items():
            other[int(p)] = (cls, tip)
    spans = []
    for p, tok in enumerate(tokens):
        if p in keys:
            cls, tip = "kv-key", f"position {p}: {key_label}"
        elif p in other:
            cls, tip = other[p][0], f"position {p}: {other[p][1]}"
        elif p >= question_start:
            cls, tip = "kv-q", f"position {p}: the question"
        else:
            cls, tip = "", f"position {p}"
        spans.append(f'<span class="kv-tok {cls}" title="{html.escape(tip)}">{_token_html(tok)}</span>')
    style = ("<style>.kv-strip{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:14px;"
             "line-height:1.8;max-height:260px;overflow-y:auto;padding:8px;border:1px solid #ddd;"
             "border-radius:6px;background:#fff}.kv-tok{white-space:pre}.kv-ws{opacity:0.45}"
             f".kv-key{{background:{KEY_COLOUR};font-weight:bold;outline:1px solid #999}}"
             f".kv-rem{{background:{REMINDER_COLOUR}}}"
             f".kv-dis{{background:{DISTRACTOR_COLOUR};outline:1px dashed #999}}"
             ".kv-q{text-decoration:underline;color:#332288}"
             ".kv-legend{font-size:13px;margin:2px 0 6px 0}.kv-legend span{padding:0 6px;"
             "margin-right:10px}</style>")
    legend = [f'<span class="kv-key">{html.escape(key_label)}</span>']
    legend += [f'<span class="{cls}">{html.escape(label)}</span>' for cls, label, _ in marks]
    legend.append('<span class="kv-q">the question</span>')
    return (f'{style}<div class="kv-legend" data-testid="kv-needle-legend">{"".join(legend)}</div>'
            f'<div class="kv-strip" data-testid="kv-needle-strip">{"<wbr>".join(spans)}</div>')


def scored_text(meta: dict, answer: str) -> str:
    """One answer under its task's check (kvviz.model.needle.tasks.score, as the run was
    scored): "✓ right", "✗ distractor (Greta's key)", "✗ partial: thunder amber", "✗ no key"."""
    from kvviz.model.needle.tasks import score

    s = score({**meta, "task": meta.get("task") or "passkey"}, answer)
    mark = "✓" if s.correct else "✗"
    if s.outcome == "distractor":
        return f"{mark} distractor ({s.detail}'s key)"
    if s.outcome == "partial":
        return f"{mark} partial: {s.detail}"
    return f"{mark} {s.outcome}"


# short headers: the table fits 1024 px without cutting its last column
LOST, WHOLE = "first key loss (step)", "layers with whole key"
KEPT = "key tokens kept (worst layer/head)"  # prefill: the one eviction at the prompt's end
CHECK = "the task's check"  # the answer scored by the task (a task other than the pass key)


def answers_table(meta: dict, budget: int, evicted_at=None) -> pd.DataFrame:
    """Each configuration's answer at `budget`, the full cache's first, marked right or wrong
    (a task other than the pass key: scored by its own check, scored_text);
    with the run's log, also the step it first evicted a key token and how many layers still
    hold every key token (every KV head) at the end of the prompt."""
    out = []
    kp, end = meta["key_positions"], int(meta["prompt_len"]) - 1
    for i, c in enumerate(meta["configs"]):
        if c["policy"] != FULL and c.get("budget") != budget:
            continue
        row = {"configuration": line_label(c["policy"], c.get("params")),
               "answer": meta["answers"][i]}
        if (meta.get("task") or "passkey") == "passkey":
            row["right?"] = "✓ right" if meta["correct"][i] else "✗ wrong"
        else:  # the task's own check: which key, how much of the phrase
            row[CHECK] = scored_text(meta, meta["answers"][i])
        if evicted_at is not None and meta.get("prompt_mode") == "prefill":
            # every loss is at the one eviction (step `end`): say how much of the key survived
            kept = held_share(evicted_at[i], kp, end).min() * len(kp)
            row[KEPT] = f"{int(round(kept))} of {len(kp)}"
        elif evicted_at is not None:
            s = lost_step(evicted_at[i], kp)
            row[LOST] = "never" if s < 0 else str(s)
        if evicted_at is not None:
            whole = (held_share(evicted_at[i], kp, end) == 1).all(-1)
            row[WHOLE] = f"{int(whole.sum())} of {len(whole)}"
        out.append(row)
    return pd.DataFrame(out)


def config_index(meta: dict, line: str, budget: int) -> int:
    for i, c in enumerate(meta["configs"]):
        if line_label(c["policy"], c.get("params")) == line and (
                c["policy"] == FULL or c.get("budget") == budget):
            return i
    raise ValueError(f"no configuration {line!r} at budget {budget} in run {meta.get('id')}")


def held_share(ev, key_positions, step: int) -> np.ndarray:
    """Share of the key's positions held after `step` (held: never evicted, or evicted
    later), over the last axis of `ev` (..., T) -> (...)."""
    e = np.asarray(ev)[..., list(key_positions)]
    return ((e < 0) | (e > int(step))).mean(-1)


def lost_step(ev, key_positions) -> int:
    """The step at which the first of the key's positions was evicted (any head), -1 if none."""
    e = np.asarray(ev)[..., list(key_positions)]
    e = e[e >= 0]
    return int(e.min()) if e.size else -1


def _runs(positions) -> list[tuple[int, int]]:
    """Contiguous runs [lo, hi] of sorted positions."""
    out = []
    for p in sorted(int(x) for x in positions):
        if out and p == out[-1][1] + 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return [tuple(r) for r in out]


def key_cache_figure(ev_a, ev_b, *, key_positions, prompt_len: int, label_a: str,
                     label_b: str, height: int = 520) -> go.Figure:
    """The cache heatmap of one layer (and KV head) for two configurations, with the key's
    positions shaded, the end of the prompt marked, and each one's first key eviction."""
    ev_a, ev_b = np.asarray(ev_a), np.asarray(ev_b)
    fig = cache_heatmap(ev_a, ev_b, prompt_len - 1, label_a=label_a, label_b=label_b,
                        height=height)
    for lo, hi in _runs(key_positions):
        fig.add_vrect(x0=lo - 0.5, x1=hi + 0.5, fillcolor=KEY_COLOUR, opacity=0.35,
                      line=dict(color="#8a7f00", width=1), layer="above", name="key")
    ca, cb = pair_colours(label_a, label_b)
    for ev, lab, colour, sym in ((ev_a, "A", ca, "x"), (ev_b, "B", cb, "cross")):
        s = lost_step(ev, key_positions)
        if s >= 0:
            first = min(int(p) for p in key_positions if (ev[..., int(p)] == s).any())
            fig.add_trace(go.Scatter(
                x=[first], y=[s], mode="markers+text", text=[f"{lab} lost the key"],
                # A's label above-left, B's below-right: two losses at one step never overlap
                textposition="top left" if lab == "A" else "bottom right",
                name=f"{lab} loses the key (step {s})",
                marker=dict(symbol=sym + "-thin", size=16, color=colour,
                            line=dict(width=3, color=colour)),
                textfont=dict(color=colour, size=14, weight="bold",
                              shadow="0 0 3px white, 0 0 3px white, 0 0 3px white"),
                hovertemplate=f"{lab}: first key token evicted at step {s}<extra></extra>"))
    fig.layout.title.text = f"Cache contents over time (key shaded): A = {label_a}, B = {label_b}"
    return fig


def prefill_kept(ev, prompt_len: int) -> np.ndarray:
    """bool (prompt_len,): the prompt positions a configuration holds right after the
    one-shot eviction at the end of the prompt (step prompt_len - 1)."""
    e = np.asarray(ev)[..., :int(prompt_len)]
    return (e < 0) | (e > int(prompt_len) - 1)


def prefill_figure(ev_a, ev_b, *, key_positions, prompt_len: int, label_a: str, label_b: str,
                   height: int = 300) -> go.Figure:
    """Prefill mode: the prompt is read whole and evicted once, at its end. One row per
    configuration (A above B), one column per prompt position: held after that eviction in
    the policy's colour, evicted in grey; the key's positions shaded."""
    T0 = int(prompt_len)
    ka, kb = prefill_kept(ev_a, T0), prefill_kept(ev_b, T0)
    ca, cb = pair_colours(label_a, label_b)
    z = np.stack([np.where(ka, 1, 0), np.where(kb, 2, 0)]).astype(np.int8)
    scale = [[0, "#e4e4e4"], [1 / 3, "#e4e4e4"], [1 / 3, ca], [2 / 3, ca], [2 / 3, cb], [1, cb]]
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(T0)), y=[f"A: {label_a}", f"B: {label_b}"], zmin=-0.5, zmax=2.5,
        colorscale=scale, showscale=False, ygap=6, name="kept after the prompt's eviction",
        hovertemplate="%{y}<br>position %{x}<extra></extra>"))
    for lo, hi in _runs(key_positions):
        fig.add_vrect(x0=lo - 0.5, x1=hi + 0.5, fillcolor=KEY_COLOUR, opacity=0.45,
                      line=dict(color="#8a7f00", width=1), layer="above", name="key")
    for lab, colour in ((f"A: {label_a}", ca), (f"B: {label_b}", cb)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"held by {lab}",
                                 marker=dict(symbol="square", size=14, color=colour)))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="evicted",
                             marker=dict(symbol="square", size=14, color="#e4e4e4",
                                         line=dict(color="#888888", width=1))))
    base_layout(fig, f"What each kept of the prompt after its one eviction (step {T0 - 1})",
                height)
    fig.update_xaxes(title="prompt position", range=[-0.5, T0 - 0.5], showgrid=False)
    fig.update_yaxes(autorange="reversed", showgrid=False)
    fig.update_layout(legend=dict(orientation="h", y=-0.35, yanchor="top", x=0, xanchor="left"),
                      margin=dict(b=90))
    return fig


def layers_figure(evicted_at, meta: dict, indices, labels, step: int,
                  layer_names=None, height: int = 420) -> go.Figure:
    """Per layer (y) and configuration (x): the share of the key's positions held after
    `step`, mean over KV heads (1 = the whole key is there)."""
    ev = np.asarray(evicted_at)
    kp = meta["key_positions"]
    z = np.stack([held_share(ev[i], kp, step).mean(-1) for i in indices], 1)  # (L, n)
    names = list(layer_names) if layer_names is not None else list(range(z.shape[0]))
    fig = go.Figure(go.Heatmap(
        z=z, x=list(labels), y=[str(n) for n in names], zmin=0, zmax=1, xgap=1, ygap=1,
        colorscale=[[0, "#e4e4e4"], [1, "#3a3a3a"]], colorbar=dict(title="key held",
                                                                   tickformat=".0%"),
        hovertemplate="%{x}<br>layer %{y}<br>%{z:.0%} of the key held<extra></extra>"))
    base_layout(fig, f"Which layers still hold the key after step {step}", height)
    fig.update_xaxes(title="configuration", type="category")
    fig.update_yaxes(title="model layer", type="category", autorange="reversed")
    return fig


# --- the guided experiment: whichever claim the numbers support ------------------------
def _correct(r: pd.DataFrame) -> pd.Series:
    return r["correct"].astype(str).str.lower().isin(["true", "1"])


CELL_KEYS = ["prompt_mode", "granularity", "budget", "id", "length", "depth", "seed"]
# TOVA's card (docs: the policy cards), "When not to use it": the warning the grid tests
TOVA_WARNING = "When a token matters intermittently. One quiet step is enough to lose it."
TRIO = ("tova", "h2o", "scissorhands")
TRIO_NAMES = {n: POLICIES[n].label for n in TRIO}  # "TOVA", "H2O", "Scissorhands"


def _trio(r: pd.DataFrame) -> pd.DataFrame | None:
    """One row per prompt and budget with TOVA's, H2O's and Scissorhands' answers (default
    parameters) as booleans, and claim (TOVA wrong, both others right) and reverse; None
    without all three."""
    plain = r[r["line"].isin(list(TRIO))]
    if not set(TRIO) <= set(plain["line"]):
        return None
    wide = plain.pivot_table(index=CELL_KEYS, columns="line", values="ok",
                             aggfunc="first").dropna().reset_index()
    wide[list(TRIO)] = wide[list(TRIO)].astype(bool)
    wide["claim"] = ~wide["tova"] & wide["h2o"] & wide["scissorhands"]
    wide["reverse"] = wide["tova"] & ~wide["h2o"] & ~wide["scissorhands"]
    for other in TRIO[1:]:  # one on one: TOVA wrong where the other is right, and the reverse
        wide[f"behind_{other}"] = ~wide["tova"] & wide[other]
        wide[f"ahead_{other}"] = wide["tova"] & ~wide[other]
    return wide


def _one_on_one(g) -> str:
    """'TOVA wrong where H2O right: a (the reverse: b), where Scissorhands right: c (the
    reverse: d)' over the rows g of _trio."""
    return ", ".join(f"where {TRIO_NAMES[o]} right: {int(g[f'behind_{o}'].sum())} (the reverse: "
                     f"{int(g[f'ahead_{o}'].sum())})" for o in TRIO[1:])


def grid_text(rows: pd.DataFrame, budget: int, prompt_mode: str, granularity: str) -> str:
    """TOVA's warning quoted from its card, then what the grid on screen (this budget,
    prompt mode and granularity) says about it, counted from the results."""
    r = with_lines(rows)
    wide = _trio(r.assign(ok=_correct(r)))
    head = f"**TOVA's warning**, from its card: “{TOVA_WARNING}” "
    where = f"budget {int(budget)}, {prompt_mode} prompt, {granularity} granularity"
    if wide is None:
        return head + f"These results have no {', '.join(TRIO)} runs to test it."
    g = wide[(wide["prompt_mode"] == prompt_mode) & (wide["granularity"] == granularity)
             & (pd.to_numeric(wide["budget"]) == int(budget))]
    if g.empty:
        return head + (f"**The grid above** ({where}) has no prompt with TOVA, H2O and "
                       "Scissorhands all run on it.")
    return head + (f"**The grid above** ({where}): of {len(g)} prompts TOVA answered right "
                   f"{int(g['tova'].sum())}, H2O {int(g['h2o'].sum())}, Scissorhands "
                   f"{int(g['scissorhands'].sum())}; TOVA wrong while H2O and Scissorhands "
                   f"were both right: {int(g['claim'].sum())} (the reverse: "
                   f"{int(g['reverse'].sum())}); one on one, TOVA wrong {_one_on_one(g)}.")


def guided(rows: pd.DataFrame) -> dict:
    """A guided experiment on whichever card claim the results support, its text computed
    from them: the TOVA card's warning (TOVA wrong where H2O and Scissorhands are right on the
    same prompt) if any prompt shows it, else the SnapKV card's (pooling keeps the key whole
    where poolKernel 1 does not), else what the data shows about the first.
    Returns {kind, text, lines: (A, B), cell: {budget, prompt_mode, granularity, length,
    depth, seed} | None}."""
    r = with_lines(rows)
    r = r.assign(ok=_correct(r))
    story = _tova(r)
    if story["kind"] not in ("tova-forgets", "tova-behind"):
        story = _snapkv(r) or story
    return story


def _cell(ex, budget, mode, gran) -> dict:
    return {"budget": int(budget), "prompt_mode": mode, "granularity": gran,
            "length": int(ex["length"]), "depth": float(ex["depth"]), "seed": int(ex["seed"])}


def _snapkv(r: pd.DataFrame) -> dict | None:
    """SnapKV's card: pooled snapkv holds the key whole (every key token, every layer and
    head, at the end of the prompt) where poolKernel 1 does not. None if nothing shows it."""
    snap = r[r["policy"] == "snapkv"]
    if snap.empty:
        return None
    snap = snap.assign(k=[int(_params(p).get("pool_kernel", 5)) for p in snap["params"]],
                       whole=pd.to_numeric(snap["held_end"]) >= 1.0)
    one, pooled = snap[snap["k"] == 1], snap[snap["k"] > 1]
    if one.empty or pooled.empty:
        return None
    lp = pooled["line"].value_counts().index[0]
    m = pooled[pooled["line"] == lp].merge(one, on=CELL_KEYS, suffixes=("_p", "_1"))
    if m.empty:
        return None
    l1 = m["line_1"].iloc[0]
    m = m[m["line_1"] == l1]
    m = m.assign(claim=m["whole_p"] & ~m["whole_1"])
    g = m.groupby(["prompt_mode", "granularity", "budget"])
    summary = pd.DataFrame({"claim": g["claim"].sum(), "n": g.size(), "wp": g["whole_p"].sum(),
                            "w1": g["whole_1"].sum(), "okp": g["ok_p"].sum(),
                            "ok1": g["ok_1"].sum()}).reset_index()
    if not summary["claim"].sum():
        return None
    best = summary.sort_values(["claim", "n"], ascending=[False, True], kind="stable").iloc[0]
    mode, gran, budget = best["prompt_mode"], best["granularity"], best["budget"]
    ex = m[(m["prompt_mode"] == mode) & (m["granularity"] == gran) & (m["budget"] == budget)
           & m["claim"]].sort_values(["length", "depth", "seed"]).iloc[0]
    text = (f"**SnapKV's pooling keeps the pass key whole.** At budget {int(budget)} ({mode} "
            f"prompt, {gran} granularity), {lp} held every key token in every layer at the end "
            f"of the prompt in {int(best['wp'])} of {int(best['n'])} prompts, {l1} in "
            f"{int(best['w1'])}; the first kept it whole where the second did not in "
            f"{int(best['claim'])}. Answers right: {lp} {int(best['okp'])}, {l1} "
            f"{int(best['ok1'])}.")
    return {"kind": "snapkv-whole", "text": text, "lines": (lp, l1),
            "cell": _cell(ex, budget, mode, gran)}


def _tova(r: pd.DataFrame) -> dict:
    plain = r[r["line"].isin(list(TRIO))]
    have = set(plain["line"])
    if not set(TRIO) <= have:
        missing = sorted(set(TRIO) - have)
        return {"kind": "missing", "cell": None, "lines": None,
                "text": "These results cannot test the TOVA card's warning (TOVA forgetting "
                        "a token H2O and Scissorhands keep): they have no "
                        f"{' or '.join(missing)} runs (at default parameters)."}
    wide = _trio(r)
    g = wide.groupby(["prompt_mode", "granularity", "budget"])
    summary = pd.DataFrame({"claim": g["claim"].sum(), "reverse": g["reverse"].sum(),
                            "n": g.size(), "tova": g["tova"].sum(), "h2o": g["h2o"].sum(),
                            "sc": g["scissorhands"].sum()}).reset_index()
    total = int(summary["claim"].sum())
    if total:
        best = summary.sort_values(["claim", "n"], ascending=[False, True], kind="stable").iloc[0]
        mode, gran, budget = best["prompt_mode"], best["granularity"], int(best["budget"])
        ex = wide[(wide["prompt_mode"] == mode) & (wide["granularity"] == gran)
                  & (wide["budget"] == best["budget"]) & wide["claim"]].sort_values(
            ["length", "depth", "seed"]).iloc[0]
        ans = r[(r["id"] == ex["id"]) & (r["line"] == "tova")
                & (pd.to_numeric(r["budget"]) == budget)]["answer"].iloc[0]
        text = (f"**TOVA forgets the pass key where H2O and Scissorhands keep it.** At budget "
                f"{budget} ({mode} prompt, {gran} granularity), TOVA answered wrong while H2O "
                f"and Scissorhands both answered right in {int(best['claim'])} of "
                f"{int(best['n'])} prompts (the reverse: {int(best['reverse'])}). Over those "
                f"prompts TOVA was right {int(best['tova'])} times, H2O {int(best['h2o'])}, "
                f"Scissorhands {int(best['sc'])}. In its first such prompt TOVA answered "
                f"{ans.strip()!r}: open it and look at the cache heatmap for the step where "
                "TOVA let the key go, and at which layers lost it.")
        kind = "tova-forgets"
    elif (behind := _behind(wide)) is not None:
        return behind
    else:
        # where the opposite shows most (TOVA right, both wrong), else the most prompts
        s = summary.sort_values(["reverse", "n"], ascending=False, kind="stable").iloc[0]
        mode, gran, budget = s["prompt_mode"], s["granularity"], int(s["budget"])
        sub = wide[(wide["prompt_mode"] == mode) & (wide["granularity"] == gran)
                   & (wide["budget"] == s["budget"])]
        pick = sub["reverse"] if sub["reverse"].any() else ~sub["tova"]
        ex = (sub[pick] if pick.any() else sub).sort_values(["length", "depth", "seed"]).iloc[0]
        opposite = (f" The opposite happened in {int(s['reverse'])}: TOVA right, H2O and "
                    "Scissorhands both wrong." if s["reverse"] else "")
        text = (f"**The data does not show TOVA's warning.** In no prompt did TOVA answer wrong "
                f"while H2O and Scissorhands both answered right. At budget {budget} ({mode} "
                f"prompt, {gran} granularity), of {int(s['n'])} prompts TOVA answered right "
                f"{int(s['tova'])}, H2O {int(s['h2o'])}, Scissorhands {int(s['sc'])}.{opposite}")
        kind = "no-support"
    return {"kind": kind, "text": text, "lines": ("tova", "h2o"),
            "cell": _cell(ex, budget, mode, gran)}


def _behind(wide: pd.DataFrame) -> dict | None:
    """No prompt has TOVA wrong with both others right, but one of them alone is right where
    TOVA is wrong more often than the reverse in some cell (typically Scissorhands never
    answers, so the trio's joint count stays 0): the cell where that gap is widest. None if
    TOVA is never behind either of them one on one."""
    rows = []
    for (mode, gran, budget), g in wide.groupby(["prompt_mode", "granularity", "budget"]):
        for o in TRIO[1:]:
            b, a = int(g[f"behind_{o}"].sum()), int(g[f"ahead_{o}"].sum())
            if b > a:
                rows.append((b - a, -len(g), mode, gran, budget, o, b, a, g))
    if not rows:
        return None
    _, _, mode, gran, budget, o, b, a, g = max(rows, key=lambda t: t[:2])
    ex = g[g[f"behind_{o}"]].sort_values(["length", "depth", "seed"]).iloc[0]
    text = (f"**TOVA falls behind {TRIO_NAMES[o]} one on one.** No prompt had TOVA wrong while H2O and "
            f"Scissorhands were both right, but at budget {int(budget)} ({mode} prompt, {gran} "
            f"granularity) TOVA was wrong where {TRIO_NAMES[o]} was right in {b} of {len(g)} prompts, the "
            f"reverse in {a}. Over those prompts TOVA was right {int(g['tova'].sum())} times, H2O "
            f"{int(g['h2o'].sum())}, Scissorhands {int(g['scissorhands'].sum())}. Open the first such "
            f"prompt and find the step where TOVA let the key go.")
    return {"kind": "tova-behind", "text": text, "lines": ("tova", o),
            "cell": _cell(ex, int(budget), mode, gran)}


# --- the recall task: the key's attention over the prompt ----------------------------------
def key_attention_figure(attention, *, reminders, key_positions, lost: dict, layer=None,
                         height: int = 380) -> go.Figure:
    """Per prompt step (x), the attention the full cache's query at that step pays to the
    key's positions (y: summed over them, mean over query heads), from a (layers, steps)
    array: layer `layer`'s row, or with None the mean over layers. The reminder sentences'
    steps shaded, the key's own positions in the key's colour, and each policy's step of
    losing the key (`lost`: {label: step}, -1 never) marked on the curve. The y axis fits the
    steps from the first reminder on; the key's own, higher steps run above it, their peak said
    in a note."""
    a = np.asarray(attention, float)
    y = a.mean(0) if layer is None else a[int(layer)]
    T = len(y)
    fig = go.Figure(go.Scatter(x=list(range(T)), y=y.tolist(), mode="lines", name="attention on the key",
                               line=dict(color="#3a3a3a", width=1.5),
                               hovertemplate="step %{x}<br>%{y:.3f} of the row on the key<extra></extra>"))
    for lo, hi in sorted((int(r[0]), int(r[1])) for r in reminders):  # [start, end) spans
        fig.add_vrect(x0=lo - 0.5, x1=hi - 0.5, fillcolor=REMINDER_COLOUR, opacity=0.8, layer="below",
                      line_width=0, name="reminder")
    for lo, hi in _runs(key_positions):
        fig.add_vrect(x0=lo - 0.5, x1=hi + 0.5, fillcolor=KEY_COLOUR, opacity=0.6, layer="below",
                      line_width=0, name="key")
    said = set()  # policies losing the key at one step share one label, the first marker's
    for label, step in lost.items():
        step = int(step)
        if step < 0 or step >= T:
            continue
        colour = policy_colour(policy_of(label))
        text = "" if step in said else "<br>".join(k for k, v in lost.items() if int(v) == step)
        said.add(step)
        fig.add_trace(go.Scatter(
            x=[step], y=[float(y[step])], mode="markers+text", text=[text], textposition="top center",
            name=f"{label} loses the key (step {step})",
            marker=dict(symbol="x-thin", size=14, color=colour, line=dict(width=3, color=colour)),
            textfont=dict(color=colour if "<br>" not in text else "#333333", size=13),
            hovertemplate=f"{html.escape(label)}: first key token evicted at step {step}<extra></extra>"))
    for name, colour in (("a reminder sentence", REMINDER_COLOUR), ("the key", KEY_COLOUR)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=14, color=colour)))
    where = "mean over layers" if layer is None else f"layer {int(layer)}"
    base_layout(fig, f"The key's attention at each prompt step (full cache, {where})", height,
                legend_below=True)
    fig.update_xaxes(title="prompt step (the query's position)", range=[-0.5, T - 0.5])
    # the key's own steps (and the few after them) take far more than any later step: the axis
    # is scaled to the steps from the first reminder on (without one: from just after the
    # key), and a note gives the highest value above it
    kp = [int(p) for p in key_positions]
    start = min((int(r[0]) for r in reminders), default=(max(kp) + 1) if kp else 0)
    later = y[start:] if start < T else y
    top = 1.4 * float(np.nanmax(later)) if len(later) and np.nanmax(later) > 0 else 1.0
    if T and float(np.nanmax(y)) > top:
        peak = int(np.nanargmax(y))
        fig.add_annotation(x=peak, y=top, yanchor="top", showarrow=False, yshift=-2,
                           text=f"↑ up to {float(y[peak]):.2f} at the key (step {peak})",
                           font=dict(size=12, color="#555555"), xanchor="left")
    fig.update_yaxes(title="attention on the key", range=[0, top])
    return fig
