"""Head roles, after DuoAttention (Xiao et al. 2024, arXiv:2410.10819): retrieval heads and
streaming heads.

A share of each layer's KV heads (`retrievalShare`: ceil(share x heads), at least one) are
retrieval heads: each keeps its scorer's choice at a larger budget. The rest are streaming
heads: each keeps its first `streamSinks` positions and its `streamRecent` newest: once the
roles are known its scorer is replaced by StreamingLLM (kvviz's streaming-llm, sinks =
streamSinks) at sinks + recent slots. The layer's total stays heads x budget: with S
streaming heads of s = sinks + recent slots, the R retrieval heads share
heads x budget - S x s, floor(that / R) each, the remainder one each to the retrieval heads
with the largest proxy (below).

Which heads retrieve is decided once per layer, before the first step, from calibration
rows: the first `calibration` rows of every head's stream read with the full cache (row t
over positions 0..t-1, as the model computed it before any eviction). Each head's proxy is
its mean attention share outside sinks + recent window, the mass a streaming head would not
hold, over the calibration rows that have any position there (rows with no mass are
skipped); the heads with the largest proxy retrieve (ties: the lower head). This is a
proxy: DuoAttention learns a gate per head by optimisation on synthetic retrieval data.

A role table (`roleTable`, a JSON file `kvviz calibrate headroles` writes: {"layers":
{"<model layer>": [proxy per KV head]}}) gives the proxies instead, measured offline on
pass-key prompts kvviz builds (the same share outside sinks + recent window, at the queries
that answer the pass key): then no calibration rows are read, and each layer's roles are
set from its table row when the layer is built, before the first step.

Eviction follows the total as every allocator does: nothing goes while the layer holds at
most heads x budget; when it holds more, exactly the excess goes, one slot at a time from
the head furthest over its own budget (ties: a streaming head before a retrieval head, then
the lower head), each head's slots chosen by its own policy (a streaming head's oldest
non-sinks, a retrieval head's scorer's choice); no head goes below its own budget, so a
streaming head ends at sinks + recent and a retrieval head at its larger budget.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from kvviz.core.policies.alloc import Allocator
from kvviz.core.policies.base import param


def outside_share(rows, sinks: int, recent: int) -> float:
    """One head's proxy: the mean, over rows with any position outside the first `sinks`
    and the `recent` newest, of the row's mass there over its whole mass (float64)."""
    shares = []
    for row in rows:
        row = np.asarray(row, np.float64)
        lo, hi = sinks, len(row) - recent
        total = row.sum()
        if hi <= lo or not total > 0:
            continue
        shares.append(row[lo:hi].sum() / total)
    return float(np.mean(shares)) if shares else 0.0


