"""The key's attention over time in the recall task's runs: for every recall run in a tasks
folder (decode mode), one eager forward pass of the run's prompt with the full cache and
output_attentions, and per layer and prompt step t the attention row t pays to the key's
positions (summed over them, averaged over query heads; lab.reminder_attention's
pass). The Forgetting view draws it beside each policy's step of losing the key.

    HF_HUB_OFFLINE=1 .venv/bin/python -m lab.key_attention traces/tasks --threads 1

Writes DIR/attention/<id>.npz (atomic; a run already done is skipped, so a killed pass
resumes) in kvviz.studies.key_attention's format; the app reads it with its load_attention.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from kvviz.studies.key_attention import attention_path, save_attention


def wanted(meta: dict) -> bool:
    """A run this pass covers: the recall task read in decode mode."""
    return meta.get("task") == "recall" and meta.get("prompt_mode") == "decode"


def todo(folder) -> list[str]:
    """The recall decode runs in `folder` with no attention file yet, in id order."""
    from kvviz.model.needle.results import list_runs, load_run

    out = []
    for id_ in list_runs(folder):
        # the id names the task and mode (results.run_id); the meta decides
        if id_.startswith("recall") and "-decode-" in id_ and not attention_path(folder, id_).is_file():
            if wanted(load_run(folder, id_)["meta"]):
                out.append(id_)
    return out


def key_attention_over_time(mdl, prompt_ids, key_positions) -> np.ndarray:
    """float32 (layers, prompt_len): the attention each prompt step's query pays to the key's
    positions, full cache, mean over query heads."""
    from lab.reminder_attention import eager_attention, key_attention_rows

    return key_attention_rows(eager_attention(mdl, prompt_ids), key_positions).astype(np.float32)


def run(folder, pair, log=print) -> list[Path]:
    """Every recall decode run of `folder` not done yet, on `pair` (tokenizer, model)."""
    from kvviz.model.needle.results import load_run

    written = []
    ids = todo(folder)
    for i, id_ in enumerate(ids, 1):
        r = load_run(folder, id_)
        a = key_attention_over_time(pair[1], r["prompt_ids"], r["meta"]["key_positions"])
        written.append(save_attention(folder, r["meta"], a, getattr(pair[1], "kvviz_provenance", None)))
        log(f"{i}/{len(ids)} {id_}: {a.shape[0]} layers x {a.shape[1]} steps")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.key_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a tasks folder written by `kvviz needle --task recall` (runs/*.npz)")
    p.add_argument("--model", help="a local model folder, .gguf or installed name (default: SmolLM2-135M, "
                                   "the model the runs used)")
    p.add_argument("--threads", type=int, help="torch threads")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if not (folder / "runs").is_dir():
        print(f"error: folder: {folder} has no runs/ (a `kvviz needle --out` folder)", file=sys.stderr)
        return 2
    try:
        from kvviz.model.models import thread_count

        thread_count(args.threads)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ids = todo(folder)
    if not ids:
        print(f"nothing to do: every recall decode run in {folder} has its attention file")
        return 0
    from kvviz.model.models import load_model, use_threads

    use_threads(args.threads, "key_attention")
    pair = load_model(args.model, "key_attention")
    run(folder, pair)
    return 0


if __name__ == "__main__":
    sys.exit(main())
