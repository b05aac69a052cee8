"""The public gRPC API over the fake engine: streaming, sessions, aborts, health, reflection, API keys, errors."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagerail.cluster.frontend.grpc_api import build_grpc_server
from pagerail.cluster.frontend.grpc_guards import EngineHealth
from pagerail.proto import api_pb2, api_pb2_grpc
from tests.fake_engine import FakeEngineClient

VOCAB = 1000  # the fake engine's default vocabulary


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagerail.common.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


def async_test(fn):
    """Run a coroutine test in its own event loop, bounded so a hung stream fails instead of stalling the suite."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), timeout=10))

    return run


@contextlib.asynccontextmanager
async def serve(engine: FakeEngineClient, tokenizer=None, **kwargs) -> AsyncIterator[grpc.aio.Channel]:
    server, port = build_grpc_server(engine, tokenizer, host="127.0.0.1", port=0, **kwargs)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(None)


def fake_tokens(prompt: list[int], n: int) -> list[int]:
    """What FakeEngineClient generates for `prompt`."""
    return [(sum(prompt) + 7 * i) % VOCAB for i in range(n)]


def token_request(ids: list[int], request_id: str = "", **sampling) -> api_pb2.GenerateRequest:
    params = api_pb2.SamplingParams(**sampling)
    return api_pb2.GenerateRequest(request_id=request_id, token_ids=api_pb2.TokenIds(ids=ids), sampling_params=params)


