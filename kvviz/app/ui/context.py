"""What every view's glue gets: the trace, both runs and the current step (`Ctx`)."""
from __future__ import annotations

import numbers
import string
from dataclasses import dataclass
from functools import cached_property

import streamlit as st

from kvviz.app.figures.common import pair_colours
from kvviz.app.figures.states import NEVER, next_after
from kvviz.app.ui import compute
from kvviz.core.budget import resolve
from kvviz.core.policies import config_label

# the modebar's camera saves any chart as a PNG in the browser (2x, named kvviz-chart.png)
CHART = dict(width="stretch", config={"displaylogo": False, "scrollZoom": False,
                                      "toImageButtonOptions": {"format": "png", "scale": 2,
                                                               "filename": "kvviz-chart"}})


SHARES = ("retained mass", "heavy-hitter recall", "attention loss")  # fractions of 1
COUNTS = ("memory (bytes)", "budget", "held now")


PUNCTUATION = frozenset(string.punctuation)  # the ASCII marks Markdown lets a backslash escape


def literal(text) -> str:
    """`text` shown as written in a cell st.table renders as Markdown: every ASCII punctuation
    mark backslash-escaped, so a model's answer " 72805. The" stays that text instead of
    becoming a list numbered from 72805, and "*", "_", "#" or "|" draw nothing of their own."""
    return "".join("\\" + ch if ch in PUNCTUATION else ch for ch in str(text).strip())


def table(df, literal_columns=()) -> None:
    """Draw a small table whole: st.table wraps its cells to the page's width, where
    st.dataframe's grid hides the columns past the right edge (1024 px, 125 % zoom). The
    values stay the numbers (a Styler only formats them: shares to 6 decimals, counts with
    a thousands separator); `literal_columns` (free text such as a model's answers) are
    shown as written, not read as Markdown."""
    fmt = {c: "{:.6f}" for c in SHARES if c in df.columns}
    fmt.update({c: _count for c in COUNTS if c in df.columns})
    fmt.update({c: literal for c in literal_columns if c in df.columns})
    st.table(df.style.format(fmt, na_rep="–"), hide_index=True)


def _count(v) -> str:
    """A count with a thousands separator; text (a ratio budget, '0.25x') as it is."""
    return f"{v:,}" if isinstance(v, numbers.Number) and not isinstance(v, bool) else str(v)


def refusal_message(which: str, pols: dict) -> str:
    """The page's error for a refused policy: its own rule (controls named by their labels)
    and what is still drawn."""
    name, _, error = pols[which]
    other = "b" if which == "a" else "a"
    oname, oparams, oerror = pols[other]
    tail = ("Neither policy can run: change a setting in the sidebar." if oerror else
            f"Policy {other.upper()} ({config_label(oname, oparams)}) is drawn alone below; "
            "the next valid setting brings both back.")
    return f"Policy {which.upper()} ({name}) refuses these settings: {error}. {tail}"


@dataclass
class Ctx:
    key: str
    layer: int
    version: str
    trace: object
    budget: int
    a: str
    b: str
    pa: tuple
    pb: tuple
    eng_a: object
    eng_b: object
    label_a: str
    label_b: str
    step: int = 0
    solo: str = ""  # "a" or "b": the other policy refused its settings; both sides = this one
    head: str = "mean"  # attention head of a per-head trace (kvviz.core.trace contract)
    hide_from: int | None = None  # a class's open question: steps from here on are not shown

    @property
    def held_budget(self) -> int:
        """The budget at this step: a count as it is, a ratio of the tokens seen resolved
        over the step + 1 positions seen (kvviz.core.budget; at least 1)."""
        return resolve(self.budget, self.step + 1)

    @property
    def colours(self) -> tuple[str, str]:
        """A's and B's colours: their policies' (kvviz.app.figures.common.pair_colours)."""
        return pair_colours(self.label_a, self.label_b)

    @property
    def ev_a(self):
        """A's eviction log as this page may show it (`compute.seen`: none from `hide_from` on)."""
        return compute.seen(self.eng_a.evicted_at, self.hide_from)

    @property
    def ev_b(self):
        return compute.seen(self.eng_b.evicted_at, self.hide_from)

    def run(self, which: str) -> compute.RunKey:
        """The cache key of policy 'a' or 'b' on this page (its engine, summary, peeks)."""
        name, params = (self.a, self.pa) if which == "a" else (self.b, self.pb)
        return compute.RunKey(self.key, self.layer, self.version, name, params, self.budget,
                              self.head)

    @cached_property
    def pair(self) -> dict:
        """compute.pair_of: divergence steps and |A delta B| per step, shared server-wide."""
        return compute.pair_of(self.run("a"), self.run("b"))

    def _shown(self, step: int) -> int:
        return NEVER if self.hide_from is not None and step >= self.hide_from else step

    @property
    def first_divergence(self) -> int:
        """The first divergence step, or -1 (also when it is at or after `hide_from`)."""
        return self._shown(next_after(self.pair["divergences"], NEVER))

    def next_divergence(self, after: int) -> int:
        """First divergence step strictly after `after`, or -1 (also when it is hidden)."""
        return self._shown(next_after(self.pair["divergences"], after))

    def peek(self, which: str, step: int):
        return self.run(which).peek(step)

    def panel(self, which: str, step: int) -> dict:
        kept, scores = self.peek(which, step)
        eng = self.eng_a if which == "a" else self.eng_b
        return dict(label=f"{which.upper()}: {self.label_a if which == 'a' else self.label_b}",
                    policy=self.a if which == "a" else self.b, kept=kept, scores=scores,
                    victims=eng.victims(step), colour=self.colours[0 if which == "a" else 1],
                    params=dict(self.pa if which == "a" else self.pb))
