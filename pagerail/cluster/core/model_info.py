"""Facts about a model the head needs (context limit, vocabulary, end-of-sequence ids), read from its files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pagerail.common.attention_windows import uniform_sliding_window
from pagerail.common.engine_config import EngineConfig
from pagerail.common.expert_parallel import check_expert_parallel, num_routed_experts
from pagerail.common.lora import projection_shapes
from pagerail.common.pooling_config import PoolingConfig, read_pooling_config
from pagerail.common.special_tokens import tokenizer_special_id


@dataclass(frozen=True)
class ModelInfo:
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # The window when every layer attends over the same sliding window: the block table can then release blocks
    # that left it. None when any layer attends over the whole context.
    sliding_window: int | None = None
    model_type: str | None = None
    num_routed_experts: int = 0  # experts per MoE layer; 0 for a dense model
    # Whether it only pools (an encoder, or --runner pooling), its labels, its default pooling.
    pooling: PoolingConfig = PoolingConfig()
    # (output, input) features of the projections LoRA adapters may target, and the decoder layers; None when
    # the config does not describe a Llama-family decoder.
    projection_shapes: Mapping[str, tuple[int, int]] | None = None
    num_layers: int = 0

    def check_engine(self, config: EngineConfig) -> None:
        """Refuse, before any rank starts, engine settings this model cannot run (expert parallelism without
        experts, or over ranks its experts do not divide among)."""
        if config.enable_expert_parallel:
            fields = {"model_type": self.model_type, "num_experts": self.num_routed_experts}
            check_expert_parallel(fields, config.tensor_parallel_size)


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_model_info(
    model_dir: Path, runner: str = "auto", convert: str = "auto", pooler_config: str | None = None
) -> ModelInfo:
    """Read config.json without loading weights. The end-of-sequence ids: generation_config.json's list wins over
    config.json's, and a model naming none in either stops at its tokenizer's eos token, so the same model stops
    at the same token whichever entry point serves it."""
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    eos = _as_ids(text_config.get("eos_token_id"))
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos = _as_ids(json.loads(generation.read_text()).get("eos_token_id")) or eos
    if not eos:
        eos = _as_ids(tokenizer_special_id(model_dir, "eos_token"))
    pooling = read_pooling_config(model_dir, runner, convert, pooler_config)
    positions = int(text_config.get("max_position_embeddings", 2048))
    if text_config.get("model_type") in ("roberta", "xlm-roberta"):
        positions -= int(text_config.get("pad_token_id", 1)) + 1  # RoBERTa's positions start after its padding id
    return ModelInfo(
        max_position_embeddings=positions,
        vocab_size=int(text_config["vocab_size"]),
        eos_token_ids=eos,
        sliding_window=uniform_sliding_window(text_config),
        model_type=text_config.get("model_type"),
        num_routed_experts=num_routed_experts(text_config),
        pooling=pooling,
        projection_shapes=projection_shapes(text_config) if "num_attention_heads" in text_config else None,
        num_layers=int(text_config.get("num_hidden_layers", 0)),
    )
