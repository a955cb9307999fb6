"""Model cells, computed where they run (this process, a pool worker, a Ray actor).

A task is one prompt (needle) or one text at one granularity (loop), every configuration
in one batch beside full, exactly as `kvviz needle` / `kvviz loop` run it. The model loads
once per process (kvviz.model.models.load_model keeps it), and torch runs on one thread in every
engine, so a cell's numbers do not depend on where it ran.
"""
from __future__ import annotations

import json

from kvviz.studies.sweep.cell import BLOBS, _need_plugins, describe

IDENTITY = {"needle": ("text", "id", "length", "depth", "seed", "prompt_mode", "granularity"),
            "loop": ("text", "granularity")}
CONFIG = ("policy", "label", "params", "budget")
METRICS = {"needle": ("key", "answer", "correct", "agreement", "held_question", "held_end", "layers_whole",
                      "first_lost", "held_by_layer", "held_end_by_layer", "first_lost_by_layer",
                      "held_by_head"),
           "loop": ("perplexity", "perplexity_after_eviction", "top1_agreement", "kl",
                    "full_perplexity_after_eviction", "top1_agreement_after_eviction",
                    "kl_after_eviction", "first_eviction", "n_predicted", "n_after_eviction")}
TAIL = ("status", "error", "kvviz_version", "text_sha256", "model", "eviction")


def columns(mode: str) -> list[str]:
    return [*IDENTITY[mode], *CONFIG, *METRICS[mode], *TAIL]


def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return lambda: torch.set_num_threads(before)


def _needle(text, unit, configs, payload, pair):
    from kvviz.model.needle.grid import Grid, PromptSpec
    from kvviz.model.needle.results import rows
    from kvviz.model.needle.run import compute as needle_compute

    spec = PromptSpec(*unit)
    grid = Grid([spec.length], [spec.depth], [spec.seed], ["full"], [], [spec.prompt_mode],
                [spec.granularity], payload["max_new_tokens"])
    grid.configs = configs
    run = needle_compute(spec, grid, pair, text, payload.get("text_key"), payload.get("eviction", "masked"))
    return rows(run), run["meta"]["model"]["model"]


def _loop(text, unit, configs, payload, pair):
    from kvviz.model.loop import run_loop

    res = run_loop(text, configs, granularity=unit[0], max_tokens=payload["max_tokens"], model=pair,
                   rows_layers=[], seed=payload["seed"], eviction=payload.get("eviction", "masked"))
    return res.results, res.meta.get("model")


def compute(data: bytes | None, sha: str, mode: str, text_key: str, unit: tuple, batch: str,
            plugins=()) -> list[tuple[dict | None, str | None]]:
    """(metrics, None) per configuration of `batch` (JSON: configs, full first, and the
    payload: model, eviction, max_new_tokens or max_tokens and seed), or
    (None, error) for all of them if the batch raised. `data` None with a known sha: the
    text is in BLOBS (a pool worker); None and unknown: the needle's built-in filler."""
    from kvviz.model.loop.config import LoopConfig
    from kvviz.model.models import load_model

    _need_plugins(plugins)
    if data is None and sha in BLOBS:
        data = BLOBS[sha]
    batch = json.loads(batch)
    payload = batch["payload"]
    configs = [LoopConfig(c["policy"], c["params"], c["budget"]) for c in batch["configs"]]
    restore = None
    try:
        restore = _one_thread()
        pair = load_model(payload.get("model"), f"sweep {mode}")
        text = None if data is None else data.decode("utf-8")
        run = _needle if mode == "needle" else _loop
        rows, model = run(text, unit, configs, {**payload, "text_key": text_key}, pair)
        return [({**{m: r.get(m) for m in METRICS[mode]}, "model": model,
                  "eviction": payload.get("eviction", "masked")}, None) for r in rows]
    except Exception as exc:  # recorded in every row of the task; the sweep goes on
        return [(None, describe(exc))] * len(configs)
    finally:
        if restore is not None:
            restore()


class Worker:
    """A Ray actor's body: the model stays loaded in it across the tasks it is given."""

    def __init__(self, plugins=()):
        from kvviz.studies.sweep.cell import ensure_plugins

        self.refused = ensure_plugins(plugins)

    def probe(self):
        return self.refused

    def compute(self, *args):
        return compute(*args)
