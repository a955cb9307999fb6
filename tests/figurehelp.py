"""Reading the figures back in tests: the cache heatmap's PNG as state codes."""
import base64
import io

import numpy as np
from PIL import Image

from kvviz.app.figures.cache import PALETTE


def png_to_codes(uri: str) -> np.ndarray:
    """Inverse of kvviz.app.figures.cache.codes_to_png: data URI -> state codes (-1 where a
    pixel is no state's colour)."""
    raw = base64.b64decode(uri.split(",", 1)[1])
    rgb = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    codes = np.full(rgb.shape[:2], -1, np.int8)
    for c, col in enumerate(PALETTE):
        codes[(rgb == col).all(axis=2)] = c
    return codes
