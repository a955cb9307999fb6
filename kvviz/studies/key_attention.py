"""The key's attention over time in the recall task's runs, as files: DIR/attention/<id>.npz
with `attention` float32 (layers, prompt_len) and `meta` (0-d str, JSON: id, key_positions,
reminders, model), read without pickle. The Forgetting view draws it beside each policy's step
of losing the key; lab/key_attention.py computes and writes it
(`python -m lab.key_attention traces/tasks`).
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from kvviz.core.atomic import replacing


def attention_path(folder, id_: str) -> Path:
    return Path(folder) / "attention" / f"{id_}.npz"


def save_attention(folder, meta: dict, attention, model: dict | None = None) -> Path:
    path = attention_path(folder, meta["id"])
    buf = io.BytesIO()
    info = {"id": meta["id"], "key_positions": list(meta["key_positions"]),
            "reminders": [list(r) for r in meta.get("reminders") or []], "model": model or {}}
    np.savez_compressed(buf, attention=np.asarray(attention, np.float32), meta=np.str_(json.dumps(info)))
    with replacing(path) as fh:
        fh.write(buf.getvalue())
    return path


def load_attention(folder, id_: str) -> np.ndarray | None:
    """The run's (layers, prompt_len) array, or None when the folder has no file for it."""
    path = attention_path(folder, id_)
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        return np.asarray(z["attention"], np.float32)
