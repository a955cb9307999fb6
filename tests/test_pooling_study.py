"""The pooling study's pooled span counts agree with kvviz.core.spans.span_integrity, and it runs."""
import pytest

from kvviz.core.replay import run_policy
from kvviz.core.spans import attention_spans, received, span_integrity
from kvviz.core.trace import canonical
from lab.pooling_study import integrity, markdown, study


def test_integrity_at_one_checkpoint_matches_span_integrity():
    trace = canonical(600)
    totals = received(trace)
    spans = attention_spans(trace, totals=totals)
    for kernel in (1, 5):
        run = run_policy(trace, "snapkv", 64, pool_kernel=kernel)
        for step in (200, 599):
            ours = integrity(trace, run, spans, totals, [step])
            ref = span_integrity(trace, run, spans=spans, step=step, totals=totals)
            assert ref["n_spans"] > 0
            for key, ref_key in (("whole", "whole"), ("frag", "fragmented"), ("dropped", "dropped")):
                assert ours[key] == pytest.approx(ref[ref_key])


def test_study_table_and_markdown():
    df = study([("canonical", None, canonical(300))], budgets=[64], kernels=[1, 3])
    assert list(df["policy"]) == ["tova", "snapkv (poolKernel=1)", "snapkv (poolKernel=3)", "h2o",
                                  "streaming-llm"]
    assert df["retained_mass"].between(0, 1).all() and df["words_whole"].isna().all()
    text = markdown(df)
    assert "#### Canonical trace" in text and "| snapkv (poolKernel=3) |" in text


def test_study_with_average_pooling_rows():
    """--pooling max,avg adds an avg row per kernel above 1, and it is the avg policy's run."""
    trace = canonical(300)
    df = study([("canonical", None, trace)], budgets=[64], kernels=[1, 3], poolings=("max", "avg"))
    assert list(df["policy"]) == ["tova", "snapkv (poolKernel=1)", "snapkv (poolKernel=3)",
                                  "snapkv (poolKernel=3, pooling=avg)", "h2o", "streaming-llm"]
    from kvviz.core.metrics import summary

    avg = df.set_index("policy").loc["snapkv (poolKernel=3, pooling=avg)", "retained_mass"]
    assert avg == summary(trace, run_policy(trace, "snapkv", 64, pool_kernel=3, pooling="avg"))["retained_mass"]
