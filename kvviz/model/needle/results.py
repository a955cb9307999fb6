"""What `kvviz needle` writes and the Forgetting view reads. No torch here.

Schema (DIR is the --out folder, e.g. traces/needle/):

DIR/runs/<id>.npz, one per prompt, id `L<length>-d<depth>-s<seed>-<prompt_mode>-<granularity>`
(e.g. `L512-d50-s0-decode-layer`; a task other than the pass key prefixes its name and option,
`recall20-L512-...`, `distractors2-...`, `phrase4-...`; a grid over --haystacks then the
haystack's name, `returns3-htry-L256-...`), written by np.savez_compressed to a
temp file and renamed:
  - `meta`: 0-d str, JSON: id, length, depth, seed, prompt_mode, granularity, key (digits),
    key_positions (prompt token indices of the key's digits, both mentions), question_start
    (index of the question's first token), prompt_len (T0), max_new_tokens, haystack,
    model (provenance dict), kvviz_version, configs [{policy, params, budget, source, bytes_per_slot, label}]
    (LoopConfig.record: source is where the policy came from, {origin, where, sha256}) with
    index 0 = full, answers [str], correct [bool], agreement [float], layers L, kv_heads G;
    the task (kvviz.model.needle.tasks; absent: the pass key): task, reminder_every,
    distractors, phrase_words, returns, hops (its option, None for the others),
    neighbour_positions (the phrase task's neighbours), reminders ([start, end)
    token spans), target, distractor_names, distractor_keys, distractor_positions (token
    indices of each distractor's key). `key` is the task's answer (the phrase for `phrase`)
    and key_positions its tokens.
  - `prompt_ids` int64 (T0,); `tokens` str (T0,) display strings of the prompt's tokens.
  - `new_ids` int64 (C, N): generated ids, -1 after a config stopped.
  - `evicted_at` int32 (C, L, G, T0+N): the step at which each position was evicted, -1 never.
    G = 1 at granularity "layer", the model's KV heads at "kv-head". Prefill mode's one-shot
    eviction is step T0-1.

Held, from evicted_at (e = evicted_at[c, l, g, p]):
  - at the question: e == -1 or e >= question_start (token question_start is read with the
    cache left after step question_start - 1);
  - at the end of the prompt: e == -1 or e > T0 - 1 (what generation starts from).

DIR/results.csv and DIR/results.json (records): one row per (run, config), runs in id order,
configs in run order (full first), with the columns COLUMNS:
  id, length, depth, seed, prompt_mode, granularity, policy, label, params (JSON), budget,
  key, answer, correct, agreement (top-1 agreement of the generated tokens with full),
  held_question (share of the key's positions held at the question, mean over layers x
  heads), held_end (the same at the end of the prompt), layers_whole (layers holding every
  key position in every head at the end of the prompt), first_lost (earliest step any key
  position was evicted in any layer, -1 never), held_by_layer (JSON list, at the question),
  held_end_by_layer (JSON list), first_lost_by_layer (JSON list, -1 never),
  held_by_head (JSON L x G list, at the question); the task's: task, reminder_every,
  distractors, phrase_words (-1 where the task has no such option), outcome (the task's
  answer check: right / wrong; right / distractor / no key; whole / partial / lost), detail
  (the distractor's name; the phrase's words found, in order), target, key_positions (JSON),
  reminders (count), reminder_positions (JSON, each reminder's first token), distractor_keys,
  distractor_positions (JSON), distractors_held_end (share of the distractors' key tokens
  held at the end of the prompt, -1 without distractors); the study design's: haystack (the
  haystack's name: a --haystacks file's stem, "filler", or the --haystack file's name),
  returns and hops (the returns and vartrack tasks' options, -1 for the others), quiet
  (tokens from the end of the last reminder or return to the question, -1 without any),
  seconds (the generate batch's seconds, shared by the batch_prompts prompts read together:
  a prompt's cost is seconds / batch_prompts), neighbours_held_end (the phrase task: the
  share of the NEIGHBOURS tokens each side of the phrase held at the end of the prompt, -1
  for the others), full_cache_correct (the full cache's verdict on the same prompt, empty
  without a full-cache row). A results.csv from before the tasks loads with task "passkey".

gate(df): the rows at the (task, option, length) cells where the full cache answers >= 80 % of the
prompts, and the full cache's accuracy per cell; a study keeps only those.

Loaders: list_runs(dir), load_run(dir, id) -> NeedleRun (a dict: meta parsed, arrays; its
to_frame() is the long table of every position), load_results(dir) -> pandas.DataFrame
(results.csv, JSON columns parsed to lists/dicts).

The per-layer and per-head values as a long table instead of JSON cells: layer_table(dir),
one row per (run, config, layer, head), the run's task and its option (reminder_every,
distractors, phrase_words) beside held_question, held_end and first_lost, and the outcome:
the config's answer, correct (the task's check), outcome, and full_cache_correct (the full
cache's verdict on the same prompt). It is typed (LAYER_TYPES) and its one null is <NA>:
the full cache's budget, a key never lost, a task without that option, a run without a
full-cache row. It is what `kvviz export DIR` writes; results.csv keeps its -1 markers and
JSON columns for the readers above.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from kvviz.core.atomic import replacing

NEVER = -1
ARRAYS = ("prompt_ids", "tokens", "new_ids", "evicted_at")
COLUMNS = ("id", "length", "depth", "seed", "prompt_mode", "granularity", "policy", "label",
           "params", "budget", "key", "answer", "correct", "agreement", "held_question",
           "held_end", "layers_whole", "first_lost", "held_by_layer", "held_end_by_layer",
           "first_lost_by_layer", "held_by_head",
           # the task's columns (kvviz.model.needle.tasks); a pass-key run has -1 / "" / [] there
           "task", "reminder_every", "distractors", "phrase_words", "outcome", "detail", "target",
           "key_positions", "reminders", "reminder_positions", "distractor_keys", "distractor_positions",
           "distractors_held_end",
           # the study design's: the haystack's name, the returns and variable-tracking tasks' options,
           # the quiet stretch (tokens from the end of the last return to the question, -1 none), the
           # run's seconds (its generate batch's, shared by the prompts read together) and batch size
           "haystack", "returns", "hops", "quiet", "seconds", "batch_prompts", "neighbours_held_end",
           "full_cache_correct")
JSON_COLUMNS = ("params", "held_by_layer", "held_end_by_layer", "first_lost_by_layer", "held_by_head",
                "key_positions", "reminder_positions", "distractor_keys", "distractor_positions")
TASK_DEFAULTS = {"task": "passkey", "reminder_every": -1, "distractors": -1, "phrase_words": -1,
                 "returns": -1, "hops": -1,
                 "target": "", "reminders": [], "distractor_names": [], "distractor_keys": [],
                 "distractor_positions": []}


def depth_label(depth) -> str:
    return f"{float(depth):g}"


def run_id(length: int, depth, seed: int, prompt_mode: str, granularity: str) -> str:
    return f"L{int(length)}-d{depth_label(depth)}-s{int(seed)}-{prompt_mode}-{granularity}"


def run_path(out, id_: str) -> Path:
    return Path(out) / "runs" / f"{id_}.npz"


def save_run(out, meta: dict, prompt_ids, tokens, new_ids, evicted_at) -> Path:
    """One prompt's file, whole or not at all (a killed grid leaves no half file)."""
    path = run_path(out, meta["id"])
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.str_(json.dumps(meta)),
                        prompt_ids=np.asarray(prompt_ids, np.int64),
                        tokens=np.asarray(list(tokens), dtype=str),
                        new_ids=np.asarray(new_ids, np.int64),
                        evicted_at=np.asarray(evicted_at).astype(np.int32))
    with replacing(path) as fh:
        fh.write(buf.getvalue())
    return path


