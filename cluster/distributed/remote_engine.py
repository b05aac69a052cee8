"""The LLM API's transport to a head actor on Ray: submit token-level requests, collect their outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
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

    def run(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> dict[str, SimpleNamespace]:
        """Submit every request at once; map request id → finished output."""
        refs = [self.head.generate.remote(rid, tokens, params) for rid, tokens, params in requests]
        try:
            results = ray.get(refs)
        except ray.exceptions.RayActorError as error:
            for rid, _, _ in requests:
                self.head.abort.remote(rid)
            raise HeadUnavailableError(
                "the head actor died with requests in flight; it is being restarted, retry the requests"
            ) from error
        except ray.exceptions.RayTaskError as error:
            cause = error.cause if hasattr(error, "cause") else None
            if isinstance(cause, ValueError):
                raise cause from None
            raise
        return {result.request_id: _as_request(result) for result in results}

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


def _as_request(result: RequestDelta) -> SimpleNamespace:
    """Shape a head's result like a finished Request, so the LLM fills outputs the same way for both paths."""
    return SimpleNamespace(
        request_id=result.request_id,
        output_token_ids=result.token_ids,
        logprobs=result.logprobs,
        top_logprobs=result.top_logprobs,
        num_cached_tokens=result.num_cached_tokens,
        status=SimpleNamespace(value=result.finish_reason),
        error=result.error,
        finished=True,
    )