async def read_rest(call) -> list[api_pb2.GenerateResponse]:
    """The remaining responses of a call already read with read() (iteration and read() do not mix)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def wait_until(condition, timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition(), "condition not met in time"


@async_test
async def test_generate_by_token_ids_streams_tokens_usage_and_logprobs():
    async with serve(FakeEngineClient()) as channel:
        call = api_pb2_grpc.GenerationStub(channel).Generate(token_request([1, 2, 3], max_tokens=5, logprobs=1))
        request_id = dict(await call.initial_metadata())["request-id"]
        responses = [response async for response in call]
    assert request_id and all(r.request_id == request_id for r in responses)
    assert [t for r in responses for t in r.token_ids] == fake_tokens([1, 2, 3], 5)
    assert [r.finish_reason for r in responses] == ["", "", "", "", "length"]
    assert not any(r.HasField("usage") for r in responses[:-1])
    assert responses[-1].usage == api_pb2.Usage(prompt_tokens=3, completion_tokens=5, cached_tokens=0)
    first = responses[0].logprobs[0]
    top = [(t.token_id, t.logprob) for t in first.top_logprobs]
    assert (first.token_id, first.logprob, top) == (6, -0.5, [(6, -0.5), (7, -1.5)])


@async_test
async def test_n_choices_interleave_on_one_stream_each_named_by_index():
    engine = FakeEngineClient()
    async with serve(engine) as channel:
        call = api_pb2_grpc.GenerationStub(channel).Generate(token_request([1, 2], max_tokens=4, n=3, seed=9))
        responses = [response async for response in call]
    choices: dict[int, list] = {}
    for response in responses:
        choices.setdefault(response.index, []).append(response)
    assert sorted(choices) == [0, 1, 2]
    for messages in choices.values():
        assert [t for r in messages for t in r.token_ids] == fake_tokens([1, 2], 4)
        assert [r.finish_reason for r in messages][-1] == "length" and messages[-1].usage.completion_tokens == 4
    # One engine request per choice, siblings of one group, seeded apart.
    requests = engine.requests
    assert len({r.request_id for r in requests}) == 3
    assert sorted((r.group.index, r.params.seed) for r in requests) == [(0, 9), (1, 10), (2, 11)]


@async_test
async def test_a_session_refuses_n_choices():
    async def one_message():
        yield api_pb2.SessionRequest(
            token_ids=api_pb2.TokenIds(ids=[1]), sampling_params=api_pb2.SamplingParams(n=2), final=True
        )

    async with serve(FakeEngineClient()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [response async for response in api_pb2_grpc.GenerationStub(channel).Session(one_message())]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling_params.n" in error.value.details()


@async_test
async def test_generate_by_text_detokenizes(tokenizer):
    async with serve(FakeEngineClient(), tokenizer) as channel:
        request = api_pb2.GenerateRequest(
            text="Hello world again", sampling_params=api_pb2.SamplingParams(max_tokens=8)
        )
        responses = [response async for response in api_pb2_grpc.GenerationStub(channel).Generate(request)]
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == fake_tokens(tokenizer.encode("Hello world again"), 8)
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens)
    assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 8


@async_test
async def test_stop_string_finishes_with_stop_cuts_tokens_and_ends_the_engine_request_as_stopped(tokenizer):
    tokens = fake_tokens([300], 100)
    stop = tokenizer.decode(tokens[2:3])
    assert stop.strip() and stop not in tokenizer.decode(tokens[:2])  # the third token completes the stop string
    engine = FakeEngineClient(step_delay_s=0.01)
    async with serve(engine, tokenizer) as channel:
        request = token_request([300], "r-stop", max_tokens=100, stop=[stop])
        call = api_pb2_grpc.GenerationStub(channel).Generate(request)
        responses = [response async for response in call]
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens[:2])
    assert [t for r in responses for t in r.token_ids] == tokens[:3]  # none of the tokens after the stop
    assert responses[-1].finish_reason == "stop" and responses[-1].usage.completion_tokens == 3
    # The engine request ends at once, as a stop (not an abort); the engine id is made by the server.
    await wait_until(lambda: len(engine.stopped) == 1)
    assert engine.aborted == []


@async_test
async def test_a_choice_ended_by_a_stop_string_ends_at_the_engine_while_its_sibling_runs_on(tokenizer):
    def tokens(seed: int) -> list[int]:
        return [(300 + 7 * i + 13 * seed) % VOCAB for i in range(60)]

    def usable(seed: int) -> bool:
        stop = tokenizer.decode(tokens(seed)[2:3])
        early, sibling = tokenizer.decode(tokens(seed)[:2]), tokenizer.decode(tokens(seed + 1))
        return bool(stop.strip()) and stop not in early and stop not in sibling

    seed = next(seed for seed in range(100) if usable(seed))  # choice 0 (seed) stops at its third token, choice 1 never
    engine = FakeEngineClient(step_delay_s=0.005, vary_by_seed=True)
    request = token_request([300], "r-n2", max_tokens=60, n=2, seed=seed, stop=[tokenizer.decode(tokens(seed)[2:3])])
    finished = {}
    async with serve(engine, tokenizer) as channel:
        async for response in api_pb2_grpc.GenerationStub(channel).Generate(request):
            if response.finish_reason:
                finished[response.index] = (response.finish_reason, response.usage.completion_tokens)
            if response.index == 0 and response.finish_reason:
                # Choice 0's engine request ends now, as a stop; its sibling is still generating.
                await wait_until(lambda: len(engine.stopped) == 1)
                assert len(engine.active) == 1
    assert finished == {0: ("stop", 3), 1: ("length", 60)}
    assert engine.aborted == []


@async_test
async def test_abort_ends_a_running_stream():
    engine = FakeEngineClient(step_delay_s=0.02)
    async with serve(engine) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(token_request([1], "r-abort", max_tokens=200))
        responses = [await call.read(), await call.read()]
        assert (await stub.Abort(api_pb2.AbortRequest(request_id="r-abort"))).found
        responses += await read_rest(call)
        assert not (await stub.Abort(api_pb2.AbortRequest(request_id="r-abort"))).found
    assert responses[-1].finish_reason == "abort" and len(responses) < 200
    assert len(engine.aborted) == 1


@async_test
async def test_abort_ends_a_session_still_waiting_for_input():
    engine = FakeEngineClient()

    async def open_input():
        yield api_pb2.SessionRequest(request_id="r-open", token_ids=api_pb2.TokenIds(ids=[1]))
        await asyncio.sleep(30)  # never sends the rest

    async with serve(engine) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        call = stub.Session(open_input())
        await call.initial_metadata()
        await wait_until(lambda: len(engine.active) == 1)
        assert (await stub.Abort(api_pb2.AbortRequest(request_id="r-open"))).found
        responses = await read_rest(call)
    assert [r.finish_reason for r in responses] == ["abort"] and responses[0].usage.prompt_tokens == 1
    assert len(engine.aborted) == 1 and not engine.active


@async_test
async def test_client_cancel_aborts_the_engine_request():
    engine = FakeEngineClient(step_delay_s=0.02)
    async with serve(engine) as channel:
        call = api_pb2_grpc.GenerationStub(channel).Generate(token_request([1], "r-cancel", max_tokens=200))
        await call.read()
        call.cancel()
        await wait_until(lambda: len(engine.aborted) == 1)
        await wait_until(lambda: not engine.active)


def session_messages(chunks: list[list[int]], final: bool = True, **sampling):
    async def messages():
        for i, ids in enumerate(chunks):
            message = api_pb2.SessionRequest(token_ids=api_pb2.TokenIds(ids=ids), final=final and i == len(chunks) - 1)
            if i == 0:
                message.request_id = "r-session"
                message.sampling_params.CopyFrom(api_pb2.SamplingParams(**sampling))
            yield message
            await asyncio.sleep(0.01)  # arrive one by one, as a client streaming its input would

    return messages()


@async_test
async def test_session_of_three_chunks_equals_one_generate():
    async with serve(FakeEngineClient()) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        whole = [r async for r in stub.Generate(token_request([10, 20, 30, 40, 50], max_tokens=6))]
        chunked = [r async for r in stub.Session(session_messages([[10, 20], [30, 40], [50]], max_tokens=6))]
        # The client closing its side ends the input as well as final=true does.
        closed = [r async for r in stub.Session(session_messages([[10], [20, 30, 40, 50]], final=False, max_tokens=6))]
    expected = fake_tokens([10, 20, 30, 40, 50], 6)
    for responses in (whole, chunked, closed):
        assert [t for r in responses for t in r.token_ids] == expected
        assert responses[-1].finish_reason == "length" and responses[-1].usage.prompt_tokens == 5


@async_test
async def test_health_follows_readiness_and_setter():
    engine = FakeEngineClient()
    engine.ready = False
    health = EngineHealth(engine.is_ready, ("pagerail.api.Generation",))
    async with serve(engine, health=health) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def status(service: str = "") -> int:
            return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

        assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
        engine.ready = True
        await health.set_serving(True)
        assert await status() == health_pb2.HealthCheckResponse.SERVING
        assert await status("pagerail.api.Generation") == health_pb2.HealthCheckResponse.SERVING
        await health.set_serving(False)  # draining: held down although the engine is ready
        assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING


@async_test
async def test_reflection_lists_services():
    async with serve(FakeEngineClient()) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = [
            r async for r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        ]
    names = {service.name for service in responses[0].list_services_response.service}
    assert {"pagerail.api.Generation", "grpc.health.v1.Health"} <= names


@async_test
async def test_api_key_is_required_except_for_health():
    async with serve(FakeEngineClient(), api_key="sekret") as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "sekret"),)):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.GetModelInfo(api_pb2.ModelInfoRequest(), metadata=metadata)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stub.Generate(token_request([1], max_tokens=2))]
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = await stub.GetModelInfo(api_pb2.ModelInfoRequest(), metadata=(("authorization", "Bearer sekret"),))
        assert (info.model_name, info.max_model_len, info.vocab_size) == ("fake", 256, VOCAB)
        check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING


@async_test
async def test_bad_input_is_invalid_argument_naming_the_field():
    async with serve(FakeEngineClient()) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        cases = [
            (token_request([1], top_p=2.0), "top_p"),
            (token_request([1], max_tokens=0), "max_tokens"),
            (token_request([1], stop_token_ids=[-1]), "stop_token_ids"),
            (token_request([1, VOCAB]), "token_ids.ids[1]"),
            (token_request([1], max_tokens=1000), "max_model_len"),  # found by the engine, not the server
            (api_pb2.GenerateRequest(), "input"),
            (api_pb2.GenerateRequest(text="hi"), "no tokenizer"),
        ]
        for request, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                [r async for r in stub.Generate(request)]
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in error.value.details()

        async def later_params():
            yield api_pb2.SessionRequest(token_ids=api_pb2.TokenIds(ids=[1]))
            yield api_pb2.SessionRequest(token_ids=api_pb2.TokenIds(ids=[2]), sampling_params=api_pb2.SamplingParams())

        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stub.Session(later_params())]
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling_params" in error.value.details()


@async_test
async def test_full_queue_is_resource_exhausted_with_retry_after():
    engine = FakeEngineClient(max_waiting=1, step_delay_s=0.02)
    async with serve(engine) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        running = stub.Generate(token_request([1], "r-running", max_tokens=200))
        await running.read()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stub.Generate(token_request([2], max_tokens=2))]
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error.value.trailing_metadata())["retry-after"] == "1"
        with pytest.raises(grpc.aio.AioRpcError) as error:  # the running id cannot be reused meanwhile
            [r async for r in stub.Generate(token_request([2], "r-running", max_tokens=2))]
        assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
        info = await stub.GetServerInfo(api_pb2.ServerInfoRequest())
        assert info.stats["num_unfinished"] == 1 and info.stats["grpc.active_streams"] == 1 and info.version
        running.cancel()


@async_test
async def test_request_ids_are_labels_per_connection_and_never_reach_another_callers_request():
    engine = FakeEngineClient(step_delay_s=0.01)
    server, port = build_grpc_server(engine, None, host="127.0.0.1", port=0)
    await server.start()
    # A private subchannel pool gives each caller its own connection, as separate processes would have.
    private = [("grpc.use_local_subchannel_pool", 1)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=private)
    other = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=private)
    try:
        mine = api_pb2_grpc.GenerationStub(channel).Generate(token_request([1], "shared", max_tokens=30))
        await mine.read()
        other_stub = api_pb2_grpc.GenerationStub(other)
        # Another caller naming the same id finds nothing to abort, and may use the id for its own request.
        assert not (await other_stub.Abort(api_pb2.AbortRequest(request_id="shared"))).found
        theirs = [r async for r in other_stub.Generate(token_request([2], "shared", max_tokens=3))]
        assert [t for r in theirs for t in r.token_ids] == fake_tokens([2], 3)
        rest = await read_rest(mine)
    finally:
        await other.close()
        await channel.close()
        await server.stop(None)
    assert rest[-1].finish_reason == "length" and 1 + len(rest) == 30
    assert engine.aborted == []


class ReplicaDiesEngine(FakeEngineClient):
    """A routed engine whose replica dies under the request: its stream fails as a lost session's does."""

    async def generate(self, request):
        from pagerail.cluster.routing.failover import ReplicaFailed

        yield await anext(aiter(super().generate(request)))
        raise ReplicaFailed("replica r0 failed during streaming-input session: open a new one")


