"""Downloads of the current run: eviction logs and metrics as CSV and JSON (no Streamlit)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from kvviz.app.figures.states import ends
from kvviz.core.budget import as_given


def eviction_log(run_a, run_b, tokens=None) -> pd.DataFrame:
    """One row per position: when A and B evicted it (-1 = never) and its retained share row."""
    steps = run_a.steps
    df = pd.DataFrame({
        "position": np.arange(steps),
        "A_policy": run_a.policy, "A_evicted_at": run_a.evicted_at,
        "B_policy": run_b.policy, "B_evicted_at": run_b.evicted_at,
        "A_steps_held": ends(run_a.evicted_at) - np.arange(steps),
        "B_steps_held": ends(run_b.evicted_at) - np.arange(steps),
        "A_retained": run_a.retained, "B_retained": run_b.retained,
    })
    if tokens is not None:
        df.insert(1, "token", list(tokens))
    return df


def metrics_frame(metrics: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(metrics)


def run_json(config: dict, run_a, run_b, metrics: list[dict]) -> str:
    def pack(run):
        return {"policy": run.policy, "params": run.params, "budget": as_given(run.budget),
                "steps": run.steps, "first_eviction": run.first_eviction,
                "evicted_at": run.evicted_at.tolist(),
                "retained": [None if np.isnan(x) else float(x) for x in run.retained]}

    return json.dumps({"kvviz": "explorer export", "format": 1, "config": config,
                       "metrics": metrics, "A": pack(run_a), "B": pack(run_b)}, indent=1)
