"""Streamlit glue for the explorer (state <-> URL, cached compute, controls, uploads).

`kvviz.app.engine`, `kvviz.app.state` and `kvviz.app.ui.export` import no Streamlit and are
usable on their own; the rest is imported by `app.py`.
"""
