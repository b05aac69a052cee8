"""Replica scaling: the policy's bounds, cooldown and idleness rule under random interleavings, and the scaler
growing a queued set of in-process replicas and draining it back to the minimum without failing a request."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.entrypoints.serve import add_serve_arguments, data_parallel_size, replica_bounds
from pagerail.cluster.routing.autoscale import ScalingPolicy
from pagerail.cluster.routing.replica_scaler import ReplicaScaler
from pagerail.cluster.routing.routed_client import RoutedEngineClient
from pagerail.common.sampling_params import SamplingParams
from tests.fake_engine import FakeEngineClient


class PolicyMachine(RuleBasedStateMachine):
    """Applies every decision at once, as if replicas started and drained instantly: the hardest case for bounds."""

    @initialize(
        low=st.integers(1, 4),
        extra=st.integers(0, 4),
        start=st.integers(0, 4),
        waiting_target=st.sampled_from([1, 2.5, 8]),
        cooldown=st.sampled_from([0.0, 1.0, 30.0]),
        idle_s=st.sampled_from([0.0, 5.0, 60.0]),
    )
    def setup(self, low, extra, start, waiting_target, cooldown, idle_s):
        self.policy = ScalingPolicy(low, low + extra, waiting_target, cooldown_s=cooldown, scale_down_idle_s=idle_s)
        self.num_replicas = low + min(start, extra)
        self.now = 0.0
        self.waiting = 0
        self.idle: dict[str, float] = {}
        self.last_change: float | None = None

    @rule(seconds=st.floats(0, 100, allow_subnormal=False))
    def time_passes(self, seconds):
        self.now += seconds

    @rule(waiting=st.integers(0, 200))
    def queue_changes(self, waiting):
        self.waiting = waiting

    @rule(idle=st.lists(st.sampled_from([0.0, 0.5, 10.0, 61.0, 500.0]), max_size=8))
    def idleness_changes(self, idle):
        self.idle = {f"r{i}": seconds for i, seconds in enumerate(idle[: self.num_replicas])}

    @rule()
    def decide(self):
        decision = self.policy.decide(self.num_replicas, self.waiting, self.idle, self.now)
        assert decision in (-1, 0, 1)
        if decision:
            if self.last_change is not None:
                assert self.now - self.last_change >= self.policy.cooldown_s, "a change within the cooldown"
            self.last_change = self.now
        if decision < 0:
            # Only a replica with no open request, idle long enough, is drained.
            candidate = self.policy.drain_candidate(self.idle)
            assert candidate is not None and self.idle[candidate] > 0
            assert self.idle[candidate] >= self.policy.scale_down_idle_s
        if decision > 0 and self.num_replicas >= self.policy.min_replicas:
            assert self.waiting > self.policy.target_waiting_per_replica * self.num_replicas
        self.num_replicas += decision

    @invariant()
    def within_bounds(self):
        assert self.policy.min_replicas <= self.num_replicas <= self.policy.max_replicas


TestPolicyMachine = PolicyMachine.TestCase


def test_a_queue_between_the_thresholds_changes_nothing():
    policy = ScalingPolicy(1, 4, 8, cooldown_s=0, scale_down_idle_s=10)
    assert policy.decide(2, 16, {"a": 100.0, "b": 0.0}, 0) == 0  # at target: not above it, not under half of one
    assert policy.decide(2, 17, {"a": 0.0, "b": 0.0}, 1) == 1
    assert policy.decide(3, 4, {"a": 100.0, "b": 0.0, "c": 0.0}, 2) == -1
    assert policy.decide(2, 0, {"a": 0.0, "b": 0.0}, 3) == 0  # both have open requests


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_replicas": 0, "max_replicas": 2}, "min_replicas must be an integer >= 1"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas (2) must be at least min_replicas (3)"),
        ({"min_replicas": 1, "max_replicas": 2, "target_waiting_per_replica": 0}, "target_waiting_per_replica"),
        ({"min_replicas": 1, "max_replicas": 2, "cooldown_s": -1}, "cooldown_s"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScalingPolicy(**kwargs)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_flags_resolve_the_replica_count_and_bounds():
    assert data_parallel_size("auto", 2, 8, True) == 4
    assert data_parallel_size("auto", 4, 2, True) == 1
    assert data_parallel_size("auto", 1, 0, False) == 1
    assert data_parallel_size("3", 1, 0, False) == 3
    with pytest.raises(ValueError, match="--data-parallel-size"):
        data_parallel_size("0", 1, 0, False)
    with pytest.raises(ValueError, match="--data-parallel-size"):
        data_parallel_size("two", 1, 0, False)
    assert replica_bounds(_args("--data-parallel-size", "2"), 2) == (2, 2)
    assert replica_bounds(_args("--min-replicas", "1", "--max-replicas", "4"), 2) == (1, 4)
    with pytest.raises(ValueError, match="--min-replicas"):
        replica_bounds(_args("--min-replicas", "3"), 2)
    with pytest.raises(ValueError, match="--target-waiting-per-replica"):
        replica_bounds(_args("--max-replicas", "3", "--target-waiting-per-replica", "0"), 2)
    assert _args().routing_policy == "prefix-aware"


class QueueingEngine(FakeEngineClient):
    """A fake replica that runs `capacity` requests and reports the rest as waiting."""

    capacity = 2

    async def stats(self) -> dict:
        active = len(self.active)
        return {
            "num_unfinished": active,
            "num_running": min(active, self.capacity),
            "num_waiting": max(0, active - self.capacity),
        }


def test_a_queue_above_target_adds_replicas_and_idleness_drains_them_back_without_a_failed_request():
    stopped: list[tuple[str, int]] = []
    engines: dict[str, QueueingEngine] = {}

    async def start_replica():
        await asyncio.sleep(0.05)  # a replica takes a while to start
        name = f"r{len(engines)}"
        engines[name] = QueueingEngine(step_delay_s=0.01)
        return name, engines[name]

    async def stop_replica(name: str) -> None:
        stopped.append((name, len(engines[name].active)))

    async def request(engine: RoutedEngineClient, request_id: str, prompt: list[int]) -> list[int]:
        tokens = []
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        async for delta in engine.generate(EngineRequest(request_id, prompt, params)):
            tokens.extend(delta.token_ids)
        assert delta.finish_reason == "length" and delta.error is None
        return tokens

    async def scenario():
        engines["r0"] = QueueingEngine(step_delay_s=0.01)
        engine = RoutedEngineClient({"r0": engines["r0"]}, policy="least-loaded", block_size=4)
        policy = ScalingPolicy(1, 3, 2, cooldown_s=0.1, scale_down_idle_s=0.3)
        scaler = ReplicaScaler(engine, policy, start_replica, stop_replica, drain_poll_s=0.01)

        async def maintain():
            while True:
                await engine.refresh_loads()
                await scaler.tick()
                await asyncio.sleep(0.02)

        loop = asyncio.create_task(maintain())
        try:
            # A burst: far more waiting than 2 per replica.
            burst = [asyncio.create_task(request(engine, f"b{i}", [i + 1, 2, 3])) for i in range(12)]
            await asyncio.sleep(0.2)
            # Later arrivals, while it grows: some land on the new replicas.
            later = []
            for i in range(12):
                later.append(asyncio.create_task(request(engine, f"l{i}", [i + 50, 2, 3])))
                await asyncio.sleep(0.03)
            peak = len(engine.replicas)
            outputs = await asyncio.gather(*burst, *later)
            # A trickle, one at a time, while the idle replicas drain: none of it may fail.
            trickle = []
            for i in range(10):
                trickle.append(await request(engine, f"t{i}", [i + 100, 2, 3]))
                await asyncio.sleep(0.01)
            for _ in range(200):
                if len(engine.replicas) == 1 and not scaler.draining:
                    break
                await asyncio.sleep(0.02)
            return peak, outputs, trickle, list(engine.replicas), scaler
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await scaler.aclose()

    peak, outputs, trickle, left, scaler = asyncio.run(scenario())
    assert peak >= 2 and scaler.num_added >= 2  # it grew to the maximum of 3
    assert len(left) == 1 and scaler.num_removed == scaler.num_added
    assert all(open_requests == 0 for _, open_requests in stopped) and len(stopped) == scaler.num_added
    assert all(len(tokens) == 30 for tokens in outputs + trickle)
