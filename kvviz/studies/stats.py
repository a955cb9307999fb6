"""Statistics for paired studies: every prompt is answered by two policies (or two settings),
so a contrast is a 2 x 2 table of paired verdicts, not two independent proportions.

    a   both right          b   A right, B wrong
    c   A wrong, B right    d   both wrong

- `wilson(k, n)`: the Wilson score interval of one policy's accuracy (kvviz.core.metrics).
- `mcnemar_exact(b, c)`: the exact two-sided McNemar test (the sign test on the discordant
  pairs): under "neither policy is better", b ~ Binomial(b + c, 1/2).
- `paired_diff_interval(a, b, c, d)`: Newcombe's square-and-add (hybrid score) interval for
  the paired difference of accuracies, (b - c) / n (Newcombe 1998, Statistics in Medicine
  17:2635, method 10): the two Wilson intervals (no continuity correction) combined with the
  pair's correlation, whose numerator ad - bc is shrunk towards 0 by n/2 when positive.
- `power_paired(n, p_b, p_c)`: the exact power of `mcnemar_exact` at alpha, when a prompt is
  discordant "A right, B wrong" with chance p_b and "A wrong, B right" with chance p_c; and
  `n_for_power(gap, discordance, power)`: the fewest prompts that reach that power.
- `holm(pvalues)`: Holm's step-down adjustment over a family of secondary contrasts.
- `full_cache_gate(rows)`: each prompt's rows split by the full cache's verdict on that prompt:
  a prompt the full cache gets wrong is reported apart, never counted as an eviction failure.
- `paired_table(rows, a, b)`: the 2 x 2 table of two policies over the gated prompts.

- `study_result(study, id)`: one result of a pre-registered study's answers.json, with its
  mark, "primary" or "secondary" (what the lesson's {primary.*} and {secondary.*} quote).

No scipy: the binomial tails are sums of exact terms (math.comb, in log space for large n).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvviz.core.metrics import wilson

__all__ = ["wilson", "mcnemar_exact", "paired_diff_interval", "power_paired", "power_at_gap",
           "n_for_power", "holm", "full_cache_gate", "with_full_verdict", "paired_sides",
           "paired_table", "Paired", "Z95", "study_result"]

Z95 = 1.959963984540054  # the two-sided 95 % normal quantile


def _count(name: str, v) -> int:
    if isinstance(v, bool) or int(v) != v or v < 0:
        raise ValueError(f"{name} must be a count (an integer >= 0), got {v!r}")
    return int(v)


def _prob(name: str, v, *, open_low=False, open_high=False) -> float:
    v = float(v)
    if not (0 < v if open_low else 0 <= v) or not (v < 1 if open_high else v <= 1):
        lo, hi = "(" if open_low else "[", ")" if open_high else "]"
        raise ValueError(f"{name} must lie in {lo}0, 1{hi}, got {v!r}")
    return v


def _binom_pmf(k: int, n: int, p: float) -> float:
    if p == 0.0:
        return 1.0 if k == 0 else 0.0
    if p == 1.0:
        return 1.0 if k == n else 0.0
    logc = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return math.exp(logc + k * math.log(p) + (n - k) * math.log1p(-p))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value on the discordant pairs (b one way, c the other): twice
    the smaller binomial tail of Binomial(b + c, 1/2), at most 1. 1.0 when b + c == 0."""
    b, c = _count("b", b), _count("c", c)
    m = b + c
    if m == 0:
        return 1.0
    if m <= 1000:
        tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2 ** m
    else:
        tail = sum(_binom_pmf(i, m, 0.5) for i in range(min(b, c) + 1))
    return min(1.0, 2.0 * tail)


