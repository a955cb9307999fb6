"""HeadKV (Fu et al. 2024, arXiv:2410.19258, "Not All Heads Matter"): per-head budgets from
head importance scores measured once, offline, on retrieval-reasoning prompts.

The scores come from a table file (`scores`, a path): {"layers": {"<model layer>": [one
score per KV head], ...}}, finite and >= 0, not all 0 in a layer. The default table scores
SmolLM2-135M-Instruct's 30 layers x 3 KV heads; `kvviz calibrate headkv --out FILE` writes
one (kvviz.model.calibrate: the attention each KV head's query heads put on a pass key's
tokens while the model copies it). A relative path is kept absolute, so a sweep's workers
read the same file.

The rule (the paper's Section 3.2, Eq. 5, and its code's ReasonSnapKVCluster): with w the
scorer's recent window (HeadKV's `window`, 32, given to the scorer as its `recentWindow`: the
paper's observation window, kept by every head) and B' = b - w the rest of a layer's per-head
budget b, every head keeps a base of B' - floor(B' / beta) slots and gives floor(B' / beta)
to a shared pool; the pool goes back to the heads in proportion to their normalised scores
s^temp / sum(s^temp). Head g's budget is w + base + its share. kvviz pools per layer (the
layer's H heads share H x floor(B' / beta)), not across the model as the paper's code does:
an allocator's layer holds at most heads x b here, in every harness, and a trace replays only
a few stored layers; budgets across layers are CAKE's part (`cake`). The paper's code rounds
each share (torch.round), which can miss the total by a slot or two; kvviz gives each head
the floor of its share and the slots left over one each to the heads with the largest
fractional part (ties: the lower head), so the layer's total is exactly H x b. Within a head,
its scorer (SnapKV by default, as the paper selects within a head) evicts down to the head's
budget.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from kvviz.core.paths import traces_or_default
from kvviz.core.policies.alloc import Allocator
from kvviz.core.policies.base import param

TABLE_NAME = "heads/headkv-smollm2.json"


def default_table() -> str:
    """The shipped head-score table for SmolLM2-135M-Instruct (traces/heads/): in the traces
    folder in use, else the installed bundle's or the package's checkout's."""
    from kvviz.core.paths import BUNDLE, REPO

    places = [traces_or_default(), BUNDLE / "traces", REPO / "traces"]
    found = next((p / TABLE_NAME for p in places if (p / TABLE_NAME).is_file()), places[0] / TABLE_NAME)
    return str(found.resolve())


