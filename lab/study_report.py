"""A pre-registered study's report: each claim's one primary contrast with its interval and
its power, the secondary contrasts with Holm-corrected p-values, and the prompts the full cache
got wrong reported apart.

    .venv/bin/python -m lab.study_report traces/studies/recall            # print; files to out/
    .venv/bin/python -m lab.study_report traces/studies/recall --write    # docs/studies/, answers.json

DIR holds `preregistration.toml` (committed before the study ran) and the results table it
names (a needle results table, kvviz.model.needle.results: id, policy, label, budget,
correct, full_cache_correct and the task's columns). Without --write the page and the
answers file go to --out (default out/studies/<study>/), so no tracked file changes; with it,
docs/studies/<study>.md and DIR/answers.json.

The pre-registration (TOML):

    study = "recall"                 # the page's name: docs/studies/recall.md
    title = "Does TOVA forget a token the text returns to?"
    results = "results.csv"          # relative to DIR
    alpha = 0.05
    [[claim]]
    name = "forgets"                 # a result's id is <claim>, or <claim>.<n> for secondaries
    card = "TOVA: When a token matters intermittently ..."
    hypothesis = "TOVA answers fewer gated prompts than H2O when ..."
    by = "policy"                    # the column naming the two sides (default "label")
    gap = 0.2                        # the paired gap the cell size was computed for
    power = 0.8
    discordance = 0.4                # the discordance that computation assumed
    prompts = 84                     # the planned prompts per cell (n_for_power)
    [claim.primary]                  # A: the side the hypothesis expects to answer more often
    name = "P1"
    a = "h2o"
    b = "tova"
    where = { task = "recall", prompt_mode = "decode", budget = 128, reminder_every = 5 }
    [[claim.secondary]]              # each expands to one contrast per value of `vary`
    a = "tova"
    b = "h2o"
    where = { task = "recall", prompt_mode = "decode" }
    vary = ["budget", "reminder_every"]
    [[claim.secondary]]              # two variants of one prompt, paired by these columns
    a = { policy = "h2o", returns = 3 }
    b = { policy = "h2o", returns = 0 }
    pair = ["haystack", "depth", "seed"]
    [[claim.secondary]]              # A's gain over B at 8 words minus its gain at 1 word
    kind = "interaction"
    a = "snapkv5"
    b = "snapkv1"
    across = { phrase_words = [8, 1] }
    pair = ["haystack", "depth", "seed"]
    [[describe]]                     # a table of means, descriptive (no test)
    title = "..."
    group = ["label"]
    values = ["held_end"]

Optional top-level fields: `results` may list several tables; `least_full` (a cell whose
prompts the full cache answers less often is "not testable"); `least_pairs` (a cell with
fewer prompts than planned, a claim's or a contrast's `prompts`, is "partial", descriptive
and untested, until it has this many gated pairs); `document` (the written pre-registration
this file transcribes: git's first commit of either counts).

The primary contrast is tested at `alpha` uncorrected (it is the one the claim stands on); a
claim's secondary contrasts form one Holm family (a registered cell that did not run, or is
not testable, is listed as such and left out of it). Every printed result is marked
"primary" or "secondary (Holm p = ...)"; answers.json carries the same marks for the lesson's
placeholders. A results table not written yet is read from its folder's run files (nothing
written there): a study still running can be reported.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd

from kvviz.core.atomic import replacing
from kvviz.studies import stats as S
from lab import REPO, STUDIES

PREREG = "preregistration.toml"
FIELDS = {"study", "title", "results", "alpha", "claim", "least_full", "least_pairs", "document",
          "describe", "note"}
CLAIM_FIELDS = {"name", "card", "hypothesis", "by", "gap", "power", "discordance", "prompts",
                "primary", "secondary", "control"}


class PreregError(ValueError):
    """The pre-registration itself is wrong (not a cell that did not run)."""


def _fail(path, where, rule, error=ValueError):
    raise error(f"{Path(path).name}: {where}: {rule}")


def load_prereg(folder: Path) -> dict:
    path = Path(folder) / PREREG
    if not path.is_file():
        raise ValueError(f"{folder}: no {PREREG} (a study states its claims before it runs)")
    try:
        pre = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from None
    unknown = set(pre) - FIELDS
    if unknown:
        _fail(path, "top level", f"unknown field {sorted(unknown)[0]!r} (fields: "
                                 f"{', '.join(sorted(FIELDS))})")
    for key in ("study", "claim"):
        if key not in pre:
            _fail(path, "top level", f"{key} is required")
    if not str(pre["study"]).replace("-", "").replace("_", "").isalnum():
        _fail(path, "study", f"{pre['study']!r} must be a plain name (letters, digits, - and _)")
    alpha = pre.setdefault("alpha", 0.05)
    if not 0 < float(alpha) < 1:
        _fail(path, "alpha", f"must lie in (0, 1), got {alpha!r}")
    pre.setdefault("results", "results.csv")
    names = set()
    for i, c in enumerate(pre["claim"]):
        where = f"claim {i + 1}"
        unknown = set(c) - CLAIM_FIELDS
        if unknown:
            _fail(path, where, f"unknown field {sorted(unknown)[0]!r} (fields: "
                               f"{', '.join(sorted(CLAIM_FIELDS))})")
        if not c.get("name") or c["name"] in names or "." in c["name"]:
            _fail(path, where, "name is required, unique, and has no '.'")
        names.add(c["name"])
        p = c.get("primary")
        if not isinstance(p, dict) or not {"a", "b"} <= set(p):
            _fail(path, f"{where} ({c['name']})", "one primary contrast is required: "
                                                  "[claim.primary] with a, b and where")
        gap = float(c.get("gap", 0.2))
        if not 0 < abs(gap) <= 1:
            _fail(path, f"{where} ({c['name']})", f"gap must lie in (0, 1], got {gap!r}")
    return pre


def _cell(rows: pd.DataFrame, where: dict, path, what) -> pd.DataFrame:
    mask = pd.Series(True, index=rows.index)
    for col, val in where.items():
        if col not in rows:
            _fail(path, what, f"where.{col}: the results have no column {col!r}", PreregError)
        mask &= rows[col].astype(str) == str(val) if isinstance(val, str) else rows[col] == val
    return rows[mask]


def _tables(results) -> list[str]:
    return [results] if isinstance(results, str) else list(results)


def read_results(folder: Path, results, path) -> tuple[pd.DataFrame, str]:
    """(the rows of every results table the pre-registration names that exists, relative to
    `folder`; where a table is missing but its folder has run files, the rows read from them
    (kvviz.model.needle.results.rows, nothing written): a study still running; the sources in
    words)."""
    from kvviz.model.needle.results import list_runs, load_run
    from kvviz.model.needle.results import rows as run_rows

    frames, said = [], []
    for name in _tables(results):
        table = folder / name
        if table.is_file():
            frames.append(pd.read_csv(table, keep_default_na=False, na_values=[""]))
            said.append(name)
        elif list_runs(table.parent):
            ids = list_runs(table.parent)
            frames.append(pd.DataFrame([r for i in ids for r in run_rows(load_run(table.parent, i))]))
            said.append(f"{Path(name).parent / 'runs'}/ ({len(ids)} run files; no {Path(name).name} yet)")
    if not frames:
        raise ValueError(f"{path}: results: none of {', '.join(_tables(results))} exists in {folder} "
                         "(the study has not run yet)")
    return pd.concat(frames, ignore_index=True), ", ".join(f"`{x}`" for x in said)


def _side(spec_side, by: str) -> dict:
    """A side's selection: {by: value} for a plain value, else the table as given."""
    return dict(spec_side) if isinstance(spec_side, dict) else {by: spec_side}


