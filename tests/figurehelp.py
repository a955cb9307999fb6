"""Reading the figures back in tests: the cache heatmap's PNG as state codes."""
import base64
import io
import re

import numpy as np
from PIL import Image

from kvviz.app.figures.cache import palette
from kvviz.app.figures.states import state_colours


def png_to_codes(uri: str, a: str = "tova", b: str = "snapkv") -> np.ndarray:
    """Inverse of kvviz.app.figures.cache.codes_to_png for the pair A = `a`, B = `b` (policy
    names or labels: their colours): data URI -> state codes (-1 where a pixel is no state's
    colour)."""
    raw = base64.b64decode(uri.split(",", 1)[1])
    rgb = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    codes = np.full(rgb.shape[:2], -1, np.int8)
    for c, col in enumerate(palette(state_colours(a, b))):
        codes[(rgb == col).all(axis=2)] = c
    return codes


def png_colours(uri: str) -> set[str]:
    """Every colour of a PNG data URI as '#RRGGBB'."""
    raw = base64.b64decode(uri.split(",", 1)[1])
    rgb = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")).reshape(-1, 3)
    return {"#%02X%02X%02X" % tuple(int(v) for v in c) for c in np.unique(rgb, axis=0)}


HEX = re.compile(r"^#[0-9A-Fa-f]{6}$")


def trace_colours(obj) -> set[str]:
    """Every '#RRGGBB' colour in a plotly trace (marker, line, colorscale, fill...), upper
    case, and those of PNG images it shows."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "source" and isinstance(v, str) and v.startswith("data:image/png"):
                out |= png_colours(v)
            else:
                out |= trace_colours(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out |= trace_colours(v)
    elif isinstance(obj, str) and HEX.match(obj):
        out.add(obj.upper())
    return out
