"""The pass-key grid's numbers: docs/studies/needle.md and the table in docs/benchmarks.md, from the results CSV.

    .venv/bin/python -m lab.needle_report traces/needle                 # print the report
    .venv/bin/python -m lab.needle_report traces/needle --predictors --write   # first run the loop
                                                                        # (question 5), then write
    .venv/bin/python -m lab.needle_report traces/needle --write         # also rewrite docs/studies/needle.md
                                                                        # and benchmarks.md's marked table
    .venv/bin/python -m lab.needle_report out/recall --task recall      # another task's runs

Only the lengths where the full cache answers at least 80 % of the task's prompts are
reported (kvviz.model.needle.results.gate); the others are listed with that accuracy.

Every number is computed here from DIR/results.csv (kvviz.model.needle.load_results); nothing is
typed. `--predictors` runs kvviz.model.loop.run_loop once on the grid's first decode-mode prompt
with that prompt's configurations, and keeps, per configuration, the loop's perplexity and
the replay's retained mass (kvviz.core.metrics.evaluate on the full cache's own attention rows,
layers 0, 14 and 29) in DIR/predictors.json.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from kvviz.core.metrics import wilson
from kvviz.core.paths import traces_or_default
from kvviz.core.policies import FULL_LABEL, config_label
from kvviz.model.needle import load_results, load_run
from kvviz.model.needle.results import GATE, gate
from kvviz.studies.forgetting import trio_table
from lab import REPO, STUDIES

MARK = ("<!-- needle:table -->", "<!-- /needle:table -->")
CORRECTIONS = (
    "An earlier version of this page read more into the grid than it supports. What changed, and why:",
    "",
    "- Question 5 called top-1 agreement \"the strongest predictor\" by its |rho|: its rho is negative (the "
    "configurations the loop scores better are right less often), over one prompt's handful of configurations, "
    "below the exact 5 % critical value. The answer now gives the sign, the critical value and no predictor.",
    "- Question 3 called \"every key token held in every layer\" sufficient: every run that held it is one "
    "policy (StreamingLLM) with the key inside its recent window, mostly at depth 90 %. The answer now names "
    "those runs and withdraws the general claim.",
    "- Per KV head against per layer: the accuracy collapse for TOVA and SnapKV is now marked as unexplained "
    "by this grid.",
    "- Question 1's \"wrong where both are right: 0\" compares TOVA with two policies at the floor here; the "
    "pass key is read once, so the question does not test the TOVA card's warning (as the answer said).",
)
ANSWERS = ("<!-- needle:answers -->", "<!-- /needle:answers -->")


KEEP = ("pool_kernel", "sinks")  # the parameters the report tells apart, named even at their default


def short(row) -> str:
    """The row's configuration label (config_label) from the parameters in KEEP only: the
    report compares policies and SnapKV's kernels, whatever else a grid varied."""
    kept = {k: v for k, v in row["params"].items() if k in KEEP}
    return config_label(row["policy"], kept, keep=KEEP)


PK5, PK1 = (config_label("snapkv", {"pool_kernel": k}, keep=KEEP) for k in (5, 1))


