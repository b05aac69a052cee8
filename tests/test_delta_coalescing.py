"""A request's deltas that queue up while its consumer is busy come out as one: every token once and in order, the
last delta's state, a failure after the tokens before it; a consumer that keeps up still sees every step."""

from __future__ import annotations

import asyncio

import pytest

from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_client import RequestDelta, merge_deltas, next_delta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from tests.fake_workers import FakeKVWorkers

VOCAB = 250


def delta(tokens: list[int], done: int, finished: bool = False, **extra) -> RequestDelta:
    return RequestDelta(
        "r", tokens, num_prompt_tokens=3, num_output_tokens=done, finished=finished,
        finish_reason="length" if finished else None, **extra,
    )  # fmt: skip


async def read_deltas(queue: asyncio.Queue):
    """A request's deltas as an engine client's stream reads them: until the finished one."""
    while True:
        item = await next_delta(queue)
        yield item
        if item.finished:
            return


async def read_all(queue: asyncio.Queue) -> list[RequestDelta]:
    return [item async for item in read_deltas(queue)]


def filled(*items) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_queued_deltas_come_out_as_one_with_the_last_state():
    async def scenario() -> list[RequestDelta]:
        return await read_all(
            filled(
                delta([1], 1, logprobs=[-0.1], top_logprobs=[{1: -0.1}]),
                delta([2, 3], 3, logprobs=[-0.2, -0.3], top_logprobs=[{2: -0.2}, {3: -0.3}], num_cached_tokens=2),
                delta([4], 4, finished=True, logprobs=[-0.4], top_logprobs=[{4: -0.4}], num_cached_tokens=2),
            )
        )

    [merged] = asyncio.run(scenario())
    assert merged.token_ids == [1, 2, 3, 4]
    assert merged.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert merged.top_logprobs == [{1: -0.1}, {2: -0.2}, {3: -0.3}, {4: -0.4}]
    assert (merged.num_output_tokens, merged.finished, merged.finish_reason, merged.num_cached_tokens) == (
        4, True, "length", 2,
    )  # fmt: skip


def test_merging_stops_at_the_finished_delta():
    async def scenario() -> tuple[list[RequestDelta], int]:
        queue = filled(delta([1], 1), delta([2], 2, finished=True), delta([9], 3))
        return await read_all(queue), queue.qsize()

    deltas, left = asyncio.run(scenario())
    assert [d.token_ids for d in deltas] == [[1, 2]] and deltas[0].finished
    assert left == 1  # nothing after the end is taken


def test_a_failure_comes_after_the_tokens_queued_before_it():
    received: list[list[int]] = []

    async def scenario() -> None:
        async for item in read_deltas(filled(delta([1], 1), delta([2], 2), RuntimeError("rank died"))):
            received.append(item.token_ids)

    with pytest.raises(RuntimeError, match="rank died"):
        asyncio.run(scenario())
    assert received == [[1, 2]]


def test_a_consumer_that_keeps_up_sees_every_delta():
    async def scenario() -> list[list[int]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def produce() -> None:
            for step in range(1, 6):
                queue.put_nowait(delta([step], step, finished=step == 5))
                await asyncio.sleep(0.005)

        producer = asyncio.create_task(produce())
        seen = [item.token_ids for item in await read_all(queue)]
        await producer
        return seen

    assert asyncio.run(scenario()) == [[1], [2], [3], [4], [5]]


def test_merge_of_one_delta_is_that_delta():
    only = delta([7], 1)
    assert merge_deltas([only]) is only


def test_a_slow_stream_gets_fewer_deltas_and_the_same_tokens_as_a_fast_one():
    """Through the in-process engine: a consumer slower than the steps receives merged deltas, and exactly the
    tokens (in order) a consumer that keeps up receives; its count always matches what it holds."""
    workers = FakeKVWorkers(512, 16, VOCAB, step_delay_s=0.001)
    config = EngineConfig(cache=CacheConfig(block_size=16), scheduler=SchedulerConfig(max_num_seqs=8))
    core = EngineCore(config, workers, max_model_len=256, vocab_size=VOCAB, eos_token_ids=[VOCAB + 1])
    engine = AsyncEngine(core)
    params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)
    prompt = [5, 6, 7, 8]

    async def consume(request_id: str, pause_s: float) -> tuple[list[int], int]:
        tokens: list[int] = []
        count = 0
        async for item in engine.stream(EngineRequest(request_id, prompt, params)):
            count += 1
            tokens.extend(item.token_ids)
            assert item.num_output_tokens == len(tokens)
            if pause_s:
                await asyncio.sleep(pause_s)  # a busy frontend: steps keep landing meanwhile
        return tokens, count

    async def scenario():
        return await asyncio.gather(consume("fast", 0.0), consume("slow", 0.02))

    try:
        (fast, _), (slow, slow_count) = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert len(fast) == 60 and slow == fast
    assert slow_count < 30, slow_count  # 60 steps of ~1 ms against a 20 ms pause per delta
    assert core.block_table.num_free_blocks == core.block_table.num_blocks
