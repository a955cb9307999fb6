"""A class on one server: its code, the lecturer's state, and predict-then-reveal rounds.

Held in the server process's memory only (the page keeps one `Registry` per process with
`st.cache_resource`): nothing is written anywhere and everything is gone when the server
stops. A class is reached only through its code, and only the member token that created it
(the lecturer's session) can move it, ask or reveal. Tokens are per session secrets the
page keeps in `st.session_state`; they never appear in a link.

Every refusal is a `Refused` (a ValueError) whose message names the rule, for `st.error`.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

# no 0/O, 1/I/L: a code read off a projector is typed right
ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"
CODE_LEN = 6
MAX_CLASSES = 256       # per server; the oldest idle class goes first past this
IDLE_SECONDS = 12 * 3600  # a class nobody touched for this long is closed
HERE_SECONDS = 5.0  # a student's page not heard from for this long is no longer counted
MAX_VOTES = 1000        # per round (a class, not a crowd)


class Refused(ValueError):
    """A request the class refuses; the message is the sentence to show."""


def new_token() -> str:
    """A session's member token (secret; identifies the lecturer and each voter)."""
    return secrets.token_urlsafe(16)


def new_key() -> str:
    """A class's lecturer key: 8 characters of ALPHABET (40 bits), shown only on the lecturer's
    page, which with the code lets a new tab take the class back (`Class.take_back`)."""
    return "".join(secrets.choice(ALPHABET) for _ in range(8))


def normal_code(code) -> str:
    return str(code or "").strip().upper()


@dataclass
class Round:
    """One question: "which position will <who> evict next?" at `step`.

    `held` are the positions a guess may name (the policy's cache before the eviction),
    `answer` the positions it evicts at `answer_step` (one or more). Votes are by member token.
    """
    number: int
    step: int
    who: str                 # "a" or "b"
    label: str               # the policy as the page names it ("TOVA", "SnapKV k=7 ...")
    held: frozenset
    answer: frozenset
    answer_step: int
    votes: dict = field(default_factory=dict)  # token -> position
    revealed: bool = False
    why: str = ""            # the lecturer's explanation, set on reveal (every page shows it)

    def tally(self) -> Counter:
        return Counter(self.votes.values())

    @property
    def right(self) -> int:
        return sum(1 for p in self.votes.values() if p in self.answer)

    @property
    def share_right(self) -> float | None:
        return self.right / len(self.votes) if self.votes else None


