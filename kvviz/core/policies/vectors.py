"""What the policies that read key and query vectors share: the cache's keys of the step,
kept in line with the slots, and RoPE as the model applies it.

A policy that `reads_keys` is handed, at every step, the cache's keys at the positions it
holds and at the admitted one (kvviz.core.policies.base.Policy.reads_keys). `ReadsKeys`
holds that array for the eviction that follows and drops a victim's row with its slot, so
`priority` and `scores` read `self.keys` aligned with `kept`. It is the cache's memory,
read, not a copy the policy keeps between steps: such a policy pays nothing per slot for it.
"""
from __future__ import annotations

import numpy as np

from kvviz.core.policies.base import Policy


class ReadsKeys(Policy):
    """A Policy that reads the cache's keys: `self.keys`, float32 (kept, head_dim), the row of
    slot i being kept[i]'s key (None before the first step)."""

    reads_keys = True

    def reset_state(self) -> None:
        super().reset_state()
        self.keys = None

    def advance(self, pos, attn, key_norm=None, value_norm=None, query_rows=None, keys=None,
                query=None):
        given = {k: v for k, v in (("key_norm", key_norm), ("value_norm", value_norm),
                                   ("query_rows", query_rows)) if v is not None}
        super().advance(pos, attn, **given)
        if keys is not None:
            if self.keys is not None and keys.shape[1] != self.keys.shape[1]:
                raise ValueError(f"keys must keep one head_dim: got {keys.shape[1]}, earlier "
                                 f"steps had {self.keys.shape[1]}")
            self.keys = keys

    def _remove(self, idx: np.ndarray) -> None:
        super()._remove(idx)
        if self.keys is not None:
            self.keys = np.delete(self.keys, idx, axis=0)


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """RoPE's angular frequencies, float64 (head_dim // 2,): theta ** (-2i / head_dim)."""
    return float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rotate(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """x (..., head_dim) rotated by `angles` (head_dim // 2,) in the rotate-half layout the
    Llama family uses (HF's apply_rotary_pos_emb): dimension i pairs with i + head_dim / 2."""
    half = x.shape[-1] // 2
    c, s = np.cos(angles), np.sin(angles)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def mean_rotation(head_dim: int, theta: float, first: int, count: int) -> np.ndarray:
    """The mean of RoPE's rotation matrices over positions first..first+count-1, float64
    (head_dim, head_dim): [[c, -s], [s, c]] in blocks of diagonal means of cos and sin."""
    w = inverse_frequencies(head_dim, theta)
    angles = np.arange(first, first + count, dtype=np.float64)[:, None] * w[None, :]
    c, s = np.cos(angles).mean(axis=0), np.sin(angles).mean(axis=0)
    return np.block([[np.diag(c), -np.diag(s)], [np.diag(s), np.diag(c)]])


# A declared rope_theta left at this is the run's RoPE base: the model's config in the model
# loop, the trace's meta ("rope_theta", recorded by kvviz capture) in a replay.
RUN_ROPE_THETA = 0.0


def undoes_rope(policy) -> bool:
    """Whether `policy` undoes RoPE on the queries: it reads queries and declares rope_theta."""
    return bool(getattr(policy, "reads_queries", False)) and "rope_theta" in getattr(policy, "params", {})


def rope_theta_of(policy) -> float | None:
    """The RoPE base `policy` undoes: its declared rope_theta, else the run's (`use_rope_theta`);
    None while neither is known."""
    declared = float(policy.params["rope_theta"])
    return declared if declared != RUN_ROPE_THETA else getattr(policy, "run_rope_theta", None)


def use_rope_theta(policy, theta, where: str) -> None:
    """Hand a policy that undoes RoPE (`undoes_rope`) the run's RoPE base `theta` before its
    first step; `where` names what records it ("the model's config", "trace 'code-kv-vec'"), and `theta`
    None says it records none. Nothing for any other policy. ValueError naming rope_theta
    when the declared base is not the run's, or when neither is known."""
    if not undoes_rope(policy):
        return
    if theta is None:
        if rope_theta_of(policy) is None:
            raise ValueError(f"{policy.name}'s rope_theta is by default the run's RoPE base, and "
                             f"{where} records none: pass rope_theta=<the model's RoPE base> "
                             "(SmolLM2-135M's is 100000), or capture the trace again (kvviz "
                             "capture records it)")
        return
    theta, declared = float(theta), float(policy.params["rope_theta"])
    if declared not in (RUN_ROPE_THETA, theta):
        raise ValueError(f"{policy.name}'s rope_theta={declared:g} is not the RoPE base {where} "
                         f"records ({theta:g}): pass rope_theta={theta:g}, or leave it out (the run's)")
    policy.run_rope_theta = theta
