"""`kvviz app`: start the explorer with the offline settings, from a checkout or an install.

Which page and traces it serves is kvviz.core.paths' rule (the current directory's traces/
first when it is a kvviz checkout). SETTINGS below are passed as flags so they hold from any
working directory (an install has no .streamlit/); flags given after `kvviz app` override
them. SETTINGS is the one list: the checkout's .streamlit/config.toml (what `streamlit run
app.py` reads there) must say the same, which tests/test_launch.py checks.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
from pathlib import Path

from kvviz.core.paths import app_file, lessons_dir, loop_dir, traces_dir
from kvviz.core.plugins import add_argument as plugin_arg

# Offline and local-only: no telemetry, no external IP lookup, bound to 127.0.0.1.
SETTINGS = {
    "browser.gatherUsageStats": "false",
    "browser.serverAddress": "localhost",
    "server.headless": "true",
    "server.address": "127.0.0.1",
    "server.fileWatcherType": "none",
    "server.runOnSave": "false",
    "server.maxUploadSize": "64",
    "client.toolbarMode": "minimal",
    "theme.base": "light",
    # Streamlit's default ends every script run with a full gc.collect(): 0.15-0.2 s of CPU per
    # page load here, holding the GIL, so a class's sessions queue behind it (scripts/loadtest.py)
    "runner.postScriptGC": "false",
    "runner.magicEnabled": "false",  # unused; Streamlit recompiles app.py per new session
}


HELP = """usage: kvviz app [--dry-run] [--cold] [--workers N]
                 [streamlit flags, e.g. --server.port 8502 --server.address 0.0.0.0]

Starts the explorer on http://localhost:8501 (offline: no telemetry, bound to 127.0.0.1).
Before it listens it draws the default page once, so a class arriving together finds the
replays done. --cold starts without that. --dry-run prints the command, the traces folder
and (bound to 0.0.0.0) the addresses to give a class, instead of starting.

