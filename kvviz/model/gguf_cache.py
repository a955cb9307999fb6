"""A GGUF dequantised once: safetensors + config + tokenizer in the user's cache folder.

Dequantising SmolLM2's Q4_1 GGUF to fp32 takes 17-40 s (minutes on a busy machine); reading
the same weights back from safetensors takes seconds. The folder is
$XDG_CACHE_HOME/kvviz/gguf/<sha256 of the .gguf> (else ~/.cache/kvviz/...), built in a
temporary folder beside it and renamed into place, so a reader never sees half of it. A
manifest of file sizes, written last, tells a finished folder from a partial or truncated
one, which is rebuilt with a message.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

MANIFEST = "kvviz-manifest.json"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvviz"


def problem(folder: Path) -> str | None:
    """Why `folder` is not a finished cache entry, or None when it is."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        sizes = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest (a partial build)"
    for name, size in sizes.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} is {p.stat().st_size} bytes, the manifest says {size} (truncated or corrupt)"
    return None


def dequantise(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers (dequantised to fp32) and save it as a model folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True,
                                                 dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model ("not serializable"): the weights are plain
    # fp32 tensors by now, so write them with safetensors (which drops tied duplicates).
    from safetensors.torch import save_model

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)


def cached_folder(gguf: Path, sha256: str, command: str = "capture", build=None,
                  reason: str | None = None) -> Path:
    """The cache folder for `gguf`, built with `build(gguf, folder)` (default `dequantise`)
    if absent or broken. `reason` forces a rebuild (a load of the folder failed), naming why."""
    from kvviz.model.log import log

    build = build or dequantise
    root = cache_root() / "gguf"
    folder = root / sha256
    why = reason or (problem(folder) if folder.exists() else None)
    if folder.exists() and why is None:
        return folder
    if why:
        log(f"cached model {folder} is unusable ({why}); rebuilding it", command)
    log(f"dequantising {gguf.name} once into {folder} (later loads read it from there) ...", command)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{sha256[:12]}."))
    try:
        build(gguf, tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        for name in files:
            os.chmod(tmp / name, 0o644)
        (tmp / MANIFEST).write_text(json.dumps({"source": gguf.name, "sha256": sha256, "files": files}),
                                    encoding="utf-8")
        os.chmod(tmp, 0o755)
        if folder.exists():  # broken entry: move aside first so the rename is one step
            aside = Path(tempfile.mkdtemp(dir=root, prefix=f".{sha256[:12]}.old."))
            os.replace(folder, aside / "x")
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: keep theirs
            if problem(folder) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
