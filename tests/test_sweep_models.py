"""Sweeps of model cells (mode = "loop", mode = "needle"): the rows are the library's own
results, the three engines give the same table, and a SIGKILLed sweep resumes to it.

A tiny random-weight Llama (scripts/tiny_model.py: 3 layers, 2 KV heads, SmolLM2's
tokenizer) keeps them cheap; what is tested (batching, shipping, resume) does not depend on
the weights. The needle on SmolLM2 itself is tests/test_needle.py.
"""
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
from sweephelp import kill_after_cells

from kvviz.studies.sweep.run import run_sweep
from kvviz.studies.sweep.spec import SpecError

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The elements are listed by atomic number. Hydrogen is the lightest; helium follows it. "
        "Lithium, beryllium and boron come next, then carbon, nitrogen and oxygen.")
LOOP = """
mode = "loop"
texts = ["a.txt"]
max_tokens = 40
granularity = ["layer", "kv-head"]
model = "tiny"
budgets = [16]
[[policies]]
name = "tova"
[[policies]]
name = "streaming-llm"
sinks = [0, 4]
"""
NEEDLE = """
mode = "needle"
lengths = [96]
depths = [20, 90]
seeds = [0]
prompt_modes = ["decode", "prefill"]
max_new_tokens = 2
model = "tiny"
budgets = [32]
[[policies]]
name = "tova"
[[policies]]
name = "streaming-llm"
sinks = 4
"""
SPECS = {"loop": LOOP, "needle": NEEDLE}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, torch_stack):
    sys.path.insert(0, str(ROOT / "scripts"))
    import tiny_model

    d = tmp_path_factory.mktemp("msweep")
    tiny_model.build("llama", d / "tiny")
    (d / "a.txt").write_text(TEXT)
    for mode, spec in SPECS.items():
        (d / f"{mode}.toml").write_text(spec)
    return d


@pytest.fixture(scope="module")
def serial(workdir):
    """mode -> the serial table, computed by the first test that needs it."""
    return {}


def _serial(workdir, serial, mode):
    if mode not in serial:
        serial[mode] = run_sweep(workdir / f"{mode}.toml", workdir / f"serial-{mode}", base=workdir,
                                 progress=False)
    return serial[mode]


def test_loop_rows_are_run_loops_own_results(workdir, serial, torch_stack):
    from kvviz.model.loop import LoopConfig, run_loop
    from kvviz.model.models import load_model

    df = _serial(workdir, serial, "loop")
    assert len(df) == 8 and (df.status == "ok").all()
    configs = [LoopConfig("tova", {}, 16), LoopConfig("streaming-llm", {"sinks": 0}, 16),
               LoopConfig("streaming-llm", {"sinks": 4}, 16)]
    for gran in ("layer", "kv-head"):
        res = run_loop(TEXT, configs, granularity=gran, max_tokens=40, model=load_model(str(workdir / "tiny")),
                       rows_layers=[])
        rows = df[df.granularity == gran]
        assert rows.label.tolist() == [r["label"] for r in res.results]
        for (_, row), want in zip(rows.iterrows(), res.results):
            assert row.perplexity == want["perplexity"] and row.kl == want["kl"]
            assert row.top1_agreement == want["top1_agreement"]
    assert df.loc[df.policy == "full", "budget"].tolist() == [-1, -1]


@pytest.mark.parametrize("mode", ["loop", "needle"])
def test_pool_and_ray_give_the_serial_table(workdir, serial, mode, ray_local):
    want = _serial(workdir, serial, mode)
    assert (want.status == "ok").all(), want.error.tolist()
    for name, kw in (("pool", {"workers": 2}), ("ray", {"ray": ray_local, "workers": 2})):
        got = run_sweep(workdir / f"{mode}.toml", workdir / f"{name}-{mode}", base=workdir, progress=False, **kw)
        pd.testing.assert_frame_equal(got, want, check_exact=True)
        assert (workdir / f"{name}-{mode}" / "results.csv").read_bytes() == \
            (workdir / f"serial-{mode}" / "results.csv").read_bytes()


