"""The Forgetting view in a real browser (Debian chromium via playwright, as
tests/test_e2e_loop.py): a link opens the view on the synthetic pass-key results
(tests/needle_fixture.py), the needle chart, the cache heatmap and the layers chart are
drawn and the prompt strip highlights the key; the task box switches to the recall task
(tests/tasks_fixture.py), whose prompt marks the reminders and whose key-attention chart is
drawn from the run's attention file.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402
import needle_fixture as NF  # noqa: E402
import numpy as np  # noqa: E402
import tasks_fixture as TF  # noqa: E402

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


def test_task_box_opens_the_recall_task_in_chromium(tmp_path, chromium, server):
    from kvviz.studies.key_attention import save_attention

    ART.mkdir(exist_ok=True)
    needle = NF.write_results(tmp_path / "needle", modes=("decode",))
    tasks = TF.write_tasks(tmp_path / "tasks")
    att = np.full((TF.LAYERS, 256), 0.02, np.float32)
    for a, b in TF.REMINDERS:
        att[:, a:b] = 0.1
    save_attention(tasks, {"id": "recall3-L256-d10-s0-decode-layer", "key_positions": TF.KEY_POS,
                           "reminders": TF.REMINDERS}, att)
    errors = []
    url = server.streamlit({"KVVIZ_NEEDLE_DIR": str(needle), "KVVIZ_TASKS_DIR": str(tasks)})
    with M.browser(viewport=(1500, 4200)) as page:
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/?view=needle", timeout=120_000)
        M.wait_chart_text(page, "Pass-key accuracy", timeout=120_000)
        M.wait_idle(page, timeout=60_000)
        box = page.locator('[data-testid="stSelectbox"]', has=page.get_by_text("task", exact=True))
        box.locator('[role="combobox"]').click()
        page.get_by_role("option", name="recall: a reminder every 3 sentences", exact=True).click()
        M.wait_chart_text(page, "Recall: a reminder every 3 sentences", timeout=60_000)
        M.wait_chart_text(page, "The key's attention at each prompt step", timeout=60_000)
        M.wait_idle(page, timeout=60_000)
        strip = page.locator('[data-testid="kv-needle-strip"]')
        assert strip.locator("span.kv-rem").count() == sum(b - a for a, b in TF.REMINDERS)
        assert "a reminder" in page.locator('[data-testid="kv-needle-legend"]').inner_text()
        assert "tova" in M.chart_text(page)  # its cross on the attention chart
        page.screenshot(path=str(ART / "e2e-needle-02-recall.png"))
    assert not errors, errors
