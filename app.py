"""kvviz explorer: watch decode-time KV-cache eviction policies work, step by step.

    streamlit run app.py

Thin entry point: the page's frame and the heavy imports under the server-wide lock, then
the page's run (kvviz.app.ui.page.run: the sidebar, the navigation, the selected view and
one finishing step). The work lives in kvviz.app.ui (state, cached compute, controls) and
kvviz.app.figures (pure figure builders).
"""
from html import escape
from urllib.parse import urlsplit

import streamlit as st

from kvviz.app.ui import layout
from kvviz.app.ui.imports import import_lock, settle

st.set_page_config(page_title="kvviz: KV-cache eviction explorer", page_icon="🗂️", layout="wide")

# The page's style and title in one element (each element costs every run a message).
st.markdown(f"<style>{layout.CSS}</style>\n\n#### {layout.TITLE}", unsafe_allow_html=True)


def not_found() -> str | None:
    """The path asked for when it is not the app's: `kvviz app` redirects an unknown path to
    `/?notfound=PATH` (kvviz.app.launch.not_found_redirects); under plain `streamlit run` a
    one-segment path (`/nope`) still opens this page, and its URL says so."""
    asked = st.query_params.get("notfound")
    if asked:
        return asked
    base = "/" + (st.get_option("server.baseUrlPath") or "").strip("/")
    path = urlsplit(st.context.url or "").path or "/"
    return None if path.rstrip("/") in ("", base.rstrip("/")) else path


missing = not_found()
if missing:
    st.markdown(f'<div class="kv-not-found"><b>Page not found.</b> kvviz has no page at '
                f'<code>{escape(missing[:200])}</code>. <a href="./" target="_self">Open the '
                f'explorer\u2019s home page</a>.</div>', unsafe_allow_html=True)
    st.stop()
notices = st.container()   # notes about the link
top = st.container()       # step navigation, status line
main = st.empty()          # the selected view
# Streamlit runs every session's script in its own thread, so on a fresh server the first
# sessions import numpy, pandas, PIL and plotly at the same moment. `import numpy` waits for a
# complete module, but plotly looks numpy, pandas and PIL.Image up in sys.modules directly, so
# a chart drawn while another session is half-way through importing them fails ("partially
# initialized module 'numpy' has no attribute 'ndarray'"). Drawing the first chart and doing
# those imports under one server-wide lock means no chart is ever drawn beside a half-made
# module. Later runs find them loaded. The placeholder is text, not a chart: a Plotly element
# makes the browser load and run plotly.js (4.7 MB), which held up drawing the first chart's
# server-built image (kvviz.app.ui.view_cache's preview).
with import_lock():
    if not st.session_state.get("kv.drawn"):  # session.DRAWN (imported below)
        main.caption("Replaying the policies…")
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import PIL.Image  # noqa: F401
    import plotly.graph_objects  # noqa: F401
    settle()

# after the lock: the page's modules import the libraries above (pyproject's E402 exception)
from kvviz.app.ui import page

page.run(notices, top, main)
