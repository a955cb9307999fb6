"""The Heads view: the pure figure on hand-built counts, and the page's view under AppTest on
the shipped multi-head trace (its numbers checked against kvviz.core.layers directly)."""
from __future__ import annotations

import json
from pathlib import Path

import apphelp
import numpy as np
import pytest
from apphelp import arr, ok

from kvviz.app.figures.heads import heads_figure, needle_heads_figure, position_figure
from kvviz.app.ui.view_heads import key_holding


def test_heads_figure_draws_each_head_solid_and_its_plain_scorer_dashed():
    held = np.array([[[1, 2, 2], [1, 2, 3]]])  # one layer, two heads, three steps
    plain = np.array([[[1, 2, 2], [1, 2, 2]]])
    fig = heads_figure(held, plain, [14], [2], label="adakv (tova)", plain_label="tova alone",
                       budget=2, roles=[(True, False)], step=1)
    lines = fig.data
    assert len(lines) == 4  # per head: the allocator, then the plain scorer
    # a head's role is its layer's: the legend names both
    assert [tr.name for tr in lines] == ["kv0 retrieval (layer 14): adakv (tova)",
                                         "kv0: tova alone",
                                         "kv1 streaming (layer 14): adakv (tova)",
                                         "kv1: tova alone"]
    assert lines[2].y.tolist() == [1, 2, 3] and lines[3].y.tolist() == [1, 2, 2]
    assert lines[1].line.dash == "dash" and lines[0].line.dash is None
    assert lines[0].line.color == lines[1].line.color != lines[2].line.color
    assert fig.layout.annotations[0].text == "layer 14 (per-head budget 2)"
    assert fig.layout.title.text == "Held slots per KV head: adakv (tova) vs tova alone @ 2"


def test_heads_figure_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="held and plain must both be"):
        heads_figure(np.zeros((1, 2, 3)), np.zeros((1, 2, 4)), [0], [2], label="a",
                     plain_label="b", budget=2)
    with pytest.raises(ValueError, match="layers and budgets must name the 1 layers"):
        heads_figure(np.zeros((1, 2, 3)), np.zeros((1, 2, 3)), [0, 1], [2], label="a",
                     plain_label="b", budget=2)


def test_the_heads_view_shows_the_allocators_counts(apptest):
    from kvviz.core.layers import load_layers, replay_layers
    from kvviz.core.policies import make_policy

    at = apphelp.app(timeout=180, view="heads")
    ok(at)
    at.sidebar.selectbox(key="heads.allocator").set_value("headroles").run()
    ok(at)
    spec = chart_titled(at, "Held slots")
    assert spec["layout"]["title"]["text"] == ("Held slots per KV head: headroles (tova) vs "
                                               "tova alone @ 64")
    want = replay_layers(load_layers("traces/code-kv.npz"), make_policy("headroles", 64))
    solid = [t for t in spec["data"] if "alone" not in t["name"]]
    assert len(solid) == 9  # three layers x three KV heads
    for d in range(3):
        for g in range(3):
            assert arr(solid[3 * d + g]["y"]).tolist() == want.held[d, g].tolist()
    assert sum("retrieval" in t["name"] for t in solid) == 6  # two of three heads per layer
    assert any("total 192 of 192" in c.value for c in at.caption)


def chart_titled(at, start: str) -> dict:
    """The figure JSON of the page's chart whose title starts with `start`."""
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return next(s for s in specs if s["layout"]["title"]["text"].startswith(start))


def test_a_link_chooses_the_allocator_scorer_and_budget_and_the_page_writes_them_back(apptest):
    from kvviz.core.layers import load_layers, replay_layers
    from kvviz.core.policies import make_policy

    at = apphelp.app(timeout=180, view="heads", heads__allocator="headroles", heads__scorer="h2o",
                     heads__budget=96)
    ok(at)
    assert at.sidebar.selectbox(key="heads.allocator").value == "headroles"
    assert at.sidebar.selectbox(key="heads.scorer").value == "h2o"
    assert at.sidebar.number_input(key="heads.budget").value == 96
    spec = chart_titled(at, "Held slots")
    assert spec["layout"]["title"]["text"] == "Held slots per KV head: headroles (h2o) vs h2o alone @ 96"
    want = replay_layers(load_layers("traces/code-kv.npz"), make_policy("headroles", 96, scorer="h2o"))
    solid = [t for t in spec["data"] if "alone" not in t["name"]]
    assert arr(solid[0]["y"]).tolist() == want.held[0, 0].tolist()
    at.sidebar.selectbox(key="heads.scorer").set_value("snapkv").run()
    ok(at)
    assert at.query_params["heads.scorer"] == "snapkv"
    assert at.query_params["heads.allocator"] == "headroles"
    assert at.query_params["heads.budget"] == "96"


