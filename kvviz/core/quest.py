"""Quest's page selection (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference", arXiv:2406.10774): a contrast to eviction, not a policy.

Quest frees nothing. The whole KV cache stays in memory, cut into pages of `page_size`
consecutive positions (the paper's default 16), and each page keeps two metadata vectors per
KV head: the per-channel minimum m and maximum M of its keys (section 3.2). At every decoding
step the query q scores each page by an upper bound of q.k over the page's keys,

    U(page) = sum_i max(q_i * m_i, q_i * M_i)

(for any key k in the page, q_i * k_i <= max(q_i * m_i, q_i * M_i) channel by channel), and
attention reads only the top pages (section 3.3): a token budget B gives B // page_size
pages. As the reference kernels run it (mit-han-lab/Quest, `InferenceController`), the page
budget includes the newest page, which is always read, and the others are the top
B // page_size - 1 by U; with no more pages than the budget, every page is read. Ties go to
the lower page (a deterministic order; the kernels' top-k leaves ties unspecified).

kvviz's step t is the query at position t over the cache positions 0..t-1 (what an eviction
policy may hold when query t is made, `Run.held_at(t - 1)`): Quest's pages are laid over
those positions, so the newest page is the (possibly partial) one holding t - 1.
Grouped-query attention: query head h reads KV head h // (q_heads // kv_heads); each query head
selects its own pages, and a KV head's page is fetched when any of its query heads reads it
(`quest_heads` returns the union).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PAGE_SIZE = 16  # the paper's page size (section 4)


def _check_page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive whole number of positions, got {page_size!r}")
    return int(page_size)


def _check_sizes(page_size, token_budget) -> tuple[int, int]:
    page_size = _check_page_size(page_size)
    if (isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer))
            or token_budget < page_size):
        raise ValueError(f"token_budget must be a whole number of positions at least page_size "
                         f"({page_size}): Quest reads whole pages, got {token_budget!r}")
    return int(page_size), int(token_budget)


def _as_keys(keys) -> np.ndarray:
    keys = np.asarray(keys, dtype=np.float64)
    if keys.ndim != 2:
        raise ValueError(f"keys must be 2-D (positions, head_dim), got shape {keys.shape}")
    if not np.isfinite(keys).all():
        raise ValueError("keys must be finite")
    return keys


def page_bounds(keys, page_size: int = PAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(mins, maxs), each (pages, head_dim): the per-channel minimum and maximum of the keys
    of each page of `page_size` consecutive positions (the last page may be partial)."""
    keys = _as_keys(keys)
    page_size = _check_page_size(page_size)
    n, d = keys.shape
    pages = math.ceil(n / page_size)
    pad = pages * page_size - n
    lo = np.concatenate([keys, np.full((pad, d), np.inf)]).reshape(pages, page_size, d).min(axis=1)
    hi = np.concatenate([keys, np.full((pad, d), -np.inf)]).reshape(pages, page_size, d).max(axis=1)
    return lo, hi


def page_scores(keys, query, page_size: int = PAGE_SIZE) -> np.ndarray:
    """(pages,) float64: each page's upper bound of q.k, sum_i max(q_i m_i, q_i M_i)."""
    keys = _as_keys(keys)
    query = np.asarray(query, dtype=np.float64)
    if query.shape != (keys.shape[1],):
        raise ValueError(f"query must be one vector of head_dim {keys.shape[1]}, got shape {query.shape}")
    if not np.isfinite(query).all():
        raise ValueError("query must be finite")
    lo, hi = page_bounds(keys, page_size)
    return np.maximum(lo * query, hi * query).sum(axis=1)


