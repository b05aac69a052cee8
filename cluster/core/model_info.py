"""Facts about a model the head needs (context limit, vocabulary, end-of-sequence ids), read from its files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelInfo:
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_model_info(model_dir: Path) -> ModelInfo:
    """Read config.json (and generation_config.json, whose eos list wins) without loading weights."""
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    eos = _as_ids(text_config.get("eos_token_id"))
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos = _as_ids(json.loads(generation.read_text()).get("eos_token_id")) or eos
    return ModelInfo(
        max_position_embeddings=int(text_config.get("max_position_embeddings", 2048)),
        vocab_size=int(text_config["vocab_size"]),
        eos_token_ids=eos,
    )
