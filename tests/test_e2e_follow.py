"""Follow the lecturer in a real browser (Debian's chromium driven by playwright, never
`playwright install`): two pages of one browser on one server. The lecturer's page opens a
class and shows its code; the second page opens `?follow=CODE` and shows the lecturer's
step; each time the lecturer presses K (next step) the follower's status line shows the new
step within a few seconds, with nobody touching the follower's page (its poll fragment
finds the class's new version and reruns it). The delays, from the key press to the
follower's new step on screen (and to the lecturer's own), are printed and written to
artifacts/e2e-follow.json.

Missing chromium or playwright: a failure when KVVIZ_REQUIRE_E2E=1 (CI), a skip otherwise.
"""
import contextlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402

ART = REPO / "artifacts"
MOVES = 5
STEP_RE = re.compile(r"evicted at step (\d+)")
MAIN = '[data-testid="stMain"]'
FIRST_CHART = f'{MAIN} [data-testid="stPlotlyChart"] .main-svg'


def shown_step(page) -> int | None:
    m = STEP_RE.search(page.locator(MAIN).inner_text())
    return int(m.group(1)) if m else None


def wait_step(page, step: int, timeout_s: float) -> float:
    """Seconds until the page's status line shows `step` (polled every 20 ms)."""
    t0 = time.monotonic()
    page.wait_for_function(
        "([sel, s]) => new RegExp('evicted at step ' + s + '(?!\\\\d)')"
        ".test(document.querySelector(sel).innerText)",
        arg=[MAIN, step], timeout=timeout_s * 1000, polling=20)
    return time.monotonic() - t0


def test_a_follower_moves_when_the_lecturer_does(chromium, server):
    ART.mkdir(exist_ok=True)
    errors, delays, lect_delays = [], [], []
    url = server.streamlit()
    with contextlib.ExitStack() as stack:
        from playwright.sync_api import sync_playwright

        p = stack.enter_context(sync_playwright())
        browser = p.chromium.launch(executable_path=M.CHROMIUM, args=M.CHROMIUM_ARGS,
                                    headless=True)
        stack.callback(browser.close)
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        lect, stu = ctx.new_page(), ctx.new_page()
        for page in (lect, stu):
            page.on("pageerror", lambda e: errors.append(str(e)))
        lect.goto(url + "/")
        lect.wait_for_selector(FIRST_CHART, state="attached", timeout=240_000)
        M.wait_idle(lect, timeout=240_000)
        lect.get_by_role("button", name="Open a class").click()
        side = lect.locator('[data-testid="stSidebar"]')
        side.get_by_text(re.compile(r"follow=[A-Z2-9]{6}")).wait_for(timeout=60_000)
        code = re.search(r"follow=([A-Z2-9]{6})", side.inner_text()).group(1)
        M.wait_idle(lect)
        assert f"{url}/?follow={code}" in side.inner_text()  # the whole link, to read out
        lect.screenshot(path=str(ART / "e2e-follow-lecturer.png"))
        start = shown_step(lect)
        assert start is not None

        stu.goto(f"{url}/?follow={code}")
        stu.wait_for_selector(FIRST_CHART, state="attached", timeout=240_000)
        stu.get_by_text(f"Following the lecturer of class {code}").wait_for(timeout=60_000)
        wait_step(stu, start, 30)
        for i in range(1, MOVES + 1):
            for page in (lect, stu):  # a lecturer talks between moves: both pages settled
                M.wait_settled(page)
            lect.locator("body").press("k")  # the step navigator's shortcut (nav.next)
            t0 = time.monotonic()
            wait_step(lect, start + i, 30)
            lect_s = time.monotonic() - t0
            lect_delays.append(round(lect_s, 3))
            delays.append(round(lect_s + wait_step(stu, start + i, 30), 3))
        assert shown_step(stu) == start + MOVES
        stu.screenshot(path=str(ART / "e2e-follow-student.png"))
    watch = re.search(r"^WATCH_S = ([\d.]+)", (REPO / "kvviz/app/ui/watch.py").read_text(), re.M)
    figures = {"watch_s": float(watch.group(1)), "code": code,
               "follower_s": delays, "median_s": statistics.median(delays), "max_s": max(delays),
               "lecturer_s": lect_delays, "load_1min": round(os.getloadavg()[0], 2)}
    (ART / "e2e-follow.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
    assert not errors, errors
    # the delays are a record (artifacts/e2e-follow.json), not a pass mark: a follower that
    # does not move fails its wait above
