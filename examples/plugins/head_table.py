"""head-table: an example kvviz allocator plugin whose per-head budgets come from a table of
head scores, after HeadKV (Fu et al. 2024, arXiv:2410.19258: "Not All Heads Matter").

The table is a JSON file, given as the path parameter `table`: {"layers": {"<model layer>":
[one score per KV head], ...}}, scores finite and >= 0, not all 0 in a layer.
`head_table.json` beside this file (the default) scores SmolLM2-135M's 30 layers x 3 KV
heads; the file says how its scores were made. A path is taken relative to the folder the
command runs in and kept absolute, so a sweep's workers read the same file.

In a layer of H KV heads at per-head budget b, each head keeps a base of
floor((1 - pooled) x b) slots, and the rest of the layer's H x b slots is shared out by
score: head g gets floor(rest x score_g / sum of scores) more. Rounding down may leave a few
slots unused: the layer holds at most H x b. Each head evicts down to its own budget by its
scorer (victims: its own lowest-priority candidates). A layer the table does not score, or
scores for another number of heads, is refused naming the layer.

    kvviz bench --plugin examples/plugins/head_table.py --trace traces/code-kv.npz \
        --policies head-table:table=examples/plugins/head_table.json --budgets 64
"""
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from kvviz.policies import Allocator, param

TABLE = str(Path(__file__).resolve().with_name("head_table.json"))


def read_table(path) -> dict:
    """{layer number: [scores]} from a head-score table file; ValueError saying what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable JSON file ({exc})") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f'{path} has no "layers": {{"<layer>": [scores per KV head]}}')
    out = {}
    for key, scores in layers.items():
        if not str(key).isdigit():
            raise ValueError(f"{path}: layer {key!r} is not a layer number")
        if (not isinstance(scores, list) or not scores
                or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)
                or not all(math.isfinite(s) and s >= 0 for s in scores)):
            raise ValueError(f"{path}: layer {key} must give a list of finite scores >= 0, got {scores!r}")
        out[int(key)] = [float(s) for s in scores]
    return out


def table_file(value: str) -> str:
    """a path to a JSON head-score table ({"layers": {"<layer>": [scores per KV head]}})"""
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"no such file: {value} (relative to {Path.cwd()})")
    read_table(path)
    return str(path.resolve())


@dataclass
class HeadTable(Allocator):
    table: str = param(TABLE, label="table", validate=table_file,
                       help="JSON file of head scores per layer per KV head",
                       source="HeadKV (Fu et al. 2024) scores heads once, offline; the default "
                              "table beside this plugin scores SmolLM2-135M's heads")
    pooled: float = param(0.5, label="pooled", min=0.0, max=1.0, step=0.05,
                          help="share of each head's budget pooled and shared out by score",
                          source="an example choice: HeadKV also gives each head a base budget "
                                 "and shares a pool by head score")

    name = "head-table"
    label = "Head table"
    victim_order = "per_head"

    def head_budgets(self, layer: int, b: int, heads: int) -> list[int]:
        """Each head's budget in model layer `layer` at per-head budget `b`."""
        scores = read_table(self.table).get(layer)
        if scores is None:
            raise ValueError(f"{self.name}: table {self.table} has no scores for layer {layer}")
        if len(scores) != heads:
            raise ValueError(f"{self.name}: table {self.table} gives layer {layer} {len(scores)} "
                             f"scores, and the layer has {heads} KV heads")
        total = sum(Fraction(s) for s in scores)
        if total == 0:
            raise ValueError(f"{self.name}: table {self.table} scores every head of layer {layer} 0")
        base = int((1 - Fraction(repr(self.pooled))) * b)  # floor((1 - pooled) x b), exact
        rest = heads * b - heads * base
        out = [base + int(rest * Fraction(s) / total) for s in scores]
        if min(out) < 1:
            g = out.index(min(out))
            raise ValueError(f"{self.name}: layer {layer}, head {g} gets no slot at budget {b} "
                             f"(score {scores[g]}, pooled={self.pooled}): lower pooled or raise the budget")
        return out

    def group(self, layer, layers, heads, *, depth=None, depths=None):
        group = super().group(layer, layers, heads, depth=depth, depths=depths)
        where = layer if layer is not None else (depth or 0)
        budgets = self.head_budgets(int(where), group.b, group.heads)
        for g, policy in enumerate(group.policies):
            try:
                group.policies[g] = self.make_scorer(budgets[g], policy.place)
            except ValueError as exc:
                raise ValueError(f"{self.name}: layer {where}, head {g} at its budget {budgets[g]}: "
                                 f"{exc}") from None
        group.state, group.floor, group.cap = budgets, min(budgets), max(budgets)
        return group

    def choose_group(self, group):
        return [p.choose(len(p.held()) - b) if len(p.held()) > b else np.empty(0, np.int64)
                for p, b in zip(group.policies, group.state)]