class NeedleRun(dict):
    """One prompt's run as load_run reads it: {"meta", "prompt_ids", "tokens", "new_ids",
    "evicted_at"}, with the long table of its eviction logs."""

    def to_frame(self, per: str = "position", configs=None, layers=None, heads=None):
        """A long pandas DataFrame (kvviz.core.frame), one row per config x layer x head x
        position (per="step": x step, every position before it), plus the run's id; tokens
        are the prompt's (the generated ones are None: a run keeps their ids only, in
        `new_ids`); no attention rows are recorded, so full_mass is NaN. `configs`,
        `layers`, `heads` (indices) narrow it."""
        import pandas as pd

        from kvviz.core import frame

        frame.check_per(per)
        m, ev = self["meta"], np.asarray(self["evicted_at"], np.int64)
        C, L, G, T = ev.shape
        cs, ls, hs = frame.chosen((C, L, G), configs, layers, heads)
        frame.check_size(len(cs) * len(ls) * len(hs), T, per)
        head_names = ["mean"] if G == 1 else [f"kv{g}" for g in range(G)]
        blocks = [({"config": m["configs"][c]["label"], "policy": m["configs"][c]["policy"],
                    "budget": m["configs"][c]["budget"], "layer": layer, "head": head_names[h]},
                   frame.stream(ev[c, layer, h], per=per)) for c in cs for layer in ls for h in hs]
        df = frame.frame(blocks, tokens=[str(t) for t in self["tokens"]], per=per)
        df.insert(0, "id", pd.array([m["id"]] * len(df), dtype="string"))
        return df


