"""`kvviz app --workers N`: N Streamlit processes of the page behind one address.

Each worker is `kvviz app` itself (the same SETTINGS, drawn once before it listens) on a free
loopback port; all share one `server.cookieSecret` (fresh per start, given by
$STREAMLIT_SERVER_COOKIE_SECRET: Streamlit refuses it as a flag) and one class store ($KVVIZ_CLASSES: the
user's, else a SQLite file in a private run directory made here), so a session that moves
to another worker keeps working. In front of them, Caddy on the address the user asked for.

Why Caddy and not nginx: Caddy's `lb_policy cookie` keeps a browser on the worker that holds
its session, by a cookie it sets itself. Open-source nginx can only stick by client address
(ip_hash, hash), and a lecture hall behind one NAT would all land on one worker. Caddy also
proxies websockets as they are, checks each worker's /_stcore/health, and sends a session
whose worker died to a live one (`fail_duration`, `lb_try_duration`).

The launcher supervises: it prints the address once every worker and the proxy answer their
health checks, restarts a worker (or the proxy) that exits, and on Ctrl-C / SIGTERM stops
them all, each in its own process group.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

COOKIE = "kvviz_worker"  # Caddy's sticky-session cookie
HEALTH = "/_stcore/health"


def free_port(host: str = "127.0.0.1") -> int:
    """A port the operating system chose (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def caddyfile(address: str, port: int, workers: list[int], cookie_secret: str) -> str:
    """The proxy's configuration: `address:port` in front of the workers' loopback ports."""
    bind = f"[{address}]" if ":" in address else address
    upstreams = " ".join(f"127.0.0.1:{p}" for p in workers)
    return f"""\
# Written by `kvviz app --workers {len(workers)}`: Caddy in front of the workers.
{{
	admin off
	auto_https off
	grace_period 2s
	log {{
		level ERROR
	}}
}}

http://:{port} {{
	bind {bind}
	reverse_proxy {upstreams} {{
		# sticky sessions: the cookie names the worker that holds the browser's session
		lb_policy cookie {COOKIE} {cookie_secret}
		# passive: a worker that refuses a connection is left out for 10 s and the request
		# tried on another for up to 5 s (a student whose worker died lands on a live one)
		fail_duration 10s
		max_fails 1
		lb_try_duration 5s
		lb_try_interval 250ms
		# active: a worker is sent nobody until it answers its health check
		health_uri {HEALTH}
		health_interval 2s
		health_timeout 5s
	}}
}}
"""


@dataclass
class Plan:
    """What `kvviz app --workers N` starts: the commands, the proxy's config, the run dir."""
    workers: list[int]                 # each worker's loopback port
    address: str
    port: int
    worker_cmds: list[list[str]]
    caddy_cmd: list[str]
    config: str
    env: dict = field(default_factory=dict)   # every worker's environment
    run_dir: Path | None = None


def plan(n: int, extra: list[str], cold: bool, run_dir: Path, flag, base: dict) -> Plan:
    """The workers' and the proxy's commands for `kvviz app --workers n EXTRA`. `flag(extra,
    name)` reads a Streamlit flag's value; the address and port are the proxy's, every other
    flag goes to each worker. `base`: the launcher's environment, which the workers get."""
    address = flag(extra, "server.address") or "127.0.0.1"
    port = int(flag(extra, "server.port") or 8501)
    ports = [free_port() for _ in range(n)]
    own = ("server.address", "server.port")
    rest, skip = [], False
    for a in extra:  # drop `--NAME V` / `--NAME=V` for the flags set per worker
        if skip:
            skip = False
        elif a.startswith("--") and a[2:].split("=", 1)[0] in own:
            skip = "=" not in a
        else:
            rest.append(a)
    env = {**base, "KVVIZ_CLASSES": base.get("KVVIZ_CLASSES")
           or f"sqlite://{run_dir / 'classes.sqlite3'}",
           # one secret signs the cookies of every worker (Streamlit takes it only this way)
           "STREAMLIT_SERVER_COOKIE_SECRET": base.get("STREAMLIT_SERVER_COOKIE_SECRET")
           or secrets.token_hex(32),
           # the workers run this kvviz, wherever they are started from
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                          *filter(None, [base.get("PYTHONPATH")])])}
    cmds = [[sys.executable, "-m", "kvviz", "app", *(["--cold"] if cold else []),
             f"--server.port={p}", "--server.address=127.0.0.1", *rest] for p in ports]
    caddy = [shutil.which("caddy") or "caddy", "run", "--adapter", "caddyfile",
             "--config", str(run_dir / "Caddyfile")]
    config = caddyfile(address, port, ports, secrets.token_hex(16))  # Caddy's own secret
    return Plan(ports, address, port, cmds, caddy, config, env, run_dir)


