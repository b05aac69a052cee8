"""What attention runs on a rank, fixed when its runner starts: the input to every step's choice of backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagerail.worker.input_batch import GatherWorkspace
from pagerail.worker.layers.attention import decode_path, paged_prefill_max_context

DECODE_PATHS = ("triton", "native", "torch")


@dataclass(frozen=True)
class AttentionSettings:
    """The decode path the model's layers take on this device (attention.decode_path) and what goes with it."""

    decode_path: str
    # The native kernel only: steps whose prefill chunks all end within this context run every row through it.
    paged_prefill_max_context: int = 0
    # The torch path only: reusable buffers its decodes gather K and V into (None: allocated per layer).
    workspace: GatherWorkspace | None = None

    def __post_init__(self) -> None:
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {DECODE_PATHS}, got {self.decode_path!r}")
        if self.paged_prefill_max_context and self.decode_path != "native":
            raise ValueError("paged_prefill_max_context applies to the native decode path only")

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, block_size: int
    ) -> AttentionSettings:
        """The settings of `model`'s attention shard on `device`."""
        heads, kv_heads, head_dim = model.num_heads_per_rank, model.num_kv_heads_per_rank, model.head_dim
        path = decode_path(device, heads, kv_heads, head_dim, dtype)
        workspace = None
        if device.type == "cpu" and path == "torch":
            # The Triton and native kernels read the cache in place: only the torch path gathers.
            workspace = GatherWorkspace(block_size, kv_heads, head_dim, dtype, device)
        return cls(path, paged_prefill_max_context(device, heads, kv_heads, head_dim, dtype), workspace)