def _name(sel: dict, by: str) -> str:
    return str(sel[by]) if list(sel) == [by] else ", ".join(f"{k} {v}" for k, v in sel.items())


def _acc(t: S.Paired) -> dict:
    acc = {}
    for side, k in (("a", t.a + t.b), ("b", t.a + t.c)):
        wl, wh = S.wilson(k, t.n) if t.n else (float("nan"), float("nan"))
        acc[side] = [k, t.n, wl, wh]
    return acc


def contrast(rows, spec: dict, by: str, gap: float, alpha: float, least: float, path, what,
             planned: int | None = None, least_pairs: int = 0) -> dict:
    """One contrast: side A's rows against side B's within `where`, paired by `pair` (the
    prompt's id by default), each side's prompts gated by the full cache. kind "interaction":
    the gain of A over B at the first value of `across` minus its gain at the second, per
    pair, and the exact sign test on the non-zero differences."""
    where = dict(spec.get("where", {}))
    cell = _cell(rows, where, path, what)
    if cell.empty:
        _fail(path, what, "no results yet for this cell")
    a, b = _side(spec["a"], by), _side(spec["b"], by)
    pair = list(spec.get("pair", ["id"]))
    base = {"name": spec.get("name", ""), "a": _name(a, by), "b": _name(b, by), "where": where,
            "pair": pair, "kind": spec.get("kind", "paired"), "gap": gap}
    if base["kind"] == "interaction":
        out = {**base, **_interaction(cell, a, b, pair, spec, path, what)}
        planned = spec.get("prompts", planned)
        out["partial"] = bool(planned) and out["n"] < int(planned) and out["n"] < least_pairs
        out["planned"] = planned
        out["testable"] = out["n"] > 0 and not out["partial"]
        return out
    sa, sb = _cell(cell, a, path, what + " a"), _cell(cell, b, path, what + " b")
    for side, rows_ in (("a", sa), ("b", sb)):
        if rows_.empty:
            _fail(path, what, f"no results yet for side {side} ({_name(a if side == 'a' else b, by)})")
    t = S.paired_sides(sa, sb, on=pair)
    lo, hi = t.interval()
    out = {**base, "table": [t.a, t.b, t.c, t.d], "n": t.n, "full_cache_wrong": t.dropped,
           "accuracy": _acc(t), "diff": t.diff, "interval": [lo, hi], "p": t.p,
           "discordance": (t.b + t.c) / t.n if t.n else float("nan"),
           "power": t.power(gap, alpha) if t.n else 0.0}
    total = t.n + t.dropped
    planned = spec.get("prompts", planned)
    # a cell that has not finished is tested only once it has least_pairs gated pairs
    out["partial"] = bool(planned) and total < int(planned) and t.n < least_pairs
    out["planned"] = planned
    out["testable"] = bool(total) and t.n / total >= least and not out["partial"]
    return out


