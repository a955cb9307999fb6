"""A sweep spec (TOML) -> validated, normalised spec -> the list of cells.

Everything a cell needs is checked here, before any cell runs: the spec's keys and types,
the traces (exist, readable archive, the requested layers and heads stored) and every
policy configuration, by building it once through the registry (`make_policy`), so the
rules live in one place. Each refusal is one line naming the spec key and its value.
Trace *contents* (weights finite and non-negative, row lengths) are checked where the
trace is loaded, in the cell; a trace broken inside fails its cells, not the spec.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvviz.core.layers import kv_heads, refuse_single
from kvviz.core.policies import is_allocator, make_policy, param_specs
from kvviz.studies.sweep.rules import (
    CANONICAL,
    MODES,
    SpecError,
    TraceInfo,
    axis_values,
    built,
    cell_source,
    normalise_budgets,
    normalise_policies,
    read_spec,
)

KEYS = ("mode", "traces", "layers", "heads", "budgets", "policies")
# An allocator's cell is every stored layer and KV head of its trace at once: no layer, head "kv*".
ALLOCATED = (None, "kv*")


@dataclass(frozen=True)
class Cell:
    """One independent task: a (trace, layer, head) stream, a policy configuration, a budget."""

    index: int
    trace: str
    layer: int | None
    head: str | None
    policy: str
    budget: int | str  # a count, or a ratio of the tokens seen as written ("0.25x")
    params: tuple  # ((name, value), ...) every parameter of the policy, defaults included
    source: str = ""  # SHA-256 of the policy's source and named files: an edited one re-runs

    def key(self) -> str:
        return json.dumps([self.trace, self.layer, self.head, self.policy, self.budget,
                           [list(p) for p in self.params], self.source])


def normalise(raw: dict) -> dict:
    """Check keys and types; return the spec in one canonical shape (lists everywhere)."""
    mode = raw.get("mode", "replay")
    if mode not in MODES:
        raise SpecError(f"mode = {mode!r}: must be one of {', '.join(map(repr, MODES))}")
    if mode != "replay":
        from kvviz.studies.sweep.model_spec import normalise as model_normalise

        return model_normalise(raw)
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise SpecError(f"{unknown[0]} = {raw[unknown[0]]!r}: unknown key; "
                        f"a spec has {', '.join(KEYS)}")
    traces = axis_values(raw, "traces", str)
    if traces is None:
        raise SpecError("traces: missing; list trace files (.npz) or \"canonical\"")
    budgets = normalise_budgets(raw, ratios=True)
    norm_policies = normalise_policies(raw)
    return {"mode": mode, "traces": traces, "layers": axis_values(raw, "layers", int),
            "heads": axis_values(raw, "heads", str, ["mean"]), "budgets": budgets,
            "policies": norm_policies}


def spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def trace_info(key: str, base: Path = Path(".")) -> TraceInfo:
    """Read a trace's bytes and header (layers, heads, model), not its weights."""
    if key == CANONICAL:
        from kvviz.core.trace import canonical

        t = canonical()
        digest = hashlib.sha256()  # the rows' digest, as tests/test_trace.py pins it
        for i in range(t.steps):
            digest.update(t.row(i).tobytes())
        return TraceInfo(key, digest.hexdigest(), None, None, ["mean"], None)
    path = base / key
    if not path.is_file():
        raise SpecError(f"traces = {key!r}: file not found (paths are relative to {base.resolve()})")
    data = path.read_bytes()
    try:
        import io

        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            if "attn" not in npz.files:
                raise SpecError(f"traces = {key!r}: not a kvviz trace (no 'attn' array)")
            layers = ([int(x) for x in npz["layers"]] if "layers" in npz.files
                      else list(range(npz["attn"].shape[0])))
            heads = [str(h) for h in npz["heads"]] if "heads" in npz.files else ["mean"]
            meta = json.loads(str(npz["meta"])) if "meta" in npz.files else {}
    except SpecError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise SpecError(f"traces = {key!r}: not a readable .npz trace ({exc})") from None
    model = meta.get("model") if isinstance(meta, dict) else None
    return TraceInfo(key, hashlib.sha256(data).hexdigest(), data, layers, heads, model)


def expand(spec: dict, traces: dict[str, TraceInfo]) -> list[Cell]:
    """Every cell, in a fixed order (trace, layer, head, policy entry, parameters, budget).
    Each policy configuration is built once per budget, so the registry refuses what it
    would refuse in the cell (even pool_kernel, recent_window >= budget, ...)."""
    cells: list[Cell] = []
    seen: dict[str, str] = {}
    for _ in built(spec, make_policy):
        pass
    for key in spec["traces"]:
        info = traces[key]
        if info.layers is None:
            layers = [None]
        elif spec["layers"] is None:
            layers = info.layers
        else:
            missing = [x for x in spec["layers"] if x not in info.layers]
            if missing:
                raise SpecError(f"layers = {spec['layers']!r}: {key} stores model layers "
                                f"{info.layers}, not {missing[0]}")
            layers = spec["layers"]
        if info.data is None:
            heads = [None]
        else:
            missing = [h for h in spec["heads"] if h not in info.heads]
            if missing:
                raise SpecError(f"heads = {spec['heads']!r}: {key} stores heads {info.heads}, "
                                f"not {missing[0]!r}")
            heads = spec["heads"]
        streams = [(layer, head) for layer in layers for head in heads]
        for i, entry in enumerate(spec["policies"]):
            if is_allocator(entry["name"]) and (info.data is None or not kv_heads(info.heads)):
                raise SpecError(f"policies[{i}] ({entry['name']}): {refuse_single(entry['name'], key)}")
        for layer, head in streams + [ALLOCATED]:
            for i, entry in enumerate(spec["policies"]):
                name, axes = entry["name"], entry["params"]
                if is_allocator(name) != ((layer, head) == ALLOCATED):
                    continue
                defaults = {s.name: s.default for s in param_specs(name)}
                for combo in itertools.product(*axes.values()):
                    params = {**defaults, **dict(zip(axes, combo))}
                    source = cell_source(name, params)
                    for budget in spec["budgets"]:
                        cell = Cell(len(cells), key, layer, head, name, budget,
                                    tuple(sorted(params.items())), source)
                        k = cell.key()
                        if k in seen:
                            raise SpecError(f"policies[{i}] ({name}) repeats a cell of "
                                            f"{seen[k]}: {dict(params)} at budget {budget}")
                        seen[k] = f"policies[{i}]"
                        cells.append(cell)
    return cells


def load(path_or_dict, base: Path = Path(".")) -> tuple[dict, dict[str, TraceInfo], list]:
    """Read, validate and expand a spec. Raises SpecError before anything runs. The model
    modes ("loop", "needle": kvviz.studies.sweep.model_spec) return their texts as TraceInfo."""
    raw = read_spec(path_or_dict) if not isinstance(path_or_dict, dict) else path_or_dict
    spec = normalise(raw)
    if spec["mode"] != "replay":
        from kvviz.studies.sweep import model_spec

        return model_spec.load(spec, Path(base))
    traces = {key: trace_info(key, base) for key in spec["traces"]}
    return spec, traces, expand(spec, traces)
