"""The needle grid: lengths x depths x seeds x prompt modes x granularities (the prompts) of
one task, each run with every policy x budget (the configs) in one generate batch beside full.

Everything here is checked without torch or a tokenizer, so a bad grid costs nothing.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from kvviz.core.budget import Ratio, parse_budget
from kvviz.model.loop.config import GRANULARITIES, LoopConfig
from kvviz.model.needle.prompt import check_depth
from kvviz.model.needle.results import depth_label, run_id
from kvviz.model.needle.tasks import Task

PROMPT_MODES = ("decode", "prefill")


@dataclass(frozen=True)
class PromptSpec:
    length: int
    depth: float
    seed: int
    prompt_mode: str
    granularity: str
    prefix: str = ""  # the task's (Task.prefix): none for the pass key
    haystack: str = ""  # the haystack's name (a --haystacks file's stem): none for --haystack or the filler

    @property
    def id(self) -> str:
        hay = f"h{self.haystack}-" if self.haystack else ""
        return self.prefix + hay + run_id(self.length, self.depth, self.seed, self.prompt_mode, self.granularity)


@dataclass
class Grid:
    lengths: list[int]
    depths: list[float]
    seeds: list[int]
    policies: list[str]
    budgets: list[int]
    prompt_modes: list[str] = field(default_factory=lambda: ["decode"])
    granularities: list[str] = field(default_factory=lambda: ["layer"])
    max_new_tokens: int = 8
    task: Task = field(default_factory=Task)
    haystacks: list[str] = field(default_factory=lambda: [""])  # names (--haystacks' stems); "": one haystack

    def __post_init__(self):
        check(self)
        self.configs: list[LoopConfig] = build_configs(self.policies, self.budgets)

    def prompts(self) -> list[PromptSpec]:
        # haystacks innermost: a grid stopped part way holds every haystack at the first depths
        return [PromptSpec(*x, self.task.prefix, h) for x in itertools.product(
            self.lengths, self.depths, self.seeds, self.prompt_modes, self.granularities) for h in self.haystacks]


def _nonempty(name: str, values) -> list:
    values = list(values)
    if not values:
        raise ValueError(f"{name}: give at least one value")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: a value repeats in {values}")
    return values


def check(g: Grid) -> None:
    """ValueError naming the option (CLI spelling) and the rule."""
    g.lengths = _nonempty("--lengths", g.lengths)
    for n in g.lengths:
        if isinstance(n, bool) or int(n) != n or n < 2:
            raise ValueError(f"--lengths: a length is a token count >= 2, got {n}")
    g.lengths = [int(n) for n in g.lengths]
    g.depths = [check_depth(d) for d in _nonempty("--depths", g.depths)]
    if len({depth_label(d) for d in g.depths}) != len(g.depths):
        raise ValueError(f"--depths: a value repeats in {g.depths}")
    g.seeds = [int(s) for s in _nonempty("--seeds", g.seeds)]
    for name, values, allowed in (("--prompt-modes", g.prompt_modes, PROMPT_MODES),
                                  ("--granularity", g.granularities, GRANULARITIES)):
        for v in _nonempty(name, values):
            if v not in allowed:
                raise ValueError(f"{name}: must be among {', '.join(allowed)}, got {v!r}")
    if isinstance(g.max_new_tokens, bool) or int(g.max_new_tokens) != g.max_new_tokens or g.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {g.max_new_tokens}")
    g.max_new_tokens = int(g.max_new_tokens)
    g.haystacks = [str(h) for h in _nonempty("--haystacks", g.haystacks)]
    for h in g.haystacks:
        if h and not re.fullmatch(r"[A-Za-z0-9_.-]+", h):
            raise ValueError(f"--haystacks: a haystack's name is its file's stem of letters, digits, '_', '.', "
                             f"'-' (it goes in the run id); got {h!r}")


def build_configs(policies, budgets) -> list[LoopConfig]:
    """`kvviz loop`'s rule: every policy at every budget, full first, the same --policy syntax."""
    from kvviz.model.loop.cli import build_configs as loop_configs

    for b in budgets:
        if not isinstance(b, (str, Ratio)) and (isinstance(b, bool) or int(b) != b or b < 1):
            raise ValueError(f"--budgets: a budget must be an integer >= 1, got {b}")
    budgets = [parse_budget(b, "--budgets") for b in budgets]  # counts >= 1 and ratios (0.25x)
    if not policies:
        raise ValueError("--policies: give at least one, e.g. --policies tova h2o")
    try:
        return loop_configs(list(policies), budgets)
    except ValueError as exc:  # the loop's messages name its own flags
        msg = re.sub(r"--budget\b", "--budgets", re.sub(r"--policy\b", "--policies", str(exc)))
        raise ValueError(msg) from None
