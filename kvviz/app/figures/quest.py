"""The Quest contrast: which positions query-aware page selection reads at one step against
what each eviction policy still holds, and the memory each costs.

Pure: positions and byte counts in (from kvviz.core.quest and the runs' eviction logs), a
Plotly figure and a table out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from kvviz.app.figures.common import base_layout
from kvviz.core.quest import Memory, contrast

QUEST_COLOUR = "#332288"    # indigo: Quest's reads (no policy's colour)
MISSED_COLOUR = "#CC3311"   # a position Quest reads that the policy has evicted
SKIPPED_COLOUR = "#BBBBBB"  # a position the policy holds that Quest does not read this step


@dataclass(frozen=True)
class Side:
    """One eviction policy at the step: its label, colour, the positions it holds when the
    step's query is made, the share of the step's attention on them and its memory."""

    label: str
    colour: str
    held: np.ndarray
    mass: float
    memory: Memory
    read_bytes: int  # the keys and values attention reads at this step: all it holds


def quest_figure(step: int, read: np.ndarray, sides: list[Side], *, page_size: int,
                 token_budget: int, height: int = 340) -> go.Figure:
    """One row per cache over positions 0..step-1: Quest's reads (filled), then per policy
    the positions it holds that Quest reads too (its colour), holds but Quest skips (grey)
    and has evicted although Quest reads them (red crosses). Dotted lines mark Quest's pages."""
    read = np.asarray(read, dtype=np.int64)
    fig = go.Figure()
    quest_row = f"Quest reads (pages of {page_size}, budget {token_budget})"
    rows = [quest_row] + [s.label for s in sides]

    def dots(x, y, name, colour, symbol, group, show=True):
        fig.add_trace(go.Scatter(
            x=np.asarray(x, dtype=np.int64), y=[y] * len(x), mode="markers", name=name,
            legendgroup=group, showlegend=show,
            marker=dict(symbol=symbol, color=colour, size=8, line=dict(width=1, color=colour)),
            hovertemplate="position %{x}<extra>" + name + "</extra>"))

    dots(read, quest_row, "Quest reads", QUEST_COLOUR, "square", "quest")
    for i, s in enumerate(sides):
        c = contrast(read, s.held)
        dots(c["both"], s.label, f"{s.label}: held, Quest reads it too", s.colour, "square", s.label)
        dots(c["held_skipped"], s.label, "held, Quest skips it this step", SKIPPED_COLOUR,
             "square-open", "skipped", show=i == 0)
        dots(c["evicted_read"], s.label, "evicted, Quest reads it", MISSED_COLOUR, "x",
             "missed", show=i == 0)
    for edge in range(page_size, step, page_size):
        fig.add_vline(x=edge - 0.5, line=dict(color="#DDDDDD", width=1, dash="dot"))
    base_layout(fig, f"Step {step}: what Quest reads vs what each policy holds", height,
                legend_below=True)
    fig.update_xaxes(title="position", range=[-1, max(step, 1)])
    fig.update_yaxes(categoryorder="array", categoryarray=rows[::-1], type="category")
    return fig


def quest_table(step: int, read: np.ndarray, quest_mass: float, quest_memory: Memory,
                quest_read_bytes: int, sides: list[Side]) -> pd.DataFrame:
    """One row for Quest, one per policy: positions in memory and read at the step, the
    contrast counts, the share of the step's attention read, and bytes (in memory, of which
    page metadata or the policy's bookkeeping, read at this step)."""
    read = np.asarray(read, dtype=np.int64)
    rows = [{"cache": "Quest", "positions in memory": quest_memory.positions,
             "read at this step": len(read), "both read": None, "Quest reads, evicted": None,
             "held, Quest skips": None, "attention read": f"{quest_mass:.4f}",
             "KV bytes in memory": quest_memory.kv_bytes,
             "metadata or bookkeeping bytes": quest_memory.metadata_bytes,
             "memory (bytes)": quest_memory.total, "bytes read this step": quest_read_bytes}]
    for s in sides:
        c = contrast(read, s.held)
        rows.append({"cache": s.label, "positions in memory": s.memory.positions,
                     "read at this step": len(s.held), "both read": len(c["both"]),
                     "Quest reads, evicted": len(c["evicted_read"]),
                     "held, Quest skips": len(c["held_skipped"]), "attention read": f"{s.mass:.4f}",
                     "KV bytes in memory": s.memory.kv_bytes,
                     "metadata or bookkeeping bytes": s.memory.policy_bytes,
                     "memory (bytes)": s.memory.total, "bytes read this step": s.read_bytes})
    # counts with a gap where they mean nothing (Quest against itself): nullable integers
    return pd.DataFrame(rows).astype({c: "Int64" for c in
                                      ("both read", "Quest reads, evicted", "held, Quest skips")})
