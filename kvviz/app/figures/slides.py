"""Slides: the cache heatmap and the token strip as an animated GIF or a PNG (bytes out).

Frames are drawn on the server straight from the two eviction logs with numpy and Pillow
(no browser, no screenshot of a Plotly chart): each frame is a palette image whose cells are
the A/B cache states after that frame's step (`states.state_counts` / `states_at`, the
harness's held rule), so a GIF is small and its colours are exactly the app's state colours.

* Heatmap frame at step s: rows are the steps of the chosen range, columns the positions;
  rows up to s show the states (aggregated to at most `max_px` pixels per axis, the cache
  view's display rule), later rows are still blank, and a red mark left of the grid points
  at row s. A step axis (left) and a position axis (below) carry ticks and titles. The
  animation draws the heatmap as the run unfolds; the PNG of a step is that step's frame.
* Token frame at step s: the tokens of a position range as boxes coloured by their state
  after step s (layout fixed across frames, only the colours change).
"""
from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from kvviz.app.figures.cache import PALETTE
from kvviz.app.figures.states import (
    BOTH,
    NEITHER,
    NOT_YET,
    ONLY_A,
    ONLY_B,
    bin_edges,
    display_state,
    state_counts,
    states_at,
)

MAX_FRAMES = 240
MAX_BYTES = 8 * 1024 * 1024   # a GIF larger than this is redrawn smaller, then refused
MIN_PX = 96
# palette indices after the five state colours
RED, INK, PAPER, FAINT = 5, 6, 7, 8
_EXTRA = [(204, 0, 0), (20, 20, 20), (255, 255, 255), (150, 150, 150)]
_PALETTE = [int(v) for rgb in [*map(tuple, PALETTE), *_EXTRA] for v in rgb]


def _palette_of(label_a: str, label_b: str) -> list[int]:
    """The GIF palette for A = `label_a`, B = `label_b`: their policies' colours."""
    from kvviz.app.figures.cache import palette
    from kvviz.app.figures.states import state_colours

    rgbs = [*map(tuple, palette(state_colours(label_a, label_b))), *_EXTRA]
    return [int(v) for rgb in rgbs for v in rgb]
_TEXT_ON = {BOTH: PAPER, ONLY_A: INK, ONLY_B: PAPER, NEITHER: INK, NOT_YET: FAINT}
HEADER = 40
AXIS_LEFT = 60    # step title, step tick labels, the red step mark
AXIS_BOTTOM = 36  # position tick labels and title
FONT_PATHS = ("/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",
              "/usr/share/fonts/TTF/DejaVuSansMono.ttf")


@lru_cache(maxsize=4)
def font(size: int = 13):
    """DejaVu Sans Mono when installed (it has ⏎ and ⇥), else Pillow's bundled font."""
    for p in FONT_PATHS:
        if Path(p).exists():
            return ImageFont.truetype(p, size)
    return ImageFont.load_default(size)


@lru_cache(maxsize=4096)
def _has_glyph(ch: str, size: int) -> bool:
    f = font(size)
    missing = np.asarray(f.getmask("\uffff"))
    m = np.asarray(f.getmask(ch))
    return not (m.shape == missing.shape and (m == missing).all())


def shown_token(tok: str, size: int = 13) -> str:
    """A token as drawn: whitespace visible (· space, ⏎ newline, ⇥ tab, with ASCII stand-ins
    if the font lacks them), characters the font cannot draw as '?'."""
    out = []
    for ch in str(tok):
        alt = {" ": ("·", "."), "\n": ("⏎", "\\n"), "\t": ("⇥", "\\t"), "\r": ("␍", "\\r")}.get(ch)
        if alt:
            out.append(alt[0] if _has_glyph(alt[0], size) else alt[1])
        else:
            out.append(ch if _has_glyph(ch, size) else "?")
    return "".join(out) or ("∅" if _has_glyph("∅", size) else "_")


