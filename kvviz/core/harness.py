"""The per-step rule every harness shares; Replay, run_streams and the loop all call `step`.

At step t a policy sees row t restricted to the positions it holds, renormalised to sum 1
over them in float64 and rounded to float32 once (what a model running with the
compressed cache would compute; a row with no mass is observed as is), then admits t,
then evicts down to its budget. `policy` is a Policy (one stream: rows are (n,)) or a
kvviz.core.streams.Streams (S streams at once: rows are (S, n)); both offer `held()`,
`advance(pos, attn)` and `evict(budget)`.

The budget is enforced here, not trusted: after the eviction `step` counts what the policy
holds and `enforce` stops the run (BudgetError, one line naming the policy, the stream, the
step and the count) when it is over. A harness records the counts it reads (`held_count`)
at every step, and memory figures are computed from those records. Nor are the victims
trusted: `check_victims` compares the held set before the eviction with the held set after
it, and the victims must be exactly the positions that left, each once (VictimError, one
line naming the policy, the stream, the step and what differs).
`step_layer` is the same rule for the KV heads of one layer under an allocator
(kvviz.core.policies.alloc): each head is fed, then the allocator evicts across them
(`evict_layer`), then every head's cap, the layer's total and every head's victims are
checked.
"""
from __future__ import annotations

import numpy as np

from kvviz.core.policies.base import BudgetError, VictimError, enforce, norm_inputs

__all__ = ["BudgetError", "VictimError", "check_victims", "enforce", "evict_layer", "feed",
           "held_count", "keys_at", "renormalise", "step", "step_layer"]


def renormalise(raw: np.ndarray, t: int) -> np.ndarray:
    """float32 weights from the raw weights on the held positions, (n,) or (S, n) per row.

    Refuses negative or non-finite weights (NaN fails both tests below), naming the row.
    """
    held = raw.astype(np.float64)
    if raw.ndim == 1:
        mass = held.sum()
        if len(held) and not (mass < np.inf and held.min() >= 0):
            raise ValueError(f"trace row {t} has negative or non-finite weights on held positions")
        if mass > 0:
            held /= mass
        return held.astype(np.float32)
    mass = held.sum(axis=1)  # per row numpy's pairwise sum, as the 1-D held.sum()
    n = raw.shape[1]
    if n and not (mass.max() < np.inf and raw.min() >= 0):
        bad = ~((mass < np.inf) & (raw.min(axis=1) >= 0))
        raise ValueError(f"trace row {t} of stream {int(np.flatnonzero(bad)[0])} has "
                         "negative or non-finite weights on held positions")
    attn = np.empty(raw.shape, np.float32)
    if n and mass.min() > 0:
        np.divide(held, mass[:, None], out=attn, casting="same_kind")  # float64, rounded once
    elif n:
        np.divide(held, mass[:, None], out=held, where=mass[:, None] > 0)
        attn[:] = held
    return attn


def feed(policy, pos: int, raw, key_norm=None, value_norm=None, query_rows=None, keys=None,
         query=None) -> None:
    """The first half of `step`: observe the renormalised row, admit `pos`; no eviction.

    `raw` holds the weights at `policy.held()`; it is ignored (and may be None) for a
    policy that reads no attention. `key_norm` / `value_norm` (the admitted position's key
    and value L2 norms) reach only a policy that reads them (`reads_key_norms`,
    `reads_value_norms`), `query_rows` ((query heads, held): each query head's raw weights,
    renormalised here row by row) only one that `reads_query_rows`, `keys` ((held + 1,
    head_dim): the cache's keys at `policy.held()` and at `pos`, `keys_at`) only one that
    `reads_keys`, `query` ((group, head_dim): step `pos`'s query vectors) only one that
    `reads_queries`; one that reads an input not given is refused (ValueError).
    """
    attn = None if raw is None or not policy.uses_attention else renormalise(raw, pos)
    if query_rows is not None and policy.reads_query_rows:
        query_rows = renormalise(np.asarray(query_rows), pos)
    policy.advance(pos, attn, **norm_inputs(policy, key_norm, value_norm, query_rows, None, keys, query))


