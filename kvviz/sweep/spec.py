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
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..policies import POLICIES, make_policy, param_specs, parse_params, source_hash

CANONICAL = "canonical"
MODES = ("replay", "loop", "needle")
KEYS = ("mode", "traces", "layers", "heads", "budgets", "policies")


class SpecError(ValueError):
    """A spec the sweep refuses; the message names the key and the value."""


@dataclass(frozen=True)
class Cell:
    """One independent task: a (trace, layer, head) stream, a policy configuration, a budget."""

    index: int
    trace: str
    layer: int | None
    head: str | None
    policy: str
    budget: int
    params: tuple  # ((name, value), ...) every parameter of the policy, defaults included
    source: str = ""  # SHA-256 of the policy's module source: an edited policy re-runs

    def key(self) -> str:
        return json.dumps([self.trace, self.layer, self.head, self.policy, self.budget,
                           [list(p) for p in self.params], self.source])


@dataclass
class TraceInfo:
    """What the driver knows about a trace: its bytes (shipped once), digest and header."""

    key: str            # as written in the spec
    sha256: str
    data: bytes | None  # None for the canonical trace (generated from its seed)
    layers: list | None
    heads: list
    model: str | None


def read_spec(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"spec file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"spec {path} is not valid TOML: {exc}") from None


def _axis(raw: dict, key: str, kind, default=None, where: str = "") -> list | None:
    """A scalar or a non-empty list of `kind`, without repeats. `where` prefixes the key."""
    if key not in raw:
        return default
    value = raw[key]
    key = where + key
    values = value if isinstance(value, list) else [value]
    if not values:
        raise SpecError(f"{key} = {value!r}: must not be empty")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, kind):
            raise SpecError(f"{key} = {value!r}: every value must be {kind.__name__}, got {v!r}")
    if len(set(values)) != len(values):
        raise SpecError(f"{key} = {value!r}: a value repeats")
    return list(values)


def _param_axis(name: str, entry: dict, key: str, where: str) -> list:
    """A parameter's value or list of values, each read by the registry's parser (its type
    here; its rule, which may depend on the budget, when `expand` builds the cell)."""
    value = entry[key]
    values = value if isinstance(value, list) else [value]
    if not values:
        raise SpecError(f"{where}.{key} = {value!r}: must not be empty")
    out = []
    for v in values:
        try:
            out.append(parse_params(name, {key: v}, check=False)[key])
        except ValueError as exc:
            raise SpecError(f"{where}.{key} = {value!r}: {exc}") from None
    if len(set(out)) != len(out):
        raise SpecError(f"{where}.{key} = {value!r}: a value repeats")
    return out


def normalise_budgets(raw: dict) -> list[int]:
    budgets = _axis(raw, "budgets", int)
    if budgets is None:
        raise SpecError("budgets: missing; e.g. budgets = [128, 256]")
    for b in budgets:
        if b < 1:
            raise SpecError(f"budgets = {raw['budgets']!r}: budget must be >= 1, got {b}")
    return budgets


def normalise_policies(raw: dict) -> list[dict]:
    """[{name, params: {param: [values]}}], every name and parameter known to the registry."""
    policies = raw.get("policies")
    if not isinstance(policies, list) or not policies:
        raise SpecError(f"policies = {policies!r}: give at least one [[policies]] table with a name")
    norm_policies = []
    for i, entry in enumerate(policies):
        where = f"policies[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise SpecError(f"{where} = {entry!r}: must be a table with name = \"<policy>\"")
        name = entry["name"]
        if name not in POLICIES:
            raise SpecError(f"{where}.name = {name!r}: unknown policy; one of {sorted(POLICIES)}")
        allowed = [s.name for s in param_specs(name)]
        params = {}
        for k in sorted(set(entry) - {"name"}):
            if k not in allowed:
                raise SpecError(f"{where}.{k} = {entry[k]!r}: {name} has no parameter {k!r}; "
                                f"its parameters are {allowed or 'none'}")
            params[k] = _param_axis(name, entry, k, where)
        norm_policies.append({"name": name, "params": params})
    return norm_policies


def normalise(raw: dict) -> dict:
    """Check keys and types; return the spec in one canonical shape (lists everywhere)."""
    mode = raw.get("mode", "replay")
    if mode not in MODES:
        raise SpecError(f"mode = {mode!r}: must be one of {', '.join(map(repr, MODES))}")
    if mode != "replay":
        from .model_spec import normalise as model_normalise

        return model_normalise(raw)
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise SpecError(f"{unknown[0]} = {raw[unknown[0]]!r}: unknown key; "
                        f"a spec has {', '.join(KEYS)}")
    traces = _axis(raw, "traces", str)
    if traces is None:
        raise SpecError("traces: missing; list trace files (.npz) or \"canonical\"")
    budgets = normalise_budgets(raw)
    norm_policies = normalise_policies(raw)
    return {"mode": mode, "traces": traces, "layers": _axis(raw, "layers", int),
            "heads": _axis(raw, "heads", str, ["mean"]), "budgets": budgets,
            "policies": norm_policies}


def spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def trace_info(key: str, base: Path = Path(".")) -> TraceInfo:
    """Read a trace's bytes and header (layers, heads, model), not its weights."""
    if key == CANONICAL:
        from ..trace import canonical

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
    for i, entry in enumerate(spec["policies"]):
        name, axes = entry["name"], entry["params"]
        for combo in itertools.product(*axes.values()):
            params = dict(zip(axes, combo))
            for budget in spec["budgets"]:
                try:
                    make_policy(name, budget, **params)
                except ValueError as exc:
                    shown = ", ".join(f"{k} = {v}" for k, v in params.items())
                    raise SpecError(f"policies[{i}] ({name}{', ' + shown if shown else ''}) "
                                    f"at budget {budget}: {exc}") from None
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
        for layer in layers:
            for head in heads:
                for i, entry in enumerate(spec["policies"]):
                    name, axes = entry["name"], entry["params"]
                    defaults = {s.name: s.default for s in param_specs(name)}
                    source = source_hash(name)
                    for combo in itertools.product(*axes.values()):
                        params = {**defaults, **dict(zip(axes, combo))}
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
    modes ("loop", "needle": kvviz.sweep.model_spec) return their texts as TraceInfo."""
    raw = read_spec(path_or_dict) if not isinstance(path_or_dict, dict) else path_or_dict
    spec = normalise(raw)
    if spec["mode"] != "replay":
        from . import model_spec

        return model_spec.load(spec, Path(base))
    traces = {key: trace_info(key, base) for key in spec["traces"]}
    return spec, traces, expand(spec, traces)
