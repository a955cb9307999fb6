"""Streamlit glue for the explorer (state <-> URL, cached compute, controls, uploads).

`kvviz.app.engine`, `kvviz.app.state`, `kvviz.app.slices` and `kvviz.app.ui.export` import no
Streamlit and are usable on their own; the rest is imported by `page.py`, the page's run, which
`app.py` calls after its import lock.
"""
