"""The victims a policy or allocator reports are checked against its held set at every step:
exactly the positions that left it, each once. A plugin that hides one eviction in ten
(its held set stays at the budget, so the held count alone cannot tell) is stopped in one
line naming the policy, the stream and the step by the library, `kvviz bench`, `kvviz
perf`, a sweep cell, the model loop and `kvviz.hf`; an allocator whose layer group
misreports is stopped by step_layer; an allocator that leaves room unused is within its
contract."""
import os
import subprocess
import sys

import numpy as np
import pytest
from apphelp import REPO

from kvviz.core import harness, plugins
from kvviz.core.layers import load_layers, replay_layers
from kvviz.core.policies import ALLOCATORS, POLICIES, make_policy
from kvviz.core.policies.base import BudgetError, VictimError
from kvviz.core.policies.h2o import H2O
from kvviz.core.replay import NEVER, run_policy
from kvviz.core.streams import Streams
from kvviz.studies.bench import open_trace

CODE_KV = str(REPO / "traces" / "code-kv.npz")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
BUGGY = '''
import numpy as np

from kvviz.core.policies.h2o import H2O


class H2OBuggy(H2O):
    """H2O, except that every tenth call of `evict` reports no victims (it still evicts)."""

    name = "h2o-buggy"
    label = "H2O, one report in ten lost"

    def evict(self, budget):
        victims = super().evict(budget)
        self.calls = getattr(self, "calls", 0) + 1
        return np.empty(0, np.int64) if self.calls % 10 == 0 else victims
'''
MISREPORTS = '''
from dataclasses import dataclass

from kvviz.core.policies.adakv import AdaKV
from kvviz.core.policies.alloc import LayerGroup


class HidesOne(LayerGroup):
    """Drops what the allocator chose, but reports head 1's victims without its last."""

    def evict(self):
        out = super().evict()
        out[1] = out[1][:-1]
        return out


class ClaimsOne(LayerGroup):
    """Reports, beside head 0's victims, a position head 0 still holds."""

    def evict(self):
        out = super().evict()
        if len(out[0]):
            out[0] = sorted(set(out[0].tolist()) | {int(self.policies[0].held()[0])})
        return out


@dataclass
class AdaKVHides(AdaKV):
    name = "adakv-hides"
    label = "AdaKV, head 1's last victim unreported"

    def group(self, *args, **kwargs):
        found = super().group(*args, **kwargs)
        found.__class__ = HidesOne
        return found


@dataclass
class AdaKVClaims(AdaKV):
    name = "adakv-claims"
    label = "AdaKV, one victim too many reported"

    def group(self, *args, **kwargs):
        found = super().group(*args, **kwargs)
        found.__class__ = ClaimsOne
        return found
'''
SPARE = '''
from dataclasses import dataclass

from kvviz.core.policies.adakv import AdaKV
from kvviz.core.policies.alloc import shared_victims


@dataclass
class AdaKVSpare(AdaKV):
    """AdaKV that leaves one slot of each layer's total unused."""

    name = "adakv-spare"
    label = "AdaKV, one slot spare"

    def choose_layer(self, policies, b):
        return shared_victims(policies, len(policies) * b - 1, self.floor(b))
'''


@pytest.fixture(autouse=True)
def _registry_left_as_found():
    policies, allocators = list(POLICIES), list(ALLOCATORS)
    yield
    plugins.forget()
    assert list(POLICIES) == policies and list(ALLOCATORS) == allocators


@pytest.fixture
def buggy(tmp_path):
    path = tmp_path / "h2o_buggy.py"
    path.write_text(BUGGY)
    return path


def kvviz_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvviz", *map(str, args)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)


def plain_h2o_victim(step: int, budget: int = 64, trace=None) -> int:
    """The position plain H2O evicts at `step` of bench's default stream of code-kv."""
    run = run_policy(trace or open_trace(CODE_KV, None, None), "h2o", budget)
    (pos,) = np.flatnonzero(run.evicted_at == step)
    return int(pos)


