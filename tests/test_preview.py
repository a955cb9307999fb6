"""The cache view's first-visit preview: the heatmap's server-built PNG as plain HTML, so the
first chart is on screen before the browser has loaded Plotly (kvviz.app.ui.view_cache).

AppTest checks what the page sends (the preview on a session's first run, the same image as
the Plotly figure, then no more); Chromium checks what a visitor sees: with Plotly's script
never arriving the preview is drawn, and once the page has settled the Plotly heatmap
replaces it and answers a hover.
"""
import json
import re
import sys

from apphelp import REPO, app, ok
from figurehelp import png_to_codes

from kvviz.app.ui.view_cache import preview_html

sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M

SRC = re.compile(r"<img src='([^']+)'")
LINE = re.compile(r"<b style='top:(\d+)px;")


def previews(at) -> list[str]:
    return [m.value for m in at.markdown if "kv-preview" in m.value]


def heatmap(at) -> dict:
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return next(s for s in specs if s["data"][0]["type"] == "image")


def test_first_run_sends_the_heatmap_png_before_the_plotly_chart_then_stops(apptest):
    at = app(step=1300)
    ok(at)
    (html,) = previews(at)
    fig = heatmap(at)
    src = SRC.search(html).group(1)
    assert src == fig["data"][0]["source"]  # the very image the Plotly chart draws
    assert png_to_codes(src).shape == (512, 512)  # 4,096 steps aggregated to 512 pixels
    assert fig["layout"]["title"]["text"] in html
    assert fig["data"][1]["type"] == "heatmap" and fig["data"][1]["text"]  # hover still sent
    at.run()  # a rerun in the same session: Plotly is on the page by now
    ok(at)
    assert previews(at) == [] and heatmap(at)


def test_preview_step_line_follows_the_step():
    fig = {"data": [{"source": "data:image/png;base64,"}],
           "layout": {"title": {"text": "A <&> B"}, "yaxis": {"range": [4095.5, -0.5]},
                      "height": 560, "margin": {"l": 60, "r": 20, "t": 70, "b": 90}}}
    tops = [int(LINE.search(preview_html(fig, s)).group(1)) for s in (0, 2048, 4095, 9999)]
    assert tops[0] == 70 and tops[2] == 470 and tops[3] == 470  # the plot area: 70..470 px
    assert abs(tops[1] - 270) <= 1
    assert "height:560px;padding:70px 20px 90px 60px" in preview_html(fig, 0)
    assert "A &lt;&amp;&gt; B" in preview_html(fig, 0)  # the title is escaped


def test_preview_draws_without_plotly_and_gives_way_to_it(chromium, server):
    q = "/?trace=canonical&budget=512&a=tova&b=snapkv&view=cache&step=1300"
    url = server.streamlit()
    with M.browser() as page:
        page.route("**/PlotlyChart*", lambda route: None)  # plotly.js never arrives
        page.goto(url + q)
        page.wait_for_function(M.PIXELS_JS, timeout=120_000, polling="raf")
        assert page.evaluate("() => document.querySelector('.kv-preview img').naturalWidth"
                             ) == 512
        assert page.query_selector(M.CHART_SEL + " .main-svg") is None
    with M.browser() as page:
        page.goto(url + q)
        M.wait_hover(page)  # the Plotly heatmap drew and shows a hover label
        label = page.eval_on_selector(M.CHART_SEL + " .hoverlayer .hovertext",
                                      "e => e.textContent")
        assert "steps" in label and "positions" in label
        assert not page.is_visible(".kv-preview")  # hidden once Plotly has drawn
