"""The shipped trace per KV head with key and query vectors (traces/code-kv-vec.npz): what it
holds, and the page opening it from the refusal of a policy that reads vectors, showing R-KV
and Expected Attention from the library's own replays."""
from __future__ import annotations

import json
import re
from pathlib import Path

import apphelp
import numpy as np
import pytest
from apphelp import arr, ok

from kvviz.core.policies import make_policy
from kvviz.core.replay import Replay, stream_vectors
from kvviz.core.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
VEC = TRACES / "code-kv-vec.npz"
SMOLLM2_ROPE_THETA = 100000.0  # SmolLM2-135M's config: rope_parameters.rope_theta


def test_the_shipped_vector_trace_holds_every_kv_heads_vectors():
    """256 tokens of graphlib.py, layers 0, 14 and 29, heads mean and kv0..kv2, under 2 MB;
    its head-mean rows and its vectors are the same capture as code-vec.npz's first 256
    positions (causal attention does not see the rest), and head kv1 hands a policy KV head
    1's keys and query heads 3, 4 and 5."""
    assert VEC.stat().st_size < 2_000_000
    with np.load(VEC, allow_pickle=False) as npz, np.load(TRACES / "code-vec.npz", allow_pickle=False) as vec:
        assert npz["heads"].tolist() == ["mean", "kv0", "kv1", "kv2"]
        assert npz["layers"].tolist() == [0, 14, 29]
        assert npz["keys"].shape == (3, 3, 256, 64) and npz["queries"].shape == (3, 9, 256, 64)
        assert np.array_equal(npz["keys"], vec["keys"][:, :, :256])
        assert np.array_equal(npz["queries"], vec["queries"][:, :, :256])
        assert np.array_equal(npz["attn"][:, 0], vec["attn"][:, 0, :256 * 255 // 2])
        assert npz["tokens"].tolist() == vec["tokens"][:256].tolist()
    t = load_trace(VEC, layer=14, head="kv1")
    keys, queries = stream_vectors(t)
    assert np.array_equal(keys, t.keys[1, 1]) and np.array_equal(queries, t.queries[1, 3:6])


def test_expected_attention_takes_the_traces_rope_base(long_run):
    """Both shipped vector traces record SmolLM2-135M's RoPE base (meta rope_theta). Expected
    Attention's rope_theta left at its default takes it: the replay is the one given
    rope_theta=100000, bit for bit, and not the one a trace recording another base gives. A
    rope_theta that is not the trace's, or none on a trace recording none, is refused by name."""
    for path in (VEC, TRACES / "code-vec.npz"):
        assert load_trace(path).meta["rope_theta"] == SMOLLM2_ROPE_THETA
    t = load_trace(VEC, layer=29, head="kv0")
    runs = {}
    for label, params in (("default", {}), ("given", {"rope_theta": SMOLLM2_ROPE_THETA})):
        replay = Replay(t, make_policy("expected-attention", budget=64, **params))
        runs[label] = (replay.peek(200)[1]["score"], replay.run())
    (s_default, default), (s_given, given) = runs["default"], runs["given"]
    assert np.array_equal(s_default, s_given, equal_nan=True)
    assert np.array_equal(default.evicted_at, given.evicted_at) and np.array_equal(default.held, given.held)
    other = load_trace(VEC, layer=29, head="kv0")
    other.meta["rope_theta"] = 10000.0
    assert not np.array_equal(Replay(other, make_policy("expected-attention", budget=64)).run().evicted_at,
                              default.evicted_at)
    with pytest.raises(ValueError, match=r"expected-attention's rope_theta=10000 is not the RoPE base "
                                         r"trace 'code-kv-vec' records \(100000\): pass rope_theta=100000"):
        Replay(t, make_policy("expected-attention", budget=64, rope_theta=10000.0))
    del other.meta["rope_theta"]
    with pytest.raises(ValueError, match="expected-attention's rope_theta is by default the run's RoPE "
                                         "base, and trace 'code-kv-vec' records none: pass rope_theta="):
        Replay(other, make_policy("expected-attention", budget=64))
    assert Replay(other, make_policy("expected-attention", budget=64, rope_theta=SMOLLM2_ROPE_THETA)).run() \
        .evicted_at.tolist() == default.evicted_at.tolist()  # a base given serves a trace recording none


def _status(at) -> str:
    return next(m.value for m in at.markdown if "holds **" in m.value)


def _bars(at) -> dict:
    """The Scores view's bars: {legend name: (positions, y, hover text)}."""
    spec = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Scores of the slots"))
    return {d["name"]: (arr(d["x"]), arr(d["y"]).astype(float), list(d["customdata"]))
            for d in spec["data"] if d.get("type") == "bar"}


def test_the_refusal_opens_the_vector_trace_and_the_views_show_both(apptest):
    """On the canonical trace R-KV and Expected Attention are refused; the refusal's button
    opens code-kv-vec.npz at head kv0, Expected Attention's rope_theta left at the run's (the
    trace's recorded base), and the page's held counts, victims and score bars are the
    library's replays."""
    at = apphelp.app(timeout=240, a="rkv", b="expected-attention", budget=64, step=200, view="scores")
    ok(at)
    assert any("rkv reads key and query vectors, and trace 'canonical' has none" in e.value
               for e in at.sidebar.error)
    at.button(key="vectors.open.a").click().run()
    ok(at)
    assert not at.error
    assert at.query_params["trace"] == "file:code-kv-vec.npz" and at.query_params["head"] == "kv0"
    assert float(at.query_params.get("b.rope_theta", 0.0)) == 0.0  # the run's: the trace's base
    layer = int(at.query_params["layer"])
    trace = load_trace(VEC, layer=layer, head="kv0")
    status = _status(at)
    bars = _bars(at)
    for side, name, params in (("A", "rkv", {}), ("B", "expected-attention", {})):
        replay = Replay(trace, make_policy(name, budget=64, **params))
        kept, scores = replay.peek(200)
        held = len(replay.run().held_at(200))  # after step 200's eviction
        assert held == 64
        assert re.search(rf"\*\*{side}\*\* {re.escape(name)}[^*]* holds \*\*{held}\*\*", status)
        victims = np.flatnonzero(replay.evicted_at == 200).tolist()
        evicted = status.split("evicted at step 200:")[1].split(f"**{side}**")[1].split("·")[0]
        assert [int(v) for v in re.findall(r"\d+", evicted)] == victims
        label = next(k for k in bars if (k.startswith("mix_lambda") if name == "rkv" else k.startswith("expected")))
        x, y, hover = bars.pop(label)
        want = np.asarray(scores["score"], float)[np.searchsorted(kept, x)]
        assert np.array_equal(kept[np.searchsorted(kept, x)], x)
        assert [float(h) for h in hover] == [float(f"{v:.4g}") for v in want]
        assert np.allclose(y, want)  # every bar drawn, R-KV's negative scores included
