"""Upload validation: every file goes through `kvviz.core.trace.load_trace` (allow_pickle=False,
size cap, shape/dtype/NaN/negative/row-length checks); a bad file gives a message naming
the problem and changes nothing."""
from __future__ import annotations

from pathlib import Path

from kvviz.app.ui.compute import add_upload
from kvviz.core.trace import MAX_TRACE_BYTES, load_trace


def validate_upload(data: bytes, filename: str, max_bytes: int = MAX_TRACE_BYTES):
    """(trace key, None) for a good file, (None, message) for a bad one."""
    try:
        trace = load_trace(bytes(data), max_bytes=max_bytes, name=Path(filename).stem)
    except ValueError as exc:
        return None, f"{filename}: {exc}"
    except Exception as exc:  # the loader should not raise anything else; never crash the page
        return None, f"{filename}: could not be read as a trace ({type(exc).__name__}: {exc})"
    if trace.steps < 2:
        return None, f"{filename}: a trace needs at least 2 steps"
    return add_upload(data, filename), None