def port_taken(address: str, port: int) -> str | None:
    """Why Caddy could not listen on address:port (in use, or not this machine's), or None."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Caddy binds
        try:
            s.bind((address, port))
        except OSError as exc:
            return f"cannot listen on {address}:{port} ({exc.strerror or exc})"
    return None


def refusal(n: int) -> str | None:
    """Why `--workers n` cannot start here, in one line; None when it can."""
    if n > 1 and shutil.which("caddy") is None:
        return f"--workers {n} needs Caddy: sudo apt-get install caddy"
    return None


# --- running it -------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the launcher dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Child:
    """A supervised process in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, port: int):
        self.name, self.cmd, self.env, self.log, self.port = name, cmd, env, log, port
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.delay = 0.5          # half the back-off before the next restart
        self.restart_at: float | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        self.started = time.monotonic()

    def signal(self, sig: int) -> None:
        """`sig` to the child's process group (itself and anything it started)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def stop_all(children: list[Child], grace: float = 10.0) -> None:
    """SIGTERM to every child's group at once; SIGKILL to those still there after `grace` s."""
    for c in children:
        if c.proc is not None and c.proc.poll() is None:
            c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.signal(signal.SIGKILL)
            c.proc.wait(5)

    def last_line(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + HEALTH, timeout=2) as r:
            return r.read().strip() == b"ok"
    except OSError:
        return False


def _exit_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run(p: Plan, say, ready_timeout: float = 900.0) -> int:
    """Start the workers, then the proxy once they are healthy; say the address; supervise
    until Ctrl-C or SIGTERM; stop everything. `say(line)` prints the address lines."""
    p.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (p.run_dir / "Caddyfile").write_text(p.config)
    caddy_env = {**os.environ, "XDG_CONFIG_HOME": str(p.run_dir), "XDG_DATA_HOME": str(p.run_dir)}
    workers = [Child(f"worker {i + 1}", cmd, p.env, p.run_dir / f"worker-{i + 1}.log", port)
               for i, (cmd, port) in enumerate(zip(p.worker_cmds, p.workers))]
    proxy = Child("Caddy", p.caddy_cmd, caddy_env, p.run_dir / "caddy.log", p.port)
    children = [*workers, proxy]
    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for w in workers:
            w.start()
        warm = ("cold" if "--cold" in p.worker_cmds[0] else
                "each draws the default page before it listens")
        print(f"kvviz: starting {len(workers)} workers ({warm}); run directory {p.run_dir}",
              flush=True)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(p.address, p.address)
        proxy_url = f"http://{f'[{host}]' if ':' in host else host}:{p.port}"
        deadline = time.monotonic() + ready_timeout
        waiting = list(workers)
        while waiting or not healthy(proxy_url):
            for c in children:
                if c.proc is not None and c.proc.poll() is not None:
                    print(f"kvviz: {c.name} exited with {_exit_text(c.proc.returncode)} while "
                          f"starting: {c.last_line()} (log: {c.log})", file=sys.stderr)
                    return 1
            waiting = [w for w in waiting if not healthy(f"http://127.0.0.1:{w.port}")]
            if not waiting and proxy.proc is None:
                proxy.start()
            if time.monotonic() > deadline:
                print(f"kvviz: not ready after {ready_timeout:.0f} s "
                      f"({', '.join(w.name for w in waiting) or 'Caddy'} not answering)",
                      file=sys.stderr)
                return 1
            time.sleep(0.3)
        for w in workers:
            print(f"kvviz: {w.name} on 127.0.0.1:{w.port} (pid {w.proc.pid})", flush=True)
        say(f"kvviz: {len(workers)} workers behind {proxy_url.replace('127.0.0.1', 'localhost')}"
            " (Caddy; sticky sessions by cookie)")
        _supervise(children)
    except KeyboardInterrupt:
        print("kvviz: stopping the workers and Caddy", file=sys.stderr, flush=True)
        return 0
    finally:
        stop_all(children)
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def _supervise(children: list[Child]) -> None:
    """Restart any child that exits, after a back-off that doubles (up to 30 s) while it keeps
    exiting within 30 s of its start."""
    while True:
        now = time.monotonic()
        for c in children:
            if c.restart_at is None and c.proc.poll() is not None:
                c.delay = min(c.delay * 2, 30.0) if now - c.started < 30 else 1.0
                print(f"kvviz: {c.name} (port {c.port}) exited with "
                      f"{_exit_text(c.proc.returncode)}; restarting it in {c.delay:.0f} s",
                      file=sys.stderr, flush=True)
                c.restart_at = now + c.delay
            elif c.restart_at is not None and now >= c.restart_at:
                c.restart_at = None
                c.start()
                print(f"kvviz: {c.name} restarted (pid {c.proc.pid})", file=sys.stderr,
                      flush=True)
        time.sleep(0.3)


def new_run_dir() -> Path:
    """A private directory (mode 700) for the Caddyfile, the logs and the class store."""
    return Path(tempfile.mkdtemp(prefix="kvviz-app-"))
