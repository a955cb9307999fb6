"""The policy registry: names to classes. Everything else (controls, labels, colours, score
views, references, CLI lists) is read from the registered classes, so a policy is one file.

`register_policy(cls)` adds one (kvviz.core.plugins loads files, modules and entry points).

Allocators (kvviz.core.policies.alloc: budgets shared across heads and layers, e.g. adakv,
pyramidkv) are found the same way, registered the same way (`register_allocator(cls)`, the
same plugins) and kept apart in ALLOCATORS, since they drive several streams at once;
`make_policy`, `param_specs`, `parse_params` and `config_label` read both. `make_policy`
hands an allocator it builds its scorer factory (itself) and the names a scorer may be:
nothing is wired through a global.

Plugin authors import from the documented path, `kvviz.policies`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import pkgutil
import re
import uuid

from kvviz.core.budget import at_ratio, is_ratio, parse_budget
from kvviz.core.policies.alloc import Allocator
from kvviz.core.policies.base import KINDS, ParamSpec, Place, Policy, Rank, param

# The order lists, tables and default colours show the built-ins in. A built-in not named
# here (a new file in this folder) follows these, alphabetically: adding one edits nothing here.
ORDER = ("tova", "snapkv", "h2o", "streaming-llm", "scissorhands", "knorm", "random", "vatp")


def _builtins(base=Policy) -> tuple[type, ...]:
    """Every `base` class (Policy or Allocator) with a `name` defined in a module of this
    folder: the built-ins are found from their files, so a new policy is its own file and
    nothing else."""
    found = {}
    for info in pkgutil.iter_modules(__path__, __name__ + "."):
        if info.name.endswith((".base", ".alloc")):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, base) and obj.__module__ == module.__name__
                    and isinstance(obj.__dict__.get("name"), str)):
                found[obj.name] = obj
    rank = {n: i for i, n in enumerate(ORDER)}
    return tuple(found[n] for n in sorted(found, key=lambda n: (rank.get(n, len(ORDER)), n)))


BUILTINS = _builtins()
BUILTIN_ALLOCATORS = _builtins(Allocator)
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in BUILTINS}
ALLOCATORS: dict[str, type[Allocator]] = {cls.name: cls for cls in BUILTIN_ALLOCATORS}


def is_allocator(name: str) -> bool:
    """Whether `name` is a registered allocator (several streams at once), not a policy."""
    return name in ALLOCATORS


def registered(name: str):
    """The registered class called `name` (a policy or an allocator), or None."""
    return ALLOCATORS.get(name) or POLICIES.get(name)


def scorer_names() -> tuple:
    """The registered per-stream policies an allocator may use as its scorer (plugins too)."""
    return tuple(POLICIES)


RESERVED = {"policy", "allocator", "full"}  # the base classes' names; the loop's no-eviction row
_BASE_FIELDS = {Policy: {"budget", "rng"},  # the dataclass fields a base declares without param
                Allocator: {"budget", "rng", "factory", "scorers", "scorer_params"}}
_COLOUR = re.compile(r"^#[0-9A-Fa-f]{6}$")
_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


def check_declaration(cls) -> None:
    """Raise ValueError naming the rule a policy or an allocator class breaks (see Policy,
    Allocator and param): the same rules for both, and a policy's rank and colour."""
    base = next((b for b in (Policy, Allocator) if isinstance(cls, type) and issubclass(cls, b)), None)
    if base is None or cls is base:
        raise ValueError(f"{cls!r} is not a subclass of kvviz.policies.Policy or "
                         "kvviz.policies.Allocator")
    if not dataclasses.is_dataclass(cls) or "__dataclass_fields__" not in cls.__dict__:
        raise ValueError(f"{cls.__name__} must be decorated with @dataclass")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or name in RESERVED:
        raise ValueError(f"{cls.__name__}.name must be its own lowercase name (letters, digits, "
                         f"- or _; not {sorted(RESERVED)}), got {name!r}")
    if not isinstance(cls.label, str) or not cls.label.strip():
        raise ValueError(f"{name}: label must be a non-empty string")
    declared = {s.name for s in cls.specs}
    for f in dataclasses.fields(cls):
        if f.name not in _BASE_FIELDS[base] and f.name not in declared:
            raise ValueError(f"{name}: field {f.name!r} must be declared with param(...) "
                             "(label, range or choices, help, source)")
    for s in cls.specs:
        where = f"{name}.{s.name}"
        if s.kind not in KINDS:
            raise ValueError(f"{where}: its kind must be one of {KINDS}, got {s.kind!r}")
        for attr in ("label", "help", "source"):
            if not isinstance(getattr(s, attr), str) or not getattr(s, attr).strip():
                raise ValueError(f"{where}: {attr} must be a non-empty string")
        if s.kind == "choice":
            if len(s.choices) < 2 or not all(isinstance(c, str) for c in s.choices):
                raise ValueError(f"{where}: a choice parameter needs choices=(at least two strings)")
        elif not s.numeric:  # a free string, a switch or a value: its rule is its validator
            if s.choices or s.min is not None or s.max is not None:
                raise ValueError(f"{where}: min, max and choices are for numbers and choices; a "
                                 f"{s.kind} parameter states its rule with validate=")
        else:
            if s.choices:
                raise ValueError(f"{where}: choices are for str parameters only")
            if s.min is None:
                raise ValueError(f"{where}: a numeric parameter needs min (its range)")
            if s.high is None:
                raise ValueError(f"{where}: give max, or ui_max for the control when the rule "
                                 "has no upper end")
        try:
            s.parse(s.default)
        except ValueError as exc:
            raise ValueError(f"{where}: the default breaks its own rule: {exc}") from None
    if base is Allocator and cls.victim_order not in ("per_head", "shared", None):
        raise ValueError(f"{name}: victim_order must be 'per_head', 'shared' or None, got "
                         f"{cls.victim_order!r}")
    if base is Policy and cls.rank is not None and not isinstance(cls.rank, Rank):
        raise ValueError(f"{name}: rank must be a kvviz.core.policies.base.Rank or None")
    colour = getattr(cls, "colour", None)
    if colour is not None and not (isinstance(colour, str) and _COLOUR.match(colour)):
        raise ValueError(f"{name}: colour must be '#RRGGBB' or None, got {colour!r}")
    try:
        cls(budget=512)
    except Exception as exc:  # the author's code, reported not raised through
        raise ValueError(f"{name}: its defaults do not construct at budget 512: "
                         f"{type(exc).__name__}: {exc}") from None


