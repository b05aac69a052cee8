"""Settings one worker needs to load its model shard and size its KV cache: the replica's EngineConfig, whole."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pagerail.common.engine_config import EngineConfig


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

    @property
    def device(self) -> str:
        """Where this rank computes: its pinned device, else the engine's."""
        return self.pinned_device or self.engine.device


def worker_config(config: EngineConfig, model_dir: str | os.PathLike[str]) -> WorkerConfig:
    """What every rank of the replica receives: the engine configuration itself, and where the model lies."""
    return WorkerConfig(os.fspath(model_dir), config)