def frame_steps(start: int, stop: int, frames: int) -> np.ndarray:
    """`frames` distinct steps from `start` to `stop` inclusive, evenly spread."""
    start, stop, frames = int(start), int(stop), int(frames)
    if start < 0 or stop < start:
        raise ValueError(f"step range must satisfy 0 <= start <= stop, got {start}..{stop}")
    if not 1 <= frames <= MAX_FRAMES:
        raise ValueError(f"frames must be between 1 and {MAX_FRAMES}, got {frames}")
    if frames > stop - start + 1:
        raise ValueError(f"frames must be at most the number of steps in the range "
                         f"({stop - start + 1}), got {frames}")
    if frames == 1:
        return np.array([stop], np.int64)
    return np.rint(np.linspace(start, stop, frames)).astype(np.int64)


def _legend_items(label_a: str, label_b: str):
    return ((BOTH, "both"), (ONLY_A, f"only A: {label_a}"), (ONLY_B, f"only B: {label_b}"),
            (NEITHER, "evicted by both"))


def legend_width(label_a: str, label_b: str) -> int:
    """Pixels the header needs: 'step N' then the legend."""
    return 100 + sum(22 + int(font(12).getlength(t)) for _, t in _legend_items(label_a, label_b))


def _legend(draw: ImageDraw.ImageDraw, x: int, y: int, label_a: str, label_b: str) -> None:
    f = font(12)
    for code, text in _legend_items(label_a, label_b):
        draw.rectangle([x, y + 2, x + 10, y + 12], fill=int(code), outline=FAINT)
        draw.text((x + 14, y), text, fill=INK, font=f)
        x += 22 + int(f.getlength(text))


