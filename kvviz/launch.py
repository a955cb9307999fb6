"""`kvviz app`: start the explorer with the offline settings, from a checkout or an install.

An installed kvviz carries the page (the checkout's app.py) and the shipped traces in
kvviz/_bundle/, copied there by setup.py at build time; a checkout uses app.py and traces/
beside the package. The settings are the ones in .streamlit/config.toml, passed as flags so
they hold from any working directory; flags given after `kvviz app` override them.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

BUNDLE = Path(__file__).resolve().parent / "_bundle"
REPO = Path(__file__).resolve().parents[1]

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
    "runner.postScriptGC": "false",  # see .streamlit/config.toml: the GC walk cost a class
    "runner.magicEnabled": "false",  # unused; Streamlit recompiles app.py per new session
}


def app_file() -> Path:
    for path in (BUNDLE / "app.py", REPO / "app.py"):
        if path.is_file():
            return path
    raise RuntimeError(f"the explorer's app.py is neither in {BUNDLE} nor in {REPO}; "
                       "reinstall kvviz with `pip install .` from a checkout")


def traces_dir() -> Path | None:
    """Where the shipped traces are: $KVVIZ_TRACES_DIR, the installed bundle or the checkout."""
    if os.environ.get("KVVIZ_TRACES_DIR"):
        return Path(os.environ["KVVIZ_TRACES_DIR"])
    for path in (BUNDLE / "traces", REPO / "traces"):
        if path.is_dir() and any(path.glob("*.npz")):
            return path
    return None


def command(extra: list[str]) -> list[str]:
    """`python -m streamlit run APP` with SETTINGS, minus any the user sets in `extra`."""
    given = {a[2:].split("=", 1)[0] for a in extra if a.startswith("--")}
    flags = [f"--{k}={v}" for k, v in SETTINGS.items() if k not in given]
    return [sys.executable, "-m", "streamlit", "run", str(app_file()), *flags, *extra]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: kvviz app [--dry-run] [--cold] [streamlit flags, e.g. --server.port 8502 "
              "--server.address 0.0.0.0]\n\nStarts the explorer on http://localhost:8501 "
              "(offline: no telemetry, bound to 127.0.0.1).\nBefore it listens it draws the "
              "default page once, so a class arriving together finds the replays done.\n"
              "--cold starts without that. --dry-run prints the command and the traces "
              "folder instead of starting.")
        return 0
    dry = "--dry-run" in argv
    cold = "--cold" in argv
    extra = [a for a in argv if a not in ("--dry-run", "--cold")]
    try:
        cmd = command(extra)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    traces = traces_dir()
    if traces is not None:
        env["KVVIZ_TRACES_DIR"] = str(traces)
    if dry:
        print(" ".join(cmd))
        print(f"traces: {traces}")
        return 0
    os.environ.update(env)
    if not cold:
        from kvviz.ui.warm import warm

        print("kvviz: drawing the default page once before serving…", flush=True)
        try:
            print(f"kvviz: warm in {warm(app_file()):.1f} s", flush=True)
        except Exception as exc:  # serve anyway: the page shows its own errors
            print(f"kvviz: warming failed ({exc}); starting cold", file=sys.stderr, flush=True)
    from streamlit.web import cli  # the server runs in this process: one pid to stop

    # Warming parsed the config files once; the flags below change [server], which Streamlit
    # reports as needing a restart. The server has not started, so the flags do apply.
    logging.getLogger("streamlit.config").addFilter(
        lambda rec: "config option section was detected" not in rec.getMessage())

    return cli.main(args=cmd[3:], prog_name="streamlit", standalone_mode=False) or 0