# The tenth call of `evict` is at step 9, then 19, 29, ...; at budget 64 the first of them
# that evicts anything is step 69, the first step whose report the plugin drops.
FIRST_HIDDEN = 69


# -- the check itself -------------------------------------------------------------------
def test_exact_victims_pass_in_any_order_and_come_back_as_int64():
    before = np.array([3, 5, 8, 13, 21], np.int64)
    got = harness.check_victims("p", before, np.array([3, 13, 21]), [8, 5], 7)
    assert got.dtype == np.int64 and sorted(got.tolist()) == [5, 8]
    assert harness.check_victims("p", before, before.copy(), [], 7).tolist() == []
    # a held set kept in another order is the same set
    assert harness.check_victims("p", before[::-1], np.array([21, 3, 13]), np.array([5, 8]), 7).tolist() == [5, 8]


@pytest.mark.parametrize("after, victims, said", [
    ([3, 5, 13, 21], [], "0 victims at step 7 in stream s1, but 1 position left its held set unreported: 8"),
    ([3, 5, 13, 21], [5, 8], "2 victims (5, 8) at step 7 in stream s1, but 1 reported victim is still held: 5"),
    ([3, 5, 13, 21], [8, 34], "1 reported victim was not held: 34"),
    ([3, 5, 13, 21], [8, 8], "8 was reported more than once"),
    ([3, 5, 13, 21, 99], [8], "1 position joined its held set while it evicted: 99"),
    ([3, 21], [5, 8], "1 position left its held set unreported: 13"),
])
def test_each_kind_of_wrong_report_is_refused_naming_what_differs(after, victims, said):
    before = np.array([3, 5, 8, 13, 21], np.int64)
    with pytest.raises(VictimError) as exc:
        harness.check_victims("mine", before, np.array(after, np.int64), victims, 7, "s1")
    msg = str(exc.value)
    assert msg.startswith("mine reported ") and said in msg and "\n" not in msg
    assert isinstance(exc.value, BudgetError)


def test_victims_that_are_not_integer_positions_are_refused():
    with pytest.raises(VictimError, match="not positions at step 4"):
        harness.check_victims("mine", np.arange(5), np.arange(4), [4.0], 4)


def test_a_policy_that_hides_a_victim_is_stopped_by_the_library(buggy):
    assert plugins.load_plugin(str(buggy)) == ["h2o-buggy"]
    trace = open_trace(CODE_KV, None, None)
    with pytest.raises(VictimError) as exc:
        run_policy(trace, "h2o-buggy", 64)
    gone = plain_h2o_victim(FIRST_HIDDEN, trace=trace)
    assert str(exc.value) == (
        f"h2o-buggy reported 0 victims at step {FIRST_HIDDEN} in stream code-kv (layer 0), but 1 position "
        f"left its held set unreported: {gone} (victims must be exactly the positions that left "
        "the held set)")
    # the built-in it subclasses runs through the same check untouched, every step
    run = run_policy(trace, "h2o", 64)
    assert (run.held[64:] == 64).all()


def test_a_one_pass_prefill_checks_its_one_eviction():
    class Silent(H2O):
        name = "silent-test"

        def evict(self, budget):
            super().evict(budget)
            return np.empty(0, np.int64)

    T, budget = 40, 8
    raw = np.tril(np.random.default_rng(0).random((T, T)), -1).astype(np.float32)
    policy = Silent(budget=budget, recent_window=2)
    tail, sums, streamed = harness.prefill_needs(policy, T)
    rows = harness.PromptRows(T, tail, sums, [policy] if streamed else [])
    rows.add(0, raw)
    with pytest.raises(VictimError, match=rf"silent-test reported 0 victims at step {T - 1} in stream "
                                          rf"kv1, but {T - budget} positions left its held set unreported"):
        harness.prefill(policy, rows, T, budget, stream="kv1")


