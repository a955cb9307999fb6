"""The class store (kvviz.app.teach.store) under the registry (kvviz.app.teach.classroom): every
test runs on SQLite and on a Redis server of its own, with registries that share one store the
way the processes of one server do."""
import multiprocessing
import os
import shutil
import socket
import sqlite3
import stat
import subprocess
import threading
import time

import pytest
from apphelp import refused_port

from kvviz.app.teach import classroom as cr
from kvviz.app.teach import store as st


def _start_redis(exe: str, tries: int = 5) -> tuple[subprocess.Popen, str]:
    """redis-server on a loopback port: (its process, its URL). Redis cannot bind port 0 and
    say which it got (`--port 0` turns TCP off) and kvviz's store takes only redis://HOST:PORT,
    so the port is found free first (bound to port 0, then closed). Another process may take
    it before redis binds it; then redis exits ("Address already in use") and the next port
    is tried. The server that answers is checked to be this one (INFO's process_id), so a
    test never talks to another process's server."""
    import redis

    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url, socket_connect_timeout=2)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if client.info("server")["process_id"] == proc.pid:
                    return proc, url
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    raise RuntimeError(f"redis-server did not start on a free port in {tries} tries")


@pytest.fixture(scope="module")
def _redis():
    """A redis-server of this module's own (a failure when KVVIZ_REQUIRE_E2E=1 and there is
    none, a skip otherwise): its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        msg = "redis-server is not installed (apt-get install -y redis-server)"
        if os.environ.get("KVVIZ_REQUIRE_E2E") == "1":
            pytest.fail(msg + " (KVVIZ_REQUIRE_E2E=1)")
        pytest.skip(msg)
    proc, url = _start_redis(exe)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.server)])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/classes.sqlite3"
    u = request.getfixturevalue("_redis")
    import redis

    redis.Redis.from_url(u).flushdb()
    return u


def reg(url, **kw) -> cr.Registry:
    """A registry as another process has one: no copy of what the others read (ttl 0)."""
    return cr.Registry(url, ttl=kw.pop("ttl", 0), **kw)


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def raw_dump(url) -> str:
    """Everything the store holds, as text."""
    if url.startswith("sqlite"):
        db = sqlite3.connect(url[len("sqlite://"):])
        try:
            return "\n".join(db.iterdump())
        finally:
            db.close()
    import redis

    r = redis.Redis.from_url(url, decode_responses=True)
    out = []
    for k in r.keys("*"):
        kind = r.type(k)
        value = {"hash": r.hgetall, "zset": lambda k: r.zrange(k, 0, -1, withscores=True),
                 "string": r.get, "set": r.smembers}[kind](k)
        out.append(f"{k} {value}")
    return "\n".join(out)


# --- one class, two registries ------------------------------------------------------------
def test_state_and_versions_are_shared(url):
    a, b = reg(url), reg(url)
    c = a.open("lect")
    other = a.open("lect2")
    assert c.publish("lect", {"step": 5}) == 1
    assert c.publish("lect", {"step": "5"}) == 1  # the same state, as text
    seen = b.get(c.code.lower())
    assert seen.snapshot() == (1, {"step": "5"}) and seen.poll() == (1, 0)
    assert b.get(other.code).snapshot() == (0, {})  # another code, another class
    assert seen.publish("lect", {"step": "6"}) == 2  # the token leads, whichever process
    assert c.snapshot() == (2, {"step": "6"})
    with pytest.raises(cr.Refused, match="only the lecturer's session, the one that opened"):
        seen.publish("stud", {"step": "7"})
    with pytest.raises(cr.Refused, match="'NOPE00' is not open on this server"):
        b.get("nope00")
    assert len(b) == 2
    b.close(c.code, "lect")
    with pytest.raises(cr.Refused, match="is not open"):
        a.get(c.code)
    assert len(a) == 1


def test_a_question_votes_and_every_refusal_across_registries(url, monkeypatch):
    a, b = reg(url), reg(url)
    c = a.open("l")
    s = b.get(c.code)  # the students' process
    with pytest.raises(cr.Refused, match="no question is open in this class"):
        s.vote("s1", 1, 3)
    with pytest.raises(cr.Refused, match="only the lecturer"):
        s.ask("s1", step=7, who="a", label="TOVA", held=[0, 3, 5], answer=[5], answer_step=8)
    with pytest.raises(cr.Refused, match="held positions"):
        c.ask("l", step=7, who="a", label="TOVA", held=[0, 3, 5], answer=[4], answer_step=8)
    with pytest.raises(cr.Refused, match="policy 'a' or 'b'"):
        c.ask("l", step=7, who="c", label="TOVA", held=[0, 3, 5], answer=[5], answer_step=8)
    r = c.ask("l", step=7, who="a", label="TOVA", held=[0, 3, 5], answer=[5], answer_step=8)
    assert (r.number, r.held, r.answer, r.votes) == (1, {0, 3, 5}, {5}, {})
    with pytest.raises(cr.Refused, match="position 4 is not held by TOVA at step 7"):
        s.vote("s1", 1, 4)
    with pytest.raises(cr.Refused, match="not a position number"):
        s.vote("s1", 1, "five")
    s.vote("s1", 1, 5)
    with pytest.raises(cr.Refused, match=r"already voted \(position 5\)"):
        s.vote("s1", 1, 3)
    with pytest.raises(cr.Refused, match=r"already voted \(position 5\)"):
        c.vote("s1", 1, 0)  # the other process knows it too
    with pytest.raises(cr.Refused, match="no question is open"):
        s.vote("s2", 0, 3)  # a stale round's number
    monkeypatch.setattr(cr, "MAX_VOTES", 2)
    s.vote("s2", 1, 3)
    with pytest.raises(cr.Refused, match="has 2 votes already"):
        s.vote("s3", 1, 3)
    seen = c.current_round()
    assert seen.tally() == {5: 1, 3: 1} and seen.right == 1 and seen.mine("s2") == 3
    assert seen.mine("s3") is None
    with pytest.raises(cr.Refused, match="only the lecturer"):
        s.reveal("s1")
    c.reveal("l", "TOVA drops the lowest score")
    with pytest.raises(cr.Refused, match="revealed: votes are closed"):
        s.vote("s3", 1, 3)
    shown = s.current_round()
    assert shown.revealed and shown.why == "TOVA drops the lowest score" and len(shown.votes) == 2
    assert s.poll() == (0, 4)  # ask, two votes, reveal: never the followers' version
    r2 = c.ask("l", step=9, who="b", label="H2O", held=[1, 2], answer=[2], answer_step=9)
    assert r2.number == 2 and s.current_round().votes == {}  # a new round starts empty
    s.vote("s1", 2, 2)
    with pytest.raises(cr.Refused, match="only the lecturer"):
        s.close_round("s1")
    c.close_round("l")
    assert s.current_round() is None and s.poll() == (0, 7)
    with pytest.raises(cr.Refused, match="no question is open to reveal"):
        c.reveal("l")
    with pytest.raises(cr.Refused, match="no question is open"):
        s.vote("s2", 2, 2)


def test_presence_is_counted_once_per_page_and_never_the_lecturer(url):
    a, b = reg(url), reg(url)
    c = a.open("lect")
    s = b.get(c.code)
    c.here("lect", now=100.0)
    for t in ("s1", "s2", "s1"):
        s.here(t, now=100.0)
    c.here("s3", now=100.1)  # a page served by the other process
    assert c.students(now=101.0) == 3 == s.students(now=101.0)
    s.here("s2", now=103.0)
    assert s.students(within=5, now=105.2) == 1  # s1 and s3 not heard from for 5 s
    s.here("s1", now=106.0)  # back
    assert c.students(within=5, now=106.0) == 2
    c.take_back(c.key, "s1")  # a student's tab that takes the class leads it
    assert c.students(within=5, now=106.0) == 1
    assert c.students(within=5, now=200.0) == 0


def test_a_page_writes_its_presence_at_most_once_a_second_per_process(url):
    a, b = reg(url), reg(url)
    c = a.open("lect")
    writes = []
    here = a.store.here
    a.store.here = lambda *args: (writes.append(args), here(*args))
    s = a.get(c.code)
    for i in range(50):
        s.here("s1", now=100.0 + i / 100)  # 50 ticks in half a second
    assert len(writes) == 1
    s.here("s1", now=101.0)
    assert len(writes) == 2
    b.get(c.code).here("s1", now=101.5)  # another process keeps its own memo
    assert s.students(within=0.2, now=101.6) == 1


def test_polls_read_the_store_once_per_ttl_and_see_this_process_writes(url):
    a = cr.Registry(url, ttl=60)  # a long ttl: only this process's writes refresh it
    other = reg(url)
    c = a.open("lect")
    loads = []
    load = a.store.load
    a.store.load = lambda code: (loads.append(code), load(code))[1]
    pages = [a.get(c.code) for _ in range(20)]
    polls = {p.poll() for _ in range(10) for p in pages}
    assert polls == {(0, 0)} and len(loads) == 1  # 200 polls, one read
    other.get(c.code).publish("lect", {"step": "3"})  # another process moves the class
    assert pages[0].poll() == (0, 0)  # not seen before the ttl ...
    c.publish("lect", {"step": "4"})  # ... but this process's own write is
    assert pages[0].poll() == (2, 0) and pages[1].snapshot() == (2, {"step": "4"})
    c.ask("lect", step=1, who="a", label="A", held=[1, 2], answer=[1], answer_step=1)
    assert pages[2].poll() == (2, 1)
    pages[3].vote("s1", 1, 2)
    assert pages[4].poll() == (2, 2) and pages[4].current_round().mine("s1") == 2


# --- expiry, secrets, restart -------------------------------------------------------------
def test_idle_classes_expire_and_a_touch_keeps_them(url, monkeypatch):
    clock = Clock()
    a, b = reg(url, clock=clock), reg(url, clock=clock)
    idle, busy = a.open("t1"), a.open("t2")
    clock.t += cr.IDLE_SECONDS - 100
    b.get(busy.code).poll()  # a student's page keeps it open
    clock.t += 200
    with pytest.raises(cr.Refused, match="is not open"):
        b.get(idle.code)
    assert b.get(busy.code).snapshot() == (0, {})
    with pytest.raises(cr.Refused, match="is not open"):
        a.get(idle.code)  # gone from the store, not only from b's view
    clock.t += cr.IDLE_SECONDS + 1
    a.open("t3")  # opening cleans up every idle class
    assert len(b) == 1
    monkeypatch.setattr(cr, "MAX_CLASSES", 3)
    codes = []
    for i in range(5):
        clock.t += 1
        codes.append(a.open(f"n{i}").code)
    assert len(a) == 3
    for code in codes[:2]:  # the oldest went first
        with pytest.raises(cr.Refused):
            b.get(code)
    assert all(b.get(code) for code in codes[2:])


def test_the_store_holds_digests_never_the_tokens_or_the_key(url):
    a = reg(url)
    lect, stud, new = cr.new_token(), cr.new_token(), cr.new_token()
    c = a.open(lect)
    key = c.key
    r = c.ask(lect, step=1, who="a", label="A", held=[1, 2], answer=[1], answer_step=1)
    c.vote(stud, r.number, 2)
    c.here(stud)
    dump = raw_dump(url)
    assert c.code in dump and cr.digest(lect) in dump and cr.digest(stud) in dump
    for secret in (lect, stud, key):
        assert secret not in dump
    c.take_back(key, new)
    dump = raw_dump(url)
    assert cr.digest(new) in dump and new not in dump and key not in dump
    assert a.get(c.code).key is None  # only the handle open() returned has it


def test_a_restarted_server_finds_every_class_question_and_vote(url):
    a = reg(url, ttl=cr.TTL_S)
    c = a.open("lect")
    c.publish("lect", {"step": "12", "view": "cache"})
    r = c.ask("lect", step=12, who="b", label="SnapKV", held=[3, 4, 9], answer=[9],
              answer_step=13)
    for i, p in enumerate((3, 9, 9)):
        c.vote(f"s{i}", r.number, p)
    key, code = c.key, c.code
    del a, c
    again = cr.Registry(url)  # a new process on the same store
    c = again.get(code)
    assert c.snapshot() == (1, {"step": "12", "view": "cache"})
    back = c.current_round()
    assert (back.number, back.held, back.answer, back.step, back.label) == (
        1, {3, 4, 9}, {9}, 12, "SnapKV")
    assert back.tally() == {3: 1, 9: 2} and back.mine("s0") == 3
    with pytest.raises(cr.Refused, match="already voted"):
        c.vote("s1", 1, 3)
    c.take_back(f"{key[:4]}-{key[4:]}".lower(), "tab2")  # as read off the page
    assert c.led_by("tab2") and not c.led_by("lect")
    assert c.publish("tab2", {"step": "13"}) == 2


def test_a_vote_cast_after_leaving_during_the_question_is_marked(url):
    a, b = reg(url), reg(url)
    c = a.open("lect")
    r = c.ask("lect", step=5, who="a", label="tova", held=[1, 2, 3], answer=[2], answer_step=5)
    s = b.get(c.code)  # the students' process
    early, back, gone, stayed = (f"student-{n}-" + "x" * 16 for n in range(4))
    s.vote(early, r.number, 1)
    s.left(early, r.number)  # voted, then left: their vote came before, not marked
    s.left(back, r.number)   # left, then voted: marked
    s.vote(back, r.number, 2)
    s.left(gone, r.number)   # left and never voted: no vote to mark
    s.vote(stayed, r.number, 2)
    for seen in (a.get(c.code).current_round(), reg(url).get(c.code).current_round()):
        assert seen.rejoined == {cr.digest(back)}  # (the second: a restarted server's)
        assert seen.rejoined_tally() == {2: 1} and seen.tally() == {1: 1, 2: 2}
    with pytest.raises(cr.Refused, match="already voted"):  # still one vote each
        s.vote(back, r.number, 3)
    assert not any(v in raw_dump(url) for v in (early, back, gone))  # digests only
    r2 = c.ask("lect", step=6, who="a", label="tova", held=[1, 2, 3], answer=[3],
               answer_step=6)
    s.vote(back, r2.number, 3)  # a new question: the last one's leavers are forgotten
    assert a.get(c.code).current_round().rejoined == frozenset()


def test_the_lecturer_key_is_checked_against_its_digest(url):
    c = reg(url).open("old")
    assert len(c.key) == 8 and set(c.key) <= set(cr.ALPHABET)
    for wrong in ("", c.code, c.key[:7], "A" * 8 if c.key != "A" * 8 else "B" * 8):
        with pytest.raises(cr.Refused, match=f"not class {c.code}'s lecturer key"):
            c.take_back(wrong, "new")
    assert c.led_by("old")
    other = reg(url).open("x")
    with pytest.raises(cr.Refused, match="lecturer key"):
        other.take_back(c.key, "new")  # one class's key opens no other


# --- concurrency --------------------------------------------------------------------------
def test_eight_threads_voting_count_each_vote_once(url):
    c = reg(url).open("l")
    r = c.ask("l", step=1, who="b", label="B", held=range(10), answer=[2], answer_step=1)
    ok, refused = [], []
    go = threading.Barrier(8)

    def press(i):
        mine = reg(url).get(c.code)  # each thread as its own process would
        go.wait()
        for v in range(i, 80, 8):
            for _ in range(3):  # every student presses three times: one vote counts
                try:
                    mine.vote(f"s{v}", r.number, v % 10)
                    ok.append(v)
                except cr.Refused:
                    refused.append(v)

    ts = [threading.Thread(target=press, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    got = c.current_round()
    assert sorted(ok) == list(range(80)) and len(refused) == 160
    assert len(got.votes) == 80 and got.right == 8 and c.poll() == (0, 81)


def _vote_from_process(url, code, number, voters, go, out):
    c = cr.Registry(url).get(code)
    go.wait()
    counted = 0
    for v in voters:
        for _ in range(2):
            try:
                c.vote(f"s{v}", number, v % 4)
                counted += 1
            except cr.Refused:
                pass
    out.put(counted)


def test_two_processes_voting_at_once_count_each_vote_once(url):
    c = reg(url).open("l")
    r = c.ask("l", step=1, who="a", label="A", held=range(4), answer=[0], answer_step=1)
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Barrier(2), ctx.Queue()
    voters = list(range(60))  # both processes try every voter, twice each
    procs = [ctx.Process(target=_vote_from_process, args=(url, c.code, r.number, voters, go,
                                                          out)) for _ in range(2)]
    [p.start() for p in procs]
    counted = [out.get(timeout=120) for _ in procs]
    [p.join(timeout=30) for p in procs]
    assert sum(counted) == 60
    got = c.current_round()
    assert len(got.votes) == 60 and got.tally() == {0: 15, 1: 15, 2: 15, 3: 15}


# --- choosing and opening the store ---------------------------------------------------------
@pytest.mark.parametrize("bad", ["sqlite://relative/classes.sqlite3", "sqlite:///tmp/dir/",
                                 "http://127.0.0.1:6379/0", "redis://", "redis://host/x",
                                 "classes.sqlite3"])
def test_a_bad_url_is_refused_naming_the_variable_and_the_forms(bad):
    with pytest.raises(ValueError) as e:
        st.open_store(bad)
    assert "KVVIZ_CLASSES" in str(e.value) and bad in str(e.value)
    assert "sqlite:///ABSOLUTE/PATH.sqlite3" in str(e.value) and "redis://HOST:PORT/DB" in str(e.value)


def test_the_default_store_is_a_private_file_in_the_state_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("KVVIZ_CLASSES")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    c = cr.Registry().open("l")
    path = tmp_path / "state" / "kvviz" / "classes.sqlite3"
    assert path.exists() and cr.Registry(f"sqlite://{path}").get(c.code)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert st.default_path() == tmp_path / "home" / ".local" / "state" / "kvviz" / "classes.sqlite3"


def test_a_file_of_another_schema_is_refused(tmp_path):
    old = tmp_path / "old.sqlite3"
    db = sqlite3.connect(old)
    db.execute("PRAGMA user_version = 7")
    db.execute("CREATE TABLE classes (code TEXT)")
    db.commit()
    db.close()
    with pytest.raises(ValueError, match=r"not a kvviz class store of schema 1 .its user_version is 7"):
        cr.Registry(f"sqlite://{old}").get("ABCDEF")
    other = tmp_path / "other.sqlite3"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE notes (x TEXT)")  # someone else's file
    db.commit()
    db.close()
    with pytest.raises(ValueError, match="user_version is 0"):
        cr.Registry(f"sqlite://{other}").open("l")


def test_an_unreachable_redis_is_one_sentence_at_first_use():
    with refused_port() as port:  # nothing listens there
        r = cr.Registry(f"redis://127.0.0.1:{port}/0")
        with pytest.raises(st.Unreachable) as e:
            r.open("l")
    msg = str(e.value)
    assert "cannot be reached" in msg and "KVVIZ_CLASSES" in msg and "\n" not in msg
    assert isinstance(e.value, cr.Refused)  # the page says it like any refusal


@pytest.mark.server
def test_redis_keys_expire_by_themselves(_redis):
    import redis

    redis.Redis.from_url(_redis).flushdb()
    c = reg(_redis).open("l")
    r = c.ask("l", step=1, who="a", label="A", held=[1, 2], answer=[1], answer_step=1)
    c.vote("s", r.number, 1)
    c.here("s")
    client = redis.Redis.from_url(_redis, decode_responses=True)
    keys = client.keys(f"kvviz:class:{c.code}*")
    assert len(keys) == 3
    assert all(0 < client.ttl(k) <= cr.IDLE_SECONDS for k in keys)
