"""The Forgetting view in a real browser (Debian chromium via playwright, as
tests/test_e2e_loop.py): a link opens the view on the synthetic pass-key results
(tests/needle_fixture.py), the needle chart, the cache heatmap and the layers chart are
drawn and the prompt strip highlights the key.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402
import needle_fixture as NF  # noqa: E402

ART = REPO / "artifacts"


def test_needle_view_in_chromium(tmp_path, chromium, server):
    ART.mkdir(exist_ok=True)
    folder = NF.write_results(tmp_path / "needle", modes=("decode",))
    errors = []
    url = server.streamlit({"KVVIZ_NEEDLE_DIR": str(folder)})
    with M.browser(viewport=(1500, 2600)) as page:
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/?view=needle&nbudget=16&nlen=96&ndepth=50"
                  "&nseed=0&npol=tova&nvs=h2o", timeout=120_000)
        M.wait_chart_text(page, "Pass-key accuracy", timeout=120_000)
        M.wait_chart_text(page, "Cache contents over time", timeout=60_000)
        M.wait_chart_text(page, "Which layers still hold the key", timeout=60_000)
        M.wait_idle(page, timeout=60_000)
        text = M.chart_text(page)
        assert "budget 16" in text and "scissorhands" in text and "A lost the key" in text
        strip = page.locator('[data-testid="kv-needle-strip"]')
        assert strip.locator("span.kv-key").count() == len(NF.KEY)
        page.screenshot(path=str(ART / "e2e-needle-01.png"))
    assert not errors, errors