def quest_pages(keys, query, *, page_size: int = PAGE_SIZE, token_budget: int) -> np.ndarray:
    """The pages Quest reads for `query` over `keys` (positions 0..n-1), ascending: all of
    them when there are no more than token_budget // page_size, else the newest page and the
    token_budget // page_size - 1 others with the highest upper bounds (ties: lower page)."""
    page_size, token_budget = _check_sizes(page_size, token_budget)
    scores = page_scores(keys, query, page_size)
    pages, budget = len(scores), token_budget // page_size
    if pages <= budget:
        return np.arange(pages, dtype=np.int64)
    order = np.argsort(-scores[:-1], kind="stable")[:budget - 1]
    return np.sort(np.append(order, pages - 1)).astype(np.int64)


def pages_to_positions(pages, n: int, page_size: int = PAGE_SIZE) -> np.ndarray:
    """The positions (< n) of `pages`, ascending."""
    pages = np.asarray(pages, dtype=np.int64)
    pos = (pages[:, None] * page_size + np.arange(page_size)).ravel()
    return np.sort(pos[pos < n])


def quest_read(keys, query, *, page_size: int = PAGE_SIZE, token_budget: int) -> np.ndarray:
    """The positions of `keys` (0..n-1) that Quest's attention reads for `query`, ascending
    (int64): the positions of `quest_pages`."""
    keys = _as_keys(keys)
    pages = quest_pages(keys, query, page_size=page_size, token_budget=token_budget)
    return pages_to_positions(pages, len(keys), page_size)


