"""What a generation under eviction produced (kvviz.model.loop.generate): no torch here, so the
app, the needle and a saved file read it without the model stack."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from kvviz.core.atomic import replacing
from kvviz.core.budget import as_given
from kvviz.core.replay import NEVER
from kvviz.model.loop.config import GRANULARITIES, PREFILL_CHUNK, LoopConfig, check_chunk, check_eviction

FORMAT = "kvviz-generation"
VERSION = 1
PROMPT_MODES = ("decode", "prefill")


def check_request(prompt, max_new_tokens, granularity="layer", prompt_mode="decode", eviction="masked",
                  prefill_chunk=PREFILL_CHUNK) -> None:
    """generate's input rules, checked before any model loads; ValueError names the parameter."""
    check_eviction(eviction)
    check_chunk(prefill_chunk)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if prompt_mode not in PROMPT_MODES:
        raise ValueError(f"prompt_mode must be one of {list(PROMPT_MODES)}, got {prompt_mode!r}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty: give the model something to read")
    else:
        try:
            ids = list(prompt)
        except TypeError:
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}") from None
        if not ids:
            raise ValueError("prompt is empty: give the model something to read")
        if any(isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or i < 0 for i in ids):
            raise ValueError("prompt token ids must be non-negative integers")
    if (isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, (int, np.integer))
            or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def with_reference(configs, full_cache=True) -> list:
    """generate's configurations (kvviz.model.loop.config.check_configs: a `full` row first
    unless given) with the full-cache row left out when `full_cache` is False; then no
    configuration may be `full` and at least one must evict. ValueError names the parameter."""
    from kvviz.model.loop.config import check_configs

    if not isinstance(full_cache, (bool, np.bool_)):
        raise ValueError(f"full_cache must be True or False, got {full_cache!r}")
    configs = list(configs)
    if not full_cache and any(isinstance(c, LoopConfig) and c.is_full for c in configs):
        raise ValueError("full_cache=False leaves the full-cache row out: configs must not include 'full'")
    configs = check_configs(configs)
    if full_cache:
        return configs
    if len(configs) == 1:
        raise ValueError("full_cache=False leaves the full-cache row out: give at least one evicting configuration")
    return [c for c in configs if not c.is_full]


