"""Streamlit glue for the explorer (state <-> URL, cached compute, controls, uploads).

`kvviz.ui.engine`, `kvviz.ui.state` and `kvviz.ui.export` import no Streamlit and are
usable on their own; the rest is imported by `app.py`.
"""
