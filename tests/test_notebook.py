"""The step-by-step view in a notebook (kvviz.app.notebook): what each view sends to the browser
(a bounded window of steps, the step marks moved per step, the scores per step) agrees with an
independent replay and with the eviction logs; every picture is a plain Plotly figure too; bad
arguments are refused naming the parameter; the example notebooks run top to bottom.

The browser side (the step control moving the pictures) is tests/test_e2e_notebook.py.
"""
import os
from pathlib import Path

import numpy as np
import pytest
from apphelp import arr

import kvviz
from kvviz.app import notebook as nb
from kvviz.core.policies import make_policy, rank_of
from kvviz.core.replay import NEVER, Replay
from kvviz.model.loop import load_loop_result
from kvviz.model.needle.results import read_run

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "traces"
NEEDLE = TRACES / "needle" / "runs" / "L256-d10-s0-decode-layer.npz"


@pytest.fixture(scope="module")
def code():
    trace = kvviz.load_trace(TRACES / "code.npz")
    return trace, kvviz.run_policy(trace, "tova", 64), kvviz.run_policy(trace, "snapkv", 64)


def window_steps(view):
    return range(view.lo, view.hi + 1)


def step_marks(patch):
    return [sh for sh in patch["shapes"] if sh.get("name") == "step"]


def traces_of(fig: dict, axis: str):
    """The figure's traces drawn on x axis `axis` ("x", "x2")."""
    return [t for t in fig["data"] if t.get("xaxis", "x") == axis]


def test_a_replay_view_sends_a_window_around_the_step_and_says_so(code, long_run):
    trace, a, b = code
    view = nb.replay(trace, a, b, step=300, window=6)
    assert (view.lo, view.hi, view.step, view.steps) == (297, 302, 300, 1024)
    assert "steps 297–302 of 0–1023" in view.note
    assert [m["name"] for m in view.marked] == ["cache", "survival"]
    assert view.pictures == ["cache", "survival", "scores"]
    assert len(view.marks) == len(view.frames) == 6
    for patch, s in zip(view.marks, window_steps(view)):
        cache, survival = patch
        assert [(sh["y0"], sh["y1"]) for sh in step_marks(cache)] == [(s, s)]  # the heatmap's line
        assert [an["text"] for an in cache["annotations"] if an.get("name") == "step"] == [f"step {s}"]
        lines = step_marks(survival)  # one dotted line per panel, along x
        assert len(lines) == 2 and all(sh["x0"] == sh["x1"] == s for sh in lines)
    # the whole run fits: nothing said
    toy = kvviz.load_trace(TRACES / "toy.npz")
    short = nb.replay(toy, kvviz.run_policy(toy, "tova", 8), step=10, window=32)
    assert (short.lo, short.hi, short.note, len(short.frames)) == (0, 15, "", 16)


def test_each_step_s_scores_are_the_policy_s_own_replayed_independently(code):
    trace, a, b = code
    view = nb.replay(trace, a, b, step=500, window=4)
    for frame, s in zip(view.frames, window_steps(view)):
        fig = frame[0]
        assert f"at step {s}" in fig["layout"]["title"]["text"]
        for axis, run in (("x", a), ("x2", b)):
            rp = Replay(trace, make_policy(run.policy, budget=64))
            rp.seek(s - 1)
            kept, scores = rp.peek(s)
            drawn = traces_of(fig, axis)
            bars = [t for t in drawn if t["type"] == "bar"]
            x = arr(bars[0]["x"]).astype(np.int64)
            idx = np.searchsorted(kept, x)
            assert np.array_equal(kept[idx], x)  # held slots, in cache order
            key = "sums" if "sums" in scores else rank_of(run.policy).key
            want = np.asarray(scores[key], float)[idx]
            got = arr(bars[0]["y"]).astype(float)
            assert np.allclose(np.where(want > 0, want, np.nan), got, equal_nan=True)
            victims = np.flatnonzero(run.evicted_at == s)
            marked = [t for t in drawn if t.get("name", "").startswith("victim")]
            shown = arr(marked[0]["x"]).astype(np.int64) if marked else np.array([], np.int64)
            assert np.array_equal(np.sort(shown), np.intersect1d(victims, x))
        assert any(t.get("name", "").startswith("victim") for t in fig["data"])  # tova or snapkv evicts


def test_to_figure_is_the_picture_the_widget_draws(code):
    trace, a, b = code
    view = nb.replay(trace, a, b, step=200, window=3)
    for frame, s in zip(view.frames, window_steps(view)):
        assert nb._spec(view.to_figure("scores", step=s)) == frame[0]
    cache = view.to_figure("cache")
    assert cache.layout.title.text.startswith("Cache contents over time: A = tova @ 64")
    assert [sh.y0 for sh in cache.layout.shapes if sh.name == "step"] == [200]
    assert [sh.x0 for sh in view.to_figure("survival", step=150).layout.shapes if sh.name == "step"] == [150, 150]
    with pytest.raises(ValueError, match=r"name must be one of \['cache', 'survival', 'scores'\], got 'heads'"):
        view.to_figure("heads")


