"""Attention traces: the canonical synthetic trace and the on-disk `.npz` format.

A trace is T query rows. Row t is the attention the query at position t paid to
positions 0..t-1 (float32, length t; row 0 is empty). Rows are produced on demand so a
long trace never needs its T x T matrix in memory.

File format version 2 stores `attn` as (layers, heads, packed rows) with a `heads` array of
labels: "mean" (always, first), "kv0".. (mean over the query heads sharing one KV head),
"q0".. (single query heads). Version 1 files (layers, packed rows) load as heads ("mean",).
Version 3 adds an optional `key_norms` (layers, heads, T) float32: the L2 norm of each
position's cached key (after RoPE) for policies that read key norms (knorm); for "kvN" and
"qN" the norm of the KV head they read, for "mean" the mean over the KV heads. Older files
still load, with no key norms. Version 4 adds an optional `value_norms`, shaped and read like
`key_norms`: the L2 norm of each position's cached value, for policies that read value norms
(vatp). Files of versions 1-3 still load, with no value norms. Version 5 adds optional `keys`
(layers, kv_heads, T, head_dim) and `queries` (layers, q_heads, T, head_dim), float16: every
stored layer's key and query vectors after RoPE, as the model's attention sees them, for all
KV heads and all query heads (whichever head labels `attn` stores), for policies and views
that score positions from the vectors themselves. Files of versions 1-4 load with neither.
"""
from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvviz.core.atomic import replacing

FORMAT_VERSION = 5
READ_VERSIONS = (1, 2, 3, 4, 5)
MAX_TRACE_BYTES = 64 * 1024 * 1024


def packed_offset(t: int) -> int:
    """Start of row t in the packed lower triangle (rows 0..t-1 hold 0+1+...+(t-1) values)."""
    return t * (t - 1) // 2


