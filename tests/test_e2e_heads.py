"""The Heads view in a real browser (Debian chromium via playwright, as tests/test_e2e.py): the
page opens on the view from a link and draws one panel per stored layer of the per-KV-head
trace; its caption's counts obey each allocator's rules (adakv: the layer's total is heads x
budget, no head under its floor, the heads unequal; pyramidkv: per-layer budgets falling with
depth, their mean the budget, every head of a layer at its layer's budget; headroles: the
legend names retrieval and streaming heads, a streaming head holds its sinks and recent window).
"""
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402

ART = REPO / "artifacts"
BUDGET = 64


def last_step(page) -> dict:
    """{layer: [count per head]} and {layer: (total, of)} from the caption under the chart."""
    text = page.get_by_text("At the last step:").first.text_content()
    counts, totals = {}, {}
    for lay, heads, total, of in re.findall(r"layer (\d+): ([^()]*)\(total (\d+) of (\d+)\)", text):
        counts[int(lay)] = [int(n) for n in re.findall(r"kv\d+=(\d+)", heads)]
        totals[int(lay)] = (int(total), int(of))
    return counts, totals


def choose(page, label: str, option: str) -> None:
    box = page.locator('[data-testid="stSelectbox"]', has=page.get_by_text(label, exact=True))
    box.locator('[role="combobox"]').click()
    page.keyboard.type(option)  # the sidebar's list opens as a filter box: type, then Enter
    page.keyboard.press("Enter")


def test_heads_view_in_chromium(chromium, server):
    ART.mkdir(exist_ok=True)
    errors = []
    url = server.streamlit()
    with M.browser(viewport=(1500, 1400)) as page:
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/?view=heads", timeout=120_000)
        M.wait_chart_text(page, "Held slots per KV head: adakv", timeout=120_000)
        M.wait_idle(page, timeout=120_000)
        text = M.chart_text(page)
        assert all(f"layer {lay} (per-head budget {BUDGET})" in text for lay in (0, 14, 29)), text
        counts, totals = last_step(page)
        assert sorted(counts) == [0, 14, 29]
        floor = int(0.2 * BUDGET)
        for lay, heads in counts.items():
            assert len(heads) == 3
            assert totals[lay] == (sum(heads), 3 * BUDGET)  # the layer's whole budget, shared
            assert min(heads) >= floor
        assert any(len(set(h)) > 1 for h in counts.values())  # slots moved between heads
        page.screenshot(path=str(ART / "e2e-heads-adakv.png"))

        choose(page, "allocator", "pyramidkv")
        M.wait_chart_text(page, "Held slots per KV head: pyramidkv", timeout=120_000)
        M.wait_idle(page, timeout=120_000)
        titles = re.findall(r"layer (\d+) \(per-head budget (\d+)\)", M.chart_text(page))
        per_layer = {int(lay): int(b) for lay, b in titles}
        assert sorted(per_layer) == [0, 14, 29]
        assert per_layer[0] > per_layer[14] > per_layer[29]  # deeper layers keep fewer
        assert sum(per_layer.values()) == 3 * BUDGET  # the same total as a uniform budget
        counts, totals = last_step(page)
        for lay, heads in counts.items():
            assert heads == [per_layer[lay]] * 3
            assert totals[lay] == (3 * per_layer[lay], 3 * per_layer[lay])

        choose(page, "allocator", "headroles")
        M.wait_chart_text(page, "Held slots per KV head: headroles", timeout=120_000)
        M.wait_idle(page, timeout=120_000)
        text = M.chart_text(page)
        assert "retrieval" in text and "streaming" in text
        counts, totals = last_step(page)
        for lay, heads in counts.items():
            assert totals[lay] == (sum(heads), 3 * BUDGET)
            assert min(heads) == 4 + 28  # a streaming head: its sinks and recent window
            assert max(heads) > BUDGET  # the retrieval heads hold the rest
        page.screenshot(path=str(ART / "e2e-heads-headroles.png"))
    assert not errors, errors
