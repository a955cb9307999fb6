"""The cell size of a paired study: the prompts needed to detect a 20-point paired gap in
accuracy with the exact McNemar (sign) test at two-sided alpha 0.05 and 80 % power.

Pairs: each prompt answered under two configurations (A, B). p10 = P(A right, B wrong),
p01 = P(A wrong, B right); the gap is p10 - p01 = 0.20 and the discordance rate pd = p10 + p01
is assumed (it is the one figure the design cannot know before it runs). Two computations:

- Connor's normal approximation (Connor 1987, Biometrics 43:207):
      n = ( z_{1-a/2} sqrt(pd) + z_{1-b} sqrt(pd - d^2) )^2 / d^2
- The exact power: D discordant pairs ~ Binomial(n, pd); given D, A's wins ~ Binomial(D, p10/pd);
  the exact two-sided sign test rejects where its p-value <= alpha. Summed over D.

    python -m lab.studies.power            # the table for pd 0.2 .. 0.5 and the chosen cell
"""
from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

ALPHA, POWER, GAP = 0.05, 0.80, 0.20
DISCORDANCE = 0.30  # the assumed discordance rate the pre-registration sizes the cell by


def connor(pd: float, gap: float = GAP, alpha: float = ALPHA, power: float = POWER) -> int:
    za, zb = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    return math.ceil((za * math.sqrt(pd) + zb * math.sqrt(pd - gap ** 2)) ** 2 / gap ** 2)


def pmf(k: int, n: int, p: float) -> float:
    return math.comb(n, k) * p ** k * (1 - p) ** (n - k)


def sign_p(k: int, d: int) -> float:
    """The exact two-sided sign test's p-value: k wins of d discordant pairs under p = 1/2."""
    tail = sum(math.comb(d, i) for i in range(min(k, d - k) + 1)) / 2 ** d
    return min(1.0, 2 * tail)


@lru_cache(maxsize=None)
def rejects(d: int, alpha: float = ALPHA) -> tuple[bool, ...]:
    """For D = d discordant pairs, whether k wins of A (k = 0..d) reject at `alpha` (exact, two-sided)."""
    return tuple(sign_p(k, d) <= alpha for k in range(d + 1)) if d else (False,)


def exact_power(n: int, pd: float, gap: float = GAP, alpha: float = ALPHA) -> float:
    p10 = (pd + gap) / 2
    q = p10 / pd
    total = 0.0
    for d in range(n + 1):
        w = pmf(d, n, pd)
        if w < 1e-12:
            continue
        total += w * sum(pmf(k, d, q) for k, r in enumerate(rejects(d, alpha)) if r)
    return total


def exact_n(pd: float, gap: float = GAP, alpha: float = ALPHA, power: float = POWER) -> int:
    """The smallest n from Connor's n down 10 and up whose exact power reaches `power` and stays
    there for the next 5 n (the exact power saw-tooths with n)."""
    n = max(2, connor(pd, gap, alpha, power) - 10)
    while not all(exact_power(m, pd, gap, alpha) >= power for m in range(n, n + 5)):
        n += 1
    return n


def main() -> int:
    print(f"gap {GAP:.2f}, two-sided alpha {ALPHA}, power {POWER}")
    print("discordance  Connor n  exact n  exact power at n=30")
    for pd in (0.20, 0.25, 0.30, 0.40, 0.50):
        print(f"{pd:11.2f}  {connor(pd):8d}  {exact_n(pd):7d}  {exact_power(30, pd):.2f}")
    print(f"chosen: discordance {DISCORDANCE} -> {exact_n(DISCORDANCE)} gated prompts per cell")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
