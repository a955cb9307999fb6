"""Why per-KV-head eviction loses the pass key where per-layer eviction keeps it: which
(layer, KV head) streams lose the key, and how much of the answer's attention to the key
those streams carry.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python -m lab.granularity traces/needle --threads 1

Reads the pass-key runs shipped at both granularities (DIR/runs/L<n>-d<depth>-s<seed>-prefill-
{layer,kv-head}.npz, the same prompt in both). Part 1, every prompt, from the run files alone:
per policy and granularity, the accuracy and where the key's digits were held after the
prompt's one eviction. Part 2, the prompts of --seeds, one eager forward pass each (the prompt
and the full cache's own answer, teacher-forced, nothing evicted): per layer and KV head, the
attention the answer's steps pay to the key (summed over its positions, averaged over the
head's query heads) and the attention the prompt's last step pays it (the row TOVA ranks on
at the eviction); then the share of the answer's key attention that lies in streams each
policy left holding a whole mention of the key. Prints markdown; writes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

POLICIES = {"tova": "tova@128",
            "snapkv poolKernel 5": "snapkv(obs_window=16,pool_kernel=5,recent_window=32,pooling=max)@128",
            "snapkv poolKernel 1": "snapkv(obs_window=16,pool_kernel=1,recent_window=32,pooling=max)@128",
            "h2o": "h2o(recent_window=32)@128"}
ANSWER_ROWS = 6  # the answer's first tokens: a space or not, then the key's five digits


def pairs(folder: Path) -> list[tuple[str, str]]:
    """(layer run id, kv-head run id) of every prompt run at both granularities."""
    runs = {p.stem for p in (folder / "runs").glob("*-prefill-*.npz")}
    return sorted((k.replace("-kv-head", "-layer"), k) for k in runs
                  if k.endswith("-kv-head") and k.replace("-kv-head", "-layer") in runs)


def load(folder: Path, id_: str) -> dict:
    with np.load(folder / "runs" / f"{id_}.npz") as z:
        return {"meta": json.loads(str(z["meta"])), "evicted_at": z["evicted_at"],
                "prompt_ids": z["prompt_ids"], "new_ids": z["new_ids"]}


def mentions(meta: dict) -> list[list[int]]:
    """The key's mentions as lists of token positions (runs of consecutive positions)."""
    pos, out = sorted(meta["key_positions"]), []
    for p in pos:
        if out and p == out[-1][-1] + 1:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def held_whole(run: dict, label: str) -> np.ndarray:
    """bool (L, G): the streams holding every digit of at least one mention of the key at the
    end of the prompt (G = 1 per layer)."""
    m = run["meta"]
    c = [x["label"] for x in m["configs"]].index(label)
    e = run["evicted_at"][c]  # (L, G, T)
    held = (e == -1) | (e > m["prompt_len"] - 1)
    return np.any([held[..., ms].all(-1) for ms in mentions(m)], axis=0)


def held_digits(run: dict, label: str) -> float:
    """The share of the key's token positions held at the end of the prompt, over streams."""
    m = run["meta"]
    e = run["evicted_at"][[x["label"] for x in m["configs"]].index(label)]
    held = (e == -1) | (e > m["prompt_len"] - 1)
    return float(held[..., sorted(m["key_positions"])].mean())


def shape_of(run: dict, label: str) -> str:
    """A wrong answer's shape: the key's digits it starts with, as d's, then '…' (e.g.
    'ddd…' for three of the key's digits and then something else), or 'other'."""
    m = run["meta"]
    a = m["answers"][[x["label"] for x in m["configs"]].index(label)].strip()
    n = 0
    while n < min(len(a), len(m["key"])) and a[n] == m["key"][n]:
        n += 1
    return ("d" * n + "…") if n else "other"


def right(run: dict, label: str) -> bool:
    m = run["meta"]
    return bool(m["correct"][[x["label"] for x in m["configs"]].index(label)])


def part1(folder: Path) -> list[str]:
    ps = pairs(folder)
    lines = [f"### Every prompt run at both granularities ({len(ps)} prompts, prefill, budget 128)", "",
             "| policy | granularity | right | key digits held, per stream | streams holding a whole "
             "mention | layers where every KV head holds one | a wrong answer seen most |",
             "|---|---|---|---|---|---|---|"]
    for name, label in POLICIES.items():
        for gran, k in (("per layer", 0), ("per KV head", 1)):
            ok, digits, share, layers, wrong = 0, [], [], [], {}
            for p in ps:
                run = load(folder, p[k])
                h = held_whole(run, label)  # (L, G)
                ok += right(run, label)
                digits.append(held_digits(run, label))
                share.append(h.mean())
                layers.append(h.all(-1).sum())
                if not right(run, label):
                    a = shape_of(run, label)
                    wrong[a] = wrong.get(a, 0) + 1
            common = max(sorted(wrong), key=wrong.get) if wrong else ""
            seen = f"`{common}` ({wrong[common]})" if wrong else "none"
            lines.append(f"| {name} | {gran} | {ok}/{len(ps)} | {100 * np.mean(digits):.0f} % | "
                         f"{100 * np.mean(share):.0f} % | {np.mean(layers):.1f} of {h.shape[0]} | {seen} |")
    return lines + [""]


