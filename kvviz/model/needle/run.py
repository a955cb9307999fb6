"""Running the grid: one generate batch per prompt (every config beside full), or several
prompts in one batch (`batch`), one file per prompt written atomically, so a re-run skips
what is done. torch loads here only.
"""
from __future__ import annotations

import hashlib
import sys

from kvviz.core.paths import version
from kvviz.model.loop.config import PREFILL_CHUNK
from kvviz.model.models import context_limit, load_tokenizer  # noqa: F401 (the needle's checks use them)
from kvviz.model.needle.grid import Grid, PromptSpec
from kvviz.model.needle.prompt import FILLER, NeedlePrompt, minimum_length
from kvviz.model.needle.results import list_runs, load_run, save_run, write_tables
from kvviz.model.needle.tasks import Task, draw_phrase, score
from kvviz.model.needle.tasks import build as build_task


def check_lengths(tok, lengths, max_new_tokens: int = 1, limit: int | None = None, task: Task | None = None,
                  seeds=(0,)) -> None:
    """Every length fits the task's sentences (tokenizer) and, with its new tokens, the
    model's context; a phrase's tokens fit in --max-new-tokens."""
    task = task or Task()
    need = minimum_length(tok)
    for n in lengths:
        if limit is not None and n + max_new_tokens > limit:
            raise ValueError(f"--lengths {n}: with --max-new-tokens {max_new_tokens} it exceeds the model's "
                             f"context of {limit} positions")
        if task.name == "passkey" and n < need + 1:
            raise ValueError(f"--lengths {n}: the pass key does not fit; the instruction, the key's sentence "
                             f"and the question take {need} tokens, so a length must be at least {need + 1}")
    if task.name == "passkey":
        return
    for seed in seeds:  # the tasks' own sentences: the shortest length is the one to try
        build_task(tok, task, min(lengths), 50, seed)
    if task.name == "phrase":
        for seed in seeds:
            k = len(tok(" " + " ".join(draw_phrase(seed, task.phrase_words)), add_special_tokens=False)["input_ids"])
            if k > max_new_tokens:
                raise ValueError(f"--max-new-tokens {max_new_tokens}: the pass phrase of --phrase-words "
                                 f"{task.phrase_words} (seed {seed}) takes {k} tokens, so the answer cannot hold "
                                 f"it whole; give at least {k}")


def haystack_info(text: str | None, name: str | None = None) -> dict:
    body = FILLER if text is None else text
    return {"name": name or ("filler" if text is None else "text"),
            "sha256": hashlib.sha256(body.encode()).hexdigest()}


def run_prompt(pair, p: NeedlePrompt, configs, max_new_tokens: int, *, run_id: str,
               prompt_mode: str, granularity: str, seed: int = 0, haystack: dict | None = None,
               progress=None, eviction: str = "masked", prefill_chunk: int = PREFILL_CHUNK,
               task: Task | None = None, full_cache: bool = True) -> dict:
    """One prompt, every config in one kvviz.model.loop.generate batch: the run as
    results.load_run returns it (not written). The grid and the app's own-passage form both
    run through here, so a run from either is read the same way. `haystack`: the
    haystack_info to record (the filler's when None). `eviction`, `prefill_chunk`: as for
    kvviz.model.loop.generate; the run records the mode and the memory each held. `task`:
    the Task the prompt was built for (its option is recorded; the pass key when None),
    each answer scored by its check (kvviz.model.needle.tasks.score). `full_cache` False:
    no full-cache row (configs without `full`; the run's `full_cache` says so, agreement None)."""
    from kvviz.model.loop import generate

    gen = generate(list(p.ids), configs, max_new_tokens, granularity=granularity,
                   prompt_mode=prompt_mode, model=pair, seed=seed, progress=progress, eviction=eviction,
                   prefill_chunk=prefill_chunk, full_cache=full_cache)
    return record(pair, p, gen, run_id=run_id, prompt_mode=prompt_mode, granularity=granularity, seed=seed,
                  max_new_tokens=max_new_tokens, haystack=haystack, task=task)


def run_prompts(pair, items, configs, max_new_tokens: int, *, prompt_mode: str, granularity: str,
                haystack: dict | None = None, progress=None, eviction: str = "masked",
                prefill_chunk: int = PREFILL_CHUNK, task: Task | None = None,
                full_cache: bool = True) -> list[dict]:
    """Several prompts (`items`: (run_id, NeedlePrompt, seed[, haystack_info]) each) read together, every
    prompt x config one row of a kvviz.model.loop.generate_batch batch: each run what
    run_prompt gives it alone (the same tokens and eviction logs), as results.load_run
    returns it (not written). `full_cache` as for run_prompt."""
    from kvviz.model.loop import generate_batch

    items = list(items)
    infos = [it[3] if len(it) > 3 else haystack for it in items]  # a haystack_info per prompt, where given
    items = [it[:3] for it in items]
    gens = generate_batch([list(p.ids) for _, p, _ in items], configs, max_new_tokens, granularity=granularity,
                          prompt_mode=prompt_mode, model=pair, seed=[s for _, _, s in items], progress=progress,
                          eviction=eviction, prefill_chunk=prefill_chunk, full_cache=full_cache)
    return [record(pair, p, gen, run_id=id_, prompt_mode=prompt_mode, granularity=granularity, seed=s,
                   max_new_tokens=max_new_tokens, haystack=info, task=task)
            for (id_, p, s), info, gen in zip(items, infos, gens)]


