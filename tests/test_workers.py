"""`kvviz app --workers N`: several Streamlit processes of the page behind one Caddy address.

The launcher's plan (the workers' commands, Caddy's configuration) and its refusals are
checked without starting anything. The rest starts `kvviz app --workers 2` and talks to it
through the proxy with protocol-level clients (scripts/stclient.py): a class whose students
sit on both workers, a worker killed in the middle of a question, a class of 30.

Which worker a client landed on is read from Caddy's sticky cookie: its value is the
HMAC-SHA256 of the worker's address under the secret in the run directory's Caddyfile.
The tests that need Caddy take the `caddy` fixture (the `server` tier): without Caddy they
fail when KVVIZ_REQUIRE_E2E=1 (CI, scripts/test.sh) and skip otherwise.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvviz.app import launch, workers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import loadtest  # noqa: E402
import stclient  # noqa: E402


def dry(capsys, *args) -> tuple[int, list[str], str]:
    rc = launch.main(["--dry-run", *args])
    got = capsys.readouterr()
    return rc, got.out.splitlines(), got.err


def the_plan(*extra, cold=False, env=None, n=3) -> workers.Plan:
    return workers.plan(n, list(extra), cold, Path("/run/here"), launch._flag,
                        {"PATH": "/bin", **(env or {})})


# --- the plan, started nowhere -------------------------------------------------------------
def test_the_caddyfile_sticks_by_cookie_checks_health_and_lists_every_worker():
    p = the_plan("--server.port", "8777", "--server.address=0.0.0.0", "--theme.base=dark")
    assert len(set(p.workers)) == 3 and 8777 not in p.workers
    lines = [ln.strip() for ln in p.config.splitlines()]
    assert "http://:8777 {" in lines and "bind 0.0.0.0" in lines
    proxy = next(ln for ln in lines if ln.startswith("reverse_proxy "))
    assert proxy.split()[1:-1] == [f"127.0.0.1:{port}" for port in p.workers]
    policy = next(ln for ln in lines if ln.startswith("lb_policy ")).split()
    assert policy[:3] == ["lb_policy", "cookie", workers.COOKIE] and len(policy[3]) >= 32
    for want in ("health_uri /_stcore/health", "admin off", "auto_https off", "max_fails 1"):
        assert want in lines, want
    assert any(ln.startswith("fail_duration ") for ln in lines)
    assert any(ln.startswith("lb_try_duration ") for ln in lines)
    # each worker: its own loopback port, the user's other flags, none of the proxy's
    for cmd, port in zip(p.worker_cmds, p.workers):
        assert cmd[1:4] == ["-m", "kvviz", "app"]
        assert f"--server.port={port}" in cmd and "--server.address=127.0.0.1" in cmd
        assert "--theme.base=dark" in cmd and "8777" not in cmd
        assert not any(a.startswith("--server.address=0") for a in cmd)
        assert "--cold" not in cmd
    assert all(a in the_plan(cold=True).worker_cmds[0] for a in ["--cold"])
    # one cookie secret and one class store for all, fresh per start unless the user gave one
    assert len(p.env["STREAMLIT_SERVER_COOKIE_SECRET"]) >= 32
    assert p.env["STREAMLIT_SERVER_COOKIE_SECRET"] != the_plan().env[
        "STREAMLIT_SERVER_COOKIE_SECRET"]
    assert p.env["KVVIZ_CLASSES"] == "sqlite:///run/here/classes.sqlite3"
    mine = the_plan(env={"KVVIZ_CLASSES": "redis://db:6379/0",
                         "STREAMLIT_SERVER_COOKIE_SECRET": "s" * 40})
    assert mine.env["KVVIZ_CLASSES"] == "redis://db:6379/0"
    assert mine.env["STREAMLIT_SERVER_COOKIE_SECRET"] == "s" * 40
    # the workers import this kvviz, wherever the launcher was started from
    assert p.env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


def test_by_default_the_proxy_serves_loopback_port_8501():
    p = the_plan(n=2)
    assert (p.address, p.port) == ("127.0.0.1", 8501)
    assert "bind 127.0.0.1" in p.config and "http://:8501 {" in p.config


def test_caddy_accepts_the_configuration(tmp_path, caddy):
    p = the_plan("--server.port=8777", "--server.address", "::")
    (tmp_path / "Caddyfile").write_text(p.config)
    r = subprocess.run([caddy, "adapt", "--adapter", "caddyfile", "--config",
                        str(tmp_path / "Caddyfile")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path),
                            "XDG_DATA_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    import json

    http = json.loads(r.stdout)["apps"]["http"]
    server = next(iter(http["servers"].values()))
    assert server["listen"] == ["[::]:8777"]
    proxy = server["routes"][0]["handle"][0]
    assert proxy["load_balancing"]["selection_policy"]["policy"] == "cookie"
    assert proxy["health_checks"]["active"]["uri"] == "/_stcore/health"
    assert [u["dial"] for u in proxy["upstreams"]] == [f"127.0.0.1:{w}" for w in p.workers]


def test_dry_run_prints_the_workers_caddy_and_its_configuration(capsys, caddy, monkeypatch):
    monkeypatch.delenv("KVVIZ_CLASSES", raising=False)  # then a store in the run directory
    rc, out, err = dry(capsys, "--workers", "2", "--server.port=8777")
    assert rc == 0, err
    starts = [ln for ln in out if " -m kvviz app " in ln]
    assert len(starts) == 2 and all(ln.startswith("KVVIZ_CLASSES=sqlite://$RUN/") for ln in starts)
    assert any(ln.endswith("run --adapter caddyfile --config $RUN/Caddyfile") for ln in out)
    config = "\n".join(out[out.index("--- $RUN/Caddyfile") + 1:])
    ports = [re.search(r"--server\.port=(\d+)", ln).group(1) for ln in starts]
    assert f"reverse_proxy 127.0.0.1:{ports[0]} 127.0.0.1:{ports[1]} {{" in config
    assert "STREAMLIT_SERVER_COOKIE_SECRET" not in "\n".join(out)  # the secret is not shown


def test_one_worker_is_the_plain_launcher(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no Caddy needed for one worker
    plain = dry(capsys)
    assert dry(capsys, "--workers", "1") == plain and plain[0] == 0
    assert plain[1][0].split()[1:4] == ["-m", "streamlit", "run"]


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", ""])
def test_workers_must_be_a_positive_integer(capsys, value):
    rc, out, err = dry(capsys, "--workers", value)
    assert rc == 2 and not out
    assert err.strip().splitlines() == [
        f"error: --workers must be a positive integer, got {value!r}"]


def test_several_workers_without_caddy_are_refused_before_anything_starts(capsys, monkeypatch,
                                                                          tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no caddy on it
    monkeypatch.setattr(workers, "new_run_dir", lambda: pytest.fail("a run directory was made"))
    for args in (["--dry-run"], []):
        rc = launch.main(["--workers", "2", *args])
        got = capsys.readouterr()
        assert rc == 2 and not got.out
        assert got.err.strip() == "error: --workers 2 needs Caddy: sudo apt-get install caddy"


def test_a_port_in_use_is_refused_before_anything_starts(capsys, monkeypatch, caddy):
    import socket

    monkeypatch.setattr(workers, "new_run_dir", lambda: pytest.fail("a run directory was made"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = launch.main(["--workers", "2", "--server.port", str(port)])
    got = capsys.readouterr()
    assert rc == 2 and not got.out
    assert got.err.strip() == (f"error: --server.port: cannot listen on 127.0.0.1:{port} "
                               "(Address already in use)")


def test_the_help_says_what_workers_does(capsys):
    assert launch.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "--workers N" in text and "apt-get install" in text and "KVVIZ_CLASSES" in text


def test_the_worker_flag_goes_through_the_kvviz_command():
    r = subprocess.run([sys.executable, "-m", "kvviz", "app", "--workers", "nope", "--dry-run"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: --workers must be a positive integer, got 'nope'"


# --- helpers for the live tests --------------------------------------------------------------
def worker_of(cookie: str, secret: str, ports: list[int]) -> int | None:
    """The worker port Caddy's sticky cookie names (None: none of them)."""
    for port in ports:
        if hmac.new(secret.encode(), f"127.0.0.1:{port}".encode(),
                    hashlib.sha256).hexdigest() == cookie:
            return port
    return None


