"""A class: its code, the lecturer's state, and predict-then-reveal rounds.

Kept in a store that every process of the server shares (kvviz.app.teach.store: a SQLite
file on this machine by default, or Redis; `KVVIZ_CLASSES` chooses), so a student's page
served by one process follows a lecturer served by another, and a restarted server finds its
classes again. A class is reached only through its code, and only the member token that
leads it (the lecturer's session) can move it, ask or reveal. Tokens are per session secrets
the page keeps in `st.session_state`; they never appear in a link, and the store keeps only
their SHA-256 digests (and the lecturer key's, with the code): `Registry.open` returns the key
once, for the lecturer's page to show.

Cheap under a crowd: a process reads a class's row at most once every `Registry.ttl` seconds
for all its sessions (never older than what the process itself wrote since), and writes a
student's presence at most once every HERE_WRITE_S.

Every refusal is a `Refused` (a ValueError) whose message names the rule, for `st.error`.
"""
from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvviz.app.teach.store import Refused, Store, Unreachable, open_store  # noqa: F401

# no 0/O, 1/I/L: a code read off a projector is typed right
ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"
CODE_LEN = 6
MAX_CLASSES = 256       # per store; the oldest idle class goes first past this
IDLE_SECONDS = 12 * 3600  # a class nobody touched for this long is closed
HERE_SECONDS = 5.0  # a student's page not heard from for this long is no longer counted
HERE_WRITE_S = 1.0  # a page's presence is written at most this often (per process)
TOUCH_S = 60.0      # a class's last touch is written at most this often (per process)
TTL_S = 0.2         # a class's row is read at most this often (per process)
MAX_VOTES = 1000        # per round (a class, not a crowd)


def new_token() -> str:
    """A session's member token (secret; identifies the lecturer and each voter)."""
    return secrets.token_urlsafe(16)


def new_key() -> str:
    """A class's lecturer key: 8 characters of ALPHABET (40 bits), shown only on the lecturer's
    page, which with the code lets a new tab take the class back (`Class.take_back`)."""
    return "".join(secrets.choice(ALPHABET) for _ in range(8))


def normal_code(code) -> str:
    return str(code or "").strip().upper()


def digest(token: str) -> str:
    """What the store keeps of a member token: its SHA-256, hex."""
    return hashlib.sha256(str(token).encode()).hexdigest()


def key_digest(code: str, key: str) -> str:
    """What the store keeps of a lecturer key (typed as read: any case, a dash): SHA-256 of the
    code and the key, so one key's digest says nothing about another class's."""
    key = normal_code(key).replace("-", "")
    return hashlib.sha256(f"{code}:{key}".encode()).hexdigest()


@dataclass
class Round:
    """One question: "which position will <who> evict next?" at `step`.

    `held` are the positions a guess may name (the policy's cache before the eviction),
    `answer` the positions it evicts at `answer_step` (one or more). Votes are by voter digest
    (`mine` finds a voter's own; a student's voter is their browser's identity, which outlives
    a reload and a server restart); `rejoined` are the voters whose vote came after they
    left the class during this question (they may have seen more than the question showed).
    """
    number: int
    step: int
    who: str                 # "a" or "b"
    label: str               # the policy as the page names it ("TOVA", "SnapKV k=7 ...")
    held: frozenset
    answer: frozenset
    answer_step: int
    votes: dict = field(default_factory=dict)  # digest(token) -> position
    revealed: bool = False
    why: str = ""            # the lecturer's explanation, set on reveal (every page shows it)
    rejoined: frozenset = frozenset()  # voter digests: voted after leaving during the question

    def tally(self) -> Counter:
        return Counter(self.votes.values())

    def mine(self, token: str) -> int | None:
        """The position the voter `token` voted for, or None."""
        return self.votes.get(digest(token))

    def rejoined_tally(self) -> Counter:
        """Votes cast after leaving the class during the question, by position."""
        return Counter(p for v, p in self.votes.items() if v in self.rejoined)

    @property
    def right(self) -> int:
        return sum(1 for p in self.votes.values() if p in self.answer)

    @property
    def share_right(self) -> float | None:
        return self.right / len(self.votes) if self.votes else None

    def fields(self) -> dict:
        """As the store keeps it (votes apart)."""
        return {"number": self.number, "step": self.step, "who": self.who, "label": self.label,
                "held": sorted(self.held), "answer": sorted(self.answer),
                "answer_step": self.answer_step, "revealed": self.revealed, "why": self.why}

    @classmethod
    def of(cls, f: dict, votes: dict, leavers=()) -> Round:
        votes = dict(votes)
        return cls(f["number"], f["step"], f["who"], f["label"], frozenset(f["held"]),
                   frozenset(f["answer"]), f["answer_step"], votes, f["revealed"], f["why"],
                   frozenset(v for v in leavers if v in votes))


