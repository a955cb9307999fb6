"""The page on a classroom projector, in a real browser (Debian's chromium driven by
playwright, never `playwright install`): 1024x768, and the same screen at 125 % browser
zoom, a projector's usual fix.

Browser zoom in Chromium scales the CSS pixel: at 125 % a 1024x768 window lays the page out
in 819x614 CSS pixels with devicePixelRatio 1.25. Playwright cannot press Ctrl+plus, so the
zoomed screen is a 819x614 viewport with device_scale_factor 1.25: the same layout and the
same rendered pixels (`document.body.style.zoom` is not: it scales the page inside an
unchanged window and breaks Streamlit's measurements).

On each screen and each page a class opens first (the default heatmap, an experiment open,
Compare all, Divergence, a per-head trace): the first chart's top is on the first screen
with room to show it, no button, label, chosen value, table or status line is cut (an
element whose content is wider than its box, or past the window's right edge), the status
line keeps "first divergence: step N" on one line, and with the sidebar collapsed its "»"
does not cover the title. Screenshots of the default page on both screens go to artifacts/,
and to docs/images/screenshot-1024.png and docs/images/screenshot-zoom125.png when KVVIZ_SCREENSHOT=1.

Missing chromium or playwright: a failure when KVVIZ_REQUIRE_E2E=1 (CI), a skip otherwise.
"""
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402

ART = REPO / "artifacts"
SCREENS = {"1024": ((1024, 768), 1), "zoom125": ((819, 614), 1.25)}
PAGES = {  # what a class opens first
    "default": "",
    "experiment": "exp=budget-256",  # opens the experiment: its text above its chart
    "compare": "trace=file:prose.npz&budget=128&view=compare",
    "divergence": "view=divergence&step=600",
    "head": "trace=file:code-kv.npz&head=kv1",
    "heads": "view=heads",  # the Heads view: its chart above the fold (its choices in the sidebar)
}
FIRST_CHART = """() => {
  const c = [...document.querySelectorAll('[data-testid="stMain"] [data-testid="stPlotlyChart"]')]
      .find(e => e.offsetParent && e.getBoundingClientRect().height > 50);
  return c ? c.getBoundingClientRect().top : null;
}"""
# every control's text and every small table, in the main area and the sidebar: cut when its
# content is wider than its box (an ellipsis, or hidden overflow) or runs past the window
CUT = """() => {
  const text = e => (e.tagName === 'INPUT' ? e.value : e.textContent).trim();
  const cut = e => e.offsetParent !== null && text(e)
      && (e.scrollWidth > e.clientWidth + 1
          || e.getBoundingClientRect().right > window.innerWidth + 1);
  // a select box shows its chosen value in an <input>: cut when the text is wider than it
  const sel = ['button', 'button *', '[data-testid="stWidgetLabel"] *',
               '[data-testid="stSelectbox"] input',
               '[data-testid="stMarkdownContainer"] p', '[data-testid="stTable"]',
               '[data-testid="stDataFrame"]',
               '[data-testid="stCaptionContainer"]'].join(',');
  return [...new Set([...document.querySelectorAll(sel)].filter(cut)
      .map(e => (e.dataset.testid || e.tagName) + ': ' + text(e).slice(0, 60)))];
}"""
STATUS_LINES = """() => {
  const p = [...document.querySelectorAll('[data-testid="stMarkdownContainer"] p')]
      .find(e => /first.divergence/.test(e.textContent));
  if (!p) return null;
  const walker = document.createTreeWalker(p, NodeFilter.SHOW_TEXT);
  let node;
  while ((node = walker.nextNode())) {
    const i = node.textContent.search(/first.divergence/);
    if (i < 0) continue;
    const m = node.textContent.slice(i).match(/^first.divergence:.(step.\\d+|none)/);
    const r = document.createRange();
    r.setStart(node, i);
    r.setEnd(node, i + (m ? m[0].length : 16));
    return new Set([...r.getClientRects()].map(x => Math.round(x.top))).size;
  }
  return null;
}"""
TITLE_CLEAR = """() => {
  const h = document.querySelector('[data-testid="stMain"] h4');
  const c = document.querySelector('[data-testid="stExpandSidebarButton"]');
  if (!h || !c) return null;
  const r = document.createRange();
  r.selectNodeContents(h);
  const t = r.getBoundingClientRect(), b = c.getBoundingClientRect();
  const overlap = !(b.right <= t.left || t.right <= b.left || b.bottom <= t.top
                    || t.bottom <= b.top);
  // what is drawn at the title's first letters: the title, not the header over it
  const at = document.elementFromPoint(t.left + 4, (t.top + t.bottom) / 2);
  return {overlap, visible: !!at && h.contains(at), button: [b.left, b.top, b.right, b.bottom],
          title: [t.left, t.top, t.right, t.bottom]};
}"""