def prepare(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["name"] = [short(r) for _, r in df.iterrows()]
    df["L"] = df["held_end_by_layer"].map(len)
    df["whole"] = df["layers_whole"] == df["L"]
    df["prompt"] = df["length"].astype(str) + "/" + df["depth"].astype(str) + "/" + df["seed"].astype(str)
    return df


def pct(x) -> str:
    return "–" if pd.isna(x) else f"{100 * x:.0f} %"


def acc_ci(correct) -> str:
    """Accuracy with its Wilson 95 % interval: "68 % [48–83]" (kvviz.core.metrics.wilson)."""
    c = pd.Series(correct).astype(bool)
    if not len(c):
        return "–"
    lo, hi = wilson(int(c.sum()), len(c))
    return f"{pct(c.mean())} [{100 * lo:.0f}–{100 * hi:.0f}]"


def outcome(answer: str, key: str) -> str:
    """How an answer fails or not: "right" (the key appears), "truncated" (its first number is
    a proper beginning of the key, e.g. "424" for 42400), "other number", "no number"."""
    answer = str(answer)
    if key in answer:
        return "right"
    m = re.search(r"\d+", answer)
    if not m:
        return "no number"
    return "truncated" if key.startswith(m.group(0)) else "other number"


def table(df: pd.DataFrame) -> str:
    """Accuracy per policy (rows) at each prompt mode x budget, layer granularity, all lengths."""
    d = df[df.granularity == "layer"]
    cols = sorted({(m, b) for m, b in zip(d.prompt_mode, d.budget) if b > 0}, key=lambda x: (x[0] != "decode", x[1]))
    names = [FULL_LABEL] + sorted(set(d.name) - {FULL_LABEL})
    head = "| policy | " + " | ".join(f"{m} {b}" for m, b in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    full = d[d.policy == "full"]
    lines.append("| full cache | " + " | ".join(
        pct(full[full.prompt_mode == m].correct.mean()) for m, _ in cols) + " |")
    for n in names[1:]:
        cells = []
        for m, b in cols:
            x = d[(d.name == n) & (d.prompt_mode == m) & (d.budget == b)]
            cells.append(f"{acc_ci(x.correct)} ({x.held_end.mean():.2f})" if len(x) else "–")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    runs = {m: d[(d.prompt_mode == m) & (d.policy == "full")].id.nunique() for m in ("decode", "prefill")}
    keys = {m: d[(d.prompt_mode == m) & (d.policy == "full")].key.nunique() for m in ("decode", "prefill")}
    cell_n = d[d.policy != "full"].groupby(["name", "prompt_mode", "budget"]).key.nunique()
    lines.append("")
    lines.append(f"Share of prompts answered with the key, with its Wilson 95 % interval in square brackets "
                 f"(in round brackets: share of the key's positions held at the end of the prompt, mean over "
                 f"layers); {runs['decode']} decode prompts ({keys['decode']} distinct keys) and "
                 f"{runs['prefill']} prefill prompts ({keys['prefill']} distinct keys) at layer granularity, "
                 f"lengths {sorted(d.length.unique().tolist())}; distinct keys per evicting cell: "
                 f"{_span(cell_n)}.")
    return "\n".join(lines)


def _span(values) -> str:
    """"3" or "3–5": the least and the most of `values`."""
    lo, hi = (int(values.min()), int(values.max())) if len(values) else (0, 0)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def outcomes(df: pd.DataFrame) -> str:
    """Per policy (layer granularity, every mode and budget): how its answers fail."""
    d = df[(df.granularity == "layer") & (df.policy != "full")].copy()
    if d.empty:
        return "(no runs)"
    d["outcome"] = [outcome(a, str(k)) for a, k in zip(d.answer, d.key)]
    kinds = ["right", "truncated", "other number", "no number"]
    t = (d.groupby(["name", "outcome"]).size().unstack(fill_value=0)
         .reindex(columns=kinds, fill_value=0).reset_index())
    t.insert(1, "runs", t[kinds].sum(axis=1))
    return fmt(t)


def paired(df, a: str, b: str, keys=("prompt_mode", "budget")):
    """Per prompt mode x budget: accuracy, held_end and 'whole' of a and b on the same prompts,
    and how often a is wrong where b is right (and the reverse)."""
    out = []
    d = df[df.granularity == "layer"]
    for (m, bud), g in d[d.name.isin([a, b])].groupby(list(keys)):
        x = g[g.name == a].set_index("id")
        y = g[g.name == b].set_index("id")
        common = x.index.intersection(y.index)
        if not len(common):
            continue
        x, y = x.loc[common], y.loc[common]
        out.append({"mode": m, "budget": bud, "n": len(common),
                    f"acc {a}": x.correct.mean(), f"acc {b}": y.correct.mean(),
                    f"held {a}": x.held_end.mean(), f"held {b}": y.held_end.mean(),
                    f"whole {a}": x.whole.mean(), f"whole {b}": y.whole.mean(),
                    f"{a} wrong, {b} right": int((~x.correct & y.correct).sum()),
                    f"{a} right, {b} wrong": int((x.correct & ~y.correct).sum())})
    return pd.DataFrame(out)


def fmt(df: pd.DataFrame) -> str:
    if df.empty:
        return "(no runs)"
    return df.to_markdown(index=False, floatfmt=".2f") if _has_tabulate() else "```text\n" + df.to_string(
        index=False, float_format=lambda v: f"{v:.2f}") + "\n```"


def _has_tabulate() -> bool:
    import importlib.util

    return importlib.util.find_spec("tabulate") is not None


def q1(df) -> str:
    parts = []
    verdicts = []
    for other in ("h2o", "scissorhands"):
        t = paired(df, "tova", other)
        parts.append(f"TOVA against {other}:\n\n" + fmt(t))
        if not t.empty:
            lose = int(t[f"tova wrong, {other} right"].sum())
            win = int(t[f"tova right, {other} wrong"].sum())
            held_less = int((t["held tova"] < t[f"held {other}"]).sum())
            verdicts.append(f"against {other}, TOVA is wrong where {other} is right on {lose} prompts and "
                            f"right where it is wrong on {win}; TOVA holds less of the key in {held_less} of "
                            f"{len(t)} mode x budget cells")
    if not verdicts:
        return "No TOVA / H2O / Scissorhands runs in this grid."
    both = paired3(df)
    return ("\n\n".join(parts) + "\n\n**Answer:** " + "; ".join(verdicts) + ". " + both)


def paired3(df) -> str:
    d = df[(df.granularity == "layer") & df.name.isin(["tova", "h2o", "scissorhands"])]
    piv = d.pivot_table(index=["id", "budget"], columns="name", values="correct", aggfunc="first").dropna()
    if piv.empty or not {"tova", "h2o", "scissorhands"} <= set(piv.columns):
        return ""
    piv = piv.astype(bool)
    card = int((~piv.tova & piv.h2o & piv.scissorhands).sum())
    rev = int((piv.tova & ~piv.h2o & ~piv.scissorhands).sum())
    verdict = ("This grid shows the card's warning" if card > rev else
               "This grid does not show the card's warning; a pass key is read once and not returned "
               "to, so it is not the intermittent token the warning is about")
    return (f"Runs where TOVA loses the key while H2O and Scissorhands both keep it (answer right): {card} of "
            f"{len(piv)}; the reverse: {rev}. {verdict}.")


def q2(df) -> str:
    t = paired(df, PK5, PK1)
    if t.empty:
        return "No SnapKV poolKernel 5 / 1 pairs in this grid."
    whole5, whole1 = (df[df.name == n].whole.mean() for n in (PK5, PK1))
    acc5, acc1 = (df[df.name == n].correct.mean() for n in (PK5, PK1))
    more = "more" if whole5 > whole1 else "not more"
    turns = "and it is right more often" if acc5 > acc1 else "but that does not make it right more often"
    return (fmt(t) + f"\n\n**Answer:** over all runs, poolKernel 5 keeps the key whole in every layer in "
            f"{pct(whole5)} of runs, poolKernel 1 in {pct(whole1)} ({more} often), {turns} "
            f"(accuracy {pct(acc5)} against {pct(acc1)}).")


def q3(df) -> str:
    d = df[(df.policy != "full") & (df.granularity == "layer")]
    if d.empty:
        return "No evicting runs."
    c, w = d.correct.astype(bool), d.whole
    n = {"right, whole": int((c & w).sum()), "right, not whole": int((c & ~w).sum()),
         "wrong, whole": int((~c & w).sum()), "wrong, not whole": int((~c & ~w).sum())}
    necessary = n["right, not whole"] == 0
    sufficient = n["wrong, whole"] == 0
    verdict = {(True, True): "necessary and sufficient", (True, False): "necessary, not sufficient",
               (False, True): "sufficient, not necessary", (False, False): "neither necessary nor sufficient"}
    L = int(d.L.max())
    held = pd.DataFrame(d.held_end_by_layer.tolist(), index=d.index).iloc[:, :L]
    corr = held.apply(lambda col: col.corr(c.astype(float)) if col.std() > 0 else float("nan"))
    top = corr.dropna().sort_values(ascending=False).head(5)
    whole_l = held.eq(1.0)
    lines = [f"- layer {int(layer)}: r = {r:.2f}; accuracy {pct(c[whole_l[layer]].mean())} when it holds "
             f"the whole key, {pct(c[~whole_l[layer]].mean())} when not" for layer, r in top.items()]
    whole = d[w]
    who = ", ".join(f"{k} {v}" for k, v in whole.name.value_counts().items())
    where = ", ".join(f"{x:g} % {v}" for x, v in whole.depth.value_counts().sort_index().items())
    one_family = whole.policy.nunique() == 1
    confounded = one_family and len(whole) > 0
    scope = (f" The {len(whole)} runs that held it whole are {who} (depth {where})"
             + (": one policy, whose recent window covers a key near the end of the prompt, so those runs say "
                "what that window keeps, not whether holding the key is enough." if confounded else ".")
             if len(whole) else "")
    said = (f"is not necessary for a correct answer in this grid ({n['right, not whole']} runs were right "
            "without it); whether it is sufficient, this grid cannot say" if confounded and not necessary
            else f"is {verdict[(necessary, sufficient)]} for a correct answer in this grid")
    return (f"Over {len(d)} evicting runs (layer granularity): " + ", ".join(f"{k} {v}" for k, v in n.items())
            + f". **Answer:** \"every key token held in every layer\" {said}.{scope}\n\n"
            "Layers whose held share at the end of the prompt goes most with a "
            f"right answer (Pearson r over the {len(d)} runs; they come from {d.id.nunique()} prompts, each "
            f"under every configuration, so the runs are not independent samples and r has no simple "
            f"confidence interval):\n\n" + "\n".join(lines))


def q4(df) -> str:
    d = df[(df.policy != "full") & (df.granularity == "layer")]
    rows = []
    for (n, b), g in d.groupby(["name", "budget"]):
        x = g[g.prompt_mode == "decode"].set_index("prompt")
        y = g[g.prompt_mode == "prefill"].set_index("prompt")
        common = x.index.intersection(y.index)
        if not len(common):
            continue
        x, y = x.loc[common], y.loc[common]
        rows.append({"policy": n, "budget": b, "n": len(common), "acc decode": x.correct.mean(),
                     "acc prefill": y.correct.mean(), "held decode": x.held_end.mean(),
                     "held prefill": y.held_end.mean(),
                     "same verdict": (x.correct.values == y.correct.values).mean()})
    if not rows:
        return "No prompts ran in both modes."
    t = pd.DataFrame(rows)
    gap = (t["acc prefill"] - t["acc decode"])
    return (fmt(t) + f"\n\n**Answer:** on the same prompts, prefill eviction is right more often than decode-time "
            f"eviction in {int((gap > 0).sum())} of {len(t)} policy x budget pairs, less often in "
            f"{int((gap < 0).sum())}; the mean accuracy gap (prefill − decode) is "
            f"{round(100 * gap.mean(), 1) + 0.0:+.1f} points, "
            f"the held share gap {(t['held prefill'] - t['held decode']).mean():+.2f}.")


def spearman(a: pd.Series, b: pd.Series) -> float:
    """Rank correlation, ties averaged (pandas' own method="spearman" needs scipy)."""
    return a.rank().corr(b.rank())


def q5(df, out: Path) -> str:
    path = out / "predictors.json"
    if not path.is_file():
        return "Not computed: run this script with --predictors (it runs the loop once)."
    pred = pd.DataFrame(json.loads(path.read_text())["configs"]).set_index("label")
    lines = [f"Loop and replay on prompt {json.loads(path.read_text())['id']} (the same haystack), "
             f"against accuracy over the grid's runs of each configuration:"]
    rows = []
    for mode in ("decode", "prefill"):
        d = df[(df.prompt_mode == mode) & (df.granularity == "layer") & df.label.isin(pred.index)
               & (df.policy != "full")]
        acc = d.groupby("label").correct.mean()
        if len(acc) < 3:
            continue
        j = pred.join(acc.rename("accuracy"), how="inner")
        rows.append({"accuracy in": mode, "configs": len(j),
                     "rho retained mass": spearman(j.retained_mass, j.accuracy),
                     "rho -perplexity": spearman(-j.perplexity, j.accuracy),
                     "rho top-1 agreement": spearman(j.top1_agreement, j.accuracy)})
    if not rows:
        return "Too few configurations in common with predictors.json."
    t = pd.DataFrame(rows)
    n = int(t.configs.min())
    crit = spearman_critical(n)
    cols = [c for c in t.columns if c.startswith("rho ")]
    strongest = max(((r["accuracy in"], c, r[c]) for r in t.to_dict("records") for c in cols),
                    key=lambda x: abs(x[2]))
    ranked = pred.drop(index="full", errors="ignore")
    best_ppl = ranked.perplexity.idxmin()
    acc_all = df[(df.granularity == "layer") & (df.label == best_ppl)].correct.mean()
    signif = [f"{c.replace('rho ', '')} ({r['accuracy in']})" for r in t.to_dict("records") for c in cols
              if abs(r[c]) >= crit]
    return ("\n".join(lines) + "\n\n" + fmt(t) + "\n\n**Answer:** Spearman rank correlation across "
            f"{n} configurations on one prompt; with {n} configurations a |rho| below {crit:.2f} is not significant "
            "at the 5 % level (exact, two-sided, over every ordering). "
            + (f"At that level: {', '.join(signif)}. " if signif else "None reaches it. ")
            + f"The largest in size is {strongest[1].replace('rho ', '')} against {strongest[0]} accuracy, "
            f"rho = {strongest[2]:+.2f}"
            + (": its sign is the reverse of a predictor's (the configurations the loop scores better are right "
               f"less often; {best_ppl} has the best perplexity and answers {pct(acc_all)} of its runs)."
               if strongest[2] < 0 else ".")
            + " None of the three predicts the pass key's accuracy in this grid.")


def spearman_critical(n: int, alpha: float = 0.05) -> float:
    """The least |rho| whose exact two-sided permutation p (every ordering of n untied ranks
    equally likely) is at most alpha; inf when no |rho| is (n < 4)."""
    import itertools

    base = np.arange(n)
    rhos = np.array([1 - 6 * float(((base - np.array(p)) ** 2).sum()) / (n * (n * n - 1))
                     for p in itertools.permutations(range(n))])
    for r in np.unique(np.round(np.abs(rhos), 12)):
        if (np.abs(rhos) >= r - 1e-12).mean() <= alpha:
            return float(r)
    return float("inf")


def predictors(out: Path, df: pd.DataFrame) -> None:
    """Run the loop once on the first decode prompt's text with its configs; save DIR/predictors.json."""
    import torch

    torch.set_num_threads(1)
    from kvviz.core.metrics import evaluate
    from kvviz.model.loop import LoopConfig, run_loop

    d = df[df.prompt_mode == "decode"].sort_values(["length", "depth", "seed"])
    id_ = d.id.iloc[0]
    run = load_run(out, id_)
    text = "".join(str(t) for t in run["tokens"])
    configs = [LoopConfig(c["policy"], c["params"], c["budget"]) for c in run["meta"]["configs"]]
    res = run_loop(text, configs, granularity="layer", max_tokens=len(run["tokens"]))
    f = next(i for i, c in enumerate(configs) if c.is_full)
    rows = []
    for cfg, r in zip(configs, res.results):
        mass = None
        if not cfg.is_full:
            mass = float(sum(evaluate(res.trace(f, layer), cfg.policy, cfg.budget, **cfg.params)["retained_mass"]
                             for layer in res.rows_layers) / len(res.rows_layers))
        rows.append({"label": cfg.label, "perplexity": r["perplexity"], "top1_agreement": r["top1_agreement"],
                     "retained_mass": mass})
    (out / "predictors.json").write_text(json.dumps({"id": id_, "layers": res.rows_layers, "configs": rows}, indent=1))


def gated(out: Path, task: str = "passkey") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the task's rows at the lengths the full cache answers (kvviz.model.needle.results.gate),
    the full cache's accuracy per length with `kept`)."""
    raw = load_results(out)
    raw = raw[raw.task == task]
    if raw.empty:
        raise ValueError(f"no {task} runs in {out}")
    return gate(raw)


def gate_section(acc: pd.DataFrame) -> str:
    left = acc[~acc.kept]
    lines = [f"A length stays in this report when the full cache answers at least {GATE:.0%} of its prompts:", ""]
    lines += [f"- {int(r.length)} tokens: full cache {pct(r.full_accuracy)} of {int(r.prompts)} prompts, "
              + ("kept" if r.kept else "left out") for r in acc.itertuples()]
    if len(left):
        lines += ["", f"Left out of every table and answer below: {', '.join(str(int(n)) for n in left.length)} "
                  "tokens (the model cannot do the task there with nothing evicted)."]
    return "\n".join(lines)


def report(out: Path, task: str = "passkey") -> tuple[str, str]:
    kept, acc = gated(out, task)
    if kept.empty:
        raise ValueError(f"the full cache answers under {GATE:.0%} of the {task} prompts at every length in {out}")
    df = prepare(kept)
    tab = table(df)
    lengths = sorted(df.length.unique().tolist())
    n_runs = df.id.nunique()
    cfg_n = df.groupby("id").size()
    doc = [
        "# The pass-key test under eviction",
        "",
        "Generated by `python -m lab.needle_report` from `traces/needle/results.csv`; every number below is "
        "computed from that file (and, for question 5, `traces/needle/predictors.json`). Rerun the script after "
        "the grid to refresh it. The grid: [model.md](../model.md#the-pass-key-test); how long it took: "
        "[benchmarks.md](../benchmarks.md#the-pass-key-test).",
        "",
        f"What ran: {n_runs} prompts ({', '.join(map(str, lengths))} tokens; depths "
        f"{sorted(df.depth.unique().tolist())} %; seeds {sorted(df.seed.unique().tolist())}; prompt modes "
        f"{sorted(df.prompt_mode.unique().tolist())}; granularities {sorted(df.granularity.unique().tolist())}), "
        f"{int(cfg_n.min())}–{int(cfg_n.max())} configurations each, {len(df)} rows. Model: "
        f"{load_run(out, df.id.iloc[0])['meta']['model'].get('model', '?')}.",
        "",
        ("A run is right when the key's five digits appear in its greedy answer" if task != "phrase" else
         "A run is right when the whole phrase appears in its greedy answer")
        + f" (task: {task}). *Held at the end* is the share of "
        "the key's token positions (both mentions) still in the cache after the prompt's last step, mean over "
        "layers (and KV heads); *whole* means every key position held in every layer.",
        "",
        "## The full cache's accuracy, per length",
        "",
        gate_section(acc),
        "",
        "## Accuracy by policy, prompt mode and budget",
        "",
        tab,
        "",
        "## By depth and length (accuracy of evicting runs, layer granularity)",
        "",
        fmt(df[(df.policy != "full") & (df.granularity == "layer")].pivot_table(
            index="depth", columns=["prompt_mode", "length"], values="correct", aggfunc="mean").reset_index()),
        "",
        "## 1. Does TOVA lose the pass key where H2O and Scissorhands keep it?",
        "",
        q1(df),
        "",
        "## 2. Does SnapKV's pooling keep the key whole more often than poolKernel 1?",
        "",
        q2(df),
        "",
        "## 3. Is every key token in every layer necessary, sufficient, or neither?",
        "",
        q3(df),
        "",
        "## 4. Decode-time against prefill eviction, policy by policy",
        "",
        q4(df),
        "",
        "## 5. Do the replay's retained mass or the loop's perplexity predict accuracy?",
        "",
        q5(df, out),
        "",
    ]
    doc[2:2] = ["## Corrections (2026-12-05)", "", *CORRECTIONS, ""]
    doc[-1:-1] = ["## How the answers fail (layer granularity, every mode and budget)", "",
                  "A *truncated* answer's first number is a proper beginning of the key (\"424\" for 42400): the "
                  "model recalled the key's start and stopped. *Other number*: a number that does not begin the key.",
                  "", outcomes(df), ""]
    if (df.granularity == "kv-head").any():
        doc[-1:-1] = ["## Per KV head against per layer, on the same prompts", "", per_head_table(df), "",
                      per_head_note(df), ""]
    if task != "passkey":
        doc[-1:-1] = [f"## The {task} task's answer check", "", TASK_NOTE[task], "", task_outcomes(df), ""]
    return tab, "\n".join(doc)


TASK_NOTE = {
    "recall": "The key is said once; reminders (\"Keep the pass key in mind.\") follow every K sentences. "
              "*right* / *wrong*: the key's digits in the answer or not.",
    "distractors": "Other people's keys stand in the haystack too. *right*: the asked key is the first key in the "
                   "answer; *distractor*: another person's key is; *no key*: none of them. *distractors held*: "
                   "share of the distractors' key tokens held at the end of the prompt.",
    "phrase": "*whole*: the phrase's words in the answer, consecutive and in order; *partial*: some of them in "
              "order; *lost*: none. *Held at the end* is the share of the phrase's token positions held; "
              "*whole span* the share of runs holding every one in every layer.",
}


def task_outcomes(df: pd.DataFrame) -> str:
    t = task_outcome_table(df)
    return "(no runs at layer granularity)" if t.empty else fmt(t)


def task_outcome_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per policy, budget and prompt mode (layer granularity): the task's outcomes counted,
    the share of the answer's positions held at the end and of runs holding them whole."""
    d = df[df.granularity == "layer"]
    if d.empty:
        return pd.DataFrame()
    kinds = [k for k in ("right", "wrong", "distractor", "no key", "whole", "partial", "lost") if k in set(d.outcome)]
    t = (d.groupby(["name", "budget", "prompt_mode"]).outcome.value_counts().unstack(fill_value=0)
         .reindex(columns=kinds, fill_value=0))
    g = d.groupby(["name", "budget", "prompt_mode"])
    t["held at the end"] = g.held_end.mean()
    t["whole span"] = g.whole.mean()
    if (d.distractors_held_end >= 0).any():
        t["distractors held"] = g.distractors_held_end.mean()
    return t.reset_index()


def per_head(df: pd.DataFrame) -> pd.DataFrame:
    """Each configuration run at kv-head granularity beside the same configuration at layer
    granularity on the same prompts (length, depth, seed, mode)."""
    rows = []
    d = df[df.policy != "full"]
    for (n, b, m), kv in d[d.granularity == "kv-head"].groupby(["name", "budget", "prompt_mode"]):
        lay = d[(d.granularity == "layer") & (d.name == n) & (d.budget == b) & (d.prompt_mode == m)]
        x, y = kv.set_index("prompt"), lay.set_index("prompt")
        common = x.index.intersection(y.index)
        if not len(common):
            continue
        x, y = x.loc[common], y.loc[common]
        rows.append({"policy": n, "budget": b, "mode": m, "n": len(common),
                     "kv-head": acc_ci(x.correct), "layer": acc_ci(y.correct),
                     "held kv-head": x.held_end.mean(), "held layer": y.held_end.mean(),
                     "_kv": float(x.correct.mean()), "_layer": float(y.correct.mean())})
    return pd.DataFrame(rows)


def per_head_note(df: pd.DataFrame) -> str:
    """What the per-KV-head table does not explain: the largest accuracy drops beside how little
    the held share moves."""
    t = per_head(df)
    if t.empty:
        return ""
    drops = [(r["_layer"] - r["_kv"], r, r["_kv"], r["_layer"]) for r in t.to_dict("records")]
    big = [x for x in sorted(drops, key=lambda x: -x[0]) if x[0] >= 0.3]
    if not big:
        return ""
    said = "; ".join(f"{r['policy']} @ {r['budget']} falls from {pct(lay)} to {pct(kv)} while its held share "
                     f"moves from {r['held layer']:.2f} to {r['held kv-head']:.2f}" for _, r, kv, lay in big)
    return (f"**Unexplained:** {said}. This grid does not say why: it records how much of the key each "
            "configuration holds, not which KV heads lose it or how much of the question's attention those "
            "heads carry, so the collapse is reported, not explained.")


def per_head_table(df: pd.DataFrame) -> str:
    t = per_head(df)
    return "(no prompts at both granularities)" if t.empty else fmt(t.drop(columns=["_kv", "_layer"]))


def answers(df: pd.DataFrame, out: Path) -> str:
    """The grid's answers in a few numbered lines, every number computed here."""
    d = df[df.granularity == "layer"]
    ev = d[d.policy != "full"]
    keys = df.key.nunique()
    lines = [f"What the grid answers (the detail, and the tables behind each answer, in "
             f"[studies/needle.md](studies/needle.md); not tuned, one model, {df.id.nunique()} prompts, "
             f"{keys} distinct keys; accuracies with Wilson 95 % intervals):", ""]
    piv = trio_table(ev, ["id", "budget"], column="name", value="correct")
    if piv is not None:
        card, rev = int(piv.claim.sum()), int(piv.reverse.sum())
        h2o = ev[ev.name == "h2o"]
        lines.append(f"1. **TOVA against H2O and Scissorhands.** Over {len(piv)} paired runs, TOVA is wrong "
                     f"where both are right in {card} and right where both are wrong in {rev}. H2O answers "
                     f"{acc_ci(h2o.correct)} over all its runs at layer granularity, TOVA "
                     f"{acc_ci(ev[ev.name == 'tova'].correct)}. "
                     "The pass key is read once and never returned to, so this does not test the TOVA "
                     "card's warning about a token that matters intermittently.")
    if {PK5, PK1} <= set(ev.name):
        x5, x1 = ev[ev.name == PK5], ev[ev.name == PK1]
        p5, p1 = (x[(x.prompt_mode == "prefill") & (x.budget == 128)] for x in (x5, x1))
        lines.append(f"2. **SnapKV's pooling** keeps the key whole in every layer in {pct(x5.whole.mean())} of "
                     f"runs with poolKernel 5 and {pct(x1.whole.mean())} with poolKernel 1; it answers "
                     f"{acc_ci(x5.correct)} against {acc_ci(x1.correct)} over all runs at layer granularity"
                     + (f", {acc_ci(p5.correct)} against {acc_ci(p1.correct)} at prefill budget 128"
                        if len(p5) and len(p1) else "") + ".")
    c, w = ev.correct.astype(bool), ev.whole
    whole = ev[w]
    lines.append(f"3. **Every key token held in every layer**: of {len(ev)} evicting runs, "
                 f"{int((c & ~w).sum())} were right without it and {int((~c & w).sum())} wrong with it"
                 + (f"; the {len(whole)} runs that held it are all {whole.policy.iloc[0]} (its recent window), so "
                    "this is no evidence that holding the key is sufficient." if len(whole) and
                    whole.policy.nunique() == 1 else "."))
    pairs = same = both_wrong = 0
    for _, g in ev.groupby(["name", "budget"]):
        x = g[g.prompt_mode == "decode"].set_index("prompt")
        y = g[g.prompt_mode == "prefill"].set_index("prompt")
        common = x.index.intersection(y.index)
        pairs += len(common)
        a, b = x.loc[common].correct.values.astype(bool), y.loc[common].correct.values.astype(bool)
        same += int((a == b).sum())
        both_wrong += int((~a & ~b).sum())
    if pairs:
        either = pairs - both_wrong
        lines.append(f"4. **Decode-time and prefill eviction** give the same verdict on {same} of {pairs} "
                     f"paired runs; {both_wrong} of those are both wrong, and where at least one mode was right "
                     f"they agree in {same - both_wrong} of {either}.")
    t = per_head(df)
    if not t.empty:
        parts = [f"{r['policy']} @ {r['budget']} ({r['mode']}, {r['n']} prompts) {r['kv-head']} per KV head "
                 f"against {r['layer']} per layer" for _, r in t.iterrows() if r["policy"] in ("tova", PK5, "h2o")]
        if parts:
            lines.append("5. **Per KV head** (each KV head keeps its own budget's positions): "
                         + "; ".join(parts) + ". Why accuracy collapses per KV head is not explained by this grid.")
    kinds = [outcome(a, str(k)) for a, k in zip(ev.answer, ev.key)]
    wrong = [k for k in kinds if k != "right"]
    if wrong:
        lines.append(f"6. **How answers fail**: of {len(wrong)} wrong evicting answers, "
                     f"{sum(k == 'truncated' for k in wrong)} are truncations of the key (its first digits, "
                     f"then nothing), {sum(k == 'other number' for k in wrong)} another number, "
                     f"{sum(k == 'no number' for k in wrong)} no number.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.needle_report", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", default=str(traces_or_default() / "needle"))
    p.add_argument("--predictors", action="store_true",
                   help="run the loop for question 5 first and rewrite DIR/predictors.json (needs --write)")
    p.add_argument("--write", action="store_true",
                   help="rewrite docs/studies/needle.md and the marked table in docs/benchmarks.md")
    p.add_argument("--task", default="passkey", help="the task whose runs to report (kvviz needle --task)")
    args = p.parse_args(argv)
    if args.predictors and not args.write:
        p.error("--predictors rewrites DIR/predictors.json: give --write with it")
    out = Path(args.dir)
    try:
        df, _ = gated(out, args.task)
        if args.predictors:
            predictors(out, df)
        tab, doc = report(out, args.task)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(doc)
    if args.write:
        (REPO / STUDIES / "needle.md").write_text(doc)
        bench = REPO / "docs" / "benchmarks.md"
        text = bench.read_text()
        if MARK[0] not in text:
            print(f"error: {bench} has no {MARK[0]} ... {MARK[1]} block to rewrite", file=sys.stderr)
            return 2
        text = re.sub(re.escape(MARK[0]) + ".*?" + re.escape(MARK[1]),
                      lambda _: f"{MARK[0]}\n{tab}\n{MARK[1]}", text, flags=re.S)
        said = answers(prepare(df), out)
        if ANSWERS[0] in text:
            text = re.sub(re.escape(ANSWERS[0]) + ".*?" + re.escape(ANSWERS[1]),
                          lambda _: f"{ANSWERS[0]}\n{said}\n{ANSWERS[1]}", text, flags=re.S)
        bench.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