def group_key_attention(attn: np.ndarray, keys: list[int], rows: list[int], groups: int) -> np.ndarray:
    """attn (L, H, T, T) -> (L, G): the attention `rows` pay to `keys`, summed over the keys,
    averaged over the rows and over each KV head's query heads (head h reads KV head
    h // (H / G))."""
    a = attn[:, :, rows][..., keys].sum(-1).mean(-1)  # (L, H)
    L, H = a.shape
    return a.reshape(L, groups, H // groups).mean(-1)


def part2(folder: Path, seeds: list[int], pair) -> list[str]:
    from lab.reminder_attention import eager_attention

    chosen = [p for p in pairs(folder) if int(p[0].split("-s")[1].split("-")[0]) in set(seeds)]
    if not chosen:
        raise ValueError(f"--seeds: no prompt of {folder} has seed {seeds} at both granularities")
    lines = [f"### The answer's attention to the key, per stream ({len(chosen)} prompts: "
             f"{', '.join(p[1] for p in chosen)})", "",
             "Share of the answer's key attention (full cache) in the streams each policy left "
             "holding a whole mention, and whether it answered:", "",
             "| prompt | policy | per layer | per KV head |", "|---|---|---|---|"]
    corr, top, shares = [], [], {}
    for lay_id, kv_id in chosen:
        lay, kv = load(folder, lay_id), load(folder, kv_id)
        m = kv["meta"]
        T0, G = m["prompt_len"], m["kv_heads"]
        new = [int(t) for t in kv["new_ids"][0] if t >= 0][:ANSWER_ROWS]
        ids = list(map(int, kv["prompt_ids"])) + new
        attn = eager_attention(pair[1], ids)
        keys = sorted(m["key_positions"])
        ans = group_key_attention(attn, keys, list(range(T0 - 1, T0 - 1 + len(new))), G)
        sel = group_key_attention(attn, keys, [T0 - 1], G)
        win = group_key_attention(attn, keys, list(range(T0 - 16, T0)), G)  # SnapKV's obsWindow
        total = ans.sum()
        for name, label in POLICIES.items():
            hl = np.repeat(held_whole(lay, label), G, axis=1)
            hk = held_whole(kv, label)
            shares.setdefault(name, []).append((ans[hl].sum() / total, ans[hk].sum() / total))
            lines.append(f"| {kv_id.split('-prefill')[0]} | {name} | {100 * ans[hl].sum() / total:.0f} % "
                         f"({'right' if right(lay, label) else 'wrong'}) | {100 * ans[hk].sum() / total:.0f} % "
                         f"({'right' if right(kv, label) else 'wrong'}) |")
        # do the streams the last step attends the key from carry the answer's reading of it?
        r_ans, r_sel = np.argsort(np.argsort(-ans.ravel())), np.argsort(np.argsort(-sel.ravel()))
        corr.append(np.corrcoef(r_ans, r_sel)[0, 1])
        order = np.argsort(-ans.ravel())[:10]
        hk = held_whole(kv, POLICIES["tova"]).ravel()
        hl = np.repeat(held_whole(lay, POLICIES["tova"]), G, axis=1).ravel()
        top.append((kv_id, [(int(i) // G, int(i) % G, float(ans.ravel()[i]), float(sel.ravel()[i]),
                             float(win.ravel()[i]), bool(hl[i]), bool(hk[i])) for i in order]))
    lines += [f"| mean | {name} | {100 * np.mean([a for a, _ in v]):.0f} % | "
              f"{100 * np.mean([b for _, b in v]):.0f} % |" for name, v in shares.items()]
    lines += ["", f"Rank correlation, over the {ans.size} streams, between the attention the "
              "prompt's last step pays the key (what TOVA ranks on) and the answer's: "
              + ", ".join(f"{c:.2f}" for c in corr), ""]
    for kv_id, rows in top[:2]:
        lines += [f"The ten streams that read the key most while answering, {kv_id} (held: TOVA, budget 128):",
                  "", "| layer | KV head | answer's key attention | last prompt step's | last 16 steps' (mean) | "
                  "held per layer | held per KV head |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {layer} | {g} | {a:.3f} | {s:.3f} | {w:.3f} | {'yes' if hl else 'no'} | "
                  f"{'yes' if hk else 'no'} |" for layer, g, a, s, w, hl, hk in rows] + [""]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.granularity", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", default="traces/needle", help="a needle folder with runs "
                   "at both granularities")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 10, 20],
                   help="the prompts (by seed) of part 2's model passes; none: part 1 only")
    p.add_argument("--model", help="a local model folder, .gguf or installed name (default: "
                   "SmolLM2-135M, the model the runs used)")
    p.add_argument("--threads", type=int, help="torch threads")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    try:
        if not pairs(folder):
            raise ValueError(f"folder: {folder} has no prompt run at both granularities (runs/*-prefill-"
                             "layer.npz and *-prefill-kv-head.npz)")
        lines = part1(folder)
        if args.seeds:
            from kvviz.model.models import load_model, thread_count

            thread_count(args.threads)
            lines += part2(folder, args.seeds, load_model(args.model))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
