"""Slides export (kvviz.app.figures.slides): GIFs and PNGs drawn from the eviction logs.

Every frame is decoded with Pillow and its cells are checked against the held sets of the
runs (`Run.held_mask`, the harness's rule), not against the code that drew them."""
import io

import numpy as np
import pytest
from PIL import Image

from kvviz.app.figures import slides as S
from kvviz.app.figures.states import BOTH, NEITHER, NOT_YET, ONLY_A, ONLY_B, STATE_COLOURS
from kvviz.core.replay import run_policy
from kvviz.core.trace import ArrayTrace, pack_rows

T = 160


def _rgb(h):
    h = h.lstrip("#")
    return tuple(int(h[i:i + 2], 16) for i in (0, 2, 4))


COLOUR_STATE = {_rgb(c): s for s, c in STATE_COLOURS.items()}


@pytest.fixture(scope="module")
def runs():
    rng = np.random.default_rng(3)
    a = np.zeros((T, T), np.float32)
    for t in range(1, T):
        w = rng.gamma(0.3, size=t) + (np.arange(t) < 2) * 2.0
        a[t, :t] = w / w.sum()
    tokens = ["the", " cat", "\n", "\tsat", "on"] * (T // 5)
    trace = ArrayTrace(pack_rows(a), T, name="tiny", tokens=tokens)
    return trace, run_policy(trace, "tova", 48), run_policy(trace, "snapkv", 48)


def expected_row(ra, rb, s):
    """The A/B state of every position after step s, from the runs' held masks."""
    a, b = ra.held_mask(s), rb.held_mask(s)
    out = [BOTH if x and y else ONLY_A if x else ONLY_B if y else NEITHER for x, y in zip(a, b)]
    return [NOT_YET if p > s else c for p, c in enumerate(out)]


def frames_rgb(data: bytes) -> list[np.ndarray]:
    im = Image.open(io.BytesIO(data))
    assert im.format == "GIF"
    out = []
    for k in range(im.n_frames):
        im.seek(k)
        out.append(np.asarray(im.convert("RGB")))
    return out


def grid_states(rgb, layout, rows, cols):
    """State of each cell, read from the pixel in the middle of the cell."""
    s = layout["scale"]
    ys = layout["y0"] + np.arange(rows) * s + s // 2
    xs = layout["x0"] + np.arange(cols) * s + s // 2
    cells = rgb[ys][:, xs]
    return np.vectorize(lambda r, g, b: COLOUR_STATE.get((r, g, b), -1))(
        cells[..., 0], cells[..., 1], cells[..., 2])


def test_heatmap_gif_every_step_matches_the_held_sets(runs):
    trace, ra, rb = runs
    data = S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, T, label_a="tova",
                         label_b="snapkv")
    assert data[:6] == b"GIF89a"
    frames = frames_rgb(data)
    assert len(frames) == T  # one frame per step: frame k is step k
    layout = S.heatmap_layout(T, 0, T - 1, labels=("tova", "snapkv"))
    assert layout["scale"] >= 1 and len(layout["step_edges"]) == T + 1  # one cell per pixel block
    brute = np.array([expected_row(ra, rb, s) for s in range(T)])
    assert (brute == ONLY_A).any() and (brute == ONLY_B).any()  # the runs do diverge
    for k in (0, 47, 48, 60, 101, T - 1):
        got = grid_states(frames[k], layout, T, T)
        want = np.where(np.arange(T)[:, None] <= k, brute, NOT_YET)  # rows after k: blank
        assert (got == want).all(), k


def test_heatmap_gif_frame_count_and_steps(runs):
    _, ra, rb = runs
    data = S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, 5)
    frames = frames_rgb(data)
    assert len(frames) == 5
    layout = S.heatmap_layout(T, 0, T - 1)
    # 5 frames over steps 0..159 land on 0, 40, 80, 119, 159 (evenly spread, rounded)
    for rgb, step in zip(frames, (0, 40, 80, 119, 159)):
        got = grid_states(rgb, layout, T, T)
        assert (got[step + 1:] == NOT_YET).all()
        row = expected_row(ra, rb, step)
        assert got[step].tolist() == row


def test_heatmap_gif_zoomed_range(runs):
    _, ra, rb = runs
    data = S.heatmap_gif(ra.evicted_at, rb.evicted_at, 50, 90, 41, pos_range=(20, 80))
    frames = frames_rgb(data)
    assert len(frames) == 41
    layout = S.heatmap_layout(T, 50, 90, pos_range=(20, 80))
    got = grid_states(frames[-1], layout, 41, 60)
    want = [expected_row(ra, rb, s)[20:80] for s in range(50, 91)]
    assert (got == np.array(want)).all()


