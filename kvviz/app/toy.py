"""The toy trace: 16 tokens whose every weight fits on a projector (traces/toy.npz).

A class's first minutes, before 4,096-step heatmaps make sense: at budget 4, every cell
and every score can carry its number. Hand-made, deterministic rows over one sentence
pair: a sink at position 0, a recency slope over the last three tokens, " cat" (1) looked
back at from " dog" on, and the phrase " the mat" (4, 5) attended together for a few
steps, so SnapKV's pooling has a neighbour to defend. Rebuild the shipped file with
`.venv/bin/python -m kvviz.app.toy traces/toy.npz` (tests check it equals `toy_rows()`).
"""
from __future__ import annotations

import sys

import numpy as np

TOKENS = ["The", " cat", " sat", " on", " the", " mat", ".", " The", " dog", " saw",
          " the", " cat", " on", " the", " mat", "."]
BUDGET = 4


def toy_rows() -> np.ndarray:
    """(16, 16) float32: row t is the attention query t pays to positions 0..t-1 (sum 1)."""
    n = len(TOKENS)
    a = np.zeros((n, n), np.float64)
    for t in range(1, n):
        w = np.ones(t)                         # background
        w[0] += 3                              # the sink
        for back, extra in ((1, 3), (2, 1.5), (3, 0.5)):  # the newest tokens
            if t - back >= 0:
                w[t - back] += extra
        if t >= 8:
            w[1] += 4                          # " cat", looked back at from " dog" on
        if 6 <= t <= 11:
            w[4] += 1                          # " the mat", attended as a phrase
            w[5] += 2.5
        a[t, :t] = w / w.sum()
    return a.astype(np.float32)


def write(path) -> None:
    from kvviz.core.trace import save_trace

    save_trace(path, toy_rows(), tokens=TOKENS, dtype="float32",
               meta={"name": "toy", "source": "kvviz toy trace (16 tokens, hand-made rows; "
                     "try budget 4)"})


if __name__ == "__main__":  # pragma: no cover - the shipped file's build step
    write(sys.argv[1] if len(sys.argv) > 1 else "traces/toy.npz")