def _register(cls, table: dict, kind: str, other: dict, other_kind: str):
    """The one registration rule for both kinds: the declaration checked, the same class
    again a no-op, a name taken in either table refused with ValueError naming its holder."""
    check_declaration(cls)
    if cls.name in other:
        raise ValueError(f"{kind} name {cls.name!r} is already registered ({other_kind})")
    have = table.get(cls.name)
    if have is cls:
        return cls
    if have is not None:
        raise ValueError(f"{kind} name {cls.name!r} is already registered "
                         f"(by {have.__module__}.{have.__qualname__})")
    table[cls.name] = cls
    source_hash(cls.name)
    return cls


def register_policy(cls):
    """Add a policy class to the registry; returns it (usable as a decorator).

    Registering the same class again is a no-op; another class under a registered name,
    or a class that breaks a declaration rule, is refused with ValueError."""
    if isinstance(cls, type) and issubclass(cls, Allocator):
        raise ValueError(f"{cls.__qualname__} is an Allocator: register it with register_allocator")
    return _register(cls, POLICIES, "policy", ALLOCATORS, "an allocator")


def unregister_policy(name: str) -> None:
    """Remove a plugin (tests); the built-ins stay."""
    if name in {c.name for c in BUILTINS}:
        raise ValueError(f"{name} is built in and cannot be unregistered")
    POLICIES.pop(name, None)