@dataclass
class Class:
    code: str
    owner: str                       # the lecturer's member token
    state: dict = field(default_factory=dict)  # the lecturer's page as a query mapping
    version: int = 0                 # +1 when the lecturer's page changes (followers move)
    round: Round | None = None
    round_version: int = 0           # +1 on ask, vote, reveal, close (the question panels redraw)
    rounds: int = 0
    touched: float = field(default_factory=time.monotonic)
    key: str = field(default_factory=new_key, repr=False)  # the lecturer's, to take it back
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    seen: dict = field(default_factory=dict, repr=False)  # student's token -> last heard
    turn: threading.Lock = field(default_factory=threading.Lock, repr=False)  # students' page
                                     # runs, one at a time (kvviz.app.ui.follow.turn)

    def _owner(self, token: str, what: str) -> None:
        if token != self.owner:
            raise Refused(f"only the lecturer's session, the one that opened class {self.code}, "
                          f"can {what}")

    def publish(self, token: str, state: dict) -> int:
        """The lecturer's page as a query mapping; followers move when the version changes."""
        self._owner(token, "move the class")
        state = {str(k): str(v) for k, v in dict(state).items()}
        with self.lock:
            self.touched = time.monotonic()
            if state != self.state:
                self.state = state
                self.version += 1
            return self.version

    def snapshot(self) -> tuple[int, dict]:
        with self.lock:
            self.touched = time.monotonic()
            return self.version, dict(self.state)

    def current_round(self) -> Round | None:
        """A copy of the open round (votes included), taken under the lock: votes arrive
        from other sessions' threads while a page counts them."""
        with self.lock:
            r = self.round
            return None if r is None else replace(r, votes=dict(r.votes))

    def take_back(self, key: str, token: str) -> None:
        """The lecturer's key moves the class to `token` (a reloaded or new tab); the old
        token can no longer move it."""
        if not secrets.compare_digest(normal_code(key).replace("-", "").encode(),
                                      self.key.encode()):
            raise Refused(f"that is not class {self.code}'s lecturer key (8 characters, shown "
                          "under the code on the lecturer's page)")
        with self.lock:
            self.owner = token
            self.seen.pop(token, None)  # a student's tab that takes the class is its lecturer
            self.touched = time.monotonic()

    def here(self, token: str, now: float | None = None) -> None:
        """A student's page was heard from (each of its runs and poll ticks)."""
        if token == self.owner:
            return
        with self.lock:
            self.seen[token] = time.monotonic() if now is None else now

    def students(self, within: float = HERE_SECONDS, now: float | None = None) -> int:
        """How many students' pages were heard from in the last `within` seconds (a page
        polls every second; a closed tab stops being counted)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            for t in [t for t, when in self.seen.items() if now - when > within]:
                del self.seen[t]  # (gone: a page that comes back is counted again)
            return len(self.seen)

    def poll(self) -> tuple[int, int]:
        """(version, round_version): what a polling page compares with what it last drew."""
        with self.lock:
            self.touched = time.monotonic()
            return self.version, self.round_version

    def ask(self, token: str, *, step: int, who: str, label: str, held, answer,
            answer_step: int) -> Round:
        """Open a new round (the previous one, revealed or not, is replaced)."""
        self._owner(token, "ask the class")
        held = frozenset(int(p) for p in held)
        answer = frozenset(int(p) for p in answer)
        if who not in ("a", "b"):
            raise Refused(f"who={who!r}: the question is about policy 'a' or 'b'")
        if not answer or not answer <= held:
            raise Refused("the answer must be one or more of the held positions")
        with self.lock:
            self.rounds += 1
            self.round = Round(self.rounds, int(step), who, str(label), held, answer,
                               int(answer_step))
            self.round_version += 1
            self.touched = time.monotonic()
            return self.round

    def vote(self, token: str, number: int, position) -> Round:
        """A student's guess for round `number`. Refused: no open round, a stale round,
        a revealed round, a second vote, a position the policy does not hold."""
        try:
            pos = int(position)
        except (TypeError, ValueError):
            raise Refused(f"guess {position!r} is not a position number") from None
        with self.lock:
            r = self.round
            if r is None or r.number != int(number):
                raise Refused("no question is open in this class right now")
            if r.revealed:
                raise Refused("the answer has been revealed: votes are closed for this question")
            if token in r.votes:
                raise Refused(f"you already voted (position {r.votes[token]}) on this question; "
                              "one vote each")
            if pos not in r.held:
                raise Refused(f"position {pos} is not held by {r.label} at step {r.step}: "
                              "guess one of the held positions")
            if len(r.votes) >= MAX_VOTES:
                raise Refused(f"this question has {MAX_VOTES} votes already")
            r.votes[token] = pos
            self.round_version += 1
            self.touched = time.monotonic()
            return r

    def reveal(self, token: str, why: str = "") -> Round:
        """Votes close; `why` (the lecturer's page's explanation) reaches every page with it."""
        self._owner(token, "reveal the answer")
        with self.lock:
            if self.round is None:
                raise Refused("no question is open to reveal")
            self.round.revealed = True
            self.round.why = str(why)
            self.round_version += 1
            self.touched = time.monotonic()
            return self.round

    def close_round(self, token: str) -> None:
        self._owner(token, "close the question")
        with self.lock:
            if self.round is not None:
                self.round = None
                self.round_version += 1


class Registry:
    """Every open class on this server, by code. One per process (the page's cache_resource)."""

    def __init__(self):
        self._classes: dict[str, Class] = {}
        self._lock = threading.Lock()

    def open(self, owner: str) -> Class:
        """A new class led by `owner` (a member token), under a fresh unguessable code."""
        with self._lock:
            self._expire()
            while True:
                code = "".join(secrets.choice(ALPHABET) for _ in range(CODE_LEN))
                if code not in self._classes:
                    break
            c = self._classes[code] = Class(code=code, owner=owner)
            return c

    def get(self, code) -> Class:
        """The class under `code`; Refused (naming the code) if none is open."""
        code = normal_code(code)
        with self._lock:
            c = self._classes.get(code)
        if c is None:
            shown = code or "(empty)"
            raise Refused(f"class code {shown!r} is not open on this server (codes are "
                          f"{CODE_LEN} characters, given by the lecturer's page)")
        return c

    def close(self, code, token: str) -> None:
        c = self.get(code)
        c._owner(token, "close the class")
        with self._lock:
            self._classes.pop(c.code, None)

    def __len__(self) -> int:
        return len(self._classes)

    def _expire(self) -> None:
        now = time.monotonic()
        for code in [k for k, c in self._classes.items() if now - c.touched > IDLE_SECONDS]:
            del self._classes[code]
        while len(self._classes) >= MAX_CLASSES:
            oldest = min(self._classes, key=lambda k: self._classes[k].touched)
            del self._classes[oldest]