def test_a_bad_heads_link_is_said_and_the_defaults_shown(apptest):
    at = apphelp.app(timeout=180, view="heads", heads__allocator="nope", heads__scorer="nope",
                     heads__budget=4)
    ok(at)
    warned = " ".join(w.value for w in at.warning)
    assert "heads.allocator=nope: no such allocator here; showing adakv" in warned
    assert "heads.scorer=nope: no such policy here; showing tova" in warned
    assert "heads.budget=4 is outside 8–512; using 64" in warned
    assert chart_titled(at, "Held slots")["layout"]["title"]["text"].endswith("tova alone @ 64")


def test_eviction_grid_reads_each_runs_own_log():
    from kvviz.app.figures.heads import eviction_grid
    from kvviz.core.replay import NEVER, Run

    def run(ev):
        return Run(policy="p", params={}, budget=1, steps=3, evicted_at=np.array(ev),
                   retained=np.zeros(3))

    runs = [[run([1, 2, NEVER]), run([NEVER, 2, NEVER])]]
    assert eviction_grid(runs, 0).tolist() == [[1, NEVER]]
    assert eviction_grid(runs, 1).tolist() == [[2, 2]]


def test_position_figure_shows_each_heads_eviction_step_or_held():
    ev = np.array([[5, -1], [7, 9]])  # two layers, two heads; -1: held to the end
    plain = np.array([[-1, -1], [6, 8]])
    fig = position_figure(ev, plain, [0, 14], position=3, steps=12, label="adakv (tova)",
                          plain_label="tova alone")
    left, right = fig.data
    assert [list(r) for r in left.text] == [["5", "held"], ["7", "9"]]
    assert [list(r) for r in right.text] == [["held", "held"], ["6", "8"]]
    assert np.asarray(left.z).tolist() == [[5, 12], [7, 9]]  # held coloured as the last step
    assert list(left.y) == ["layer 0", "layer 14"] and list(left.x) == ["kv0", "kv1"]
    assert (left.zmin, left.zmax) == (3, 12)
    assert [a.text for a in fig.layout.annotations] == ["adakv (tova)", "tova alone"]
    assert fig.layout.title.text.startswith("Position 3:")
    with pytest.raises(ValueError, match="evicted and plain must both be"):
        position_figure(ev, plain[:1], [0, 14], position=3, steps=12, label="a", plain_label="b")
    with pytest.raises(ValueError, match="layers must name the 2 layers"):
        position_figure(ev, plain, [0], position=3, steps=12, label="a", plain_label="b")


def test_needle_heads_figure_shows_the_files_numbers():
    fig = needle_heads_figure([[3, 1]], [[2, 2]], [[0.5, 0.25]], label_a="adakv:tova @ 4",
                              label_b="tova @ 4")
    a, b, mass = fig.data
    assert np.asarray(a.z).tolist() == [[3, 1]] and np.asarray(b.z).tolist() == [[2, 2]]
    assert np.asarray(mass.z).tolist() == [[0.5, 0.25]]
    assert [list(r) for r in mass.text] == [["0.5000", "0.2500"]]
    assert [x.text for x in fig.layout.annotations] == ["held: adakv:tova @ 4", "held: tova @ 4",
                                                        "key attention (full cache)"]
    with pytest.raises(ValueError, match="must all be"):
        needle_heads_figure([[3, 1]], [[2, 2]], [[0.5]], label_a="a", label_b="b")


def test_needle_heads_figure_shows_the_key_tokens_each_head_holds():
    fig = needle_heads_figure([[3, 1]], [[2, 2]], [[0.5, 0.25]], label_a="A", label_b="B",
                              key_held_a=[[2, 0]], key_held_b=[[1, 2]], key_tokens=2)
    a, b, _ = fig.data
    assert np.asarray(a.z).tolist() == [[2, 0]] and np.asarray(b.z).tolist() == [[1, 2]]
    assert [list(r) for r in a.text] == [["2/2", "0/2"]]
    assert [list(r) for r in a.customdata] == [["2 of the key's 2 tokens, 3 slots held",
                                                "0 of the key's 2 tokens, 1 slots held"]]
    assert (a.zmin, a.zmax) == (0, 2)
    assert fig.layout.annotations[0].text == "key tokens held: A"
    with pytest.raises(ValueError, match="key_tokens must be the key's token count"):
        needle_heads_figure([[3, 1]], [[2, 2]], [[0.5, 0.25]], label_a="A", label_b="B",
                            key_held_a=[[3, 0]], key_held_b=[[1, 2]], key_tokens=2)
    with pytest.raises(ValueError, match="key_held_a and key_held_b must be"):
        needle_heads_figure([[3, 1]], [[2, 2]], [[0.5, 0.25]], label_a="A", label_b="B",
                            key_held_a=[[2]], key_held_b=[[1, 2]], key_tokens=2)


def test_key_holding_counts_whole_part_and_none():
    assert key_holding("X", [[5, 2], [0, 5], [0, 1]], 5) == (
        "X: 2 of 6 heads hold the whole key, 2 part of it, 2 none of it.")


