"""The lab's report commands print by default: each one, run without `--write` on a copy of
the files it reads (the shipped study folders, a copy of docs/), leaves every file there as it
was and adds none; with `--write` it does write (so the check can fail)."""
import hashlib
import shutil
from pathlib import Path

import pandas as pd
import pytest

from lab import REPO, alloc_report, loop_report, needle_report, tasks_report


def snapshot(*roots: Path) -> dict:
    """Every file under the roots: path -> sha256 of its bytes."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def repo_copy(tmp_path, monkeypatch):
    """A scratch checkout holding a copy of docs/ for the reports that write a page."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "docs", root / "docs")
    for mod in (needle_report, tasks_report, loop_report):
        monkeypatch.setattr(mod, "REPO", root)
    return root


def test_needle_report_writes_nothing_without_write(repo_copy, tmp_path, capsys):
    needle = tmp_path / "needle"
    shutil.copytree(REPO / "traces" / "needle", needle)
    before = snapshot(needle, repo_copy)
    assert needle_report.main([str(needle)]) == 0
    assert "# The pass-key test under eviction" in capsys.readouterr().out
    assert snapshot(needle, repo_copy) == before
    with pytest.raises(SystemExit):  # the loop for question 5 rewrites predictors.json: refused alone
        needle_report.main([str(needle), "--predictors"])
    assert "--write" in capsys.readouterr().err
    assert snapshot(needle, repo_copy) == before
    assert needle_report.main([str(needle), "--write"]) == 0
    assert (repo_copy / "docs" / "studies" / "needle.md").read_text() + "\n" == capsys.readouterr().out


def test_tasks_report_leaves_the_results_table_alone(repo_copy, tmp_path, monkeypatch, capsys):
    """The shipped table beside two of its run files: rebuilding the table from the runs (what
    --write does first) would change it; without --write it is read as it is."""
    tasks = tmp_path / "tasks"
    (tasks / "runs").mkdir(parents=True)
    for name in ("results.csv", "answers.json", "summary.csv"):
        shutil.copy(REPO / "traces" / "tasks" / name, tasks / name)
    for run in sorted((REPO / "traces" / "tasks" / "runs").glob("recall*.npz"))[:2]:
        shutil.copy(run, tasks / "runs" / run.name)
    calls = []
    monkeypatch.setattr(tasks_report, "report", lambda out: calls.append(out) or ("DOC", {}, pd.DataFrame()))
    monkeypatch.setattr(tasks_report, "write", lambda *a: calls.append("write"))
    before = snapshot(tasks, repo_copy)
    assert tasks_report.main([str(tasks)]) == 0
    assert calls == [tasks] and capsys.readouterr().out == "DOC\n"
    assert snapshot(tasks, repo_copy) == before
    assert tasks_report.main([str(tasks), "--write"]) == 0
    assert calls[-1] == "write"
    assert len(pd.read_csv(tasks / "results.csv").id.unique()) == 2  # rebuilt from the two runs


def test_alloc_report_writes_its_summary_only_with_write(tmp_path, capsys):
    alloc = tmp_path / "alloc"
    shutil.copytree(REPO / "traces" / "alloc", alloc)
    before = snapshot(alloc)
    argv = ["--out", str(alloc), "--report-only", "--kvpress", str(alloc / "kvpress.json")]
    assert alloc_report.main(argv) == 0
    assert "pass key: 12 prompts" in capsys.readouterr().out
    assert snapshot(alloc) == before
    (alloc / "summary.json").unlink()
    assert alloc_report.main(argv + ["--write"]) == 0
    assert (alloc / "summary.json").is_file()


def test_loop_report_writes_its_csv_only_with_write(repo_copy, monkeypatch, capsys):
    monkeypatch.setattr(loop_report, "frame", lambda folder: pd.DataFrame({"a": [1]}))
    monkeypatch.setattr(loop_report, "report", lambda df: None)
    monkeypatch.setattr(loop_report, "answers", lambda df: None)
    before = snapshot(repo_copy)
    assert loop_report.main(["--dir", "unused"]) == 0
    assert snapshot(repo_copy) == before
    assert loop_report.main(["--dir", "unused", "--write"]) == 0
    assert (repo_copy / "docs" / "studies" / "loop.csv").read_text() == "a\n1\n"