def list_runs(out) -> list[str]:
    folder = Path(out) / "runs"
    return sorted(p.stem for p in folder.glob("*.npz")) if folder.is_dir() else []


def load_run(out, id_: str) -> dict:
    """{"meta": dict, "prompt_ids", "tokens", "new_ids", "evicted_at"}; ValueError if absent."""
    path = run_path(out, id_)
    if not path.is_file():
        raise ValueError(f"run {id_!r}: no {path}")
    return read_run(path)


def read_run(path) -> NeedleRun:
    """One run file wherever it lies (load_run finds it in DIR/runs/)."""
    with np.load(path, allow_pickle=False) as npz:
        run = NeedleRun({k: npz[k] for k in ARRAYS})
        run["meta"] = json.loads(str(npz["meta"]))
    return run


def held(evicted_at: np.ndarray, positions, step: int) -> np.ndarray:
    """bool (..., len(positions)): position held in the cache left after step `step`."""
    e = evicted_at[..., list(positions)]
    return (e == NEVER) | (e > step)


def task_meta(meta: dict) -> dict:
    """A run's task fields, a run from before the tasks read as the pass key."""
    return {k: meta.get(k, v) if meta.get(k) is not None else v for k, v in TASK_DEFAULTS.items()}


def task_columns(meta: dict, answer: str, ev_c, T0: int) -> dict:
    """One row's task columns: whether the answer is right by the task's check (`correct`,
    as the run scored it), the task and its option, the check's outcome and detail, the
    recorded positions, the share of the distractors' key tokens held at the end of the
    prompt (-1 without distractors)."""
    from kvviz.model.needle.tasks import score

    t = task_meta(meta)
    s = score({**meta, **t}, answer)
    dpos = [p for ps in t["distractor_positions"] for p in ps]
    return {"correct": s.correct, "task": t["task"], "reminder_every": int(t["reminder_every"]),
            "distractors": int(t["distractors"]), "phrase_words": int(t["phrase_words"]),
            "returns": int(t["returns"]), "hops": int(t["hops"]),
            "outcome": s.outcome, "detail": s.detail, "target": t["target"],
            "key_positions": json.dumps(list(meta["key_positions"])), "reminders": len(t["reminders"]),
            "reminder_positions": json.dumps([int(a) for a, _ in t["reminders"]]),
            "distractor_keys": json.dumps(list(t["distractor_keys"])),
            "distractor_positions": json.dumps([list(ps) for ps in t["distractor_positions"]]),
            "distractors_held_end": float(held(ev_c, dpos, T0 - 1).mean()) if dpos else -1.0}


def haystack_name(h) -> str:
    """A run's haystack as its name: the recorded {name, sha256}'s name (an older or
    hand-made run may record a bare string)."""
    return str(h.get("name", "")) if isinstance(h, dict) else str(h or "")