@dataclass
class Generation:
    """One prompt, C configurations (one batch row each), greedy continuations.

    - `new_ids` int64 (C, N): each row's generated tokens, -1 after the row stopped;
      `logprobs` float64 (C, N): each token's log-probability under its own row, NaN-padded.
    - `stopped`: "eos" or "length" per row; `texts`: the decoded continuations; `pieces`:
      per row, one display string per generated token (kvviz.model.models.token_strings).
    - `evicted_at` int64 (C, L, G, T0 + N): the step at which each position was evicted,
      kvviz.core.replay.NEVER if never (prefill victims: step T0 - 1).
    - `agreement[c]`: share of the N columns where row c's token equals the full row's (two
      rows both stopped count as agreeing); `departure[c]`: the first column where they
      differ, -1 if none. A generation run without the full-cache row (`full_cache=False`,
      said in `meta["full_cache"]`) has no reference: both are None for every row.
    """

    configs: list
    granularity: str
    prompt_mode: str
    prompt_ids: np.ndarray
    tokens: list
    new_ids: np.ndarray
    logprobs: np.ndarray
    texts: list
    stopped: list
    evicted_at: np.ndarray
    meta: dict = field(default_factory=dict)
    pieces: list = field(default_factory=list)  # per row, one display string per generated token
    agreement: list = field(init=False)
    departure: list = field(init=False)

    def __post_init__(self):
        self.prompt_ids = np.asarray(self.prompt_ids, np.int64)
        self.new_ids = np.asarray(self.new_ids, np.int64)
        self.logprobs = np.asarray(self.logprobs, np.float64)
        self.evicted_at = np.asarray(self.evicted_at, np.int64)
        f = self.full_index
        if f is None:
            self.agreement, self.departure = [None] * len(self.configs), [None] * len(self.configs)
            return
        same = self.new_ids == self.new_ids[f]
        self.agreement = [float(row.mean()) if row.size else 1.0 for row in same]
        self.departure = [int(np.argmin(row)) if not row.all() else -1 for row in same]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def full_index(self) -> int | None:
        """The full-cache row, or None when the generation left it out."""
        return next((i for i, c in enumerate(self.configs) if c.is_full), None)

    @property
    def labels(self) -> list[str]:
        return [c.label for c in self.configs]

    def generated(self, c: int) -> np.ndarray:
        """Row c's generated ids without the padding."""
        row = self.new_ids[c]
        return row[row >= 0]

    def held(self, c: int, step: int) -> np.ndarray:
        """bool (L, G, step + 1): the positions config c holds after step `step`'s eviction."""
        if not 0 <= step < self.evicted_at.shape[-1]:
            raise ValueError(f"step must be in 0..{self.evicted_at.shape[-1] - 1}, got {step}")
        ev = self.evicted_at[c, :, :, : step + 1]
        return (ev == NEVER) | (ev > step)

    def marked(self, c: int, marker: str = "|>") -> str:
        """Row c's continuation with `marker` before the first token that differs from the
        full row's (none if it never departs, or there is no full row); newlines shown as \\n."""
        pieces = self.pieces[c] if self.pieces else [self.texts[c]]
        d = self.departure[c]
        if d is not None and d >= 0 and self.pieces:
            pieces = pieces[:d] + [marker] + pieces[d:]
        return "".join(pieces).replace("\n", "\\n")

    def to_frame(self, per: str = "position", configs=None, layers=None, heads=None):
        """A long pandas DataFrame (kvviz.core.frame) over prompt and generated positions:
        per="position", one row per config x layer x head x position; per="step", one row
        per config x layer x head x step x position before it. Tokens are the prompt's and
        then each row's own generated pieces; a generation records no attention rows, so
        full_mass is NaN. `configs`, `layers`, `heads` (indices) narrow it."""
        from kvviz.core import frame

        frame.check_per(per)
        C, L, G, T = self.evicted_at.shape
        cs, ls, hs = frame.chosen((C, L, G), configs, layers, heads)
        frame.check_size(len(cs) * len(ls) * len(hs), T, per)
        head_names = ["mean"] if G == 1 else [f"kv{g}" for g in range(G)]
        blocks = []
        for c in cs:
            cfg = self.configs[c]
            own = list(self.tokens) + (list(self.pieces[c]) if self.pieces else [])
            for layer in ls:
                for h in hs:
                    given = None if cfg.budget is None else as_given(cfg.budget)  # a ratio as its text
                    keys = {"config": cfg.label, "policy": cfg.policy, "budget": given,
                            "layer": layer, "head": head_names[h], "tokens": own}
                    blocks.append((keys, frame.stream(self.evicted_at[c, layer, h], per=per)))
        return frame.frame(blocks, per=per)

    @property
    def results(self) -> list[dict]:
        out = []
        for c, cfg in enumerate(self.configs):
            lp = self.logprobs[c][~np.isnan(self.logprobs[c])]
            out.append({"label": cfg.label, **cfg.to_dict(), "text": self.texts[c],
                        "new_tokens": int(len(self.generated(c))), "stopped": self.stopped[c],
                        "agreement": self.agreement[c], "departure": self.departure[c],
                        "mean_logprob": float(lp.mean()) if len(lp) else None})
        return out

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "granularity": self.granularity,
                "prompt_mode": self.prompt_mode, "configs": [c.record() for c in self.configs],
                "prompt_ids": self.prompt_ids.tolist(), "prompt_len": self.prompt_len, "tokens": list(self.tokens),
                "new_ids": self.new_ids.tolist(),
                "logprobs": [[None if np.isnan(x) else float(x) for x in row] for row in self.logprobs],
                "texts": list(self.texts), "stopped": list(self.stopped), "agreement": self.agreement,
                "departure": self.departure,
                "pieces": [list(p) for p in self.pieces], "evicted_at": self.evicted_at.tolist(),
                "results": self.results, "meta": self.meta}

    def save(self, path) -> None:
        """JSON, written atomically (a temporary file, then os.replace)."""
        with replacing(path) as fh:
            fh.write(json.dumps(self.to_dict()).encode())

    @classmethod
    def from_dict(cls, d: dict) -> "Generation":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a kvviz generation file (format {d.get('format')!r})")
        configs = [LoopConfig.from_record(c) for c in d["configs"]]  # without the policies' code
        C = len(configs)
        new_ids = np.asarray(d["new_ids"], np.int64).reshape(C, -1)
        logprobs = np.array([[np.nan if x is None else x for x in row] for row in d["logprobs"]],
                            np.float64).reshape(new_ids.shape)
        return cls(configs=configs, granularity=d["granularity"], prompt_mode=d["prompt_mode"],
                   prompt_ids=np.asarray(d["prompt_ids"], np.int64), tokens=d["tokens"],
                   new_ids=new_ids, logprobs=logprobs, texts=d["texts"], stopped=d["stopped"],
                   evicted_at=np.asarray(d["evicted_at"], np.int64), meta=d.get("meta", {}),
                   pieces=d.get("pieces", []))


def load_generation(path) -> Generation:
    """A Generation saved by `Generation.save`."""
    with open(path, encoding="utf-8") as fh:
        return Generation.from_dict(json.load(fh))