def register_allocator(cls):
    """Add an allocator class (an Allocator subclass) to the registry; returns it (usable as
    a decorator). The rules are register_policy's: the declaration is checked
    (check_declaration), the same class again is a no-op, and a name already taken by a
    policy or by another allocator is refused with ValueError."""
    if not (isinstance(cls, type) and issubclass(cls, Allocator)):
        raise ValueError(f"{cls!r} is not a subclass of kvviz.policies.Allocator "
                         "(a per-stream policy is registered with register_policy)")
    return _register(cls, ALLOCATORS, "allocator", POLICIES, "a policy")


def unregister_allocator(name: str) -> None:
    """Remove a plugin allocator (tests); the built-ins stay."""
    if name in {c.name for c in BUILTIN_ALLOCATORS}:
        raise ValueError(f"{name} is built in and cannot be unregistered")
    ALLOCATORS.pop(name, None)


def policy_class(name: str):
    """The registered class `name` (a policy or an allocator); ValueError naming them all."""
    if name in ALLOCATORS:
        return ALLOCATORS[name]
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES) + sorted(ALLOCATORS)}, got {name!r}")
    return POLICIES[name]


def _split(name: str, params: dict) -> tuple[dict, str, dict]:
    """An allocator's own parameters, its scorer's name, and the rest (the scorer's)."""
    cls = ALLOCATORS[name]
    own_names = {s.name for s in cls.specs} | {s.label for s in cls.specs}
    own = {k: v for k, v in params.items() if k in own_names}
    scorer = own.get("scorer", next(s.default for s in cls.specs if s.name == "scorer"))
    scorer = str(scorer).strip()
    if scorer in ALLOCATORS or scorer not in POLICIES:
        raise ValueError(f"scorer must be one of {sorted(POLICIES)} (a registered policy, not an "
                         f"allocator), got {scorer!r}")
    rest = {k: v for k, v in params.items() if k not in own_names}
    clash = sorted(own_names & ({s.name for s in POLICIES[scorer].specs}
                                | {s.label for s in POLICIES[scorer].specs}))
    if clash:
        raise ValueError(f"{name} and its scorer {scorer} both declare {clash}: such a scorer "
                         "cannot be composed with it")
    return own, scorer, rest


def make_policy(name: str, budget: int = 512, rng=None, place: Place | None = None, **params):
    """A fresh policy object by registered name: the one constructor every surface uses, so
    an unknown name, an unknown parameter or a value outside its declared rule is refused the
    same way everywhere (a ValueError naming it). `rng` is used only by `random`; None is a
    fixed seed, so replays are bit-identical run to run. `place` (a Place) tells the policy
    where its stream sits (`policy.place`; default: nowhere known).

    `budget` is a slot count or a ratio of the tokens seen ('0.25x', kvviz.core.budget): a
    ratio builds the policy at the smallest budget its parameters accept (its `budget`, the
    ratio's floor) and sets `policy.ratio`, which every harness resolves at each step.

    An allocator's name gives an Allocator; a parameter it does not declare is its scorer's
    (`make_policy("adakv", 64, scorer="snapkv", pool_kernel=3)`), checked by building the
    scorer once at the budget."""
    cls = policy_class(name)
    budget = parse_budget(budget)
    if is_ratio(budget):
        return _ratio_policy(name, budget, rng, place, params)
    if name in ALLOCATORS:
        own, scorer, rest = _split(name, params)
        try:
            rest = cls.scorer_settings(_parse_own(name, own, "", False), scorer, rest)
            probe = make_policy(scorer, budget=budget, **parse_params(scorer, rest, check=False))
        except ValueError as exc:
            raise ValueError(f"{name}: scorer {scorer}: {exc}") from None
        return cls(budget=budget, rng=rng, factory=make_policy, scorers=scorer_names(),
                   scorer_params=dict(probe.params), **_parse_own(name, own, "", False))
    allowed = {s.name for s in cls.specs}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"{name} has no parameter {sorted(unknown)}; "
                         f"its parameters are {sorted(allowed) or 'none'}")
    policy = cls(budget=budget, rng=rng, **params)
    if place is not None:
        if not isinstance(place, Place):
            raise ValueError(f"place must be a kvviz.core.policies.base.Place, got {place!r}")
        policy.place = place
    return policy


