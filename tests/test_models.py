"""Other models without downloads: tiny random-weight models built here from configs.

Each architecture (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 with softcapping and
sliding-window layers, OLMo 2, StableLM with partial rotary; GPT-2 with learned positions and
GPT-NeoX with partial rotary, both multi-head; GPTBigCode and Falcon, multi-query; GPT-J)
gets hidden size 64, 2-3 layers, 4 heads and the bundled SmolLM2 tokenizer, saved to a
folder once per session. On each: the loop with a budget of
the whole text reproduces a plain forward pass's per-token NLL; the registered attention
function ran in every layer at every step; masking one key is removing it; capture's rows
are the eager forward pass's attentions, head-averaged.
"""
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

TEXT = ("The committee met at noon; the minutes record that the motion passed. "
        "Topological Sorter sorts a graph. It was a bright cold day in April.")
T = 24  # tokens read: shorter than the Gemma 2 model's sliding window below
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from tiny_model import ARCHS, build  # (the README's tiny-model folders, built the same way)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, torch_stack):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tiny_model import save_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, tokenizer_dir):
    """arch -> a saved model folder (built on first use)."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = build(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), tokenizer_from=tokenizer_dir)
        return made[arch]

    return get


# (query heads, KV heads the cache holds), written out from each tiny config: not read back
# through kvviz.model.models.attention_shape, which they check
KV_HEADS = {"llama": (4, 2), "mistral": (4, 2), "qwen2": (4, 2), "qwen3": (4, 2), "phi3": (4, 2), "gemma2": (4, 2),
            "olmo2": (4, 2), "stablelm": (4, 2), "gpt2": (4, 4), "gpt_neox": (4, 4), "gptj": (4, 4),
            "gpt_bigcode": (4, 1), "falcon": (4, 1)}


def _attention_modules(mdl):
    """The decoder's self-attention modules in layer order, whatever the architecture names them."""
    return [m for m in mdl.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def _pair(tiny, arch):
    from kvviz.model.models import load_model

    return load_model(str(tiny(arch)))


def _plain_nll(mdl, ids):
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(mdl(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    return (-logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_budget_loop_matches_a_plain_forward_and_attention_ran_everywhere(tiny, arch, monkeypatch, torch_stack):
    from kvviz.model.loop import LoopConfig, run_loop
    from kvviz.model.loop import attention as engine  # where the registered function lives
    from kvviz.model.models import attention_shape, tokenize

    tok, mdl = _pair(tiny, arch)
    calls = {}
    inner = engine.attention

    def counting(module, *a, **kw):
        calls[module.layer_idx] = calls.get(module.layer_idx, 0) + 1
        return inner(module, *a, **kw)

    monkeypatch.setattr(engine, "attention", counting)
    cfgs = [LoopConfig("full"), LoopConfig("tova", {}, T), LoopConfig("streaming-llm", {}, T + 5)]
    res = run_loop(TEXT, cfgs, max_tokens=T, model=(tok, mdl), granularity="kv-head")
    ids = tokenize(tok, TEXT, T)[0]
    assert len(ids) == T and res.token_ids.tolist() == ids
    want = _plain_nll(mdl, ids)
    for c in range(len(cfgs)):
        np.testing.assert_allclose(res.nll[c], want, atol=1e-4, rtol=0)
    L = attention_shape(mdl).layers
    assert calls == {layer: T for layer in range(L)}  # every layer, every step
    assert (res.evicted_at == -1).all()  # nothing had to go
    assert res.rows_layers == sorted({0, (L - 1) // 2, L - 1})
    assert res.meta["model"] == tiny(arch).name and res.meta["model_type"] == arch
    assert res.meta["bos"] is False and "SmolLM2" not in res.meta["model"]


@pytest.mark.parametrize("arch", ARCHS)
def test_masking_one_key_is_removing_it(tiny, arch, torch_stack):
    """The registered attention function with key j at -inf equals attention over the keys
    without j: only j's contribution changes, the rest is renormalised."""
    import torch

    from kvviz.model.loop import engine
    from kvviz.model.models import attention_shape, text_config

    tok, mdl = _pair(tiny, arch)
    cfg, shape = text_config(mdl), attention_shape(mdl)
    layer = _attention_modules(mdl)[-1]
    scaling = getattr(layer, "scaling", None) or layer.inv_norm_factor  # Falcon: inv_norm_factor
    D = shape.head_dim
    g = torch.Generator().manual_seed(1)
    k = 9
    q = torch.randn(1, shape.heads, 1, D, generator=g)
    key = torch.randn(1, shape.kv_heads, k, D, generator=g)
    val = torch.randn(1, shape.kv_heads, k, D, generator=g)
    kw = {"softcap": getattr(cfg, "attn_logit_softcapping", None)}
    j = 4
    state = engine.State(torch, 1, shape.layers, shape.kv_heads, 1, k)
    try:
        engine.bind(layer, state)
        full, _ = engine.attention(layer, q, key, val, None, scaling, **kw)
        state.bias[0, layer.layer_idx, :, j] = -np.inf
        masked, _ = engine.attention(layer, q, key, val, None, scaling, **kw)
    finally:
        engine.bind(layer, None)
    keep = [i for i in range(k) if i != j]
    removed, _ = engine.attention(layer, q, key[:, :, keep], val[:, :, keep], None, scaling, **kw)
    torch.testing.assert_close(masked, removed, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(masked, full, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_rows_are_the_eager_attentions_head_averaged(tiny, arch, torch_stack):
    import torch

    from kvviz.model.capture import capture
    from kvviz.model.models import resolve, source_sha256

    tok, mdl = _pair(tiny, arch)
    res = capture(TEXT, max_tokens=T, heads="kv", model=str(tiny(arch)))
    Hq, Hk = KV_HEADS[arch]
    L = len(_attention_modules(mdl))
    assert res["layers"] == sorted({0, (L - 1) // 2, L - 1})
    with torch.no_grad():
        att = mdl(input_ids=torch.tensor([res_ids(tok)]), output_attentions=True).attentions
    lower = np.tril(np.ones((T, T), bool), k=-1)
    r = Hq // Hk
    for i, layer in enumerate(res["layers"]):
        a = att[layer][0].numpy()
        np.testing.assert_allclose(res["attn"][i, 0], np.where(lower, a.mean(0), 0), atol=1e-6)
        for h in range(Hk):
            np.testing.assert_allclose(res["attn"][i, 1 + h], np.where(lower, a[h * r:(h + 1) * r].mean(0), 0),
                                       atol=1e-6)
    meta = res["meta"]
    assert meta["model"] == tiny(arch).name and meta["model_source"] == tiny(arch).name
    assert meta["model_sha256"] == source_sha256(resolve(str(tiny(arch))))
    assert meta["dtype"] == "float32" and meta["device"] == "cpu" and meta["torch"] and meta["transformers"]
    assert "".join(res["tokens"]) == TEXT[:len("".join(res["tokens"]))]


def res_ids(tok):
    from kvviz.model.models import tokenize

    return tokenize(tok, TEXT, T)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_shape_is_what_the_cache_holds(tiny, arch, torch_stack):
    """The helper's KV heads and head size are the shapes the model's own cache stores."""
    import torch

    from kvviz.model.models import attention_shape

    tok, mdl = _pair(tiny, arch)
    shape = attention_shape(mdl)
    with torch.no_grad():
        cache = mdl(input_ids=torch.tensor([res_ids(tok)[:5]]), use_cache=True).past_key_values
    assert (shape.heads, shape.kv_heads) == KV_HEADS[arch]
    assert shape.layers == len(cache.layers) == len(_attention_modules(mdl))
    assert tuple(cache.layers[0].keys.shape) == (1, shape.kv_heads, 5, shape.head_dim)


def test_sliding_window_past_the_window_matches_the_plain_model(tiny, torch_stack):
    """Gemma 2 (sliding window 32 on alternate layers) at three times the window, through the
    loop (masked and freed) and a prompt read in one pass: the model's own window applies,
    so the full budget reproduces a plain forward pass; eviction runs on top of it."""
    import torch

    from kvviz.model.loop import LoopConfig, generate, run_loop
    from kvviz.model.models import tokenize

    tok, mdl = _pair(tiny, "gemma2")
    n = 96
    ids = tokenize(tok, TEXT * 6, n)[0]
    assert len(ids) == n and mdl.config.sliding_window == 32
    want = _plain_nll(mdl, ids)
    cfgs = [LoopConfig("full"), LoopConfig("tova", {}, n), LoopConfig("tova", {}, 40)]
    for eviction in ("masked", "freed"):
        res = run_loop(TEXT * 6, cfgs, max_tokens=n, model=(tok, mdl), eviction=eviction)
        np.testing.assert_allclose(res.nll[:2], [want, want], atol=1e-4, rtol=0)
        assert np.abs(res.nll[2] - want).max() > 1e-3  # a budget of 40 does evict
    wide = type(mdl)(type(mdl.config)(**{**mdl.config.to_dict(), "sliding_window": 4 * n})).eval()
    wide.load_state_dict(mdl.state_dict())  # the same weights with a window wider than the text
    assert np.abs(_plain_nll(wide, ids) - want).max() > 1e-3  # so the window matters here
    with torch.no_grad():
        plain = mdl.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False).tolist()[0][n:]
    gen = generate(ids, [LoopConfig("full")], 6, model=(tok, mdl), prompt_mode="prefill", stop_at_eos=False)
    assert gen.new_ids[0].tolist() == plain


@pytest.mark.parametrize("kind, config", [
    ("bloom", dict(n_layer=2, n_head=4, hidden_size=64)),
    ("falcon", dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, alibi=True)),
    ("gpt_neo", dict(num_layers=2, num_heads=4, hidden_size=64, attention_types=[[["global"], 2]])),
])
def test_an_unsupported_attention_is_refused_in_one_line_naming_the_type_and_reason(kind, config, torch_stack):
    import transformers as tf

    from kvviz.hf import evicting
    from kvviz.model.loop import LoopConfig, generate, run_loop

    cls = {"bloom": tf.BloomConfig, "falcon": tf.FalconConfig, "gpt_neo": tf.GPTNeoConfig}[kind]
    mdl = tf.AutoModelForCausalLM.from_config(cls(vocab_size=64, **config)).eval()
    reason = "ALiBi attention biases" if kind != "gpt_neo" else "does not go through transformers' AttentionInterface"
    rule = rf"^model \S+ \(model type {kind}\) is not supported: .*{reason}"
    with pytest.raises(ValueError, match=rule):
        run_loop(TEXT, [LoopConfig("full")], max_tokens=8, model=(None, mdl))
    with pytest.raises(ValueError, match=rule):
        generate([1, 2, 3], [LoopConfig("full")], 2, model=(None, mdl))
    with pytest.raises(ValueError, match=rule):
        with evicting(mdl, budget=4):
            pass


def test_layers_outside_the_model_are_refused_naming_the_range(tiny, torch_stack):
    from kvviz.model.capture import capture
    from kvviz.model.loop import LoopConfig, run_loop

    pair = _pair(tiny, "qwen2")  # 2 layers
    with pytest.raises(ValueError, match=r"layer 5 is outside this model's layers 0\.\.1"):
        capture(TEXT, max_tokens=8, layers=[0, 5], model=pair)
    with pytest.raises(ValueError, match=r"rows_layers: layer 2 is outside this model's layers 0\.\.1"):
        run_loop(TEXT, [LoopConfig("full")], max_tokens=8, model=pair, rows_layers=[2])
    assert capture(TEXT, max_tokens=8, model=pair)["layers"] == [0, 1]


def test_bos_follows_the_tokenizer(tiny, torch_stack):
    """SmolLM2's tokenizer adds no BOS; one told to add it gets it first, and results say so."""
    from transformers import AutoTokenizer

    from kvviz.model.capture import capture
    from kvviz.model.models import tokenize

    folder = tiny("llama")
    tok, mdl = _pair(tiny, "llama")
    plain, _, bos = tokenize(tok, TEXT, 10)
    assert bos is False and plain[0] != tok.bos_token_id
    with_bos = AutoTokenizer.from_pretrained(folder, add_bos_token=True)
    if with_bos("x")["input_ids"][0] != with_bos.bos_token_id:
        pytest.fail("add_bos_token=True did not make the tokenizer add a BOS")
    ids, offsets, bos = tokenize(with_bos, TEXT, 10)
    assert bos is True and ids[0] == with_bos.bos_token_id and ids[1:] == plain[:9]
    res = capture(TEXT, max_tokens=10, model=(with_bos, mdl))
    assert res["meta"]["bos"] is True and res["tokens"][0] == with_bos.bos_token


def test_token_strings_from_offsets_render_words_whole(tiny, torch_stack):
    from kvviz.model.models import token_strings, tokenize

    tok, _ = _pair(tiny, "llama")
    ids, offsets, _ = tokenize(tok, TEXT, 200)
    pieces = token_strings(tok, ids, TEXT, offsets)
    assert "".join(pieces) == TEXT
    assert " Sorter" in "".join(pieces) and "Ġ" not in "".join(pieces)


def test_missing_or_incomplete_model_refused_before_any_load(tmp_path, monkeypatch, capsys, tiny):
    import kvviz.model.models as models
    from kvviz.model.capture import main as capture_main
    from kvviz.model.loop.cli import main as loop_main

    def no_load(*a, **k):
        raise AssertionError("nothing may load for a bad --model")

    monkeypatch.setattr(models, "load_model", no_load)
    monkeypatch.setattr(models, "_load_folder", no_load)
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    for argv in (["--model", str(broken)], ["--model", str(tmp_path / "nope")]):
        assert capture_main(["--text", str(text), "--out", str(tmp_path / "x.npz"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and argv[1] in err
        assert loop_main(["--text", str(text), *argv]) == 2
        assert argv[1] in capsys.readouterr().err
    assert capture_main(["--text", str(text), "--out", str(tmp_path / "x.npz"), "--model", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "weights" in err and "tokenizer" in err and "config.json" not in err.split("missing")[1]
    no_tok = tmp_path / "notok"
    shutil.copytree(tiny("qwen2"), no_tok, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(ValueError, match=r"notok: incomplete model folder, missing a tokenizer"):
        models.resolve(str(no_tok))
    assert not (tmp_path / "x.npz").exists()


def test_gguf_cache_rebuilds_a_truncated_entry(tmp_path, monkeypatch, capsys, tiny):
    """The cache folder is keyed by the hash, built once, and rebuilt when truncated."""
    from kvviz.model import gguf_cache
    from kvviz.model.models import _load_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    builds = []

    def build(gguf, out):  # stands in for the dequantisation: copies a model folder
        builds.append(out)
        shutil.copytree(tiny("llama"), out, dirs_exist_ok=True)

    sha = "ab" * 32
    folder = gguf_cache.cached_folder(tmp_path / "m.gguf", sha, build=build)
    assert folder == tmp_path / "cache" / "kvviz" / "gguf" / sha and len(builds) == 1
    assert gguf_cache.cached_folder(tmp_path / "m.gguf", sha, build=build) == folder and len(builds) == 1
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:
        fh.truncate(size // 2)
    capsys.readouterr()
    assert gguf_cache.cached_folder(tmp_path / "m.gguf", sha, build=build) == folder and len(builds) == 2
    err = capsys.readouterr().err
    assert "unusable" in err and "truncated" in err and "rebuilding" in err
    assert weights.stat().st_size == size and gguf_cache.problem(folder) is None
    _load_folder(folder)  # the rebuilt entry loads
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_device_and_dtype_refused_in_one_line(tiny, tmp_path, capsys, torch_stack):
    import torch

    from kvviz.model.capture import main as capture_main
    from kvviz.model.loop.cli import main as loop_main
    from kvviz.model.models import check_device

    with pytest.raises(ValueError, match="--dtype bfloat16 needs --device cuda; the CPU runs float32"):
        check_device("cpu", "bfloat16")
    assert check_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu", "float32")
    if torch.cuda.is_available():
        return
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    model = ["--model", str(tiny("qwen2")), "--device", "cuda"]
    assert loop_main(["--text", str(text), "--max-tokens", "8", *model]) == 2
    assert capture_main(["--text", str(text), "--out", str(tmp_path / "x.npz"), *model]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --device cuda: no CUDA device here (torch.cuda.is_available() is False)"] * 2


def test_load_model_of_a_gguf_uses_the_cache_and_rebuilds_an_unloadable_entry(tmp_path, monkeypatch, capsys,
                                                                               tiny, torch_stack):
    """load_model(".gguf"): built once into the cache, keyed by the file's SHA-256; an entry
    whose sizes are right but which does not load is rebuilt, with a message."""
    import hashlib

    from kvviz.model import gguf_cache, models

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    builds = []

    def fake_dequantise(gguf, out):  # the dequantisation, replaced by a tiny model folder
        builds.append(gguf)
        shutil.copytree(tiny("llama"), out, dirs_exist_ok=True)

    monkeypatch.setattr(gguf_cache, "dequantise", fake_dequantise)
    monkeypatch.setattr(models, "_LOADED", {})
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"not really a gguf, only hashed here")
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    tok, mdl = models.load_model(str(gguf))
    assert builds == [gguf.resolve()] and mdl.kvviz_provenance["model_sha256"] == sha
    assert mdl.kvviz_provenance["model_source"] == "mine.gguf" and mdl.kvviz_provenance["model"] == "mine"
    folder = tmp_path / "cache" / "kvviz" / "gguf" / sha
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(b"\xff" * size)  # same size, garbage: only loading it finds out
    monkeypatch.setattr(models, "_LOADED", {})
    capsys.readouterr()
    models.load_model(str(gguf))
    err = capsys.readouterr().err
    assert len(builds) == 2 and "unusable" in err and "rebuilding" in err
    assert weights.read_bytes()[:1] != b"\xff" and gguf_cache.problem(folder) is None


def test_cli_refuses_a_layer_outside_the_model_in_one_line(tiny, tmp_path, capsys):
    from kvviz.model.capture import main as capture_main
    from kvviz.model.loop.cli import main as loop_main

    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    model = ["--model", str(tiny("qwen2"))]  # 2 layers
    assert capture_main(["--text", str(text), "--out", str(tmp_path / "x.npz"), "--layers", "0,7", *model]) == 2
    assert loop_main(["--text", str(text), "--max-tokens", "8", "--rows-layers", "-3", *model]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert err == ["error: --layers: layer 7 is outside this model's layers 0..1",
                   "error: --rows-layers: layer -3 is outside this model's layers 0..1"]
    assert not (tmp_path / "x.npz").exists()


def test_token_strings_render_a_sentencepiece_vocabulary(torch_stack):
    """A Metaspace (SentencePiece-style, "▁") tokenizer trained here: the pieces are the
    text's own characters and join to it, which decoding token by token does not give."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvviz.model.models import token_strings, tokenize
    from kvviz.model.tokens import byte_token_strings

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>")
    ids, offsets, bos = tokenize(tok, TEXT, 500)
    assert bos is False and any(p.startswith("▁") for p in tok.convert_ids_to_tokens(ids))
    pieces = token_strings(tok, ids, TEXT, offsets)
    assert "".join(pieces) == TEXT and not any("▁" in p for p in pieces)
    assert "".join(byte_token_strings(tok, ids)) != TEXT  # decoding token by token loses the spaces


def test_a_gguf_hash_is_remembered_across_processes_until_the_file_changes(tmp_path, monkeypatch):
    import hashlib
    import os as _os

    from kvviz.model import models

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    monkeypatch.setattr(models, "_HASHES", {})
    assert models.file_sha256(gguf, remember=True) == hashlib.sha256(b"one").hexdigest()
    assert (tmp_path / "cache" / "kvviz" / "sha256.json").is_file()
    monkeypatch.setattr(models, "_HASHES", {})  # a new process: read back, not recomputed
    st = gguf.stat()
    with open(gguf, "r+b") as fh:  # same size and mtime, other bytes: the book is believed
        fh.write(b"two")
    _os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert models.file_sha256(gguf, remember=True) == hashlib.sha256(b"one").hexdigest()
    monkeypatch.setattr(models, "_HASHES", {})
    gguf.write_bytes(b"three")  # a new size: hashed again
    assert models.file_sha256(gguf, remember=True) == hashlib.sha256(b"three").hexdigest()


def test_a_model_listed_in_kvviz_models_is_found_by_name(tiny, monkeypatch):
    from kvviz.model.models import available, resolve

    folder = tiny("qwen2")
    monkeypatch.setenv("KVVIZ_MODELS", str(folder))
    assert resolve(folder.name).path == folder.resolve()
    assert available()[folder.name] == str(folder.resolve())
    with pytest.raises(ValueError, match=rf"not an installed model \(installed: smollm2, {folder.name}\)"):
        resolve("no-such-model")


@pytest.mark.parametrize("arch", ARCHS)
def test_direct_load_is_the_same_model_as_from_pretrained(tiny, arch, torch_stack):
    """The fast path (empty parameters, the safetensors file assigned in) must give exactly
    from_pretrained's model: every parameter and buffer, tied weights, logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvviz.model.models import _load_folder

    folder = tiny(arch)
    _, fast = _load_folder(folder)
    # GPT-NeoX saves its head under the legacy name embed_out: the fast path declines it
    assert getattr(fast, "kvviz_direct_load", False) == (arch != "gpt_neox"), f"{arch}: the wrong path was taken"
    slow = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="eager",
                                                dtype=torch.float32).eval()
    a, b = fast.state_dict(), slow.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    bufs = dict(slow.named_buffers())
    assert {n for n, _ in fast.named_buffers()} == set(bufs)
    assert all(torch.equal(v, bufs[n]) for n, v in fast.named_buffers())
    emb, head = fast.get_input_embeddings().weight, fast.get_output_embeddings().weight
    tied = slow.get_input_embeddings().weight.data_ptr() == slow.get_output_embeddings().weight.data_ptr()
    assert (emb.data_ptr() == head.data_ptr()) == tied
    ids = torch.tensor([[1, 500, 600, 700, 800]])
    with torch.no_grad():
        assert torch.equal(fast(ids).logits, slow(ids).logits)


def test_direct_load_leaves_other_folders_to_from_pretrained(tiny, tmp_path):
    """A checkpoint whose keys are not the model's own (here one renamed) must not be
    half-loaded by the fast path: it declines and from_pretrained's rules apply."""
    from safetensors.torch import load_file, save_file

    from kvviz.model.models import _direct_load

    folder = tmp_path / "renamed"
    shutil.copytree(tiny("llama"), folder)
    state = load_file(str(folder / "model.safetensors"))
    key = next(k for k in state if k.endswith("q_proj.weight"))
    state["legacy." + key] = state.pop(key)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert _direct_load(folder) is None


def _long_ids(tok, n):
    from kvviz.model.models import tokenize

    ids = tokenize(tok, TEXT * 8, n)[0]
    assert len(ids) == n
    return ids


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_at_full_budget_is_plain_greedy_with_its_log_probabilities(tiny, arch, torch_stack):
    """kvviz's generate (prompt token by token, and in one pass) at a budget of the whole
    sequence gives plain HF greedy output, each token's log-probability the plain forward's;
    Gemma 2's prompt runs past its 32-token window."""
    import torch

    from kvviz.model.loop import LoopConfig, generate

    tok, mdl = _pair(tiny, arch)
    ids, N = _long_ids(tok, 40), 6
    with torch.no_grad():
        plain = mdl.generate(torch.tensor([ids]), max_new_tokens=N, min_new_tokens=N, do_sample=False)[0]
        logp = torch.log_softmax(mdl(input_ids=plain[None, :-1]).logits[0].double(), dim=-1)
    want = logp[len(ids) - 1:].gather(1, plain[len(ids):, None])[:, 0].numpy()
    for mode in ("decode", "prefill"):
        gen = generate(ids, [LoopConfig("full"), LoopConfig("tova", {}, 40 + N)], N, model=(tok, mdl),
                       prompt_mode=mode, stop_at_eos=False, granularity="kv-head")
        assert gen.new_ids.tolist() == [plain[len(ids):].tolist()] * 2, mode
        np.testing.assert_allclose(gen.logprobs, [want, want], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("eviction", ["masked", "freed"])
def test_kvviz_hf_with_gradients_enabled_matches_a_plain_forward_at_full_budget(tiny, arch, eviction, torch_stack):
    """A user's own decode loop inside kvviz.hf.evicting, outside torch.no_grad(): every
    step's logits are the plain forward's at a budget of the whole text (Gemma 2 past its
    window), the logits still carry gradients, and a budget of 8 evicts and changes them."""
    import torch

    import kvviz.hf
    from kvviz.core.replay import NEVER
    from kvviz.model.models import attention_shape

    tok, mdl = _pair(tiny, arch)
    n, P = 72, 20
    ids = torch.tensor([_long_ids(tok, n)])
    with torch.no_grad():
        want = mdl(input_ids=ids).logits[0]

    def decode(budget):
        with kvviz.hf.evicting(mdl, "tova", budget, eviction=eviction) as log:
            out = mdl(input_ids=ids[:, :P], use_cache=True)
            logits, cache = [out.logits[0]], out.past_key_values
            for t in range(P, n):
                out = mdl(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
                logits.append(out.logits[0])
        return torch.cat(logits), log

    assert torch.is_grad_enabled()
    got, log = decode(n)
    assert got.requires_grad
    got.sum().backward()  # gradients flow through the eviction attention
    torch.testing.assert_close(got.detach(), want, atol=1e-4, rtol=0)
    shape = attention_shape(mdl)
    assert log.evicted_at.shape == (shape.layers, shape.kv_heads, n) and (log.evicted_at == NEVER).all()
    small, log = decode(8)
    assert (log.evicted_at != NEVER).any() and (small.detach() - want).abs().max() > 1e-3
    mdl.zero_grad(set_to_none=True)


def test_refusals_name_the_commands_own_options(tiny, tmp_path, capsys, torch_stack):
    """The loop has no --prompt-mode and needle's budgets are --budgets: each command's
    refusal names what that command takes."""
    from dataclasses import dataclass

    from kvviz.core import plugins
    from kvviz.core.policies import register_allocator
    from kvviz.model.loop import LoopConfig, run_loop
    from kvviz.model.needle.cli import main as needle_main
    from kvviz.policies import Allocator

    @dataclass
    class Planner(Allocator):  # plans its layers from its first rows: a freed loop cannot size it
        name = "uniform-planner"
        label = "Uniform planner"

        def calibration_rows(self):
            return 4

        def plan_layers(self, rows_by_layer):
            return [self.budget] * len(rows_by_layer)

    pair = _pair(tiny, "llama")
    register_allocator(Planner)
    try:
        with pytest.raises(ValueError, match=r"kvviz loop reads its text token by token; run it as a prompt with "
                                             r"kvviz generate --prompt-mode prefill"):
            run_loop(TEXT, [LoopConfig("uniform-planner", {"scorer": "tova"}, 40)], max_tokens=T, model=pair,
                     granularity="kv-head", eviction="freed")
    finally:
        plugins.forget()
    argv = ["--out", str(tmp_path / "n"), "--lengths", "128", "--policies", "tova", "--budgets", "500",
            "--eviction", "freed", "--model", str(tiny("llama"))]
    assert needle_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --budgets 500 with --eviction freed: ") and "--budget " not in err[-1]


def test_threads_follow_one_rule_and_each_command_says_what_it_used(tiny, tmp_path, monkeypatch, capsys,
                                                                     torch_stack):
    import os as _os

    import torch

    from kvviz.model.loop.cli import main as loop_main
    from kvviz.model.loop.generate_cli import main as generate_main
    from kvviz.model.models import thread_count
    from kvviz.model.needle.cli import main as needle_main

    for var in ("KVVIZ_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert thread_count() == (4, "min(4, 16 cores available)")
    monkeypatch.setattr(_os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert thread_count() == (2, "min(4, 2 cores available)")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thread_count() == (3, "$OMP_NUM_THREADS")
    monkeypatch.setenv("KVVIZ_THREADS", "1")  # a launcher running several side by side
    assert thread_count() == (1, "$KVVIZ_THREADS") and thread_count(2) == (2, "--threads")
    for bad, where in ((0, "--threads"), ("two", "--threads")):
        with pytest.raises(ValueError, match=rf"^{where} must be an integer >= 1, got "):
            thread_count(bad)
    monkeypatch.setenv("KVVIZ_THREADS", "0")
    with pytest.raises(ValueError, match=r"^\$KVVIZ_THREADS must be an integer >= 1, got '0'"):
        thread_count()
    monkeypatch.setenv("KVVIZ_THREADS", "1")

    before = torch.get_num_threads()
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    model = ["--model", str(tiny("gpt2")), "--quiet"]
    try:
        assert loop_main(["--text", str(text), "--max-tokens", "12", "--threads", "2", *model]) == 0
        assert torch.get_num_threads() == 2
        assert "[kvviz loop] torch threads: 2 (--threads)" in capsys.readouterr().err.splitlines()
        assert generate_main(["--prompt", TEXT, "--max-new-tokens", "2", *model]) == 0
        assert torch.get_num_threads() == 1
        assert ("[kvviz generate] torch threads: 1 ($KVVIZ_THREADS; --threads N to choose)"
                in capsys.readouterr().err.splitlines())
        for main in (loop_main, generate_main, needle_main):
            assert main(["--threads", "0", *model]) == 2
            assert capsys.readouterr().err.splitlines() == ["error: --threads must be an integer >= 1, got 0"]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("variant, cached", [(dict(new_decoder_architecture=True, num_kv_heads=2), 4),
                                             (dict(multi_query=False), 4), (dict(multi_query=True), 1)])
def test_falcons_other_layouts_cache_what_the_helper_says_and_match_a_plain_forward(tokenizer_dir, variant, cached,
                                                                                      torch_stack):
    """Falcon's new decoder architecture broadcasts its KV heads to every query head before
    caching; without multi_query it is multi-head: the loop follows the cache either way."""
    import torch
    import transformers as tf

    from kvviz.model.loop import LoopConfig, run_loop
    from kvviz.model.models import attention_shape, tokenize

    torch.manual_seed(0)
    cfg = tf.FalconConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=False,
                          initializer_range=0.2, **variant)
    mdl = tf.AutoModelForCausalLM.from_config(cfg).eval()
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenize(tok, TEXT, T)[0]
    with torch.no_grad():
        cache = mdl(input_ids=torch.tensor([ids[:3]]), use_cache=True).past_key_values
    assert attention_shape(mdl).kv_heads == cached == cache.layers[0].keys.shape[1]
    res = run_loop(TEXT, [LoopConfig("full"), LoopConfig("tova", {}, T), LoopConfig("tova", {}, 8)], max_tokens=T,
                   model=(tok, mdl), granularity="kv-head")
    want = _plain_nll(mdl, ids)
    np.testing.assert_allclose(res.nll[:2], [want, want], atol=1e-4, rtol=0)
    assert np.abs(res.nll[2] - want).max() > 1e-3 and res.evicted_at.shape[2] == cached


def test_loop_perf_prints_the_configurations_it_runs(tiny, monkeypatch, capsys, torch_stack):
    """`loop --perf` once printed "8 configs" while it ran more: what it prints is what ran."""
    from kvviz.model import models
    from kvviz.model.loop import engine
    from kvviz.studies import loop_perf

    pair = _pair(tiny, "gpt2")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pair)
    ran, inner = [], engine.run

    def recording(text, configs, *a, **kw):
        ran.append([c.label for c in configs])
        return inner(text, configs, *a, **kw)

    monkeypatch.setattr(engine, "run", recording)
    assert loop_perf.main(64, budget=40) == 0
    out = capsys.readouterr().out.splitlines()
    assert [len(r) for r in ran] == [len(ran[0]), len(ran[0]), 1] and len(ran[0]) > 8
    n = len(ran[0])
    assert f"configs ({n}): {', '.join(ran[0])}" in out
    assert any(line.startswith(f"batch efficiency (layer): {n} configs ") for line in out)
    assert [line.split()[:2] for line in out if line.startswith(("layer ", "kv-head "))] == \
        [["layer", str(n)], ["kv-head", str(n)], ["layer", "1"]]


@pytest.mark.parametrize("kind", ["mistral", "starcoder2", "qwen2"])
def test_a_16_token_window_at_four_times_the_window_matches_the_plain_model(tokenizer_dir, kind, torch_stack):
    """Every layer sliding (Mistral, Starcoder2) or Qwen2's use_sliding_window, a window of 16,
    a text of 64 tokens: the loop (masked and freed) at a full budget is the plain model; so
    is StreamingLLM without sinks at budget 15 (it holds the 15 keys before the query, what
    the window lets the query read besides itself), and at 14 it is not."""
    import torch
    import transformers as tf

    from kvviz.model.loop import LoopConfig, run_loop
    from kvviz.model.models import tokenize

    torch.manual_seed(0)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, sliding_window=16)
    cfg = {"mistral": lambda: tf.MistralConfig(**common),
           "starcoder2": lambda: tf.Starcoder2Config(**common),
           "qwen2": lambda: tf.Qwen2Config(**common, use_sliding_window=True, max_window_layers=0)}[kind]()
    mdl = tf.AutoModelForCausalLM.from_config(cfg).eval()
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    n = 64
    ids = tokenize(tok, TEXT * 6, n)[0]
    want = _plain_nll(mdl, ids)
    wide = type(mdl)(type(cfg)(**{**cfg.to_dict(), "sliding_window": 4 * n})).eval()
    wide.load_state_dict(mdl.state_dict())
    assert np.abs(_plain_nll(wide, ids) - want).max() > 1e-3  # the window matters here
    for eviction in ("masked", "freed"):
        cfgs = [LoopConfig("full"), LoopConfig("tova", {}, n), LoopConfig("streaming-llm", {"sinks": 0}, 15),
                LoopConfig("streaming-llm", {"sinks": 0}, 14)]
        res = run_loop(TEXT * 6, cfgs, max_tokens=n, model=(tok, mdl), eviction=eviction, granularity="kv-head")
        np.testing.assert_allclose(res.nll[:3], [want] * 3, atol=1e-4, rtol=0)
        assert (res.evicted_at[2] != -1).any() and np.abs(res.nll[3] - want).max() > 1e-3


@pytest.mark.parametrize("arch", ["gpt2", "gpt_bigcode", "falcon"])
def test_a_text_past_the_models_positions_is_refused_before_it_loads(tiny, arch, tmp_path, capsys, monkeypatch):
    """GPT-2 and GPTBigCode name their context `n_positions`; it is still the context (256 here)."""
    import kvviz.model.models as models
    from kvviz.model.loop.cli import main as loop_main

    def no_load(*a, **k):
        raise AssertionError("nothing may load for a text past the context")

    folder = tiny(arch)
    monkeypatch.setattr(models, "load_model", no_load)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 20, encoding="utf-8")
    capsys.readouterr()
    assert loop_main(["--text", str(text), "--max-tokens", "300", "--model", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --text {text} needs 300 positions, more than the model's context of 256"]
