"""Warm a server before it listens: draw the default page once, in-process.

A class opens a just-started server at the same moment, and every session then waits for
the same one-time work: importing numpy, pandas and plotly, replaying the default pair of
policies, building the whole-run heatmap (about 2 s here), before the N page runs that share
one GIL. `kvviz app` does that work first, by running the page itself once (Streamlit's
AppTest), so its server-wide caches (`st.cache_resource`: traces, replays, the heatmap) are
full before the first student connects. Besides the default page it opens what a class
opens next (`FIRST_OPENED`): the Compare view, whose six replays took 18 s on a first visit.
Nothing here replicates the page's logic.
"""
from __future__ import annotations

import gc
import logging
import sys
import time
from pathlib import Path
from urllib.parse import parse_qsl

# the links a class opens first, in order: a plain link, then Compare all (every policy)
FIRST_OPENED = ("", "view=compare")


def warm(app: Path, timeout: float = 300.0, queries=FIRST_OPENED) -> float:
    """Run `app` once per query string in `queries` ("" = a plain link). Returns seconds
    taken; RuntimeError naming the first exception if a page does not draw."""
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
        for query in queries:
            at = AppTest.from_file(str(app), default_timeout=timeout)
            for k, v in parse_qsl(query):
                at.query_params[k] = v
            at.run()
            if at.exception:
                raise RuntimeError(f"the page {'?' + query if query else ''} failed while "
                                   f"warming: {at.exception[0].message}")
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if main is not None:
            sys.modules["__main__"] = main
    gc.collect()  # the warm-up's garbage, then everything alive now: out of the collector's
    gc.freeze()   # reach for good (kvviz.app.ui.imports.settle)
    return time.perf_counter() - t0