def test_heatmap_gif_size_limit(runs):
    _, ra, rb = runs
    full = S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, 20)
    smaller = S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, 20, max_bytes=len(full) - 1)
    assert len(smaller) < len(full)
    assert Image.open(io.BytesIO(smaller)).n_frames == 20
    with pytest.raises(ValueError, match="max_bytes"):
        S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, 20, max_bytes=100)


def test_bad_ranges_are_refused(runs):
    _, ra, rb = runs
    ea, eb = ra.evicted_at, rb.evicted_at
    with pytest.raises(ValueError, match="frames"):
        S.heatmap_gif(ea, eb, 0, 10, 0)
    with pytest.raises(ValueError, match="frames must be at most"):
        S.heatmap_gif(ea, eb, 0, 10, 12)
    with pytest.raises(ValueError, match="step range"):
        S.heatmap_gif(ea, eb, 0, T, 3)
    with pytest.raises(ValueError, match="step range"):
        S.heatmap_gif(ea, eb, 20, 10, 3)
    with pytest.raises(ValueError, match="pos_range"):
        S.heatmap_gif(ea, eb, 0, 10, 3, pos_range=(5, 5))
    with pytest.raises(ValueError, match="token range"):
        S.token_gif(["a"] * T, ea, eb, 0, 10, 3, lo=0, hi=T + 1)


def test_token_gif_boxes_match_the_held_sets(runs):
    trace, ra, rb = runs
    data = S.token_gif(trace.tokens, ra.evicted_at, rb.evicted_at, 60, 159, 10, lo=40, hi=T)
    frames = frames_rgb(data)
    assert len(frames) == 10
    layout = S.token_layout(trace.tokens, 40, T,
                            max(900, S.legend_width("A", "B")))
    steps = (60, 71, 82, 93, 104, 115, 126, 137, 148, 159)  # 10 frames over 60..159
    for rgb, step in zip(frames, steps):
        want = expected_row(ra, rb, step)
        for p, (x, y, _w, h, _) in zip(range(40, T), layout["boxes"]):
            # the box's left edge (text starts 3 px in) carries the state colour
            got = COLOUR_STATE.get(tuple(int(v) for v in rgb[y + h // 2, x + 1]), -1)
            assert got == want[p], (step, p)


def test_pngs_and_determinism(runs):
    trace, ra, rb = runs
    png = S.heatmap_png(ra.evicted_at, rb.evicted_at, 100)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    layout = S.heatmap_layout(T, 0, T - 1)
    got = grid_states(rgb, layout, T, T)
    # the still of step 100 shows the steps up to 100 and nothing of the future
    for s in (30, 99, 100):
        assert got[s].tolist() == expected_row(ra, rb, s)
    y0, x0, sc = layout["y0"], layout["x0"], layout["scale"]
    future = rgb[y0 + 101 * sc:y0 + T * sc, x0:x0 + T * sc]
    assert future.size and (future == 255).all()  # every pixel after the step's row: background
    # the PNG is the GIF's frame of that step, pixel for pixel
    frame = frames_rgb(S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, T))[100]
    assert (frame == rgb).all()
    with pytest.raises(ValueError, match="step must lie in the step range"):
        S.heatmap_png(ra.evicted_at, rb.evicted_at, 100, start=0, stop=50)
    tok = S.token_png(trace.tokens, ra.evicted_at, rb.evicted_at, 100, lo=0, hi=120)
    assert Image.open(io.BytesIO(tok)).format == "PNG"
    again = S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, 8)
    assert again == S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, 8)


def test_shown_token_makes_whitespace_visible():
    out = S.shown_token(" a\n\t")
    assert " " not in out and "\n" not in out and "\t" not in out and "a" in out
    assert S.shown_token("")  # an empty token still gets a visible mark


def test_heatmap_gif_aggregated_blocks(runs):
    """Above `max_px` bins per axis the frame shows blocks of cells: a block whose cells all
    share one state (by the held sets) shows that state; blocks after the step are blank."""
    _, ra, rb = runs
    data = S.heatmap_gif(ra.evicted_at, rb.evicted_at, 0, T - 1, 4, max_px=96)
    layout = S.heatmap_layout(T, 0, T - 1, max_px=96)
    se, pe = layout["step_edges"], layout["pos_edges"]
    assert len(se) - 1 < T and (np.diff(se) == 2).all()  # 2x2 blocks
    brute = np.array([expected_row(ra, rb, s) for s in range(T)])
    frames = frames_rgb(data)
    step = 106  # 4 frames over 0..159: 0, 53, 106, 159
    got = grid_states(frames[2], layout, len(se) - 1, len(pe) - 1)
    uniform = 0
    for i in range(len(se) - 1):
        for j in range(len(pe) - 1):
            if se[i] > step:
                assert got[i, j] == NOT_YET
                continue
            cells = brute[se[i]:min(se[i + 1], step + 1), pe[j]:pe[j + 1]]
            if (cells == cells.flat[0]).all():
                uniform += 1
                assert got[i, j] == cells.flat[0], (i, j)
    assert uniform > 1000


