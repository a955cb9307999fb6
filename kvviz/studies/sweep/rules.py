"""What every sweep spec shares, whatever its mode: the error a bad spec raises, reading
the TOML, one axis's values, the budgets and policies axes, the trace or text a cell reads.
The replay spec (`spec`) and the model modes' spec (`model_spec`) both build on these."""
from __future__ import annotations

import hashlib
import itertools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvviz.core.budget import parse_budget
from kvviz.core.policies import ALLOCATORS, POLICIES, param_specs, parse_params, source_hash

CANONICAL = "canonical"
MODES = ("replay", "loop", "needle")
class SpecError(ValueError):
    """A spec the sweep refuses; the message names the key and the value."""


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


def axis_values(raw: dict, key: str, kind, default=None, where: str = "") -> list | None:
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
            what = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise SpecError(f"{key} = {value!r}: every value must be {what}, got {v!r}")
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
    context = {}  # an allocator's scorer, so a key of the scorer's is read by its declaration
    if name in ALLOCATORS and key != "scorer" and isinstance(entry.get("scorer"), str):
        context = {"scorer": entry["scorer"]}
    for v in values:
        try:
            typed = parse_params(name, {**context, key: v}, check=False)[key]
            spec = next((s for s in _specs(name, context) if key in (s.name, s.label)), None)
            if spec is not None and spec.validate is not None and not spec.numeric:
                # a validated string or value (a path) as its validator gives it (an absolute
                # path), so every worker reads what the spec named, wherever it runs
                typed = spec.parse(typed)
            out.append(typed)
        except ValueError as exc:
            raise SpecError(f"{where}.{key} = {value!r}: {exc}") from None
    if len(set(out)) != len(out):
        raise SpecError(f"{where}.{key} = {value!r}: a value repeats")
    return out


def _specs(name: str, context: dict) -> list:
    """The declared parameters of `name` and, for an allocator, of the scorer in `context`."""
    specs = list(param_specs(name))
    scorer = context.get("scorer")
    if name in ALLOCATORS and isinstance(scorer, str) and scorer in POLICIES:
        specs += list(param_specs(scorer))
    return specs


def normalise_budgets(raw: dict, ratios: bool = False) -> list:
    """The budgets axis: integers >= 1, and with `ratios` also ratios of the tokens seen
    written as strings ("0.25x", kvviz.core.budget), kept as written so a cell's row records
    the budget as given."""
    budgets = axis_values(raw, "budgets", (int, str) if ratios else int)
    if budgets is None:
        raise SpecError("budgets: missing; e.g. budgets = [128, 256]")
    for b in budgets:
        if isinstance(b, str):
            try:
                parse_budget(b)
            except ValueError as exc:
                raise SpecError(f"budgets = {raw['budgets']!r}: {exc}") from None
        elif b < 1:
            raise SpecError(f"budgets = {raw['budgets']!r}: budget must be >= 1, got {b}")
    return [b.strip() if isinstance(b, str) else b for b in budgets]


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
        if name not in POLICIES and name not in ALLOCATORS:
            raise SpecError(f"{where}.name = {name!r}: unknown policy; one of "
                            f"{sorted(POLICIES) + sorted(ALLOCATORS)}")
        allowed = [s.name for s in param_specs(name)]
        if name in ALLOCATORS:  # and its scorer's, when one scorer is named
            scorer = entry.get("scorer", next(s.default for s in param_specs(name) if s.name == "scorer"))
            if isinstance(scorer, str) and scorer in POLICIES:
                allowed += [s.name for s in param_specs(scorer)]
        params = {}
        for k in sorted(set(entry) - {"name"}):
            if k not in allowed:
                raise SpecError(f"{where}.{k} = {entry[k]!r}: {name} has no parameter {k!r}; "
                                f"its parameters are {allowed or 'none'}")
            params[k] = _param_axis(name, entry, k, where)
        norm_policies.append({"name": name, "params": params})
    return norm_policies


def built(spec: dict, build):
    """(entry index, name, build(name, budget, params)) for every policy entry x parameter
    combination x budget, in spec order; a refusal of `build` becomes one SpecError naming
    the entry, its parameters and the budget."""
    for i, entry in enumerate(spec["policies"]):
        name, axes = entry["name"], entry["params"]
        for combo in itertools.product(*axes.values()):
            params = dict(zip(axes, combo))
            for budget in spec["budgets"]:
                try:
                    yield i, name, build(name, budget, **params)
                except ValueError as exc:
                    shown = ", ".join(f"{k} = {v}" for k, v in params.items())
                    raise SpecError(f"policies[{i}] ({name}{', ' + shown if shown else ''}) "
                                    f"at budget {budget}: {exc}") from None


def cell_source(name: str, params: dict) -> str:
    """What a cell's results depend on beyond its parameters' values: the SHA-256 of the
    policy's module source and of every file a parameter names (a head-score table): an
    edited policy or an edited file re-runs its cells instead of reusing stale ones."""
    files = sorted(str(v) for v in params.values() if isinstance(v, str) and v and Path(v).is_file())
    if not files:
        return source_hash(name)
    digest = hashlib.sha256(source_hash(name).encode())
    for path in files:
        digest.update(path.encode() + b"\0" + hashlib.sha256(Path(path).read_bytes()).digest())
    return digest.hexdigest()
