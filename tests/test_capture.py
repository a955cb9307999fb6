"""Capture for real with the shipped SmolLM2 GGUF on a short text.

torch is imported lazily. Without it these tests skip, unless KVVIZ_REQUIRE_CAPTURE=1 (set
by CI), where a missing torch is a failure: CI must not pass by silently skipping.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. "
        "The committee met at noon; the minutes record that the motion passed. "
        "def mean(xs):\n    return sum(xs) / len(xs)\n"
        "| Z | Symbol |\n|---|---|\n| 1 | H |\n")


@pytest.fixture(scope="module")
def captured(tmp_path_factory, torch_stack):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvviz.model.capture import main

    src = tmp_path_factory.mktemp("cap") / "text.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = src.with_name("short.npz")
    assert main(["--text", str(src), "--out", str(out), "--max-tokens", "64",
                 "--layers", "0,14,29", "--vectors", "--licence", "test", "--source", "test"]) == 0
    return out


def test_capture_file_format(captured):
    from kvviz.core.trace import load_trace

    assert captured.stat().st_size < 4 * 1024 * 1024
    with np.load(captured, allow_pickle=False) as npz:
        assert npz["attn"].dtype == np.float16 and npz["attn"].shape[:2] == (3, 1)
        assert npz["layers"].tolist() == [0, 14, 29] and npz["heads"].tolist() == ["mean"]
        assert int(npz["format_version"]) == 5 and npz["key_norms"].shape == (3, 1, 64)
        assert npz["value_norms"].shape == (3, 1, 64) and npz["value_norms"].dtype == np.float32
    for layer in (0, 14, 29):
        t = load_trace(captured, layer=layer)
        assert t.layer == layer and t.heads == ["mean"]
        assert t.steps == 64 and t.layers == [0, 14, 29]
        assert t.meta["aggregation"] == "head-mean" and t.meta["licence"] == "test"
        assert "SmolLM2" in t.meta["model"] and t.meta["layers"] == [0, 14, 29]
        assert t.meta["rope_theta"] == 100000.0  # SmolLM2-135M's config: rope_parameters.rope_theta
        assert t.row(5).dtype == np.float32


def test_captured_vectors_reproduce_the_captured_attention(captured):
    """--vectors: the stored keys and queries (after RoPE) give back the stored rows: the
    softmax of q.k / sqrt(head_dim) over positions 0..t, averaged over the 9 query heads, each
    reading KV head h // 3, minus the self weight. Queries before RoPE, or keys from the wrong
    layer, miss by far more than float16's rounding."""
    from kvviz.core.trace import load_trace

    for li, layer in enumerate((0, 14, 29)):
        t = load_trace(captured, layer=layer)
        assert t.keys.shape == (3, 3, 64, 64) and t.queries.shape == (3, 9, 64, 64)
        k, q = t.keys[li].astype(np.float64), t.queries[li].astype(np.float64)
        for step in (1, 17, 63):
            probs = []
            for h in range(9):
                s = k[h // 3, :step + 1] @ q[h, step] / 8.0
                p = np.exp(s - s.max())
                probs.append(p / p.sum())
            np.testing.assert_allclose(np.mean(probs, 0)[:step], t.row(step), atol=2e-3)


def test_rows_causal_positive_and_sum_to_one_minus_self(captured):
    from kvviz.core.trace import load_trace

    for layer in (0, 14, 29):
        t = load_trace(captured, layer=layer)
        assert t.row(0).shape == (0,)
        sums = []
        for i in range(1, t.steps):
            r = t.row(i)
            assert r.shape == (i,)                      # causal: only positions before i
            assert (r > 0).all()                        # softmax weights are all positive
            assert r.sum() <= 1 + 2e-3                  # float16 storage rounding
            sums.append(r.sum())
        # the dropped self weight is a minority share: rows stay well above 0 and mostly near 1
        assert min(sums) > 0.05 and np.median(sums) > 0.5


def test_tokens_round_trip_to_text_prefix(captured):
    from kvviz.core.trace import load_trace

    t = load_trace(captured)
    joined = "".join(t.tokens)
    assert len(t.tokens) == 64 and len(joined) > 100
    assert TEXT.startswith(joined)
    assert t.meta["text"] == joined


def test_capture_function_matches_self_weight(torch_stack):
    """Row sums plus the dropped diagonal equal 1: checked on the float32 result in memory."""
    import torch

    from kvviz.model.capture import capture
    from kvviz.model.models import load_model

    tok, model = load_model()
    res = capture(TEXT, max_tokens=32, layers=[14])
    ids = tok(TEXT, add_special_tokens=False)["input_ids"][:32]
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions[14][0]
    self_w = att.mean(0).diagonal().numpy()
    assert res["attn"].shape == (1, 1, 32, 32) and res["heads"] == ["mean"]
    sums = res["attn"][0, 0].sum(1)
    np.testing.assert_allclose(sums + self_w, 1.0, atol=1e-4)
    assert np.all(np.triu(res["attn"][0, 0]) == 0)      # nothing on or above the diagonal


def test_import_without_torch():
    """kvviz, kvviz.model.capture and kvviz.core.spans import with torch and transformers blocked."""
    code = textwrap.dedent("""
        import sys
        for name in ("torch", "transformers", "gguf", "accelerate"):
            sys.modules[name] = None      # any import of these now raises ImportError
        import kvviz, kvviz.model.capture, kvviz.core.spans
        assert callable(kvviz.model.capture.main) and callable(kvviz.core.spans.span_integrity)
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def no_model(*args, **kwargs):
    raise AssertionError("the model must not be loaded for an empty text")


def test_empty_text_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """`kvviz capture` on an empty text: no torch needed, and loading the model at all would
    fail this test."""
    import kvviz.model.capture as cap
    import kvviz.model.models as models

    monkeypatch.setattr(models, "load_model", no_model)  # capture imports it when it runs
    for content in ("", "  \n\t\n"):
        src = tmp_path / "empty.txt"
        src.write_text(content, encoding="utf-8")
        assert cap.main(["--text", str(src), "--out", str(tmp_path / "e.npz")]) == 2
        assert "empty" in capsys.readouterr().err
    assert not (tmp_path / "e.npz").exists()


def test_capture_refuses_an_empty_text_before_the_model_loads(monkeypatch, torch_stack):
    """capture() itself (it imports torch first): the same refusal, no model load."""
    import kvviz.model.capture as cap
    import kvviz.model.models as models

    monkeypatch.setattr(models, "load_model", no_model)
    for content in ("", "  \n\t\n"):
        with pytest.raises(ValueError, match="text is empty"):
            cap.capture(content)


def test_head_groups_labels():
    from kvviz.model.capture import head_groups

    assert head_groups("mean", 9, 3) == [("mean", list(range(9)))]
    assert [g for g, _ in head_groups("all", 9, 3)] == ["mean"] + [f"q{h}" for h in range(9)]
    with pytest.raises(ValueError, match="heads must be one of mean, kv, all"):
        head_groups("per-head", 9, 3)


def test_kv_groups_follow_transformers_repeat_kv(torch_stack):
    """Query head h reads the KV head that transformers' own repeat_kv gives it."""
    import torch
    from transformers.models.llama.modeling_llama import repeat_kv

    from kvviz.model.capture import head_groups
    from kvviz.model.models import load_model

    _, model = load_model()
    n_heads, n_kv = model.config.num_attention_heads, model.config.num_key_value_heads
    assert (n_heads, n_kv) == (9, 3)
    kv_index = torch.arange(n_kv, dtype=torch.float32).reshape(1, n_kv, 1, 1)
    served_by = repeat_kv(kv_index, n_heads // n_kv).reshape(-1).int().tolist()
    groups = dict(head_groups("kv", n_heads, n_kv))
    assert list(groups) == ["mean", "kv0", "kv1", "kv2"]
    for g in range(n_kv):
        assert groups[f"kv{g}"] == [h for h in range(n_heads) if served_by[h] == g]


def test_capture_per_head_rows_match_the_model(torch_stack):
    """--heads kv / all: each stored head's rows are the model's own weights for those heads."""
    import torch

    from kvviz.model.capture import capture
    from kvviz.model.models import load_model

    tok, model = load_model()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"][:32]
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions[29][0].numpy()
    lower = np.tril(np.ones((32, 32), bool), k=-1)
    res = capture(TEXT, max_tokens=32, layers=[29], heads="all")
    assert res["heads"] == ["mean"] + [f"q{h}" for h in range(9)]
    assert res["attn"].shape == (1, 10, 32, 32)
    for h in range(9):
        np.testing.assert_allclose(res["attn"][0, 1 + h], np.where(lower, att[h], 0), atol=1e-6)
    kv = capture(TEXT, max_tokens=32, layers=[29], heads="kv")
    assert kv["heads"] == ["mean", "kv0", "kv1", "kv2"]
    for g in range(3):
        want = np.where(lower, att[3 * g:3 * g + 3].mean(0), 0)
        np.testing.assert_allclose(kv["attn"][0, 1 + g], want, atol=1e-6)
    # equal group sizes: the mean of the three group means is the head-mean
    np.testing.assert_allclose(kv["attn"][0, 1:].mean(0), kv["attn"][0, 0], atol=1e-6)
    assert not np.allclose(kv["attn"][0, 1], kv["attn"][0, 2], atol=1e-3)  # heads differ


@pytest.mark.parametrize("proj,field,layer", [("k_proj", "key_norms", 29), ("v_proj", "value_norms", 14)])
def test_capture_norms_are_the_models_own(torch_stack, proj, field, layer):
    """The key norms (format 3) and value norms (format 4), checked against the layer's k_proj
    and v_proj outputs, per KV head: RoPE rotates pairs of a key's coordinates, which keeps
    every L2 norm, and values are cached as projected. Mapped to head labels alike (`mean`
    first, then each query head's KV head)."""
    from kvviz.model.capture import capture
    from kvviz.model.models import load_model

    tok, model = load_model()
    seen = []
    hook = getattr(model.model.layers[layer].self_attn, proj).register_forward_hook(
        lambda mod, inp, out: seen.append(out[0].detach()))
    try:
        res = capture(TEXT, max_tokens=32, layers=[layer], heads="all")
    finally:
        hook.remove()
    pre = seen[-1].reshape(32, 3, 64).float().norm(dim=-1).T.numpy()  # (KV heads, T)
    got = res[field]
    assert got.shape == (1, 10, 32) and got.dtype == np.float32
    np.testing.assert_allclose(got[0, 0], pre.mean(axis=0), rtol=1e-5)
    for h in range(9):
        np.testing.assert_allclose(got[0, 1 + h], pre[h // 3], rtol=1e-5)
    assert not np.allclose(pre[0], pre[1], rtol=1e-2)  # KV heads differ, so the mapping is tested
    other = "value_norms" if field == "key_norms" else "key_norms"
    assert not np.allclose(got, res[other], rtol=1e-2)  # not the other norms again


def test_capture_cli_heads_kv_file(tmp_path, torch_stack):
    from kvviz.core.trace import load_trace
    from kvviz.model.capture import main

    src = tmp_path / "t.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "kv.npz"
    assert main(["--text", str(src), "--out", str(out), "--max-tokens", "40", "--layers", "14,29",
                 "--heads", "kv", "--licence", "test", "--source", "test"]) == 0
    t = load_trace(out, layer=29, head="kv2")
    assert (t.layers, t.heads, t.layer, t.head) == ([14, 29], ["mean", "kv0", "kv1", "kv2"], 29, "kv2")
    assert t.meta["heads"] == t.heads and t.meta["head_groups"]["kv2"] == [6, 7, 8]
    mean = load_trace(out, layer=29)
    assert not np.array_equal(mean.row(39), t.row(39))
    assert t.key_norms.shape == (40,) and (t.key_norms > 0).all()  # format 3 carries key norms
    assert not np.array_equal(t.key_norms, mean.key_norms)
