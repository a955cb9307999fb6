"""Needle results from evicted_at alone: hand-built runs whose held shares are known."""
import json

import numpy as np
import pytest

from kvviz.model.needle import list_runs, load_results, load_run
from kvviz.model.needle.results import run_id, save_run, write_tables


def _run(out, ev, depth=50):
    """T0 = 10, question at 7, key at 3 and 4; two configs; 2 layers, 1 head; N = 2."""
    meta = {"id": run_id(10, depth, 0, "decode", "layer"), "length": 10, "depth": depth, "seed": 0,
            "prompt_mode": "decode", "granularity": "layer", "key": "12", "key_positions": [3, 4],
            "question_start": 7, "prompt_len": 10, "max_new_tokens": 2,
            "configs": [{"policy": "full", "params": {}, "budget": None, "label": "full"},
                        {"policy": "tova", "params": {}, "budget": 4, "label": "tova@4"}],
            "answers": [" 12", " 3"], "correct": [True, False], "agreement": [1.0, 0.5],
            "layers": 2, "kv_heads": 1}
    save_run(out, meta, np.arange(10), [str(i) for i in range(10)], np.zeros((2, 2)), ev)
    return meta["id"]


def test_rows_follow_the_held_rule(tmp_path):
    ev = np.full((2, 2, 1, 12), -1, np.int32)
    ev[1, 0, 0, 3] = 7   # evicted at the question's own step: held when the question starts
    ev[1, 1, 0, 3] = 6   # evicted before it: not held
    ev[1, 1, 0, 4] = 10  # evicted during generation: held at the end of the prompt (step 9)
    id_ = _run(tmp_path, ev)
    df = write_tables(tmp_path)
    assert list_runs(tmp_path) == [id_] == ["L10-d50-s0-decode-layer"]
    full, tova = df.iloc[0], df.iloc[1]
    assert full.held_question == full.held_end == 1.0 and full.first_lost == -1 and full.layers_whole == 2
    assert tova.held_question == 0.75          # layer 0 whole, layer 1 half
    assert tova.held_end == 0.5                # layer 0 lost pos 3 at step 7; layer 1 lost pos 3
    assert tova.layers_whole == 0 and tova.first_lost == 6
    assert json.loads(tova.first_lost_by_layer) == [7, 6]
    assert json.loads(tova.held_by_layer) == [1.0, 0.5]
    assert json.loads(tova.held_end_by_layer) == [0.5, 0.5]
    back = load_results(tmp_path)
    assert back.loc[1, "first_lost_by_layer"] == [7, 6] and back.loc[0, "answer"] == " 12"
    assert back.loc[1, "params"] == {} and back.correct.tolist() == [True, False]
    assert json.loads((tmp_path / "results.json").read_text())[1]["held_end"] == 0.5
    run = load_run(tmp_path, id_)
    assert run["evicted_at"].dtype == np.int32 and run["meta"]["key"] == "12"
    with pytest.raises(ValueError, match="no .*nope"):
        load_run(tmp_path, "nope")