def test_a_streams_group_that_misreports_one_stream_is_refused_naming_that_stream():
    class Lying(Streams):
        def evict(self, budget):
            victims = super().evict(budget)
            if victims.shape[1]:
                victims = victims.copy()
                victims[2, 0] = self.kept(2)[0]  # stream 2 names a position it still holds
            return victims

    S, B = 4, 6
    group = Lying(make_policy("tova", B), S, offsets=np.arange(S) * 100, names=[f"kv{s}" for s in range(S)])
    rng = np.random.default_rng(1)
    with pytest.raises(VictimError) as exc:
        for t in range(B + 2):
            harness.step(group, t, rng.random((S, group.n)).astype(np.float32), B)
    msg = str(exc.value)
    assert t == B and f"tova reported 1 victim ({group.kept(2)[0]}) at step {B} in stream kv2, but " in msg
    assert "1 position left its held set unreported" in msg and "1 reported victim is still held" in msg
    honest = Streams(make_policy("tova", B), S, offsets=np.arange(S) * 100)
    for t in range(B + 2):  # the same rows through the honest group: no refusal
        harness.step(honest, t, rng.random((S, honest.n)).astype(np.float32), B)


# -- the command line ------------------------------------------------------------------
def test_bench_stops_the_plugin_in_one_line_naming_policy_step_and_stream(buggy):
    r = kvviz_cli("bench", "--trace", CODE_KV, "--policies", "h2o-buggy", "--budgets", "64", "--plugin", buggy)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    gone = plain_h2o_victim(FIRST_HIDDEN)
    assert lines[0] == (f"error: h2o-buggy reported 0 victims at step {FIRST_HIDDEN} in stream "
                        f"code-kv (layer 0), but 1 position left its held set unreported: {gone} "
                        "(victims must be exactly the positions that left the held set)")
    assert "h2o-buggy" not in r.stdout  # no table with its row


def test_perf_stops_the_plugin_in_one_line(buggy):
    r = kvviz_cli("perf", "--policies", "h2o-buggy", "--budget", "64", "--steps", "256",
                  "--long-steps", "0", "--plugin", buggy)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: h2o-buggy reported 0 victims at step {FIRST_HIDDEN} in stream canonical")


def test_a_sweep_fails_the_plugins_cell_with_the_message_and_exits_non_zero(buggy, tmp_path):
    (tmp_path / "spec.toml").write_text(
        f'traces = ["{CODE_KV}"]\nlayers = [14]\nbudgets = [64]\n'
        '[[policies]]\nname = "h2o"\n[[policies]]\nname = "h2o-buggy"\n')
    r = kvviz_cli("sweep", tmp_path / "spec.toml", "--out", tmp_path / "out", "--quiet", "--plugin", buggy)
    assert r.returncode == 1, r.stderr
    import pandas as pd

    df = pd.read_csv(tmp_path / "out" / "results.csv")
    row = df.set_index("policy").loc["h2o-buggy"]
    assert df.set_index("policy").loc["h2o", "status"] == "ok"
    assert row["status"] == "error" and row["error"].startswith(
        f"VictimError: h2o-buggy reported 0 victims at step {FIRST_HIDDEN} in stream ")
    assert "left its held set unreported" in row["error"] and "(layer 14)" in row["error"]
    assert "1 of 2 cells failed" in r.stderr and "h2o-buggy reported 0 victims" in r.stderr


# -- allocators ----------------------------------------------------------------------------
def first_loss(found, head: int) -> tuple[int, int, list]:
    """(step, model layer, positions): the first step at which `head` of some layer loses
    a slot in an allocator's replay (ties: the first layer stepped), and what it lost."""
    steps = [(int(run.evicted_at[run.evicted_at != NEVER].min()), d)
             for d, run in enumerate(r[head] for r in found.runs)]
    t, d = min(steps)
    return t, found.layer_numbers[d], np.flatnonzero(found.runs[d][head].evicted_at == t).tolist()


