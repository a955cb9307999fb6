"""Format version 5: key and query vectors (after RoPE) round-trip, and bad ones are refused."""
import io
from pathlib import Path

import numpy as np
import pytest

from kvviz.core.trace import load_trace, save_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"


def matrix(steps, seed=0):
    rng = np.random.default_rng(seed)
    m = np.tril(rng.random((steps, steps)), k=-1).astype(np.float32)
    m[1:] /= m[1:].sum(axis=1, keepdims=True)
    return m


def vectors(layers=2, heads=3, steps=12, dim=4, seed=0):
    return np.random.default_rng(seed).normal(size=(layers, heads, steps, dim)).astype(np.float32)


def npz_bytes(**arrays):
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_keys_and_queries_round_trip_as_float16(tmp_path):
    m = np.stack([np.stack([matrix(12, 2 * li + hi) for hi in range(2)]) for li in range(2)])
    keys, queries = vectors(heads=2), vectors(heads=6, seed=1)
    path = save_trace(tmp_path / "v.npz", m, layers=[3, 7], heads=["mean", "kv1"], keys=keys,
                      queries=queries)
    with np.load(path, allow_pickle=False) as npz:
        assert int(npz["format_version"]) == 5
        assert npz["keys"].dtype == np.float16 and npz["queries"].dtype == np.float16
    for layer in (3, 7):
        t = load_trace(path, layer=layer, head="kv1")
        # every stored layer's vectors, whichever layer's rows were loaded
        assert np.array_equal(t.keys, keys.astype(np.float16))
        assert np.array_equal(t.queries, queries.astype(np.float16))
    bare = load_trace(save_trace(tmp_path / "n.npz", matrix(6)))
    assert bare.keys is None and bare.queries is None


def test_keys_alone_are_allowed(tmp_path):
    t = load_trace(save_trace(tmp_path / "k.npz", matrix(12)[None], keys=vectors(layers=1)))
    assert t.keys.shape == (1, 3, 12, 4) and t.queries is None


def test_a_key_beyond_float16_is_refused_not_stored_as_inf(tmp_path):
    keys = vectors(layers=1)
    keys[0, 0, 3, 1] = 1e6
    with pytest.raises(ValueError, match="keys must be finite"):
        save_trace(tmp_path / "big.npz", matrix(12)[None], keys=keys)
    assert not (tmp_path / "big.npz").exists()


ATTN = np.full((1, 1, 6), 0.25, np.float32)  # one layer, one head, 4 steps
F16 = np.float16


@pytest.mark.parametrize("version, extra, keyword", [
    (4, {"keys": np.ones((1, 1, 4, 2), F16)}, "keys is a format_version 5 field"),
    (5, {"keys": np.ones((1, 1, 4, 2), np.float32)}, "keys must be float16"),
    (5, {"queries": np.ones((1, 4, 2), F16)}, "queries must be float16 of shape"),
    (5, {"keys": np.ones((2, 1, 4, 2), F16)}, "1 layers and 4 steps"),
    (5, {"queries": np.ones((1, 1, 5, 2), F16)}, "1 layers and 4 steps"),
    (5, {"keys": np.full((1, 1, 4, 2), np.inf, F16)}, "keys must be finite"),
    (5, {"queries": np.full((1, 1, 4, 2), np.nan, F16)}, "queries must be finite"),
    (5, {"keys": np.ones((1, 1, 4, 2), F16), "queries": np.ones((1, 2, 4, 3), F16)},
     "share head_dim"),
    (5, {"keys": np.ones((1, 2, 4, 2), F16), "queries": np.ones((1, 3, 4, 2), F16)},
     "whole multiple"),
])
def test_bad_vectors_are_refused_with_the_rule(version, extra, keyword):
    data = npz_bytes(format_version=np.int64(version), attn=ATTN, heads=np.array(["mean"]), **extra)
    with pytest.raises(ValueError, match=keyword):
        load_trace(data)


def test_vectors_must_cover_the_stored_head_labels():
    attn = np.full((1, 2, 6), 0.25, np.float32)
    data = npz_bytes(format_version=np.int64(5), attn=attn, heads=np.array(["mean", "kv2"]),
                     keys=np.ones((1, 2, 4, 2), F16))
    with pytest.raises(ValueError, match=r"keys holds 2 heads, fewer than the head labels \['kv2'\]"):
        load_trace(data)


def test_shipped_vector_trace_reproduces_its_attention():
    """code-vec.npz: SmolLM2's keys and queries after RoPE at layers 0, 14 and 29. Recomputing
    row t from them (softmax of q.k / 8 over 0..t, mean of the 9 query heads, KV head h // 3)
    gives the stored row to float16 precision; its key norms are the keys' norms."""
    for li, layer in enumerate((0, 14, 29)):
        t = load_trace(TRACES / "code-vec.npz", layer=layer)
        assert t.steps == 368 and t.layers == [0, 14, 29]
        assert t.keys.shape == (3, 3, 368, 64) and t.queries.shape == (3, 9, 368, 64)
        k, q = t.keys[li].astype(np.float64), t.queries[li].astype(np.float64)
        np.testing.assert_allclose(np.linalg.norm(k, axis=-1).mean(0), t.key_norms, rtol=2e-3)
        for step in (1, 100, 367):
            s = np.einsum("hd,htd->ht", q[:, step], k[np.arange(9) // 3, :step + 1]) / 8.0
            p = np.exp(s - s.max(axis=1, keepdims=True))
            mean = (p / p.sum(axis=1, keepdims=True)).mean(0)
            np.testing.assert_allclose(mean[:step], t.row(step), atol=2e-3)
    assert (TRACES / "code-vec.npz").stat().st_size < 2_000_000
