"""Open a sweep's results.parquet (from `python -m kvviz sweep`) in the Metrics view and
draw it as small multiples by trace and layer."""
from __future__ import annotations

import importlib.util
import io

import pandas as pd
import streamlit as st

from kvviz.app.figures.metrics import METRIC_LABELS
from kvviz.app.figures.sweep import check_results, sweep_grid_figure
from kvviz.app.ui.present import chart

CHART = dict(width="stretch", config={"displaylogo": False, "scrollZoom": False})


def read_results(data: bytes) -> pd.DataFrame:
    try:
        df = pd.read_parquet(io.BytesIO(data))
    except Exception as exc:  # pyarrow's errors vary by what is wrong with the file
        raise ValueError(f"could not be read as Parquet ({type(exc).__name__}: {exc})") from None
    check_results(df)
    return df


def pyarrow_available() -> bool:
    return importlib.util.find_spec("pyarrow") is not None


def render(ctx=None) -> None:
    st.subheader("A sweep's results")
    if not pyarrow_available():
        st.info("Opening a sweep's results.parquet needs pyarrow: "
                "`pip install -r requirements-scale.txt`.")
        return
    up = st.file_uploader("results.parquet of `python -m kvviz sweep` (docs/sweeps.md)",
                          type=["parquet"], key="w.sweep_file")
    if up is None:
        st.caption("Run a grid of traces, layers, policies and budgets with "
                   "`python -m kvviz sweep SPEC.toml --out DIR`, then open DIR/results.parquet here.")
        return
    try:
        df = read_results(up.getvalue())
    except ValueError as exc:
        st.error(f"{up.name}: {exc}")
        return
    metric = st.radio("metric", ["retained_mass", "hh_recall", "attention_loss", "memory_bytes"],
                      horizontal=True, key="w.sweep_file_metric",
                      format_func=lambda m: METRIC_LABELS.get(m, m))
    failed = df[df["status"] != "ok"]
    st.caption(f"{len(df)} cells, {len(failed)} failed (left out of the plot)"
               + (f"; kvviz {', '.join(map(str, df['kvviz_version'].unique()))}"
                  if "kvviz_version" in df.columns else ""))
    chart(sweep_grid_figure(df, metric), key="chart.sweep_file", **CHART)
    if len(failed):
        st.dataframe(failed[[c for c in ("trace", "layer", "policy", "budget", "error")
                             if c in failed.columns]], hide_index=True)
