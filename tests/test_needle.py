"""The pass-key test on SmolLM2: a window-only policy whose window cannot reach the key
holds none of it at the question, a budget above the text holds all of it, the full cache
answers the key, and a re-run resumes instead of recomputing."""
import numpy as np
import pytest

from kvviz.model.loop import LoopConfig
from kvviz.model.needle import list_runs, load_results, load_run
from kvviz.model.needle.grid import Grid
from kvviz.model.needle.prompt import build

LENGTH, DEPTH, SEED, N = 96, 25, 0, 6
SINKS, BUDGET = 4, 32


def _grid():
    g = Grid([LENGTH], [DEPTH], [SEED], ["full"], [], ["decode"], ["layer"], N)
    g.configs = [LoopConfig("full"), LoopConfig("streaming-llm", {"sinks": SINKS}, BUDGET),
                 LoopConfig("tova", {}, LENGTH + N)]
    return g


@pytest.fixture(scope="module")
def grid_dir(smollm, tmp_path_factory):
    from kvviz.model.needle.run import run_grid

    out = tmp_path_factory.mktemp("needle")
    run_grid(_grid(), out, model=smollm, progress=False)
    return out


def test_a_window_that_cannot_reach_the_key_holds_none_of_it(smollm, grid_dir):
    (id_,) = list_runs(grid_dir)
    run = load_run(grid_dir, id_)
    m, ev = run["meta"], run["evicted_at"]
    tok = smollm[0]
    p = build(tok, LENGTH, DEPTH, SEED)
    assert m["key_positions"] == p.key_positions and m["question_start"] == p.question_start
    q, pos = p.question_start, np.array(p.key_positions)
    window = BUDGET - SINKS
    assert pos.min() >= SINKS and pos.max() < q - window  # the seeded prompt: out of the window's reach
    # StreamingLLM's definition, not the code: after step t it holds the sinks and the
    # `window` latest positions, so position p >= sinks leaves at step p + window
    stream = ev[1]
    assert stream.shape == (30, 1, LENGTH + N)
    assert (stream[..., pos] == pos + window).all()
    held = (stream == -1) | (stream >= q)  # what the question's first token reads
    assert not held[..., pos].any()
    expect = np.zeros(LENGTH + N, bool)
    expect[:SINKS] = True
    expect[q - window:] = True
    assert (held[..., :q] == expect[:q]).all()
    for c in (0, 2):  # full, and a budget above prompt + answer: nothing is ever evicted
        assert (ev[c] == -1).all()
    rows = load_results(grid_dir)
    assert rows.held_question.tolist() == [1.0, 0.0, 1.0]
    assert rows.held_end.tolist() == [1.0, 0.0, 1.0]
    assert rows.layers_whole.tolist() == [0 + 30, 0, 30]
    assert rows.first_lost.tolist() == [-1, int(pos.min()) + window, -1]
    assert rows.first_lost_by_layer[1] == [int(pos.min()) + window] * 30


def test_the_full_cache_answers_the_key(grid_dir):
    rows = load_results(grid_dir)
    full = rows.iloc[0]
    assert full.label == "full" and full.key in full.answer and full.correct
    assert rows.iloc[2].answer == full.answer  # nothing evicted, same greedy tokens


def test_a_rerun_resumes_and_a_changed_grid_recomputes(smollm, grid_dir, monkeypatch):
    import kvviz.model.needle.run as run_mod

    before = (grid_dir / "runs" / f"{list_runs(grid_dir)[0]}.npz").read_bytes()
    calls = []
    real = run_mod.compute
    monkeypatch.setattr(run_mod, "compute", lambda *a, **k: calls.append(a) or real(*a, **k))
    run_mod.run_grid(_grid(), grid_dir, model=smollm, progress=False)
    assert calls == []
    assert (grid_dir / "runs" / f"{list_runs(grid_dir)[0]}.npz").read_bytes() == before
    g = _grid()
    g.max_new_tokens = 1
    df = run_mod.run_grid(g, grid_dir, model=smollm, progress=False)
    assert len(calls) == 1 and load_run(grid_dir, list_runs(grid_dir)[0])["new_ids"].shape == (3, 1)
    assert len(df) == 3
