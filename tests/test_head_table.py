"""The HeadKV-style example allocator (examples/plugins/head_table.py): per-head budgets from a
head-score table file given as a path parameter, validated by the function its declaration
names; through the library, `kvviz check`, `kvviz bench`, a process-pool sweep started from
another folder (the relative path resolved where it was given), the Heads view's data, and
the model loop and pass-key test, each recording the plugin's file and hash."""
import hashlib
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from apphelp import REPO

from kvviz.core import plugins
from kvviz.core.layers import layer_summary, load_layers, replay_layers
from kvviz.core.policies import make_policy, parse_params

PLUGIN = str(REPO / "examples" / "plugins" / "head_table.py")
TABLE = REPO / "examples" / "plugins" / "head_table.json"
SHA = hashlib.sha256(Path(PLUGIN).read_text().encode()).hexdigest()
ORIGIN = {"origin": "file", "where": PLUGIN, "sha256": SHA}
CODE_KV = str(REPO / "traces" / "code-kv.npz")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _loaded():
    assert plugins.load_plugins([PLUGIN]) == []
    yield
    plugins.forget()


def by_hand(scores, b, pooled):
    """The rule written out: a base of floor((1 - pooled) x b) each, the rest of heads x b
    shared by score, rounded down."""
    heads = len(scores)
    base = int((1 - Fraction(str(pooled))) * b)
    rest = heads * b - heads * base
    return [base + int(rest * Fraction(s) / sum(Fraction(x) for x in scores)) for s in scores]


def kvviz_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "kvviz", *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


def write_table(path, layers):
    path.write_text(json.dumps({"layers": {str(k): v for k, v in layers.items()}}))
    return path


# -- the library -----------------------------------------------------------------------------
def test_each_head_ends_at_its_share_of_the_table_and_the_layer_at_most_its_total():
    table = json.loads(TABLE.read_text())["layers"]
    found = replay_layers(load_layers(CODE_KV), make_policy("head-table", 64))
    for d, layer in enumerate((0, 14, 29)):
        want = by_hand(table[str(layer)], 64, 0.5)
        assert found.held[d, :, -1].tolist() == want  # every head of this trace outgrows its budget
        assert sum(want) <= 3 * 64
    assert sum(by_hand(table["14"], 64, 0.5)) < 3 * 64  # rounding down leaves room: allowed


def test_a_table_given_relative_is_read_where_it_was_given_and_kept_absolute(tmp_path, monkeypatch):
    write_table(tmp_path / "heads.json", {0: [1, 1, 2], 14: [0, 1, 3], 29: [1, 2, 3]})
    monkeypatch.chdir(tmp_path)
    alloc = make_policy("head-table", 16, table="heads.json", pooled=1.0)
    assert alloc.table == str(tmp_path / "heads.json")
    with pytest.raises(ValueError, match=r"layer 14, head 0 gets no slot at budget 16 \(score 0.0, "
                                         r"pooled=1.0\): lower pooled or raise the budget"):
        alloc.group(14, None, 3)
    assert make_policy("head-table", 16, table="heads.json", pooled=0.5).group(14, None, 3).state == [8, 8 + 6, 8 + 18]
    # a base of 8 each, the other 24 of 48 shared 0 : 1 : 3


def test_a_bad_table_path_is_refused_naming_the_parameter_and_the_rule(tmp_path):
    rule = (r"table must be a path to a JSON head-score table "
            r"\(\{\"layers\": \{\"<layer>\": \[scores per KV head\]\}\}\)")
    with pytest.raises(ValueError, match=rule + ": no such file: heads.json"):
        make_policy("head-table", 64, table="heads.json")
    with pytest.raises(ValueError, match=rule + r": no such file: heads.json"):
        parse_params("head-table", {"table": "heads.json"})
    (tmp_path / "bad.json").write_text('{"layers": {"0": [1, -2]}}')
    with pytest.raises(ValueError, match=rule + r": .*bad.json: layer 0 must give a list of finite scores >= 0"):
        make_policy("head-table", 64, table=str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"table must be a string, got 3"):
        make_policy("head-table", 64, table=3)


