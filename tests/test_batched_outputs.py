"""One output batch per engine step: 256 concurrent streams, of different lengths, some aborted and some dropped
mid-way, each receive every token of their request exactly once and in order, in-process and through the head
actor on Ray; the engine loop hands each consumer one batch per step, not one item per request."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.request import Request
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from tests.fake_workers import FakeKVWorkers
from tests.ray_start import start_ray

NUM_STREAMS = 256
VOCAB = 250


@dataclass
class Plan:
    """What one stream does: how long its request runs, and whether its caller aborts it or hangs up."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    action: str  # "read" to the end, "abort" after some tokens and read on, "drop" the stream after some tokens
    after: int = 0
    received: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int | None = None


def make_plans(prefix: str) -> list[Plan]:
    plans = []
    for i in range(NUM_STREAMS):
        action = {3: "abort", 6: "drop"}.get(i % 8, "read")
        # Lengths spread over 1..40 so streams finish at many different steps; those cut short run long enough
        # that the abort lands first even when the client's event loop gets little of a loaded machine.
        max_tokens = 120 if action != "read" else 1 + (i * 7) % 40
        prompt = [3 + (i * 13 + j * 7) % (VOCAB - 3) for j in range(3 + i % 9)]
        plans.append(Plan(f"{prefix}-{i}", prompt, max_tokens, action, after=2 + i % 5))
    return plans


async def drive(plans: list[Plan], generate, abort) -> None:
    """Run every plan concurrently; `generate(plan)` opens its stream, `abort(request_id)` aborts from outside."""

    async def one(plan: Plan) -> None:
        stream = generate(plan)
        aborted = False
        try:
            async for delta in stream:
                assert delta.request_id == plan.request_id
                plan.received.extend(delta.token_ids)
                plan.num_output_tokens = delta.num_output_tokens
                assert delta.num_output_tokens == len(plan.received), plan.request_id
                if delta.finished:
                    plan.finish_reason = delta.finish_reason
                    return
                if len(plan.received) >= plan.after and plan.action == "drop":
                    return  # the caller hangs up: closing the stream aborts the request
                if len(plan.received) >= plan.after and plan.action == "abort" and not aborted:
                    aborted = True
                    await abort(plan.request_id)
        finally:
            await stream.aclose()

    await asyncio.wait_for(asyncio.gather(*(one(plan) for plan in plans)), timeout=240)


def params_of(plan: Plan) -> SamplingParams:
    return SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True, temperature=0.0)


def check(plans: list[Plan], final: dict[str, Request | tuple[list[int], str]]) -> None:
    """Each stream got its request's final output tokens, exactly once and in order (a dropped one: a prefix)."""
    for plan in plans:
        tokens, status = final[plan.request_id]
        if plan.action == "drop":
            assert plan.received == tokens[: len(plan.received)] and status == "abort", plan.request_id
            assert len(tokens) < plan.max_tokens, plan.request_id
            continue
        assert plan.received == tokens, (plan.request_id, plan.received, tokens)
        assert plan.finish_reason == status, plan.request_id
        if plan.action == "read":
            assert status == "length" and len(tokens) == plan.max_tokens, plan.request_id
        else:
            assert status == "abort" and plan.after <= len(tokens) < plan.max_tokens, plan.request_id


def recording(engine: EngineCore) -> dict[str, Request]:
    """Keep every request the engine admits, to compare with what its stream delivered."""
    requests: dict[str, Request] = {}
    add_request = engine.add_request

    def add_and_keep(*args, **kwargs) -> Request:
        request = add_request(*args, **kwargs)
        requests[request.request_id] = request
        return request

    engine.add_request = add_and_keep
    return requests


def test_in_process_streams_get_every_token_once_with_one_handoff_per_step():
    # A millisecond per step, as a fast accelerator takes: instant ranks would let the engine thread run a stream
    # to its end before the client's abort, on a loaded machine, gets its turn.
    workers = FakeKVWorkers(2048, 16, VOCAB, step_delay_s=0.001)
    config = EngineConfig(
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=NUM_STREAMS, max_num_batched_tokens=4096),
    )
    core = EngineCore(config, workers, max_model_len=256, vocab_size=VOCAB, eos_token_ids=[VOCAB + 1])
    requests = recording(core)
    engine = AsyncEngine(core)
    plans = make_plans("local")
    handoffs: list[str] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            handoffs.append(threading.current_thread().name)
            return call_soon_threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted

        async def abort(request_id: str, stopped: bool = False) -> None:
            engine.abort(request_id, stopped=stopped)

        await drive(plans, lambda p: engine.stream(EngineRequest(p.request_id, p.prompt, params_of(p))), abort)

    try:
        asyncio.run(scenario())
        check(plans, {rid: (r.output_token_ids, r.status.value) for rid, r in requests.items()})
        stats = engine.stats()
    finally:
        engine.shutdown()
    num_deltas = stats["num_output_deltas"]
    engine_handoffs = handoffs.count("engine-loop")
    # One loop, one sink: each engine loop iteration hands over at most once, whatever the number of requests.
    assert engine_handoffs == stats["num_output_handoffs"] == stats["num_output_deliveries"]
    assert engine_handoffs <= workers.steps + 8, (engine_handoffs, workers.steps)
    assert num_deltas >= sum(len(p.received) for p in plans) and num_deltas > 20 * engine_handoffs
    assert core.block_table.num_free_blocks == core.block_table.num_blocks


