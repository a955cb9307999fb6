"""Test-session hygiene shared by every test file."""
import sys

import pytest

_MAIN = sys.modules["__main__"]


@pytest.fixture(autouse=True)
def _restore_main_module():
    """AppTest runs app.py as `__main__` and leaves it in sys.modules; a process spawned
    afterwards (the sweep's process pool) re-runs the main module on start-up, so it would
    run the page and die, and the pool would wait on it for ever. Put pytest's back."""
    yield
    sys.modules["__main__"] = _MAIN