@dataclass(eq=False)
class Class:
    """A handle on one class in the registry's store (`Registry.get` makes one per call).
    `key` is the lecturer key on the handle `Registry.open` returns, None on every other."""
    code: str
    reg: Registry = field(repr=False)
    key: str | None = field(default=None, repr=False)

    @property
    def turn(self) -> threading.Lock:
        """Students' page runs, one at a time, in this process (kvviz.app.ui.follow.turn)."""
        return self.reg._turn(self.code)

    def _row(self) -> dict:
        row = self.reg._row(self.code)
        if row is None:
            raise self.reg._gone(self.code)
        return row

    def _check(self, row: dict | None, token: str, what: str) -> dict:
        if row is None:
            raise self.reg._gone(self.code)
        if not secrets.compare_digest(row["owner"], digest(token)):
            raise Refused(f"only the lecturer's session, the one that opened class {self.code}, "
                          f"can {what}")
        return row

    def _update(self, change) -> dict:
        return self.reg._update(self.code, change)

    def led_by(self, token: str) -> bool:
        """Whether the session with member token `token` leads the class now."""
        return secrets.compare_digest(self._row()["owner"], digest(token))

    @property
    def version(self) -> int:
        return self._row()["version"]

    @property
    def round_version(self) -> int:
        return self._row()["round_version"]

    @property
    def round(self) -> Round | None:
        return self.current_round()

    def publish(self, token: str, state: dict) -> int:
        """The lecturer's page as a query mapping; followers move when the version changes."""
        state = {str(k): str(v) for k, v in dict(state).items()}
        row = self._row()
        if secrets.compare_digest(row["owner"], digest(token)) and row["state"] == state:
            self.reg._touch(self.code)  # the lecturer's every run: no write when nothing moved
            return row["version"]

        def change(row):
            self._check(row, token, "move the class")
            if state == row["state"]:
                return {"touched": self.reg.clock()}
            return {"state": state, "version": row["version"] + 1, "touched": self.reg.clock()}
        return self._update(change)["version"]

    def snapshot(self) -> tuple[int, dict]:
        row = self._row()
        self.reg._touch(self.code)
        return row["version"], dict(row["state"])

    def current_round(self) -> Round | None:
        """A copy of the open round (votes included): votes arrive from other sessions while
        a page counts them."""
        row = self._row()
        if row["round"] is None:
            return None
        return Round.of(row["round"], *self.reg._votes(self.code, row))

    def take_back(self, key: str, token: str) -> None:
        """The lecturer's key moves the class to `token` (a reloaded or new tab); the old
        token can no longer move it."""
        def change(row):
            if row is None:
                raise self.reg._gone(self.code)
            if not secrets.compare_digest(key_digest(self.code, key), row["key"]):
                raise Refused(f"that is not class {self.code}'s lecturer key (8 characters, "
                              "shown under the code on the lecturer's page)")
            return {"owner": digest(token), "touched": self.reg.clock()}
        self._update(change)

    def here(self, token: str, now: float | None = None) -> None:
        """A student's page was heard from (each of its runs, and every few seconds while it is
        connected: kvviz.app.ui.watch). The lecturer's
        page is never counted (`students` leaves out the class's owner)."""
        self.reg._here(self.code, digest(token), self.reg.clock() if now is None else now)

    def students(self, within: float = HERE_SECONDS, now: float | None = None) -> int:
        """How many students' pages were heard from in the last `within` seconds (a connected
        page is heard every few seconds; a closed tab stops being counted)."""
        now = self.reg.clock() if now is None else now
        return self.reg.store.heard(self.code, now - within, self._row()["owner"])

    def poll(self) -> tuple[int, int]:
        """(version, round_version): what the class watcher compares with what a page drew."""
        row = self._row()
        self.reg._touch(self.code)
        return row["version"], row["round_version"]

    def ask(self, token: str, *, step: int, who: str, label: str, held, answer,
            answer_step: int) -> Round:
        """Open a new round (the previous one, revealed or not, is replaced)."""
        held = frozenset(int(p) for p in held)
        answer = frozenset(int(p) for p in answer)

        def change(row):
            self._check(row, token, "ask the class")
            if who not in ("a", "b"):
                raise Refused(f"who={who!r}: the question is about policy 'a' or 'b'")
            if not answer or not answer <= held:
                raise Refused("the answer must be one or more of the held positions")
            r = Round(row["rounds"] + 1, int(step), who, str(label), held, answer,
                      int(answer_step))
            return {"rounds": r.number, "round": r.fields(),
                    "round_version": row["round_version"] + 1, "touched": self.reg.clock()}
        return Round.of(self._update(change)["round"], {})

    def vote(self, token: str, number: int, position) -> Round:
        """A student's guess for round `number`. Refused: no open round, a stale round,
        a revealed round, a second vote, a position the policy does not hold."""
        try:
            pos = int(position)
        except (TypeError, ValueError):
            raise Refused(f"guess {position!r} is not a position number") from None
        status, detail, r = self.reg.store.vote(self.code, int(number), digest(token), pos,
                                                MAX_VOTES, self.reg.clock())
        self.reg._wrote(self.code)
        if status == "gone":
            raise self.reg._gone(self.code)
        if status == "closed":
            raise Refused("no question is open in this class right now: the lecturer closed "
                          "it before your vote arrived, so your vote was not counted")
        if status == "revealed":
            raise Refused("the answer has been revealed: votes are closed for this question")
        if status == "again":
            raise Refused(f"you already voted (position {detail}) on this question; "
                          "one vote each")
        if status == "held":
            raise Refused(f"position {pos} is not held by {r['label']} at step {r['step']}: "
                          "guess one of the held positions")
        if status == "full":
            raise Refused(f"this question has {MAX_VOTES} votes already")
        return self.current_round()

    def left(self, token: str, number: int) -> None:
        """The voter `token` left the class while round `number` was open: a vote they cast
        on it afterwards is marked (`Round.rejoined`)."""
        self.reg.store.left(self.code, int(number), digest(token))
        self.reg._wrote(self.code)

    def reveal(self, token: str, why: str = "") -> Round:
        """Votes close; `why` (the lecturer's page's explanation) reaches every page with it."""
        def change(row):
            self._check(row, token, "reveal the answer")
            if row["round"] is None:
                raise Refused("no question is open to reveal")
            return {"round": {**row["round"], "revealed": True, "why": str(why)},
                    "round_version": row["round_version"] + 1, "touched": self.reg.clock()}
        self._update(change)
        return self.current_round()

    def close_round(self, token: str) -> None:
        def change(row):
            self._check(row, token, "close the question")
            if row["round"] is None:
                return {}
            return {"round": None, "round_version": row["round_version"] + 1}
        self._update(change)