@async_test
async def test_a_request_whose_replica_died_is_unavailable_not_internal():
    async with serve(ReplicaDiesEngine()) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stub.Generate(token_request([1, 2], max_tokens=8))]
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value
        assert "replica r0 failed" in error.value.details()


@async_test
async def test_generate_carries_its_priority_and_service_tier_to_every_choice():
    engine = FakeEngineClient()
    async with serve(engine) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        request = token_request([1, 2, 3], max_tokens=2, n=2)
        request.priority, request.service_tier = -7, "flex"
        [response async for response in stub.Generate(request)]
        request.service_tier = "scale"
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [response async for response in stub.Generate(request)]
    assert [(r.priority, r.service_tier) for r in engine.requests] == [(-7, "flex"), (-7, "flex")]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "service_tier" in error.value.details()


@async_test
async def test_tenants_by_key_their_default_priority_and_concurrency_quota():
    """The caller's bearer key picks its tenant: its name, weight and default priority reach the engine (an
    explicit priority wins), and a tenant at its max_concurrency gets RESOURCE_EXHAUSTED while others are served."""
    from pagerail.cluster.frontend.tenants import parse_tenants

    tenants = parse_tenants(
        "tenants:\n  - {name: chat, api_keys: [sk-chat], weight: 2, max_concurrency: 1, priority: -3}\n"
    )
    engine = FakeEngineClient(step_delay_s=0.01)
    chat = (("authorization", "Bearer sk-chat"),)
    async with serve(engine, tenants=tenants) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        [r async for r in stub.Generate(token_request([1, 2], max_tokens=2), metadata=chat)]
        explicit = token_request([1, 2], max_tokens=2)
        explicit.priority = 5
        [r async for r in stub.Generate(explicit, metadata=chat)]
        [r async for r in stub.Generate(token_request([1, 2], max_tokens=2))]
        sent = [(r.tenant, r.tenant_weight, r.priority) for r in engine.requests]
        assert sent == [("chat", 2.0, -3), ("chat", 2.0, 5), ("default", 1.0, 0)]
        engine.paused = True
        held = stub.Generate(token_request([1, 2], max_tokens=2), metadata=chat)
        await wait_until(lambda: len(engine.requests) == 4)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in stub.Generate(token_request([3], max_tokens=2), metadata=chat)]
        assert (
            refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrency" in refused.value.details()
        )
        engine.paused = False
        [r async for r in stub.Generate(token_request([4], max_tokens=2))]  # another tenant: served
        [r async for r in held]


