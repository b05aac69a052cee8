"""What the frontend needs from an engine: token-level requests in, token deltas out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.kv_handoff import KvHandoff


@dataclass
class RequestDelta:
    """New tokens of one request since its previous delta, and its state; the last one has finished=True."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    logprobs: list[float] = field(default_factory=list)  # aligned with token_ids when asked for
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None  # why the engine gave up, when it did
    # "worker_failure" (retriable), "session_idle_timeout" or "quarantined", with `error`.
    error_code: str | None = None
    # With prompt_logprobs, on the request's first delta: per prompt position, (logprob, rank, top logprobs) of
    # its token given the ones before it; position 0 (nothing before it) is None.
    prompt_logprobs: list[tuple[float, int, dict[int, float]] | None] | None = None
    # An embedding request's pooled vector, on its last delta.
    pooled: list[float] | None = None

    def __reduce__(self):
        # A head sends hundreds of deltas per step to each frontend. Pickled as its fields in order, a delta is
        # rebuilt by one constructor call instead of an instance dict: about half the unpickling time.
        return (
            type(self),
            (
                self.request_id,
                self.token_ids,
                self.num_prompt_tokens,
                self.num_output_tokens,
                self.finished,
                self.finish_reason,
                self.logprobs,
                self.top_logprobs,
                self.num_cached_tokens,
                self.error,
                self.error_code,
                self.prompt_logprobs,
                self.pooled,
            ),
        )


def merge_deltas(consecutive: list[RequestDelta]) -> RequestDelta:
    """One delta standing for consecutive ones of a request: all their tokens in order, the last one's state."""
    if len(consecutive) == 1:
        return consecutive[0]
    return replace(
        consecutive[-1],
        prompt_logprobs=consecutive[0].prompt_logprobs,
        token_ids=[token for delta in consecutive for token in delta.token_ids],
        logprobs=[logprob for delta in consecutive for logprob in delta.logprobs],
        top_logprobs=[top for delta in consecutive for top in delta.top_logprobs],
    )


async def next_delta(deltas: asyncio.Queue) -> RequestDelta:
    """A request's next delta from its queue; an exception in the queue is raised, after the tokens before it.

    Deltas that queued up while the consumer was busy come out merged into one: a consumer that falls behind the
    engine (hundreds of streams on a busy frontend) then catches up with one pass per wake instead of one per
    step, and its cost per token falls as its load rises. A consumer that keeps up sees every step's delta. The
    engine clients' streams call it in their own loop: no iterator of its own between the queue and the caller.
    """
    item = await deltas.get()
    if isinstance(item, BaseException):
        raise item
    if item.finished or deltas.empty():
        return item
    queued = [item]
    while not queued[-1].finished and not deltas.empty():
        following = deltas.get_nowait()
        if isinstance(following, BaseException):
            # Raised by the next call, once the tokens before it are delivered; nothing after a failure counts.
            while not deltas.empty():
                deltas.get_nowait()
            deltas.put_nowait(following)
            break
        queued.append(following)
    return merge_deltas(queued)


class EngineClient(Protocol):
    """One model replica as the frontend sees it. `generate` raises ValueError for bad input, QueueFullError
    when the waiting queue is full; both before yielding anything. The request's `trace_context` is the W3C
    carrier (traceparent, tracestate) of the request span the engine's step spans link to."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]  # the tokens that end a sequence (unless a request ignores them)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]: ...

    async def append_input(self, request_id: str, token_ids: list[int], final: bool) -> None: ...

    async def abort(self, request_id: str, stopped: bool = False) -> None:
        """End a request; `stopped`: the caller found a stop string in its text, so it finishes with reason "stop"
        (counted as a finish, not an abort)."""
        ...

    async def is_ready(self) -> bool: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def stats(self) -> dict: ...

    async def kv_events(self, epoch: int | None, seq: int) -> dict:
        """Block events of the replica's caches after (epoch, seq), or a snapshot (cluster/core/kv_events.py)."""
        ...

    async def export_kv(self, token_ids: list[int]) -> KvHandoff | None:
        """The KV blocks the replica caches for `token_ids`, to continue their request elsewhere (kv_handoff.py)."""
        ...

    async def import_kv(self, handoff: KvHandoff) -> int:
        """Take another replica's KV blocks into this replica's host tier; how many blocks it took."""
        ...

    async def metrics(self) -> str:
        """Prometheus text exposition of the engine (head and worker ranks)."""
        ...
