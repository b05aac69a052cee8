"""Data-parallel replicas of a tiny model on a local Ray behind one routed client: unique prompts spread evenly, a
queue starts a replica and idleness stops it, and a killed head (restarted by Ray) or a killed worker rank loses
and repeats no token of a greedy or seeded, penalised request."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.requirements import require_module

ray = require_module("ray", "needs Ray")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagerail.cluster.core.engine_request import EngineRequest  # noqa: E402
from pagerail.cluster.distributed.cluster_options import ClusterOptions  # noqa: E402
from pagerail.cluster.distributed.launcher import HeadLauncher, start_heads, stop_head  # noqa: E402
from pagerail.cluster.routing.replica_pool import ReplicaPool, ReplicaSettings  # noqa: E402
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pagerail.common.sampling_params import SamplingParams  # noqa: E402
from tests.ray_start import start_ray  # noqa: E402
from tests.test_cluster_failures import _answers, _pid, wait_for  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

NAMES = ["dp-head-0", "dp-head-1"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [[(p * 17 + i * 5) % 240 + 3 for i in range(5 + p % 7)] for p in range(12)]
# Every other request is seeded and penalised: one that moves to another replica continues with the same seeds
# per output position and the same penalty counts, so it too ends with the tokens of an undisturbed run.
PARAMS = [
    GREEDY
    if p % 2 == 0
    else SamplingParams(
        temperature=0.8, seed=100 + p, presence_penalty=0.4, frequency_penalty=0.6, max_tokens=40, ignore_eos=True
    )
    for p in range(len(PROMPTS))
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("dp") / "llama")


@pytest.fixture(scope="module")
def heads(model_dir):
    # Two single-rank replicas; spare logical CPUs for a restarted replica's new rank and for a scaled one.
    start_ray(num_cpus=4, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    try:
        config = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=4, num_gpu_blocks=512))
        started = start_heads(config, ClusterOptions(), NAMES)
        yield dict(zip(NAMES, started, strict=True))
        for head in started:
            stop_head(head)
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def every_head_ready(heads):
    wait_for(lambda: all(_answers(head) for head in heads.values()), 120, "every head is ready")


def make_pool(policy: str = "prefix-aware") -> ReplicaPool:
    """A pool over the module's heads, as the frontend actor builds it; made inside the test's event loop."""
    info = ray.get(ray.get_actor(NAMES[0]).model_info.remote())
    settings = ReplicaSettings(routing_policy=policy, block_size=4, refresh_interval_s=0.2)
    return ReplicaPool(NAMES, "tiny", info, settings)


async def collect(stream) -> list[int]:
    tokens = []
    async for delta in stream:
        tokens.extend(delta.token_ids)
    assert delta.finished and delta.finish_reason == "length" and delta.error is None, delta
    return tokens


async def clean_run(pool: ReplicaPool, prefix: str) -> list[list[int]]:
    streams = [pool.engine.generate(EngineRequest(f"{prefix}-{i}", p, PARAMS[i])) for i, p in enumerate(PROMPTS)]
    return list(await asyncio.gather(*(collect(s) for s in streams)))


def routed_counts(text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pagerail_router_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    replica = sample.labels["replica"]
                    counts[replica] = counts.get(replica, 0) + sample.value
    return counts


async def run_with_incident(pool: ReplicaPool, prefix: str, incident) -> list[list[int]]:
    """Start every request, hold the replicas once each has its first tokens, and run `incident()`, which lets
    them go on."""
    engine = pool.engine
    streams = [engine.generate(EngineRequest(f"{prefix}-{i}", p, PARAMS[i])) for i, p in enumerate(PROMPTS)]
    firsts = await asyncio.gather(*(anext(s) for s in streams))
    await engine.pause("all")
    await incident()

    async def rest(first, stream) -> list[int]:
        if first.finished:
            return list(first.token_ids)
        return list(first.token_ids) + await collect(stream)

    return list(await asyncio.gather(*(rest(f, s) for f, s in zip(firsts, streams, strict=True))))


@pytest.mark.parametrize("policy", ["prefix-aware", "least-loaded", "round-robin"])
def test_unique_prompts_spread_evenly_over_the_replicas(heads, policy):
    async def scenario():
        pool = make_pool(policy)
        pool.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            prompts = [[(p * 31 + i * 11) % 240 + 3 for i in range(9)] for p in range(40)]
            for wave in range(4):  # some at once, as a loaded server gets them, in waves
                batch = prompts[wave * 10 : (wave + 1) * 10]
                streams = [pool.engine.generate(EngineRequest(f"u{wave}-{i}", p, params)) for i, p in enumerate(batch)]
                await asyncio.gather(*(collect(s) for s in streams))
            return routed_counts(await pool.engine.metrics())
        finally:
            await pool.aclose()

    counts = asyncio.run(scenario())
    assert set(counts) == set(NAMES) and sum(counts.values()) == 40, counts
    mean = 40 / len(NAMES)
    assert max(counts.values()) <= 1.3 * mean, counts


def test_a_queue_above_target_starts_a_replica_and_idleness_stops_it(heads, model_dir):
    # Two sequences at a time: a handful of requests makes a queue.
    config = EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(block_size=4, num_gpu_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=2),
    )
    launcher = HeadLauncher(config, ClusterOptions(), ready_timeout_s=120)
    first = start_heads(config, ClusterOptions(), ["dp-scale-0"])[0]
    info = ray.get(first.model_info.remote())
    settings = ReplicaSettings(
        block_size=4,
        refresh_interval_s=0.2,
        min_replicas=1,
        max_replicas=2,
        target_waiting_per_replica=1,
        scale_cooldown_s=0.5,
        scale_down_idle_s=1.0,
        name_prefix="dp-scale",
        launcher=launcher,
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def scenario():
        pool = ReplicaPool(["dp-scale-0"], "tiny", info, settings)
        pool.start()
        done: list[list[int]] = []
        loaded = asyncio.Event()

        async def load():
            wave = 0
            while not loaded.is_set():
                streams = [pool.engine.generate(EngineRequest(f"s{wave}-{i}", PROMPTS[i], params)) for i in range(6)]
                done.extend(await asyncio.gather(*(collect(s) for s in streams)))
                wave += 1

        try:
            client = asyncio.create_task(load())
            for _ in range(600):  # the second replica starts while the first has a queue
                if "dp-scale-1" in pool.engine.replicas:
                    break
                await asyncio.sleep(0.2)
            grown = sorted(pool.engine.replicas)
            await asyncio.sleep(1.0)  # requests go to both
            loaded.set()
            await client
            for _ in range(300):  # idle now: back to the minimum
                if pool.scaler.num_removed and not pool.scaler.draining:
                    break
                await asyncio.sleep(0.2)
            return grown, sorted(pool.engine.replicas), pool.head_names(), done, pool.scaler
        finally:
            await pool.aclose()

    try:
        grown, left, head_names, done, scaler = asyncio.run(scenario())
    finally:
        for name in ("dp-scale-0", "dp-scale-1"):
            try:
                stop_head(ray.get_actor(name))
            except ValueError:
                pass  # stopped by the scale-down
    assert grown == ["dp-scale-0", "dp-scale-1"]
    assert scaler.num_added == 1 and scaler.num_removed == 1 and scaler.num_failed_starts == 0
    assert len(left) == 1 and left == head_names  # the drained head was stopped, not only left out
    assert done and all(len(tokens) == params.max_tokens for tokens in done)


def test_a_killed_worker_rank_is_recovered_inside_its_replica(heads):
    async def scenario():
        pool = make_pool()
        try:
            expected = await clean_run(pool, "rank-ref")

            async def kill_a_rank():
                pid = ray.get(ray.get_actor(f"{NAMES[1]}-rank0").pid.remote())
                os.kill(pid, signal.SIGKILL)
                await pool.engine.resume()

            outputs = await run_with_incident(pool, "rank-kill", kill_a_rank)
            return expected, outputs, pool.engine.num_failovers, await pool.engine.metrics()
        finally:
            await pool.aclose()

    before = ray.get(heads[NAMES[1]].stats.remote())["num_restarts"]
    expected, outputs, failovers, metrics = asyncio.run(scenario())
    assert outputs == expected
    assert failovers == 0  # the replica's own worker-group restart carried its requests on
    assert ray.get(heads[NAMES[1]].stats.remote())["num_restarts"] == before + 1
    # The restart shows in the metrics, on that replica's series.
    restarts = {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "pagerail_worker_restarts"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert restarts[NAMES[1]] == before + 1


def test_a_killed_head_fails_over_and_its_restarted_replica_rejoins(heads):
    victim = NAMES[0]
    old_pid = _pid(heads[victim])

    async def scenario():
        pool = make_pool()
        pool.start()
        try:
            expected = await clean_run(pool, "head-ref")

            async def kill_a_head():
                assert pool.engine.router.replicas[victim].in_flight > 0  # it holds some of the requests
                ray.kill(heads[victim], no_restart=False)  # as if its process crashed: Ray starts it again
                # A call to the restarting head would wait for its new life: only the other one goes on.
                await pool.engine.replicas[NAMES[1]].resume()

            outputs = await run_with_incident(pool, "head-kill", kill_a_head)
            metrics = await pool.engine.metrics()
            # The refresh loop puts the restarted head back once it answers ready.
            for _ in range(600):
                if pool.engine.router.routable(victim) and _pid(heads[victim]) not in (None, old_pid):
                    break
                await asyncio.sleep(0.2)
            rejoined = pool.engine.router.routable(victim)
            before = routed_counts(await pool.engine.metrics()).get(victim, 0)
            # Requests reach it again through the same client, on a new output channel.
            fresh = [[(p * 7 + i * 3) % 240 + 3 for i in range(9)] for p in range(100, 106)]
            after = [
                await collect(pool.engine.generate(EngineRequest(f"after-{i}", p, GREEDY))) for i, p in enumerate(fresh)
            ]
            routed_after = routed_counts(await pool.engine.metrics()).get(victim, 0) - before
            return expected, outputs, metrics, rejoined, after, routed_after
        finally:
            await pool.aclose()

    expected, outputs, metrics, rejoined, after, routed_after = asyncio.run(scenario())
    assert outputs == expected
    failovers = {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "pagerail_router_failovers"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert failovers.get(victim, 0) >= 1, failovers
    assert rejoined
    assert [len(tokens) for tokens in after] == [GREEDY.max_tokens] * 6
    assert routed_after > 0
