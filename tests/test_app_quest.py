"""The Quest view: the pure figure and table on hand-built sets, and the page's view under
AppTest on the shipped vector trace (its numbers checked against kvviz.core directly)."""
from __future__ import annotations

import json

import apphelp
import numpy as np
from apphelp import arr, ok

from kvviz.app.figures.quest import MISSED_COLOUR, Side, quest_figure, quest_table
from kvviz.core.quest import eviction_memory, quest_memory


def side(held, label="A: tova", bps=9):
    mem = eviction_memory(len(held), kv_heads=1, head_dim=2, itemsize=2, bytes_per_slot=bps)
    return Side(label, "#E69F00", np.array(held, np.int64), 0.5, mem, mem.kv_bytes)


def test_figure_marks_both_skipped_and_evicted_reads_per_policy():
    fig = quest_figure(10, np.array([0, 1, 2, 3, 8, 9]), [side([0, 3, 4, 5, 9]), side([4], "B: h2o")],
                       page_size=2, token_budget=6)
    quest = next(tr for tr in fig.data if tr.name == "Quest reads")
    assert list(quest.x) == [0, 1, 2, 3, 8, 9]
    a = [tr for tr in fig.data if tr.y is not None and len(tr.y) and tr.y[0] == "A: tova"]
    assert [list(tr.x) for tr in a] == [[0, 3, 9], [4, 5], [1, 2, 8]]  # both, skipped, evicted
    assert a[2].marker.color == MISSED_COLOUR and a[2].marker.symbol == "x"
    b = [tr for tr in fig.data if tr.y is not None and len(tr.y) and tr.y[0] == "B: h2o"]
    assert [list(tr.x) for tr in b] == [[4], [0, 1, 2, 3, 8, 9]]  # (its "both" trace is empty)
    assert len(fig.layout.shapes) == 4  # page edges at 2, 4, 6, 8


def test_table_counts_and_bytes():
    q = quest_memory(10, kv_heads=1, head_dim=2, itemsize=2, page_size=2)  # 8 bytes a position
    df = quest_table(10, np.array([0, 1, 2, 3, 8, 9]), 0.75, q, 123, [side([0, 3, 4, 5, 9])])
    quest, a = df.iloc[0], df.iloc[1]
    assert (quest["positions in memory"], quest["read at this step"]) == (10, 6)
    assert (quest["KV bytes in memory"], quest["metadata or bookkeeping bytes"]) == (80, 5 * 8)
    assert quest["memory (bytes)"] == 120 and quest["bytes read this step"] == 123
    assert quest["attention read"] == "0.7500" and quest.isna()["both read"]
    assert (a["both read"], a["Quest reads, evicted"], a["held, Quest skips"]) == (3, 3, 2)
    # 5 held x 8 bytes of keys and values, 5 x 9 bytes of bookkeeping
    assert (a["KV bytes in memory"], a["metadata or bookkeeping bytes"], a["memory (bytes)"]) == (40, 45, 85)


def test_the_quest_view_on_the_shipped_trace_matches_the_core(apptest):
    from kvviz.core.quest import contrast, quest_reads
    from kvviz.core.replay import run_policy
    from kvviz.core.trace import load_trace

    at = apphelp.app(timeout=180, view="quest", trace="file:code-vec.npz", layer=29, step=250,
                     a="tova", b="h2o", budget=64)
    ok(at)
    trace = load_trace("traces/code-vec.npz", layer=29)
    reads = quest_reads(trace, 250, page_size=16, token_budget=64)
    read = np.unique(np.concatenate(list(reads.values())))
    spec = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Step 250"))
    quest = next(d for d in spec["data"] if d["name"] == "Quest reads")
    assert arr(quest["x"]).tolist() == read.tolist()
    df = at.table[0].value
    rows = {r["cache"]: r for r in df.to_dict("records")}
    assert rows["Quest"]["positions in memory"] == 250
    assert rows["Quest"]["read at this step"] == len(read)
    pages = -(-250 // 16)
    assert rows["Quest"]["metadata or bookkeeping bytes"] == pages * 3 * 64 * 2 * 2
    assert rows["Quest"]["KV bytes in memory"] == 250 * 3 * 64 * 2 * 2
    for label, name in (("A: tova", "tova"), ("B: h2o", "h2o")):
        run = run_policy(trace, name, 64)
        held = run.held_at(249)
        c = contrast(read, held)
        r = rows[label]
        assert r["positions in memory"] == len(held) == 64
        assert (r["both read"], r["Quest reads, evicted"], r["held, Quest skips"]) == \
            (len(c["both"]), len(c["evicted_read"]), len(c["held_skipped"]))
        assert r["memory (bytes)"] == 64 * 768 + 64 * run.bytes_per_slot
    assert at.query_params["quest.budget"] == "64" and at.query_params["quest.page"] == "16"


def test_a_trace_without_vectors_offers_the_shipped_one(apptest):
    at = apphelp.app(timeout=180, view="quest", step=100)  # the canonical trace: no vectors
    ok(at)
    assert any("has none" in i.value for i in at.info)
    at.button(key="quest.open").click().run()
    ok(at)
    assert at.query_params["trace"] == "file:code-vec.npz"
    assert at.table[0].value.iloc[0]["cache"] == "Quest"
