"""Serves the head's step stream: steps run in arrival order on a thread of their own, while the next step is
received and the previous result is sent, so the rank goes from one step to the next without a network wait."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import grpc

from pagerail.proto import step_pb2

logger = logging.getLogger(__name__)

_END = object()  # no more steps: the head closed or cancelled the stream


def serve_step_stream(
    requests: Iterator[step_pb2.StepBatch],
    context: grpc.ServicerContext,
    execute: Callable[[step_pb2.StepBatch], step_pb2.StepResult],
    step_span: Callable[[step_pb2.StepBatch], AbstractContextManager],
    rank: int,
) -> Iterator[step_pb2.StepResult]:
    """The response iterator of one StepStream call: `execute` runs each step (`step_span` around it), in order.

    Three threads share the work: a reader takes steps off the stream (and parses them) as they arrive, a runner
    executes them one at a time, and gRPC's handler thread (this generator) sends each result. A step that raises
    is answered with a result carrying its error, and the runner executes nothing after it; the stream stays open
    until the head closes its side (it does on reading the error), then ends with INTERNAL naming the step.
    Ending it at once would race the head's write of its next step, and a client write that fails as a stream
    ends may replace the stream's status with a bare "Internal error from Core" (grpc.aio), losing the reason.
    """
    context.send_initial_metadata(())  # the head waits for this to know the stream is open before any step
    steps: queue.SimpleQueue = queue.SimpleQueue()
    results: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(requests, steps, rank), name=f"step-stream-read-{rank}", daemon=True).start()
    runner = threading.Thread(
        target=_run, args=(steps, results, execute, step_span, rank), name=f"step-stream-run-{rank}", daemon=True
    )
    runner.start()
    failed: step_pb2.StepResult | None = None
    while (item := results.get()) is not _END:
        if item.error:
            failed = item
        yield item
    if failed is not None:
        context.abort(grpc.StatusCode.INTERNAL, f"step {failed.step_id}: {failed.error}")


def _read(requests: Iterator[step_pb2.StepBatch], steps: queue.SimpleQueue, rank: int) -> None:
    try:
        for batch in requests:
            steps.put(batch)
    except grpc.RpcError:
        # The head cancelled or lost the stream (it is rebuilding the group): nobody waits for an answer.
        logger.info("rank %d: step stream ended by the head", rank)
    except Exception:  # a malformed message: the stream cannot go on
        logger.exception("rank %d: could not read the step stream", rank)
    steps.put(_END)


def _run(
    steps: queue.SimpleQueue,
    results: queue.SimpleQueue,
    execute: Callable[[step_pb2.StepBatch], step_pb2.StepResult],
    step_span: Callable[[step_pb2.StepBatch], AbstractContextManager],
    rank: int,
) -> None:
    while (batch := steps.get()) is not _END:
        try:
            with step_span(batch):
                result = execute(batch)
        except Exception as error:
            logger.exception("rank %d: step %d failed", rank, batch.step_id)
            results.put(step_pb2.StepResult(step_id=batch.step_id, error=f"{type(error).__name__}: {error}"))
            # The steps queued behind it were built on its outcome: none of them may run. They are read and
            # dropped until the head closes the stream, which then ends.
            while steps.get() is not _END:
                pass
            break
        results.put(result)
    results.put(_END)