--workers N (N > 1) starts N server processes on free loopback ports, each drawing the
default page before it listens (with --cold: none does), and Caddy (`sudo apt-get install
caddy`) on the address and port asked for, keeping each browser on its worker by a cookie
and sending it to a live one if its worker dies; a worker that exits is restarted. The
workers share one class store: $KVVIZ_CLASSES (sqlite:///ABS/PATH.sqlite3 or
redis://HOST:PORT/DB) if set, else a SQLite file in a private run directory. --dry-run
prints the workers' and Caddy's commands and Caddy's configuration.

Traces: $KVVIZ_TRACES_DIR if set; else ./traces when the current directory is a kvviz
checkout (a trace captured there shows up even with an installed kvviz); else the ones this
kvviz ships. The page is always this kvviz's own."""


# the query key an unknown path is redirected with (`/nope/deeper` -> `/?notfound=/nope/deeper`);
# the page answers it with its not-found message (kvviz.app.ui.notfound)
NOT_FOUND_KEY = "notfound"


def not_found_redirects() -> None:
    """Make the server about to start send an unknown path to the page's not-found message.

    Streamlit answers any path it has no file for with its index page, whose scripts load by
    relative address: under `/nope/deeper` they resolve to `/nope/static/...`, which is the
    index page again, so the browser runs nothing and shows a blank page. Here that fallback
    becomes a redirect to the app's root with the path in NOT_FOUND_KEY (GET and HEAD; the
    index page itself, real files and Streamlit's own routes are unchanged)."""
    from urllib.parse import quote

    from starlette.responses import FileResponse, RedirectResponse
    from streamlit.web.server.starlette import starlette_static_routes as routes

    make = routes.create_streamlit_static_handler
    if getattr(make, "kvviz_not_found", False):
        return

    def create(directory, base_url):
        handler = make(directory, base_url)
        index = getattr(handler, "_index_path", None)
        served = handler.get_response

        async def get_response(path, scope):
            response = await served(path, scope)
            rel = path.replace("\\", "/").strip("/.")
            if (index is not None and isinstance(response, FileResponse)
                    and response.path == index and rel not in ("", "index.html")
                    and scope.get("method") in ("GET", "HEAD")):
                root = scope.get("root_path", "") + "/" + (base_url or "").strip("/")
                asked = scope.get("path", "/" + rel)
                return RedirectResponse(
                    f"{root.rstrip('/')}/?{NOT_FOUND_KEY}={quote(asked, safe='/')}",
                    status_code=302, headers={"Cache-Control": "no-cache"})
            return response

        handler.get_response = get_response
        return handler

    create.kvviz_not_found = True
    routes.create_streamlit_static_handler = create


def _flag(extra: list[str], name: str) -> str | None:
    """The value of --name=V or --name V among `extra`, the last one given."""
    value = None
    for i, a in enumerate(extra):
        if a.startswith(f"--{name}="):
            value = a.split("=", 1)[1]
        elif a == f"--{name}" and i + 1 < len(extra):
            value = extra[i + 1]
    return value


def lan_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback, read from its interfaces (no
    packet is sent); the host name's addresses where interfaces cannot be read."""
    found = set()
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                except OSError:
                    continue
                found.add(socket.inet_ntoa(raw[20:24]))
    except (ImportError, OSError, AttributeError):
        pass
    if not found:
        try:
            found = {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
        except OSError:
            pass
    return sorted(ip for ip in found if not ip.startswith("127."))


def class_urls(extra: list[str]) -> list[str] | None:
    """When bound to all interfaces, the URLs a class can open; None otherwise."""
    if _flag(extra, "server.address") not in ("0.0.0.0", "::"):
        return None
    port = _flag(extra, "server.port") or "8501"
    return [f"http://{ip}:{port}" for ip in lan_addresses()]


def command(extra: list[str]) -> list[str]:
    """`python -m streamlit run APP` with SETTINGS, minus any the user sets in `extra`."""
    given = {a[2:].split("=", 1)[0] for a in extra if a.startswith("--")}
    flags = [f"--{k}={v}" for k, v in SETTINGS.items() if k not in given]
    return [sys.executable, "-m", "streamlit", "run", str(app_file()), *flags, *extra]


def parser(sub=None) -> argparse.ArgumentParser:
    """`kvviz app`'s own flags; every other flag is Streamlit's, collected by parse_known_args
    into `args.extra` (allow_abbrev=False: no Streamlit flag is taken for a prefix of ours)."""
    kw = dict(prog="kvviz app", add_help=False, allow_abbrev=False)
    p = (sub.add_parser("app", help="start the explorer (streamlit) on http://localhost:8501 "
                        "(--plugin PATH.py|MODULE, repeatable, loads policies into it)", **kw)
         if sub is not None else argparse.ArgumentParser(**kw))
    p.add_argument("-h", "--help", action="store_true")  # prints HELP, which names Streamlit's flags
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--cold", action="store_true")
    p.add_argument("--workers", default="1")  # checked in run(): a one-line refusal
    plugin_arg(p)
    p.set_defaults(func=run, parser=p, extra=[], passes_unknown=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args, extra = parser().parse_known_args(argv)
    args.extra = extra
    return run(args)


def run(args) -> int:
    if args.help:
        print(HELP)
        return 0
    if args.plugin:  # checked here, then handed to the page (and what it starts) by $KVVIZ_PLUGINS
        from kvviz.core import plugins
        if plugins.cli_load(args.plugin, "kvviz app"):
            return 2
        given = [plugins.absolute(s) for s in args.plugin]
        os.environ[plugins.ENV] = os.pathsep.join(plugins.env_specs() + given)
    dry, cold, extra = args.dry_run, args.cold, list(args.extra)
    workers = int(args.workers) if args.workers.isdigit() else 0
    if workers < 1:
        print(f"error: --workers must be a positive integer, got {args.workers!r}",
              file=sys.stderr)
        return 2
    try:
        cmd = command(extra)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    traces, loop = traces_dir(), loop_dir()
    if traces is not None:
        env["KVVIZ_TRACES_DIR"] = str(traces)
    if loop is not None:
        env["KVVIZ_LOOP_DIR"] = str(loop)
    lessons = lessons_dir()  # found once here, not on every page run
    if lessons is not None:
        env["KVVIZ_LESSONS_DIR"] = str(lessons)
    urls = class_urls(extra)
    if urls is not None:
        urls_line = ("class URLs: " + " ".join(urls) if urls else
                     "class URLs: none found (no network address other than loopback)")
    if workers > 1:
        return _run_workers(workers, cold, dry, extra, env, traces, loop,
                            urls_line if urls is not None else None)
    if dry:
        print(" ".join(cmd))
        print(f"traces: {traces}")
        print(f"loop results: {loop}")
        if urls is not None:
            print(urls_line)
        return 0
    if urls is not None:
        print(f"kvviz: bound to all interfaces; {urls_line}", flush=True)
    os.environ.update(env)
    if not cold:
        from kvviz.app.ui.warm import warm

        print("kvviz: drawing the default page and Compare all once before serving…",
              flush=True)
        try:
            print(f"kvviz: warm in {warm(app_file()):.1f} s", flush=True)
        except Exception as exc:  # serve anyway: the page shows its own errors
            print(f"kvviz: warming failed ({exc}); starting cold", file=sys.stderr, flush=True)
    from streamlit.web import cli  # the server runs in this process: one pid to stop

    not_found_redirects()

    # Warming parsed the config files once; the flags below change [server], which Streamlit
    # reports as needing a restart. The server has not started, so the flags do apply.
    logging.getLogger("streamlit.config").addFilter(
        lambda rec: "config option section was detected" not in rec.getMessage())

    return cli.main(args=cmd[3:], prog_name="streamlit", standalone_mode=False) or 0


def _run_workers(n, cold, dry, extra, env, traces, loop, urls_line) -> int:
    """`--workers n`: the plan printed (--dry-run) or started and supervised (workers.py)."""
    from kvviz.app import workers

    why = workers.refusal(n)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if not (_flag(extra, "server.port") or "8501").isdigit():
        print(f"error: --server.port must be a port number, got {_flag(extra, 'server.port')!r}",
              file=sys.stderr)
        return 2
    address = _flag(extra, "server.address") or "127.0.0.1"
    taken = None if dry else workers.port_taken(address, int(_flag(extra, "server.port") or 8501))
    if taken:
        print(f"error: --server.port: {taken}", file=sys.stderr)
        return 2
    run_dir = Path("$RUN") if dry else workers.new_run_dir()
    p = workers.plan(n, extra, cold, run_dir, _flag, env)
    if dry:
        print(f"run directory: a new private temporary directory ({run_dir})")
        for cmd in p.worker_cmds:
            print(f"KVVIZ_CLASSES={p.env['KVVIZ_CLASSES']}", " ".join(cmd))
        print(" ".join(p.caddy_cmd))
        print(f"traces: {traces}")
        print(f"loop results: {loop}")
        if urls_line is not None:
            print(urls_line)
        print(f"--- {run_dir}/Caddyfile")
        print(p.config, end="")
        return 0

    def say(line):
        print(line, flush=True)
        if urls_line is not None:
            print(f"kvviz: bound to all interfaces; {urls_line}", flush=True)

    rc = workers.run(p, say)
    if rc == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rc
