"""The server-wide lock app.py imports the heavy libraries under (the crowd fix).

Kept out of app.py because Streamlit re-executes app.py on every run, and a cache decorator
there is rebuilt each time (hashing its own source). Imports nothing heavy: app.py takes
this lock before numpy, pandas, PIL and plotly are loaded.
"""
import threading

import streamlit as st


@st.cache_resource(show_spinner=False)
def import_lock() -> threading.Lock:
    """One lock for the whole server (cache_resource hands every session the same object)."""
    return threading.Lock()
