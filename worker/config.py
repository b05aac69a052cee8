"""Settings one worker needs to load its model shard and size its KV cache."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    """Built by the head from its engine configuration; plain values so it crosses process boundaries."""

    model_dir: str
    # What the user asked for (None: the embedded default); a node without `model_dir` resolves it itself.
    model_spec: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # Longest context a request may reach; None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # True: never capture CUDA graphs (every step runs eagerly).
    enforce_eager: bool = False
    # Torch intra-op threads; None: every core this process may run on.
    num_threads: int | None = None
    # OTLP collector for this rank's spans; None: tracing off.
    otlp_traces_endpoint: str | None = None
    trace_sampling_ratio: float = 1.0