def test_step_layer_stops_an_allocator_group_that_hides_a_victim(tmp_path):
    path = tmp_path / "misreports.py"
    path.write_text(MISREPORTS)
    assert plugins.load_plugin(str(path)) == ["adakv-hides", "adakv-claims"]
    grid = load_layers(CODE_KV)
    with pytest.raises(VictimError) as exc:
        replay_layers(grid, make_policy("adakv-hides", 16))
    # plain AdaKV's replay says where head 1 first loses slots and which: the last goes unreported
    t, layer, lost = first_loss(replay_layers(grid, make_policy("adakv", 16)), 1)
    shown = f" ({', '.join(map(str, lost[:-1]))})" if len(lost) > 1 else ""
    assert str(exc.value) == (
        f"adakv-hides (scorer tova) reported {len(lost) - 1} victim{'' if len(lost) == 2 else 's'}{shown} at "
        f"step {t} in stream layer {layer}, head 1, but 1 position left its held set unreported: "
        f"{lost[-1]} (victims must be exactly the positions that left the held set)")
    with pytest.raises(VictimError, match=r"adakv-claims \(scorer tova\) reported .* head 0, but 1 reported "
                                          r"victim is still held"):
        replay_layers(grid, make_policy("adakv-claims", 16))


def test_bench_stops_a_misreporting_allocator_in_one_line(tmp_path):
    path = tmp_path / "misreports.py"
    path.write_text(MISREPORTS)
    r = kvviz_cli("bench", "--trace", CODE_KV, "--layer", "14", "--policies", "adakv-hides", "--budgets", "64",
                  "--plugin", path)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: adakv-hides (scorer tova) reported ")
    assert "in stream layer 14, head 1, but 1 position left its held set unreported" in line


def test_an_allocator_may_leave_room_unused_and_its_held_counts_are_recorded(tmp_path):
    path = tmp_path / "spare.py"
    path.write_text(SPARE)
    plugins.load_plugin(str(path))
    found = replay_layers(load_layers(CODE_KV), make_policy("adakv-spare", 16))
    totals = found.held.sum(axis=1)  # (layers, steps): each layer's held count after each step
    assert totals.max() == 3 * 16 - 1 and (totals[:, -1] == 3 * 16 - 1).all()
    assert found.held_at_end().sum(axis=1).tolist() == [3 * 16 - 1] * 3


# -- the model loop and kvviz.hf ------------------------------------------------------------
TEXT = ("The elements are listed by atomic number. Hydrogen is the lightest; helium follows it. "
        "Lithium, beryllium and boron come next, then carbon, nitrogen and oxygen.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, torch_stack):
    sys.path.insert(0, str(REPO / "scripts"))
    import tiny_model

    folder = tmp_path_factory.mktemp("victims") / "tiny"
    tiny_model.build("llama", folder)
    from kvviz.model.models import load_model

    return load_model(str(folder))


@pytest.mark.parametrize("gran, stream", [("kv-head", "layer 0: h2o-buggy reported 0 victims at step 19 in stream "
                                                     "head 0, but 1 position left"),
                                          ("layer", "layer 0: h2o-buggy reported 0 victims at step 19, but 1 "
                                                    "position left")])
def test_the_loop_stops_the_plugin_naming_configuration_layer_and_head(buggy, tiny, torch_stack, gran, stream):
    from kvviz.model.loop import LoopConfig, run_loop

    plugins.load_plugin(str(buggy))
    with pytest.raises(VictimError) as exc:  # budget 16: the tenth call (step 9) evicts nothing, step 19 does
        run_loop(TEXT, [LoopConfig("h2o-buggy", {"recent_window": 4}, 16)], granularity=gran, max_tokens=32,
                 model=tiny, rows_layers=[])
    assert str(exc.value).startswith(f"h2o-buggy(recent_window=4)@16, {stream}"), str(exc.value)


def test_kvviz_hf_stops_the_plugin_inside_generate(buggy, tiny, torch_stack):
    import torch

    import kvviz.hf

    plugins.load_plugin(str(buggy))
    tok, mdl = tiny
    ids = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"]])
    with pytest.raises(VictimError, match=r"h2o-buggy reported 0 victims at step \d+ in stream head \d, but 1 "
                                          r"position left its held set unreported"):
        with kvviz.hf.evicting(mdl, policy="h2o-buggy", budget=8, recent_window=2):
            mdl.generate(ids, max_new_tokens=24, do_sample=False)
    assert mdl.config._attn_implementation == "eager"