def read_roles(path) -> dict:
    """{model layer: [proxy per KV head]} from a role table file; ValueError saying what is
    wrong with it."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"role_table: {path} is not a readable JSON file ({exc})") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f'role_table: {path} has no "layers": {{"<layer>": [proxy per KV head]}}')
    out = {}
    for key, row in layers.items():
        if not str(key).isdigit():
            raise ValueError(f"role_table: {path}: layer {key!r} is not a layer number")
        if (not isinstance(row, list) or not row
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)
                or not all(math.isfinite(x) and 0 <= x <= 1 for x in row)):
            raise ValueError(f"role_table: {path}: layer {key} must give a list of shares in 0..1, got {row!r}")
        out[int(key)] = [float(x) for x in row]
    return out


def role_table_file(value: str) -> str:
    """empty, or a path to a JSON role table ({"layers": {"<layer>": [proxy per KV head]}})"""
    if not str(value).strip():
        return ""
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ValueError(f"role_table: no such file: {value} (relative to {Path.cwd()})")
    read_roles(path)
    return str(path.resolve())


@dataclass(frozen=True)
class Roles:
    """One layer's roles: the proxy per head, which heads retrieve, and each head's budget."""

    proxy: tuple
    retrieval: tuple  # bool per head
    budgets: tuple    # int per head


@dataclass
class HeadRoles(Allocator):
    share: float = param(
        0.5, label="retrievalShare", min=0.0, max=1.0, step=0.05,
        help="share of each layer's KV heads that are retrieval heads: ceil(share x heads), "
             "at least one",
        source="DuoAttention (Xiao et al. 2024) deploys 50% retrieval heads on GQA models "
               "(25% on MHA); SmolLM2 is GQA")
    stream_sinks: int = param(
        4, label="streamSinks", min=0, ui_max=64,
        help="first positions a streaming head keeps",
        source="Xiao et al. 2024 (StreamingLLM): four initial tokens as attention sinks")
    stream_recent: int = param(
        28, label="streamRecent", min=1, ui_max=1024,
        help="newest positions a streaming head keeps (with its sinks: its whole cache)",
        source="kvviz choice: a streaming head of 32 slots, small beside the budgets kvviz "
               "tables show (64-1024); DuoAttention's streaming heads are likewise constant-length")
    calibration: int = param(
        256, label="calibration", min=1, ui_max=4096,
        help="rows of each head's stream, read with the full cache before eviction starts, "
             "that decide the roles",
        source="kvviz choice: the first 256 rows of the trace (DuoAttention calibrates offline "
               "on synthetic passkey data)")

    role_table: str = param(
        "", label="roleTable", validate=role_table_file,
        help="a role table from `kvviz calibrate headroles` (each head's proxy measured on "
             "pass-key prompts); empty: the proxy from the run's first `calibration` rows",
        source="DuoAttention (Xiao et al. 2024) identifies its heads offline on synthetic "
               "passkey data; kvviz's table is a training-free proxy of that")

    name = "headroles"
    label = "Head roles"
    victim_order = "per_head"  # each head's slots are its own policy's choice
    reference = "kvviz.core.reference_alloc:RefHeadRoles"

    def check_params(self):
        if self.share <= 0:
            raise ValueError(f"share must be above 0 (retrievalShare): share={self.share} leaves "
                             "no retrieval head to hold the rest of the layer's slots")
        s = self.stream_sinks + self.stream_recent
        if s > self.budget:
            raise ValueError(f"stream_sinks + stream_recent must be at most the budget: "
                             f"{self.stream_sinks} + {self.stream_recent} = {s} > budget={self.budget}")

    # -- roles ---------------------------------------------------------------------
    def retrieval_count(self, heads: int) -> int:
        """ceil(share x heads), exact on share's decimal spelling, at least 1."""
        return max(1, min(heads, math.ceil(Fraction(repr(float(self.share))) * heads)))

    def streaming_slots(self) -> int:
        """The slots a streaming head holds: its sinks and its recent window."""
        return self.stream_sinks + self.stream_recent

    def _retrieval_budget(self, b: int, heads: int) -> tuple[int, int]:
        """(each retrieval head's base budget, how many get one more)."""
        r = self.retrieval_count(heads)
        pool = heads * b - (heads - r) * self.streaming_slots()
        return pool // r, pool % r

    def roles(self, proxy, b: int) -> Roles:
        """The roles and budgets for per-head budget `b` from each head's proxy."""
        heads = len(proxy)
        ranked = sorted(range(heads), key=lambda g: (-proxy[g], g))
        r = self.retrieval_count(heads)
        base, extra = self._retrieval_budget(b, heads)
        budgets = [self.streaming_slots()] * heads
        retrieval = [False] * heads
        for k, g in enumerate(ranked[:r]):
            retrieval[g] = True
            budgets[g] = base + (k < extra)
        return Roles(tuple(float(p) for p in proxy), tuple(retrieval), tuple(budgets))

    def calibration_rows(self):
        return 0 if self.role_table else self.calibration

    def group(self, layer, layers, heads, **kw):
        group = super().group(layer, layers, heads, **kw)
        if self.role_table:  # the roles from the table, before the first step
            table = read_roles(self.role_table)
            if layer is None or int(layer) not in table:
                raise ValueError(f"role_table: {self.role_table} has no layer {layer} (it gives layers "
                                 f"{sorted(table)}): calibrate it on this model")
            proxy = table[int(layer)]
            if len(proxy) != group.heads:
                raise ValueError(f"role_table: {self.role_table} gives layer {layer} {len(proxy)} heads, "
                                 f"and this layer has {group.heads} KV heads: calibrate it on this model")
            group.state = self.assign(proxy, group)
            group.calibrated = True
        return group

    def calibrate(self, rows, group):
        sinks, recent = self.stream_sinks, self.stream_recent
        return self.assign([outside_share(r[: self.calibration], sinks, recent) for r in rows], group)

    def assign(self, proxy, group) -> Roles:
        """The layer's roles from each head's proxy; its streaming heads become StreamingLLM."""
        sinks = self.stream_sinks
        roles = self.roles(proxy, group.b)
        for g, retrieves in enumerate(roles.retrieval):
            if not retrieves:  # before the first step: nothing observed is lost
                group.policies[g] = self.build_policy("streaming-llm", self.streaming_slots(),
                                                      group.policies[g].place, sinks=sinks)
        return roles

    # -- the layer's slots ------------------------------------------------------------
    def floor(self, b):
        return min(b, self.streaming_slots())

    def cap(self, b, heads):
        base, extra = self._retrieval_budget(b, heads)
        return base + (extra > 0)

    def choose_group(self, group):
        roles = group.state
        if roles is None:
            raise ValueError(f"{self.name} decides its heads' roles from calibration rows read "
                             "before eviction starts, and this layer was given none: replay it "
                             "with kvviz.core.layers.replay_layers (or call group.calibrate)")
        counts = group.held_counts()
        over = counts - np.array(roles.budgets)
        excess = int(counts.sum()) - group.total
        take = np.zeros(group.heads, np.int64)
        for _ in range(max(excess, 0)):  # one slot from the head furthest over its budget
            g = max(range(group.heads), key=lambda h: (over[h], not roles.retrieval[h], -h))
            over[g] -= 1
            take[g] += 1
        return [p.choose(int(k)) if k else np.empty(0, np.int64)
                for p, k in zip(group.policies, take)]