def record(pair, p: NeedlePrompt, gen, *, run_id: str, prompt_mode: str, granularity: str, seed: int,
           max_new_tokens: int, haystack: dict | None, task: Task | None) -> dict:
    """A prompt's Generation as the run results.load_run returns: the meta (the prompt, its
    task, each config's answer scored by the task's check) and the arrays."""
    from kvviz.model.models import model_provenance, token_strings

    tok, mdl = pair
    if list(gen.prompt_ids) != list(p.ids):
        raise RuntimeError(f"{run_id}: generate read other tokens than the prompt built")
    answers = [str(t) for t in gen.texts]
    task = task or Task()
    fields = {**task.record(), "task": p.task, "reminders": [list(r) for r in p.reminders], "target": p.target,
              "distractor_names": p.distractor_names, "distractor_keys": p.distractor_keys,
              "distractor_positions": p.distractor_positions, "neighbour_positions": p.neighbour_positions}
    meta = {"id": run_id, "length": p.length, "depth": p.depth, "seed": seed,
            "prompt_mode": prompt_mode, "granularity": granularity, "key": p.key,
            "key_positions": p.key_positions, "question_start": p.question_start,
            "prompt_len": len(p.ids), "max_new_tokens": max_new_tokens,
            "haystack": haystack or haystack_info(None),
            "model": model_provenance(mdl), "kvviz_version": version(),
            "configs": [{**c.record(), "label": c.label} for c in gen.configs],
            "answers": answers, "correct": [score({"key": p.key, **fields}, a).correct for a in answers],
            "agreement": [None if x is None else float(x) for x in gen.agreement],
            "full_cache": bool(gen.meta.get("full_cache", True)),
            "layers": int(gen.evicted_at.shape[1]), "kv_heads": int(gen.evicted_at.shape[2]),
            **{k: gen.meta[k] for k in ("eviction", "cache_bytes", "full_cache_bytes", "policy_bytes", "seconds")},
            "memory_by_config": gen.meta.get("memory_by_config"),
            **({"batch_prompts": gen.meta["batch_prompts"]} if "batch_prompts" in gen.meta else {}),
            **fields}
    return {"meta": meta, "prompt_ids": p.ids, "tokens": token_strings(tok, p.ids, p.text, p.offsets),
            "new_ids": gen.new_ids, "evicted_at": gen.evicted_at}


def spec_haystack(spec: PromptSpec, haystack, haystack_name):
    """(text, name) of the spec's haystack: `haystack` a dict of name -> text (--haystacks)
    is looked up by spec.haystack; else the one text and its name."""
    if isinstance(haystack, dict):
        if spec.haystack not in haystack:
            raise ValueError(f"--haystacks: no haystack named {spec.haystack!r}")
        return haystack[spec.haystack], spec.haystack
    return haystack, haystack_name


def compute(spec: PromptSpec, grid: Grid, pair, haystack: str | dict | None = None,
            haystack_name: str | None = None, eviction: str = "masked", prefill_chunk: int = PREFILL_CHUNK) -> dict:
    """One prompt of the grid, every config: the run as results.load_run returns it (not written).
    A grid whose configs hold no `full` row (run_grid's full_cache=False) runs without it.
    `haystack`: one text, or name -> text (--haystacks), the spec's looked up by its name."""
    haystack, haystack_name = spec_haystack(spec, haystack, haystack_name)
    p = build_task(pair[0], grid.task, spec.length, spec.depth, spec.seed, haystack)
    return run_prompt(pair, p, grid.configs, grid.max_new_tokens, run_id=spec.id,
                      prompt_mode=spec.prompt_mode, granularity=spec.granularity, seed=spec.seed,
                      haystack=haystack_info(haystack, haystack_name), eviction=eviction,
                      prefill_chunk=prefill_chunk, task=grid.task,
                      full_cache=any(c.is_full for c in grid.configs))


def compute_batch(specs, grid: Grid, pair, haystack: str | None = None, haystack_name: str | None = None,
                  eviction: str = "masked", prefill_chunk: int = PREFILL_CHUNK) -> list[dict]:
    """Prompts of the grid of one prompt mode and granularity, read together in one batch
    (run_prompts): their runs, not written."""
    specs = list(specs)
    if len({(s.prompt_mode, s.granularity) for s in specs}) != 1:
        raise ValueError("a batch of prompts shares one prompt mode and granularity")
    built = []
    for s in specs:
        text, name = spec_haystack(s, haystack, haystack_name)
        built.append((s.id, build_task(pair[0], grid.task, s.length, s.depth, s.seed, text), s.seed,
                      haystack_info(text, name)))
    return run_prompts(pair, built, grid.configs, grid.max_new_tokens, prompt_mode=specs[0].prompt_mode,
                       granularity=specs[0].granularity,
                       eviction=eviction, prefill_chunk=prefill_chunk, task=grid.task,
                       full_cache=any(c.is_full for c in grid.configs))