def test_nice_ticks():
    assert S.nice_ticks(0, 4095, 5) == [0, 1000, 2000, 3000, 4000]
    assert S.nice_ticks(500, 560, 6) == [500, 510, 520, 530, 540, 550, 560]
    assert S.nice_ticks(7, 7, 3) == [7]
    assert S.nice_ticks(3, 98, 4) == [3, 20, 40, 60, 80]  # starts at the range's first value


def test_heatmap_frames_have_step_and_position_axes(runs):
    """Every frame (GIF and PNG) has tick labels at round steps down the left and round
    positions along the bottom, at the pixel of the row / column they name, and titles."""
    _, ra, rb = runs
    layout = S.heatmap_layout(T, 50, 90, pos_range=(20, 80))
    sc, x0, y0 = layout["scale"], layout["x0"], layout["y0"]
    steps = [v for v, _ in layout["step_ticks"]]
    gaps = set(np.diff(steps[1:]).tolist())
    assert steps[0] == 50 and steps[-1] <= 90 and len(steps) >= 3 and len(gaps) == 1
    assert gaps <= {1, 2, 5, 10, 20, 50} and all(v % gaps.copy().pop() == 0 for v in steps[1:])
    ys = [y for _, y in layout["step_ticks"]]
    assert min(np.diff(ys)) >= 24  # labels never touch
    for v, y in layout["step_ticks"]:
        assert y == y0 + (v - 50) * sc + sc // 2  # one row per step: the tick is on its row
    for v, x in layout["pos_ticks"]:
        assert 20 <= v < 80 and x == x0 + (v - 20) * sc + sc // 2
    png = S.heatmap_png(ra.evicted_at, rb.evicted_at, 70, start=50, stop=90, pos_range=(20, 80))
    gif = frames_rgb(S.heatmap_gif(ra.evicted_at, rb.evicted_at, 50, 90, 3, pos_range=(20, 80)))
    gh, gw = 41 * sc, 60 * sc
    for rgb in (np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), gif[0], gif[-1]):
        ink = (rgb == (20, 20, 20)).all(axis=-1)
        for _, y in layout["step_ticks"]:  # a label left of the grid, on the tick's row
            assert ink[y - 3:y + 4, 14:x0 - 12].any(), y
        for _, x in layout["pos_ticks"]:  # a label under the grid, at the tick's column
            assert ink[y0 + gh + 4:y0 + gh + 17, max(0, x - 8):x + 9].any(), x
        assert ink[y0:y0 + gh, 0:14].any()  # the "step" title
        assert ink[y0 + gh + 19:, x0:x0 + gw].any()  # the "position" title


def test_slides_position_slider_ends_where_the_steps_end(tmp_path, monkeypatch, apptest):
    """The page's positions slider runs 0..T-1 like the steps slider (not 0..T), and the
    last position chosen is drawn (the library's range is half-open)."""
    import apphelp

    from kvviz.app.ui import view_slides
    from kvviz.core.trace import save_trace

    view_slides._preview.clear()  # the page's preview cache: every draw below reaches the library
    asked = []
    real = S.heatmap_png
    monkeypatch.setattr(S, "heatmap_png", lambda *a, **k: asked.append(k) or real(*a, **k))
    rng = np.random.default_rng(5)
    save_trace(tmp_path / "tiny.npz", apphelp.softmax_rows(rng, T, 1),
               tokens=["a", " b"] * (T // 2), meta={"name": "tiny"})
    with apphelp.traces_dir(tmp_path):
        at = apphelp.app(timeout=180, trace="file:tiny.npz", budget=48, view="slides", step=90)
        apphelp.ok(at)
        steps, pos = at.slider(key="slides.steps"), at.slider(key="slides.pos")
        assert steps.max == pos.max == T - 1 and pos.value == (0, T - 1)
        assert asked[-1]["pos_range"] == (0, T)  # every position, the last one included
        pos.set_value((10, 19)).run()
        apphelp.ok(at)
        assert asked[-1]["pos_range"] == (10, 20) and asked[-1]["stop"] == T - 1
        at.segmented_control(key="slides.kind").set_value("tokens").run()
        apphelp.ok(at)
        tok = at.slider(key="slides.tokens")
        assert tok.max == T - 1 and tok.value == (0, T - 1)