def test_a_step_outside_the_window_sends_the_window_around_it(code, long_run):
    trace, a, b = code
    view = nb.replay(trace, a, b, step=100, window=4)
    frames = view.frames
    view.step = 101  # inside: nothing re-sent
    assert view.frames is frames and (view.lo, view.hi) == (98, 101)
    view.step = 1023
    assert (view.lo, view.hi) == (1020, 1023) and view.frames is not frames
    assert step_marks(view.marks[-1][0])[0]["y0"] == 1023
    with pytest.raises(ValueError, match=r"step must be an integer in 0\.\.1023, got 1024"):
        view.step = 1024


def test_bad_arguments_are_refused_naming_them(code):
    trace, a, b = code
    with pytest.raises(ValueError, match=r"window must be an integer in 1\.\.1024"):
        nb.replay(trace, a, window=0)
    with pytest.raises(ValueError, match=r"step must be an integer in 0\.\.1023, got -1"):
        nb.replay(trace, a, step=-1)
    with pytest.raises(ValueError, match="run_a and run_b must be kvviz Runs, got dict"):
        nb.replay(trace, {"policy": "tova"})
    toy = kvviz.load_trace(TRACES / "toy.npz")
    with pytest.raises(ValueError, match="run of tova covers 1024 steps, the trace 16"):
        nb.replay(toy, a)
    result = load_loop_result(TRACES / "loop" / "code-layer.npz")
    with pytest.raises(ValueError, match=r"a must be a configuration's index or label, one of \['full', 'tova@64'"):
        nb.loop(result, "tova@65")
    with pytest.raises(ValueError, match=r"b must be an index in 0\.\.24 or a label, got 25"):
        nb.loop(result, 1, 25)
    with pytest.raises(ValueError, match=r"layer must be one of the stored layers \[0, 14, 29\], got 3"):
        nb.loop(result, 1, layer=3)
    with pytest.raises(ValueError, match=r"head must be in 0\.\.0, got 1"):
        nb.needle(read_run(NEEDLE), 1, head=1)


def test_a_needle_view_shows_the_held_slots_and_victims_its_log_says(code):
    run = read_run(NEEDLE)
    view = nb.needle(run, "tova@128", "streaming-llm(sinks=4)@128", layer=14, window=4)
    assert view.step == run["meta"]["prompt_len"] - 1  # the end of the prompt
    assert [m["name"] for m in view.marked] == ["cache", "survival"]
    keys = [sh for sh in view.marked[0]["figure"]["layout"]["shapes"] if sh.get("name") == "key"]
    assert keys and all(k in view.marks[0][0]["shapes"] for k in keys)  # the key stays shaded
    ev = np.asarray(run["evicted_at"])
    for frame, s in zip(view.frames, window_steps(view)):
        for axis, c in (("x", 1), ("x2", 6)):
            e = ev[c, 14, 0]
            held = np.flatnonzero((np.arange(len(e)) <= s) & ((e == NEVER) | (e >= s)))
            drawn = traces_of(frame[0], axis)
            x = arr(next(t for t in drawn if t["name"] == "held")["x"]).astype(np.int64)
            assert len(x) and np.isin(x, held).all()
            assert np.array_equal(x, held[np.searchsorted(held, x[0]):][:len(x)])  # contiguous slots
            victims = [t for t in drawn if t["name"].startswith("victim")]
            shown = arr(victims[0]["x"]).astype(np.int64) if victims else np.array([], np.int64)
            assert np.array_equal(np.sort(shown), np.intersect1d(np.flatnonzero(e == s), x))


def test_a_loop_view_replays_the_rows_the_model_produced():
    result = load_loop_result(TRACES / "loop" / "code-layer.npz")
    view = nb.loop(result, "tova@64", step=120, window=2)
    assert view.title == "loop, layer 0, mean" and (view.lo, view.hi) == (119, 120)
    rows = result.trace(1, 0)
    rp = Replay(rows, make_policy("tova", budget=64))
    rp.seek(119)
    kept, scores = rp.peek(120)
    bars = [t for t in view.frames[1][0]["data"] if t["type"] == "bar"]
    x = arr(bars[0]["x"]).astype(np.int64)
    assert np.allclose(arr(bars[0]["y"]), np.asarray(scores[rank_of("tova").key])[np.searchsorted(kept, x)])


