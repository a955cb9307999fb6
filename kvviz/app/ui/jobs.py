"""Model runs in the background, one at a time per server process, first come first served.

The page's model runs (the loop view's, the Forgetting view's) each load and run a model on
2 shared cores: two at once would both crawl (OpenMP threads spin). So a run goes into one
server-wide queue (a module global: one per server process, shared by every session) and a
single worker thread runs them in order. A job is a plain dict the session keeps; the worker
only writes its progress fields, never session state, which belongs to the script thread.
"""
from __future__ import annotations

import threading
import time
from collections import deque

_LOCK = threading.Lock()
_WAITING: deque = deque()   # (job, work) not yet started
_ACTIVE: list = []          # the job the worker runs now (0 or 1)


def new_job(total: int) -> dict:
    """A job's fields: progress (done/total), the result or error, and whether it is still
    queued or running ("running" stays True until it ends, so a page shows it as busy)."""
    return {"done": 0, "total": int(total), "result": None, "error": None, "running": True,
            "queued": True, "started": time.time(), "shown": False}


def start(total: int, run) -> dict:
    """Queue `run(progress)`, `progress(done, total)` writing the job's progress fields."""
    def work(job):
        def progress(done, n):
            job["done"], job["total"] = int(done), int(n)

        return run(progress)

    return submit(new_job(total), work)


def show(job: dict | None, what: str, unit: str) -> None:
    """For a fragment that reruns on a timer: the progress bar while `job` waits or runs,
    then, once it has ended, one rerun of the whole page so its result is drawn."""
    import streamlit as st

    if job is None:
        return
    if job["running"]:
        st.progress(min(1.0, job["done"] / max(1, job["total"])), text=status_text(job, what, unit))
    elif not job["shown"]:
        job["shown"] = True
        st.rerun(scope="app")


def submit(job: dict, work) -> dict:
    """Queue `work(job)`; its return value becomes job["result"], an exception job["error"]
    (a line for the page, never a traceback)."""
    global _worker
    with _LOCK:
        _WAITING.append((job, work))
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_run, name="kvviz-model-runs", daemon=True)
            _worker.start()
    return job


_worker: threading.Thread | None = None


def _run() -> None:
    global _worker
    while True:
        with _LOCK:
            if not _WAITING:
                _worker = None
                return
            job, work = _WAITING.popleft()
            _ACTIVE[:] = [job]
        job["queued"], job["started"] = False, time.time()
        try:
            job["result"] = work(job)
        except Exception as exc:  # shown on the page
            job["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            with _LOCK:
                _ACTIVE.clear()
            job["running"] = False


def place(job: dict) -> int:
    """0 while the job runs (or has ended), else its place in the queue (1 = next)."""
    with _LOCK:
        for i, (j, _) in enumerate(_WAITING, 1):
            if j is job:
                return i
    return 0


def status_text(job: dict, what: str, unit: str) -> str:
    """The progress line: the place in the queue while waiting, then done/total, rate, ETA."""
    n = place(job)
    if n:
        return (f"waiting for the model: place {n} in the queue "
                f"({n} run{'s' if n > 1 else ''} ahead of yours, one at a time on this server)")
    total = max(1, job["total"])
    el = time.time() - job["started"]
    rate = job["done"] / el if el > 0 else 0.0
    eta = (f", about {(total - job['done']) / rate:.0f} s left" if rate > 0
           else " (loading the model…)")
    return f"{what}: {job['done']}/{total} {unit}, {rate:.1f} {unit}/s{eta}"