def _interaction(cell, a, b, pair, spec, path, what) -> dict:
    across = spec.get("across")
    if not isinstance(across, dict) or len(across) != 1 or len(next(iter(across.values()))) != 2:
        _fail(path, what, "an interaction needs across = { COLUMN = [first, second] }", PreregError)
    col, (v1, v2) = next(iter(across.items()))
    gains, dropped = [], 0
    for v in (v1, v2):
        part = _cell(cell, {col: v}, path, what)
        sa, sb = _cell(part, a, path, what), _cell(part, b, path, what)
        m = S.with_full_verdict(sa)[[*pair, "correct", "full_cache_correct"]].merge(
            S.with_full_verdict(sb)[[*pair, "correct", "full_cache_correct"]], on=pair, suffixes=("_a", "_b"))
        ok = S._bool(m["full_cache_correct_a"]) & S._bool(m["full_cache_correct_b"])
        dropped += int((~ok).sum())
        m = m[ok]
        gains.append(m[pair].assign(g=S._bool(m["correct_a"]).astype(int) - S._bool(m["correct_b"]).astype(int)))
    both = gains[0].merge(gains[1], on=pair, suffixes=("1", "2"))
    d = both["g1"] - both["g2"]
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    return {"across": {col: [v1, v2]}, "n": len(both), "full_cache_wrong": dropped,
            "positive": pos, "negative": neg, "diff": float(d.mean()) if len(d) else float("nan"),
            "p": S.mcnemar_exact(pos, neg), "testable": len(both) > 0}


def _reason(exc: ValueError) -> str:
    """Why a registered cell has no contrast, without the file and claim the page is about."""
    text = str(exc)
    return text.split(": ", 2)[-1] if text.startswith(PREREG) else text


def _secondaries(rows, claim, path) -> list[dict]:
    """Each [[claim.secondary]] expanded over its `vary` columns' values (the primary's own
    cell left out)."""
    out = []
    prim = claim["primary"]
    for j, s in enumerate(claim.get("secondary", [])):
        vary = list(s.get("vary", []))
        base = {k: v for k, v in s.get("where", {}).items() if k not in vary}
        if not vary:
            out.append({**s, "where": base})
            continue
        cell = _cell(rows, base, path, f"{claim['name']} secondary {j + 1}")
        for col in vary:
            if col not in cell:
                _fail(path, f"{claim['name']} secondary {j + 1}", f"vary: no column {col!r}")
        values = [sorted(set(cell[c].dropna()) - ({-1} if c == "budget" else set())) for c in vary]
        for combo in product(*values):
            where = {**base, **{c: (v.item() if hasattr(v, "item") else v) for c, v in zip(vary, combo)}}
            same = (str(s["a"]), str(s["b"])) == (str(prim["a"]), str(prim["b"])) and \
                where == dict(prim.get("where", {}))
            if not same and not _cell(rows, where, path, "vary").empty:
                out.append({**{k: v for k, v in s.items() if k != "vary"}, "where": where})
    return out


