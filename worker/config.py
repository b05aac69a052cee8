"""Settings one worker needs to load its model shard and size its KV cache: the replica's EngineConfig, whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine_config import EngineConfig


@dataclass(frozen=True)
class WorkerConfig:
    """The head's engine configuration, plus what differs per node or process: where the model lies here and how
    many threads this rank computes with. Crosses process boundaries as it is (plain frozen dataclasses)."""

    model_dir: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Torch intra-op threads; None: every core this process may run on.
    num_threads: int | None = None
    # The device its actor pinned this rank to ("cuda:0" under Ray, which shows each actor its own GPU only);
    # None: the engine's `device`.
    pinned_device: str | None = None

    # The engine settings a rank reads, under the names the worker uses; read from `engine`, never copied.
    @property
    def model_spec(self) -> str | None:
        """What the user asked for (None: the embedded default); a node without `model_dir` resolves it itself."""
        return self.engine.model

    @property
    def dtype(self) -> str:
        return self.engine.dtype

    @property
    def device(self) -> str:
        return self.pinned_device or self.engine.device

    @property
    def load_format(self) -> str:
        return self.engine.load_format

    @property
    def seed(self) -> int:
        return self.engine.seed

    @property
    def enforce_eager(self) -> bool:
        return self.engine.enforce_eager

    @property
    def block_size(self) -> int:
        return self.engine.cache.block_size

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        return self.engine.cache.kv_cache_memory_bytes

    @property
    def gpu_memory_utilization(self) -> float:
        return self.engine.cache.gpu_memory_utilization

    @property
    def num_blocks(self) -> int | None:
        return self.engine.cache.num_gpu_blocks

    @property
    def max_num_batched_tokens(self) -> int:
        return self.engine.scheduler.max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    @property
    def max_model_len(self) -> int | None:
        return self.engine.scheduler.max_model_len

    @property
    def otlp_traces_endpoint(self) -> str | None:
        return self.engine.observability.otlp_traces_endpoint

    @property
    def trace_sampling_ratio(self) -> float:
        return self.engine.observability.trace_sampling_ratio