def test_a_generation_view_shows_prompt_and_generated_tokens_and_its_log():
    from kvviz.model.loop import Generation, LoopConfig

    toy = kvviz.load_trace(TRACES / "toy.npz")  # 16 steps: 12 prompt tokens, 4 generated
    runs = [kvviz.run_policy(toy, "tova", 8), kvviz.run_policy(toy, "h2o", 8, recent_window=2)]
    ev = np.stack([np.full(16, NEVER)] + [r.evicted_at for r in runs])[:, None, None, :]
    gen = Generation(configs=[LoopConfig("full"), LoopConfig("tova", budget=8),
                              LoopConfig("h2o", {"recent_window": 2}, budget=8)],
                     granularity="layer", prompt_mode="decode", prompt_ids=np.arange(12),
                     tokens=list(toy.tokens[:12]), new_ids=np.ones((3, 4), np.int64),
                     logprobs=np.zeros((3, 4)), texts=[""] * 3, stopped=["length"] * 3, evicted_at=ev,
                     pieces=[list(toy.tokens[12:])] * 3)
    view = nb.generation(gen, "tova@8", 2, step=14, window=3)
    assert (view.lo, view.hi, view.steps) == (13, 15, 16)
    assert view.to_figure("cache").layout.title.text == ("Cache contents over time: A = tova @ 8, "
                                                         "B = h2o (recentWindow=2) @ 8")
    for frame, s in zip(view.frames, window_steps(view)):
        for axis, run in (("x", runs[0]), ("x2", runs[1])):
            e = run.evicted_at
            drawn = traces_of(frame[0], axis)
            held = np.flatnonzero((np.arange(16) <= s) & ((e == NEVER) | (e >= s)))
            assert np.array_equal(arr(next(t for t in drawn if t["name"] == "held")["x"]), held)  # 9 slots
            ticks = frame[0]["layout"]["xaxis" if axis == "x" else "xaxis2"]["ticktext"]
            assert ticks[-1].endswith(toy.tokens[s].strip()[:3])  # the newest: a generated token
    with pytest.raises(ValueError, match=r"layer must be one of the stored layers \[0\], got 1"):
        nb.generation(gen, 1, layer=1)


def test_a_heads_view_draws_the_allocator_s_heads_picture_with_its_step():
    view = nb.heads(TRACES / "code-kv.npz", "adakv", "snapkv", 64, layer=14, head=1, step=200, window=2)
    assert view.pictures == ["cache", "survival", "heads", "scores"]
    heads = view.marks[1][2]
    assert len(step_marks(heads)) == 3 and all(sh["x0"] == 200 for sh in step_marks(heads))  # per layer
    assert view.to_figure("heads").layout.title.text.startswith("Held slots per KV head: adakv (snapkv)")


def test_plotly_js_is_sent_from_the_installed_plotly_when_the_page_asks(code, monkeypatch):
    trace, a, _ = code
    view = nb.replay(trace, a, window=1)
    sent = []
    monkeypatch.setattr(view, "send", lambda content, buffers=None: sent.append((content, buffers)))
    view._answer(view, {"kind": "something else"}, [])
    assert sent == []
    view._answer(view, {"kind": "plotly.js?"}, [])
    (content, buffers), = sent
    assert content == {"kind": "plotly.js"}
    assert buffers[0].startswith(b"/**\n* plotly.js v") and b"window.Plotly = Plotly;" in buffers[0]


# --- the example notebooks ---------------------------------------------------------------

def execute(name: str, tmp_path, monkeypatch):
    """Run examples/NAME top to bottom in a fresh kernel (cwd `tmp_path`, this checkout's kvviz)."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    book = nbformat.read(REPO / "examples" / name, as_version=4)
    NotebookClient(book, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises on a cell's error
    return [c for c in book.cells if c.cell_type == "code"]


def widgets(cells) -> int:
    return sum("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for c in cells for o in c.outputs)


def test_the_replay_notebook_runs_top_to_bottom(long_run, tmp_path, monkeypatch):
    cells = execute("notebook_replay.ipynb", tmp_path, monkeypatch)
    assert widgets(cells) == 4  # replay, loop, needle, heads
    assert "Scores of the slots around position" in "".join(o.get("text", "") for c in cells for o in c.outputs)
    assert list(tmp_path.iterdir()) == []  # it writes nothing


def test_the_model_notebook_runs_top_to_bottom(torch_stack, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cells = execute("notebook_model.ipynb", tmp_path, monkeypatch)
    assert widgets(cells) == 1
    text = "".join(o.get("text", "") for c in cells for o in c.outputs)
    assert "tova@8" in text
    assert "Cache contents over time: A = tova @ 8, B = streaming-llm (sinks=2) @ 8" in text
