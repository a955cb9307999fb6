"""Allocators that see across layers and calibrate from the first rows they see: an
allocator's `plan_layers` sets every layer's budget from every layer's calibration rows
before any layer evicts (in the library harness and token by token), and `kvviz bench`
at kv-head granularity gives per-stream policies and allocators rows over the same
streams."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from kvviz.core import plugins
from kvviz.core.groups import AllocatedLayers
from kvviz.core.layers import load_layers, replay_layers
from kvviz.core.policies import make_policy, register_allocator
from kvviz.core.replay import NEVER, run_policy
from kvviz.core.trace import load_trace
from kvviz.policies import Allocator
from kvviz.studies import bench

CODE_KV = "traces/code-kv.npz"


def spread(rows) -> float:
    """A layer's statistic: the mean share of each row's mass outside its 4 newest positions."""
    shares = [float(np.sum(r[:-4]) / np.sum(r)) for head in rows for r in head if len(r) > 4 and np.sum(r) > 0]
    return float(np.mean(shares)) if shares else 0.0


def planned(rows_by_layer, budget: int) -> list[int]:
    """The test rule, by hand: the layer whose rows spread most gains budget // 4 slots per
    head, the one that spreads least gives them (ties to the lower layer); the sum holds."""
    L = len(rows_by_layer)
    out = [budget] * L
    if L > 1:
        stat = [spread(rows) for rows in rows_by_layer]
        most = max(range(L), key=lambda d: (stat[d], -d))
        least = min(range(L), key=lambda d: (stat[d], d))
        out[most] += budget // 4
        out[least] -= budget // 4
    return out


@dataclass
class LayerPlanner(Allocator):
    """Test only: every layer's budget from every layer's first 16 rows (`planned`)."""

    name = "layer-planner"
    label = "Layer planner"
    seen: ClassVar[list] = []

    def calibration_rows(self):
        return 16

    def plan_layers(self, rows_by_layer):
        type(self).seen.append(rows_by_layer)
        return planned(rows_by_layer, self.budget)


@dataclass
class WrongSum(LayerPlanner):
    name = "wrong-sum-planner"
    label = "Wrong sum"

    def plan_layers(self, rows_by_layer):
        return [self.budget + 1] * len(rows_by_layer)


@pytest.fixture(autouse=True)
def registered():
    register_allocator(LayerPlanner)
    register_allocator(WrongSum)
    LayerPlanner.seen = []
    yield
    plugins.forget()


class GridInputs:
    """Step t of a grid's streams (flattened layer by layer), as a StreamGroup reads it."""

    def __init__(self, streams, t):
        self.streams, self.t = streams, t

    def weights(self, s, held):
        return self.streams[s].row(self.t)[held]

    def key_norm(self, s):
        return self.streams[s].key_norm(self.t)

    def value_norm(self, s):
        return self.streams[s].value_norm(self.t)


def token_by_token(grid, alloc) -> np.ndarray:
    """The allocator stepped token by token, never calibrated by the caller: (L, heads, T) log."""
    L, heads, T = len(grid), len(grid[0]), grid[0][0].steps
    allocated = AllocatedLayers([alloc.group(row[0].layer, None, heads, depth=d, depths=L)
                                 for d, row in enumerate(grid)])
    streams = [tr for row in grid for tr in row]
    evicted = np.full((L * heads, T), NEVER, np.int64)
    for t in range(T):
        which, victims = allocated.step(t, GridInputs(streams, t))
        evicted[which, victims] = t
    return evicted.reshape(L, heads, T)


def test_an_allocator_plans_every_layers_budget_from_every_layers_rows_in_the_library_harness():
    grid = load_layers(CODE_KV)  # layers 0, 14, 29 x kv0..kv2
    run = replay_layers(grid, make_policy("layer-planner", 64, scorer="tova"))
    (rows,) = LayerPlanner.seen  # called once, with every layer's rows
    assert [len(r) for r in rows] == [3, 3, 3] and all(len(head) == 16 for r in rows for head in r)
    for d, row in enumerate(grid):
        for g, tr in enumerate(row):
            for t in range(16):  # row t of the stream, read with the full cache
                assert np.array_equal(rows[d][g][t], tr.row(t))
    want = planned([[[tr.row(t) for t in range(16)] for tr in row] for row in grid], 64)
    assert run.budgets == want and want != [64] * 3 and sum(want) == 3 * 64
    assert run.held[:, :, -1].sum(axis=1).tolist() == [3 * b for b in want]  # each layer at its planned total


