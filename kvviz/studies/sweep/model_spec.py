"""The model modes of a sweep: `mode = "needle"` (kvviz needle's grid) and `mode = "loop"`
(kvviz loop over text files). A task is one prompt (needle) or one text at one granularity
(loop), every policy configuration in one generate batch beside full; a cell is one
(task, configuration) row. The text (haystack or loop text) is a TraceInfo, so it travels
like a trace file: once per pool worker, once into Ray's object store.

    mode = "needle"                      mode = "loop"
    lengths = [256, 512]                 texts = ["traces/sources/elements.md"]
    depths = [10, 50, 90]                max_tokens = 256
    seeds = [0, 1]                       granularity = ["layer"]
    prompt_modes = ["decode"]            seed = 0
    granularity = ["layer"]              model = "smollm2"      # optional
    max_new_tokens = 8                   budgets = [128]
    haystack = "filler"                  [[policies]] ...
    budgets = [128]
    [[policies]] ...

Either mode takes `eviction = "masked"` (the default) or `"freed"` (kvviz.model.loop's
two eviction modes); every row records it.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from kvviz.core.policies import param_specs
from kvviz.model.loop.config import EVICTIONS, GRANULARITIES, LoopConfig
from kvviz.studies.sweep.rules import (
    SpecError,
    TraceInfo,
    axis_values,
    built,
    cell_source,
    normalise_budgets,
    normalise_policies,
)

FILLER = "filler"
COMMON = ("mode", "granularity", "model", "budgets", "policies", "eviction")
KEYS = {"needle": COMMON + ("lengths", "depths", "seeds", "prompt_modes", "max_new_tokens", "haystack"),
        "loop": COMMON + ("texts", "max_tokens", "seed")}


@dataclass(frozen=True)
class ModelCell:
    """One row: a task (`item`: the prompt id or the text key; `unit`: what the task runs)
    and one configuration. `budget` is None for full."""

    index: int
    mode: str
    text: str      # the TraceInfo key of the haystack or text
    item: str
    unit: tuple
    policy: str
    budget: int | None
    params: tuple
    source: str = ""
    slot: int = 0       # this configuration's row in the task's batch
    batch: str = "{}"   # JSON: every configuration of the task (full first; a task always runs
                        # whole) and what it runs with (kvviz.studies.sweep.model_cell.compute)

    @property
    def trace(self) -> str:  # what the engines and the store look a TraceInfo up by
        return self.text

    def key(self) -> str:
        return json.dumps([self.mode, self.text, self.item, list(self.unit), self.policy, self.budget,
                           [list(p) for p in self.params], self.source])

    def config(self) -> LoopConfig:
        return LoopConfig(self.policy, dict(self.params), self.budget)


def _int(raw, key, default, low):
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise SpecError(f"{key} = {v!r}: must be an integer >= {low}")
    return v


def _choices(raw, key, allowed, default):
    values = axis_values(raw, key, str, default)
    for v in values:
        if v not in allowed:
            raise SpecError(f"{key} = {raw[key]!r}: each must be one of {', '.join(allowed)}, got {v!r}")
    return values


def normalise(raw: dict) -> dict:
    from kvviz.model.needle.grid import PROMPT_MODES

    mode = raw["mode"]
    unknown = sorted(set(raw) - set(KEYS[mode]))
    if unknown:
        raise SpecError(f"{unknown[0]} = {raw[unknown[0]]!r}: unknown key for mode = {mode!r}; "
                        f"its keys are {', '.join(KEYS[mode])}")
    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        raise SpecError(f"model = {model!r}: must be a string (a folder, a .gguf or an installed name)")
    eviction = raw.get("eviction", "masked")
    if eviction not in EVICTIONS:
        raise SpecError(f"eviction = {eviction!r}: must be one of {', '.join(map(repr, EVICTIONS))}")
    spec = {"mode": mode, "granularity": _choices(raw, "granularity", GRANULARITIES, ["layer"]),
            "model": model, "budgets": normalise_budgets(raw), "policies": normalise_policies(raw),
            "eviction": eviction}
    if mode == "loop":
        texts = axis_values(raw, "texts", str)
        if texts is None:
            raise SpecError("texts: missing; list UTF-8 text files for the model to read")
        return {**spec, "texts": texts, "max_tokens": _int(raw, "max_tokens", 1024, 2),
                "seed": _int(raw, "seed", 0, 0)}
    for key in ("lengths", "depths", "seeds"):
        if key not in raw:
            raise SpecError(f"{key}: missing; e.g. lengths = [256], depths = [50], seeds = [0]")
    depths = raw["depths"] if isinstance(raw["depths"], list) else [raw["depths"]]
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, float)):
            raise SpecError(f"depths = {raw['depths']!r}: every value must be a number, got {d!r}")
        if not 0 <= d <= 100:
            raise SpecError(f"depths = {raw['depths']!r}: a depth is a percent of the haystack, 0-100; got {d}")
    if not depths or len({float(d) for d in depths}) != len(depths):
        raise SpecError(f"depths = {raw['depths']!r}: give distinct values")
    lengths = axis_values(raw, "lengths", int)
    for n in lengths:
        if n < 2:
            raise SpecError(f"lengths = {raw['lengths']!r}: a length is a token count >= 2, got {n}")
    haystack = raw.get("haystack", FILLER)
    if not isinstance(haystack, str):
        raise SpecError(f"haystack = {haystack!r}: \"filler\" or a text file")
    return {**spec, "lengths": lengths, "depths": [float(d) for d in depths],
            "seeds": axis_values(raw, "seeds", int),
            "prompt_modes": _choices(raw, "prompt_modes", PROMPT_MODES, ["decode"]),
            "max_new_tokens": _int(raw, "max_new_tokens", 8, 1), "haystack": haystack}


def text_info(key: str, base: Path, where: str) -> TraceInfo:
    """A text file (or the built-in filler) as the sweep ships it: its bytes and digest."""
    if key == FILLER:
        from kvviz.model.needle.prompt import FILLER as TEXT

        data = None
        digest = hashlib.sha256(TEXT.encode()).hexdigest()
        return TraceInfo(key, digest, data, None, [], None)
    path = base / key
    if not path.is_file():
        raise SpecError(f"{where} = {key!r}: file not found (paths are relative to {base.resolve()})")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{where} = {key!r}: not UTF-8 text") from None
    if not text.strip():
        raise SpecError(f"{where} = {key!r}: the file is empty")
    return TraceInfo(key, hashlib.sha256(data).hexdigest(), data, None, [], None)


def configs(spec: dict) -> list[LoopConfig]:
    """full, then every policy entry x parameter combination x budget, each built once."""
    out = [LoopConfig("full")]
    for i, name, cfg in built(spec, lambda name, budget, **params: LoopConfig(name, params, budget)):
        if cfg.label in [c.label for c in out]:
            raise SpecError(f"policies[{i}] ({name}) repeats a configuration: {cfg.label}")
        out.append(cfg)
    return out


def units(spec: dict) -> list[tuple[str, str, tuple]]:
    """(text key, item, unit) per task, in task order."""
    if spec["mode"] == "loop":
        return [(t, f"{t}-{g}", (g,)) for t in spec["texts"] for g in spec["granularity"]]
    from kvviz.model.needle.grid import PromptSpec

    out = []
    for x in itertools.product(spec["lengths"], spec["depths"], spec["seeds"], spec["prompt_modes"],
                               spec["granularity"]):
        out.append((spec["haystack"], PromptSpec(*x).id, tuple(x)))
    return out


def load(spec: dict, base: Path):
    """(spec, texts, cells) as kvviz.studies.sweep.spec.load returns them; the model is resolved
    (not loaded) and, for the needle, every length checked against the tokenizer."""
    from kvviz.model.models import resolve

    if spec["model"] is not None:
        p = base / spec["model"]
        spec = {**spec, "model": str(p.resolve()) if p.exists() else spec["model"]}
    try:
        resolve(spec["model"])
    except (ValueError, RuntimeError) as exc:
        raise SpecError(f"model = {spec['model']!r}: {exc}") from None
    keys = spec["texts"] if spec["mode"] == "loop" else [spec["haystack"]]
    where = "texts" if spec["mode"] == "loop" else "haystack"
    texts = {k: text_info(k, base, where) for k in keys}
    cfgs = configs(spec)
    if spec["mode"] == "needle":
        from kvviz.model.needle.run import check_lengths, context_limit, load_tokenizer

        try:
            check_lengths(load_tokenizer(spec["model"]), spec["lengths"], spec["max_new_tokens"],
                          context_limit(spec["model"]))
        except ValueError as exc:
            raise SpecError(str(exc).replace("--lengths ", "lengths = ")
                            .replace("--max-new-tokens", "max_new_tokens")) from None
    keys = ("model", "eviction", "max_new_tokens") if spec["mode"] == "needle" else \
        ("model", "eviction", "max_tokens", "seed")
    batch = json.dumps({"configs": [c.to_dict() for c in cfgs], "payload": {k: spec[k] for k in keys}})
    cells = []
    for text, item, unit in units(spec):
        for slot, c in enumerate(cfgs):
            params = {} if c.is_full else {**{s.name: s.default for s in param_specs(c.policy)}, **c.params}
            cells.append(ModelCell(len(cells), spec["mode"], text, item, unit, c.policy, c.budget,
                                   tuple(sorted(params.items())), "" if c.is_full else cell_source(c.policy, params),
                                   slot, batch))
    return spec, texts, cells