def analyse(folder: Path) -> dict:
    """answers.json's dict: per claim, its results, the primary first, each marked."""
    folder = Path(folder)
    pre = load_prereg(folder)
    path = folder / PREREG
    rows, source = read_results(folder, pre["results"], path)
    rows = S.with_full_verdict(rows)
    alpha, least = float(pre["alpha"]), float(pre.get("least_full", 0.0))
    least_pairs = int(pre.get("least_pairs", 0))
    claims = {}
    for c in pre["claim"]:
        by, gap = c.get("by", "label"), float(c.get("gap", 0.2))
        try:
            prim = contrast(rows, c["primary"], by, gap, alpha, least, path, f"{c['name']} primary",
                            c.get("prompts"), least_pairs)
        except PreregError:
            raise
        except ValueError as exc:
            prim = {"name": c["primary"].get("name", ""), "where": dict(c["primary"].get("where", {})),
                    "not_run": _reason(exc), "testable": False}
        prim.update(id=c["name"], status="primary")
        secs = []
        for i, spec in enumerate(_secondaries(rows, c, path)):
            try:
                r = contrast(rows, spec, by, gap, alpha, least, path, f"{c['name']} secondary",
                             c.get("prompts"), least_pairs)
            except PreregError:
                raise
            except ValueError as exc:  # a registered cell that did not run: said, not tested
                r = {"name": spec.get("name", ""), "where": dict(spec.get("where", {})),
                     "not_run": _reason(exc), "testable": False}
            r.update(id=f"{c['name']}.{i + 1}", status="secondary")
            secs.append(r)
        tested = [r for r in secs if r["testable"]]
        for r, h in zip(tested, S.holm([r["p"] for r in tested])):
            r["holm_p"] = h
        for r in (prim, *secs):
            r["text"] = result_line(r)  # what a lesson's {primary.*} / {secondary.*} quotes
        control = next((r for r in secs if c.get("control") and r.get("name", "").startswith(c["control"])),
                       None)
        claims[c["name"]] = {"card": c.get("card", ""), "hypothesis": c.get("hypothesis", ""),
                             "control": control_note(control, c.get("control"), alpha),
                             "answer": answer(prim, control, c.get("control"), alpha),
                             "planned": {k: c[k] for k in ("gap", "power", "discordance", "prompts")
                                         if k in c},
                             "holm_family": len(tested), "results": [prim, *secs]}
    described = [describe(rows, d, path) for d in pre.get("describe", [])]
    prompts = rows.drop_duplicates("id")
    wrong = prompts[~prompts["full_cache_correct"]]
    by_hay = "haystack" if "haystack" in rows else None
    apart = {"prompts": len(prompts), "wrong": len(wrong),
             "by": ({str(k): int(v) for k, v in wrong.groupby(by_hay).size().items()} if by_hay else {})}
    return {"study": pre["study"], "title": pre.get("title", pre["study"]), "alpha": alpha,
            "least_full": least, "described": described, "set_apart": apart, "note": pre.get("note", ""),
            "preregistration": str(path.resolve().relative_to(REPO))
            if path.resolve().is_relative_to(REPO) else str(path),
            "registered": registration(folder, _tables(pre["results"])[0], pre.get("document")),
            "results_table": source, "claims": claims}


