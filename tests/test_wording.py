"""Sentences the page prints that used to leave the reader guessing: which difference, what a
symbol means, which score a policy with no pooling ranks by. Each is checked against the
library's own numbers."""
import json

from apphelp import app, ok

from kvviz.app import explain
from kvviz.app.ui.view_loop import model_caption
from kvviz.core.metrics import evaluate
from kvviz.core.policies import defaults
from kvviz.core.trace import canonical


def test_the_metrics_caption_says_b_minus_a_and_which_is_higher(apptest):
    at = app(trace="canonical", budget=512, a="tova", b="h2o", view="metrics")
    ok(at)
    trace = canonical()
    m = {n: evaluate(trace, n, 512, **defaults(n)) for n in ("tova", "h2o")}
    ra, rb = m["tova"]["retained_mass"], m["h2o"]["retained_mass"]
    assert ra != rb
    higher = "higher than" if rb > ra else "lower than"
    want = f"retained mass: B minus A = {rb - ra:+.6f} (B's is {higher} A's)"
    assert any(want in c.value for c in at.caption), [c.value for c in at.caption]
    assert not any("differ by" in c.value for c in at.caption)


def test_the_status_line_says_what_a_delta_b_counts(apptest):
    at = app()
    ok(at)
    from kvviz.app.engine import Engine
    from kvviz.app.figures.states import divergence_steps, symmetric_difference

    ea, eb = (Engine(canonical(), n, 512, defaults(n)).evicted_at for n in ("tova", "snapkv"))
    step = int(divergence_steps(ea, eb)[0])  # where the default page opens
    diff = int(symmetric_difference(ea, eb)[step])
    line = next(m.value for m in at.markdown if "**|A Δ B|**" in m.value)
    assert f"**|A Δ B|** {diff} held by one only ·" in line


def test_a_result_without_its_model_says_so_plainly():
    said = model_caption({})
    assert "does not name its model" in said and "recorded before results" not in said
    assert model_caption({"model": "m", "model_source": "hf"}).startswith("model: m (hf")


def test_no_pooling_is_not_called_pooled():
    panel = dict(kept=[0, 1, 2], scores={"pooled": [0.1, 0.2, 0.3], "sums": [0.1, 0.2, 0.3],
                                         "candidate": [True, True, True]},
                 victims=[0], policy="snapkv", label="A: snapkv (poolKernel=1)",
                 params={"pool_kernel": 1})
    d = explain.decision("A", panel, 0)
    assert d.score_label == "window sum (poolKernel 1: nothing pooled)"
    pooled = explain.decision("A", {**panel, "params": {"pool_kernel": 5}}, 0)
    assert pooled.score_label == "pooled window sum"


def test_the_page_with_pooling_off_says_window_sum(apptest):
    at = app(trace="file:prose.npz", layer=0, budget=128, a="snapkv", a__poolKernel=1,
             b="snapkv", step=299, view="divergence")
    ok(at)
    text = " ".join(m.value for m in at.markdown)
    a_part = text.split("A, snapkv (poolKernel=1),", 1)[1].split("B, snapkv", 1)[0]
    assert "window sum (poolKernel 1: nothing pooled)" in a_part
    assert "pooled window sum" not in a_part
    at = app(trace="file:prose.npz", layer=0, budget=128, a="snapkv", a__poolKernel=1,
             b="snapkv", step=299, view="scores")
    ok(at)
    names = {t.get("name") for c in at.get("plotly_chart")
             for t in json.loads(c.proto.spec)["data"]}
    assert "pooled envelope (poolKernel 1: the window sum itself)" in names
