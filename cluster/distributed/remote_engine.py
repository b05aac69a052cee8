"""The LLM API's transport to a head actor on Ray: submit token-level requests, collect their outputs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import ray

from cluster.core.config import EngineConfig
from cluster.core.engine_client import RequestDelta
from cluster.core.sampling_params import SamplingParams
from cluster.distributed.head import ClusterOptions
from cluster.distributed.launcher import connect, start_head


class HeadUnavailableError(RuntimeError):
    """The head actor died while requests were in flight; Ray restarts it, the requests must be retried."""


class RemoteEngine:
    """Starts a head actor for this process and runs batches of requests through it."""

    def __init__(
        self, config: EngineConfig, options: ClusterOptions, ray_address: str | None, name: str, device: str = "auto"
    ) -> None:
        connect(ray_address)
        if device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0):
            options = replace(options, use_gpu=True)
        self.head = start_head(config, options, name)

    @classmethod
    def for_head(cls, head) -> RemoteEngine:
        """Batches run through a head actor that is already up (one replica of several)."""
        engine = cls.__new__(cls)
        engine.head = head
        return engine

    def run(
        self,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        stops: Callable[[str, list[int]], bool] | None = None,
    ) -> dict[str, SimpleNamespace]:
        """Submit every request at once; map request id → finished output.

        The outputs stream back on one channel, one message per engine step. `stops(request_id, new_token_ids)`
        is asked for each step's new tokens of a request: True finishes it there ("stop"), aborted at the head.
        """
        channel_id = uuid.uuid4().hex
        stream = self.head.outputs.remote(channel_id)
        try:
            ray.get([self.head.submit.remote(channel_id, rid, tokens, params) for rid, tokens, params in requests])
            return _collect(stream, {rid: _Output(rid) for rid, _, _ in requests}, self._stop_one(channel_id, stops))
        except ray.exceptions.RayActorError as error:
            raise HeadUnavailableError(
                "the head actor died with requests in flight; it is being restarted, retry the requests"
            ) from error
        except ray.exceptions.RayTaskError as error:
            cause = error.cause if hasattr(error, "cause") else None
            if isinstance(cause, ValueError):
                raise cause from None
            raise
        finally:
            # Ends the stream and aborts what is still running (a refused request, an interrupted caller).
            self.head.close_channel.remote(channel_id)

    def _stop_one(
        self, channel_id: str, stops: Callable[[str, list[int]], bool] | None
    ) -> Callable[[RequestDelta], bool]:
        def stop(delta: RequestDelta) -> bool:
            if stops is None or delta.finished or not stops(delta.request_id, delta.token_ids):
                return False
            self.head.abort.remote(delta.request_id, channel_id)
            return True

        return stop

    def wait_until_ready(self, timeout_s: float = 300.0) -> None:
        """Block until the head answers (after Ray restarted it, once its new workers are up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.get(self.head.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stats(self) -> dict:
        return ray.get(self.head.stats.remote())

    def shutdown(self) -> None:
        try:
            ray.get(self.head.shutdown.remote(), timeout=60)
        finally:
            ray.kill(self.head, no_restart=True)


@dataclass
class _Output:
    """One request's output as its deltas arrive, shaped like a finished Request so that the LLM fills outputs
    the same way for both paths."""

    request_id: str
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    status: SimpleNamespace | None = None
    error: str | None = None
    finished: bool = False

    def add(self, delta: RequestDelta) -> None:
        self.output_token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.top_logprobs.extend(delta.top_logprobs)
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish(delta.finish_reason, delta.error)

    def finish(self, reason: str | None, error: str | None = None) -> None:
        self.status, self.error, self.finished = SimpleNamespace(value=reason), error, True


def _collect(stream, outputs: dict[str, _Output], stop: Callable[[RequestDelta], bool]) -> dict[str, _Output]:
    """Read the channel's messages until every request finished; a request stopped here ignores later deltas."""
    remaining = set(outputs)
    for ref in stream:
        for request_id, item in ray.get(ref):
            if request_id not in remaining:
                continue
            if isinstance(item, BaseException):
                raise item
            output = outputs[request_id]
            output.add(item)
            if stop(item):
                output.finish("stop")
            if output.finished:
                remaining.discard(request_id)
        if not remaining:
            return outputs
    raise HeadUnavailableError("the head actor ended its output stream with requests in flight; retry them")
