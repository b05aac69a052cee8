"""Maps a Hugging Face architecture name (or model_type) to the model class that implements it."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagerail.common.pooling_config import ENCODER_ARCHITECTURES, ENCODER_MODEL_TYPES
from pagerail.worker.models.bert import BertEncoder
from pagerail.worker.models.gemma import GemmaForCausalLM
from pagerail.worker.models.gpt_oss import GptOssForCausalLM
from pagerail.worker.models.llama import LlamaForCausalLM
from pagerail.worker.models.mixtral import MixtralForCausalLM
from pagerail.worker.models.qwen2_moe import Qwen2MoeForCausalLM
from pagerail.worker.models.qwen3_moe import Qwen3MoeForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    # Encoders, served as pooling models (embeddings; the classification heads for /classify, /score, /rerank).
    **dict.fromkeys(ENCODER_ARCHITECTURES, BertEncoder),
}

# Configs converted from GGUF or written by hand may lack `architectures`; their model_type still identifies them.
_MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "phi3": LlamaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    **dict.fromkeys(ENCODER_MODEL_TYPES, BertEncoder),
}


def supported_architectures() -> list[str]:
    """Architecture names this engine can serve."""
    return sorted(_ARCHITECTURES)


def model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for `hf_config`, from architectures[0] or else model_type; ValueError when unsupported."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        name = architectures[0]
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
        raise ValueError(
            f"architectures[0]={name!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"model_type={model_type!r} (no architectures in config) is not supported; "
        f"supported: {', '.join(sorted(_MODEL_TYPES))}"
    )
