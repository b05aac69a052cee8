"""The in-process transport (tensor-parallel size 1 in the caller's process) and the worker settings every
transport derives from the engine's configuration."""

from __future__ import annotations

from pathlib import Path

from cluster.core.config import EngineConfig
from cluster.core.executor import WorkerGroupError
from proto import step_pb2
from worker.config import WorkerConfig
from worker.model_loader import resolve_model_dir
from worker.worker import Worker


def locate_model(config: EngineConfig) -> Path:
    """The local directory holding the model's config, weights and tokenizer."""
    return resolve_model_dir(config.model)


def worker_config(config: EngineConfig, model_dir: Path) -> WorkerConfig:
    cache = config.cache
    return WorkerConfig(
        model_dir=str(model_dir),
        model_spec=config.model,
        dtype=config.dtype,
        device=config.device,
        load_format=config.load_format,
        seed=config.seed,
        block_size=cache.block_size,
        kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        num_blocks=cache.num_gpu_blocks,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        otlp_traces_endpoint=config.observability.otlp_traces_endpoint,
        trace_sampling_ratio=config.observability.trace_sampling_ratio,
    )


class InProcessExecutor:
    """Tensor-parallel size 1 in the caller's process: the step message is handed over without copying."""

    def __init__(self, config: WorkerConfig) -> None:
        self.worker = Worker(config)
        self.num_blocks = self.worker.num_blocks

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        return self.worker.execute_step(batch)

    def restart(self) -> int:
        raise WorkerGroupError("the in-process worker cannot be restarted")

    def shutdown(self) -> None:
        self.worker = None
