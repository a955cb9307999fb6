"""The closed-loop result: per-token losses, eviction logs, the rows the model produced.

No torch: the app reads shipped results (traces/loop/*.npz) without it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvviz.core.atomic import replacing
from kvviz.core.budget import as_given
from kvviz.core.replay import NEVER, Run, held_shares
from kvviz.core.trace import ArrayTrace, packed_offset
from kvviz.model.loop.config import LoopConfig

FORMAT = "kvviz-loop"
VERSION = 1
MAX_BYTES = 64 * 1024 * 1024
# a configuration's memory at the end, in bytes (kvviz.model.loop.bookkeeping.memory)
BYTES = ("kv_held_bytes", "full_cache_bytes", "policy_bytes")


def _mean(x) -> float | None:
    return float(np.mean(x)) if len(x) else None


def _ppl(nll) -> float | None:
    return math.exp(float(np.mean(nll))) if len(nll) else None


@dataclass
class LoopResult:
    """Everything one batched loop measured. C configs, T tokens, T-1 predictions.

    - `nll`, `p_true`: float64 (C, T-1); entry t scores token t+1 from the logits at t.
    - `kl_tokens`: float64 (C, T-1), KL(full || config) of the next-token distributions.
    - `top1`: int64 (C, T-1), the argmax next token.
    - `evicted_at`: int64 (C, L, H, T), model layers `layers`; H = 1 (layer) or 3 (kv-head);
      the step each position was evicted in, or -1 (replay.NEVER).
    - `rows`: float32 (C, len(rows_layers), H, packed) or None: the attention rows the model
      really produced over the first `rows_tokens` tokens, packed lower triangle (row t =
      weights of query t on 0..t-1, self dropped, 0 on evicted positions), averaged over
      the query heads of each policy's group, exactly what the policies were fed.
    """

    configs: list[LoopConfig]
    granularity: str
    tokens: list[str]
    token_ids: np.ndarray
    nll: np.ndarray
    p_true: np.ndarray
    kl_tokens: np.ndarray
    top1: np.ndarray
    evicted_at: np.ndarray
    layers: list[int]
    rows: np.ndarray | None = None
    rows_layers: list[int] = field(default_factory=list)
    rows_tokens: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def full_index(self) -> int:
        return next(i for i, c in enumerate(self.configs) if c.is_full)

    @property
    def heads(self) -> list[str]:
        """Labels of the head axis of `evicted_at` and `rows` (the trace contract's names)."""
        return ["mean"] if self.evicted_at.shape[2] == 1 else [f"kv{h}" for h in range(self.evicted_at.shape[2])]

    def first_eviction(self, c: int) -> int:
        hit = self.evicted_at[c][self.evicted_at[c] != NEVER]
        return int(hit.min()) if hit.size else NEVER

    @property
    def results(self) -> list[dict]:
        """One summary per config. "after eviction" = tokens predicted by the queries made
        after the config's first eviction in any layer or head (queries t >= e + 1)."""
        f = self.full_index
        agree = self.top1 == self.top1[f]
        memory = self.meta.get("memory_by_config") or [None] * len(self.configs)
        out = []
        for c, cfg in enumerate(self.configs):
            e = self.first_eviction(c)
            after = np.arange(self.nll.shape[1]) >= e + 1 if e != NEVER else np.zeros(self.nll.shape[1], bool)
            out.append({
                **cfg.to_dict(), "granularity": self.granularity, "label": cfg.label,
                "perplexity": _ppl(self.nll[c]),
                "perplexity_after_eviction": _ppl(self.nll[c, after]),
                "top1_agreement": _mean(agree[c]), "kl": _mean(self.kl_tokens[c]),
                "full_perplexity_after_eviction": _ppl(self.nll[f, after]),
                "top1_agreement_after_eviction": _mean(agree[c, after]),
                "kl_after_eviction": _mean(self.kl_tokens[c, after]),
                "first_eviction": None if e == NEVER else e,
                "n_predicted": int(self.nll.shape[1]), "n_after_eviction": int(after.sum()),
                **({} if memory[c] is None else {k: memory[c][k] for k in BYTES}),
            })
        return out

    def _index(self, c: int, layer: int, head: int, layers) -> tuple[int, int]:
        if not 0 <= int(c) < len(self.configs):
            raise ValueError(f"config index must be in 0..{len(self.configs) - 1}, got {c}")
        if layer not in layers:
            raise ValueError(f"layer {layer} is not stored; stored layers: {list(layers)}")
        if not 0 <= int(head) < self.evicted_at.shape[2]:
            raise ValueError(f"head must be in 0..{self.evicted_at.shape[2] - 1} ({self.heads}), got {head}")
        return list(layers).index(layer), int(head)

    def trace(self, c: int, layer: int, head: int = 0) -> ArrayTrace:
        """The rows config c's model produced at `layer` (a model layer number), `head`."""
        if self.rows is None:
            raise ValueError("this result holds no attention rows (rows_layers was empty)")
        li, h = self._index(c, layer, head, self.rows_layers)
        cfg = self.configs[c]
        return ArrayTrace(self.rows[c, li, h], self.rows_tokens, name=f"loop {cfg.label} L{layer} {self.heads[h]}",
                          tokens=self.tokens[: self.rows_tokens], layers=self.rows_layers, layer=layer,
                          heads=self.heads, head=self.heads[h],
                          meta={"source": "kvviz loop", "config": cfg.label, "granularity": self.granularity,
                                "head": self.heads[h]})

    def run(self, c: int, layer: int, head: int = 0) -> Run:
        """Config c's eviction log at `layer`, `head` as a kvviz Run. `retained` is the
        share of each row's mass on held positions, over the recorded rows (NaN elsewhere;
        evicted positions get no weight in the loop, so it is 1 where rows exist)."""
        li, h = self._index(c, layer, head, self.layers)
        cfg = self.configs[c]
        ev = self.evicted_at[c, li, h].astype(np.int64)
        steps = len(ev)
        retained = np.full(steps, np.nan)
        if self.rows is not None and layer in self.rows_layers and self.rows_tokens > 1:
            n = self.rows_tokens
            retained[:n] = held_shares(self.trace(c, layer, head), ev[:n])
        return Run(policy=cfg.policy, params=cfg.full_params(), budget=cfg.budget or steps, steps=steps,
                   evicted_at=ev, retained=retained, bytes_per_slot=cfg.bytes_per_slot,
                   trace_name=self.meta.get("name", ""),
                   meta={"granularity": self.granularity, "layer": layer, "head": self.heads[h]})

    def to_frame(self, per: str = "position", configs=None, layers=None, heads=None):
        """A long pandas DataFrame (kvviz.core.frame): per="position", one row per config x
        layer x head x position (admitted, evicted, full_mass, lost_mass, and the token's
        outcome under the config: nll, kl, top1_agreement, see `token_columns`); per="step", one
        row per config x layer x head x step x position before it (held, full_mass).
        full_mass is the full cache's own attention (the full row's recorded rows, so known
        at `rows_layers` over the first `rows_tokens` queries; NaN elsewhere). `configs`
        (indices), `layers` (model layer numbers), `heads` (indices) narrow it."""
        from kvviz.core import frame

        frame.check_per(per)
        cs = range(len(self.configs)) if configs is None else [int(c) for c in configs]
        ls = list(self.layers) if layers is None else [int(x) for x in layers]
        hs = range(self.evicted_at.shape[2]) if heads is None else [int(h) for h in heads]
        for c in cs:
            for layer in ls:
                for h in hs:
                    self._index(c, layer, h, self.layers)
        frame.check_size(len(cs) * len(ls) * len(hs), len(self.tokens), per)
        f = next((i for i, c in enumerate(self.configs) if c.is_full), None)
        blocks = []
        for c in cs:
            cfg = self.configs[c]
            for layer in ls:
                li = list(self.layers).index(layer)
                for h in hs:
                    row, n = None, 0
                    if self.rows is not None and layer in self.rows_layers and f is not None:
                        packed = self.rows[f, list(self.rows_layers).index(layer), h]
                        row, n = (lambda t, p=packed: p[packed_offset(t):packed_offset(t) + t]), self.rows_tokens
                    given = None if cfg.budget is None else as_given(cfg.budget)  # a ratio as its text
                    keys = {"config": cfg.label, "policy": cfg.policy, "budget": given,
                            "layer": layer, "head": self.heads[h]}
                    blocks.append((keys, frame.stream(self.evicted_at[c, li, h], row=row, n_rows=n, per=per)))
        df = frame.frame(blocks, tokens=self.tokens, per=per)
        if per == "position":
            for name, values in self.token_columns(cs, len(ls) * len(hs)).items():
                df[name] = values
        return df

    def token_columns(self, configs, repeat: int = 1) -> dict:
        """The per-token outcome columns of the position table, for `configs` (indices), each
        config's T values repeated `repeat` times (its layers x heads): at position p, `nll`
        of token p under the config (from the logits at p - 1), `kl` (KL(full || config) of
        that prediction) and `top1_agreement` (its argmax equals the full cache's). Position
        0 has no prediction: NaN / <NA>; so do `kl` and `top1_agreement` without a full-cache
        row. A column's mean over one layer and head is the config's summary in `results`."""
        import pandas as pd

        T, cs = len(self.tokens), list(configs)
        f = next((i for i, c in enumerate(self.configs) if c.is_full), None)
        first = np.full((len(cs), 1), np.nan)
        nll = np.hstack([first, self.nll[cs].reshape(len(cs), T - 1)])
        kl = np.hstack([first, self.kl_tokens[cs].reshape(len(cs), T - 1)])
        agree = np.zeros((len(cs), T), bool)
        unknown = np.zeros((len(cs), T), bool)
        unknown[:, 0] = True
        if f is None:  # nothing to compare with
            kl[:] = np.nan
            unknown[:] = True
        else:
            agree[:, 1:] = self.top1[cs].reshape(len(cs), T - 1) == self.top1[f]

        def rows(x):  # each config's T values, once per layer x head
            return np.repeat(x[:, None], repeat, 1).reshape(-1)

        return {"nll": rows(nll), "kl": rows(kl),
                "top1_agreement": pd.arrays.BooleanArray(rows(agree), rows(unknown))}

    def save(self, path, layers=None, rows_dtype="float32") -> Path:
        """Write an .npz (no pickles) atomically. `layers` keeps only those model layers'
        eviction logs (default all); rows may be stored float16 to halve the file."""
        path = Path(path)
        keep = list(self.layers) if layers is None else [int(x) for x in layers]
        for x in keep:
            self._index(0, x, 0, self.layers)
        sel = [list(self.layers).index(x) for x in keep]
        T = len(self.tokens)
        meta = dict(self.meta, format=FORMAT, version=VERSION, granularity=self.granularity,
                    configs=[c.record() for c in self.configs], tokens=self.tokens, layers=keep,
                    rows_layers=list(self.rows_layers), rows_tokens=int(self.rows_tokens))
        arrays = {
            "meta": np.array(json.dumps(meta)),
            "token_ids": self.token_ids.astype(np.int64),
            "nll": self.nll, "p_true": self.p_true, "kl_tokens": self.kl_tokens,
            "top1": self.top1.astype(np.int32),
            "evicted_at": self.evicted_at[:, sel].astype(np.int16 if T < 32000 else np.int32),
        }
        if self.rows is not None:
            arrays["rows"] = self.rows.astype(rows_dtype)
        with replacing(path) as fh:
            np.savez_compressed(fh, **arrays)
        return path


def load_loop_result(path, max_bytes: int = MAX_BYTES) -> LoopResult:
    """Read a file written by LoopResult.save (allow_pickle=False; shapes checked)."""
    path = Path(path)
    if path.stat().st_size > max_bytes:
        raise ValueError(f"loop result {path.name} is {path.stat().st_size} bytes; the limit is {max_bytes}")
    with np.load(path, allow_pickle=False) as z:
        try:
            meta = json.loads(str(z["meta"]))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{path.name} is not a kvviz loop result: {exc}") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path.name} is not a kvviz loop result version {VERSION}")
        data = {k: z[k] for k in z.files if k != "meta"}
    configs = [LoopConfig.from_record(d) for d in meta.pop("configs")]  # without the policies' code
    tokens = meta.pop("tokens")
    C, T = len(configs), len(tokens)
    for key in ("nll", "p_true", "kl_tokens", "top1"):
        if data[key].shape != (C, T - 1):
            raise ValueError(f"{path.name}: {key} has shape {data[key].shape}, expected {(C, T - 1)}")
    ev = data["evicted_at"].astype(np.int64)
    if ev.ndim != 4 or ev.shape[0] != C or ev.shape[1] != len(meta["layers"]) or ev.shape[3] != T:
        raise ValueError(f"{path.name}: evicted_at has shape {ev.shape}")
    rows = data.get("rows")
    if rows is not None:
        n = int(meta["rows_tokens"])
        expect = (C, len(meta["rows_layers"]), ev.shape[2], packed_offset(n))
        if rows.shape != expect:
            raise ValueError(f"{path.name}: rows have shape {rows.shape}, expected {expect}")
        rows = rows.astype(np.float32)
    return LoopResult(configs=configs, granularity=meta.pop("granularity"), tokens=tokens,
                      token_ids=data["token_ids"], nll=data["nll"], p_true=data["p_true"],
                      kl_tokens=data["kl_tokens"], top1=data["top1"].astype(np.int64), evicted_at=ev,
                      layers=meta.pop("layers"), rows=rows, rows_layers=meta.pop("rows_layers"),
                      rows_tokens=int(meta.pop("rows_tokens")), meta=meta)
