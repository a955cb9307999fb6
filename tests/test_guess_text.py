"""The sentence a class sees after the reveal for each guessed position
(`kvviz.app.explain.guess_text`), against kvviz.core.reference's plain loops: a canonical
trace replayed by each ranking policy and by its reference, stopped at an eviction step;
for every position the policy holds there, the sentence's rank and candidate count are the
reference's, its tie count is the reference's, "so it was evicted." is said exactly of the
reference's victims, and the number of victims is a count of slots ("evicts 1 slot"), never
a bare number that reads like a position ("the first 1")."""
import re

import numpy as np
import pytest
from test_explain import ref_ranked, ref_to, small_params

from kvviz.app import explain as X
from kvviz.core.policies import make_policy
from kvviz.core.reference import make_reference
from kvviz.core.replay import NEVER, Replay, run_policy
from kvviz.core.trace import CanonicalTrace


@pytest.mark.parametrize("name,seed", [("tova", 0), ("tova", 1), ("h2o", 2), ("snapkv", 3),
                                       ("streaming-llm", 4)])
def test_guess_text_against_the_reference(name, seed):
    budget, steps = 12, 60
    trace = CanonicalTrace(steps=steps, seed=seed, epoch=40, recent=12, hh_per_epoch=5)
    params = small_params(name, budget)
    ev = run_policy(trace, name, budget, **params).evicted_at
    step = int(np.sort(ev[ev != NEVER])[len(ev[ev != NEVER]) // 2])  # an eviction mid-run
    rp = Replay(trace, make_policy(name, budget=budget, **params))
    rp.seek(step - 1)
    kept, scores = rp.peek(step)
    victims = rp.step()
    panel = dict(label=f"A: {name}", policy=name, kept=kept, scores=scores, victims=victims)
    ref = make_reference(name, budget=budget, **params)
    ref_to(trace, ref, step)
    order = ref_ranked(ref)
    gone = set(ref.evict(budget).tolist())
    assert gone == set(np.asarray(victims).tolist())
    tokens = [f"t{i}" for i in range(steps)]
    for pos in map(int, kept):
        text = X.guess_text(panel, pos, tokens)
        assert text.startswith(f"Position {pos} (“t{pos}”): A ({name}) "), text
        assert text.endswith("so it was evicted." if pos in gone else "so it stayed."), text
        assert not re.search(r"the first \d", text), text
        if all(p != pos for _, p in order):
            assert "could not evict it" in text
            continue
        if name == "streaming-llm":
            assert "no score to rank by" in text and f"picked {len(gone)} slot" in text
            continue
        m = re.search(r"ranks it (\d+) of (\d+) candidates", text)
        assert m and (int(m[1]), int(m[2])) == (
            [p for _, p in order].index(pos) + 1, len(order)), (text, order)
        mine = next(k for k, p in order if p == pos)
        ties = sum(1 for k, p in order if k == mine and p != pos)
        said = re.search(r"tied with (\d+) other candidates?", text)
        assert int(said[1] if said else 0) == ties, text
        assert f"evicts {len(gone)} slot{'s' if len(gone) != 1 else ''} at this step" in text


def test_a_position_not_held_is_said_so():
    trace = CanonicalTrace(steps=40, seed=5, epoch=40, recent=12, hh_per_epoch=5)
    rp = Replay(trace, make_policy("tova", budget=8))
    rp.seek(29)
    kept, scores = rp.peek(30)
    panel = dict(label="B: tova", policy="tova", kept=kept, scores=scores, victims=rp.step())
    gone = next(p for p in range(30) if p not in set(map(int, kept)))
    assert X.guess_text(panel, gone) == (f"Position {gone}: B (tova) did not hold it at this "
                                         "step, so it could not be evicted.")
