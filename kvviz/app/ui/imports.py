"""The server-wide lock app.py imports the heavy libraries under (the crowd fix).

Kept out of app.py because Streamlit re-executes app.py on every run, and a cache decorator
there is rebuilt each time (hashing its own source). Imports nothing heavy: app.py takes
this lock before numpy, pandas, PIL and plotly are loaded.
"""
import gc
import threading

import streamlit as st


@st.cache_resource(show_spinner=False)
def import_lock() -> threading.Lock:
    """One lock for the whole server (cache_resource hands every session the same object)."""
    return threading.Lock()


def settle() -> None:
    """Move every object alive now (the imported libraries, thousands of modules' worth) out
    of the garbage collector's reach (`gc.freeze`), once per server. They live as long as
    the server does, and each full collection would otherwise walk them all again, holding
    the GIL the class's page runs queue for."""
    if not getattr(settle, "done", False):
        settle.done = True
        gc.freeze()