class Trace:
    """Base: `steps` rows, `row(i)` returns a fresh float32 array of length i."""

    steps: int = 0
    name: str = "trace"
    tokens: list[str] | None = None
    meta: dict = {}
    layers: list[int] = []      # model layer numbers stored (empty for synthetic traces)
    layer: int | None = None    # the one loaded
    heads: list[str] = ["mean"]  # head labels stored
    head: str = "mean"          # the one loaded
    key_norms: np.ndarray | None = None  # float32 (T,): each position's key L2 norm, if recorded
    value_norms: np.ndarray | None = None  # float32 (T,): each position's value L2 norm, if recorded
    keys: np.ndarray | None = None  # float16 (layers, kv_heads, T, head_dim) after RoPE, if recorded
    queries: np.ndarray | None = None  # float16 (layers, q_heads, T, head_dim) after RoPE, if recorded

    def row(self, i: int) -> np.ndarray:  # pragma: no cover - abstract
        """Query i's attention over positions 0..i-1 (a fresh array the caller may change):
        the one thing a policy is fed at step i, before the harness restricts it to the
        held positions."""
        raise NotImplementedError

    def key_norm(self, i: int) -> float | None:
        """Position i's key L2 norm, or None when the trace has none (synthetic, version < 3)."""
        return None if self.key_norms is None else float(self.key_norms[i])

    def value_norm(self, i: int) -> float | None:
        """Position i's value L2 norm, or None when the trace has none (synthetic, version < 4)."""
        return None if self.value_norms is None else float(self.value_norms[i])

    def _check_step(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < self.steps:
            raise ValueError(f"step must be in 0..{self.steps - 1}, got {i}")
        return i


@dataclass
class CanonicalTrace(Trace):
    """The cards' benchmark workload, generated row by row from a seed.

    Each row is a mixture, then normalised to sum 1: `sink_mass` shared by the first
    `sinks` positions; `recent_mass` on the `recent` newest positions, decaying with
    distance; `hh_mass` on `hh_per_epoch` heavy hitters (scattered singletons drawn
    independently, fixed within an epoch of `epoch` steps, redrawn at the next); and a
    uniform `background_mass` over every position. Nothing in a row depends on the step
    within an epoch except which positions exist, so the workload is stationary.
    """

    steps: int = 4096
    seed: int = 0
    sinks: int = 4
    recent: int = 64
    epoch: int = 512
    hh_per_epoch: int = 32
    sink_mass: float = 0.15
    recent_mass: float = 0.55
    hh_mass: float = 0.20
    background_mass: float = 0.10
    name: str = "canonical"
    tokens: list[str] | None = None
    meta: dict = field(default_factory=lambda: {"source": "kvviz synthetic canonical trace"})

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        decay = np.exp(-np.arange(self.recent) / (self.recent / 2))
        self._recent_shape = decay / decay.sum()  # index 0 = newest position
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._memo: dict[int, np.ndarray] | None = None

    def keep_rows(self) -> "CanonicalTrace":
        """Remember each row once generated (all 4,096: 34 MB of float32), for a server whose
        replays of one trace would otherwise regenerate every row per policy (a third of a
        replay). `row` still returns a fresh copy. Returns self."""
        if self._memo is None:
            self._memo = {}
        return self

    def heavy_hitters(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, shares) of one epoch; drawn from the context before the epoch."""
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            hi = max(epoch * self.epoch, self.epoch)
            pos = rng.integers(self.sinks, hi, size=self.hh_per_epoch)
            share = rng.uniform(0.5, 1.5, size=self.hh_per_epoch)
            self._epochs[epoch] = (pos, share / share.sum())
        return self._epochs[epoch]

    def row(self, i: int) -> np.ndarray:
        t = self._check_step(i)
        if self._memo is not None:
            kept = self._memo.get(t)
            if kept is None:
                kept = self._memo[t] = self._make_row(t)  # threads may race: same values
            return kept.copy()
        return self._make_row(t)

    def _make_row(self, t: int) -> np.ndarray:
        if t == 0:
            return np.zeros(0, np.float32)
        w = np.full(t, self.background_mass / t)
        w[: self.sinks] += self.sink_mass / self.sinks
        n = min(self.recent, t)
        w[t - n:] += self.recent_mass * self._recent_shape[:n][::-1]
        pos, share = self.heavy_hitters(t // self.epoch)
        live = pos < t
        np.add.at(w, pos[live], self.hh_mass * share[live])
        w /= w.sum()
        return w.astype(np.float32)


def canonical(steps: int = 4096, seed: int = 0) -> CanonicalTrace:
    """The synthetic trace the cards describe (sinks, a recency band, heavy hitters, an
    intermittent token), rows generated on demand from `seed`: a shared, model-free test
    bed on which every policy's behaviour can be compared and reproduced bit for bit."""
    return CanonicalTrace(steps=steps, seed=seed)


class ArrayTrace(Trace):
    """A trace held as packed lower-triangle rows (float16 or float32) of one layer and head."""

    def __init__(self, packed: np.ndarray, steps: int, *, name="trace", tokens=None,
                 meta=None, layers=None, layer=None, heads=None, head="mean", key_norms=None,
                 value_norms=None, keys=None, queries=None):
        self._packed = packed
        self.keys = None if keys is None else np.asarray(keys, np.float16)
        self.queries = None if queries is None else np.asarray(queries, np.float16)
        self.key_norms = None if key_norms is None else np.asarray(key_norms, np.float32)
        self.value_norms = None if value_norms is None else np.asarray(value_norms, np.float32)
        self.steps = steps
        self.name = name
        self.tokens = tokens
        self.meta = dict(meta or {})
        self.layers = list(layers or [])
        self.layer = layer
        self.heads = list(heads or ["mean"])
        self.head = head

    @property
    def packed(self) -> np.ndarray:
        """The stored packed rows (read by kvviz.core.streams without a copy)."""
        return self._packed

    def row(self, i: int) -> np.ndarray:
        t = self._check_step(i)
        start = packed_offset(t)
        return self._packed[start:start + t].astype(np.float32)


def pack_rows(matrix: np.ndarray) -> np.ndarray:
    """(T, T) matrix whose row t uses columns 0..t-1 -> packed 1-D lower triangle."""
    matrix = np.asarray(matrix)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"attn matrix must be square (T, T), got shape {matrix.shape}")
    rows, cols = np.tril_indices(matrix.shape[0], k=-1)
    return matrix[rows, cols]