def keys_at(held: np.ndarray, pos: int) -> np.ndarray:
    """The positions whose keys a policy that `reads_keys` is given at step `pos`: the ones
    it holds, then `pos` itself (int64)."""
    return np.append(np.asarray(held, np.int64), np.int64(pos))


def held_count(policy) -> int:
    """How many slots the policy (or each stream of a Streams group) holds now."""
    return int(policy.held().shape[-1])


def step(policy, pos: int, raw, budget: int, key_norm=None, stream: str = "",
         value_norm=None, query_rows=None, keys=None, query=None) -> np.ndarray:
    """One harness step: feed, then `evict(budget)`, then `enforce` the budget and check the
    victims (`check_victims`; `check_stream_victims` for a Streams group); returns the
    victims' positions (int64). `stream` names the stream in a refusal."""
    feed(policy, pos, raw, key_norm, value_norm, query_rows, keys, query)
    before = policy.held().copy()  # an eviction may close its gaps in place
    victims = policy.evict(budget)
    after = policy.held()
    name = getattr(policy, "name", type(policy).__name__)
    enforce(name, int(after.shape[-1]), budget, pos, stream)
    if before.ndim == 1:
        return check_victims(name, before, after, victims, pos, stream)
    return check_stream_victims(name, before, after, victims, pos, policy.offsets,
                                policy.stream_names, stream)


def step_layer(group, pos: int, raws, key_norms=None, value_norms=None, query_rows=None) -> list:
    """One step of the KV heads of one layer under an allocator: feed head g its row
    `raws[g]` (and `key_norms[g]`, `value_norms[g]`, `query_rows[g]`), then `evict_layer`.
    `group` is an allocator's per-layer group (`Allocator.group(...)`); returns one array of
    victims' positions per head."""
    for g, policy in enumerate(group.policies):
        feed(policy, pos, None if raws is None else raws[g],
             None if key_norms is None else key_norms[g],
             None if value_norms is None else value_norms[g],
             None if query_rows is None else query_rows[g])
    return evict_layer(group, pos)


def evict_layer(group, pos: int) -> list:
    """The allocator evicts across the layer's heads (`group.evict()`), then each head's cap
    and the layer's total are enforced (`group.enforce(pos)`) and each head's victims
    checked (`check_victims`); one int64 array of victims' positions per head."""
    before = [p.held().copy() for p in group.policies]
    victims = list(group.evict())
    group.enforce(pos)
    where = group.place.describe()
    if len(victims) != len(before):
        raise VictimError(f"{group.name} reported victims for {len(victims)} heads at step {pos}"
                          f"{f' in {where}' if where else ''}, but the layer has {len(before)}: "
                          "an allocator reports one array of victims per head")
    return [check_victims(group.name, held, p.held(), v, pos, ", ".join(filter(None, [where, f"head {g}"])))
            for g, (p, held, v) in enumerate(zip(group.policies, before, victims))]


# -- the victims a policy reports --------------------------------------------------------

_INT64 = np.dtype(np.int64)


def check_victims(name: str, before, after, victims, pos: int, stream: str = "") -> np.ndarray:
    """`victims` (int64), after checking that they are exactly the positions of the held
    set `before` the eviction that are not in the held set `after` it, each reported once:
    nothing still held, nothing that was not held, nothing left out. VictimError otherwise,
    naming `name`, the step `pos`, the stream and what differs.

    The common cases (nothing left; one victim) are decided by comparing bytes, about a
    microsecond a step; anything else, or arrays not in ascending order, by set arithmetic."""
    if type(victims) is not np.ndarray or victims.dtype is not _INT64:
        victims = _int64(victims, name, pos, stream)
    if type(before) is not np.ndarray or type(after) is not np.ndarray:
        before, after = np.asarray(before), np.asarray(after)
    if _exact(before, after, victims):
        return victims
    problem = _differences(before, after, victims)
    if problem:
        raise VictimError(_said(name, victims, pos, stream, problem))
    return victims  # the same sets, in another order