@dataclass
class _Seen:
    """A process's copy of one class's row, read at `at` (time.monotonic), and of its open
    round's votes and leavers as of round version `votes_at`."""
    at: float
    row: dict
    votes_at: int = -1
    votes: tuple = (dict(), frozenset())


class Registry:
    """Every open class in one store, by code: one per process (the page's module global).

    `url`: the store (None: $KVVIZ_CLASSES, else the default SQLite file): a bad one is a
    ValueError here, a store that cannot be reached an `Unreachable` (a Refused) at first use.
    `clock`: wall-clock seconds (presence and expiry; tests move it). `ttl`: how long this
    process serves a class's row from its copy."""

    def __init__(self, url: str | None = None, *, clock=time.time, ttl: float = TTL_S):
        self.url, self.clock, self.ttl = url, clock, float(ttl)
        self.store: Store = open_store(url, IDLE_SECONDS)  # (connects at first use)
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        self._gen: dict[str, int] = {}       # code -> writes by this process (a read that
                                             # began before one is not kept)
        self._heard: dict[tuple, float] = {}  # (code, voter) -> presence last written
        self._touched: dict[str, float] = {}  # code -> last touch written
        self._turns: dict[str, threading.Lock] = {}

    # --- the process's copies -------------------------------------------------------------
    def _row(self, code: str) -> dict | None:
        with self._lock:
            seen, gen = self._seen.get(code), self._gen.get(code, 0)
        t0 = time.monotonic()
        if seen is not None and t0 - seen.at < self.ttl:
            return seen.row
        row = self.store.load(code)
        with self._lock:
            if row is None:
                self._seen.pop(code, None)
            elif self._gen.get(code, 0) == gen:
                old = self._seen.get(code)
                keep = old is not None and old.votes_at == row["round_version"]
                self._seen[code] = _Seen(t0, row, *((old.votes_at, old.votes) if keep else ()))
        return row

    def _votes(self, code: str, row: dict) -> tuple[dict, frozenset]:
        """(votes, leavers) of the row's open round."""
        with self._lock:
            seen = self._seen.get(code)
            if seen is not None and seen.row is row and seen.votes_at == row["round_version"]:
                return dict(seen.votes[0]), seen.votes[1]
        number = row["round"]["number"]
        votes = self.store.votes(code, number)
        leavers = frozenset(self.store.leavers(code, number)) if votes else frozenset()
        with self._lock:
            if seen is not None and self._seen.get(code) is seen:
                seen.votes_at, seen.votes = row["round_version"], (votes, leavers)
        return dict(votes), leavers

    def _wrote(self, code: str) -> None:
        """This process changed class `code`: its next read goes to the store."""
        with self._lock:
            self._gen[code] = self._gen.get(code, 0) + 1
            self._seen.pop(code, None)

    def _update(self, code: str, change) -> dict:
        try:
            row = self.store.update(code, change)
        finally:
            self._wrote(code)
        if row is None:
            raise self._gone(code)
        if "touched" in row:
            self._touched[code] = row["touched"]
        return row

    def _touch(self, code: str) -> None:
        now = self.clock()
        if now - self._touched.get(code, float("-inf")) >= TOUCH_S:
            self._touched[code] = now
            self.store.touch(code, now)
            self._wrote(code)

    def _here(self, code: str, voter: str, now: float) -> None:
        with self._lock:
            last = self._heard.get((code, voter))
            if last is not None and 0 <= now - last < HERE_WRITE_S:
                return
            if len(self._heard) >= 4096:  # the memo only needs the last HERE_WRITE_S
                old = [k for k, t in self._heard.items() if not 0 <= now - t < HERE_WRITE_S]
                for k in old if len(old) > 1024 else list(self._heard):
                    del self._heard[k]
            self._heard[(code, voter)] = now
        self.store.here(code, voter, now)

    def _turn(self, code: str) -> threading.Lock:
        with self._lock:
            return self._turns.setdefault(code, threading.Lock())

    @staticmethod
    def _gone(code: str) -> Refused:
        shown = code or "(empty)"
        return Refused(f"class code {shown!r} is not open on this server (codes are "
                       f"{CODE_LEN} characters, given by the lecturer's page)")

    # --- the registry ---------------------------------------------------------------------
    def open(self, owner: str) -> Class:
        """A new class led by `owner` (a member token), under a fresh unguessable code; the
        returned handle's `key` is the lecturer key (the store keeps only its digest)."""
        now = self.clock()
        self.store.expire(now - IDLE_SECONDS, MAX_CLASSES - 1)
        key = new_key()
        while True:
            code = "".join(secrets.choice(ALPHABET) for _ in range(CODE_LEN))
            row = {"owner": digest(owner), "key": key_digest(code, key), "state": {},
                   "version": 0, "round_version": 0, "rounds": 0, "round": None,
                   "touched": now}
            if self.store.create(code, row):
                break
        self._wrote(code)
        self._touched[code] = now
        return Class(code, self, key)

    def get(self, code) -> Class:
        """The class under `code`; Refused (naming the code) if none is open."""
        code = normal_code(code)
        row = self._row(code) if code else None
        if row is not None and self.clock() - row["touched"] > IDLE_SECONDS:
            self.store.delete(code)
            self._wrote(code)
            row = None
        if row is None:
            raise self._gone(code)
        return Class(code, self)

    def close(self, code, token: str) -> None:
        c = self.get(code)
        c._check(self.store.load(c.code), token, "close the class")
        self.store.delete(c.code)
        self._wrote(c.code)

    def __len__(self) -> int:
        self.store.expire(self.clock() - IDLE_SECONDS, MAX_CLASSES)
        return self.store.count()
