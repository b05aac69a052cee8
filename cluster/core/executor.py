"""How the engine drives its workers: the one small interface every transport implements."""

from __future__ import annotations

from typing import Protocol

from proto import step_pb2


class WorkerGroupError(RuntimeError):
    """A rank failed, died or missed its deadline: the whole group must be rebuilt."""


class Executor(Protocol):
    """Sends one StepBatch to every rank and returns rank 0's StepResult."""

    num_blocks: int

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult: ...

    def restart(self) -> int:
        """Replace every rank with a fresh one (new processes, empty cache); returns the new block count."""
        ...

    def shutdown(self) -> None: ...