def open_screen(browser, url, screen, screens=SCREENS):
    """A page at one of `screens` (viewport, zoom as device scale), its charts drawn."""
    (w, h), scale = screens[screen]
    ctx = browser.new_context(viewport={"width": w, "height": h}, device_scale_factor=scale)
    page = ctx.new_page()
    page.goto(url)
    page.wait_for_selector('[data-testid="stMain"] [data-testid="stPlotlyChart"] .main-svg',
                           state="attached", timeout=240_000)
    M.wait_settled(page, timeout=240_000)  # the last layout pass after the charts draw
    return ctx, page


def test_projector_screens(chromium, server):
    ART.mkdir(exist_ok=True)
    seen, errors = {}, []
    url = server.streamlit()
    with contextlib.ExitStack() as stack:
        from playwright.sync_api import sync_playwright

        p = stack.enter_context(sync_playwright())
        browser = p.chromium.launch(executable_path=M.CHROMIUM, args=M.CHROMIUM_ARGS,
                                    headless=True)
        stack.callback(browser.close)
        for screen in SCREENS:
            for name, query in PAGES.items():
                if name == "compare" and not (REPO / "traces" / "prose.npz").exists():
                    continue
                if name in ("head", "heads") and not (REPO / "traces" / "code-kv.npz").exists():
                    continue
                ctx, page = open_screen(browser, url + "/?" + query, screen)
                with contextlib.closing(ctx):
                    page.on("pageerror", lambda e: errors.append(str(e)))
                    inner = page.evaluate("() => [innerWidth, innerHeight, devicePixelRatio]")
                    top = page.evaluate(FIRST_CHART)
                    cut = page.evaluate(CUT)
                    lines = page.evaluate(STATUS_LINES)
                    seen[f"{screen}/{name}"] = {"window": inner, "first_chart_top": top,
                                                "cut": cut, "status_lines": lines}
                    if name == "default":
                        page.screenshot(path=str(ART / f"e2e-projector-{screen}.png"))
                        # the sidebar collapsed: its "»" clear of the title
                        page.locator('[data-testid="stSidebar"]').hover()  # shows the button
                        page.locator('[data-testid="stSidebarCollapseButton"] button').click(
                            force=True)
                        page.wait_for_selector('[data-testid="stExpandSidebarButton"]')
                        M.wait_settled(page)  # the sidebar's slide-out transition ended
                        seen[f"{screen}/collapsed"] = page.evaluate(TITLE_CLEAR)
                        page.screenshot(path=str(ART / f"e2e-projector-{screen}-collapsed.png"))
    (ART / "e2e-projector.json").write_text(json.dumps(seen, indent=1))
    if os.environ.get("KVVIZ_SCREENSHOT") == "1":
        shutil.copy(ART / "e2e-projector-1024.png", REPO / "docs" / "images" / "screenshot-1024.png")
        shutil.copy(ART / "e2e-projector-zoom125.png", REPO / "docs" / "images" / "screenshot-zoom125.png")
    print(json.dumps(seen, indent=1))
    assert not errors, errors
    assert seen["zoom125/default"]["window"] == [819, 614, 1.25]  # what 125 % zoom lays out
    for where, s in seen.items():
        if where.endswith("collapsed"):
            assert s is not None and not s["overlap"] and s["visible"], (where, s)
            continue
        h = s["window"][1]
        # the chart's title and its first rows: at least 80 CSS px of it on the first screen
        assert s["first_chart_top"] is not None and s["first_chart_top"] + 80 <= h, (where, s)
        assert not s["cut"], (where, s["cut"])
        if s["status_lines"] is not None:
            assert s["status_lines"] == 1, (where, "status line splits 'first divergence: step N'")