def save_trace(path, attn, *, tokens=None, layers=None, heads=None, meta=None,
               dtype="float16", key_norms=None, value_norms=None, keys=None,
               queries=None) -> Path:
    """Write a trace file (format version 5). Row t of each matrix uses columns 0..t-1.

    `key_norms` and `value_norms`, when given, are (L, H, T) like `attn` without its last
    axis (see the module docstring); kept float32, since a norm's scale is far from
    float16's sweet spot. `keys` (L, kv_heads, T, head_dim) and `queries` (L, q_heads, T,
    head_dim), when given, are every stored layer's vectors after RoPE, written float16 (a
    value beyond float16's range is refused rather than stored as inf).

    `attn` is (T, T), (L, T, T) (head-mean only) or (L, H, T, T) with `heads` naming the H
    heads ("mean" first). Written to a temporary file and renamed, so an interrupted save
    never leaves a truncated trace behind.
    """
    attn = np.asarray(attn)
    if attn.ndim == 2:
        attn = attn[None]
    if attn.ndim == 3:
        attn = attn[:, None]
    if attn.ndim != 4:
        raise ValueError(f"attn must be (T, T), (L, T, T) or (L, H, T, T), got shape {attn.shape}")
    heads = ["mean"] if heads is None else [str(h) for h in heads]
    if len(heads) != attn.shape[1]:
        raise ValueError(f"heads must name the {attn.shape[1]} stored heads, got {len(heads)}")
    packed = np.stack([np.stack([pack_rows(m) for m in per_layer]) for per_layer in attn])
    packed = packed.astype(dtype)
    steps = attn.shape[2]
    arrays = {
        "format_version": np.int64(FORMAT_VERSION),
        "attn": packed,
        "layers": np.asarray(layers if layers is not None else range(len(attn)), np.int64),
        "heads": np.asarray(heads, dtype=np.str_),
        "meta": np.str_(json.dumps(meta or {}, sort_keys=True)),
    }
    if tokens is not None:
        if len(tokens) != steps:
            raise ValueError(f"tokens must have one entry per step ({steps}), got {len(tokens)}")
        arrays["tokens"] = np.asarray([str(s) for s in tokens], dtype=np.str_)
    if key_norms is not None:
        arrays["key_norms"] = np.asarray(key_norms, np.float32)
    if value_norms is not None:
        arrays["value_norms"] = np.asarray(value_norms, np.float32)
    for field_name, vectors in (("keys", keys), ("queries", queries)):
        if vectors is not None:
            with np.errstate(over="ignore"):
                arrays[field_name] = np.asarray(vectors).astype(np.float16)
    _check_arrays(arrays, "attn")
    path = Path(path)
    with replacing(path) as fh:
        np.savez_compressed(fh, **arrays)
    return path


def load_trace(source, layer: int | None = None, head: str | None = None, *,
               max_bytes: int = MAX_TRACE_BYTES, name: str | None = None) -> ArrayTrace:
    """Load and validate a trace file (path, bytes or file object). Never unpickles.

    `layer` is a model layer number, one of the stored `layers` (default: the first stored);
    `head` a stored head label (default "mean"). Every problem is a ValueError that names
    the field and the rule it breaks.
    """
    data, default_name = _read_bytes(source, max_bytes)
    if not data:
        raise ValueError("trace file is empty")
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise ValueError("trace file is not an .npz archive (expected a zip made by numpy.savez)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except ValueError as exc:
        raise ValueError(f"trace file holds object arrays, which are refused: {exc}") from None
    except Exception as exc:  # corrupt member, bad header
        raise ValueError(f"trace file could not be read as .npz: {exc}") from None
    steps = _check_arrays(arrays, "attn")
    packed = arrays["attn"]
    if packed.ndim == 2:  # version 1: head-mean only
        packed = packed[:, None]
    layers = [int(x) for x in arrays.get("layers", np.arange(packed.shape[0]))]
    heads = [str(h) for h in arrays["heads"]] if "heads" in arrays else ["mean"]
    li = _pick("layer", layer, layers, layers[0])
    hi = _pick("head", head, heads, "mean")
    tokens = [str(s) for s in arrays["tokens"]] if "tokens" in arrays else None
    meta = json.loads(str(arrays["meta"])) if "meta" in arrays else {}
    rows = packed[li, hi].copy()  # a copy, so the other layers and heads can be freed
    norms = arrays["key_norms"][li, hi].copy() if "key_norms" in arrays else None
    values = arrays["value_norms"][li, hi].copy() if "value_norms" in arrays else None
    return ArrayTrace(rows, steps, name=name or meta.get("name") or default_name,
                      tokens=tokens, meta=meta, layers=layers, layer=layers[li],
                      heads=heads, head=heads[hi], key_norms=norms, value_norms=values,
                      keys=arrays.get("keys"), queries=arrays.get("queries"))


def _pick(field_name: str, wanted, stored: list, default) -> int:
    """Index of `wanted` (default `default`) in `stored`; ValueError listing what is stored."""
    wanted = default if wanted is None else wanted
    if field_name == "layer":
        try:
            wanted = int(wanted)
        except (TypeError, ValueError):
            raise ValueError(f"layer must be a model layer number, got {wanted!r}") from None
    else:
        wanted = str(wanted)
    if wanted not in stored:
        listed = ", ".join(map(str, stored))
        raise ValueError(f"{field_name} {wanted} is not stored in this trace; "
                         f"stored {field_name}s: {listed}")
    return stored.index(wanted)


def _read_bytes(source, max_bytes: int) -> tuple[bytes, str]:
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"trace file not found: {path}")
        size = path.stat().st_size
        if size > max_bytes:
            raise ValueError(f"trace file is {size} bytes; the limit is {max_bytes}")
        return path.read_bytes(), path.stem
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        data = source.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"trace file is over the {max_bytes}-byte limit")
    return data, getattr(source, "name", "uploaded")


