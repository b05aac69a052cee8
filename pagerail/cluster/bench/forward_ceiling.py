"""The forward-only ceiling: a workload's prefill and decode batches pushed through the model and its paged KV
cache alone, with no scheduler, engine or transport, giving the most output tokens/s the engine could reach."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from pagerail.cluster.bench.workload import BenchRequest, throughput
from pagerail.common.engine_args import engine_config
from pagerail.proto import step_pb2
from pagerail.worker.config import WorkerConfig
from pagerail.worker.worker import Worker


def blocks_per_request(request: BenchRequest, block_size: int) -> int:
    return -(-(request.prompt_len + request.output_len) // block_size)


def kv_blocks_needed(requests: list[BenchRequest], block_size: int) -> int:
    """Blocks that hold every request's whole context at once, so no run of this workload ever preempts."""
    return sum(blocks_per_request(r, block_size) for r in requests)


_GREEDY = step_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)


class _Replay:
    """Builds the workload's StepBatches (every prompt prefilled, then one decode step per output position over
    every unfinished sequence), runs each on the worker, and adds up what the rank reports."""

    def __init__(self, worker: Worker, requests: list[BenchRequest], budget: int) -> None:
        self.worker = worker
        self.requests = requests
        self.budget = budget
        self.produced: dict[int, int] = {}
        self.forward_seconds = 0.0
        self.compute_seconds = 0.0
        self.decode_forwards: list[float] = []
        self.counts = {"prefill_steps": 0, "decode_steps": 0, "max_decode_batch": 0}
        self._step_id = 0

    def run(self) -> int:
        """Output tokens sampled over the whole workload."""
        block_size = self.worker.config.engine.cache.block_size
        next_block, pending = 0, deque()
        for handle, request in enumerate(self.requests, start=1):
            count = blocks_per_request(request, block_size)
            pending.append((handle, request, list(range(next_block, next_block + count)), 0))
            next_block += count
        while pending:
            batch = self._batch()
            left = self.budget
            while pending and left:
                handle, request, blocks, done = pending.popleft()
                take = min(request.prompt_len - done, left)
                partial = done + take < request.prompt_len
                if done == 0:
                    batch.new_requests.add(
                        handle=handle,
                        request_id=str(handle),
                        token_ids=request.prompt_token_ids,
                        num_prompt_tokens=request.prompt_len,
                        sampling=_GREEDY,
                        block_ids=blocks,
                        num_scheduled_tokens=take,
                        skip_sampling=partial,
                    )
                else:
                    batch.cached_requests.add(handle=handle, num_scheduled_tokens=take, skip_sampling=partial)
                left -= take
                if partial:
                    pending.appendleft((handle, request, blocks, done + take))
            self._execute(batch, decode=False)
        targets = {handle: request.output_len for handle, request in enumerate(self.requests, start=1)}
        forgotten: set[int] = set()
        while True:
            running = [h for h, target in targets.items() if self.produced.get(h, 0) < target]
            if not running:
                last = self._batch()
                last.finished.extend(sorted(set(targets) - forgotten))
                self.worker.execute_step(last)  # the rank forgets them all, ready for another replay
                break
            batch = self._batch()
            # Finished requests are dropped on the rank as the engine would, so its state stays the same size.
            done = [h for h in targets if h not in forgotten and self.produced.get(h, 0) >= targets[h]]
            batch.finished.extend(done)
            forgotten.update(done)
            batch.decode_handles.extend(running)  # as the engine sends a plain decode
            self._execute(batch, decode=True)
        return sum(self.produced.values())

    def _batch(self) -> step_pb2.StepBatch:
        self._step_id += 1
        return step_pb2.StepBatch(step_id=self._step_id)

    def _execute(self, batch: step_pb2.StepBatch, decode: bool) -> None:
        result = self.worker.execute_step(batch)
        for handle in result.handles:
            self.produced[handle] = self.produced.get(handle, 0) + 1
        self.forward_seconds += result.forward_seconds
        self.compute_seconds += result.compute_seconds
        if decode:
            self.decode_forwards.append(result.forward_seconds)
            self.counts["decode_steps"] += 1
            self.counts["max_decode_batch"] = max(self.counts["max_decode_batch"], len(batch.decode_handles))
        else:
            self.counts["prefill_steps"] += 1


def measure_forward_ceiling(
    model_dir: str | Path,
    requests: list[BenchRequest],
    *,
    warmup: list[BenchRequest] | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    dtype: str = "auto",
    device: str = "auto",
    seed: int = 0,
) -> dict[str, Any]:
    """Output tokens/s of the forward passes alone, over the same tokens the engine must produce.

    A worker of its own (model and paged KV cache, in this process) runs every prompt, packed into steps of
    `max_num_batched_tokens`, then one decode step per output position over every unfinished sequence, greedy.
    The time counted is the forward pass with the LM head as the rank measures it (the same figure the engine's
    `forward` phase reports); the rank's input building and sampling around it are reported apart.
    """
    num_blocks = max(kv_blocks_needed(requests, block_size), kv_blocks_needed(warmup or [], block_size))
    engine = engine_config(
        dtype=dtype,
        device=device,
        seed=seed,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    config = WorkerConfig(str(model_dir), engine)
    worker = Worker(config)
    try:
        # A short pass first, so one-time costs (kernel builds, weight packing) fall outside the measurement.
        if warmup is None:
            warmup = [BenchRequest(r.prompt_token_ids, min(r.output_len, 4)) for r in requests[:16]]
        _Replay(worker, warmup, max_num_batched_tokens).run()
        replay = _Replay(worker, requests, max_num_batched_tokens)
        started = time.perf_counter()
        produced = replay.run()
        wall = time.perf_counter() - started
    finally:
        del worker
        gc.collect()
    decodes = replay.decode_forwards
    return {
        **throughput(requests, replay.forward_seconds, produced, "the forward ceiling"),
        "output_tokens": produced,
        "forward_seconds": replay.forward_seconds,
        # The whole step on the rank: its input building and sampling around the forward pass.
        "rank_compute_seconds": replay.compute_seconds,
        "wall_seconds": wall,
        **replay.counts,
        "decode_forward_p50_s": statistics.median(decodes) if decodes else 0.0,
    }