def _ratio_policy(name: str, ratio, rng, place, params):
    """`make_policy` at a ratio budget: built at the smallest budget its parameters accept
    (every refusal that does not depend on the budget said as at any budget)."""
    if name in ALLOCATORS:
        cls = ALLOCATORS[name]
        fixed = [m for m in ("group", "plan_layers", "calibrate") if getattr(cls, m) is not getattr(Allocator, m)]
        if fixed:
            raise ValueError(f"budget: {name} sets its heads' or layers' budgets once ({', '.join(fixed)}), "
                             f"so it takes a fixed budget (slots per stream), got the ratio {ratio}")
    return at_ratio(lambda b: make_policy(name, b, rng, place, **params), ratio)


def param_specs(name: str) -> list[ParamSpec]:
    """The policy's declared parameters (default, range or choices, label, help, source), in
    declaration order: what the sidebar, the CLI and sweep specs build their controls from."""
    specs = list(policy_class(name).specs)
    if name in ALLOCATORS:  # its scorer: any registered policy, plugins included
        specs = [dataclasses.replace(s, choices=scorer_names()) if s.name == "scorer" else s
                 for s in specs]
    return specs


def defaults(name: str) -> dict:
    """The declared default of each parameter: the configuration a bare name means."""
    return {s.name: s.default for s in policy_class(name).specs}


def parse_params(name: str, given, where: str = "", check: bool = True) -> dict:
    """The one parser of parameters, for the sidebar, `name:k=v`, the sweep spec and the URL.

    `given` maps a parameter's name (pool_kernel) or label (poolKernel) to a value or its
    text. Returns {name: typed value} for the keys given (defaults are not added).
    ValueError names the parameter and the rule; `where` prefixes the message. With
    check=False only the type is checked (the URL: the page then shows the policy's own
    refusal, as it does for a control set out of its rule).

    For an allocator, a key it does not declare is its scorer's (`scorer` given, else its
    default), parsed by the scorer's declaration."""
    given = {str(k).strip(): v for k, v in dict(given).items()}
    if name in ALLOCATORS:  # the keys it does not declare are its scorer's
        own, scorer, rest = _split(name, given)
        out = _parse_own(name, own, where, check)
        out.update(parse_params(scorer, rest, where + f"{name}: scorer {scorer}: ", check))
        return out
    return _parse_own(name, given, where, check)


def _parse_own(name: str, given: dict, where: str, check: bool) -> dict:
    """parse_params over `name`'s own declared parameters."""
    specs = param_specs(name)
    by_key = {**{s.label: s for s in specs}, **{s.name: s for s in specs}}
    unknown = sorted(set(given) - set(by_key))
    if unknown:  # worded as make_policy words it
        raise ValueError(f"{where}{name} has no parameter {unknown}; its parameters are "
                         f"{sorted(s.name for s in specs) or 'none'}")
    out = {}
    for key, value in given.items():
        spec = by_key[key]
        try:
            out[spec.name] = spec.parse(value) if check else spec.coerce(value)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None
    return out


FULL = "full"              # the no-eviction configuration, as `--policy full` names it
FULL_LABEL = "full cache"  # and as every table and figure shows it


