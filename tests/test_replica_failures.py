"""Only a replica's real failure moves a request to another replica; any other error, a bug in our own code first
of all, surfaces: through the HTTP front door as a logged 500 that shows the client no internals."""

from __future__ import annotations

import asyncio
import logging

import grpc
import httpx
import pytest
from transformers import AutoTokenizer

from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.cluster.routing.failover import ReplicaFailed, is_replica_failure
from pagerail.cluster.routing.routed_client import RoutedEngineClient
from pagerail.common.sampling_params import SamplingParams
from tests.fake_engine import FakeEngineClient
from tests.requirements import require_module


class BrokenReplica(FakeEngineClient):
    """The fake engine, whose streams raise `error` after `after` deltas; it notes every request it receives."""

    def __init__(self, error: BaseException | None = None, after: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.error = error
        self.after = after
        self.received: list[str] = []

    async def generate(self, request: EngineRequest):
        self.received.append(request.request_id)
        count = 0
        async for delta in super().generate(request):
            if self.error is not None and count == self.after:
                raise self.error
            yield delta
            count += 1


def test_a_lost_replica_is_a_failure_and_a_bug_is_not():
    failures = [ReplicaFailed("its workers gave up"), ConnectionError("reset"), ConnectionRefusedError(), OSError()]
    bugs = [
        TypeError("bad operand"),
        AttributeError("no such field"),
        KeyError("x"),
        RuntimeError("oops"),
        ValueError("bad input"),
        AssertionError(),
        ZeroDivisionError(),
    ]
    assert all(is_replica_failure(error) for error in failures)
    assert not any(is_replica_failure(error) for error in bugs)


def test_rays_errors_for_a_dead_or_unreachable_actor_are_failures_and_a_task_error_is_not():
    ray_errors = require_module("ray.exceptions", "needs Ray")
    failures = [
        ray_errors.ActorDiedError(),
        ray_errors.RayActorError(),
        ray_errors.ActorUnavailableError("unreachable", None),
        ray_errors.RaySystemError("the raylet died"),
    ]
    assert all(is_replica_failure(error) for error in failures)
    # The head actor itself raised: it is alive, and the error (here a bug) says nothing about the replica.
    assert not is_replica_failure(ray_errors.RayTaskError("submit", "Traceback ...", TypeError("bad operand")))


def test_grpc_counts_only_an_unavailable_peer():
    class Rpc(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

    assert is_replica_failure(Rpc(grpc.StatusCode.UNAVAILABLE))
    assert not is_replica_failure(Rpc(grpc.StatusCode.INVALID_ARGUMENT))


@pytest.mark.parametrize("after", [0, 2], ids=["before-the-first-delta", "mid-stream"])
def test_a_bug_in_a_replica_stream_fails_the_request_without_moving_it(after):
    bug, healthy = BrokenReplica(TypeError("unsupported operand"), after), BrokenReplica()
    routed = RoutedEngineClient({"r0": bug, "r1": healthy}, policy="round-robin")

    async def scenario():
        tokens = []
        async for delta in routed.generate(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=8))):
            tokens.extend(delta.token_ids)
        return tokens

    with pytest.raises(TypeError, match="unsupported operand"):
        asyncio.run(scenario())
    assert bug.received == ["r"] and healthy.received == []
    assert routed.num_failovers == 0 and routed.router.in_rotation() == ["r0", "r1"]
    assert not routed._open and all(state.in_flight == 0 for state in routed.router.replicas.values())


def test_a_real_failure_still_moves_the_request():
    dying, healthy = BrokenReplica(ConnectionError("connection reset"), 2), BrokenReplica()
    routed = RoutedEngineClient({"r0": dying, "r1": healthy}, policy="round-robin")

    async def scenario():
        return [delta async for delta in routed.generate(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=8)))]

    deltas = asyncio.run(scenario())
    assert dying.received == ["r"] and healthy.received == ["r"] and routed.num_failovers == 1
    assert deltas[-1].num_output_tokens == 8 and deltas[-1].finish_reason == "length"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.mark.parametrize("after", [0, 2], ids=["before-the-first-delta", "mid-stream"])
def test_a_bug_behind_the_router_is_a_logged_500_at_the_front_door_not_a_failover(tokenizer, caplog, after):
    vocab = len(tokenizer)
    bug = BrokenReplica(TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"), after, vocab_size=vocab)
    healthy = BrokenReplica(vocab_size=vocab)
    routed = RoutedEngineClient({"r0": bug, "r1": healthy}, policy="round-robin", model_name="fake")
    app = create_app(ServerState(routed, tokenizer, FrontendSettings("fake")))
    body = {"model": "fake", "prompt": "hello", "max_tokens": 6}

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagerail") as client:
            return await client.post("/v1/completions", json=body, headers={"X-Request-Id": "label-1"})

    with caplog.at_level(logging.ERROR, logger="pagerail.cluster.frontend.http_app"):
        response = asyncio.run(post())
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "TypeError" not in response.text and "NoneType" not in response.text  # no internals for the client
    assert response.headers["x-request-id"] == "label-1"
    (record,) = [r for r in caplog.records if r.name == "pagerail.cluster.frontend.http_app"]
    assert record.exc_info is not None and record.exc_info[0] is TypeError  # the traceback is in the log
    assert "/v1/completions" in record.getMessage() and "label-1" in record.getMessage()
    # Not a failover: no other replica saw the request, nothing was counted, the replica stays in rotation.
    assert len(bug.received) == 1 and healthy.received == []
    assert routed.num_failovers == 0 and routed.router.in_rotation() == ["r0", "r1"]
