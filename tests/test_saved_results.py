"""A saved result outlives the policy's code: a loop result, a generation, a needle run and
a sweep, each made with a plugin file in this process, load in a fresh process that never
loads the plugin, with the policy's name, parameters, source hash and origin recorded."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from apphelp import REPO

from kvviz.core import plugins
from kvviz.core.replay import NEVER

PLUGIN_SOURCE = textwrap.dedent('''
    from dataclasses import dataclass
    from kvviz.core.policies.tova import Tova
    from kvviz.policies.base import param

    @dataclass
    class Mine(Tova):
        weight: float = param(0.5, label="weight", min=0.0, max=1.0, help="h", source="s")
        name = "mine-only-here"
        label = "a policy only this file defines"
    ''')


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "mine_only.py"
    path.write_text(PLUGIN_SOURCE)
    assert plugins.load_plugins([str(path)]) == []
    yield path
    plugins.forget()


def fresh(code: str, cwd) -> str:
    """Run `code` in a new interpreter that has not loaded the plugin; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "KVVIZ_PLUGINS"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def expected_source(path) -> dict:
    return {"origin": "file", "where": str(path.resolve()),
            "sha256": hashlib.sha256(path.read_text().encode()).hexdigest()}


def configs():
    from kvviz.model.loop import LoopConfig

    return [LoopConfig("full"), LoopConfig("mine-only-here", {"weight": 0.25}, 3), LoopConfig("tova", {}, 3)]


def test_a_loop_result_loads_without_its_plugin(plugin, tmp_path):
    from kvviz.model.loop import LoopResult

    cfgs = configs()
    T = 5
    ev = np.full((3, 1, 1, T), NEVER, np.int64)
    ev[1, 0, 0, 1] = 3  # the plugin's row evicted position 1 at step 3
    res = LoopResult(configs=cfgs, granularity="layer", tokens=list("abcde"), token_ids=np.arange(T),
                     nll=np.ones((3, T - 1)), p_true=np.full((3, T - 1), 0.5), kl_tokens=np.zeros((3, T - 1)),
                     top1=np.zeros((3, T - 1), np.int64), evicted_at=ev, layers=[0])
    res.save(tmp_path / "loop.npz")
    out = fresh("""
        import json
        from kvviz.core.policies import POLICIES
        from kvviz.model.loop import load_loop_result
        res = load_loop_result("loop.npz")
        assert "mine-only-here" not in POLICIES
        c = res.configs[1]
        run = res.run(1, layer=0)
        print(json.dumps({"label": c.label, "params": c.full_params(), "source": c.source,
                          "record": c.record(), "evicted": run.evicted_at.tolist(), "bytes": run.bytes_per_slot,
                          "tova": res.configs[2].source["origin"]}))
        try:
            c.make()
        except ValueError as exc:
            print(exc)
        """, tmp_path)
    got, refusal = out.splitlines()
    got = json.loads(got)
    assert got["label"] == "mine-only-here(weight=0.25)@3"
    assert got["params"] == {"weight": 0.25}
    assert got["source"] == expected_source(plugin)
    assert got["record"]["source"] == got["source"]  # re-saved as it was recorded
    assert got["evicted"] == [-1, 3, -1, -1, -1]
    assert got["bytes"] == 4 + 8 + 1  # TOVA's float64 score column, as the base class counts
    assert got["tova"] == "built-in"
    assert refusal.startswith("policy 'mine-only-here' is not registered in this process; this config was "
                              f"recorded from file {plugin.resolve()}")


def test_a_generation_loads_without_its_plugin(plugin, tmp_path):
    from kvviz.model.loop import Generation

    cfgs = configs()
    gen = Generation(configs=cfgs, granularity="layer", prompt_mode="decode", prompt_ids=[1, 2, 3],
                     tokens=["a", "b", "c"], new_ids=[[7, 8], [7, 9], [7, 8]],
                     logprobs=[[-0.1, -0.2], [-0.1, -0.3], [-0.1, -0.2]], texts=["x", "y", "x"],
                     stopped=["length"] * 3, evicted_at=np.full((3, 1, 1, 5), NEVER))
    gen.save(tmp_path / "g.json")
    out = fresh("""
        from kvviz.model.loop import load_generation
        g = load_generation("g.json")
        print(g.labels); print(g.departure); print(g.configs[1].source["origin"], g.configs[1].source["sha256"])
        """, tmp_path)
    labels, departure, source = out.splitlines()
    assert labels == "['full', 'mine-only-here(weight=0.25)@3', 'tova@3']"
    assert departure == "[-1, 1, -1]"
    assert source == f"file {expected_source(plugin)['sha256']}"


def test_a_needle_run_and_its_tables_load_without_its_plugin(plugin, tmp_path):
    from kvviz.model.needle.results import save_run

    cfgs = configs()
    ev = np.full((3, 2, 1, 8), NEVER)
    ev[1, :, 0, 2] = 5  # the plugin's row loses key position 2 at step 5 in both layers
    meta = {"id": "L6-d50-s0-decode-layer", "length": 6, "depth": 50, "seed": 0, "prompt_mode": "decode",
            "granularity": "layer", "key": "42", "key_positions": [2, 3], "question_start": 4, "prompt_len": 6,
            "max_new_tokens": 2, "haystack": {"name": "filler", "sha256": "0"}, "model": {"model": "m"},
            "kvviz_version": "0", "configs": [{**c.record(), "label": c.label} for c in cfgs],
            "answers": ["42", "4", "42"], "correct": [True, False, True], "agreement": [1.0, 0.5, 1.0],
            "layers": 2, "kv_heads": 1}
    save_run(tmp_path, meta, range(6), list("abcdef"), [[1, 2], [1, 3], [1, 2]], ev)
    out = fresh("""
        from kvviz.model.needle.results import load_run, write_tables
        df = write_tables(".")
        print(df.label.tolist()); print(df.first_lost.tolist())
        print(load_run(".", "L6-d50-s0-decode-layer")["meta"]["configs"][1]["source"]["origin"])
        """, tmp_path)
    labels, lost, origin = out.splitlines()
    assert labels == "['full', 'mine-only-here(weight=0.25)@3', 'tova@3']"
    assert lost == "[-1, 5, -1]"
    assert origin == "file"


def test_a_sweep_records_where_each_policy_came_from(plugin, tmp_path):
    from kvviz.studies.sweep.run import run_sweep

    (tmp_path / "spec.toml").write_text('traces = ["canonical"]\nbudgets = [64]\n'
                                        '[[policies]]\nname = "mine-only-here"\nweight = [0.25]\n'
                                        '[[policies]]\nname = "tova"\n')
    run_sweep(tmp_path / "spec.toml", tmp_path / "out", progress=False, plugins=[str(plugin)])
    out = fresh("""
        import json
        import pandas as pd
        df = pd.read_csv("out/results.csv")
        print(df.policy.tolist(), df.weight.tolist()[0])
        print(json.dumps(json.load(open("out/policies.json"))))
        """, tmp_path)
    table, record = out.splitlines()
    assert table == "['mine-only-here', 'tova'] 0.25"
    record = json.loads(record)
    assert record["mine-only-here"] == expected_source(plugin)
    assert record["tova"]["origin"] == "built-in" and record["tova"]["where"] == ""
