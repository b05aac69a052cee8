"""Finds a model's local directory: the embedded default, a local folder, a .gguf file or a Hugging Face hub id.

Torch-free, so the head and the frontend locate a model without importing what the ranks compute with."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pagerail.common.default_model import cache_root, convert_gguf, default_model_dir

# What a hub snapshot needs: config, tokenizer and safetensors weights (not the duplicate consolidated.* files).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """Local directory holding config.json and safetensors weights for `model`.

    None → the embedded default model; a directory with config.json → itself; a .gguf file → converted once
    into the cache; anything else is taken as a Hugging Face hub id and downloaded (needs network access).
    """
    if model is None:
        return default_model_dir()
    text = os.fspath(model)
    if not text.strip():
        raise ValueError("model must be a local directory, a .gguf file or a hub id, got an empty string")
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ValueError(f"model={text!r} is a directory without config.json")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path, _gguf_cache_dir(path))
        raise ValueError(f"model={text!r} is a file but not a .gguf checkpoint; pass its directory instead")
    if _looks_like_path(text):
        raise ValueError(f"model={text!r} does not exist")
    return _download(text)


def _looks_like_path(text: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else that does not exist locally is a mistyped path.
    return text.startswith((".", "/", "~")) or text.count("/") > 1 or text.lower().endswith(".gguf") or "\\" in text


def _gguf_cache_dir(path: Path) -> Path:
    # Keyed by location, size and mtime, so replacing the file triggers a fresh conversion.
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{path.stem}-{digest}"


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        local = Path(snapshot_download(repo_id=repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # any failure (offline, unknown repo, auth) means the same thing to the user
        raise ValueError(
            f"model={repo_id!r} is not a local directory or .gguf file, and downloading it from the Hugging Face "
            f"hub failed ({type(exc).__name__}: {exc}); pass a local model directory or check network access"
        ) from exc
    if not (local / "config.json").is_file():
        raise ValueError(f"model={repo_id!r} was downloaded to {local} but has no config.json")
    return local