def quest_heads(keys, queries, *, page_size: int = PAGE_SIZE, token_budget: int) -> np.ndarray:
    """The positions any query head reads, ascending: `keys` (kv_heads, n, head_dim) of one
    layer, `queries` (q_heads, head_dim) at one step; query head h reads KV head
    h // (q_heads // kv_heads) and picks its own pages (`quest_read`)."""
    keys = np.asarray(keys, dtype=np.float64)
    queries = np.asarray(queries, dtype=np.float64)
    if keys.ndim != 3 or queries.ndim != 2:
        raise ValueError(f"keys must be (kv_heads, positions, head_dim) and queries (q_heads, "
                         f"head_dim), got shapes {keys.shape} and {queries.shape}")
    hk, hq = keys.shape[0], queries.shape[0]
    if hk < 1 or hq % hk:
        raise ValueError(f"queries' heads ({hq}) must be a whole multiple of keys' heads ({hk})")
    r = hq // hk
    read = [quest_read(keys[h // r], queries[h], page_size=page_size, token_budget=token_budget)
            for h in range(hq)]
    return np.unique(np.concatenate(read)).astype(np.int64) if read else np.zeros(0, np.int64)


def query_heads(label: str, q_heads: int, kv_heads: int) -> list[int]:
    """The query heads a trace's head label stands for: "mean" every one, "kvN" the
    q_heads // kv_heads that read KV head N, "qN" query head N alone."""
    r = q_heads // kv_heads
    if label == "mean":
        return list(range(q_heads))
    if label.startswith("kv") and label[2:].isdigit() and int(label[2:]) < kv_heads:
        g = int(label[2:])
        return list(range(g * r, (g + 1) * r))
    if label.startswith("q") and label[1:].isdigit() and int(label[1:]) < q_heads:
        return [int(label[1:])]
    raise ValueError(f"head must be 'mean', 'kvN' (N < {kv_heads}) or 'qN' (N < {q_heads}), got {label!r}")


def quest_reads(trace, step: int, *, page_size: int = PAGE_SIZE, token_budget: int,
                layer: int | None = None, head: str | None = None) -> dict[int, np.ndarray]:
    """What Quest reads for query `step` of a trace that carries key and query vectors
    (`trace.keys`, `trace.queries`), per KV head: {KV head: the positions of 0..step-1 any of
    its query heads reads}, at model layer `layer` (default the loaded one), for the query heads
    of `head` (default the loaded head label; see `query_heads`). Each query head picks its own
    pages (`quest_read`) over the keys of the KV head it reads."""
    if trace.keys is None or trace.queries is None:
        raise ValueError(f"Quest reads key and query vectors, and trace {trace.name!r} has none: "
                         "capture one with `kvviz capture --vectors` (e.g. traces/code-vec.npz)")
    step = trace._check_step(step)
    _check_sizes(page_size, token_budget)
    layer = trace.layer if layer is None else layer
    if layer not in trace.layers:
        raise ValueError(f"layer {layer} is not stored in this trace; stored layers: "
                         f"{', '.join(map(str, trace.layers))}")
    li = trace.layers.index(layer)
    keys, queries = trace.keys[li], trace.queries[li]
    heads = query_heads(trace.head if head is None else head, queries.shape[0], keys.shape[0])
    r = queries.shape[0] // keys.shape[0]
    out: dict[int, np.ndarray] = {}
    for h in heads:
        read = (np.zeros(0, np.int64) if step == 0 else
                quest_read(keys[h // r, :step], queries[h, step], page_size=page_size,
                           token_budget=token_budget))
        out[h // r] = np.union1d(out.get(h // r, np.zeros(0, np.int64)), read).astype(np.int64)
    return out


def quest_at(trace, step: int, *, page_size: int = PAGE_SIZE, token_budget: int,
             layer: int | None = None, head: str | None = None) -> np.ndarray:
    """The cache positions (of 0..step-1) Quest reads for query `step`, ascending: a position
    is read when any query head of `head` reads it (the union of `quest_reads`)."""
    reads = quest_reads(trace, step, page_size=page_size, token_budget=token_budget,
                        layer=layer, head=head)
    return np.unique(np.concatenate(list(reads.values()))).astype(np.int64)


@dataclass(frozen=True)
class Memory:
    """One layer's bytes at a step: the keys and values in memory (`kv_bytes`), Quest's page
    metadata (`metadata_bytes`: a min and a max key per page per KV head) and an eviction
    policy's own bookkeeping (`policy_bytes`: its bytes per slot x the slots it holds)."""

    positions: int
    kv_bytes: int
    metadata_bytes: int = 0
    policy_bytes: int = 0

    @property
    def total(self) -> int:
        """Every byte of the three."""
        return self.kv_bytes + self.metadata_bytes + self.policy_bytes


def kv_bytes_per_position(kv_heads: int, head_dim: int, itemsize: int) -> int:
    """One position's key and value in one layer: kv_heads x head_dim x 2 x itemsize bytes."""
    return int(kv_heads) * int(head_dim) * 2 * int(itemsize)


def quest_memory(positions: int, *, kv_heads: int, head_dim: int, itemsize: int,
                 page_size: int = PAGE_SIZE) -> Memory:
    """Quest's memory for one layer holding `positions`: every key and value stays, plus a min
    and a max key (head_dim values each) per page of `page_size` per KV head."""
    pages = math.ceil(int(positions) / int(page_size))
    return Memory(int(positions), int(positions) * kv_bytes_per_position(kv_heads, head_dim, itemsize),
                  metadata_bytes=pages * int(kv_heads) * int(head_dim) * 2 * int(itemsize))


def eviction_memory(held: int, *, kv_heads: int, head_dim: int, itemsize: int,
                    bytes_per_slot: int) -> Memory:
    """An eviction policy's memory for one layer holding `held` positions: their keys and
    values plus its bookkeeping, `bytes_per_slot` per held slot (Policy.bytes_per_slot)."""
    return Memory(int(held), int(held) * kv_bytes_per_position(kv_heads, head_dim, itemsize),
                  policy_bytes=int(held) * int(bytes_per_slot))


def contrast(read, held) -> dict:
    """What Quest reads against what a policy holds, as position arrays: `both` (read and
    held), `evicted_read` (Quest reads, the policy has evicted), `held_skipped` (the policy
    holds, Quest does not read this step)."""
    read = np.asarray(read, dtype=np.int64)
    held = np.asarray(held, dtype=np.int64)
    return {"both": np.intersect1d(read, held), "evicted_read": np.setdiff1d(read, held),
            "held_skipped": np.setdiff1d(held, read)}
