"""The head's view of which LoRA adapters rank 0 holds read: a request for an adapter is scheduled only once its
read is done, so reading an adapter from disk never stalls a step; the requests behind it run meanwhile.

An adapter a waiting request names is asked for in a step batch (`lora_prefetch`), each rank reads it on a thread
beside its steps, and rank 0's result says when it is ready (`lora_ready`), when it holds it no more
(`lora_dropped`) and when a read failed (`lora_failed`). The ranks keep `--max-cpu-loras` adapters read, so at
most that many adapters that waiting requests need are read or being read at once: reading more would push out
of the ranks' host cache adapters that are still waited for, and read them again, and again.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagerail.cluster.core.request import Request
from pagerail.proto import step_pb2


class LoRAReadiness:
    """Adapters ready on rank 0, being read, and wanted by requests but not yet asked for."""

    def __init__(self, capacity: int) -> None:
        """`capacity`: adapters the ranks keep read (their host cache, --max-cpu-loras)."""
        self.capacity = capacity
        self.ready: set[int] = set()  # the scheduler admits requests of these adapters only
        self.reading: dict[int, str] = {}  # adapter id -> path, asked for and not yet answered
        self._wanted: dict[int, str] = {}  # adapter id -> path, in the order requests came

    def want(self, request: Request) -> None:
        """`request` waits for its adapter: have it read unless it is ready or being read."""
        lora = request.envelope.lora
        if lora is not None and lora.lora_int_id not in self.ready and lora.lora_int_id not in self.reading:
            self._wanted.setdefault(lora.lora_int_id, lora.lora_path)

    def next_reads(self, waiting: Iterable[Request]) -> list[tuple[int, str]]:
        """The adapters (id, path) to ask the ranks to read with the next step batch: those being read, again (a
        rank reading one ignores the ask, one holding it answers that it is ready: news lost with a failed step
        comes again), and the wanted ones the ranks have room to keep read beside those waiting requests already
        have ready or being read."""
        reads = list(self.reading.items())
        if not self._wanted:
            return reads
        needed: set[int] = set()
        held: set[int] = set()  # ready or being read, and waited for
        for request in waiting:
            lora_id = request.lora_id
            if lora_id:
                needed.add(lora_id)
                if lora_id in self.ready or lora_id in self.reading:
                    held.add(lora_id)
        for lora_id, path in list(self._wanted.items()):
            if lora_id not in needed or lora_id in self.ready or lora_id in self.reading:
                del self._wanted[lora_id]  # its requests ended or were admitted, or it was read meanwhile
                continue
            if len(held) >= self.capacity:
                break
            reads.append((lora_id, path))
            del self._wanted[lora_id]
            self.reading[lora_id] = path
            held.add(lora_id)
        return reads

    def observe(self, result: step_pb2.StepResult, waiting: Iterable[Request]) -> dict[int, str]:
        """Take rank 0's news from a step's result; returns the adapters whose read failed, with the reason. An
        adapter dropped while requests still wait for it is wanted again."""
        self.ready.update(result.lora_ready)
        failed = {failure.lora_id: failure.message for failure in result.lora_failed}
        for lora_id in (*result.lora_ready, *failed):
            self.reading.pop(lora_id, None)
        if result.lora_dropped:
            dropped = set(result.lora_dropped)
            self.ready -= dropped
            for request in waiting:
                if request.lora_id in dropped:
                    self.want(request)
        return failed

    def reset(self, waiting: Iterable[Request]) -> None:
        """Steps' answers were lost (and the ranks may have restarted): know nothing, and ask again for every
        waiting request's adapter (a rank that still holds one answers that it is ready)."""
        self.ready.clear()
        self.reading.clear()
        self._wanted.clear()
        for request in waiting:
            self.want(request)