def horizon(rows, d: dict, path) -> dict:
    """A [[describe]] of kind "horizon" (descriptive): the decode steps a key survives under
    one policy once eviction has started with nothing returning to it. Per gated prompt of
    `where`, the median over layers of first_lost_by_layer - start (a key never lost in a
    layer counts as end - start); the horizon is the median over prompts. Beside it, the
    quiet stretch (`quiet`) plus the answer's `answer_tokens` on the prompts of `quiet_where`,
    and on how many of them it is longer than the horizon."""
    import json

    for key in ("title", "label", "start", "end", "quiet_where"):
        if key not in d:
            _fail(path, "describe", f"a horizon needs {key} (title, where, label, start, end, "
                                    "quiet_where, answer_tokens)", PreregError)
    cell = _cell(rows, dict(d.get("where", {})), path, "describe")
    cell = cell[cell["full_cache_correct"] & (cell["label"] == d["label"])]
    start, end = int(d["start"]), int(d["end"])
    per_prompt = []
    for v in cell["first_lost_by_layer"]:
        lost = json.loads(v) if isinstance(v, str) else list(v)
        per_prompt.append(float(np.median([(x - start) if x >= 0 else (end - start) for x in lost])))
    if not per_prompt:
        return {"title": d["title"], "not_run": f"no gated prompt of {d['label']} at "
                                                f"{where_text(d.get('where', {}))} yet"}
    h = float(np.median(per_prompt))
    q = _cell(rows, dict(d["quiet_where"]), path, "describe")
    q = q[q["full_cache_correct"]].drop_duplicates("id")
    quiet = pd.to_numeric(q["quiet"], errors="coerce").dropna() + int(d.get("answer_tokens", 0))
    longer = int((quiet > h).sum())
    return {"title": d["title"], "group": ["policy"], "where": dict(d.get("where", {})),
            "values": ["prompts", "horizon (median steps)", "quiet + answer (steps)",
                       "prompts where it is longer"],
            "rows": [{"policy": d["label"], "prompts": len(per_prompt), "horizon (median steps)": h,
                      "quiet + answer (steps)": f"{int(quiet.min())}–{int(quiet.max())}" if len(quiet) else "none",
                      "prompts where it is longer": f"{longer} of {len(quiet)}"}], "no_rows_column": True}


def describe(rows, d: dict, path) -> dict:
    """A [[describe]] table (descriptive, no test): the mean of `values` over the gated
    prompts' rows of `where`, per combination of `group` (kind "horizon": horizon())."""
    if d.get("kind") == "horizon":
        return horizon(rows, d, path)
    for key in ("title", "group", "values"):
        if key not in d:
            _fail(path, "describe", f"{key} is required (title, where, group, values)", PreregError)
    cell = _cell(rows, dict(d.get("where", {})), path, "describe")
    cell = cell[cell["full_cache_correct"]]
    for col in [*d["group"], *d["values"]]:
        if col not in cell:
            return {"title": d["title"], "not_run": f"the results have no column {col!r}"}
    vals = cell[[*d["group"], *d["values"]]].copy()
    for col in d["values"]:
        vals[col] = pd.to_numeric(vals[col], errors="coerce").where(lambda x: x >= 0)
    g = vals.groupby(list(d["group"]))
    table = g[list(d["values"])].mean().round(3).join(g.size().rename("rows")).reset_index()
    return {"title": d["title"], "group": list(d["group"]), "values": list(d["values"]),
            "where": dict(d.get("where", {})), "rows": table.to_dict(orient="records")}


def first_commit(path: Path) -> tuple[str, int] | None:
    """(the short hash, the time) of the first commit that added `path`, or None when it is
    not committed (or not in a git checkout)."""
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h %ct", "--", path.name],
                             cwd=path.parent, capture_output=True, text=True, check=False).stdout
    except OSError:
        return None
    lines = out.split()
    return (lines[-2], int(lines[-1])) if len(lines) >= 2 else None


def registration(folder: Path, results: str, document: str | None = None) -> str:
    """Whether git shows the pre-registration committed before the results, in words. With
    `document` (the written pre-registration the TOML transcribes, relative to the checkout),
    the earlier of the two first commits counts."""
    pre = first_commit(Path(folder) / PREREG)
    table = Path(folder) / results
    res = first_commit(table) or first_commit(table.parent / "runs")  # or its run files
    if document:
        doc = first_commit(REPO / document)
        if doc is not None and (pre is None or doc[1] < pre[1]):
            pre = doc
    if pre is None:
        return "the pre-registration is not committed: these results are not pre-registered"
    if res is None:
        return f"pre-registered in commit {pre[0]}; the results are not committed yet"
    if pre[1] <= res[1]:
        return f"pre-registered in commit {pre[0]}, before the results' first commit {res[0]}"
    return (f"the pre-registration's first commit {pre[0]} came after the results' {res[0]}: "
            "these results are not pre-registered")


# --- text ----------------------------------------------------------------------------------
def pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def mark(r: dict) -> str:
    """"primary" or "secondary (Holm p = 0.62)"."""
    if r["status"] == "primary":
        return "primary"
    return f"secondary (Holm p = {r['holm_p']:.2g})"


def where_text(w: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in w.items()) or "all rows"


