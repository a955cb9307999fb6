"""lab.needle_report computes its answers from the CSV: hand-built runs whose
counts are known give those counts and verdicts."""
import sys
from pathlib import Path

import numpy as np
import pytest

from kvviz.model.needle.results import run_id, save_run, write_tables
from lab import needle_report

CONFIGS = [("full", {}, None), ("tova", {}, 4), ("h2o", {"recent_window": 1}, 4),
           ("scissorhands", {"history_window": 1, "recent_window": 1}, 4)]


def _save(out, mode, depth, correct, lost):
    """T0 = 10, key at 3 and 4, 2 layers; `lost[c]` = layers where config c loses position 3."""
    ev = np.full((4, 2, 1, 12), -1, np.int32)
    for c, layers in enumerate(lost):
        for layer in layers:
            ev[c, layer, 0, 3] = 8
    meta = {"id": run_id(10, depth, 0, mode, "layer"), "length": 10, "depth": depth, "seed": 0,
            "prompt_mode": mode, "granularity": "layer", "key": "12", "key_positions": [3, 4],
            "question_start": 7, "prompt_len": 10, "max_new_tokens": 2,
            "configs": [{"policy": p, "params": q, "budget": b, "label": f"{p}@{b}" if b else "full"}
                        for p, q, b in CONFIGS],
            "answers": ["12" if ok else "x" for ok in correct], "correct": correct,
            "model": {"model": "hand-built"}, "layers": 2, "kv_heads": 1}
    save_run(out, meta, np.arange(10), [str(i) for i in range(10)], np.zeros((4, 2)), ev)


def test_report_counts_and_verdicts(tmp_path):
    # decode, depth 10: tova loses the key in layer 1 and is wrong, h2o and scissorhands keep it and are right
    _save(tmp_path, "decode", 10, [True, False, True, True], [[], [1], [], []])
    # decode, depth 90: everyone right; scissorhands right without the whole key
    _save(tmp_path, "decode", 90, [True, True, True, True], [[], [], [], [0]])
    # prefill, depth 10: tova right, the others wrong with the key whole
    _save(tmp_path, "prefill", 10, [True, True, False, False], [[], [], [], []])
    write_tables(tmp_path)
    table, doc = needle_report.report(tmp_path)
    assert "| full cache | 100 % | 100 % |" in table
    # Wilson 95 %: 1 of 2 -> 0.5 +- 0.406 = [9-91]; 1 of 1 -> [1 / (1 + z^2), 1] = [21-100]
    assert "| tova | 50 % [9–91] (0.88) | 100 % [21–100] (1.00) |" in table
    assert "distinct keys per evicting cell: 1." in table  # every hand-built prompt's key is 12
    # 9 evicting runs: right+whole 5 (tova d90, h2o d10, d90, sc d10, tova prefill), right+not whole 1
    # (sc d90), wrong+whole 2 (h2o, sc prefill), wrong+not whole 1 (tova d10)
    assert "right, whole 5, right, not whole 1, wrong, whole 2, wrong, not whole 1" in doc
    assert "neither necessary nor sufficient" in doc
    assert "H2O and Scissorhands both keep it (answer right): 1 of 3; the reverse: 1" in doc
    assert "prefill eviction is right more often than decode-time eviction in 1 of 3" in doc
    assert "Not computed: run this script with --predictors" in doc
    assert "they come from 3 prompts, each under every configuration, so the runs are not independent" in doc
    said = needle_report.answers(needle_report.prepare(needle_report.load_results(tmp_path)), tmp_path)
    assert "Over 3 paired runs, TOVA is wrong where both are right in 1 and right where both are wrong in 1" in said
    assert "of 9 evicting runs, 1 were right without it and 2 wrong with it" in said
    # every wrong answer here is "x": no number
    assert "of 3 wrong evicting answers, 0 are truncations of the key" in said and "3 no number" in said


def test_wilson_interval_at_its_closed_forms():
    from kvviz.core.metrics import wilson

    z2 = 1.959963984540054 ** 2
    assert wilson(0, 30) == (0.0, pytest.approx(z2 / (30 + z2)))  # k = 0: [0, z^2 / (n + z^2)]
    assert wilson(30, 30) == (pytest.approx(30 / (30 + z2)), pytest.approx(1.0))
    lo, hi = wilson(15, 30)
    assert lo + hi == pytest.approx(1.0) and lo == pytest.approx(0.3315, abs=1e-4)  # symmetric at p = 1/2
    assert all(v != v for v in wilson(0, 0))  # nan: no trials
    with pytest.raises(ValueError, match="wilson needs 0 <= k <= n"):
        wilson(3, 2)


@pytest.mark.parametrize("answer,kind", [(" 42400. Remember", "right"), (" 424. The", "truncated"),
                                         ("4240", "truncated"), (" 12345", "other number"),
                                         (" 4241", "other number"), (" The key is", "no number")])
def test_answers_are_sorted_by_how_they_fail(answer, kind):
    assert needle_report.outcome(answer, "42400") == kind


def test_setup_ships_exactly_the_files_the_grid_writes(monkeypatch):
    """The runs a wheel ships (setup.py's bundle_files) are the grid lab/needle_ship.sh writes."""
    import runpy
    import shlex
    import types

    from kvviz.model.needle.cli import grid_from, parser

    root = Path(__file__).resolve().parents[1]
    # setup.py read for its lists only: a stand-in setuptools whose setup() does nothing
    stub = types.ModuleType("setuptools")
    stub.setup = lambda **kw: None
    command = types.ModuleType("setuptools.command")
    build_py = types.ModuleType("setuptools.command.build_py")
    build_py.build_py = type("build_py", (), {})
    for name, mod in (("setuptools", stub), ("setuptools.command", command),
                      ("setuptools.command.build_py", build_py)):
        monkeypatch.setitem(sys.modules, name, mod)
    shipped = runpy.run_path(str(root / "setup.py"))["bundle_files"](root)
    env, ids = {}, []
    def expand(text):  # the script's own variables, longest name first ($SIX before $S)
        for k in sorted(env, key=len, reverse=True):
            text = text.replace(f"${k}", env[k])
        return text

    for line in (root / "lab" / "needle_ship.sh").read_text().splitlines():
        if "=" in line.split(" ")[0] and not line.startswith("export"):
            k, v = line.split("=", 1)
            env[k] = " ".join(shlex.split(expand(v)))
        elif line.startswith("$N "):
            argv = shlex.split(env["N"])[3:] + shlex.split(expand(line[3:]))
            ids += [s.id for s in grid_from(parser().parse_args(argv[1:])).prompts()]
    assert len(ids) == len(set(ids)) == 120  # 4 kinds of prompt x 3 depths x 10 seeds each
    keys = {}
    for i in ids:  # L<length>-d<depth>-s<seed>-<mode>-<granularity>
        length, depth, seed, mode, gran = i.split("-", 4)
        keys.setdefault((length, mode, gran), set()).add(seed)
    assert all(len(seeds) == 30 for seeds in keys.values())  # 30 distinct seeds (keys) per cell
    runs = [x for x in shipped if x.startswith("traces/needle/runs/")]
    assert sorted(f"traces/needle/runs/{i}.npz" for i in ids) == runs


def test_spearman_critical_values_match_the_exact_tables():
    # two-sided 5 %: n = 6 needs |rho| >= 0.886 (26/30); n = 5 only a perfect order; n = 3 never
    assert needle_report.spearman_critical(6) == pytest.approx(1 - 6 * 4 / 210)
    assert needle_report.spearman_critical(5) == pytest.approx(1.0)
    assert needle_report.spearman_critical(3) == float("inf")