def read_table(path) -> dict:
    """{layer number: [scores per KV head]} from a head-score table file; ValueError saying
    what is wrong with it."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"scores: {path} is not a readable JSON file ({exc})") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f'scores: {path} has no "layers": {{"<layer>": [scores per KV head]}}')
    out = {}
    for key, scores in layers.items():
        if not str(key).isdigit():
            raise ValueError(f"scores: {path}: layer {key!r} is not a layer number")
        if (not isinstance(scores, list) or not scores
                or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)
                or not all(math.isfinite(s) and s >= 0 for s in scores)):
            raise ValueError(f"scores: {path}: layer {key} must give a list of finite scores >= 0, "
                             f"got {scores!r}")
        if not any(s > 0 for s in scores):
            raise ValueError(f"scores: {path}: layer {key} scores every head 0")
        out[int(key)] = [float(s) for s in scores]
    return out


def table_file(value: str) -> str:
    """a path to a JSON head-score table ({"layers": {"<layer>": [scores per KV head]}})"""
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ValueError(f"scores: no such file: {value} (relative to {Path.cwd()})")
    read_table(path)
    return str(path.resolve())


def with_window(scorer: str, params: dict, **windows) -> dict:
    """`params` with each of `windows` (recent_window=, obs_window=) set where the scorer
    declares it (an allocator that owns the scorer's windows: headkv, cake)."""
    from kvviz.core.policies import registered  # the registry imports this module

    cls = registered(scorer)
    if cls is None:  # an unknown scorer: refused where it is built
        return dict(params)
    set_here = {s.name: s.label for s in cls.specs if s.name in windows}
    kept = {k: v for k, v in params.items() if k not in set_here and k not in set_here.values()}
    return {**kept, **{k: windows[k] for k in set_here}}


def probe_tail(alloc, **windows) -> int:
    """The newest positions the allocator's scorer never evicts, from one scorer built at the
    budget with `windows` (refused as the scorer refuses them: the check shrinks the window
    that does not fit). Built by hand, without a factory, the registry's make_policy builds it."""
    from kvviz.core.policies import make_policy  # the registry imports this module

    factory = alloc.factory or make_policy
    params = with_window(alloc.scorer, alloc.scorer_params, **windows)
    return int(factory(alloc.scorer, budget=alloc.budget, **params).protected_tail())


def head_budgets(scores: list, b: int, window: int, beta: float, temp: float) -> list[int]:
    """Each head's budget in a layer of per-head budget `b` (see the module docstring)."""
    heads = len(scores)
    rest = b - window
    if rest < 1:
        return [b] * heads  # nothing beyond the window to share
    give = int(Fraction(rest) / Fraction(repr(float(beta))))  # floor(B' / beta), exact
    base = rest - give
    pool = heads * give
    weights = [Fraction(float(s) ** float(temp)) for s in scores]
    total = sum(weights)
    shares = [pool * w / total for w in weights]
    whole = [int(s) for s in shares]
    order = sorted(range(heads), key=lambda g: (-(shares[g] - whole[g]), g))
    for g in order[: pool - sum(whole)]:
        whole[g] += 1
    return [window + base + k for k in whole]


@dataclass
class HeadKV(Allocator):
    scorer: str = param("snapkv", label="scorer", choices=("snapkv", "tova"),
                        help="the per-head policy that chooses victims within a head's budget",
                        source="HeadKV selects within each head SnapKV-style (Fu et al. 2024, "
                               "Section 3.2; its code's ReasonSnapKVCluster)")
    scores: str = param(default_table(), label="scores", validate=table_file,
                        help="JSON file of head scores per layer per KV head (kvviz calibrate headkv)",
                        source="HeadKV scores heads once, offline, on retrieval-reasoning prompts "
                               "(Fu et al. 2024, Section 3.1); the shipped table scores SmolLM2-135M")
    beta: float = param(1.005, label="beta", min=1.0, ui_max=20.0, step=0.005,
                        help="each head gives floor((budget - window) / beta) slots to the layer's "
                             "pool and keeps the rest as its base",
                        source="HeadKV's code, scripts' default beta=1.005 (Fu et al. 2024, Eq. 5)")
    window: int = param(32, label="window", min=0, ui_max=256,
                        help="the newest positions every head keeps beyond its budget share "
                             "(the scorer's recentWindow)",
                        source="HeadKV's code, window_size=32 (Fu et al. 2024): the observation "
                               "window every head keeps")
    temp: float = param(1.0, label="temp", min=0.0, ui_max=10.0, step=0.1,
                        help="scores are raised to this power before they share the pool",
                        source="HeadKV's code, scripts' default temp=1")

    name = "headkv"
    label = "HeadKV"
    victim_order = "per_head"
    reference = "kvviz.core.reference_alloc:RefHeadKV"

    def check_params(self):
        if self.beta < 1:
            raise ValueError(f"beta must be at least 1 (a head cannot give more than its slots), "
                             f"got beta={self.beta}")
        self._window = probe_tail(self, recent_window=self.window)

    @classmethod
    def scorer_settings(cls, own, scorer, params):
        return with_window(scorer, params, recent_window=own.get("window", 32))

    def make_scorer(self, budget, place):
        """The scorer, its recentWindow set to HeadKV's window where it declares one."""
        return self.build_policy(self.scorer, budget, place, **with_window(self.scorer, self.scorer_params,
                                                                          recent_window=self.window))

    def budgets(self, layer: int, b: int, heads: int) -> list[int]:
        """Each head's budget in model layer `layer` at per-head budget `b`."""
        scores = read_table(self.scores).get(layer)
        if scores is None:
            raise ValueError(f"{self.name}: scores {self.scores} has no scores for layer {layer}")
        if len(scores) != heads:
            raise ValueError(f"{self.name}: scores {self.scores} gives layer {layer} {len(scores)} "
                             f"scores, and the layer has {heads} KV heads")
        return head_budgets(scores, b, self._window, self.beta, self.temp)

    def group(self, layer, layers, heads, *, depth=None, depths=None, budget=None):
        group = super().group(layer, layers, heads, depth=depth, depths=depths, budget=budget)
        where = layer if layer is not None else (depth or 0)
        budgets = self.budgets(int(where), group.b, group.heads)
        for g, policy in enumerate(group.policies):
            group.policies[g] = self.make_scorer(budgets[g], policy.place)
        group.state, group.floor, group.cap = budgets, min(budgets), max(budgets)
        return group

    def choose_group(self, group):
        return [p.choose(len(p.held()) - b) if len(p.held()) > b else np.empty(0, np.int64)
                for p, b in zip(group.policies, group.state)]