def result_line(r: dict) -> str:
    """One result in words, with its mark: the contrast, accuracies, paired gap with its
    interval, the exact test, the power, and the prompts set apart."""
    label = f"{r['name']}: " if r.get("name") else ""
    if "not_run" in r:
        return f"[{r['status']}, not run] {label}at {where_text(r['where'])}: {r['not_run']}"
    if r.get("partial") and r.get("kind") != "interaction":
        (ka, n, _, _), (kb, _, _, _) = r["accuracy"]["a"], r["accuracy"]["b"]
        return (f"[{r['status']}, partial: descriptive, no test] {label}{r['a']} against {r['b']} at "
                f"{where_text(r['where'])}: {r['n'] + r['full_cache_wrong']} of {r['planned']} planned "
                f"prompts run, {n} gated ({r['full_cache_wrong']} set apart: the full cache got them "
                f"wrong); so far {ka}/{n} against {kb}/{n}, discordant {r['table'][1]} against "
                f"{r['table'][2]}")
    if not r["testable"] and r.get("kind") != "interaction":
        total = r["n"] + r["full_cache_wrong"]
        return (f"[{r['status']}, not testable] {label}{r['a']} against {r['b']} at "
                f"{where_text(r['where'])}: the full cache answered {r['n']} of {total} prompts")
    if r.get("kind") == "interaction" and not r["testable"]:
        state = "partial: descriptive, no test" if r.get("partial") else "no pairs yet"
        return (f"[{r['status']}, {state}] {label}the gain of {r['a']} over {r['b']} across "
                f"{r['across']}: {r['n']} gated pairs so far, positive in {r['positive']}, negative in "
                f"{r['negative']}")
    if r.get("kind") == "interaction":
        (col, (v1, v2)), = r["across"].items()
        p = f"p = {r['p']:.2g}" + (f", Holm p = {r['holm_p']:.2g}" if "holm_p" in r else "")
        return (f"[{mark(r)}] {label}the gain of {r['a']} over {r['b']} at {col} {v1} minus its gain at "
                f"{col} {v2}, at {where_text(r['where'])}, per pair of prompts ({', '.join(r['pair'])}): "
                f"positive in {r['positive']}, negative in {r['negative']} of {r['n']} pairs, mean "
                f"{r['diff']:+.2f}; exact sign test {p}; the full cache got {r['full_cache_wrong']} "
                "pairs' prompts wrong (set apart)")
    (ka, n, la, ha), (kb, _, lb, hb) = r["accuracy"]["a"], r["accuracy"]["b"]
    lo, hi = r["interval"]
    if not n:
        return f"[{mark(r)}] {label}{r['a']} against {r['b']} at {where_text(r['where'])}: no gated prompts"
    p = f"p = {r['p']:.2g}" + (f", Holm p = {r['holm_p']:.2g}" if r["status"] == "secondary" else "")
    return (f"[{mark(r)}] {label}{r['a']} against {r['b']} at {where_text(r['where'])}: "
            f"{ka}/{n} ({pct(ka / n)} [{pct(la)}–{pct(ha)}]) against {kb}/{n} ({pct(kb / n)} "
            f"[{pct(lb)}–{pct(hb)}]); paired gap {100 * r['diff']:+.0f} points, 95 % interval "
            f"[{100 * lo:+.0f}, {100 * hi:+.0f}] (Newcombe); discordant {r['table'][1]} against "
            f"{r['table'][2]}, exact McNemar {p}; "
            + (f"power to detect a {100 * r['gap']:.0f}-point gap at the observed discordance: "
               f"{pct(r['power'])}" if r["table"][1] + r["table"][2] else
               "power: none to speak of (no discordant prompt: the sides cannot be told apart)")
            + "; " + _apart(r))


def _apart(r: dict) -> str:
    k = r["full_cache_wrong"]
    if r.get("pair", ["id"]) == ["id"]:
        return f"the full cache got {k} prompt{'s' if k != 1 else ''} wrong (set apart)"
    return f"{k} pair{'s' if k != 1 else ''} set apart (the full cache got a prompt of each wrong)"


