"""Policies and allocators from outside the package: a .py file, an importable module, or an
installed package's entry point (group `kvviz.policies`, for both); `--plugin` on the
commands, `KVVIZ_PLUGINS` (os.pathsep-separated) for the app and what it starts.

Loading imports the plugin and registers every Policy subclass and every Allocator subclass
it defines with a `name` (kvviz.core.policies.register_policy / register_allocator, which
check the declaration). A plugin that fails is refused with one line naming it and the rule,
and the built-ins keep working. Loading is idempotent, so a page that reruns can load on
every run. A plugin allocator records where it came from as a plugin policy does
(`provenance`), and a sweep's workers load its file (`worker_specs`).

An entry point's name is the name of the policy or allocator it registers
(`ema-sinks = "pkg.mod:Ema"` needs `Ema.name == "ema-sinks"`; an entry point naming a module
registers its class of that name); any other is refused. A plugin named explicitly (a file or module: `--plugin`,
$KVVIZ_PLUGINS, `load_plugins`) replaces an installed entry point's policy of the same name,
and says so in one line (`notices()`).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from kvviz.core.policies import (
    ALLOCATORS,
    BUILTIN_ALLOCATORS,
    BUILTINS,
    POLICIES,
    Allocator,
    Policy,
    check_declaration,
    register_allocator,
    register_policy,
    registered,
    unregister_allocator,
    unregister_policy,
)

ENV = "KVVIZ_PLUGINS"
GROUP = "kvviz.policies"  # the entry-point group of an installed package's policies and allocators
_LOADED: dict[str, list[str]] = {}  # spec as given -> policy and allocator names it registered
_REFUSED: dict[str, str] = {}  # spec as given -> its refusal
_ORIGIN: dict[type, str] = {}  # class -> the spec a worker process can load it from
_KIND: dict[type, tuple[str, str]] = {}  # class -> ("file" | "module" | "entry point", where)
_ENTRY_POINTS: list[str] | None = None  # refusals of the entry points, once per process
_NOTICES: list[str] = []  # an explicit plugin replaced an entry point's policy: said once each


class PluginError(ValueError):
    """A plugin refused: the message is one line naming the plugin and the rule."""


def env_specs() -> list[str]:
    """The plugins `$KVVIZ_PLUGINS` names (paths or modules, os.pathsep-separated): how the
    app, and the workers a sweep starts, get the same policies as the command that set it."""
    return [s for s in os.environ.get(ENV, "").split(os.pathsep) if s.strip()]


def _is_path(spec: str) -> bool:
    return spec.partition(":")[0].endswith(".py") or os.sep in spec or Path(spec).is_file()


def absolute(spec: str) -> str:
    """A path spec made absolute (for another working directory); a module as it is."""
    if Path(spec).is_file():
        return str(Path(spec).resolve())
    target, sep, cls = spec.partition(":")
    return str(Path(target).expanduser().resolve()) + sep + cls if _is_path(target) else spec


def load_file(path) -> object:
    """A `.py` file run as a module, once per process (the same module back for the same
    resolved path): what plugins and `kvviz check --reference PATH.py:FUNC` both load, so a
    file given to both is one module. Whatever the file raises is raised (it is not left
    half-loaded in sys.modules); callers word the error for their option."""
    path = Path(path).expanduser().resolve()
    name = f"kvviz_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # @dataclass looks its module up while the file runs
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _is_class(v) -> bool:
    """A Policy or an Allocator subclass (not the bases)."""
    return isinstance(v, type) and issubclass(v, (Policy, Allocator)) and v not in (Policy, Allocator)


def _classes(module, only: str | None = None) -> list[type]:
    found = [v for k, v in vars(module).items()
             if _is_class(v) and v.__module__ == module.__name__ and "name" in v.__dict__
             and (only is None or k == only)]
    return found


def _unregister(name: str) -> None:
    (unregister_allocator if name in ALLOCATORS else unregister_policy)(name)


def _what(cls) -> str:
    return "allocator" if issubclass(cls, Allocator) else "policy"


def _same_source(a: type, b: type) -> bool:
    """The same policy loaded twice (a relative and an absolute path, or a script that a
    spawned worker already ran as __mp_main__)."""
    import inspect

    try:
        fa, fb = inspect.getsourcefile(a), inspect.getsourcefile(b)
        return a.__qualname__ == b.__qualname__ and bool(fa and fb) and os.path.samefile(fa, fb)
    except (OSError, TypeError):
        return False


def _is_entry_point(cls) -> bool:
    return _KIND.get(cls, ("",))[0] == "entry point"


def _register_all(spec: str, classes: list[type], origin, kind: tuple[str, str] | None = None) -> list[str]:
    """Register `classes` (all or none). `kind` ("file" | "module" | "entry point", where):
    an explicit plugin replaces an entry point's policy of its name; an entry point gives
    way to an explicit plugin already registered; both say so in one line (notices())."""
    entry = kind is not None and kind[0] == "entry point"
    replace, skip = [], []
    for cls in classes:  # every declaration first, so a plugin registers whole or not at all
        try:
            check_declaration(cls)
        except ValueError as exc:
            raise PluginError(f"plugin {spec}: {exc}") from None
        have = registered(cls.name)
        if have is not None and have is not cls and not _same_source(have, cls):
            if not entry and _is_entry_point(have):
                replace.append((cls, have))
            elif entry and have in _KIND and not _is_entry_point(have):
                skip.append(cls)
            else:
                raise PluginError(f"plugin {spec}: {_what(cls)} name {cls.name!r} is already "
                                  f"registered (by {have.__module__}.{have.__qualname__})")
    for cls, have in replace:
        _unregister(cls.name)
        _NOTICES.append(f"plugin {spec} replaces the installed {_what(have)} {cls.name!r} "
                        f"({_KIND[have][1]})")
    for cls in skip:
        _NOTICES.append(f"plugin {_KIND[registered(cls.name)][1]} replaces the installed "
                        f"{_what(cls)} {cls.name!r} ({kind[1]})")
    names = []
    for cls in classes:
        if registered(cls.name) is None:
            try:
                (register_allocator if issubclass(cls, Allocator) else register_policy)(cls)
            except ValueError as exc:  # a policy's name taken by an allocator, or the reverse
                raise PluginError(f"plugin {spec}: {exc}") from None
            _ORIGIN[cls] = origin(cls)
            if kind is not None:
                _KIND.setdefault(cls, kind)
        names.append(cls.name)
    return names


def notices() -> list[str]:
    """The lines saying which explicit plugin replaced which installed policy, each once
    (taken: a second call returns only the newer ones)."""
    out = list(_NOTICES)
    _NOTICES.clear()
    return out


def load_plugin(spec: str) -> list[str]:
    """Load PATH.py or MODULE (either with an optional :CLASS); the names it registered.
    PluginError names the plugin and the rule."""
    spec = str(spec).strip()
    if spec in _LOADED:
        return _LOADED[spec]
    target, _, only = spec.partition(":") if not Path(spec).is_file() else (spec, "", "")
    only = only or None
    try:
        if _is_path(target):
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise PluginError(f"plugin {spec}: file not found")
            module = load_file(path)
            where = str(path)
        else:
            module = importlib.import_module(target)
            where = None
    except PluginError:
        raise
    except BaseException as exc:  # the author's code; SystemExit too
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise PluginError(f"plugin {spec}: import failed: {_one_line(exc)}") from None
    classes = _classes(module, only)
    if not classes:
        what = (f"no Policy or Allocator subclass named {only}" if only
                else "no Policy or Allocator subclass with a name")
        raise PluginError(f"plugin {spec}: defines {what}")
    kind = ("file", where) if where else ("module", target)
    _LOADED[spec] = _register_all(spec, classes,
                                  lambda cls: f"{where or cls.__module__}:{cls.__name__}", kind)
    return _LOADED[spec]


def load_plugins(specs) -> list[str]:
    """Load each plugin; one refusal message per plugin that failed (empty: all loaded).
    The ones that load stay registered whatever the others do."""
    messages = []
    for spec in specs or ():
        if spec not in _REFUSED:  # a refused file is not run again on every page run
            try:
                load_plugin(spec)
                continue
            except PluginError as exc:
                _REFUSED[spec] = str(exc)
        messages.append(_REFUSED[spec])
    return messages


def load_entry_points() -> list[str]:
    """Every installed `kvviz.policies` entry point (a Policy or an Allocator class, or a
    module), once."""
    global _ENTRY_POINTS
    if _ENTRY_POINTS is None:
        from importlib.metadata import entry_points

        _ENTRY_POINTS = []
        for ep in entry_points(group=GROUP):
            dist = getattr(getattr(ep, "dist", None), "name", None)
            label = f"entry point {ep.name} in {GROUP}" + (f" of {dist}" if dist else "")
            where = f"{ep.value} ({label})"
            try:
                obj = ep.load()
            except Exception as exc:  # the author's code
                _ENTRY_POINTS.append(f"plugin {where}: import failed: {_one_line(exc)}")
                continue
            try:
                classes = _entry_classes(ep.name, obj, where)
                _register_all(where, classes, lambda cls: f"{cls.__module__}:{cls.__name__}",
                              ("entry point", where))
            except PluginError as exc:
                _ENTRY_POINTS.append(str(exc))
    return list(_ENTRY_POINTS)


def _entry_classes(name: str, obj, where: str) -> list[type]:
    """The one policy or allocator entry point `name` registers: the class it names, or its
    module's class called `name`; the rule (the entry point's name is the class's `name`)
    refused in one line otherwise."""
    if isinstance(obj, type):
        if not _is_class(obj):
            raise PluginError(f"plugin {where}: {obj.__qualname__} is not a Policy or Allocator "
                              "subclass")
        own = obj.__dict__.get("name")
        if own != name:
            raise PluginError(f"plugin {where}: the entry point's name must be the {_what(obj)}'s "
                              f"name; {obj.__qualname__}.name is {own!r}, the entry point is {name!r}")
        return [obj]
    found = _classes(obj)
    if not found:
        raise PluginError(f"plugin {where}: defines no Policy or Allocator subclass with a name")
    match = [c for c in found if c.name == name]
    if not match:
        raise PluginError(f"plugin {where}: the entry point's name must be the policy's name; the "
                          f"module defines {', '.join(repr(c.name) for c in found)}, the entry point "
                          f"is {name!r}")
    return match


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_all(specs=()) -> list[str]:
    """Entry points, then $KVVIZ_PLUGINS, then `specs`: every refusal, one line each."""
    return load_entry_points() + load_plugins(env_specs()) + load_plugins(specs)


def _builtin(cls) -> bool:
    return cls in BUILTINS or cls in BUILTIN_ALLOCATORS


def origin(name: str) -> str | None:
    """What a worker process loads to get policy or allocator `name` (None for a built-in;
    an allocator's scorer is named on its own)."""
    cls = registered(name)
    if cls is None:
        raise PluginError(f"{name} is not a registered policy or allocator")
    if _builtin(cls):
        return None
    if cls in _ORIGIN:
        return _ORIGIN[cls]
    module = sys.modules.get(cls.__module__)
    if cls.__module__ in ("__main__", "__mp_main__"):
        path = getattr(module, "__file__", None)
        if not path:
            raise PluginError(f"{_what(cls)} {name} was registered from code with no file (python -c "
                              "or a notebook): worker processes cannot load it; put it in a .py "
                              "file and pass --plugin FILE (run_sweep(..., plugins=[FILE]))")
        return f"{Path(path).resolve()}:{cls.__name__}"
    return f"{cls.__module__}:{cls.__name__}"


def provenance(name: str) -> dict:
    """Where policy (or allocator) `name` comes from, as a saved result records it beside its
    parameters: {"origin": "built-in" | "entry point" | "file" | "module", "where": the
    entry point, the file's absolute path or the module (empty for a built-in), "sha256":
    the SHA-256 of its module's source (kvviz.core.policies.source_hash)}."""
    from kvviz.core.policies import policy_class, source_hash

    cls = policy_class(name)  # ValueError naming the registered ones
    if _builtin(cls):
        kind = ("built-in", "")
    elif cls in _KIND:
        kind = _KIND[cls]
    else:  # registered by register_policy from a script or a module
        path = getattr(sys.modules.get(cls.__module__), "__file__", None)
        kind = (("file", str(Path(path).resolve())) if cls.__module__ in ("__main__", "__mp_main__") and path
                else ("module", cls.__module__))
    return {"origin": kind[0], "where": kind[1], "sha256": source_hash(name)}


def worker_specs(names) -> list[str]:
    """The plugins a worker must load to run policies and allocators `names`, in a fixed
    order."""
    out = []
    for name in names:
        spec = origin(name)
        if spec is not None and spec not in out:
            out.append(spec)
    return out


def cli_load(specs, prog: str = "kvviz") -> int:
    """For a command: load every plugin. A refused --plugin is an error (exit status 2,
    one line each); a refused entry point or $KVVIZ_PLUGINS entry is a warning."""
    for msg in load_entry_points() + load_plugins(env_specs()):
        print(f"{prog}: warning: {msg} (ignored)", file=sys.stderr)
    refused = load_plugins(specs)
    for msg in notices():
        print(f"{prog}: {msg}", file=sys.stderr)
    for msg in refused:
        print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2 if refused else 0


def forget() -> None:
    """Unregister every plugin and forget what was loaded (tests share one registry)."""
    for name in [n for n, c in POLICIES.items() if c not in BUILTINS]:
        unregister_policy(name)
    for name in [n for n, c in ALLOCATORS.items() if c not in BUILTIN_ALLOCATORS]:
        unregister_allocator(name)
    _LOADED.clear()
    _REFUSED.clear()
    _ORIGIN.clear()
    _KIND.clear()
    _NOTICES.clear()
    global _ENTRY_POINTS
    _ENTRY_POINTS = None


def add_argument(parser) -> None:
    """Add `--plugin PATH.py|MODULE` (repeatable) to a command: one spelling on every command."""
    parser.add_argument("--plugin", action="append", default=[], metavar="PATH.py|MODULE",
                        help="load policies and allocators from a file or module (repeatable; also "
                             f"${ENV}, {os.pathsep}-separated)")
