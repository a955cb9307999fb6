"""Presentation mode (present=1) in a real browser (Debian's chromium driven by playwright,
never `playwright install`), on a projector's screens: 1024x768, and the same screen at
125 % and 150 % browser zoom, laid out as tests/test_e2e_projector.py explains (a viewport
of 1024/zoom x 768/zoom CSS pixels at device_scale_factor = zoom).

On each screen and view: no sidebar; the chart's top on the first screen with room to show
it; no button, label or text cut; the smallest text of every chart, and of the page around
it, at least the room's floor (kvviz.app.figures.room.FLOOR) in CSS pixels. On the 1024x768
screen the keys: K and → move the step on by one (the status line says so), J and ←
back, the focused step slider's own → moves it by exactly one (not two), and P leaves the
presentation (the sidebar is back, the link drops present). Screenshots go to artifacts/,
and to docs/images/screenshot-present-1024.png and docs/images/screenshot-present-150.png when
KVVIZ_SCREENSHOT=1.

Missing chromium or playwright: a failure when KVVIZ_REQUIRE_E2E=1 (CI), a skip otherwise.
"""
import contextlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402
from test_e2e_projector import CUT, FIRST_CHART, open_screen  # noqa: E402

from kvviz.app.figures.room import FLOOR  # noqa: E402

ART = REPO / "artifacts"
SCREENS = {"1024": ((1024, 768), 1), "zoom125": ((819, 614), 1.25), "zoom150": ((683, 512), 1.5)}
PAGES = {"cache": "present=1", "scores": "present=1&view=scores",
         "divergence": "present=1&view=divergence&step=600"}
# the smallest font among the visible texts of the charts, and of the rest of the main area
SMALLEST = """() => {
  const shown = e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0
      && [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()); };
  const px = e => parseFloat(getComputedStyle(e).fontSize);
  const all = [...document.querySelectorAll('[data-testid="stMain"] *')].filter(shown)
      .filter(e => !e.closest('[data-testid="stIconMaterial"]'));
  const chart = all.filter(e => e.closest('[data-testid="stPlotlyChart"]'));
  const page = all.filter(e => !e.closest('[data-testid="stPlotlyChart"]'));
  const low = list => list.sort((a, b) => px(a) - px(b)).slice(0, 3).map(e =>
      [px(e), e.tagName + (e.dataset.testid ? '/' + e.dataset.testid : ''),
       e.textContent.trim().slice(0, 30)]);
  return {chart: low(chart), n_chart: chart.length, page: low(page)};
}"""
# a chart's text past its chart's left or right edge (plotly never wraps or clips a label)
CHART_CUT = """() => [...document.querySelectorAll('[data-testid="stPlotlyChart"] svg text')]
  .filter(e => e.textContent.trim() && e.getBoundingClientRect().width > 0)
  .filter(e => { const r = e.getBoundingClientRect(),
                       c = e.closest('[data-testid="stPlotlyChart"]').getBoundingClientRect();
                 return r.left < c.left - 1 || r.right > c.right + 1
                        || r.right > window.innerWidth + 1; })
  .map(e => e.textContent.trim().slice(0, 50))"""
SIDEBAR = "() => !!document.querySelector('[data-testid=\"stSidebar\"]')"
STEP = """() => { const p = [...document.querySelectorAll('[data-testid="stMarkdownContainer"] p')]
  .find(e => /evicted at step \\d+/.test(e.textContent));
  return p ? +p.textContent.match(/evicted at step (\\d+)/)[1] : null; }"""


def _press(page, key, before):
    """Press `key` on the page (nothing focused) and wait for the status line's step to move."""
    page.keyboard.press(key)
    page.wait_for_function(f"() => ({STEP})() !== {before}", timeout=60_000)
    M.wait_settled(page, timeout=60_000)
    return page.evaluate(STEP)