def check_stream_victims(name: str, before, after, victims, pos: int, offsets, stream_names=None,
                         stream: str = "") -> np.ndarray:
    """`check_victims` for S streams at once (a kvviz.core.streams.Streams group): `before`
    and `after` are (S, n) held keys (a position plus the stream's `offsets` entry), each
    row ascending and without repeats, `victims` (S, k) positions; `stream_names[s]` names
    stream s in a refusal (default 'stream s')."""
    if type(victims) is not np.ndarray or victims.dtype is not _INT64:
        victims = _int64(victims, name, pos, stream)
    S = len(before)
    if victims.ndim != 2 or len(victims) != S:
        where = f" in stream {stream}" if stream else ""
        raise VictimError(f"{name} reported victims of shape {victims.shape} at step {pos}{where} "
                          f"for {S} streams: one row of victims per stream")
    offsets = np.asarray(offsets, np.int64)
    if _exact_streams(before, after, victims + offsets[:, None]):
        return victims
    for s in range(S):
        problem = _differences(before[s] - offsets[s], after[s] - offsets[s], victims[s])
        if problem:
            label = stream_names[s] if stream_names is not None else f"stream {s}"
            raise VictimError(_said(name, victims[s], pos, ", ".join(filter(None, [stream, label])), problem))
    return victims


def _int64(victims, name: str, pos: int, stream: str) -> np.ndarray:
    """The reported victims as an int64 array; VictimError for non-integer ones."""
    v = np.asarray(victims)
    if v.size and not np.issubdtype(v.dtype, np.integer):
        where = f" in stream {stream}" if stream else ""
        raise VictimError(f"{name} reported victims that are not positions at step {pos}{where}: "
                          f"{v.dtype} values {_few(v.ravel())}; victims are integer positions")
    return v.astype(np.int64)


def _exact(before: np.ndarray, after: np.ndarray, victims: np.ndarray) -> bool:
    """Whether `after` plus `victims` is `before` (1-D, ascending, one dtype), decided from
    their bytes: False means "look closer" (`_differences`), never "wrong"."""
    if victims.ndim != 1 or len(after) + len(victims) != len(before):
        return False
    k = len(victims)
    if k == 0:
        return after.tobytes() == before.tobytes()
    held = before.tobytes()
    if k == 1:  # `after` is `before` without the victim's 8 bytes, found by bisection
        i = 8 * int(before.searchsorted(victims)[0])
        return held[i:i + 8] == victims.tobytes() and after.tobytes() == held[:i] + held[i + 8:]
    merged = np.concatenate((after, victims))
    merged.sort()
    return merged.tobytes() == held


def _exact_streams(before: np.ndarray, after: np.ndarray, keys: np.ndarray) -> bool:
    """`_exact` for S streams at once: (S, n) keys before and after, (S, k) victims' keys."""
    S, n = before.shape
    k = keys.shape[1]
    if after.shape != (S, n - k):
        return False
    if not k:
        return after.tobytes() == before.tobytes()
    if k == 1:  # a row holds each key once: S hits in all means one per row
        stay = before != keys
        return np.count_nonzero(stay) == S * (n - 1) and before[stay].tobytes() == after.tobytes()
    merged = np.concatenate((after, keys), axis=1)
    merged.sort(axis=1)
    return merged.tobytes() == before.tobytes()


