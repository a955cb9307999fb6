"""The "Model in the loop" view in a real browser (Debian chromium via playwright, as
tests/test_e2e.py): the page opens on the view from a link, draws the perplexity chart,
the ΔNLL strip and chart and the cache heatmap from the fixture results, and redraws when
the policy changes.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402

ART = REPO / "artifacts"
FIX = REPO / "tests" / "fixtures" / "loop"


def test_loop_view_in_chromium(chromium, server):
    ART.mkdir(exist_ok=True)
    errors = []
    url = server.streamlit({"KVVIZ_LOOP_DIR": str(FIX)})
    with M.browser(viewport=(1500, 2400)) as page:
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/?trace=canonical&budget=512&view=loop", timeout=120_000)
        M.wait_chart_text(page, "What eviction costs", timeout=120_000)
        M.wait_chart_text(page, "Where eviction hurt", timeout=60_000)
        M.wait_chart_text(page, "Cache contents over time", timeout=60_000)
        M.wait_idle(page, timeout=60_000)
        text = M.chart_text(page)
        assert "full cache" in text and "tova @ 32" in text  # tova, middle budget: the defaults
        strip = page.locator('[data-testid="kv-loop-strip"]')
        assert strip.count() == 1
        first = strip.locator("span.kv-tok").nth(1).get_attribute("title")
        assert "p(true token) full cache" in first
        page.screenshot(path=str(ART / "e2e-loop-01.png"))
        # choose another policy: the ΔNLL chart's title follows
        box = page.locator('[data-testid="stSelectbox"]',
                           has=page.get_by_text("policy", exact=True))
        box.locator('[role="combobox"]').click()
        page.get_by_role("option", name="streaming-llm", exact=True).click()
        M.wait_chart_text(page, "streaming-llm @", timeout=60_000)
        M.wait_idle(page, timeout=60_000)
        page.screenshot(path=str(ART / "e2e-loop-02.png"))
    assert not errors, errors