def _check_arrays(arrays: dict, key: str) -> int:
    """Validate the format's fields; return the number of steps."""
    if "format_version" not in arrays:
        raise ValueError("trace file has no 'format_version' field")
    version = arrays["format_version"]
    if (version.shape != () or version.dtype.kind not in "iu"
            or int(version) not in READ_VERSIONS):
        raise ValueError(f"format_version must be 1, 2, 3, 4 or 5, got {version!r}")
    version = int(version)
    if key not in arrays:
        raise ValueError(f"trace file has no '{key}' field")
    packed = arrays[key]
    if packed.dtype not in (np.float16, np.float32):
        raise ValueError(f"attn must be float16 or float32, got {packed.dtype}")
    if version == 1:
        if packed.ndim != 2:
            raise ValueError(f"attn must be 2-D (layers, packed rows) in format_version 1, "
                             f"got shape {packed.shape}")
        if "heads" in arrays:
            raise ValueError("heads is a format_version 2 field; a version 1 file stores "
                             "head-mean attention only")
    else:
        if packed.ndim != 3:
            raise ValueError(f"attn must be 3-D (layers, heads, packed rows) in format_version "
                             f"{version}, got shape {packed.shape}")
        _check_heads(arrays, packed.shape[1])
    n = packed.shape[-1]
    steps = int((1 + np.sqrt(1 + 8 * n)) // 2)
    if n == 0 or packed_offset(steps) != n:
        raise ValueError(
            f"attn rows have the wrong lengths: {n} values is not 1+2+...+(T-1) for any T >= 2 "
            "(row t must hold exactly t weights)")
    if packed.shape[0] < 1:
        raise ValueError("attn must hold at least one layer")
    if "layers" in arrays and len(set(arrays["layers"].ravel().tolist())) != arrays["layers"].size:
        raise ValueError("layers must be distinct model layer numbers")
    if not np.isfinite(packed).all():
        raise ValueError("attn weights must be finite (found NaN or inf)")
    if (packed < 0).any():
        raise ValueError("attn weights must be non-negative")
    for field_name, since in (("key_norms", 3), ("value_norms", 4)):
        if field_name in arrays:
            _check_norms(arrays, field_name, since, version, packed.shape[:-1] + (steps,))
    _check_vectors(arrays, version, packed.shape[0], steps)
    if "tokens" in arrays and arrays["tokens"].shape != (steps,):
        raise ValueError(f"tokens must have one entry per step ({steps}), "
                         f"got shape {arrays['tokens'].shape}")
    if "layers" in arrays and arrays["layers"].shape != (packed.shape[0],):
        raise ValueError(f"layers must list {packed.shape[0]} layer indices, "
                         f"got shape {arrays['layers'].shape}")
    if "layers" in arrays and arrays["layers"].dtype.kind not in "iu":
        raise ValueError(f"layers must be integers (model layer numbers), got {arrays['layers'].dtype}")
    if "meta" in arrays:
        try:
            meta = json.loads(str(arrays["meta"]))
        except json.JSONDecodeError:
            raise ValueError("meta must be a JSON object string") from None
        if not isinstance(meta, dict):
            raise ValueError("meta must be a JSON object string")
    return steps


def _check_norms(arrays: dict, field_name: str, since: int, version: int, shape: tuple) -> None:
    if version < since:
        raise ValueError(f"{field_name} is a format_version {since} field; this file says {version}")
    kn = arrays[field_name]
    if kn.dtype != np.float32 or kn.shape != shape:
        raise ValueError(f"{field_name} must be float32 of shape {shape} (layers, heads, steps), "
                         f"got {kn.dtype} of shape {kn.shape}")
    if not np.isfinite(kn).all() or (kn < 0).any():
        raise ValueError(f"{field_name} must be finite and non-negative (they are L2 norms)")


def _check_vectors(arrays: dict, version: int, n_layers: int, steps: int) -> None:
    """Version 5's `keys` (layers, kv_heads, T, head_dim) and `queries` (layers, q_heads, T,
    head_dim): float16, finite, one layer per stored layer and one row per step, the same
    head_dim, query heads a whole multiple of KV heads (grouped-query attention), and enough
    heads for every "kvN" / "qN" label `attn` stores."""
    shapes = {}
    for field_name, axis in (("keys", "kv_heads"), ("queries", "q_heads")):
        if field_name not in arrays:
            continue
        if version < 5:
            raise ValueError(f"{field_name} is a format_version 5 field; this file says {version}")
        v = arrays[field_name]
        if v.dtype != np.float16 or v.ndim != 4:
            raise ValueError(f"{field_name} must be float16 of shape (layers, {axis}, steps, "
                             f"head_dim), got {v.dtype} of shape {v.shape}")
        if v.shape[0] != n_layers or v.shape[2] != steps or min(v.shape[1], v.shape[3]) < 1:
            raise ValueError(f"{field_name} must be (layers, {axis}, steps, head_dim) with "
                             f"{n_layers} layers and {steps} steps like attn, got shape {v.shape}")
        if not np.isfinite(v).all():
            raise ValueError(f"{field_name} must be finite (found NaN or inf: a value beyond "
                             "float16's range?)")
        shapes[field_name] = v.shape
    if len(shapes) == 2:
        (_, hk, _, dk), (_, hq, _, dq) = shapes["keys"], shapes["queries"]
        if dk != dq:
            raise ValueError(f"keys and queries must share head_dim, got {dk} and {dq}")
        if hq % hk:
            raise ValueError(f"queries' q_heads ({hq}) must be a whole multiple of keys' "
                             f"kv_heads ({hk}): each KV head serves q_heads // kv_heads query heads")
    labels = [str(h) for h in arrays["heads"]] if "heads" in arrays else ["mean"]
    for field_name, prefix in (("keys", "kv"), ("queries", "q")):
        if field_name in shapes:
            n = shapes[field_name][1]
            over = [h for h in labels if re.fullmatch(rf"{prefix}\d+", h) and int(h[len(prefix):]) >= n]
            if over:
                raise ValueError(f"{field_name} holds {n} heads, fewer than the head labels "
                                 f"{over} need")


HEAD_LABEL = re.compile(r"mean|kv\d+|q\d+")


def _check_heads(arrays: dict, n_heads: int) -> None:
    """Version 2: `heads` labels the head axis, "mean" first, each label once."""
    if "heads" not in arrays:
        raise ValueError("trace file has no 'heads' field (required in format_version 2)")
    heads = arrays["heads"]
    if heads.dtype.kind != "U" or heads.shape != (n_heads,):
        raise ValueError(f"heads must be {n_heads} str labels (one per attn head), "
                         f"got {heads.dtype} of shape {heads.shape}")
    labels = [str(h) for h in heads]
    if not labels or labels[0] != "mean":
        raise ValueError(f"heads must start with 'mean' (the head-mean is always stored), got {labels}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"heads must be distinct, got {labels}")
    bad = [h for h in labels if not HEAD_LABEL.fullmatch(h)]
    if bad:
        raise ValueError(f"heads must be 'mean', 'kvN' or 'qN', got {bad}")