# --- heatmap -----------------------------------------------------------------------------
def heatmap_layout(steps: int, start: int, stop: int, pos_range=None,
                   max_px: int = 640, labels=("A", "B")) -> dict:
    """Geometry shared by every frame: step/position bin edges (at most `max_px` bins per
    axis), pixels per bin (`scale`, integer upscaling of small ranges), where the grid
    starts in the image (`x0`, `y0`), and the axes' ticks as (value, pixel) pairs."""
    if not 0 <= int(start) <= int(stop) < int(steps):
        raise ValueError(f"step range must lie within 0..{steps - 1}, got {start}..{stop}")
    p0, p1 = pos_range if pos_range is not None else (0, int(stop) + 1)
    if not 0 <= int(p0) < int(p1) <= int(steps):
        raise ValueError(f"pos_range must lie within 0..{steps}, got {p0}..{p1}")
    max_px = max(MIN_PX, int(max_px))
    se = bin_edges(int(stop) + 1, max_px, int(start))
    pe = bin_edges(int(p1), max_px, int(p0))
    scale = max(1, max_px // max(len(se) - 1, len(pe) - 1))
    gw, gh = (len(pe) - 1) * scale, (len(se) - 1) * scale
    width = max(AXIS_LEFT + gw + 24, legend_width(*labels))
    return dict(step_edges=se, pos_edges=pe, scale=scale, x0=AXIS_LEFT, y0=HEADER,
                width=width, height=HEADER + gh + AXIS_BOTTOM,
                step_ticks=_ticks(se, scale, HEADER, max(2, gh // 60)),
                pos_ticks=_ticks(pe, scale, AXIS_LEFT, max(2, gw // 90)))


def nice_ticks(lo: int, hi: int, n: int) -> list[int]:
    """About `n` round values in [lo, hi] (steps of 1, 2 or 5 × 10^k), always with `lo`."""
    if hi <= lo:
        return [int(lo)]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** int(np.floor(np.log10(max(raw, 1))))
    step = min((m * mag for m in (1, 2, 5, 10)), key=lambda c: abs(np.log(c / raw)))
    vals = [v for v in range(-(-int(lo) // step) * step, int(hi) + 1, step)]
    return [int(lo)] + [v for v in vals if v - lo >= step / 2]


def _ticks(edges, scale: int, origin: int, n: int) -> list[tuple[int, int]]:
    """(value, pixel centre of the bin holding it) for round values along one axis."""
    edges = np.asarray(edges)
    out = []
    for v in nice_ticks(int(edges[0]), int(edges[-1]) - 1, n):
        i = int(np.searchsorted(edges, v, side="right")) - 1
        out.append((v, origin + i * scale + scale // 2))
    return out


def _axes(draw: ImageDraw.ImageDraw, img: Image.Image, layout: dict) -> None:
    """Tick labels and titles: steps down the left, positions along the bottom."""
    f = font(11)
    x0, y0 = layout["x0"], layout["y0"]
    gw = (len(layout["pos_edges"]) - 1) * layout["scale"]
    gh = (len(layout["step_edges"]) - 1) * layout["scale"]
    draw.rectangle([x0 - 1, y0 - 1, x0 + gw, y0 + gh], outline=FAINT)  # the grid's extent
    for v, y in layout["step_ticks"]:
        t = str(v)
        draw.line([(x0 - 13, y), (x0 - 11, y)], fill=INK)
        draw.text((x0 - 15 - int(f.getlength(t)), y - 6), t, fill=INK, font=f)
    for v, x in layout["pos_ticks"]:
        t = str(v)
        draw.line([(x, y0 + gh + 1), (x, y0 + gh + 3)], fill=INK)
        tx = min(max(x - int(f.getlength(t)) // 2, x0 - 4), layout["width"] - 2 - int(f.getlength(t)))
        draw.text((tx, y0 + gh + 4), t, fill=INK, font=f)
    title = "position"
    draw.text((x0 + (gw - int(f.getlength(title))) // 2, y0 + gh + 19), title, fill=INK, font=f)
    # the step title, written upwards beside the step ticks
    w = int(f.getlength("step")) + 2
    label = Image.new("1", (w, 14), 0)
    ImageDraw.Draw(label).text((1, 0), "step", fill=1, font=f)
    label = label.rotate(90, expand=True)
    ys = y0 + max(0, (gh - label.height) // 2)
    ink = Image.new("P", label.size, INK)
    img.paste(ink, (1, ys), label)


def heatmap_codes(ev_a, ev_b, layout: dict, step: int, reveal: bool = True) -> np.ndarray:
    """State code per (step bin, position bin) as shown at `step`: bins after `step` are
    blank (NOT_YET) when `reveal`; the bin holding `step` covers only steps up to it."""
    se, pe = layout["step_edges"], layout["pos_edges"]
    codes = display_state(state_counts(ev_a, ev_b, se, pe), se, pe)
    return _revealed(ev_a, ev_b, codes, layout, int(step)) if reveal else codes


def heatmap_frame(ev_a, ev_b, step: int, layout: dict, *, label_a: str = "A",
                  label_b: str = "B", reveal: bool = True, codes=None) -> Image.Image:
    """One palette image: header (step, legend), axes, the red step mark, the grid."""
    codes = heatmap_codes(ev_a, ev_b, layout, step, reveal) if codes is None else codes
    s = layout["scale"]
    canvas = np.full((layout["height"], layout["width"]), PAPER, np.uint8)
    grid = np.repeat(np.repeat(codes.astype(np.uint8), s, axis=0), s, axis=1)
    y0, x0 = layout["y0"], layout["x0"]
    canvas[y0:y0 + grid.shape[0], x0:x0 + grid.shape[1]] = grid
    img = Image.frombytes("P", (layout["width"], layout["height"]), canvas.tobytes())
    img.putpalette(_palette_of(label_a, label_b))
    draw = ImageDraw.Draw(img)
    draw.fontmode = "1"  # no anti-aliasing: the palette stays exact
    draw.text((4, 2), f"step {int(step)}", fill=RED, font=font(14))
    _legend(draw, 100, 4, label_a, label_b)
    pe = layout["pos_edges"]
    draw.text((4, 22), f"rows: steps {int(layout['step_edges'][0])}–"
                       f"{int(layout['step_edges'][-1]) - 1} · columns: positions "
                       f"{int(pe[0])}–{int(pe[-1]) - 1}", fill=FAINT, font=font(11))
    _axes(draw, img, layout)
    i = int(np.searchsorted(layout["step_edges"], int(step), side="right")) - 1
    if 0 <= i < len(layout["step_edges"]) - 1:
        y = layout["y0"] + i * s + s // 2
        draw.polygon([(x0 - 10, y - 4), (x0 - 2, y), (x0 - 10, y + 4)], fill=RED)
        if not reveal:  # the whole range is drawn, so a line marks the step
            draw.line([(x0, y), (x0 + grid.shape[1] - 1, y)], fill=RED, width=1)
    return img


def heatmap_images(ev_a, ev_b, steps, layout, *, label_a="A", label_b="B",
                   reveal=True) -> list[Image.Image]:
    """One frame per step of `steps` (the whole range is aggregated once)."""
    full = heatmap_codes(ev_a, ev_b, layout, 0, reveal=False)
    out = []
    for s in steps:
        codes = full if not reveal else _revealed(ev_a, ev_b, full, layout, int(s))
        out.append(heatmap_frame(ev_a, ev_b, int(s), layout, label_a=label_a, label_b=label_b,
                                 codes=codes))
    return out


def _revealed(ev_a, ev_b, full: np.ndarray, layout: dict, step: int) -> np.ndarray:
    """`heatmap_codes(..., reveal=True)` reusing the whole-range codes (one aggregation per
    GIF instead of one per frame)."""
    se, pe = layout["step_edges"], layout["pos_edges"]
    codes = full.copy()
    i = int(np.searchsorted(se, step, side="right")) - 1  # the bin holding `step` (-1: none)
    codes[i + 1:] = NOT_YET
    if 0 <= i < len(se) - 1 and step < se[i + 1] - 1:
        part = [int(se[i]), step + 1]
        codes[i] = display_state(state_counts(ev_a, ev_b, part, pe), part, pe)[0]
    return codes


# --- tokens ------------------------------------------------------------------------------
def token_layout(tokens, lo: int, hi: int, width: int = 900, size: int = 14) -> dict:
    """Tokens lo..hi-1 as boxes wrapped at `width` pixels and at newlines, drawn once: a map
    of which token's box each pixel belongs to (-1: none) and a mask of the text pixels, so
    every frame is one numpy lookup of the states (drawing text per frame is ~100x slower)."""
    if not 0 <= int(lo) < int(hi) <= len(tokens):
        raise ValueError(f"token range must lie within 0..{len(tokens)}, got {lo}..{hi}")
    f = font(size)
    line_h = size + 10
    x, y = 6, HEADER
    boxes = []
    for p in range(int(lo), int(hi)):
        text = shown_token(tokens[p], size)
        w = int(f.getlength(text)) + 6
        if x + w > width - 6 and x > 6:
            x, y = 6, y + line_h
        boxes.append((x, y, w, line_h - 4, text))
        x += w + 2
        if "\n" in str(tokens[p]):
            x, y = 6, y + line_h
    height = y + line_h + 6
    box_id = np.full((height, int(width)), -1, np.int32)
    text = Image.new("1", (int(width), height), 0)
    draw = ImageDraw.Draw(text)
    draw.fontmode = "1"
    for i, (x, y, w, h, t) in enumerate(boxes):
        box_id[y:y + h, x:min(x + w, int(width))] = i
        draw.text((x + 3, y + 1), t, fill=1, font=f)
    mask = np.asarray(text, dtype=bool) & (box_id >= 0)
    return dict(lo=int(lo), hi=int(hi), boxes=boxes, width=int(width), size=int(size),
                height=height, box_id=box_id, text_mask=mask)


_TEXT_LUT = np.array([_TEXT_ON[c] for c in range(5)], np.uint8)


def token_frame(tokens, ev_a, ev_b, step: int, layout: dict, *, label_a="A",
                label_b="B") -> Image.Image:
    """Tokens of `layout` coloured by their state after `step` (box: the state colour; text:
    a colour readable on it)."""
    codes = states_at(ev_a, ev_b, int(step))[layout["lo"]:layout["hi"]].astype(np.uint8)
    box_id, mask = layout["box_id"], layout["text_mask"]
    canvas = np.full(box_id.shape, PAPER, np.uint8)
    inside = box_id >= 0
    canvas[inside] = codes[box_id[inside]]
    canvas[mask] = _TEXT_LUT[codes[box_id[mask]]]
    img = Image.frombytes("P", (layout["width"], layout["height"]), canvas.tobytes())
    img.putpalette(_palette_of(label_a, label_b))
    draw = ImageDraw.Draw(img)
    draw.fontmode = "1"
    draw.text((4, 2), f"step {int(step)}", fill=RED, font=font(14))
    _legend(draw, 100, 4, label_a, label_b)
    draw.text((4, 22), f"tokens {layout['lo']}–{layout['hi'] - 1}, coloured by their state "
                       "after the step", fill=FAINT, font=font(11))
    return img


# --- encoding ----------------------------------------------------------------------------
def encode_gif(images: list[Image.Image], duration_ms: int = 150) -> bytes:
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:],
                   duration=int(duration_ms), loop=0, optimize=False, disposal=1)
    return buf.getvalue()


def encode_png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def heatmap_gif(ev_a, ev_b, start: int, stop: int, frames: int, *, label_a="A", label_b="B",
                pos_range=None, max_px: int = 640, duration_ms: int = 150,
                max_bytes: int = MAX_BYTES) -> bytes:
    """Animated GIF: the A/B cache heatmap over steps start..stop, drawn as the run unfolds,
    `frames` frames. Redrawn with fewer pixels per axis until it fits `max_bytes`."""
    steps = frame_steps(start, stop, frames)
    px = max(MIN_PX, int(max_px))
    while True:
        layout = heatmap_layout(len(ev_a), start, stop, pos_range, px, (label_a, label_b))
        data = encode_gif(heatmap_images(ev_a, ev_b, steps, layout, label_a=label_a,
                                         label_b=label_b), duration_ms)
        if len(data) <= max_bytes:
            return data
        if px <= MIN_PX:
            raise ValueError(f"max_bytes: a {frames}-frame GIF needs {len(data):,} bytes even at "
                             f"{MIN_PX} pixels per axis, more than {max_bytes:,}; use fewer frames")
        px = max(MIN_PX, px // 2)


def heatmap_png(ev_a, ev_b, step: int, *, start: int = 0, stop: int | None = None,
                label_a="A", label_b="B", pos_range=None, max_px: int = 640) -> bytes:
    """The GIF's frame of `step` over start..stop (default the whole run): rows up to the
    step drawn, later rows blank (no future on a slide of the present)."""
    stop = len(ev_a) - 1 if stop is None else int(stop)
    if not int(start) <= int(step) <= stop:
        raise ValueError(f"step must lie in the step range {start}..{stop}, got {step}")
    layout = heatmap_layout(len(ev_a), start, stop, pos_range, max_px, (label_a, label_b))
    return encode_png(heatmap_frame(ev_a, ev_b, step, layout, label_a=label_a,
                                    label_b=label_b, reveal=True))


def token_gif(tokens, ev_a, ev_b, start: int, stop: int, frames: int, *, lo: int, hi: int,
              label_a="A", label_b="B", width: int = 900, duration_ms: int = 150,
              max_bytes: int = MAX_BYTES) -> bytes:
    """Animated GIF: tokens lo..hi-1 coloured by their state at each of `frames` steps."""
    steps = frame_steps(start, stop, frames)
    if int(stop) >= len(ev_a):
        raise ValueError(f"step range must lie within 0..{len(ev_a) - 1}, got {start}..{stop}")
    layout = token_layout(tokens, lo, hi, max(int(width), legend_width(label_a, label_b)))
    data = encode_gif([token_frame(tokens, ev_a, ev_b, int(s), layout, label_a=label_a,
                                   label_b=label_b) for s in steps], duration_ms)
    if len(data) > max_bytes:
        raise ValueError(f"max_bytes: the GIF needs {len(data):,} bytes, more than "
                         f"{max_bytes:,}; use fewer frames or fewer tokens")
    return data


def token_png(tokens, ev_a, ev_b, step: int, *, lo: int, hi: int, label_a="A", label_b="B",
              width: int = 900) -> bytes:
    layout = token_layout(tokens, lo, hi, max(int(width), legend_width(label_a, label_b)))
    return encode_png(token_frame(tokens, ev_a, ev_b, step, layout, label_a=label_a,
                                  label_b=label_b))