def batches(specs, size: int) -> list[list]:
    """`specs` in groups of at most `size` that can share a batch (one prompt mode and
    granularity), shortest prompts together (a batch runs as long as its longest)."""
    groups = {}
    for s in specs:
        groups.setdefault((s.prompt_mode, s.granularity), []).append(s)
    out = []
    for group in groups.values():
        group = sorted(group, key=lambda s: s.length)
        out += [group[i:i + size] for i in range(0, len(group), size)]
    return out


def model_name(model) -> str:
    """The name results record for `model` (kvviz.model.models.provenance), without loading it."""
    from kvviz.model.models import model_provenance, resolve

    return model_provenance(model[1])["model"] if isinstance(model, tuple) else resolve(model).name


def label_now(cfg: dict) -> str:
    """A saved configuration's label as this code names it: its recorded parameters with the
    defaults of any parameter declared since (which the run used without naming it: a new
    parameter's default is the rule before it) filled in; the recorded label when the policy
    is not registered here."""
    from kvviz.model.loop.config import LoopConfig

    if cfg["policy"] == "full":
        return cfg["label"]
    try:
        return LoopConfig(cfg["policy"], dict(cfg.get("params") or {}), cfg["budget"]).label
    except (ValueError, KeyError, TypeError):
        return cfg["label"]


def signature(meta: dict) -> tuple:
    """What a saved run must match to be skipped on a re-run: configs (label_now), new
    tokens, haystack, model, eviction mode (a run from before the mode was recorded masked)."""
    return ([label_now(c) for c in meta["configs"]], meta["max_new_tokens"], meta["haystack"]["sha256"],
            meta["model"].get("model"), meta.get("eviction", "masked"))


def done(out, spec: PromptSpec, grid: Grid, haystack, haystack_name, name: str, eviction: str = "masked") -> bool:
    haystack, haystack_name = spec_haystack(spec, haystack, haystack_name)
    try:
        meta = load_run(out, spec.id)["meta"]
    except (ValueError, OSError, KeyError):
        return False  # absent or unreadable: run it (again)
    return signature(meta) == ([c.label for c in grid.configs], grid.max_new_tokens,
                               haystack_info(haystack, haystack_name)["sha256"], name, eviction)


def run_grid(grid: Grid, out, model=None, haystack: str | dict | None = None, haystack_name=None,
             progress: bool = True, device: str = "cpu", dtype: str = "float32", eviction: str = "masked",
             prefill_chunk: int = PREFILL_CHUNK, batch: int = 1, full_cache: bool = True):
    """Run every prompt not already in `out` (resume), then write results.csv/.json.
    `batch`: prompts read together in one engine batch (of one prompt mode and
    granularity; each run's tokens and eviction logs are what it gets alone). `full_cache`
    False leaves the full-cache row out of every run (a run with it and one without have
    different configs: neither resumes the other). `haystack`: one text, or name -> text for
    a grid over several haystacks (Grid.haystacks). Returns the table of every run in `out`."""
    import copy

    from kvviz.model.models import load_model

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--batch must be an integer >= 1, got {batch!r}")
    if not full_cache:
        grid = copy.copy(grid)
        grid.configs = [c for c in grid.configs if not c.is_full]
        if not grid.configs:
            raise ValueError("full_cache=False leaves the full cache out: give a policy other than full")

    prompts = grid.prompts()
    name = model_name(model)
    todo = [s for s in prompts if not done(out, s, grid, haystack, haystack_name, name, eviction)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="[kvviz needle]",
                   unit="prompt", file=sys.stderr, mininterval=0.5, smoothing=0, dynamic_ncols=True)
    try:
        if todo:
            pair = load_model(model, "needle", device, dtype)
            for specs in batches(todo, batch):
                if bar is not None:
                    bar.set_postfix_str(specs[0].id + (f" +{len(specs) - 1}" if len(specs) > 1 else ""), refresh=False)
                runs = ([compute(specs[0], grid, pair, haystack, haystack_name, eviction, prefill_chunk)]
                        if len(specs) == 1 else
                        compute_batch(specs, grid, pair, haystack, haystack_name, eviction, prefill_chunk))
                for run in runs:
                    save_run(out, run["meta"], run["prompt_ids"], run["tokens"], run["new_ids"], run["evicted_at"])
                if bar is not None:
                    bar.update(len(specs))
    finally:
        if bar is not None:
            bar.close()
    return write_tables(out) if list_runs(out) else None