def rows(run: dict) -> list[dict]:
    """The results rows of one run (one per config), from its meta and evicted_at."""
    m, ev = run["meta"], run["evicted_at"]
    pos, q, T0 = m["key_positions"], int(m["question_start"]), int(m["prompt_len"])
    full = [bool(ok) for cfg, ok in zip(m["configs"], m["correct"]) if cfg["policy"] == "full"]
    out = []
    for c, cfg in enumerate(m["configs"]):
        hq = held(ev[c], pos, q - 1).mean(axis=-1)       # (L, G) share at the question
        he = held(ev[c], pos, T0 - 1)                     # (L, G, K) at the end of the prompt
        e = ev[c][..., list(pos)].reshape(ev.shape[1], -1)  # (L, G*K)
        lost = [int(r[r != NEVER].min()) if (r != NEVER).any() else NEVER for r in e]
        ever = [x for x in lost if x != NEVER]
        agreement = m.get("agreement") or [None] * len(m["configs"])
        out.append({
            "id": m["id"], "length": m["length"], "depth": m["depth"], "seed": m["seed"],
            "prompt_mode": m["prompt_mode"], "granularity": m["granularity"],
            "policy": cfg["policy"], "label": cfg["label"], "params": json.dumps(cfg["params"], sort_keys=True),
            "budget": -1 if cfg["budget"] is None else _given(cfg["budget"]), "key": m["key"],
            "answer": m["answers"][c], "correct": bool(m["correct"][c]),
            "agreement": agreement[c],
            "held_question": float(hq.mean()), "held_end": float(he.mean()),
            "layers_whole": int(he.all(axis=(1, 2)).sum()),
            "first_lost": min(ever) if ever else NEVER,
            "held_by_layer": json.dumps([round(float(x), 6) for x in hq.mean(axis=1)]),
            "held_end_by_layer": json.dumps([round(float(x), 6) for x in he.mean(axis=(1, 2))]),
            "first_lost_by_layer": json.dumps(lost),
            "held_by_head": json.dumps([[round(float(x), 6) for x in r] for r in hq]),
            **task_columns(m, m["answers"][c], ev[c], T0),
            "haystack": haystack_name(m.get("haystack")),
            "quiet": q - max(int(b) for _, b in m["reminders"]) if m.get("reminders") else NEVER,
            "seconds": m.get("seconds"), "batch_prompts": m.get("batch_prompts", 1),
            # the share of the answer's neighbours (the phrase's, NEIGHBOURS each side) held at the end
            "neighbours_held_end": (float(held(ev[c], m["neighbour_positions"], T0 - 1).mean())
                                    if m.get("neighbour_positions") else -1.0),
            # the full cache's verdict on the same prompt (the gate); None without a full-cache row
            "full_cache_correct": full[0] if full else None,
        })
    return out


LAYER_COLUMNS = ("id", "task", "reminder_every", "distractors", "phrase_words", "returns", "hops", "length", "depth",
                 "seed",
                 "prompt_mode", "granularity", "policy", "label", "budget", "layer", "head", "held_question",
                 "held_end", "first_lost", "answer", "correct", "outcome", "full_cache_correct")
# The long table's column types: strings, nullable integers (<NA>, never -1, where a value is
# absent: the full cache's budget, a key never lost, a task without that option) and nullable
# booleans (<NA> where the run has no full-cache row to compare with).
LAYER_TYPES = {"id": "string", "task": "string", "reminder_every": "Int64", "distractors": "Int64",
               "phrase_words": "Int64", "returns": "Int64", "hops": "Int64", "length": "Int64", "depth": "float64",
               "seed": "Int64",
               "prompt_mode": "string", "granularity": "string", "policy": "string", "label": "string",
               "budget": "Int64", "layer": "Int64", "head": "string", "held_question": "float64",
               "held_end": "float64", "first_lost": "Int64", "answer": "string", "correct": "boolean",
               "outcome": "string", "full_cache_correct": "boolean"}


def _absent(x, none=NEVER):
    """None where `x` is the results' marker for "no value" (-1 or None), else int(x)."""
    return None if x is None or int(x) == none else int(x)


def layer_rows(run: dict) -> list[dict]:
    """One row per (config, layer, head) of one run: the share of the key's positions held
    at the question and at the end of the prompt, and the earliest step a key position was
    evicted there (None never): the values results.csv keeps as JSON lists, one per cell;
    beside them the config's answer, whether the task's check found it right, the check's
    outcome, and the full cache's verdict on the same prompt (None when the run has no
    full-cache row)."""
    m, ev = run["meta"], np.asarray(run["evicted_at"])
    pos, q, T0 = m["key_positions"], int(m["question_start"]), int(m["prompt_len"])
    G = ev.shape[2]
    t = task_meta(m)
    task = {"task": t["task"], **{k: _absent(t[k]) for k in OPTIONS}}  # the task and its option (None: none)
    verdicts = [task_columns(m, m["answers"][c], ev[c], T0) for c in range(len(m["configs"]))]
    full = [v["correct"] for cfg, v in zip(m["configs"], verdicts) if cfg["policy"] == "full"]
    out = []
    for c, cfg in enumerate(m["configs"]):
        hq = held(ev[c], pos, q - 1).mean(axis=-1)       # (L, G)
        he = held(ev[c], pos, T0 - 1).mean(axis=-1)      # (L, G)
        e = ev[c][..., list(pos)]                        # (L, G, K)
        outcome = {"answer": str(m["answers"][c]), "correct": bool(verdicts[c]["correct"]),
                   "outcome": verdicts[c]["outcome"], "full_cache_correct": bool(full[0]) if full else None}
        for layer in range(ev.shape[1]):
            for g in range(G):
                hit = e[layer, g][e[layer, g] != NEVER]
                out.append({"id": m["id"], **task, "length": m["length"],
                            "depth": m["depth"], "seed": m["seed"],
                            "prompt_mode": m["prompt_mode"], "granularity": m["granularity"],
                            "policy": cfg["policy"], "label": cfg["label"],
                            "budget": None if cfg["budget"] is None else _given(cfg["budget"]),
                            "layer": layer, "head": "mean" if G == 1 else f"kv{g}",
                            "held_question": float(hq[layer, g]), "held_end": float(he[layer, g]),
                            "first_lost": int(hit.min()) if hit.size else None, **outcome})
    return out