def verdict(r: dict, alpha: float) -> str:
    """The claim's answer from its primary contrast (A is the side the hypothesis expects to
    answer more often)."""
    if "not_run" in r:
        return "not answered: the primary contrast did not run."
    if r.get("partial"):
        return ("not answered yet: the primary cell is partial (its pre-registration tests an "
                "unfinished cell only once it has enough gated pairs); its counts so far are "
                "descriptive.")
    if not r["testable"]:
        return "not answered: the full cache fails too many of the primary cell's prompts."
    if r.get("kind") == "interaction":
        ok = r["p"] <= alpha
        return ("supported" if ok and r["diff"] > 0 else "contradicted" if ok else "not shown") + \
            f" (exact sign test p = {r['p']:.2g})."
    lo, hi = r["interval"]
    span = f"paired gap {100 * r['diff']:+.0f} points, 95 % interval [{100 * lo:+.0f}, {100 * hi:+.0f}]"
    if r["table"][1] + r["table"][2] == 0:
        a, _, _, d = r["table"]
        where = ("both at the floor: no gated prompt answered by either" if a == 0 else
                 "both at the ceiling: every gated prompt answered by both" if d == 0 else
                 "every gated prompt answered by both or by neither")
        return (f"no evidence either way: {where} ({r['n']} prompts), so no prompt separates "
                f"{r['a']} from {r['b']}; the cell cannot answer the claim.")
    if r["p"] <= alpha and r["diff"] > 0:
        return f"supported: {r['a']} answered more often than {r['b']} ({span}, p = {r['p']:.2g})."
    if r["p"] <= alpha:
        return f"contradicted: {r['b']} answered more often than {r['a']} ({span}, p = {r['p']:.2g})."
    return (f"not shown: {span}, p = {r['p']:.2g}; the test had {pct(r['power'])} power to detect a "
            f"{100 * r['gap']:.0f}-point gap at the observed discordance, so a gap that size "
            f"{'would likely have been found' if r['power'] >= 0.8 else 'could have been missed'}.")


def control_failed(r: dict | None, alpha: float) -> bool:
    """The positive control ran, was testable, and did not show the expected gain."""
    return bool(r) and "not_run" not in r and r["testable"] and not (r["holm_p"] <= alpha and r.get("diff", 0) > 0)


def answer(prim: dict, control: dict | None, name: str | None, alpha: float) -> str:
    """The claim's answer: the primary's verdict, read with its positive control."""
    v = verdict(prim, alpha)
    note = control_note(control, name, alpha)
    if v.startswith("supported") and control_failed(control, alpha):
        return ("not shown as claimed: the primary contrast favours A (" + v.split(": ", 1)[1].rstrip(".")
                + f"), but its positive control ({name}) does not show the expected gain (Holm p = "
                f"{control['holm_p']:.2g}): the design did not make the difference the claim is about, so "
                "the primary does not test the claim itself.")
    return v + (f" {note}" if note else "")


def control_note(r: dict | None, name: str | None, alpha: float) -> str:
    """What the claim's positive control (a secondary named by the claim's `control`) says
    about reading the primary: empty without one."""
    if not name:
        return ""
    if r is None or "not_run" in r:
        return (f"Its positive control ({name}) has not run: until it does, the design's making "
                "the difference it tests for is not shown, and the primary is read with that caveat.")
    if not r["testable"]:
        return f"Its positive control ({name}) is not testable yet: the primary is read with that caveat."
    if r["holm_p"] <= alpha and r.get("diff", 0) > 0:
        return f"Its positive control ({name}) shows the expected gain (Holm p = {r['holm_p']:.2g})."
    return (f"Its positive control ({name}) does not show the expected gain (Holm p = "
            f"{r['holm_p']:.2g}): the primary is read as the design not making that difference matter.")


def needed(r: dict, planned: dict) -> str:
    """The prompts a cell would need for the planned power at the observed discordance."""
    want = float(planned.get("power", 0.8))
    disc = max(r["discordance"], abs(r["gap"])) if r["n"] else float(planned.get("discordance", 0.4))
    try:
        n = S.n_for_power(r["gap"], min(disc, 1.0), want)
    except ValueError as exc:
        return f"Prompts needed for {pct(want)} power: not reached ({exc})."
    return (f"Prompts needed for {pct(want)} power to detect a {100 * r['gap']:.0f}-point gap at "
            f"the observed discordance ({pct(disc)}): {n}; this cell has {r['n']}.")