def _differences(before: np.ndarray, after: np.ndarray, victims: np.ndarray) -> str:
    """What differs between `victims` and the positions that left `before` for `after`, in
    words ('' when nothing does)."""
    reported, counts = np.unique(victims, return_counts=True)
    parts = []
    left = np.setdiff1d(before, after)
    unreported = np.setdiff1d(left, reported)
    if len(unreported):
        parts.append(f"{_count(len(unreported), 'position')} left its held set unreported: "
                     f"{_few(unreported)}")
    still = np.intersect1d(reported, after)
    if len(still):
        parts.append(f"{_count(len(still), 'reported victim')} {'is' if len(still) == 1 else 'are'} "
                     f"still held: {_few(still)}")
    never = np.setdiff1d(np.setdiff1d(reported, before), after)
    if len(never):
        parts.append(f"{_count(len(never), 'reported victim')} {'was' if len(never) == 1 else 'were'} "
                     f"not held: {_few(never)}")
    twice = reported[counts > 1]
    if len(twice):
        parts.append(f"{_few(twice)} {'was' if len(twice) == 1 else 'were'} reported more than once")
    joined = np.setdiff1d(after, before)
    if len(joined):
        parts.append(f"{_count(len(joined), 'position')} joined its held set while it evicted: "
                     f"{_few(joined)}")
    return "; ".join(parts)