def config_label(name: str, params=None, *, budget=None, keep=()) -> str:
    """How every table, figure, report and CSV names a configuration: 'snapkv
    (poolKernel=1, pooling=avg)': the policy's name, then the parameters that differ from
    its defaults (plus any named in `keep`), by the labels the sidebar shows and
    `name:k=v` accepts, in declaration order; 'full cache' for no eviction; with a
    `budget`, ' @ 256' after it (the full cache has none). One spelling,
    so a row of a report, a CSV and a line in the app name a configuration alike.

    `params` may hold every parameter (a policy's own `params`) or only some; values are
    compared typed, so the text "1" of a CLI flag is the default 1. A policy that is not
    registered (a plugin not loaded) shows every parameter given."""
    if name == FULL:
        return FULL_LABEL
    if isinstance(budget, float) and budget.is_integer():  # a table column with gaps
        budget = int(budget)
    at = "" if budget is None or budget == "" or budget != budget else f" @ {budget}"
    params = dict(params or {})
    keep = set(keep)
    if name in ALLOCATORS:
        own, scorer, rest = _split(name, params)
        inner = config_label(scorer, rest, keep=keep)[len(scorer):].strip(" ()")
        shown = [f"scorer={scorer}"] + [p for p in _shown(name, own, keep) if not p.startswith("scorer=")]
        shown += [inner] if inner else []
    elif name not in POLICIES:
        shown = [f"{k}={v}" for k, v in sorted(params.items())]
    else:
        shown = _shown(name, params, keep)
    return name + (f" ({', '.join(shown)})" if shown else "") + at


def _shown(name: str, params: dict, keep: set) -> list[str]:
    """config_label's 'label=value' items: parameters off their default or kept."""
    shown = []
    for spec in param_specs(name):
        key = spec.name if spec.name in params else spec.label
        if key not in params:
            continue
        value = params[key]
        try:
            value = spec.coerce(value)
        except ValueError:
            pass
        if value != spec.default or spec.name in keep or spec.label in keep:
            shown.append(f"{spec.label}={value}")
    return shown


def rank_of(name: str) -> Rank | None:
    """What the policy ranks by (its `Rank`), or None for an unknown name or a policy with no
    score to explain (random): the Scores view and the explanations ask here."""
    cls = POLICIES.get(name)
    return cls.rank if cls is not None else None


def score_labels(name: str | None = None) -> dict:
    """Score key -> label: every registered policy's (its rank score and its other
    scores), with policy `name`'s own taking precedence where two share a key."""
    out = {}
    classes = list(POLICIES.values()) + ([POLICIES[name]] if name in POLICIES else [])
    for cls in classes:
        out.update(cls.score_labels)
        if cls.rank is not None:
            out[cls.rank.key] = cls.rank.label
    return out


_NO_SOURCE = uuid.uuid4().hex  # this process's stand-in when a policy has no source file
_SOURCES: dict = {}


def source_hash(name: str) -> str:
    """SHA-256 of the source of the module that defines the policy (what a sweep cell's
    identity includes, so an edited policy re-runs its cells). A class whose source cannot
    be read (defined in `python -c`) gets a fresh value per process: never resumed."""
    cls = policy_class(name)
    if cls not in _SOURCES:  # read once per class: the code that runs, not a later edit
        try:
            text = inspect.getsource(inspect.getmodule(cls))
            _SOURCES[cls] = hashlib.sha256(text.encode()).hexdigest()
        except (OSError, TypeError):
            _SOURCES[cls] = "unreadable-" + _NO_SOURCE
    return _SOURCES[cls]


def reference_class(name: str):
    """The policy's slow reference class (a "module:Class" string is imported here)."""
    ref = policy_class(name).reference
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        ref = getattr(importlib.import_module(module), attr)
    return ref


__all__ = ["ALLOCATORS", "Allocator", "BUILTINS", "BUILTIN_ALLOCATORS", "FULL", "FULL_LABEL",
           "POLICIES", "ParamSpec", "Place", "Policy", "Rank", "check_declaration", "is_allocator",
           "config_label", "defaults", "make_policy", "param", "param_specs", "parse_params", "policy_class",
           "rank_of", "reference_class", "register_allocator", "register_policy", "registered",
           "score_labels", "scorer_names", "source_hash", "unregister_allocator",
           "unregister_policy"]
