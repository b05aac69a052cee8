"""How the engine drives its workers: the one small interface every transport implements."""

from __future__ import annotations

from typing import Protocol

from pagerail.proto import step_pb2


class WorkerGroupError(RuntimeError):
    """A rank failed, died or missed its deadline: the whole group must be rebuilt."""


class PendingStep(Protocol):
    """A step handed to the ranks; `result()` waits for rank 0's StepResult or raises WorkerGroupError."""

    def result(self) -> step_pb2.StepResult: ...


class Executor(Protocol):
    """Sends StepBatches to every rank. Steps run on the ranks in the order they were submitted, so the engine
    may submit step N+1 before step N's result is back (the ranks keep the tokens they sampled themselves)."""

    num_blocks: int
    # True where the head's own work can run beside the ranks' forward pass (what overlapped steps assume): ranks
    # on accelerators, or ranks in processes of their own. False for a CPU rank on the head's own thread, whose
    # forward needs that thread and every core. The default of async_scheduling; a transport without it: False.
    overlap_by_default: bool

    def submit(self, batch: step_pb2.StepBatch) -> PendingStep:
        """Hand the step to the ranks and return at once (a transport may wait until an earlier step is done)."""
        ...

    def restart(self) -> int:
        """Replace every rank with a fresh one (new processes, empty cache); returns the new block count.

        Steps still pending are abandoned: their results are never asked for."""
        ...

    def shutdown(self) -> None: ...


class CompletedStep:
    """A step that already ran: for transports that execute while submitting."""

    def __init__(self, result: step_pb2.StepResult | None = None, error: WorkerGroupError | None = None) -> None:
        self._result = result
        self._error = error

    def result(self) -> step_pb2.StepResult:
        if self._error is not None:
            raise self._error
        return self._result
