"""Every scene of every shipped lesson (lessons/*.toml) presented on a classroom projector, in
a real browser (Debian's chromium driven by playwright, never `playwright install`): 1024x768,
and the same screen at 125 % browser zoom (an 819x614 CSS-pixel window at device scale 1.25;
tests/test_e2e_projector.py says why that is the zoomed screen).

For each scene, opened in presentation mode: the scene's main element (its first chart, or
for a view drawn without one, its first table) is whole on the first screen; the chart's
plots (the union of its plot areas) take at least 45 % of the window's height; its title,
legend, axis titles and subplot titles do not overlap one another; when the view has other
charts, they wait behind one control (an expander), not above the main one. One browser, one
page a screen: the first scene is opened by its link, the next ones by the page's own key
(N), as a lecturer moves on. The readings go to artifacts/e2e-scenes.json, a screenshot a
scene and screen to artifacts/e2e-scene-N-SCREEN.png.

Missing chromium or playwright: a failure when KVVIZ_REQUIRE_E2E=1 (CI), a skip otherwise.
"""
import contextlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402
from test_e2e_projector import SCREENS  # noqa: E402

from kvviz.app.teach import lesson as L  # noqa: E402

ART = REPO / "artifacts"
SHARE = 0.45  # of the window's height: the main chart's plots at least this tall
# the main element of the page's view, its plots and the boxes of its labels
MEASURE = """() => {
  const main = document.querySelector('[data-testid="stMain"]');
  const box = e => { const r = e.getBoundingClientRect();
                     return {top: r.top, bottom: r.bottom, left: r.left, right: r.right}; };
  const shown = e => e.offsetParent !== null && e.getBoundingClientRect().height > 20;
  const chart = [...main.querySelectorAll('[data-testid="stPlotlyChart"]')].find(shown);
  const table = [...main.querySelectorAll('[data-testid="stTable"]')].find(shown);
  const more = !!main.querySelector('.st-key-kv-more');
  const out = {window: [innerWidth, innerHeight, devicePixelRatio], more, table: null,
               chart: null, plots: null, labels: []};
  if (table) out.table = box(table);
  if (!chart) return out;
  out.chart = box(chart);
  // the chart is the main one: no other chart drawn above it
  out.above = [...main.querySelectorAll('[data-testid="stPlotlyChart"]')]
      .filter(e => shown(e) && e !== chart && e.getBoundingClientRect().top < out.chart.top).length;
  const plots = [...chart.querySelectorAll('.draglayer .nsewdrag')].map(box)
      .filter(p => p.bottom > p.top);
  if (plots.length) out.plots = {top: Math.min(...plots.map(p => p.top)),
                                 bottom: Math.max(...plots.map(p => p.bottom))};
  const named = [['title', '.g-gtitle'], ['legend', '.legend'], ['x title', '.g-xtitle'],
                 ['y title', '.g-ytitle'], ['subplot title', '.annotation']];
  for (const [what, sel] of named)
    for (const e of chart.querySelectorAll(sel))
      if (e.getBoundingClientRect().width > 0 && e.textContent.trim())
        out.labels.push({what, text: e.textContent.trim().slice(0, 40), ...box(e)});
  for (const sel of ['.g-x2title', '.g-y2title', '.g-x3title', '.g-y3title'])
    for (const e of chart.querySelectorAll(sel))
      if (e.getBoundingClientRect().width > 0 && e.textContent.trim())
        out.labels.push({what: 'axis title', text: e.textContent.trim().slice(0, 40), ...box(e)});
  return out;
}"""


def overlaps(labels: list[dict], slack: float = 2.0) -> list[tuple[str, str]]:
    """Pairs of labels whose boxes cross by more than `slack` px each way."""
    out = []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            w = min(a["right"], b["right"]) - max(a["left"], b["left"])
            h = min(a["bottom"], b["bottom"]) - max(a["top"], b["top"])
            if w > slack and h > slack:
                out.append((f"{a['what']} {a['text']!r}", f"{b['what']} {b['text']!r}"))
    return out


def test_overlaps_reads_crossing_boxes():
    a = dict(what="title", text="t", top=0, bottom=20, left=0, right=100)
    b = dict(what="legend", text="l", top=15, bottom=40, left=50, right=120)
    c = dict(what="x title", text="x", top=21, bottom=40, left=0, right=40)
    assert overlaps([a, b, c]) == [("title 't'", "legend 'l'")]


def _wait_scene(page, n: int, total: int) -> None:
    page.wait_for_function(
        "([n, t]) => [...document.querySelectorAll('[data-testid=\"stMarkdownContainer\"] p')]"
        ".some(e => e.textContent.startsWith(`Scene ${n}/${t}`))", arg=[n, total],
        timeout=240_000)
    page.wait_for_function(  # its chart, or its table (a view drawn without a chart)
        "() => !!document.querySelector('[data-testid=\"stMain\"] [data-testid=\"stPlotlyChart\"]"
        " .main-svg, [data-testid=\"stMain\"] [data-testid=\"stTable\"]')", timeout=240_000)
    M.wait_settled(page, timeout=240_000)


def test_every_scene_is_whole_and_large_on_the_projector(chromium, server):
    ART.mkdir(exist_ok=True)
    url = server.streamlit()
    seen, errors, bad = {}, [], []
    with contextlib.ExitStack() as stack:
        from playwright.sync_api import sync_playwright

        p = stack.enter_context(sync_playwright())
        browser = p.chromium.launch(executable_path=M.CHROMIUM, args=M.CHROMIUM_ARGS,
                                    headless=True)
        stack.callback(browser.close)
        for name in L.names():
            les = L.load(name)
            total = len(les.scenes)
            for screen, ((w, h), scale) in SCREENS.items():
                ctx = browser.new_context(viewport={"width": w, "height": h},
                                          device_scale_factor=scale)
                stack.callback(ctx.close)
                page = ctx.new_page()
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(f"{url}/?lesson={name}&scene=1&present=1")
                for n in range(1, total + 1):
                    if n > 1:
                        page.locator("body").press("n")  # the next scene, as the lecturer
                    _wait_scene(page, n, total)
                    m = page.evaluate(MEASURE)
                    page.screenshot(path=str(ART / f"e2e-scene-{name}-{n}-{screen}.png"))
                    where = f"{name} scene {n} ({les.scene(n).state.view}) at {screen}"
                    seen[where] = m
                    bad += [f"{where}: {why}" for why in _problems(m)]
    (ART / "e2e-scenes.json").write_text(json.dumps(seen, indent=1))
    assert not errors, errors
    assert not bad, "\n".join(bad)


def _problems(m: dict) -> list[str]:
    h = m["window"][1]
    if m["chart"] is None:  # a view without a chart: its table whole on the first screen
        if m["table"] is None:
            return ["no chart and no table"]
        t = m["table"]
        return [] if t["top"] >= 0 and t["bottom"] <= h + 1 else [f"table at {t}, window {h}"]
    out = []
    c = m["chart"]
    if c["top"] < 0 or c["bottom"] > h + 1:
        out.append(f"chart {c['top']:.0f}–{c['bottom']:.0f} px not whole in a {h} px window")
    if m["above"]:
        out.append(f"{m['above']} other chart(s) above the main one")
    plots = m["plots"]
    if plots is None or plots["bottom"] - plots["top"] < SHARE * h:
        tall = None if plots is None else round(plots["bottom"] - plots["top"])
        out.append(f"plots {tall} px tall, under {SHARE:.0%} of {h} px")
    for a, b in overlaps(m["labels"]):
        out.append(f"{a} overlaps {b}")
    return out