@pytest.mark.parametrize("mode", ["loop", "needle"])
def test_sigkill_then_resume_loses_nothing(workdir, serial, mode):
    want = _serial(workdir, serial, mode)
    out = workdir / f"killed-{mode}"
    kill_after_cells(1, ["sweep", f"{mode}.toml", "--out", str(out), "--quiet"], workdir,
                     {**os.environ, "PYTHONPATH": str(ROOT)})
    cells = out / "cells"
    before = {p.name: p.read_bytes() for p in cells.glob("*.json")}
    assert len(before) == 1 < len(want)
    got = run_sweep(workdir / f"{mode}.toml", out, base=workdir, progress=False)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert all((cells / n).read_bytes() == b for n, b in before.items())  # kept, not redone
    assert not list(cells.glob("*.tmp"))


@pytest.mark.parametrize("edit, message", [
    (("max_tokens = 40", "max_tokens = 1"), "max_tokens = 1: must be an integer >= 2"),
    (('texts = ["a.txt"]', 'texts = ["nope.txt"]'), "texts = 'nope.txt': file not found"),
    (('model = "tiny"', 'model = "nope"'), "model = 'nope': --model nope: no such folder"),
    (("budgets = [16]", "budgets = [0]"), "budget must be >= 1"),
    (("sinks = [0, 4]", "sinks = [0, 16]"), "policies[1] (streaming-llm, sinks = 16) at budget 16"),
    (("max_tokens = 40", "max_tokens = 40\nlengths = [96]"), "lengths = [96]: unknown key for mode = 'loop'"),
])
def test_a_bad_loop_spec_is_refused(workdir, edit, message):
    (workdir / "bad.toml").write_text(LOOP.replace(*edit))
    with pytest.raises(SpecError) as err:
        run_sweep(workdir / "bad.toml", workdir / "bad", base=workdir, progress=False)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (workdir / "bad").exists()


@pytest.mark.parametrize("edit, message", [
    (("depths = [20, 90]", "depths = [20, 120]"), "a depth is a percent of the haystack, 0-100; got 120"),
    (("lengths = [96]", "lengths = [40]"), "lengths = 40: the pass key does not fit"),
    (("lengths = [96]", "lengths = [300]"), "exceeds the model's context of 256"),
    (("max_new_tokens = 2", "max_new_tokens = 0"), "max_new_tokens = 0: must be an integer >= 1"),
    (('prompt_modes = ["decode", "prefill"]', 'prompt_modes = ["chunked"]'), "prompt_modes"),
    (("max_new_tokens = 2", 'max_new_tokens = 2\nhaystack = "none.txt"'), "haystack = 'none.txt': file not found"),
])
def test_a_bad_needle_spec_is_refused(workdir, edit, message):
    (workdir / "bad.toml").write_text(NEEDLE.replace(*edit))
    with pytest.raises(SpecError) as err:
        run_sweep(workdir / "bad.toml", workdir / "bad", base=workdir, progress=False)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (workdir / "bad").exists()


def test_a_needle_sweep_runs_an_allocator_per_kv_head(workdir):
    """An allocator over a scorer as a sweep policy: adakv shares each layer's budget across
    its KV heads, so the sweep runs it at kv-head granularity and labels its rows."""
    spec = NEEDLE.replace("depths = [20, 90]", "depths = [50]").replace(
        'prompt_modes = ["decode", "prefill"]', 'prompt_modes = ["prefill"]\ngranularity = ["kv-head"]')
    spec = spec[:spec.index("[[policies]]")] + '[[policies]]\nname = "adakv"\nscorer = "tova"\n'
    (workdir / "adakv.toml").write_text(spec)
    df = run_sweep(workdir / "adakv.toml", workdir / "serial-adakv", base=workdir, progress=False)
    assert (df.status == "ok").all(), df.error.tolist()
    assert df.policy.tolist() == ["full", "adakv"]
    assert (df.granularity == "kv-head").all() and (df.prompt_mode == "prefill").all()
    row = df[df.policy == "adakv"].iloc[0]
    assert row.label == "adakv(scorer=tova,alpha=0.2)@32" and row.budget == 32
    assert row.params == '{"alpha": 0.2, "scorer": "tova"}'
    assert row.held_end < 1.0  # the prompt outgrew the budget, so the allocator evicted
