"""gRPC streaming-input sessions over the real engine loop (fake workers): half-close, growth without max_tokens,
context overflow, idle timeout."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.local_client import LocalEngineClient
from pagerail.cluster.frontend.grpc_api import build_grpc_server
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.proto import api_pb2, api_pb2_grpc
from tests.fake_workers import FakeKVWorkers, next_token

VOCAB = 97
MAX_MODEL_LEN = 48


@contextlib.asynccontextmanager
async def session_stub(**scheduler):
    workers = FakeKVWorkers(64, 4, VOCAB)
    config = EngineConfig(cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(**scheduler))
    engine = AsyncEngine(EngineCore(config, workers, MAX_MODEL_LEN, VOCAB, eos_token_ids=[VOCAB + 1]))
    server, port = build_grpc_server(LocalEngineClient(engine, "fake"), None, host="127.0.0.1", port=0)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield api_pb2_grpc.GenerationStub(channel), engine
    finally:
        await channel.close()
        await server.stop(None)
        engine.shutdown()


def chunk(ids: list[int], **fields) -> api_pb2.SessionRequest:
    return api_pb2.SessionRequest(token_ids=api_pb2.TokenIds(ids=ids), **fields)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_half_closed_session_without_max_tokens_generates_up_to_the_context():
    async def scenario():
        async with session_stub() as (stub, engine):

            async def messages():
                yield chunk([1, 2, 3, 4, 5, 6], request_id="s")  # no sampling_params: no max_tokens
                await asyncio.sleep(0.2)
                yield chunk([7, 8, 9, 10])
                await asyncio.sleep(0.2)
                # The client half-closes without a final chunk.

            responses = [r async for r in stub.Session(messages())]
            return responses, engine.stats()

    responses, stats = run(scenario())
    tokens = [t for r in responses for t in r.token_ids]
    prompt = list(range(1, 11))
    expected = []
    for _ in range(MAX_MODEL_LEN - len(prompt)):
        expected.append(next_token(prompt + expected, VOCAB))
    assert responses[-1].finish_reason == "length" and tokens == expected
    assert stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_chunk_beyond_the_context_is_refused_with_the_limit_named():
    async def scenario():
        async with session_stub() as (stub, engine):

            async def messages():
                yield chunk([1, 2, 3], request_id="s")
                await asyncio.sleep(0.1)
                yield chunk(list(range(1, MAX_MODEL_LEN)))

            with pytest.raises(grpc.aio.AioRpcError) as error:
                [r async for r in stub.Session(messages())]
            await asyncio.sleep(0.1)
            return error.value, engine.stats()

    error, stats = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"max_model_len={MAX_MODEL_LEN}" in error.details()
    assert stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_an_idle_session_times_out_with_a_clear_status():
    async def scenario():
        async with session_stub(session_idle_timeout_s=0.3) as (stub, engine):

            async def messages():
                yield chunk([1, 2, 3], request_id="s")
                await asyncio.sleep(5)  # never sends the next chunk in time

            with pytest.raises(grpc.aio.AioRpcError) as error:
                [r async for r in stub.Session(messages())]
            return error.value, engine.stats()

    error, stats = run(scenario())
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "session_idle_timeout" in error.details()
    assert stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_model_info_shows_the_context_capped_to_the_cache():
    async def scenario():
        workers = FakeKVWorkers(8, 4, VOCAB)  # 32 tokens of KV cache
        config = EngineConfig(cache=CacheConfig(block_size=4))
        engine = AsyncEngine(EngineCore(config, workers, MAX_MODEL_LEN, VOCAB, eos_token_ids=[VOCAB + 1]))
        server, port = build_grpc_server(LocalEngineClient(engine, "fake"), None, host="127.0.0.1", port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await api_pb2_grpc.GenerationStub(channel).GetModelInfo(api_pb2.ModelInfoRequest())
        finally:
            await server.stop(None)
            engine.shutdown()

    assert run(scenario()).max_model_len == 32
