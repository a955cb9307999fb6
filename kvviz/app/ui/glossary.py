"""One glossary for the whole page, opened from beside the view selector (every view)."""
from __future__ import annotations

import streamlit as st

from kvviz.app.explain import policy_entries

GLOSSARY = {
    "retained mass": "At each step after the first eviction, the share of the model's attention "
                     "(in the full, uncompressed trace) that falls on positions the cache still "
                     "holds, averaged over those steps; 1 = nothing the model looked at was "
                     "missing. Attention loss = 1 − retained mass.",
    "heavy-hitter recall": "The heavy hitters are the budget/4 positions with the most attention "
                           "received so far in the full trace (H2O, Zhang et al. 2023); recall "
                           "is the share of them the cache holds, averaged over steps.",
    "|A Δ B|": "The symmetric difference: positions held by exactly one of the two policies at "
               "a step. 0 means both caches are identical.",
    "window sum": "SnapKV: the attention a slot received over the last obsWindow observed steps.",
    "pooled envelope": "SnapKV: each slot's pooled score, the largest window sum among its "
                       "poolKernel nearest held slots (itself in the middle). A slot next to a "
                       "heavy hitter is lifted by it, so phrases stay whole (Li et al. 2024, "
                       "SnapKV).",
    "defended": "A slot whose own window sum would have been evicted, kept because a "
                "neighbour's sum raised its pooled score.",
    "uniform share": "Scissorhands: 1 / (slots held), the attention every slot would get if "
                     "attention were spread evenly; a slot below it at a step counts as "
                     "unimportant then (Liu et al. 2023, Scissorhands).",
    "epoch": "The canonical synthetic trace redraws its heavy hitters every 512 steps; each "
             "512-step stretch is an epoch, stationary inside.",
    "sink": "The first positions (0–3): models park attention there whatever the text "
            "(Xiao et al. 2024, StreamingLLM, 'attention sinks').",
    "memory bytes": "What the policy's bookkeeping costs at this budget: budget × bytes per slot "
                    "(position, scores, and SnapKV's obsWindow history ring), the cards' memory "
                    "layout. Not the keys and values themselves.",
    "budget": "How many key/value positions each policy may hold; beyond it, one is evicted per "
              "new token.",
    "step": "One decode step: the new token is admitted, then the policy evicts down to the "
            "budget. The views show the state after that eviction.",
}


def entries() -> dict[str, str]:
    """The terms above, then one entry per registered policy (read from the registry each
    time, so a plugin appears too)."""
    return {**GLOSSARY, **policy_entries()}


def glossary_popover() -> None:
    with st.popover("Glossary", width="stretch"):
        st.markdown("\n".join(f"- **{k}**: {v}" for k, v in entries().items()))