def _keys(page) -> dict:
    page.mouse.click(5, page.viewport_size["height"] - 5)  # focus the page, not a widget
    start = page.evaluate(STEP)
    out = {"start": start}
    out["K"] = _press(page, "k", start)
    out["ArrowRight"] = _press(page, "ArrowRight", out["K"])
    out["J"] = _press(page, "j", out["ArrowRight"])
    out["ArrowLeft"] = _press(page, "ArrowLeft", out["J"])
    page.locator('[data-testid="stSlider"]').first.get_by_role("slider").focus()
    out["slider ArrowRight"] = _press(page, "ArrowRight", out["ArrowLeft"])
    page.mouse.click(5, page.viewport_size["height"] - 5)
    page.keyboard.press("p")
    page.wait_for_selector('[data-testid="stSidebar"]', timeout=60_000)
    M.wait_settled(page, timeout=60_000)  # the sidebar slid in
    out["P: sidebar"] = page.evaluate(SIDEBAR)
    out["P: link"] = page.url
    return out


def test_presentation_screens(chromium, server):
    ART.mkdir(exist_ok=True)
    seen, errors, keys = {}, [], None
    url = server.streamlit()
    with contextlib.ExitStack() as stack:
        from playwright.sync_api import sync_playwright

        p = stack.enter_context(sync_playwright())
        browser = p.chromium.launch(executable_path=M.CHROMIUM, args=M.CHROMIUM_ARGS,
                                    headless=True)
        stack.callback(browser.close)
        for screen in SCREENS:
            for name, query in PAGES.items():
                ctx, page = open_screen(browser, url + "/?" + query, screen, SCREENS)
                with contextlib.closing(ctx):
                    page.on("pageerror", lambda e: errors.append(str(e)))
                    seen[f"{screen}/{name}"] = {
                        "window": page.evaluate("() => [innerWidth, innerHeight, "
                                                "devicePixelRatio]"),
                        "sidebar": page.evaluate(SIDEBAR),
                        "first_chart_top": page.evaluate(FIRST_CHART),
                        "cut": page.evaluate(CUT) + page.evaluate(CHART_CUT), "smallest": page.evaluate(SMALLEST)}
                    if name == "cache":
                        page.screenshot(path=str(ART / f"e2e-present-{screen}.png"))
                        if screen == "1024":
                            keys = _keys(page)
    (ART / "e2e-present.json").write_text(json.dumps({"screens": seen, "keys": keys}, indent=1))
    if os.environ.get("KVVIZ_SCREENSHOT") == "1":
        shutil.copy(ART / "e2e-present-1024.png", REPO / "docs" / "images" / "screenshot-present-1024.png")
        shutil.copy(ART / "e2e-present-zoom150.png", REPO / "docs" / "images" / "screenshot-present-150.png")
    print(json.dumps({"screens": seen, "keys": keys}, indent=1))
    assert not errors, errors
    assert seen["zoom150/cache"]["window"] == [683, 512, 1.5]  # what 150 % zoom lays out
    for where, s in seen.items():
        h = s["window"][1]
        assert not s["sidebar"], where
        assert s["first_chart_top"] is not None and s["first_chart_top"] + 80 <= h, (where, s)
        assert not s["cut"], (where, s["cut"])
        assert s["smallest"]["n_chart"] > 5, (where, s)
        assert s["smallest"]["chart"][0][0] >= FLOOR, (where, s["smallest"])
        assert s["smallest"]["page"][0][0] >= FLOOR, (where, s["smallest"])
    k = keys
    assert k["K"] == k["start"] + 1 and k["ArrowRight"] == k["K"] + 1, k
    assert k["J"] == k["ArrowRight"] - 1 and k["ArrowLeft"] == k["J"] - 1, k
    assert k["slider ArrowRight"] == k["ArrowLeft"] + 1, k  # the slider's own key: one step
    assert k["P: sidebar"] and not re.search(r"[?&]present=", k["P: link"]), k
