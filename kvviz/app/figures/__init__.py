"""Pure figure builders for the explorer: data in, Plotly figure (or HTML) out.

No Streamlit import anywhere in this package, so every view is testable on its own.
"""
from kvviz.app.figures.cache import cache_heatmap, heatmap_grid, state_labels
from kvviz.app.figures.divergence import decision_step, divergence_figure, divergent_positions, only_sets
from kvviz.app.figures.metrics import metrics_table, sweep_figure
from kvviz.app.figures.scores import (
                     defended_positions,
                     eviction_order,
                     neighbourhood_figure,
                     why_figure,
                     why_rows,
                     why_table,
)
from kvviz.app.figures.states import (
                     first_divergence,
                     held_mask,
                     next_divergence,
                     recent_held_fraction,
                     sinks_held,
                     states_at,
                     symmetric_difference,
)
from kvviz.app.figures.survival import survival_figure
from kvviz.app.figures.tokens import token_strip_html, token_timeline_figure

__all__ = [
    "cache_heatmap", "heatmap_grid", "state_labels", "decision_step", "divergence_figure",
    "divergent_positions", "only_sets", "metrics_table", "sweep_figure", "defended_positions",
    "eviction_order", "neighbourhood_figure", "why_figure", "why_rows", "why_table", "first_divergence",
    "held_mask", "next_divergence", "recent_held_fraction", "sinks_held", "states_at",
    "symmetric_difference", "survival_figure", "token_strip_html", "token_timeline_figure",
]
