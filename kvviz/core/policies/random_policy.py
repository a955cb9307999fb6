"""Random eviction: the floor every other policy must clear. Uses the rng it is given."""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy


@dataclass
class RandomPolicy(Policy):
    name = "random"
    label = "random"
    colour = "#999999"
    reference = "kvviz.core.reference:RefRandom"
    uses_attention = False

    def choose(self, count):
        # one uniform draw per victim among those still standing: without replacement
        if count == 1:
            return np.array([int(self.rng.integers(self._n))])
        standing = np.arange(self._n)
        picks = []
        for _ in range(count):
            i = int(self.rng.integers(len(standing)))
            picks.append(standing[i])
            standing = np.delete(standing, i)
        return np.sort(np.array(picks, dtype=np.int64))

    @property
    def bytes_per_slot(self):
        return 4