def alive(pid: int) -> bool:
    """The process is there and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launched(log: Path, timeout: float = 60) -> tuple[str, dict[int, tuple[int, int]]]:
    """From the launcher's output, once it said the address (every worker and the proxy
    healthy): Caddy's cookie secret (from the run directory's Caddyfile) and {worker number:
    (port, pid)}."""
    deadline = time.monotonic() + timeout
    while "workers behind http://" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    text = log.read_text()
    run_dir = Path(re.search(r"run directory (\S+)", text)[1])
    secret = re.search(r"lb_policy cookie \S+ (\S+)", (run_dir / "Caddyfile").read_text())[1]
    found = {int(n): (int(port), int(pid)) for n, port, pid in
             re.findall(r"worker (\d+) on 127\.0\.0\.1:(\d+) \(pid (\d+)\)", text)}
    return secret, found


def test_a_class_on_two_workers_follows_and_counts_votes_across_them(server, caddy, tmp_path):
    """`kvviz app --workers 2`: a lecturer and 10 students through the proxy land on both
    workers; every student, those on the other worker than the lecturer's included, follows
    the lecturer's moves, and every vote reaches the lecturer's histogram."""
    log = tmp_path / "launcher.log"
    with open(log, "wb") as out, stclient.Server(REPO, server.port(), launcher="kvviz",
                                                 workers=2, log=out) as srv:
        secret, found = launched(log)
        ports = [port for port, _ in found.values()]
        r = asyncio.run(loadtest.class_session(srv.url, 10, moves=2, vote_spread=1.0,
                                               join_spread=1.0, gap=0.5, timeout=90, wait=60))
        children = srv.children()  # the workers and Caddy
    assert len(ports) == 2 and len(children) == 3, children
    assert not [pid for pid in children if alive(pid)], "the launcher left processes behind"
    where = {name: worker_of(c.get(workers.COOKIE, ""), secret, ports)
             for name, c in r["cookies"].items()}
    assert None not in where.values(), r["cookies"]  # each page holds a worker's cookie
    others = [name for name, port in where.items() if port != where["lecturer"]]
    assert set(where.values()) == set(ports) and others, where
    assert not r["errors"], r["errors"][:5]
    assert not r["problems"], r["problems"][:5]  # every student followed, on either worker
    assert len(r["follow_s"]) == 10 * 2, r["follow_s"]
    assert r["votes"] == {"sent": 10, "accepted": 10, "shown": 10}, r["votes"]


KEY_RX = re.compile(rb"lecturer key: `(\w{4})-(\w{4})`")
TAKE = ("class.take.code", "class.take.key", "class.take")


def key_of(lec) -> str | None:
    return next((m[1].decode() + m[2].decode() for x in lec.texts
                 for m in [KEY_RX.search(x.encode())] if m), None)


def test_a_worker_killed_in_the_middle_of_a_question(server, caddy, tmp_path):
    """The lecturer asks, some students vote, and the lecturer's worker (holding some students
    too) is killed: its pages reconnect through the proxy to the live worker, as the frontend
    does; the lecturer's new session takes the class back with its key, the question still
    open and no vote lost; the rest vote, all are counted; a move after the question reaches
    every student; the launcher restarts the killed worker."""
    log = tmp_path / "launcher.log"
    with open(log, "wb") as out, stclient.Server(REPO, server.port(), launcher="kvviz",
                                                 workers=2, log=out) as srv:
        secret, found = launched(log)
        killed = asyncio.run(_kill_in_a_question(srv.url, secret, found))
        number, (port, _) = next((n, w) for n, w in found.items() if w[1] == killed)
        deadline = time.monotonic() + 300  # restarted, it draws the page again, then listens
        while not workers.healthy(f"http://127.0.0.1:{port}"):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(1)
        text = log.read_text()
    assert f"worker {number} (port {port}) exited with signal 9; restarting it in" in text, text
    assert re.search(rf"worker {number} restarted \(pid \d+\)", text), text


async def _kill_in_a_question(url: str, secret: str, found: dict) -> int:
    """The class, the question, the kill (the test's docstring); the killed worker's pid."""
    ports = [port for port, _ in found.values()]
    pid_of = {port: pid for port, pid in found.values()}
    lec = stclient.LiveSession(url, loadtest.QUERY, 90, name="lecturer")
    lec.watch = (loadtest.CODE_RX, loadtest.VOTES_RX, KEY_RX)
    students: list = []
    wait = 90

    def where(s):
        return worker_of(s.cookies.get(workers.COOKIE, ""), secret, ports)

    async def join(n):
        new = [stclient.LiveSession(url, f"follow={code}", 90, name=f"student{len(students) + i}")
               for i in range(n)]
        students.extend(new)
        await asyncio.gather(*(s.start() for s in new))
        got = await asyncio.gather(*(loadtest._arrive(s, 0, here, wait) for s in new))
        assert all(got), [s.diag() for s, x in zip(new, got) if x is None]

    try:
        await lec.start()
        await lec.wait_for(lambda: lec.full_runs_done())
        await lec.act(loadtest.OPEN)
        code = await lec.wait_for(lambda: loadtest.code_of(lec))
        key = await lec.wait_for(lambda: key_of(lec))
        here = loadtest.step_of(lec.query)
        await join(6)
        dead = where(lec)
        while not ({where(s) for s in students} >= set(ports)) and len(students) < 30:
            await join(1)  # a late student, until both workers hold some (the proxy chooses)
        doomed = [s for s in students if where(s) == dead]
        kept = [s for s in students if where(s) != dead]
        assert doomed and kept, {s.name: where(s) for s in students}

        held = loadtest.held_positions(lec.query)
        t_ask = await lec.act(loadtest.ASK)
        seen = await asyncio.gather(*(loadtest._shows(s, t_ask, wait) for s in students))
        assert all(seen), [s.diag(6) for s, ok in zip(students, seen) if not ok]
        early = doomed[:(len(doomed) + 1) // 2] + kept[:(len(kept) + 1) // 2]
        sent = await asyncio.gather(*(loadtest._vote(s, 0, held[i % len(held)], wait)
                                      for i, s in enumerate(early)))
        assert all(acc is not None for _, acc in sent)
        await lec.wait_for(lambda: max(loadtest.votes_shown(lec), default=0) >= len(early), wait)

        # the lecturer's worker dies, with some students on it
        t_kill = time.perf_counter()
        os.kill(pid_of[dead], signal.SIGKILL)
        victims = [lec, *doomed]
        await asyncio.gather(*(s.wait_for(lambda s=s: any(t >= t_kill and "disconnected" in e
                                                          for t, e in s.errors), 30)
                               for s in victims))
        # each reconnects, as the frontend does: a new websocket through the proxy
        t_back = time.perf_counter()
        await asyncio.gather(*(s.reconnect() for s in victims))
        moved = {s.name: where(s) for s in victims}
        assert set(moved.values()) == {p for p in ports if p != dead}, moved
        # the students on it are in the class again, the question (still open) on their pages
        back = await asyncio.gather(*(loadtest._shows(s, t_back, wait) for s in doomed))
        assert all(back), [s.diag(6) for s, ok in zip(doomed, back) if not ok]
        # the lecturer's new session takes the class back with the key
        await lec.wait_for(lambda: lec.full_runs_done(t_back) and TAKE[0] in lec.keys
                           and lec.seen[TAKE[0]] > t_back, wait)
        lec.texts.clear()  # what the histogram says from now on
        t_take = await lec.act((TAKE[0], code), (TAKE[1], key), TAKE[2])
        await lec.wait_for(lambda: lec.full_runs_done(t_take), wait)
        await lec.wait_for(lambda: lec.seen.get(loadtest.REVEAL, 0) > t_take, wait)
        await lec.wait_for(lambda: max(loadtest.votes_shown(lec), default=0) >= len(early), wait)
        # the rest vote, on either worker: every vote is counted
        late = [s for s in students if s not in early]
        sent = await asyncio.gather(*(loadtest._vote(s, 0, held[i % len(held)], wait)
                                      for i, s in enumerate(late)))
        assert all(acc is not None for _, acc in sent)
        await lec.wait_for(lambda: max(loadtest.votes_shown(lec), default=0) >= len(students),
                           wait)
        assert max(loadtest.votes_shown(lec)) == len(students), loadtest.votes_shown(lec)
        # reveal, close, move: the move reaches every student, those that reconnected too
        for button in (loadtest.REVEAL, loadtest.CLOSE):
            t = await lec.act(button)
            await lec.wait_for(lambda t=t: lec.full_runs_done(t), wait)
        target = loadtest.step_of(lec.query) + 1  # (the question held the page at its step)
        t = await lec.act(loadtest.NEXT)
        got = await asyncio.gather(*(loadtest._arrive(s, t, target, wait)
                                     for s in [lec, *students]))
        late_ones = [s.diag() for s, x in zip([lec, *students], got) if x is None]
        assert not late_ones, f"not at step {target}: " + "\n".join(late_ones)
    finally:
        await asyncio.gather(*(s.close() for s in [lec, *students]), return_exceptions=True)
    # nothing went wrong but the lost connections of the killed worker's pages
    errors = [(s.name, e) for s in [lec, *students] for t, e in s.errors
              if not (s in victims and t_kill <= t < t_back)]
    assert not errors, errors[:5]
    return pid_of[dead]


def test_a_class_of_30_on_two_workers(server, caddy):
    """scripts/loadtest.py --class 30 --workers 2: no error, every vote counted."""
    r = loadtest.run_class(30, timeout=120, settle=0, workers=2, wait=120)
    assert r["workers"] == 2 and r["server_cpu_s"] > 0
    assert not r["errors"], r["errors"][:5]
    assert not r["problems"], r["problems"][:5]
    assert r["votes"] == {"sent": 30, "accepted": 30, "shown": 30}, r["votes"]
