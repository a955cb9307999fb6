"""The Streamlit explorer, its figures and the teaching tools: `pip install 'kvviz[app]'`.

Without that extra, importing this package fails at once with one line naming it, instead of
deep inside a view."""
from kvviz.core.extras import require

require("kvviz.app", "app", "streamlit", "plotly", "pandas", "PIL")