@async_test
async def test_sessions_and_responses_run_as_the_callers_tenant(tokenizer):
    """Session and CreateResponse read the caller's key as Generate does: the tenant, its weight and its default
    priority reach the engine (CreateResponse's own priority and service_tier win), under the same quotas."""
    from pagerail.cluster.frontend.tenants import parse_tenants

    tenants = parse_tenants(
        "tenants:\n  - {name: chat, api_keys: [sk-chat], weight: 2, max_concurrency: 1, priority: -3}\n"
    )
    engine = FakeEngineClient(vocab_size=len(tokenizer), step_delay_s=0.01)
    chat = (("authorization", "Bearer sk-chat"),)
    async with serve(engine, tokenizer, tenants=tenants) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        [r async for r in stub.Session(session_messages([[10, 20], [30]], max_tokens=2), metadata=chat)]
        await stub.CreateResponse(api_pb2.ResponseRequest(input_text="hi", max_output_tokens=2), metadata=chat)
        explicit = api_pb2.ResponseRequest(input_text="hi", max_output_tokens=2, priority=4, service_tier="flex")
        await stub.CreateResponse(explicit, metadata=chat)
        await stub.CreateResponse(api_pb2.ResponseRequest(input_text="hi", max_output_tokens=2))
        sent = [(r.tenant, r.tenant_weight, r.priority, r.service_tier) for r in engine.requests]
        assert sent == [
            ("chat", 2.0, -3, "default"),
            ("chat", 2.0, -3, "default"),
            ("chat", 2.0, 4, "flex"),
            ("default", 1.0, 0, "default"),
        ]
        engine.paused = True
        held = stub.Session(session_messages([[10, 20]], max_tokens=2), metadata=chat)
        await wait_until(lambda: len(engine.requests) == 5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateResponse(api_pb2.ResponseRequest(input_text="hi", max_output_tokens=2), metadata=chat)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        engine.paused = False
        [r async for r in held]
