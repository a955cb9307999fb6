"""Where the classes live: a store that every server process of one app shares.

`KVVIZ_CLASSES` chooses it, the same for every process of one server:

- `sqlite:///ABSOLUTE/PATH.sqlite3`: a SQLite file on this machine (WAL mode: readers never
  wait, writers take turns). Unset: `$XDG_STATE_HOME/kvviz/classes.sqlite3`, else
  `~/.local/state/kvviz/classes.sqlite3`, created 0600 in a 0700 folder.
- `redis://HOST:PORT/DB`: a Redis server (the `redis` package), for processes on several
  machines. Each class's keys expire by themselves after the class's idle time.

A class is a row of plain fields (`Store.load`): `owner` and `key` are SHA-256 digests (of the
lecturer's member token, and of the code with the lecturer key), never the secrets; `state`
the lecturer's page as a query mapping; `version`, `round_version`, `rounds`; `round` the open
question (a dict) or None; `touched`, wall-clock seconds. Votes are by voter digest (a
student's identity that outlives their page: kvviz.app.ui.classroom.me), presence ("heard
from") by digest too; `left` records a voter who left the class while a question was open
and had not voted on it, so a vote they cast after coming back is marked (`leavers`). Every
rule that reads then writes runs in one transaction (`update`, `vote`): two processes voting
at once count each vote once.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

ENV = "KVVIZ_CLASSES"
SCHEMA = 1  # the layout below; a store written with another is refused, never guessed at
FORMS = "sqlite:///ABSOLUTE/PATH.sqlite3 or redis://HOST:PORT/DB"


class Refused(ValueError):
    """A request the class refuses; the message is the sentence to show."""


class Unreachable(Refused):
    """The store cannot be reached (a Redis server down): one sentence, for the page."""


def default_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kvviz" / "classes.sqlite3"


def store_url(url: str | None = None) -> str:
    """`url`, else $KVVIZ_CLASSES, else the default SQLite file's URL."""
    url = url if url is not None else os.environ.get(ENV, "").strip()
    return url or f"sqlite://{default_path()}"


def open_store(url: str | None = None, ttl: float = 12 * 3600) -> Store:
    """The store at `url` (see the module's docstring); `ttl`: Redis's expiry of an idle
    class's keys (seconds)."""
    url = store_url(url)
    bad = ValueError(f"{ENV}={url!r}: expected {FORMS}")
    if url.startswith("sqlite://"):
        path = url[len("sqlite://"):]
        if not path.startswith("/") or path.endswith("/"):
            raise bad
        return SQLiteStore(Path(path))
    if url.startswith("redis://"):
        u = urlparse(url)
        if not u.hostname or (u.path.strip("/") and not u.path.strip("/").isdigit()):
            raise bad
        return RedisStore(url, ttl)
    raise bad


def _dumps(row: dict) -> dict:
    """A row's fields as a backend keeps them: state and round as JSON text."""
    out = dict(row)
    if "state" in out:
        out["state"] = json.dumps(out["state"], sort_keys=True)
    if "round" in out:
        out["round"] = "" if out["round"] is None else json.dumps(out["round"], sort_keys=True)
    return out


def _loads(raw: dict) -> dict:
    return {"owner": raw["owner"], "key": raw["key"], "state": json.loads(raw["state"]),
            "version": int(raw["version"]), "round_version": int(raw["round_version"]),
            "rounds": int(raw["rounds"]), "round": json.loads(raw["round"]) if raw["round"] else None,
            "touched": float(raw["touched"])}


def _number(rnd: dict | None) -> int:
    return -1 if rnd is None else rnd["number"]


def vote_rule(rnd: dict | None, number: int, position: int, mine, count: int,
              max_votes: int) -> tuple[str, object]:
    """The vote's rule, in order: (status, detail); "ok" or the refusal's kind."""
    if rnd is None or rnd["number"] != number:
        return "closed", None
    if rnd["revealed"]:
        return "revealed", None
    if mine is not None:
        return "again", int(mine)
    if position not in rnd["held"]:
        return "held", None
    if count >= max_votes:
        return "full", None
    return "ok", None


