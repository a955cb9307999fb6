"""The compare and slides views in a real browser (Debian's chromium driven by playwright,
never `playwright install`), following tests/test_e2e.py: start `streamlit run app.py` on a
free port, wait for /_stcore/health, drive the page, stop the server by PID. At 1024x768 (a
projector) the compare view draws its six small multiples and its table, whole; the slides
view's GIF download delivers a GIF.

Missing chromium or playwright: a failure when KVVIZ_REQUIRE_E2E=1 (CI), a skip otherwise.
"""
import contextlib
import io
import json
import sys
import time
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402

ART = REPO / "artifacts"
CHROMIUM, CHROMIUM_ARGS = M.CHROMIUM, M.CHROMIUM_ARGS
CHART = '[data-testid="stPlotlyChart"]'


@contextlib.contextmanager
def browser(width=1024, height=768):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            ctx = b.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
            yield ctx.new_page()
        finally:
            b.close()


def wait_idle(page, timeout=120_000):
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout)


def wait_chart_text(page, text, timeout=120_000):
    page.wait_for_function(
        "(t) => [...document.querySelectorAll('[data-testid=\"stPlotlyChart\"]')]"
        ".some(e => e.textContent.includes(t))", arg=text, timeout=timeout)


def test_compare_and_gif_download_at_1024x768(chromium, server):
    ART.mkdir(exist_ok=True)
    errors, took = [], {}
    url = server.streamlit()
    with browser(1024, 768) as page:
        page.on("pageerror", lambda e: errors.append(str(e)))
        # compare: six small multiples, the survival chart and a six-row table
        # the shipped prose trace (1,024 steps) keeps the cold replays of six policies short
        page.goto(url + "/?trace=file:prose.npz&budget=128&a=tova&b=snapkv&step=600&view=compare",
                  wait_until="commit")
        t0 = time.perf_counter()
        wait_chart_text(page, "Held set over time")
        wait_chart_text(page, "every policy")
        wait_idle(page)
        took["compare_cold_s"] = time.perf_counter() - t0
        small = page.locator(CHART).filter(has_text="Held set over time").first
        assert small.locator("image").count() == 6
        titles = small.locator("text.annotation-text").all_text_contents()
        assert [t.split("holds")[0] for t in titles] == ["tova", "snapkv", "h2o", "streaming-llm",
                                                         "scissorhands", "random"], titles
        box = small.bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 1024  # fits the projector
        table = page.locator('[data-testid="stTable"]').first  # drawn whole (st.table)
        table.wait_for(timeout=30_000)
        assert table.locator("tbody tr").count() == 6
        tbox = table.bounding_box()
        assert tbox and tbox["x"] + tbox["width"] <= 1024
        assert table.evaluate("e => e.scrollWidth <= e.clientWidth + 1")  # no column hidden
        small.scroll_into_view_if_needed()
        page.screenshot(path=str(ART / "e2e-views-compare-1024.png"))

        # slides: the GIF download delivers an animated GIF with the chosen frame count
        page.goto(url + "/?trace=file:prose.npz&budget=128&a=tova&b=snapkv&step=600&view=slides",
                  wait_until="commit")
        button = page.get_by_role("button", name="animated GIF: 48 frames")
        button.wait_for(timeout=120_000)
        wait_idle(page)
        t0 = time.perf_counter()
        with page.expect_download(timeout=120_000) as info:
            button.click()
        path = info.value.path()
        took["gif_download_s"] = time.perf_counter() - t0
        data = Path(path).read_bytes()
        assert data[:6] == b"GIF89a"
        assert info.value.suggested_filename.endswith(".gif")
        assert Image.open(io.BytesIO(data)).n_frames == 48
        took["gif_bytes"] = len(data)
        page.screenshot(path=str(ART / "e2e-views-slides-1024.png"))
    (ART / "e2e-views.json").write_text(json.dumps(took, indent=1))
    assert not errors, errors