def paired_diff_interval(a: int, b: int, c: int, d: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's square-and-add interval (method 10) for the paired difference
    p_A - p_B = (b - c) / n, n = a + b + c + d, at `z`. (nan, nan) for n = 0."""
    a, b, c, d = (_count(k, v) for k, v in zip("abcd", (a, b, c, d)))
    n = a + b + c + d
    if n == 0:
        return float("nan"), float("nan")
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c  # the correlation's numerator, shrunk by n/2 when positive
    cross = cross - n / 2 if cross > n / 2 else min(cross, 0)
    phi = 0.0 if den == 0 else cross / math.sqrt(den)
    diff = p1 - p2
    dl = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    du = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    return max(-1.0, diff - math.sqrt(max(dl, 0.0))), min(1.0, diff + math.sqrt(max(du, 0.0)))


def _critical(m: int, alpha: float) -> int:
    """For m discordant pairs, the largest k with mcnemar_exact(k, m - k) <= alpha (the test
    rejects at b <= k or b >= m - k), -1 when no split is extreme enough."""
    k, cum, term = -1, 0, 1  # term = comb(m, i)
    exact = m <= 1000
    for i in range(m // 2 + 1):
        if exact:
            cum += term
            p = min(1.0, 2 * cum / 2 ** m)
            term = term * (m - i) // (i + 1)
        else:
            p = mcnemar_exact(i, m - i)
        if p > alpha:
            break
        k = i
    return k


def power_paired(n: int, p_b: float, p_c: float, alpha: float = 0.05) -> float:
    """The exact power of the two-sided exact McNemar test at level `alpha` on n prompts, when
    each prompt independently is "A right, B wrong" with chance p_b and "A wrong, B right" with
    chance p_c (the gap is p_b - p_c, the discordance p_b + p_c): the chance the test rejects,
    summed over the number of discordant prompts."""
    n = _count("n", n)
    p_b, p_c = _prob("p_b", p_b), _prob("p_c", p_c)
    alpha = _prob("alpha", alpha, open_low=True, open_high=True)
    pd_ = p_b + p_c
    if pd_ > 1 + 1e-12:
        raise ValueError(f"p_b + p_c is the discordance and must be at most 1, got {pd_!r}")
    pd_ = min(pd_, 1.0)
    if pd_ == 0.0:
        return 0.0
    q = p_b / pd_
    total = 0.0
    for m in range(n + 1):
        pm = _binom_pmf(m, n, pd_)
        k = _critical(m, alpha)
        if pm < 1e-300 or k < 0:
            continue
        region = set(range(k + 1)) | set(range(m - k, m + 1))
        total += pm * sum(_binom_pmf(b, m, q) for b in region)
    return min(1.0, total)


def _gap_discordance(gap: float, discordance: float) -> tuple[float, float]:
    gap, discordance = float(gap), _prob("discordance", discordance, open_low=True)
    if not 0 < abs(gap) <= discordance:
        raise ValueError(f"gap must be non-zero and at most the discordance in size "
                         f"(|gap| <= {discordance:g}), got {gap!r}")
    return (discordance + gap) / 2, (discordance - gap) / 2


def power_at_gap(n: int, gap: float, discordance: float, alpha: float = 0.05) -> float:
    """power_paired with the gap p_b - p_c and the discordance p_b + p_c given instead."""
    p_b, p_c = _gap_discordance(gap, discordance)
    return power_paired(n, p_b, p_c, alpha)


def n_for_power(gap: float, discordance: float, power: float = 0.8, alpha: float = 0.05,
                most: int = 5000) -> int:
    """The fewest prompts n at which power_at_gap(n, gap, discordance, alpha) >= `power`.
    (The exact test's power is saw-toothed in n: a few n above this one can fall just
    short again.) ValueError when no n up to `most` reaches it."""
    _gap_discordance(gap, discordance)
    power = _prob("power", power, open_low=True, open_high=True)
    # start a little under the normal approximation (Connor 1987), then walk up
    p_b, p_c = _gap_discordance(gap, discordance)
    za, zb = _zq(1 - alpha / 2), _zq(power)
    approx = (za * math.sqrt(discordance) + zb * math.sqrt(discordance - gap ** 2)) ** 2 / gap ** 2
    n = max(1, int(approx * 0.7))
    while n <= most:
        if power_paired(n, p_b, p_c, alpha) >= power:
            return n
        n += 1
    raise ValueError(f"no n up to {most} reaches power {power:g} for gap {gap:g} at "
                     f"discordance {discordance:g}")


def _zq(p: float) -> float:
    """The standard normal quantile at p (bisection on erf; no scipy)."""
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p times
    (m - i + 1), made non-decreasing along that order, capped at 1."""
    ps = [float(p) for p in pvalues]
    for i, p in enumerate(ps):
        if not 0 <= p <= 1:
            raise ValueError(f"pvalues[{i}] must lie in [0, 1], got {p!r}")
    m = len(ps)
    order = sorted(range(m), key=lambda i: (ps[i], i))
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


# --- tables of results (kvviz.model.needle.results' columns) -----------------------------
FULL = "full"


def _full_verdict(rows):
    """Per prompt id, the full cache's verdict: the full_cache_correct column where the table
    has it, else the `full` policy's own row."""
    import pandas as pd

    full = rows[rows["policy"] == FULL]
    if full.empty:
        raise ValueError("rows: no full_cache_correct column and no full-cache rows (policy "
                         "'full'): the full-cache gate needs one of them")
    v = _bool(full.groupby("id")["correct"].first())
    missing = sorted(set(rows["id"]) - set(v.index))
    if missing:
        raise ValueError(f"rows: prompt {missing[0]!r} has no full-cache row")
    return pd.Series(v)


def full_cache_gate(rows):
    """(the rows of the prompts the full cache answers, the rows of the prompts it gets
    wrong): a prompt the full cache gets wrong says nothing about eviction and is reported
    apart."""
    for col in ("id", "policy", "correct"):
        if col not in rows:
            raise ValueError(f"rows: no {col!r} column (a needle results table is required)")
    keep = with_full_verdict(rows)["full_cache_correct"]
    return rows[keep], rows[~keep]


@dataclass(frozen=True)
class Paired:
    """Two policies over the same prompts: the 2 x 2 table and its statistics."""

    a: int                # both right
    b: int                # A right, B wrong
    c: int                # A wrong, B right
    d: int                # both wrong
    dropped: int          # prompts the full cache got wrong (reported apart)

    @property
    def n(self) -> int:
        return self.a + self.b + self.c + self.d

    @property
    def acc_a(self) -> float:
        return (self.a + self.b) / self.n if self.n else float("nan")

    @property
    def acc_b(self) -> float:
        return (self.a + self.c) / self.n if self.n else float("nan")

    @property
    def diff(self) -> float:
        return (self.b - self.c) / self.n if self.n else float("nan")

    @property
    def p(self) -> float:
        return mcnemar_exact(self.b, self.c)

    def interval(self, z: float = Z95) -> tuple[float, float]:
        return paired_diff_interval(self.a, self.b, self.c, self.d, z)

    def power(self, gap: float, alpha: float = 0.05) -> float:
        """The power of this table's test (its n) to detect a paired gap of `gap` at the
        discordance observed here (at least |gap|: the discordance cannot be below the gap)."""
        if not self.n:
            return 0.0
        disc = max((self.b + self.c) / self.n, abs(gap))
        return power_at_gap(self.n, gap, min(disc, 1.0), alpha)


def _bool(col):
    """A verdict column as booleans (read from CSV as bool or as text)."""
    return col.astype(str).str.lower().isin(["true", "1"])


def with_full_verdict(rows):
    """`rows` with full_cache_correct: the full cache's verdict on each row's prompt (the
    column as given where the table has it whole, else the `full` policy's own row)."""
    if "full_cache_correct" in rows and rows["full_cache_correct"].notna().all():
        return rows.assign(full_cache_correct=_bool(rows["full_cache_correct"]))
    ok = _full_verdict(rows)
    return rows.assign(full_cache_correct=rows["id"].map(ok).astype(bool))


def paired_sides(side_a, side_b, on=("id",)) -> Paired:
    """The 2 x 2 table of side A's rows against side B's, paired by the columns `on` (the
    prompt's id, or e.g. haystack, depth and seed to pair two variants of one prompt). A pair
    enters only where the full cache answered both sides' prompts (full_cache_correct, see
    with_full_verdict); `dropped` counts the pairs set apart. ValueError when a side has two
    rows for one pair (the side is not one setting)."""
    on = list(on)
    cols = [*on, "correct", "full_cache_correct"]
    for name, s in (("a", side_a), ("b", side_b)):
        missing = [c for c in cols if c not in s]
        if missing:
            raise ValueError(f"{name}: no {missing[0]!r} column in the rows")
        dup = s.duplicated(on)
        if dup.any():
            key = ", ".join(f"{c} {v}" for c, v in zip(on, s.loc[dup, on].iloc[0]))
            raise ValueError(f"{name}: two rows for one prompt ({key}): narrow the side to one "
                             "setting")
    m = side_a[cols].merge(side_b[cols], on=on, suffixes=("_a", "_b"))
    ok = _bool(m["full_cache_correct_a"]) & _bool(m["full_cache_correct_b"])
    x, y = _bool(m.loc[ok, "correct_a"]), _bool(m.loc[ok, "correct_b"])
    return Paired(a=int((x & y).sum()), b=int((x & ~y).sum()), c=int((~x & y).sum()),
                  d=int((~x & ~y).sum()), dropped=int((~ok).sum()))


def paired_table(rows, a: str, b: str, by: str = "label") -> Paired:
    """The 2 x 2 table of policy A (rows whose `by` column is `a`) against B over the prompts
    both answered and the full cache answered; `dropped` counts the prompts the full cache got
    wrong. ValueError when a prompt has two rows of one side (the cell is not one setting)."""
    if by not in rows:
        raise ValueError(f"by: no column {by!r} in the rows")
    for col in ("id", "policy", "correct"):
        if col not in rows:
            raise ValueError(f"rows: no {col!r} column (a needle results table is required)")
    rows = with_full_verdict(rows)
    sides = []
    for name, val in (("a", a), ("b", b)):
        s = rows[rows[by] == val]
        if s.empty:
            raise ValueError(f"{name}: no rows with {by} == {val!r} (values: "
                             f"{', '.join(sorted(map(str, set(rows[by]))))})")
        sides.append(s)
    return paired_sides(*sides, on=("id",))


# --- a study's answers file (written by lab/study_report.py) ------------------------------
MARKS = ("primary", "secondary")


def studies_dir() -> Path:
    """studies/ in the traces folder: one folder per pre-registered study, each with its
    preregistration.toml, results and answers.json."""
    from kvviz.core.paths import traces_or_default

    return traces_or_default() / "studies"


def study_answers(study: str, folder=None) -> tuple[Path, dict]:
    """(the path, the dict) of `study`'s answers.json; ValueError naming the file when it is
    missing, unreadable or not a study's answers."""
    if not study or not study.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"study {study!r}: not a study name (a folder in traces/studies/)")
    path = Path(folder if folder is not None else studies_dir() / study) / "answers.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the study's report writes it: python -m "
                         f"lab.study_report {path.parent} --write)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("claims"), dict):
        raise ValueError(f"{path}: not a study's answers (no claims)")
    return path, data


def study_result(study: str, rid: str, folder=None) -> tuple[Path, dict]:
    """One result of a study's answers by id (<claim> for its primary, <claim>.<n> for a
    secondary): (the file, the result, with its status "primary" or "secondary")."""
    path, data = study_answers(study, folder)
    for claim in data["claims"].values():
        for r in claim.get("results", []):
            if r.get("id") == rid:
                if r.get("status") not in MARKS:
                    raise ValueError(f"{path}: result {rid} is marked neither primary nor "
                                     "secondary")
                return path, r
    ids = [r.get("id") for c in data["claims"].values() for r in c.get("results", [])]
    raise ValueError(f"{path}: no result {rid!r} (results: {', '.join(map(str, ids)) or 'none'})")
