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

import hashlib
import hmac
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvviz.app import launch, workers

REPO = Path(__file__).resolve().parents[1]


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
def worker_of(cookie: str, run_dir: Path, ports: list[int]) -> int | None:
    """The worker port Caddy's sticky cookie names (None: none of them)."""
    secret = re.search(r"lb_policy cookie \S+ (\S+)", (run_dir / "Caddyfile").read_text())[1]
    for port in ports:
        if hmac.new(secret.encode(), f"127.0.0.1:{port}".encode(),
                    hashlib.sha256).hexdigest() == cookie:
            return port
    return None