def test_a_refused_request_fails_only_its_own_stream():
    workers = FakeKVWorkers(64, 16, VOCAB, step_delay_s=0.002)
    core = EngineCore(EngineConfig(cache=CacheConfig(block_size=16)), workers, 256, VOCAB, eos_token_ids=[VOCAB + 1])
    engine = AsyncEngine(core)

    async def scenario() -> list[int]:
        good = engine.stream(EngineRequest("good", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True)))
        first = await anext(good)
        with pytest.raises(ValueError, match="prompt token ids"):
            await anext(engine.stream(EngineRequest("bad", [VOCAB + 5], SamplingParams(max_tokens=2))))
        return first.token_ids + [t for delta in [d async for d in good] for t in delta.token_ids]

    try:
        assert len(asyncio.run(asyncio.wait_for(scenario(), 30))) == 12
    finally:
        engine.shutdown()


# -- through the head actor on Ray --------------------------------------------------------------------------------


@pytest.mark.slow
def test_head_streams_get_every_token_once_in_one_message_per_step(tmp_path):
    from tests.requirements import require_module

    ray = require_module("ray", "needs Ray")
    from pagerail.cluster.distributed.cluster_options import ClusterOptions
    from pagerail.cluster.distributed.head import HeadActor
    from pagerail.cluster.distributed.head_client import HeadEngineClient
    from pagerail.cluster.distributed.launcher import NAMESPACE
    from tests.tiny_models import make_tiny_model

    class RecordingHead(HeadActor):
        """A head that remembers the final output tokens of every request it admitted."""

        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.requests = recording(self.engine)

        def final_outputs(self) -> dict[str, tuple[list[int], str]]:
            return {rid: (r.output_token_ids, r.status.value) for rid, r in self.requests.items() if r.finished}

    model_dir = make_tiny_model("llama", tmp_path / "llama")
    start_ray(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        config = EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(block_size=16, num_gpu_blocks=2048),
            scheduler=SchedulerConfig(max_num_seqs=NUM_STREAMS, max_num_batched_tokens=4096),
        )
        name = f"batched-head-{uuid.uuid4().hex[:8]}"
        head = (
            ray.remote(RecordingHead)
            .options(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=10_000, max_restarts=-1)
            .remote(config, ClusterOptions(), secrets.token_urlsafe(16))
        )
        ray.get(head.ready.remote())
        client = HeadEngineClient(head, "tiny", {"max_model_len": 256, "vocab_size": VOCAB, "eos_token_ids": []})
        plans = make_plans("ray")

        async def scenario() -> None:
            with pytest.raises(ValueError, match="prompt token ids"):  # refused at admission, as a ValueError
                await anext(client.generate(EngineRequest("refused", [VOCAB + 5], SamplingParams(max_tokens=2))))
            await drive(
                plans, lambda p: client.generate(EngineRequest(p.request_id, p.prompt, params_of(p))), client.abort
            )
            await client.aclose()

        before = ray.get(head.stats.remote())
        asyncio.run(scenario())
        deadline = time.monotonic() + 30
        while (stats := ray.get(head.stats.remote()))["num_unfinished"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the dropped streams' aborts are sent without waiting
        check(plans, ray.get(head.final_outputs.remote()))
        steps = stats["num_steps"] - before["num_steps"]
        messages = stats["num_output_messages"] - before["num_output_messages"]
        deltas = stats["num_output_deltas"] - before["num_output_deltas"]
        # One channel: at most one message per engine step (plus the admissions' own iterations), each carrying
        # the step's deltas of every stream.
        assert messages <= stats["num_output_deliveries"] - before["num_output_deliveries"] <= steps + 8
        assert deltas > 20 * messages, (deltas, messages)
        assert stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats

        async def head_dies_and_restarts() -> list[int]:
            stream = client.generate(EngineRequest("long", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)))
            await anext(stream)
            ray.kill(head, no_restart=False)  # as if its process crashed; Ray restarts it
            with pytest.raises(ray.exceptions.RayActorError):  # the open stream fails with Ray's own error
                async for _ in stream:
                    pass
            deadline = time.monotonic() + 120
            while not await client.is_ready():
                assert time.monotonic() < deadline, "the head did not come back"
                await asyncio.sleep(0.2)
            # The same client serves again: it opens a new channel at the new head.
            again = client.generate(EngineRequest("again", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
            return [token async for delta in again for token in delta.token_ids]

        assert len(asyncio.run(asyncio.wait_for(head_dies_and_restarts(), 180))) == 4
        ray.get(head.shutdown.remote())
    finally:
        ray.shutdown()