class Store:
    """The operations a Registry needs. `row`s are dicts of the fields the module names."""

    def create(self, code: str, row: dict) -> bool:
        """Add class `code` (False: the code is taken)."""
        raise NotImplementedError

    def load(self, code: str) -> dict | None:
        raise NotImplementedError

    def update(self, code: str, change) -> dict | None:
        """`change(row or None)` -> the fields to write ({}: none), or it raises; read, checked
        and written in one transaction. A new round number drops the old round's votes.
        Returns the row after."""
        raise NotImplementedError

    def vote(self, code: str, number: int, voter: str, position: int, max_votes: int,
             now: float) -> tuple[str, object, dict | None]:
        """`vote_rule` checked and the vote written in one transaction: (status, detail, the
        round); status "gone" if there is no such class."""
        raise NotImplementedError

    def votes(self, code: str, number: int) -> dict[str, int]:
        raise NotImplementedError

    def left(self, code: str, number: int, voter: str) -> None:
        """`voter` left the class while round `number` was open (kept only if they have not
        voted on it: a vote they cast afterwards is one cast after leaving)."""
        raise NotImplementedError

    def leavers(self, code: str, number: int) -> set[str]:
        """The voters who left the class during round `number` before voting on it."""
        raise NotImplementedError

    def here(self, code: str, voter: str, when: float) -> None:
        raise NotImplementedError

    def heard(self, code: str, since: float, but: str) -> int:
        """Voters heard from at or after `since`, `but` left out; older ones are forgotten."""
        raise NotImplementedError

    def touch(self, code: str, now: float) -> None:
        raise NotImplementedError

    def delete(self, code: str) -> None:
        raise NotImplementedError

    def expire(self, before: float, keep: int) -> None:
        """Delete the classes touched before `before`, then the oldest past `keep` classes."""
        raise NotImplementedError

    def count(self) -> int:
        raise NotImplementedError


# --- SQLite -------------------------------------------------------------------------------
_TABLES = """
CREATE TABLE classes (code TEXT PRIMARY KEY, owner TEXT NOT NULL, key TEXT NOT NULL,
    state TEXT NOT NULL, version INTEGER NOT NULL, round_version INTEGER NOT NULL,
    rounds INTEGER NOT NULL, round TEXT NOT NULL, touched REAL NOT NULL);
CREATE INDEX classes_touched ON classes (touched);
CREATE TABLE votes (code TEXT NOT NULL, round INTEGER NOT NULL, voter TEXT NOT NULL,
    position INTEGER NOT NULL, PRIMARY KEY (code, round, voter));
CREATE TABLE presence (code TEXT NOT NULL, voter TEXT NOT NULL, heard REAL NOT NULL,
    PRIMARY KEY (code, voter));
"""
# added to schema 1 (a store that lacks it gets it; older readers never look at it)
_LEAVERS = ("CREATE TABLE IF NOT EXISTS leavers (code TEXT NOT NULL, round INTEGER NOT NULL, "
            "voter TEXT NOT NULL, PRIMARY KEY (code, round, voter))")
_TABLES_ALL = ("votes", "presence", "leavers")
_COLUMNS = ("owner", "key", "state", "version", "round_version", "rounds", "round", "touched")


