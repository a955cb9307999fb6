"""Test-session hygiene shared by every test file, and the one model load they share."""
import os
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


@pytest.fixture(scope="session")
def smollm():
    """SmolLM2's (tokenizer, model), loaded once for the whole session: a load is ~20 s
    alone and minutes on a crowded machine. Missing stack: see require_capture_stack."""
    from apphelp import require_capture_stack

    require_capture_stack()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvviz.model.models import load_model

    return load_model()