def test_a_plan_that_breaks_the_sum_is_refused_naming_the_allocator_and_the_rule():
    with pytest.raises(ValueError, match=r"wrong-sum-planner \(scorer tova\): plan_layers' budgets must sum to "
                                         r"layers x budget = 3 x 64 = 192, got 195"):
        replay_layers(load_layers(CODE_KV), make_policy("wrong-sum-planner", 64, scorer="tova"))


@pytest.mark.parametrize("name, params", [("layer-planner", {"scorer": "tova"}),
                                          ("headroles", {"scorer": "tova", "calibration": 24})])
def test_token_by_token_an_allocator_calibrates_on_the_first_rows_it_sees(name, params):
    """Read token by token, an allocator that asks for calibration rows gets the first ones
    it sees (no eviction comes before them at these budgets): the same log as the harness
    that hands it the rows before step 0."""
    grid = load_layers(CODE_KV)
    up_front = replay_layers(grid, make_policy(name, 64, **params))
    LayerPlanner.seen = []
    stepped = token_by_token(grid, make_policy(name, 64, **params))
    want = np.array([[run.evicted_at for run in row] for row in up_front.runs])
    assert np.array_equal(stepped, want)
    assert (stepped != NEVER).any()


def test_token_by_token_an_allocator_calibrates_before_a_layer_must_evict():
    """Head roles asking for more rows than the budget allows before the first eviction:
    it calibrates on rows 0..budget at the step where its layers must first evict."""
    grid = load_layers(CODE_KV, [14])
    alloc = make_policy("headroles", 40, scorer="tova", calibration=256)
    stepped = token_by_token(grid, alloc)
    first = stepped[stepped != NEVER].min()
    assert first == 40  # the step where each head first holds 41 > 40
    want = make_policy("headroles", 40, scorer="tova", calibration=41)  # the rows it had: 0..40
    assert np.array_equal(stepped, np.array([[r.evicted_at for r in row]
                                             for row in replay_layers(grid, want).runs]))


def test_bench_at_kv_head_granularity_gives_per_stream_policies_rows_over_the_allocators_streams():
    trace = bench.open_trace(CODE_KV, 14)
    table = bench.table(trace, [64], ["tova", "adakv:scorer=tova", "h2o"])
    rows = {r["policy"]: r for r in table.rows}
    assert {r["granularity"] for r in table.rows} == {"kv-head"}
    # by hand: tova on each KV head of layer 14 alone, metrics averaged, memory summed
    runs = [run_policy(load_trace(CODE_KV, layer=14, head=f"kv{g}"), "tova", 64) for g in range(3)]
    from kvviz.core.metrics import summary

    found = [summary(load_trace(CODE_KV, layer=14, head=f"kv{g}"), run) for g, run in enumerate(runs)]
    assert rows["tova"]["retained_mass"] == pytest.approx(np.mean([f["retained_mass"] for f in found]), abs=1e-12)
    assert rows["tova"]["hh_recall"] == pytest.approx(np.mean([f["hh_recall"] for f in found]), abs=1e-12)
    assert rows["tova"]["memory_bytes"] == 3 * 64 * runs[0].bytes_per_slot
    assert rows["tova"]["memory_bytes"] == rows["adakv"]["memory_bytes"]  # the same budget, the same bytes
    assert any("granularity kv-head: every row is the 3 KV-head streams of layer 14" in n for n in table.notes)
    assert bench.describe(trace, table) == "trace: code-kv (512 steps), every KV head of stored layers 0, 14, 29"
    alone = bench.table(trace, [64], ["tova"])  # no allocator: the one stream chosen
    assert [r["granularity"] for r in alone.rows] == ["mean"]
    assert alone.rows[0]["memory_bytes"] == 64 * runs[0].bytes_per_slot
    assert bench.describe(trace, alone).endswith("model layer 14 of stored 0, 14, 29, head mean")
    with pytest.raises(ValueError, match="--head kv0 picks one stream, and adakv is an allocator"):
        bench.table(bench.open_trace(CODE_KV, 14, "kv0"), [64], ["tova", "adakv"])


def test_kvviz_check_plans_the_layers_as_a_run_does():
    from kvviz.core.check_alloc import check_allocator

    results = check_allocator(lambda b: make_policy("layer-planner", budget=b))
    assert all(r.passed for r in results), [r for r in results if not r.passed]
    assert LayerPlanner.seen and len(LayerPlanner.seen[0]) == 2  # every layer's rows, at once
    wrong = {r.name: r for r in check_allocator(lambda b: make_policy("wrong-sum-planner", budget=b))}
    assert not wrong["total"].passed
    assert "its layer plan: wrong-sum-planner (scorer tova): plan_layers' budgets must sum" in wrong["total"].detail
