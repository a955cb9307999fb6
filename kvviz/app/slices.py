"""Each view's own part of the link: its fields, their URL keys, how it reads and writes them.

A slice is a small dataclass. Its plain fields are listed in `KEYS` (URL key -> field): each
is parsed with the type of the field's default, said in a note when it does not parse, and
written to the link only when it is not the default. A slice with another rule (the cache
view's zoom, the compare view's list, the Forgetting view's cell) overrides `parse`/`query`.
The page's state (`kvviz.app.state.ViewState`) holds one of each, in `SLICES` order, beside the
page-wide fields (trace, policies, step ...). Adding a view's choice = a field and a `KEYS`
line in its slice; the view reads and draws it with `kvviz.app.ui.session.widget`.

Pure and Streamlit-free, like kvviz.app.state: a link or a lesson's scene parses anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from kvviz.app.jumps import NOTABLE_SHARE
from kvviz.core.policies import POLICIES

ZOOMS = (0, 32, 128, 512)
MAX_COMPARE = 6  # the compare view's limit (kvviz.app.figures.compare.MAX_POLICIES)


def _plain(text: str, like):
    """A plain key's value in the type of its field's default `like`; ValueError if not."""
    if isinstance(like, tuple):
        parts = [p for p in str(text).split(",") if p.strip()]
        if len(parts) != 2:
            raise ValueError(text)
        return tuple(int(p) for p in parts)
    return type(like)(str(text).strip())


def plain_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _rule(like) -> str:
    return ("two integers S0,S1" if isinstance(like, tuple) else
            "a number" if isinstance(like, float) else "an integer")


@dataclass
class Slice:
    """One view's (or page feature's) fields; `NAME`: the view (its registry name) or the
    page feature it belongs to."""

    NAME: ClassVar[str] = ""
    KEYS: ClassVar[dict] = {}  # URL key -> field, each parsed like its default (plain keys)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def url_keys(cls) -> tuple[str, ...]:
        """Every URL key this slice reads."""
        return tuple(cls.KEYS)

    def parse(self, q: dict, notes: list, page) -> None:
        """Read this slice's keys from the query `q` (one value per key); a value that does
        not parse is left at its default and said in `notes`. `page`: the page-wide fields
        (already parsed)."""
        for k, f in self.KEYS.items():
            if k in q:
                like = getattr(self, f)
                try:
                    setattr(self, f, _plain(q[k], like))
                except ValueError:
                    notes.append(f"{k}={q[k]!r} is not {_rule(like)}; ignored")

    def query(self, page) -> dict[str, str]:
        """This slice's keys for the link (plain keys: only those not at their default)."""
        blank = type(self)()
        return {k: plain_text(getattr(self, f)) for k, f in self.KEYS.items()
                if getattr(self, f) != getattr(blank, f)}

    def settle(self, page) -> None:
        """Types back after a round through the session (a list where a tuple belongs)."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list) and isinstance(f.default, tuple):
                setattr(self, f.name, tuple(v))


@dataclass
class CacheState(Slice):
    """The cache heatmap: its range, 0 = the whole run, N = +-N steps around the step.
    Always in the link."""

    NAME: ClassVar[str] = "cache"
    zoom: int = 0

    @classmethod
    def url_keys(cls):
        return ("zoom",)

    def parse(self, q, notes, page):
        if "zoom" not in q:
            return
        try:
            self.zoom = int(str(q["zoom"]).strip())
        except ValueError:
            notes.append(f"zoom={q['zoom']!r} is not an integer; ignored")
            return
        if self.zoom not in ZOOMS:
            notes.append(f"zoom={q['zoom']} is not one of {', '.join(map(str, ZOOMS))}; "
                         "showing the whole run")
            self.zoom = 0

    def query(self, page):
        return {"zoom": str(self.zoom)}

    def settle(self, page):
        self.zoom = int(self.zoom)


def default_cmp(a: str = "tova", b: str = "snapkv") -> list[str]:
    """The compare view's default: every policy while they fit, else A, B and the first
    registered others up to the limit, in registry order."""
    names = list(POLICIES)
    pick = [n for n in (a, b) if n in POLICIES]
    # fill with policies every trace can run first (knorm needs key norms, vatp value norms,
    # rkv key and query vectors; most traces have none)
    for n in sorted(names, key=lambda n: any(getattr(POLICIES[n], f) for f in (
            "reads_key_norms", "reads_value_norms", "reads_keys", "reads_queries"))):
        if len(set(pick)) >= MAX_COMPARE:
            break
        pick.append(n)
    return [n for n in names if n in pick]


@dataclass
class CompareState(Slice):
    """The compare view's policies (`cmp`, comma-separated): by default every registered
    policy, or A, B and the first others when more than MAX_COMPARE are registered."""

    NAME: ClassVar[str] = "compare"
    cmp: list = field(default_factory=default_cmp)

    @classmethod
    def url_keys(cls):
        return ("cmp",)

    def parse(self, q, notes, page):
        if "cmp" not in q:
            self.cmp = default_cmp(page.a, page.b)
            return
        names = [n for n in str(q["cmp"]).split(",") if n]
        bad = [n for n in names if n not in POLICIES]
        if bad:
            notes.append(f"cmp: unknown policies {', '.join(map(repr, bad))}; ignored")
        self.cmp = ([n for n in dict.fromkeys(names) if n in POLICIES][:MAX_COMPARE]
                    or default_cmp(page.a, page.b))

    def query(self, page):
        return {} if list(self.cmp) == default_cmp(page.a, page.b) else {"cmp": ",".join(self.cmp)}

    def settle(self, page):
        self.cmp = list(self.cmp or default_cmp(page.a, page.b))


@dataclass
class LoopState(Slice):
    """Model in the loop: the result shown, its policy line and budget."""

    NAME: ClassVar[str] = "loop"
    KEYS: ClassVar[dict] = {
        "loop": "loop",                # the result's name ("" = the first)
        "loop.policy": "loop_policy",  # its policy line ("" = tova, else the first)
        "loop.budget": "loop_budget",  # and budget (0 = the middle one)
    }
    loop: str = ""
    loop_policy: str = ""
    loop_budget: int = 0


@dataclass
class SlidesState(Slice):
    """Slides: what is animated, over which steps, in how many frames."""

    NAME: ClassVar[str] = "slides"
    KEYS: ClassVar[dict] = {
        "slides.kind": "slides_kind",      # what is animated ("" = the heatmap)
        "slides.steps": "slides_steps",    # over which steps, "S0,S1" (() = the whole run)
        "slides.frames": "slides_frames",  # in how many frames (0 = 48, or fewer steps)
    }
    slides_kind: str = ""
    slides_steps: tuple = ()
    slides_frames: int = 0


@dataclass
class NavState(Slice):
    """The step navigation: the attention share the next-divergence jump looks for."""

    NAME: ClassVar[str] = "nav"
    KEYS: ClassVar[dict] = {"nav.share": "share"}
    share: float = NOTABLE_SHARE


@dataclass
class PresentState(Slice):
    """Presentation mode: 1 = no sidebar, one view, large type (kvviz.app.ui.present)."""

    NAME: ClassVar[str] = "present"
    KEYS: ClassVar[dict] = {"present": "present"}
    present: int = 0


@dataclass
class LessonState(Slice):
    """The lesson being taught (a file name in lessons/, "" = none) and its scene (1-based;
    0 = none)."""

    NAME: ClassVar[str] = "lesson"
    KEYS: ClassVar[dict] = {"lesson": "lesson", "scene": "scene"}
    lesson: str = ""
    scene: int = 0


@dataclass
class HeadsState(Slice):
    """Heads: the allocator, its scorer and the mean slots per head."""

    NAME: ClassVar[str] = "heads"
    KEYS: ClassVar[dict] = {
        "heads.allocator": "heads_alloc",  # "" = adakv
        "heads.scorer": "heads_scorer",    # any per-stream policy ("" = tova)
        "heads.budget": "heads_budget",    # 0 = 64
    }
    heads_alloc: str = ""
    heads_scorer: str = ""
    heads_budget: int = 0


# the Forgetting view's choices (kvviz.app.ui.view_needle checks them against its results)
NEEDLE_KEYS = ("ntask", "nbudget", "nmode", "ngran", "nlen", "ndepth", "nseed", "npol", "nvs",
               "nlayer", "nhead", "nalayer")


@dataclass
class NeedleState(Slice):
    """Forgetting: the cell shown, one text per key of NEEDLE_KEYS (the view checks them
    against its results)."""

    NAME: ClassVar[str] = "needle"
    needle: dict = field(default_factory=dict)

    @classmethod
    def url_keys(cls):
        return NEEDLE_KEYS

    def parse(self, q, notes, page):
        self.needle = {k: str(q[k]) for k in NEEDLE_KEYS if k in q}

    def query(self, page):
        return {k: str(v) for k, v in self.needle.items() if k in NEEDLE_KEYS}

    def settle(self, page):
        self.needle = dict(self.needle or {})


# Every slice of the page, in the link's order
SLICES = (CacheState, CompareState, LoopState, SlidesState, NavState, PresentState,
          LessonState, HeadsState, NeedleState)
