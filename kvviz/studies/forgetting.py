"""The pass-key and tasks results as statistics: the Forgetting view's tables and sentences,
and the trio pivot (TOVA, H2O and Scissorhands answering the same prompt) the tasks study's
report counts with (pure: a results table or a run's arrays in, numbers and text out).

Inputs are `kvviz needle`'s records: the results table (one row per run and configuration:
length, depth, seed, prompt_mode, granularity, policy, params, budget, answer, correct, ...;
kvviz.model.needle.results.load_results) and one run's arrays (`evicted_at` (C, L, G, T), meta
with key_positions, question_start, prompt_len, configs, answers, correct). The app's figures
draw what these functions count; lab/'s reports print and write it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from kvviz.core.policies import FULL, FULL_LABEL, POLICIES, config_label, param_specs


def right(rows: pd.DataFrame) -> pd.Series:
    """Each row's verdict as a boolean (the table's `correct`, read as CSV text or bool)."""
    return rows["correct"].astype(str).str.lower().isin(["true", "1"])


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
    return sorted({int(x) for x in b.dropna() if str(x).isdigit()})  # counts (a ratio, "0.25x", is not one)


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
    c = r.assign(correct=right(r))
    g = c.groupby(["line", "depth", "length"])["correct"]
    return pd.DataFrame({"right": g.sum(), "n": g.size()}).reset_index().assign(
        accuracy=lambda d: d["right"] / d["n"])


# --- the tasks study's answers (answers.json, written by lab/tasks_report.py) --------------
def answers_path(folder=None) -> Path:
    """answers.json in `folder`, by default the tasks folder (kvviz.core.paths.tasks_dir)."""
    from kvviz.core.paths import tasks_dir

    return Path(folder if folder is not None else tasks_dir()) / "answers.json"


def load_answers(folder=None) -> dict:
    """The tasks study's measured answers (answers_path); ValueError naming the file when it
    is missing, not JSON, or not a JSON object."""
    path = answers_path(folder)
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the tasks study's report writes it: "
                         "./lab/tasks_study.sh report)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


# --- tasks and their options ------------------------------------------------------
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


# --- one run: the answers and the key's positions ------------------------------------
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


# --- the trio and the guided experiment: whichever claim the numbers support -----------
CELL_KEYS = ["prompt_mode", "granularity", "budget", "id", "length", "depth", "seed"]
# TOVA's card (docs: the policy cards), "When not to use it": the warning the grid tests
TOVA_WARNING = "When a token matters intermittently. One quiet step is enough to lose it."
TRIO = ("tova", "h2o", "scissorhands")
TRIO_NAMES = {n: POLICIES[n].label for n in TRIO}  # "TOVA", "H2O", "Scissorhands"


def trio_table(rows: pd.DataFrame, index, column: str = "line", value: str = "ok") -> pd.DataFrame | None:
    """TOVA, H2O and Scissorhands on the same prompts: one row per `index` value (a prompt, or a
    prompt and budget) where all three ran (at default parameters: their `column` is the bare
    name), their verdicts (`value`) as booleans in columns tova, h2o and scissorhands, and the
    paired counts' columns: claim (TOVA wrong, both others right: the TOVA card's warning),
    reverse (TOVA right, both wrong), all_same, and per other policy o behind_o (TOVA wrong where
    o is right) and ahead_o (the reverse). None when one of the three never ran."""
    plain = rows[rows[column].isin(list(TRIO))]
    if not set(TRIO) <= set(plain[column]):
        return None
    wide = plain.pivot_table(index=index, columns=column, values=value,
                             aggfunc="first").dropna().reset_index()
    wide.columns.name = None
    wide[list(TRIO)] = wide[list(TRIO)].astype(bool)
    wide["claim"] = ~wide["tova"] & wide["h2o"] & wide["scissorhands"]
    wide["reverse"] = wide["tova"] & ~wide["h2o"] & ~wide["scissorhands"]
    wide["all_same"] = (wide["tova"] == wide["h2o"]) & (wide["h2o"] == wide["scissorhands"])
    for other in TRIO[1:]:  # one on one: TOVA wrong where the other is right, and the reverse
        wide[f"behind_{other}"] = ~wide["tova"] & wide[other]
        wide[f"ahead_{other}"] = wide["tova"] & ~wide[other]
    return wide


def _trio(r: pd.DataFrame) -> pd.DataFrame | None:
    """trio_table per prompt and budget (the grid's cells), from a table with `line` and `ok`."""
    return trio_table(r, CELL_KEYS)


def _one_on_one(g) -> str:
    """'TOVA wrong where H2O right: a (the reverse: b), where Scissorhands right: c (the
    reverse: d)' over the rows g of _trio."""
    return ", ".join(f"where {TRIO_NAMES[o]} right: {int(g[f'behind_{o}'].sum())} (the reverse: "
                     f"{int(g[f'ahead_{o}'].sum())})" for o in TRIO[1:])


def grid_text(rows: pd.DataFrame, budget: int, prompt_mode: str, granularity: str) -> str:
    """TOVA's warning quoted from its card, then what the grid on screen (this budget,
    prompt mode and granularity) says about it, counted from the results."""
    r = with_lines(rows)
    wide = _trio(r.assign(ok=right(r)))
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
    r = r.assign(ok=right(r))
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
    k0 = next(s.default for s in param_specs("snapkv") if s.name == "pool_kernel")  # the declared default
    snap = snap.assign(k=[int(_params(p).get("pool_kernel", k0)) for p in snap["params"]],
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