def test_a_layer_the_table_does_not_fit_is_refused_naming_the_layer(tmp_path):
    only0 = write_table(tmp_path / "only0.json", {0: [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match=r"head-table: table .*only0.json has no scores for layer 14"):
        replay_layers(load_layers(CODE_KV), make_policy("head-table", 64, table=str(only0)))
    two = write_table(tmp_path / "two.json", {0: [1.0, 2.0], 14: [1.0, 2.0], 29: [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"table .*two.json gives layer 0 2 scores, and the layer has 3 KV heads"):
        replay_layers(load_layers(CODE_KV), make_policy("head-table", 64, table=str(two)))
    zero = write_table(tmp_path / "zero.json", {0: [0, 0, 0]})
    with pytest.raises(ValueError, match=r"scores every head of layer 0 0"):
        make_policy("head-table", 64, table=str(zero)).group(0, None, 3)


def test_the_heads_view_replays_the_plugin_from_its_data_path():
    from kvviz.app.ui.view_heads import _runs, choices

    assert "head-table" in choices()[0]
    held, _, layers, budgets, _, _, _ = _runs(CODE_KV, "head-table", "tova", 64)
    table = json.loads(TABLE.read_text())["layers"]
    assert list(layers) == [0, 14, 29] and list(budgets) == [64, 64, 64]
    assert [held[d, :, -1].tolist() for d in range(3)] == [by_hand(table[str(x)], 64, 0.5) for x in (0, 14, 29)]


def test_the_heads_view_runs_it_from_the_environment(monkeypatch, apptest):
    import apphelp

    monkeypatch.setenv("KVVIZ_PLUGINS", PLUGIN)
    at = apphelp.app(timeout=180, view="heads", heads__allocator="head-table")
    apphelp.ok(at)
    assert at.sidebar.selectbox(key="heads.allocator").value == "head-table"
    table = json.loads(TABLE.read_text())["layers"]
    for layer in (0, 14, 29):
        want = by_hand(table[str(layer)], 64, 0.5)
        line = f"layer {layer}: " + ", ".join(f"kv{g}={n}" for g, n in enumerate(want)) + \
            f" (total {sum(want)} of 192)"
        assert any(line in c.value for c in at.caption), [c.value for c in at.caption]


# -- the commands ----------------------------------------------------------------------------
def test_kvviz_check_passes_the_plugin_and_probes_its_path_parameter():
    r = kvviz_cli("check", "--plugin", PLUGIN, "head-table")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "  PASS  refusals: bad parameters and budgets raise ValueError naming them" in r.stdout
    assert "  PASS  order: each victim is the lowest-priority candidate it may take (per head)" in r.stdout


def test_bench_runs_it_with_a_relative_table_and_names_its_origin(tmp_path):
    write_table(tmp_path / "heads.json", {0: [1, 1, 1], 14: [1, 2, 3], 29: [3, 2, 1]})
    r = kvviz_cli("bench", "--plugin", PLUGIN, "--trace", CODE_KV, "--layer", "14",
                  "--policies", "head-table:table=heads.json", "--budgets", "64", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    want = ", ".join(f"kv{g}={n}" for g, n in enumerate(by_hand([1, 2, 3], 64, 0.5)))
    assert f"head-table @ 64: layer 14 (per-head budget 64, total 192) held at the end: {want}" in r.stdout
    assert r.stdout.splitlines()[-1] == f"head-table: file {PLUGIN}, sha256 {SHA}"
    r = kvviz_cli("bench", "--plugin", PLUGIN, "--trace", CODE_KV, "--policies", "head-table:table=nope.json",
                  "--budgets", "64", cwd=tmp_path)
    last = r.stderr.strip().splitlines()[-1]  # after bench's usage, as for any bad --policies
    assert r.returncode == 2 and last.startswith("kvviz bench: error: --policies 'head-table:table=nope.json': ")
    assert "table must be a path to a JSON head-score table" in last and "no such file: nope.json" in last


def test_a_process_pool_sweep_from_another_folder_reads_the_table_given_there(tmp_path, long_run):
    write_table(tmp_path / "heads.json", {0: [1, 1, 1], 14: [1, 2, 3], 29: [3, 2, 1]})
    (tmp_path / "spec.toml").write_text(f'traces = [{json.dumps(CODE_KV)}]\nbudgets = [32, 64]\n'
                                        '[[policies]]\nname = "head-table"\ntable = ["heads.json"]\n')
    r = kvviz_cli("sweep", "spec.toml", "--out", "out", "--workers", "2", "--plugin", PLUGIN, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    import pandas as pd

    df = pd.read_csv(tmp_path / "out" / "results.csv")
    assert df["status"].tolist() == ["ok", "ok"], df.get("error")
    assert df["table"].tolist() == [str(tmp_path / "heads.json")] * 2
    for budget in (32, 64):
        alloc = make_policy("head-table", budget, table=str(tmp_path / "heads.json"))
        want = replay_layers(load_layers(CODE_KV), alloc)
        assert df.loc[df["budget"] == budget, "memory_bytes"].item() == want.memory_bytes
    assert json.loads((tmp_path / "out" / "policies.json").read_text())["head-table"] == ORIGIN
    # the table edited: its cells re-run with the new table, none is reused
    write_table(tmp_path / "heads.json", {0: [3, 2, 1], 14: [1, 1, 1], 29: [1, 2, 3]})
    r = kvviz_cli("sweep", "spec.toml", "--out", "out", "--workers", "2", "--plugin", PLUGIN, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    df = pd.read_csv(tmp_path / "out" / "results.csv")
    grid = load_layers(CODE_KV)
    for budget in (32, 64):
        alloc = make_policy("head-table", budget, table=str(tmp_path / "heads.json"))
        want = layer_summary(grid, replay_layers(grid, alloc))["retained_mass"]
        assert df.loc[df["budget"] == budget, "retained_mass"].item() == pytest.approx(want, abs=1e-12)


# -- the model -------------------------------------------------------------------------------
def test_loop_and_needle_run_it_and_record_its_file(smollm, tmp_path, monkeypatch):
    import kvviz.model.models
    from kvviz.__main__ import main

    monkeypatch.setattr(kvviz.model.models, "load_model", lambda *a, **k: smollm)
    src, js, npz = tmp_path / "t.txt", tmp_path / "r.json", tmp_path / "r.npz"
    src.write_text((REPO / "traces" / "sources" / "execmodel.txt").read_text()[:300])
    assert main(["loop", "--text", str(src), "--max-tokens", "20", "--budget", "12", "--granularity", "kv-head",
                 "--policy", f"head-table:table={TABLE}", "--plugin", PLUGIN, "--json", str(js),
                 "--out", str(npz), "--quiet"]) == 0
    results = json.loads(js.read_text())["results"]
    assert [(r["policy"], r["budget"]) for r in results] == [("full", None), ("head-table", 12)]
    assert results[1]["params"]["table"] == str(TABLE) and np.isfinite(results[1]["perplexity"])
    plugins.forget()
    from kvviz.model.loop import load_loop_result

    assert load_loop_result(npz).configs[1].source == ORIGIN
    out = tmp_path / "needle"
    assert main(["needle", "--out", str(out), "--lengths", "96", "--depths", "50", "--policies", "head-table",
                 "--budgets", "32", "--granularity", "kv-head", "--max-new-tokens", "2", "--plugin", PLUGIN,
                 "--quiet"]) == 0
    (run,) = (out / "runs").glob("*.npz")
    meta = json.loads(str(np.load(run)["meta"]))
    assert next(c["source"] for c in meta["configs"] if c["policy"] == "head-table") == ORIGIN
