"""scripts/apt_deps.sh (test.sh's apt step) installs what is missing of chromium, caddy and
redis-server, and waits out a held apt lock instead of failing.

A fake apt-get behaves as apt does when it cannot wait: it fails at once with apt's own
message while another process holds its lock. The test holds that lock with `flock` until
apt has met it, then frees it, and checks the script said it was waiting and installed only
once the lock was free.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "apt_deps.sh"

FAKE_APT = """#!/usr/bin/env bash
# like apt-get without a lock timeout: fail at once while the lock is held
if ! flock -n "$FAKE_LOCK" true; then
  echo "E: Could not get lock $FAKE_LOCK. It is held by process 1 (apt-get)" >&2
  echo "$(date +%s.%N) locked $*" >> "$FAKE_LOG"; exit 100
fi
if [ -n "${FAKE_FAIL:-}" ]; then
  echo "E: Unable to locate package chromium" >&2; echo "$(date +%s.%N) fail $*" >> "$FAKE_LOG"
  exit 100
fi
echo "$(date +%s.%N) ok $*" >> "$FAKE_LOG"
"""


@pytest.fixture
def fake(tmp_path):
    apt = tmp_path / "apt-get"
    apt.write_text(FAKE_APT)
    apt.chmod(0o755)
    lock, log = tmp_path / "lock-frontend", tmp_path / "apt.log"
    lock.touch()
    env = {**os.environ, "KVVIZ_CHROMIUM": str(tmp_path / "no-chromium"),
           "KVVIZ_CADDY": str(tmp_path / "no-caddy"), "KVVIZ_REDIS": str(tmp_path / "no-redis"),
           "KVVIZ_APT": str(apt),
           "KVVIZ_APT_LOCKS": str(lock), "FAKE_LOCK": str(lock), "FAKE_LOG": str(log)}
    return env, lock, log


def calls(log: Path) -> list[tuple[float, str, str]]:
    if not log.exists():
        return []
    return [(float(t), kind, args) for t, kind, args in
            (line.split(" ", 2) for line in log.read_text().splitlines())]


def hold(lock: Path) -> subprocess.Popen:
    """A process holding `lock` until its standard input is closed (or it is killed)."""
    holder = subprocess.Popen(["flock", str(lock), "cat"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL)
    for _ in range(500):  # until the holder has the lock
        if subprocess.run(["flock", "-n", str(lock), "true"]).returncode:
            return holder
        time.sleep(0.02)
    raise AssertionError("the holder never took the lock")


def run(env, timeout=60):
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_waits_for_a_held_lock_then_installs(fake, long_run):
    env, lock, log = fake
    holder = hold(lock)
    script = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(k == "locked" for _, k, _ in calls(log)):  # apt met the lock: release it
            assert script.poll() is None and time.monotonic() < deadline, script.communicate()
            time.sleep(0.02)
    finally:
        released = time.time()
        holder.stdin.close()
        holder.wait(10)
    out, err = script.communicate(timeout=60)
    assert script.returncode == 0, out + err
    assert "waiting" in out and str(lock) in out
    got = calls(log)
    ok = [(t, a) for t, k, a in got if k == "ok"]
    assert [a.split()[2] for _, a in ok] == ["update", "install"]  # it went on after the lock
    assert ok[1][1].split()[-3:] == ["chromium", "caddy", "redis-server"]
    assert all(t >= released for t, _ in ok)
    assert all("DPkg::Lock::Timeout=600" in a for _, _, a in got)


def test_gives_up_after_its_timeout(fake, long_run):
    env, lock, log = fake
    holder = hold(lock)
    try:
        r = run({**env, "KVVIZ_APT_LOCK_TIMEOUT": "1"})
    finally:
        holder.kill()
        holder.wait(10)
    assert r.returncode == 100
    assert "still held after 1 s" in r.stderr
    assert {k for _, k, _ in calls(log)} == {"locked"}


def test_other_failures_are_not_retried(fake):
    env, _, log = fake
    r = run({**env, "FAKE_FAIL": "1"})
    assert r.returncode == 100
    assert "Unable to locate package" in r.stdout  # apt's output is shown
    assert len(calls(log)) == 1


def _program(path: Path) -> str:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_nothing_to_do_when_all_are_there(fake, tmp_path):
    env, _, log = fake
    r = run({**env, "KVVIZ_CHROMIUM": _program(tmp_path / "chromium"),
             "KVVIZ_CADDY": _program(tmp_path / "caddy"),
             "KVVIZ_REDIS": _program(tmp_path / "redis-server")})
    assert r.returncode == 0 and calls(log) == []


@pytest.mark.parametrize("present,installed", [
    (("chromium",), ["caddy", "redis-server"]),
    (("chromium", "redis-server"), ["caddy"]),
    (("caddy", "redis-server"), ["chromium"]),
])
def test_only_what_is_missing_is_installed(fake, tmp_path, present, installed):
    env, _, log = fake
    names = {"chromium": "KVVIZ_CHROMIUM", "caddy": "KVVIZ_CADDY", "redis-server": "KVVIZ_REDIS"}
    r = run({**env, **{names[p]: _program(tmp_path / p) for p in present}})
    assert r.returncode == 0, r.stdout + r.stderr
    ok = [a.split() for _, k, a in calls(log) if k == "ok"]
    assert [a[2] for a in ok] == ["update", "install"]
    assert ok[1][ok[1].index("-qq") + 1:] == installed