def _said(name: str, victims: np.ndarray, pos: int, stream: str, problem: str) -> str:
    k = len(victims)
    shown = f" ({_few(victims)})" if k else ""
    where = f" in stream {stream}" if stream else ""
    return (f"{name} reported {_count(k, 'victim')}{shown} at step {pos}{where}, but {problem} "
            "(victims must be exactly the positions that left the held set)")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _few(values, limit: int = 8) -> str:
    shown = ", ".join(str(int(v)) for v in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")



# -- a prompt read in one pass ----------------------------------------------------------

def prefill_needs(policy, length: int) -> tuple[int, bool, bool]:
    """What `prefill` needs of a `length`-row prompt for `policy`: (how many last rows as
    they are, whether the float64 sum of the renormalised rows before the last, whether
    every row in order as it arrives). A policy reading no attention needs no rows."""
    if not policy.uses_attention:
        return 0, False, False
    if policy.reads_query_rows:
        return 1, False, True  # each row's query heads, as they arrive
    if policy.summable:
        return 1, True, False
    k = int(policy.prefill_rows(length))
    if not 1 <= k <= length:
        raise ValueError(f"{policy.name}.prefill_rows({length}) must be in 1..{length}, got {k}")
    return (1, False, True) if k == length else (k, False, False)


def refuse_vectors_in_prefill(policy) -> None:
    """A prompt read in one pass supplies no key or query vectors: ValueError naming a policy
    that reads them and the way to read the prompt token by token."""
    if getattr(policy, "reads_keys", False) or getattr(policy, "reads_queries", False):
        raise ValueError(f"{policy.name} reads key and query vectors, which a prompt read in one pass "
                         "does not supply: read the prompt token by token (kvviz loop; kvviz generate "
                         "--prompt-mode decode; kvviz needle --prompt-modes decode)")


class PromptRows:
    """One stream's prompt rows as `prefill` needs them, gathered from chunks of rows as a
    model produces them, in memory linear in the prompt length: the last `tail` rows,
    optionally the float64 sum of the renormalised rows before the last (`sums`), and
    every row before the last fed at once to the `streamed` policies (which need them all).

    `add(start, raw, key_norms)` takes rows start..start+m-1 in order (rows nobody `wants`
    may be left out): row t's weights
    on positions 0..t-1 are `raw[i, :t]` (nothing is evicted during a prefill, so a
    row's held positions are all the earlier ones); `key_norms` (length,) is needed
    only when a streamed policy reads key norms, `value_norms` when one reads value norms."""

    def __init__(self, length: int, tail: int = 1, sums: bool = False, streamed=()):
        self.length = int(length)
        self.tail = max(1, min(int(tail), self.length))
        self.rows = np.zeros((self.tail, self.length), np.float32)  # row i = prompt row length - tail + i
        self.sums = np.zeros(max(self.length - 1, 0)) if sums else None
        self.streamed = list(streamed)
        self.last_query_rows = None  # the last row's, per query head, when given
        self.next = 0

    def wants(self, start: int, stop: int) -> bool:
        """Whether rows start..stop-1 are needed: every row is, for a sum or a streamed
        policy; else only the last `tail`."""
        return self.sums is not None or bool(self.streamed) or stop > self.length - self.tail

    def add(self, start: int, raw: np.ndarray, key_norms=None, value_norms=None,
            query_rows=None) -> None:
        """Take prompt rows start..start+len(raw)-1 (see the class docstring); `query_rows`
        (query heads, rows, length), each query head's rows, when a streamed policy reads them."""
        if start != self.next and (start < self.next or self.wants(self.next, start)):
            raise ValueError(f"prompt rows must arrive in order: expected row {self.next}, got {start}")
        first_tail = self.length - self.tail
        for i in range(raw.shape[0]):
            t = start + i
            row = raw[i, :t]
            if t < self.length - 1:
                for p in self.streamed:
                    feed(p, t, row, None if key_norms is None or not p.reads_key_norms else key_norms[t],
                         None if value_norms is None or not p.reads_value_norms else value_norms[t],
                         None if query_rows is None or not p.reads_query_rows
                         else query_rows[:, i, :t])
                if self.sums is not None and t:
                    self.sums[:t] += renormalise(row, t)
            if t >= first_tail:
                self.rows[t - first_tail, :t] = row
            if t == self.length - 1 and query_rows is not None:
                self.last_query_rows = query_rows[:, i, :t].copy()
        self.next = start + raw.shape[0]

    def row(self, t: int) -> np.ndarray:
        """Prompt row t's weights on 0..t-1, for one of the last `tail` rows."""
        return self.rows[t - (self.length - self.tail), :t]


def prefill(policy, rows: PromptRows | None, length: int, budget: int, key_norms=None,
            value_norms=None, stream: str = "") -> np.ndarray:
    """A prompt of `length` positions read in one pass: `policy` observes its rows without
    evicting, then evicts once, down to `budget`, at the last row (one `step`); returns
    the victims. Bit for bit what feeding every row and stepping the last gives, through
    the policy's declared shortcut (`prefill_needs`): rows it does not depend on are
    passed over (their positions admitted unobserved, `skip_rows` told), and a summable
    policy observes the rows' sum once. `rows` (a PromptRows built with at least the
    policy's needs) may be None for a policy that reads no attention. `stream` names the
    stream in a refusal."""
    refuse_vectors_in_prefill(policy)
    tail, sums, streamed = prefill_needs(policy, length)
    kn = (lambda t: key_norms[t]) if policy.reads_key_norms else (lambda t: None)
    vn = (lambda t: value_norms[t]) if policy.reads_value_norms else (lambda t: None)

    def norm(t):
        return kn(t), vn(t)

    def last_step(raw):
        k, v = norm(last)
        q = rows.last_query_rows if rows is not None and policy.reads_query_rows else None
        return step(policy, last, raw, budget, k, stream, v, q)
    last = length - 1
    if tail:
        if rows is None or rows.length != length or rows.tail < tail or (sums and rows.sums is None):
            raise ValueError(f"prefill of {policy.name} needs the prompt's last {tail} rows"
                             f"{' and their sum' if sums else ''}")
        if rows.next != length:
            raise ValueError(f"prefill of {policy.name}: {rows.next} of {length} prompt rows arrived")
    if streamed:
        if len(policy.held()) != last:
            raise ValueError(f"prefill of {policy.name} streams every row: give it to PromptRows(streamed=...)")
        return last_step(rows.row(last))
    if not tail:
        for t in range(last):
            feed(policy, t, None, *norm(t))
        return last_step(None)
    start = last if sums else length - tail
    for t in range(start):
        feed(policy, t, None, *norm(t))  # admitted unobserved
    if sums:
        if last:
            policy.observe(rows.sums)
    else:
        policy.skip_rows(start)
        for t in range(start, last):
            feed(policy, t, rows.row(t), *norm(t))
    return last_step(rows.row(last))