class SQLiteStore(Store):
    """One file. Each call takes a connection from the store's idle ones (or opens one) and
    puts it back: a page run is a new thread each time, a connection per thread would be
    opened per run. A forked child opens its own."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._idle: list[sqlite3.Connection] = []
        self._pid = None
        self._lock = threading.Lock()

    @contextmanager
    def _db(self):
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._create()
                    self._idle, self._pid = [], os.getpid()
        try:
            db = self._idle.pop()
        except IndexError:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=10,
                                 check_same_thread=False)
            db.execute("PRAGMA busy_timeout = 10000")
            db.execute("PRAGMA synchronous = NORMAL")
        try:
            yield db
        finally:
            if not db.in_transaction:
                self._idle.append(db)

    def _create(self) -> None:
        """The file (0600, in a 0700 folder when that is made here) and its tables."""
        if not self.path.exists():
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                pass
        db = sqlite3.connect(self.path, isolation_level=None, timeout=10)
        try:
            db.execute("PRAGMA busy_timeout = 10000")
            if db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise ValueError(f"{self.path}: SQLite cannot keep it in WAL mode "
                                 "(a network file system?); choose a local file in " + ENV)
            db.execute("BEGIN IMMEDIATE")
            have = db.execute("PRAGMA user_version").fetchone()[0]
            tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if have == 0 and tables == 0:
                for statement in _TABLES.split(";")[:-1]:  # (executescript would COMMIT)
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA}")
            elif have != SCHEMA:
                raise ValueError(f"{self.path} is not a kvviz class store of schema {SCHEMA} "
                                 f"(its user_version is {have}): move it away, or set {ENV} "
                                 "to another file")
            db.execute(_LEAVERS)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    @contextmanager
    def _tx(self):
        """One write transaction, taken before the first read (BEGIN IMMEDIATE)."""
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    @staticmethod
    def _row(db, code: str) -> dict | None:
        got = db.execute(f"SELECT {', '.join(_COLUMNS)} FROM classes WHERE code = ?",
                         (code,)).fetchone()
        return None if got is None else _loads(dict(zip(_COLUMNS, got)))

    def create(self, code, row):
        raw = _dumps(row)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM classes WHERE code = ?", (code,)).fetchone():
                return False
            for table in _TABLES_ALL:
                db.execute(f"DELETE FROM {table} WHERE code = ?", (code,))
            db.execute(f"INSERT INTO classes (code, {', '.join(_COLUMNS)}) "
                       f"VALUES (?{', ?' * len(_COLUMNS)})",
                       (code, *(raw[c] for c in _COLUMNS)))
            return True

    def load(self, code):
        with self._db() as db:
            return self._row(db, code)

    def update(self, code, change):
        with self._tx() as db:
            row = self._row(db, code)
            new = change(row)
            if not new or row is None:
                return row
            raw = _dumps(new)
            db.execute(f"UPDATE classes SET {', '.join(f'{k} = ?' for k in raw)} "
                       "WHERE code = ?", (*raw.values(), code))
            if "round" in new:  # only the open round's votes (and leavers) are kept
                for table in ("votes", "leavers"):
                    db.execute(f"DELETE FROM {table} WHERE code = ? AND round != ?",
                               (code, _number(new["round"])))
            return {**row, **new}

    def vote(self, code, number, voter, position, max_votes, now):
        with self._tx() as db:
            row = self._row(db, code)
            if row is None:
                return "gone", None, None
            rnd = row["round"]
            mine = db.execute("SELECT position FROM votes WHERE code = ? AND round = ? AND "
                              "voter = ?", (code, number, voter)).fetchone()
            count = db.execute("SELECT count(*) FROM votes WHERE code = ? AND round = ?",
                               (code, number)).fetchone()[0]
            status, detail = vote_rule(rnd, number, position, mine and mine[0], count,
                                       max_votes)
            if status == "ok":
                db.execute("INSERT INTO votes (code, round, voter, position) "
                           "VALUES (?, ?, ?, ?)", (code, number, voter, position))
                db.execute("UPDATE classes SET round_version = round_version + 1, "
                           "touched = ? WHERE code = ?", (now, code))
            return status, detail, rnd

    def votes(self, code, number):
        with self._db() as db:
            return dict(db.execute("SELECT voter, position FROM votes WHERE code = ? AND "
                                   "round = ?", (code, number)).fetchall())

    def left(self, code, number, voter):
        with self._tx() as db:
            if not db.execute("SELECT 1 FROM votes WHERE code = ? AND round = ? AND voter = ?",
                              (code, number, voter)).fetchone():
                db.execute("INSERT OR IGNORE INTO leavers (code, round, voter) VALUES (?, ?, ?)",
                           (code, number, voter))

    def leavers(self, code, number):
        with self._db() as db:
            return {v for (v,) in db.execute("SELECT voter FROM leavers WHERE code = ? AND "
                                             "round = ?", (code, number))}

    def here(self, code, voter, when):
        with self._db() as db:
            db.execute("INSERT INTO presence (code, voter, heard) VALUES (?, ?, ?) ON "
                       "CONFLICT (code, voter) DO UPDATE SET heard = excluded.heard",
                       (code, voter, when))

    def heard(self, code, since, but):
        with self._tx() as db:
            db.execute("DELETE FROM presence WHERE code = ? AND heard < ?", (code, since))
            return db.execute("SELECT count(*) FROM presence WHERE code = ? AND voter != ?",
                              (code, but)).fetchone()[0]

    def touch(self, code, now):
        with self._db() as db:
            db.execute("UPDATE classes SET touched = max(touched, ?) WHERE code = ?",
                       (now, code))

    def delete(self, code):
        with self._tx() as db:
            for table in ("classes", *_TABLES_ALL):
                db.execute(f"DELETE FROM {table} WHERE code = ?", (code,))

    def expire(self, before, keep):
        with self._tx() as db:
            db.execute("DELETE FROM classes WHERE touched < ?", (before,))
            db.execute("DELETE FROM classes WHERE code IN (SELECT code FROM classes ORDER BY "
                       "touched DESC, rowid DESC LIMIT -1 OFFSET ?)", (max(0, keep),))
            for table in _TABLES_ALL:
                db.execute(f"DELETE FROM {table} WHERE code NOT IN (SELECT code FROM classes)")

    def count(self):
        with self._db() as db:
            return db.execute("SELECT count(*) FROM classes").fetchone()[0]


# --- Redis --------------------------------------------------------------------------------
# KEYS: the class's hash, its votes' hash, the ranking of codes. ARGV: round number, voter,
# position, max votes, now, ttl, code. The same rule as vote_rule, in one script (Redis runs
# a script alone: nothing comes between its reads and its writes).
_VOTE = """
local raw = redis.call('HGET', KEYS[1], 'round')
if not raw then return {'gone', '', ''} end
if raw == '' then return {'closed', '', ''} end
local r = cjson.decode(raw)
if r['number'] ~= tonumber(ARGV[1]) then return {'closed', '', raw} end
if r['revealed'] then return {'revealed', '', raw} end
local mine = redis.call('HGET', KEYS[2], ARGV[2])
if mine then return {'again', mine, raw} end
local pos, held = tonumber(ARGV[3]), false
for _, p in ipairs(r['held']) do if p == pos then held = true end end
if not held then return {'held', '', raw} end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[4]) then return {'full', '', raw} end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[1], 'round_version', 1)
redis.call('HSET', KEYS[1], 'touched', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('ZADD', KEYS[3], 'XX', ARGV[5], ARGV[7])
return {'ok', '', raw}
"""
PREFIX = "kvviz:"


class RedisStore(Store):
    """Per class, under `kvviz:class:CODE`: a hash (the row), `:votes` (voter -> position, the
    open round's), `:here` (a sorted set, voter by last heard) and `:left` (a set of
    "ROUND:voter"), each expiring `ttl` after the class was last touched; `kvviz:classes`
    ranks the codes by last touch."""

    def __init__(self, url: str, ttl: float):
        import redis

        self.url, self.ttl = url, int(ttl)
        self._redis = redis
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=3,
                                      socket_timeout=10)
        self._vote = self.r.register_script(_VOTE)
        self._checked = False

    @contextmanager
    def _up(self):
        """redis-py's connection errors as one sentence (the first use says the store is down)."""
        try:
            if not self._checked:
                have = self.r.get(PREFIX + "schema")
                if have is None:
                    self.r.setnx(PREFIX + "schema", SCHEMA)
                elif int(have) != SCHEMA:
                    raise ValueError(f"the Redis class store {self.url} holds kvviz classes of "
                                     f"schema {have}, this kvviz reads {SCHEMA}: flush its "
                                     f"kvviz:* keys or set {ENV} to another database")
                self._checked = True
            yield
        except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
            raise Unreachable(f"the class store {self.url} ({ENV}) cannot be reached ({exc}): "
                              "start that Redis server, or unset " + ENV + " to keep classes "
                              "in a file on this machine") from None

    def _keys(self, code: str) -> tuple[str, str, str, str]:
        k = f"{PREFIX}class:{code}"
        return k, k + ":votes", k + ":here", k + ":left"

    def create(self, code, row):
        k, v, h, lf = self._keys(code)
        with self._up():
            if not self.r.hsetnx(k, "owner", row["owner"]):
                return False
            p = self.r.pipeline()
            p.delete(v, h, lf)
            p.hset(k, mapping=_dumps(row))
            p.expire(k, self.ttl)
            p.zadd(PREFIX + "classes", {code: row["touched"]})
            p.execute()
            return True

    def load(self, code):
        with self._up():
            raw = self.r.hgetall(self._keys(code)[0])
        return _loads(raw) if len(raw) == len(_COLUMNS) else None

    def update(self, code, change):
        k, v, _, lf = self._keys(code)
        with self._up(), self.r.pipeline() as p:
            while True:
                try:
                    p.watch(k)
                    raw = p.hgetall(k)
                    row = _loads(raw) if len(raw) == len(_COLUMNS) else None
                    new = change(row)
                    if not new or row is None:
                        p.unwatch()
                        return row
                    p.multi()
                    p.hset(k, mapping=_dumps(new))
                    if "round" in new and _number(new["round"]) != _number(row["round"]):
                        p.delete(v, lf)  # a new round (or none): the old one's votes go
                    if "touched" in new:
                        for key in self._keys(code):
                            p.expire(key, self.ttl)
                        p.zadd(PREFIX + "classes", {code: new["touched"]}, xx=True)
                    p.execute()
                    return {**row, **new}
                except self._redis.WatchError:
                    continue

    def vote(self, code, number, voter, position, max_votes, now):
        k, v = self._keys(code)[:2]
        with self._up():
            status, detail, raw = self._vote(keys=[k, v, PREFIX + "classes"],
                                             args=[number, voter, position, max_votes, now,
                                                   self.ttl, code])
        return (status, int(detail) if detail else None,
                json.loads(raw) if raw else None)

    def votes(self, code, number):
        k, v = self._keys(code)[:2]
        with self._up():
            p = self.r.pipeline(transaction=True)
            p.hget(k, "round")
            p.hgetall(v)
            raw, votes = p.execute()
        if not raw or json.loads(raw)["number"] != number:
            return {}
        return {voter: int(pos) for voter, pos in votes.items()}

    def left(self, code, number, voter):
        _, v, _, lf = self._keys(code)
        with self._up():
            if not self.r.hexists(v, voter):
                p = self.r.pipeline(transaction=False)
                p.sadd(lf, f"{number}:{voter}")
                p.expire(lf, self.ttl)
                p.execute()

    def leavers(self, code, number):
        with self._up():
            marks = self.r.smembers(self._keys(code)[3])
        head = f"{number}:"
        return {m[len(head):] for m in marks if m.startswith(head)}

    def here(self, code, voter, when):
        h = self._keys(code)[2]
        with self._up():
            p = self.r.pipeline(transaction=False)
            p.zadd(h, {voter: when})
            p.expire(h, self.ttl)
            p.execute()

    def heard(self, code, since, but):
        h = self._keys(code)[2]
        with self._up():
            p = self.r.pipeline(transaction=True)
            p.zremrangebyscore(h, "-inf", f"({since}")
            p.zcard(h)
            p.zscore(h, but)
            _, n, theirs = p.execute()
        return n - (theirs is not None)

    def touch(self, code, now):
        keys = self._keys(code)
        with self._up():
            if not self.r.exists(keys[0]):
                return
            p = self.r.pipeline(transaction=True)
            p.hset(keys[0], "touched", now)
            for key in keys:
                p.expire(key, self.ttl)
            p.zadd(PREFIX + "classes", {code: now}, xx=True)
            p.execute()

    def delete(self, code):
        with self._up():
            self.r.delete(*self._keys(code))
            self.r.zrem(PREFIX + "classes", code)

    def expire(self, before, keep):
        ranked = PREFIX + "classes"
        with self._up():
            old = self.r.zrangebyscore(ranked, "-inf", f"({before}")
            codes = self.r.zrange(ranked, 0, -1)
            p = self.r.pipeline(transaction=False)
            for code in codes:
                p.exists(self._keys(code)[0])
            old += [c for c, there in zip(codes, p.execute()) if not there]  # expired by Redis
            for code in set(old):
                self.delete(code)
            extra = self.r.zcard(ranked) - max(0, keep)
            if extra > 0:
                for code in self.r.zrange(ranked, 0, extra - 1):
                    self.delete(code)

    def count(self):
        with self._up():
            return self.r.zcard(PREFIX + "classes")
