"""In-process engines over a tiny random checkpoint, built as the embedded mode builds its own, for engine tests."""

from __future__ import annotations

from pathlib import Path

from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.model_info import read_model_info
from pagerail.cluster.distributed.local_executor import InProcessExecutor
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.worker.config import worker_config


def tiny_engine(model_dir: str | Path, num_blocks: int = 64, block_size: int = 4, **scheduler) -> EngineCore:
    """A fresh EngineCore with its own in-process rank over `model_dir`; `scheduler` sets SchedulerConfig fields."""
    config = EngineConfig(
        model=str(model_dir),
        device="cpu",
        cache=CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks),
        scheduler=SchedulerConfig(**{"max_num_batched_tokens": 64, **scheduler}),
    )
    info = read_model_info(Path(model_dir))
    executor = InProcessExecutor(worker_config(config, Path(model_dir)))
    engine = EngineCore.for_model(config, executor, info)
    engine.restart_backoff_s = 0.0
    return engine


def close(engine: EngineCore) -> None:
    """Release the engine's rank (its model and KV cache)."""
    engine.executor.shutdown()
