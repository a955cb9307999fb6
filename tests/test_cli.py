"""`python -m kvviz bench` as a user runs it: table on stdout, CSV/JSON files, clear errors."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd

from kvviz.core.trace import save_trace


def kvviz(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kvviz", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_bench_prints_and_writes_the_table(tmp_path):
    rng = np.random.default_rng(0)
    m = np.tril(rng.random((120, 120)), k=-1).astype(np.float32)
    trace = save_trace(tmp_path / "small.npz", m, meta={"name": "small"})
    out = kvviz("bench", "--trace", str(trace), "--budgets", "40,64", "--csv", str(tmp_path / "t.csv"),
                "--json", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    assert "trace: small (120 steps)" in out.stdout
    for name in ("tova", "snapkv", "h2o", "streaming-llm", "scissorhands", "random", "raas"):
        assert name in out.stdout
    table = pd.read_csv(tmp_path / "t.csv")
    assert len(table) == 14 and set(table.budget) == {40, 64}  # those 7 (no norms here) x 2 budgets
    assert table.retained_mass.between(0, 1).all()
    rows = json.loads((tmp_path / "t.json").read_text())
    assert rows[0]["policy"] == "tova" and rows[0]["memory_bytes"] == 13 * 40


def test_bench_refuses_a_bad_trace_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"definitely not numpy")
    out = kvviz("bench", "--trace", str(bad))
    assert out.returncode == 2
    assert "npz" in out.stderr and "Traceback" not in out.stderr


def test_bench_refuses_a_refused_parameter_combination():
    out = kvviz("bench", "--budgets", "16", "--policies", "snapkv")  # recent_window 32 >= 16
    assert out.returncode == 2 and "recent_window" in out.stderr


def test_perf_prints_a_ratio_per_policy():
    """Smoke only: figures are for the README, never asserted against a clock."""
    out = kvviz("perf", "--steps", "200", "--budget", "64", "--long-steps", "300")
    assert out.returncode == 0, out.stderr
    for name in ("tova", "snapkv", "h2o", "streaming-llm", "scissorhands", "random"):
        assert name in out.stdout
    assert "speedup" in out.stdout and "held_at_end': 300" in out.stdout


def test_bench_pool_kernels_and_spans(tmp_path):
    out = kvviz("bench", "--budgets", "256", "--policies", "tova,snapkv", "--pool-kernels", "1,3",
                "--spans", "--csv", str(tmp_path / "p.csv"))
    assert out.returncode == 0, out.stderr
    table = pd.read_csv(tmp_path / "p.csv")
    assert table.params.fillna("").str.contains("pool_kernel=3").sum() == 1
    assert table.span_whole.notna().all()
    # pooling off reproduces TOVA's retained mass (F4), so the two rows agree to the bit
    assert table.retained_mass[0] == table.retained_mass[1]


def heads_file(tmp_path):
    """Two model layers (14, 29) x heads mean/kv0, each with different attention."""
    rng = np.random.default_rng(1)
    m = np.tril(rng.random((2, 2, 90, 90)), k=-1).astype(np.float32)
    m[..., 1:, :] /= m[..., 1:, :].sum(axis=-1, keepdims=True)
    return save_trace(tmp_path / "heads.npz", m, layers=[14, 29], heads=["mean", "kv0"],
                      meta={"name": "heads"})


def test_bench_layer_is_a_model_layer_number_and_the_output_says_which_ran(tmp_path):
    path = heads_file(tmp_path)
    rows = {}
    for layer, head in ((None, None), ("29", None), ("29", "kv0")):
        args = ["bench", "--trace", str(path), "--budgets", "40", "--policies", "tova",
                "--csv", str(tmp_path / "o.csv")]
        args += ["--layer", layer] if layer else []
        args += ["--head", head] if head else []
        out = kvviz(*args)
        assert out.returncode == 0, out.stderr
        want = f"model layer {layer or 14} of stored 14, 29, head {head or 'mean'}"
        assert f"trace: heads (90 steps), {want}" in out.stdout
        rows[(layer, head)] = pd.read_csv(tmp_path / "o.csv").retained_mass[0]
    assert len(set(rows.values())) == 3  # three different attention matrices were replayed


def test_bench_refuses_an_index_or_unknown_head_listing_what_is_stored(tmp_path):
    path = heads_file(tmp_path)
    out = kvviz("bench", "--trace", str(path), "--layer", "1")
    assert out.returncode == 2 and "stored layers: 14, 29" in out.stderr
    out = kvviz("bench", "--trace", str(path), "--head", "q4")
    assert out.returncode == 2 and "stored heads: mean, kv0" in out.stderr
    out = kvviz("bench", "--layer", "29")
    assert out.returncode == 2 and "canonical trace has no model layers" in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_warns_when_a_budget_never_evicts(tmp_path):
    path = heads_file(tmp_path)
    out = kvviz("bench", "--trace", str(path), "--budgets", "40,90,200", "--policies", "tova",
                "--csv", str(tmp_path / "w.csv"))
    assert out.returncode == 0, out.stderr
    warnings = [ln for ln in out.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 2 and "budget 90 is at least the trace length (90 steps)" in warnings[0]
    table = pd.read_csv(tmp_path / "w.csv")
    assert table.evicts.tolist() == [True, False, False]
    assert table.retained_mass[0] < 1  # the row that evicts is a real measurement


def test_pooling_study_head_option(tmp_path):
    path = heads_file(tmp_path)
    csv = tmp_path / "study.csv"
    out = subprocess.run([sys.executable, "-m", "lab.pooling_study", "--traces", str(path),
                          "--head", "kv0", "--budgets", "40", "--kernels", "1,5", "--csv", str(csv)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "head: kv0" in out.stderr
    table = pd.read_csv(csv)
    assert set(table["head"]) == {"kv0"} and sorted(set(table["layer"])) == [14, 29]
    mean = subprocess.run([sys.executable, "-m", "lab.pooling_study", "--traces", str(path),
                           "--budgets", "40", "--kernels", "1,5", "--csv", str(csv)],
                          capture_output=True, text=True, timeout=300)
    assert mean.returncode == 0, mean.stderr
    assert set(pd.read_csv(csv)["head"]) == {"mean"}
    assert not pd.read_csv(csv).retained_mass.equals(table.retained_mass)  # another head's attention
    bad = subprocess.run([sys.executable, "-m", "lab.pooling_study", "--traces", "canonical",
                          "--head", "kv0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "stored heads: mean" in bad.stderr


COMMANDS = ("bench", "perf", "capture", "loop", "generate", "needle", "calibrate", "app", "sweep",
            "check", "lesson", "export")


def test_help_lists_every_command_and_each_command_has_help(capsys):
    """One argparse tree: `kvviz --help` names every command, each `--help` exits 0 with its
    own usage, and building the tree imports none of the heavy stacks."""
    import pytest

    from kvviz.__main__ import main

    with pytest.raises(SystemExit) as top:
        main(["--help"])
    listed = capsys.readouterr().out
    assert top.value.code == 0
    assert "{" + ",".join(COMMANDS) + "}" in listed
    for command in COMMANDS:
        try:
            code = main([command, "--help"])  # `kvviz app --help` prints its own text and returns
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr().out
        assert code in (0, None), command
        assert "usage: " in out and f"kvviz {command}" in out, command
    heavy = subprocess.run([sys.executable, "-c", "import sys; from kvviz.__main__ import parser; "
                            "parser(); print(sorted({'torch', 'transformers', 'ray', 'streamlit', "
                            "'hypothesis'} & set(sys.modules)))"],
                           capture_output=True, text=True, timeout=120)
    assert heavy.stdout.strip() == "[]", heavy.stderr


def test_unknown_flags_are_refused_except_the_streamlit_ones_app_passes_on(capsys):
    import pytest

    from kvviz.__main__ import main

    with pytest.raises(SystemExit) as refused:
        main(["check", "tova", "--no-such-flag"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip() == "error: unrecognized arguments: --no-such-flag"
    assert main(["app", "--dry-run", "--server.port", "8502", "--server.runOnSave=true"]) == 0
    command = capsys.readouterr().out.splitlines()[0]
    assert command.endswith("--server.port 8502 --server.runOnSave=true")
    assert "--server.runOnSave=false" not in command  # the user's setting replaces the default