def test_shipped_pass_key_files_count_key_tokens_within_what_each_head_holds():
    for path in sorted(Path("traces/alloc/needle").glob("*.json")):
        data = json.loads(path.read_text())
        n_key = len(data["key_positions"])
        for r in data["rows"]:
            held, key = np.array(r["held"]), np.array(r["key_held"])
            assert key.shape == held.shape, (path.name, r["name"])
            assert ((0 <= key) & (key <= np.minimum(held, n_key))).all(), (path.name, r["name"])


def test_the_heads_view_tracks_a_position_across_heads(apptest):
    from kvviz.core.layers import load_layers, replay_layers
    from kvviz.core.policies import make_policy
    from kvviz.core.replay import run_policy

    at = apphelp.app(timeout=180, view="heads")
    ok(at)
    at.number_input(key="heads.position").set_value(40).run()
    ok(at)
    spec = chart_titled(at, "Position 40:")
    grid = load_layers("traces/code-kv.npz")
    found = replay_layers(grid, make_policy("adakv", 64, scorer="tova"))
    want = [[r.evicted_at[40] for r in row] for row in found.runs]
    alone = [[run_policy(tr, "tova", 64).evicted_at[40] for tr in row] for row in grid]
    for shown, runs in zip(spec["data"], (want, alone)):
        assert shown["text"] == [["held" if v < 0 else str(int(v)) for v in row] for row in runs]
    assert any(v >= 0 for row in want for v in row)  # something was evicted at this budget
    caption = next(c.value for c in at.caption if "evicted position 40 of 512" in c.value)
    assert "layer 0: " + ", ".join(f"kv{g}={'held' if v < 0 else v}" for g, v in
                                   enumerate(want[0])) in caption


def test_the_heads_view_shows_a_pass_key_prompts_heads_from_the_files(apptest):
    at = apphelp.app(timeout=180, view="heads")
    ok(at)
    at.selectbox(key="heads.needle.prompt").set_value("L512-d50-s0").run()
    ok(at)
    assert at.selectbox(key="heads.needle.a").value == "adakv:tova @ 128"
    assert at.selectbox(key="heads.needle.b").value == "tova @ 128"
    data = json.loads(open("traces/alloc/needle/L512-d50-s0.json").read())
    rows = {(r["name"], r["budget"]): r for r in data["rows"]}
    spec = chart_titled(at, "Pass key per")
    a, b, mass = spec["data"]
    assert arr(a["z"]).tolist() == rows["adakv:tova", 128]["key_held"]
    assert arr(b["z"]).tolist() == rows["tova", 128]["key_held"]
    assert np.array_equal(arr(mass["z"]), np.array(data["key_mass"]))
    n_key = len(data["key_positions"])
    slots = rows["adakv:tova", 128]["held"][0][0]
    assert a["customdata"][0][0] == (f"{rows['adakv:tova', 128]['key_held'][0][0]} of the key's "
                                     f"{n_key} tokens, {slots} slots held")
    at.selectbox(key="heads.needle.a").set_value("headroles:tova @ 64").run()
    ok(at)
    spec = chart_titled(at, "Pass key per")
    held = rows["headroles:tova", 64]["key_held"]
    assert arr(spec["data"][0]["z"]).tolist() == held
    assert any(repr(rows["headroles:tova", 64]["answer"]) in c.value for c in at.caption)
    whole = sum(v == n_key for row in held for v in row)
    none = sum(v == 0 for row in held for v in row)
    cells = sum(len(row) for row in held)
    assert any(f"headroles:tova @ 64: {whole} of {cells} heads hold the whole key, "
               f"{cells - whole - none} part of it, {none} none of it." in c.value for c in at.caption)


def test_the_heads_view_presented_draws_no_sidebar_and_no_trace_navigation(apptest):
    """Presentation mode: the link's allocator, scorer and budget with no sidebar; neither
    here nor in the explorer the step slider or status line of the page's trace, which
    move nothing on this chart."""
    room = apphelp.app(timeout=180, view="heads", present=1, heads__allocator="headroles",
                       heads__scorer="h2o", heads__budget=96)
    ok(room)
    assert not list(room.sidebar.children.values())
    spec = chart_titled(room, "Held slots")
    assert "headroles (h2o) vs h2o alone @ 96" in spec["layout"]["title"]["text"]
    for at in (room, apphelp.app(timeout=180, view="heads")):
        ok(at)
        assert "w.step" not in [s.key for s in at.slider]
        assert not [m.value for m in at.markdown if "evicted at step" in m.value]


def test_the_heads_legend_has_a_line_for_each_entry_and_names_each_roles_layer():
    """With roles, one entry per (layer, head) role: each names its layer, and the figure is
    as tall as its legend's entries (it never scrolls)."""
    held = np.ones((3, 3, 4), int)
    roles = [(True, False, True)] * 3
    fig = heads_figure(held, held, [0, 7, 14], [2, 2, 2], label="headroles (tova)",
                       plain_label="tova alone", budget=2, roles=roles)
    shown = [t.name for t in fig.data if t.showlegend]
    assert len(shown) == len(set(shown))  # no two entries alike
    assert "kv0 retrieval (layer 7): headroles (tova)" in shown
    assert fig.layout.height >= 150 + 24 * len(shown)
