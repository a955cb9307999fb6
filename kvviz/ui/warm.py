"""Warm a server before it listens: draw the default page once, in-process.

A class opens a just-started server at the same moment, and every session then waits for
the same one-time work: importing numpy, pandas and plotly, replaying the default pair of
policies, building the whole-run heatmap (about 2 s here), before the N page runs that share
one GIL. `kvviz app` does that work first, by running the page itself once (Streamlit's
AppTest), so its server-wide caches (`st.cache_resource`: traces, replays, the heatmap) are
full before the first student connects. Nothing here replicates the page's logic.
"""
from __future__ import annotations

import gc
import logging
import sys
import time
from pathlib import Path


def warm(app: Path, timeout: float = 300.0) -> float:
    """Run `app` once with no query (the page a plain link opens). Returns seconds taken;
    RuntimeError naming the first exception if the page does not draw."""
    from streamlit.testing.v1 import AppTest

    t0 = time.perf_counter()
    main = sys.modules.get("__main__")  # AppTest leaves the page registered as __main__
    # "missing ScriptRunContext" and "no runtime" warnings are expected outside a server;
    # Streamlit sets a level on each of its loggers, so each is quietened and restored
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n.startswith("streamlit")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        at = AppTest.from_file(str(app), default_timeout=timeout).run()
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if main is not None:
            sys.modules["__main__"] = main
    if at.exception:
        raise RuntimeError(f"the page failed while warming: {at.exception[0].message}")
    gc.collect()  # the warm-up's garbage, then everything alive now: out of the collector's
    gc.freeze()   # reach for good (kvviz.ui.imports.settle)
    return time.perf_counter() - t0
