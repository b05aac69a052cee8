"""Whether a model (its Hugging Face config, object or dict) can spread its experts over a tensor-parallel group."""

from __future__ import annotations

from typing import Any

# Where each mixture-of-experts family keeps its routed expert count (Qwen2/3-MoE; Mixtral, gpt-oss; DeepSeek).
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def num_routed_experts(config: Any) -> int:
    """The number of routed experts per MoE layer, 0 for a dense model."""
    for name in EXPERT_COUNT_FIELDS:
        value = _field(config, name)
        if value:
            return int(value)
    return 0


def check_expert_parallel(config: Any, tensor_parallel_size: int) -> None:
    """Refuse expert parallelism that the model cannot use: no experts, or experts that do not split evenly.

    With it each rank of the tensor-parallel group holds num_experts / tensor_parallel_size whole experts.
    """
    num_experts = num_routed_experts(config)
    if num_experts == 0:
        model_type = _field(config, "model_type")
        raise ValueError(
            f"enable_expert_parallel=True needs a mixture-of-experts model; model_type={model_type!r} has no routed "
            f"experts (none of {', '.join(EXPERT_COUNT_FIELDS)} is set)"
        )
    if tensor_parallel_size > num_experts:
        raise ValueError(
            f"enable_expert_parallel=True needs tensor_parallel_size <= num_experts: "
            f"tensor_parallel_size={tensor_parallel_size} ranks for num_experts={num_experts}"
        )
    if num_experts % tensor_parallel_size:
        raise ValueError(
            f"enable_expert_parallel=True needs num_experts={num_experts} divisible by "
            f"tensor_parallel_size={tensor_parallel_size}"
        )