def _given(budget):
    """A recorded budget as the tables hold it: a count as an int, a ratio as its text ("0.25x")."""
    from kvviz.core.budget import as_given, parse_budget

    return as_given(parse_budget(budget))


def typed(df, types: dict):
    """`df` with each of its columns named in `types` cast to that pandas type."""
    return df.astype({k: v for k, v in types.items() if k in df.columns})


def layer_table(out) -> "pandas.DataFrame":  # noqa: F821  (pandas is imported inside)
    """Every run in DIR as the long per-layer table (layer_rows), runs in id order, typed
    (LAYER_TYPES: absent values are <NA>); ValueError if DIR holds no runs."""
    import pandas as pd

    ids = list_runs(out)
    if not ids:
        raise ValueError(f"no needle runs in {out} (no runs/*.npz)")
    df = pd.DataFrame([r for id_ in ids for r in layer_rows(load_run(out, id_))], columns=list(LAYER_COLUMNS))
    ratios = df["budget"].map(lambda b: isinstance(b, str)).any()  # "0.25x": budgets as given, as text
    return typed(df, {**LAYER_TYPES, "budget": "string"} if ratios else LAYER_TYPES)


def write_tables(out) -> "pandas.DataFrame":  # noqa: F821  (pandas is imported inside)
    """results.csv and results.json from every run file in DIR (atomic each)."""
    import pandas as pd

    records = [r for id_ in list_runs(out) for r in rows(load_run(out, id_))]
    df = pd.DataFrame(records, columns=list(COLUMNS))
    with replacing(Path(out) / "results.csv") as fh:
        fh.write(df.to_csv(index=False).encode())
    with replacing(Path(out) / "results.json") as fh:
        fh.write(json.dumps(records, indent=1).encode())
    return df


def load_results(out) -> "pandas.DataFrame":  # noqa: F821  (pandas is imported inside)
    """DIR/results.csv, JSON columns parsed; ValueError if the folder has none."""
    import pandas as pd

    path = Path(out) / "results.csv"
    if not path.is_file():
        raise ValueError(f"no needle results in {out} (no results.csv)")
    df = pd.read_csv(path, keep_default_na=False, na_values=[""],
                     dtype={"id": str, "policy": str, "label": str, "key": str, "answer": str,
                            "prompt_mode": str, "granularity": str, "task": str, "outcome": str,
                            "detail": str, "target": str, "haystack": str})
    for col in ("answer", "detail", "target", "haystack"):
        if col in df:
            df[col] = df[col].fillna("")
    if "task" not in df:  # a folder written before the tasks: every run is the pass key
        df["task"] = "passkey"
    for col in JSON_COLUMNS:
        if col in df:
            df[col] = df[col].map(json.loads)
    return df


OPTIONS = ("reminder_every", "distractors", "phrase_words", "returns", "hops")  # the tasks' options (-1: none)
GATE = 0.8  # the least full-cache accuracy at which a task's length stays in a study


def gate(df, least: float = GATE):
    """(the rows at the (task, option, length) cells where the full cache answers at least
    `least` of the prompts, the full cache's accuracy per cell with `kept`): a task is studied
    only where the model can do it with nothing evicted."""
    task = df["task"] if "task" in df else "passkey"
    d = df.assign(task=task)
    full = d[d["policy"] == "full"]
    keys = ["task", *[c for c in OPTIONS if c in d], "length"]  # a task's variants (its option) gated apart
    acc = full.groupby(keys)["correct"].agg(prompts="size", full_accuracy="mean").reset_index()
    acc["kept"] = acc["full_accuracy"] >= least
    keep = set(acc.loc[acc["kept"], keys].itertuples(index=False, name=None))
    return d[[k in keep for k in d[keys].itertuples(index=False, name=None)]], acc
