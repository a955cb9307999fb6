"""The canonical trace's shape follows the cards; the file format refuses bad input."""
import hashlib
import io

import numpy as np
import pytest

from kvviz.core.replay import run_policy
from kvviz.core.trace import CanonicalTrace, canonical, load_trace, pack_rows, save_trace

# Pinned so that any change to the canonical workload is deliberate: update it together
# with the README's tables, never to make a test pass.
CANONICAL_SHA256 = "ee7d16f19c4b7156b7561cb3257d9e666e81151d80101d8634e5435e97708387"


def test_canonical_checksum_is_pinned():
    t = canonical()
    digest = hashlib.sha256()
    for i in range(t.steps):
        digest.update(t.row(i).tobytes())
    assert digest.hexdigest() == CANONICAL_SHA256


def test_canonical_rows_are_causal_distributions():
    t = canonical()
    assert t.steps == 4096
    assert len(t.row(0)) == 0
    for i in (1, 2, 65, 1000, 4095):
        row = t.row(i)
        assert row.dtype == np.float32 and row.shape == (i,)
        assert (row >= 0).all()
        assert abs(float(row.sum(dtype=np.float64)) - 1) < 1e-5


def test_canonical_mass_split_follows_the_cards():
    t = canonical()
    row = t.row(3000).astype(np.float64)
    recent = row[-64:].sum()
    # 0.55 on the 64 newest, plus their sliver of the uniform background (0.10 / 3000 each)
    assert abs(recent - (0.55 + 64 * 0.10 / 3000)) < 1e-4
    assert np.allclose(row[:4], 0.15 / 4 + 0.10 / 3000, atol=1e-6)  # four equal sinks
    hh, share = t.heavy_hitters(3000 // 512)
    assert hh.max() < (3000 // 512) * 512  # drawn from the context before the epoch
    background = np.delete(row, np.concatenate([np.arange(4), np.arange(2936, 3000), hh]))
    assert np.ptp(background) == 0  # everything else is the one uniform background weight


def test_heavy_hitters_are_stationary_within_an_epoch_and_redrawn_across():
    t = canonical()
    a, b = t.row(1100), t.row(1500)  # same epoch (1024..1535)
    hh, _ = t.heavy_hitters(2)
    # with each row's uniform background removed, a heavy hitter weighs the same all epoch
    assert np.allclose(a[hh] - 0.10 / 1100, b[hh] - 0.10 / 1500, rtol=1e-4)
    assert not np.array_equal(np.sort(t.heavy_hitters(2)[0]), np.sort(t.heavy_hitters(3)[0]))


def test_canonical_is_deterministic_and_seeded():
    assert np.array_equal(canonical().row(2000), canonical().row(2000))
    assert not np.array_equal(canonical(seed=1).row(2000), canonical().row(2000))
    with pytest.raises(ValueError, match="step"):
        canonical().row(4096)


def matrix(steps, seed=0):
    rng = np.random.default_rng(seed)
    m = np.tril(rng.random((steps, steps)), k=-1).astype(np.float32)
    m[1:] /= m[1:].sum(axis=1, keepdims=True)
    return m


def test_save_load_round_trip(tmp_path):
    m = np.stack([matrix(20), matrix(20, 1)])
    tokens = [f"tok{i}\n" for i in range(20)]
    path = save_trace(tmp_path / "t.npz", m, tokens=tokens, layers=[3, 7], meta={"model": "x"},
                      dtype="float32")
    trace = load_trace(path, layer=7)  # a model layer number, not an index
    assert trace.steps == 20 and trace.tokens == tokens and trace.layer == 7
    assert trace.meta["model"] == "x"
    for i in range(20):
        assert np.array_equal(trace.row(i), m[1, i, :i])
    assert load_trace(path.read_bytes()).layer == 3
    assert (path.stat().st_mode & 0o044) == 0o044  # readable by others: traces are shared


def test_float16_storage_loads_as_float32(tmp_path):
    m = matrix(10)
    trace = load_trace(save_trace(tmp_path / "h.npz", m))
    assert trace.row(9).dtype == np.float32
    assert np.allclose(trace.row(9), m[9, :9], atol=1e-3)


def test_pack_rows_order():
    m = np.arange(16, dtype=np.float32).reshape(4, 4)
    assert pack_rows(m).tolist() == [4, 8, 9, 12, 13, 14]


def npz_bytes(**arrays):
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


GOOD = dict(format_version=np.int64(1), attn=np.full((1, 6), 0.25, np.float32))


@pytest.mark.parametrize("data, rule", [
    (b"", "empty"),
    (b"not a zip at all", "npz"),
    (npz_bytes(**{**GOOD, "attn": np.array([[0.1, 0.2, 0.3, 0.4]], np.float32)}), "row"),
    (npz_bytes(**{**GOOD, "attn": np.full((1, 6), np.nan, np.float32)}), "finite"),
    (npz_bytes(**{**GOOD, "attn": np.full((1, 6), -0.1, np.float32)}), "non-negative"),
    (npz_bytes(**{**GOOD, "attn": np.full((1, 6), 1, np.int32)}), "float16 or float32"),
    (npz_bytes(**{**GOOD, "attn": np.full(6, 0.1, np.float32)}), "2-D"),
    (npz_bytes(attn=GOOD["attn"]), "format_version"),
    (npz_bytes(format_version=np.int64(6), attn=GOOD["attn"]), "format_version must be 1, 2, 3, 4 or 5"),
    (npz_bytes(format_version=np.float64(1), attn=GOOD["attn"]), "format_version"),
    (npz_bytes(**GOOD, heads=np.array(["mean"])), "heads is a format_version 2 field"),
    (npz_bytes(**{**GOOD, "layers": np.array([0.5])}), "layers must be integers"),
    (npz_bytes(format_version=np.int64(1)), "attn"),
    (npz_bytes(**GOOD, tokens=np.array(["a", "b"])), "tokens"),
    (npz_bytes(**GOOD, meta=np.str_("[1, 2]")), "meta"),
    (npz_bytes(**GOOD, attn_obj=np.array([{"a": 1}], dtype=object)), "object"),
])
def test_bad_files_are_refused_with_the_rule(data, rule):
    with pytest.raises(ValueError, match=rule):
        load_trace(data)


def test_truncated_zip_is_refused():
    data = npz_bytes(**GOOD)
    with pytest.raises(ValueError, match="npz|read"):
        load_trace(data[: len(data) // 2])


def test_size_cap(tmp_path):
    with pytest.raises(ValueError, match="limit"):
        load_trace(npz_bytes(**GOOD), max_bytes=100)


def test_valid_minimal_file_loads():
    trace = load_trace(npz_bytes(**GOOD))
    assert trace.steps == 4 and trace.row(3).tolist() == [0.25, 0.25, 0.25]


def test_canonical_parameters_are_validated():
    with pytest.raises(ValueError, match="steps"):
        CanonicalTrace(steps=0)


# ---- format version 2: a head axis -------------------------------------------------------

def v1_bytes():
    """A version-1 file exactly as the old save_trace wrote it: attn (L, packed), no heads."""
    a, b = pack_rows(matrix(8)), pack_rows(matrix(8, 1))
    return npz_bytes(format_version=np.int64(1), attn=np.stack([a, b]).astype(np.float16),
                     layers=np.array([0, 29], np.int64), meta=np.str_('{"name": "old"}')), (a, b)


def test_version_1_files_still_load_as_head_mean():
    data, (a, b) = v1_bytes()
    t = load_trace(data)
    assert t.heads == ["mean"] and t.head == "mean" and t.layers == [0, 29] and t.layer == 0
    assert t.name == "old"
    last = load_trace(data, layer=29, head="mean")
    assert last.layer == 29
    assert np.array_equal(last.row(7), b[-7:].astype(np.float16).astype(np.float32))
    with pytest.raises(ValueError, match="head kv0 is not stored.*stored heads: mean"):
        load_trace(data, head="kv0")


def test_the_shipped_version_1_traces_still_load():
    from pathlib import Path
    for path in sorted((Path(__file__).resolve().parents[1] / "traces").glob("*.npz")):
        with np.load(path, allow_pickle=False) as npz:
            version = int(npz["format_version"])
        t = load_trace(path)
        assert t.head == "mean" and t.layer == t.layers[0], path.name
        if version == 1:
            assert t.heads == ["mean"], path.name


def heads_stack(steps=12, layers=2, labels=("mean", "kv0", "kv1", "kv2")):
    """(L, H, T, T): each (layer, head) matrix distinct, so a wrong pick is visible."""
    return np.stack([np.stack([matrix(steps, seed=10 * li + hi) for hi in range(len(labels))])
                     for li in range(layers)])


def test_version_2_round_trip_every_layer_and_head(tmp_path):
    labels = ["mean", "kv0", "kv1", "kv2"]
    m = heads_stack()
    path = save_trace(tmp_path / "h.npz", m, layers=[14, 29], heads=labels, dtype="float32",
                      tokens=[str(i) for i in range(12)])
    with np.load(path, allow_pickle=False) as npz:
        assert int(npz["format_version"]) == 5  # written as the newest version; read as 2 was
        assert npz["attn"].shape == (2, 4, 66) and npz["heads"].tolist() == labels
    for li, layer in enumerate([14, 29]):
        for hi, head in enumerate(labels):
            t = load_trace(path, layer=layer, head=head)
            assert (t.layer, t.head, t.layers, t.heads) == (layer, head, [14, 29], labels)
            for i in range(12):
                assert np.array_equal(t.row(i), m[li, hi, i, :i])
    default = load_trace(path)
    assert (default.layer, default.head) == (14, "mean")
    assert np.array_equal(default.row(11), m[0, 0, 11, :11])


def test_head_mean_only_save_is_version_2_with_mean(tmp_path):
    t = load_trace(save_trace(tmp_path / "m.npz", np.stack([matrix(6)]), layers=[5]))
    assert t.heads == ["mean"] and t.layers == [5] and t.layer == 5


def test_unknown_layer_or_head_lists_what_is_stored(tmp_path):
    path = save_trace(tmp_path / "h.npz", heads_stack(), layers=[14, 29],
                      heads=["mean", "kv0", "kv1", "kv2"])
    with pytest.raises(ValueError, match=r"layer 1 is not stored.*stored layers: 14, 29"):
        load_trace(path, layer=1)  # an index is not a model layer number
    with pytest.raises(ValueError, match=r"head q3 is not stored.*stored heads: mean, kv0, kv1, kv2"):
        load_trace(path, head="q3")
    with pytest.raises(ValueError, match="layer must be a model layer number"):
        load_trace(path, layer="last")


def test_save_refuses_heads_that_do_not_match(tmp_path):
    with pytest.raises(ValueError, match="heads must name the 4 stored heads"):
        save_trace(tmp_path / "x.npz", heads_stack(), heads=["mean", "kv0"])
    with pytest.raises(ValueError, match="heads must start with 'mean'"):
        save_trace(tmp_path / "x.npz", heads_stack(), heads=["kv0", "mean", "kv1", "kv2"])
    assert not list(tmp_path.iterdir())  # nothing written for a refused save


V2 = dict(format_version=np.int64(2), attn=np.full((1, 2, 6), 0.25, np.float32),
          heads=np.array(["mean", "kv0"]))


@pytest.mark.parametrize("changes, rule", [
    ({"attn": np.full((1, 6), 0.25, np.float32)}, "attn must be 3-D"),
    ({"heads": None}, "no 'heads' field"),
    ({"heads": np.array(["mean"])}, "heads must be 2 str labels"),
    ({"heads": np.array([1, 2])}, "heads must be 2 str labels"),
    ({"heads": np.array(["kv0", "mean"])}, "heads must start with 'mean'"),
    ({"heads": np.array(["mean", "mean"])}, "heads must be distinct"),
    ({"heads": np.array(["mean", "head7"])}, "heads must be 'mean', 'kvN' or 'qN'"),
    ({"attn": np.full((1, 2, 5), 0.25, np.float32)}, "row"),
    ({"layers": np.array([3, 3]), "attn": np.full((2, 2, 6), 0.25, np.float32)}, "layers must be distinct"),
])
def test_bad_version_2_files_are_refused_naming_the_field(changes, rule):
    arrays = {k: v for k, v in {**V2, **changes}.items() if v is not None}
    with pytest.raises(ValueError, match=rule):
        load_trace(npz_bytes(**arrays))


def test_valid_minimal_version_2_file_loads():
    t = load_trace(npz_bytes(**V2), head="kv0")
    assert t.steps == 4 and t.heads == ["mean", "kv0"] and t.head == "kv0" and t.layer == 0


def test_canonical_has_the_head_attributes():
    t = canonical(steps=10)
    assert t.heads == ["mean"] and t.head == "mean" and t.layers == [] and t.layer is None


def test_shipped_per_kv_head_trace():
    """traces/code-kv.npz: the head axis of a real capture, within the 4 MB budget."""
    from pathlib import Path
    traces = Path(__file__).resolve().parents[1] / "traces"
    path = traces / "code-kv.npz"
    assert path.stat().st_size <= 4 * 1024 * 1024
    mean = load_trace(path)
    assert mean.heads == ["mean", "kv0", "kv1", "kv2"] and mean.layers == [0, 14, 29]
    assert mean.steps == 512 and mean.meta["head_groups"]["kv1"] == [3, 4, 5]
    code = load_trace(traces / "code.npz", layer=29)
    assert code.tokens[:512] == mean.tokens  # the same text prefix as code.npz
    for layer in (0, 29):
        m = load_trace(path, layer=layer)
        kv = [load_trace(path, layer=layer, head=f"kv{g}") for g in range(3)]
        c = load_trace(traces / "code.npz", layer=layer)
        for i in (1, 100, 511):
            # three equal groups: the head-mean is the mean of the group means (fp16 storage)
            assert np.allclose(np.mean([k.row(i) for k in kv], axis=0), m.row(i), atol=1e-3)
            # causal attention over the same prefix: what code.npz holds for these rows
            assert np.allclose(c.row(i), m.row(i), atol=1e-3)
        assert not np.allclose(kv[0].row(511), kv[1].row(511), atol=1e-2)  # heads differ


def test_kept_rows_are_the_generated_rows_and_fresh_copies():
    """The app's canonical trace remembers its rows (keep_rows); every row, asked for in any
    order and twice, must be bit-identical to a plain trace's, and callers get their own copy."""
    plain, kept = canonical(700), canonical(700).keep_rows()
    order = list(range(699, -1, -3)) + list(range(700))
    for t in order:
        assert np.array_equal(kept.row(t), plain.row(t)), t
        assert kept.row(t).dtype == np.float32
    r = kept.row(650)
    r[:] = -1
    assert np.array_equal(kept.row(650), plain.row(650))
    ra, rb = run_policy(plain, "snapkv", 64), run_policy(kept, "snapkv", 64)
    assert np.array_equal(ra.evicted_at, rb.evicted_at)
    assert np.array_equal(ra.retained, rb.retained, equal_nan=True)


# ---- format version 3: key norms ---------------------------------------------------------
def test_version_3_key_norms_round_trip_per_layer_and_head(tmp_path):
    labels = ["mean", "kv0", "kv1"]
    m = heads_stack(labels=labels)
    norms = np.arange(2 * 3 * 12, dtype=np.float32).reshape(2, 3, 12) / 7  # distinct per cell
    path = save_trace(tmp_path / "k.npz", m, layers=[0, 5], heads=labels, key_norms=norms)
    for li, layer in enumerate([0, 5]):
        for hi, head in enumerate(labels):
            t = load_trace(path, layer=layer, head=head)
            assert np.array_equal(t.key_norms, norms[li, hi])
            assert t.key_norm(11) == float(norms[li, hi, 11])


def test_a_trace_without_key_norms_has_none(tmp_path):
    path = save_trace(tmp_path / "n.npz", matrix(6))
    assert load_trace(path).key_norms is None and load_trace(path).key_norm(3) is None


@pytest.mark.parametrize("version, norms, keyword", [
    (2, np.ones((1, 1, 4), np.float32), "format_version 3 field"),
    (3, np.ones((1, 1, 5), np.float32), "shape"),
    (3, np.ones((1, 1, 4), np.float64), "float32"),
    (3, -np.ones((1, 1, 4), np.float32), "non-negative"),
    (3, np.full((1, 1, 4), np.nan, np.float32), "finite"),
])
def test_bad_key_norms_are_refused(version, norms, keyword):
    data = npz_bytes(format_version=np.int64(version), attn=np.full((1, 1, 6), 0.25, np.float32),
                     heads=np.array(["mean"]), key_norms=norms)
    with pytest.raises(ValueError, match=keyword):
        load_trace(data)


def test_shipped_per_kv_head_trace_has_key_norms_that_replay_knorm():
    """code-kv.npz is format 3: per head, mean = the mean of the KV heads' norms; knorm
    replays it, and refuses the format-2 code.npz beside it with a message."""
    from pathlib import Path

    from kvviz.core.policies import make_policy
    from kvviz.core.replay import Replay
    traces = Path(__file__).resolve().parents[1] / "traces"
    for layer in (0, 14, 29):
        kv = [load_trace(traces / "code-kv.npz", layer=layer, head=f"kv{g}").key_norms for g in range(3)]
        mean = load_trace(traces / "code-kv.npz", layer=layer).key_norms
        np.testing.assert_allclose(np.mean(kv, axis=0), mean, rtol=1e-6)
        assert (mean > 0).all() and not np.allclose(kv[0], kv[1], rtol=1e-2)
    run = run_policy(load_trace(traces / "code-kv.npz", layer=29, head="kv1"), "knorm", 64)
    assert (run.evicted_at != -1).sum() == 512 - 64
    with pytest.raises(ValueError, match="reads key norms, and trace 'code' has none"):
        Replay(load_trace(traces / "code.npz"), make_policy("knorm", 64))


# ---- format version 4: value norms -------------------------------------------------------
def test_version_4_value_norms_round_trip_beside_key_norms(tmp_path):
    labels = ["mean", "kv0"]
    m = heads_stack(labels=labels)
    keys = np.arange(2 * 2 * 12, dtype=np.float32).reshape(2, 2, 12) / 7
    values = keys[::-1, ::-1].copy() + 1  # distinct from the keys in every cell
    path = save_trace(tmp_path / "v.npz", m, layers=[0, 5], heads=labels, key_norms=keys,
                      value_norms=values)
    with np.load(path, allow_pickle=False) as npz:
        assert int(npz["format_version"]) == 5
    for li, layer in enumerate([0, 5]):
        for hi, head in enumerate(labels):
            t = load_trace(path, layer=layer, head=head)
            assert np.array_equal(t.value_norms, values[li, hi])
            assert np.array_equal(t.key_norms, keys[li, hi])
            assert t.value_norm(11) == float(values[li, hi, 11])
    bare = load_trace(save_trace(tmp_path / "n.npz", matrix(6)))
    assert bare.value_norms is None and bare.value_norm(3) is None


def test_an_older_file_still_loads_without_value_norms():
    data = npz_bytes(format_version=np.int64(3), attn=np.full((1, 1, 6), 0.25, np.float32),
                     heads=np.array(["mean"]), key_norms=np.ones((1, 1, 4), np.float32))
    t = load_trace(data)
    assert t.value_norms is None and t.key_norm(0) == 1.0


@pytest.mark.parametrize("version, norms, keyword", [
    (3, np.ones((1, 1, 4), np.float32), "value_norms is a format_version 4 field"),
    (4, np.ones((1, 1, 5), np.float32), "value_norms must be float32 of shape"),
    (4, np.ones((1, 1, 4), np.float64), "value_norms must be float32"),
    (4, -np.ones((1, 1, 4), np.float32), "value_norms must be finite and non-negative"),
])
def test_bad_value_norms_are_refused(version, norms, keyword):
    data = npz_bytes(format_version=np.int64(version), attn=np.full((1, 1, 6), 0.25, np.float32),
                     heads=np.array(["mean"]), value_norms=norms)
    with pytest.raises(ValueError, match=keyword):
        load_trace(data)
