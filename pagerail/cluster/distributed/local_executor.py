"""The in-process transport: tensor-parallel size 1 in the caller's process."""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor

from pagerail.cluster.core.executor import CompletedStep, PendingStep, WorkerGroupError
from pagerail.proto import step_pb2
from pagerail.worker.config import WorkerConfig
from pagerail.worker.worker import Worker


class InProcessExecutor:
    """Tensor-parallel size 1 in the caller's process: the step message is handed over without copying.

    Steps run on one thread of their own, in submission order, so the engine schedules the next step while the
    forward pass runs (torch releases the GIL inside its kernels).
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.worker = Worker(config)
        self.num_blocks = self.worker.num_blocks
        self.num_host_blocks = self.worker.num_host_blocks
        self.weights = self.worker.weights
        # A CPU rank's forward needs this thread and every core: its steps run inline and do not overlap.
        self.overlap_by_default = self.worker.device.type == "cuda"
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagerail-rank0")

    def submit(self, batch: step_pb2.StepBatch) -> PendingStep:
        if not self.overlap_by_default:
            # On the CPU the forward needs every core and steps do not overlap: run it here, without a thread hop.
            return CompletedStep(self.worker.execute_step(batch))
        # The caller's context travels along, so the rank's spans stay children of the step's dispatch span.
        context = contextvars.copy_context()
        return self._thread.submit(context.run, self.worker.execute_step, batch)  # a Future is a PendingStep

    @property
    def kv_layout(self) -> dict:
        return self.worker.kv_layout

    def export_blocks(self, block_ids: list[int]):
        """Every KV head of `block_ids`, [n, layers, 2, kv_heads, block_size, head_dim] (one rank holds them all)."""
        return self._on_rank_thread(self.worker.export_blocks, block_ids)

    def import_host(self, slots: list[int], data) -> None:
        self._on_rank_thread(self.worker.import_host, slots, data)

    def _on_rank_thread(self, fn, *args):
        # After every step submitted so far, where the steps run: never beside one.
        if not self.overlap_by_default:
            return fn(*args)
        return self._thread.submit(fn, *args).result()

    def restart(self) -> int:
        raise WorkerGroupError("the in-process worker cannot be restarted")

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
        if self.worker is not None:
            worker, self.worker = self.worker, None
            worker.close()