def page(ans: dict) -> str:
    lines = [f"# {ans['title']}", "",
             f"Generated by `python -m lab.study_report {Path(ans['preregistration']).parent} --write` "
             f"from {ans['results_table']} and the pre-registration `{ans['preregistration']}` "
             f"({ans['registered']}).", "",
             "Each claim has one primary contrast, tested at "
             f"alpha = {ans['alpha']:g} uncorrected; its secondary contrasts are one family, "
             "Holm-corrected. Every result is marked. A prompt the full cache gets wrong is "
             "reported apart, never counted as an eviction failure. Paired gaps are A's accuracy "
             "minus B's over the same prompts, with Newcombe's square-and-add 95 % interval; "
             "accuracies carry Wilson 95 % intervals; power is the exact McNemar test's, at the "
             "observed discordance.", ""]
    if ans.get("note"):
        lines += [" ".join(ans["note"].split()), ""]
    apart = ans.get("set_apart")
    if apart:
        by = "; ".join(f"{k} {v}" for k, v in sorted(apart["by"].items(), key=lambda kv: (-kv[1], kv[0])))
        lines += [f"**Set apart:** the full cache got {apart['wrong']} of the study's {apart['prompts']} "
                  f"prompts wrong; every contrast leaves them out{f' (by haystack: {by})' if by else ''}.", ""]
    for name, c in ans["claims"].items():
        prim, secs = c["results"][0], c["results"][1:]
        lines += [f"## {name}", ""]
        if c["card"]:
            lines += [f"> {c['card']}", ""]
        if c["hypothesis"]:
            lines += [f"Hypothesis: {c['hypothesis']}", ""]
        if c["planned"]:
            lines += ["Planned: " + ", ".join(f"{k} {v}" for k, v in c["planned"].items()), ""]
        lines += [f"**Answer (from the primary contrast):** {c['answer']}", "",
                  f"**Primary.** {result_line(prim)}.", ""]
        if prim.get("testable") and prim.get("kind", "paired") == "paired" and sum(prim["table"][1:3]):
            lines += [needed(prim, c["planned"]), ""]
        if secs:
            lines += [f"Secondary ({len(secs)} registered; Holm-corrected over the "
                      f"{c['holm_family']} that ran and were testable):", ""]
            lines += [f"- {result_line(r)}" for r in secs] + [""]
    for d in ans.get("described", []):
        lines += [f"## {d['title']} (descriptive, no test)", ""]
        if "not_run" in d:
            lines += [f"Not run: {d['not_run']}.", ""]
            continue
        cols = [*d["group"], *d["values"]] + ([] if d.get("no_rows_column") else ["rows"])
        what = "Over" if d.get("no_rows_column") else "Means over"
        lines += [f"{what} the prompts the full cache answers, at {where_text(d['where'])}:", "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in d["rows"]] + [""]
    return "\n".join(lines)


def summary(ans: dict) -> str:
    """What the command prints: per claim, the primary contrast, its interval and its power."""
    out = [f"{ans['study']}: {ans['title']} ({ans['registered']})"]
    for name, c in ans["claims"].items():
        r = c["results"][0]
        out.append(f"{name}: {c['answer']}")
        out.append(f"  {result_line(r)}")
        if r.get("testable") and r.get("kind", "paired") == "paired" and sum(r["table"][1:3]):
            out.append(f"  {needed(r, c['planned'])}")
        sig = [s for s in c["results"][1:] if s.get("holm_p", 1.0) <= ans["alpha"]]
        out.append(f"  secondary: {len(c['results']) - 1} registered, {c['holm_family']} tested, "
                   f"{len(sig)} at Holm p <= {ans['alpha']:g}")
    return "\n".join(out)


def write(ans: dict, doc: str, page_path: Path, answers_path: Path) -> None:
    page_path.parent.mkdir(parents=True, exist_ok=True)
    answers_path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(page_path) as fh:
        fh.write(doc.encode())
    with replacing(answers_path) as fh:
        fh.write(json.dumps(ans, indent=1).encode())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.study_report", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="the study's folder (preregistration.toml and its results)")
    p.add_argument("--write", action="store_true",
                   help="write docs/studies/<study>.md and DIR/answers.json (tracked files)")
    p.add_argument("--out", default=None, help="where the page and answers.json go without "
                   "--write (default out/studies/<study>/)")
    args = p.parse_args(argv)
    try:
        ans = analyse(Path(args.dir))
        doc = page(ans)
        if args.write:
            write(ans, doc, REPO / STUDIES / f"{ans['study']}.md", Path(args.dir) / "answers.json")
        else:
            out = Path(args.out) if args.out else Path("out") / "studies" / ans["study"]
            write(ans, doc, out / f"{ans['study']}.md", out / "answers.json")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(ans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
