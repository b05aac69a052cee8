"""Fair share between tenants (the Virtual Token Counter): a flooding tenant does not hold back a light one, tokens
go in proportion to weights, saved-up credit cannot burst; and a stateful property test over the scheduler with
tenants, weights, priorities and random arrivals, checking the block table and queues and VTC's bound on the
service gap between two backlogged tenants."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagerail.cluster.core.block_table import BlockTable
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.fair_share import request_cost, service_gap_bound
from pagerail.cluster.core.request import Request, RequestStatus
from pagerail.cluster.core.scheduler import Scheduler
from pagerail.common.engine_config import SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from tests.test_scheduler import EOS, run_step

_handles = itertools.count(1)


def make_request(rid: str, tenant: str, weight: float = 1.0, prompt_len: int = 8, max_tokens: int = 8, priority=0):
    prompt = [(7 * i + len(rid)) % 500 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    envelope = EngineRequest(rid, prompt, params, priority=priority, tenant=tenant, tenant_weight=weight)
    return Request(envelope, handle=next(_handles), stop_token_ids=frozenset({EOS}))


def make_scheduler(fairness: str, max_seqs: int = 2, budget: int = 32, num_blocks: int = 256, policy="fcfs"):
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, fairness=fairness, scheduling_policy=policy
    )
    return Scheduler(config, BlockTable(num_blocks, 4, enable_prefix_caching=False), 256)


def _served_until_light_finishes(fairness: str) -> int:
    """Tenant `flood` queues 30 requests, then `light` one: the flood's requests finished before light's."""
    scheduler = make_scheduler(fairness)
    flood = [make_request(f"flood-{n}", "flood") for n in range(30)]
    for request in flood:
        scheduler.add_request(request)
    run_step(scheduler)
    light = make_request("light", "light")
    scheduler.add_request(light)
    while not light.finished:
        run_step(scheduler)
    return sum(r.finished for r in flood)


def test_a_light_tenant_is_not_held_back_behind_a_flood():
    # Lifted to the flood's counter on arrival, it is admitted at once into the slot of a flood request preempted
    # for it (the flood runs both slots, more than its share of one): at most the other one finishes first.
    assert _served_until_light_finishes("vtc") <= 1
    assert _served_until_light_finishes("none") >= 28  # behind the whole queue


def test_a_tenant_under_its_share_of_the_slots_takes_one_from_the_most_served_tenant_over_its_share():
    """Four slots, all held by `flood` (weight 1) beside `steady` (weight 1, one running): `light` arrives and is
    admitted in the next step into the slot of flood's most recently admitted request, never steady's; the
    preempted request loses nothing (it recomputes and finishes with all its tokens)."""
    scheduler = make_scheduler("vtc", max_seqs=4)
    steady = make_request("steady", "steady", max_tokens=40)
    scheduler.add_request(steady)
    flood = [make_request(f"flood-{n}", "flood", max_tokens=40) for n in range(6)]
    for request in flood:
        scheduler.add_request(request)
    for _ in range(4):
        run_step(scheduler)
    assert sorted(r.request_id for r in scheduler.running) == ["flood-0", "flood-1", "flood-2", "steady"]
    light = make_request("light", "light", max_tokens=4)
    scheduler.add_request(light)
    out = run_step(scheduler)
    assert [r.request_id for r in out.preempted] == ["flood-2"]
    assert light in scheduler.running and steady.num_preemptions == 0
    while scheduler.requests:
        run_step(scheduler)
    assert all(len(r.output_token_ids) == 40 for r in [steady, *flood])
    assert scheduler.block_table.num_free_blocks == scheduler.block_table.num_blocks


def test_backlogged_tenants_are_given_tokens_in_proportion_to_their_weights():
    scheduler = make_scheduler("vtc", max_seqs=4, budget=64)
    requests = [make_request(f"{t}-{n}", t, w) for n in range(40) for t, w in (("a", 3.0), ("b", 1.0))]
    for request in requests:
        scheduler.add_request(request)
    # While both stay backlogged, count the tokens each was given.
    served = {"a": 0, "b": 0}
    while {r.tenant for r in scheduler.waiting} == {"a", "b"}:
        out = run_step(scheduler)
        for item in out.scheduled:
            served[item.request.tenant] += item.num_tokens
    assert 2.7 <= served["a"] / served["b"] <= 3.3, served


def test_credit_saved_while_idle_cannot_burst():
    """`b` is idle while `a` is served for a long time; when `b` returns it starts from `a`'s counter, not from
    zero, so it does not take every admission until it has caught up."""
    scheduler = make_scheduler("vtc", max_seqs=2)
    for n in range(10):
        scheduler.add_request(make_request(f"a-early-{n}", "a"))
    for _ in range(40):
        run_step(scheduler)
    late_a = [make_request(f"a-{n}", "a") for n in range(10)]
    for request in late_a:
        scheduler.add_request(request)
    returning = [make_request(f"b-{n}", "b") for n in range(10)]
    for request in returning:
        scheduler.add_request(request)
    assert scheduler.fair_share.counters["b"] >= min(scheduler.fair_share.counters.values())
    admitted: list[str] = []
    for _ in range(60):
        out = run_step(scheduler)
        admitted += [item.request.tenant for item in out.scheduled if item.admitted]
    # Alternating from the start: among the first eight admissions each tenant has half.
    assert admitted[:8].count("b") == 4, admitted


TENANTS = {"a": 1.0, "b": 2.0, "c": 0.5}
MAX_PROMPT, MAX_OUTPUT = 20, 12


class FairShareMachine(RuleBasedStateMachine):
    """Random arrivals of three tenants (weights 1, 2 and 0.5), priorities and steps, over a cache that may run
    out. After every rule: the queues and the block table agree, and while two tenants stay backlogged their
    weighted service differs by at most the bound."""

    @initialize(
        budget=st.integers(4, 24),
        max_num_seqs=st.integers(1, 5),
        num_blocks=st.integers(12, 48),
        policy=st.sampled_from(["fcfs", "priority"]),
    )
    def start(self, budget: int, max_num_seqs: int, num_blocks: int, policy: str) -> None:
        self.scheduler = make_scheduler("vtc", max_num_seqs, budget, num_blocks, policy)
        self.bound = service_gap_bound(max_num_seqs, request_cost(MAX_PROMPT, MAX_OUTPUT), min(TENANTS.values()))
        self.next_id = 0
        self.requests: list[Request] = []
        # (tenant, tenant) -> their counters when both became backlogged
        self.since: dict[tuple[str, str], tuple[float, float]] = {}

    @rule(
        tenant=st.sampled_from(sorted(TENANTS)),
        prompt_len=st.integers(1, MAX_PROMPT),
        max_tokens=st.integers(1, MAX_OUTPUT),
        priority=st.sampled_from([0, 0, 0, 1]),
        count=st.integers(1, 4),
    )
    def arrive(self, tenant: str, prompt_len: int, max_tokens: int, priority: int, count: int) -> None:
        for _ in range(count):
            self.next_id += 1
            request = make_request(f"r{self.next_id}", tenant, TENANTS[tenant], prompt_len, max_tokens, priority)
            self.scheduler.add_request(request)
            self.requests.append(request)

    @precondition(lambda self: bool(self.scheduler.requests))
    @rule(count=st.integers(1, 6))
    def step(self, count: int) -> None:
        for _ in range(count):
            if self.scheduler.requests:
                run_step(self.scheduler)

    @invariant()
    def queues_and_blocks_agree(self) -> None:
        scheduler, table = self.scheduler, self.scheduler.block_table
        assert all(r.status is RequestStatus.RUNNING for r in scheduler.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting)
        assert len(scheduler.running) + len(scheduler.waiting) == len(scheduler.requests)
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        assert table.num_free_blocks + table.num_used_blocks == table.num_blocks
        assert sum(table.num_blocks_held(r.request_id) for r in scheduler.running) == table.num_used_blocks
        assert not any(table.has_request(r.request_id) for r in self.requests if r.finished)

    @invariant()
    def backlogged_tenants_stay_within_the_bound(self) -> None:
        counters = self.scheduler.fair_share.counters
        # Backlogged at equal priority: tenants with a request waiting at the most urgent priority there is.
        waiting = list(self.scheduler.waiting)
        urgent = min((r.priority for r in waiting), default=None)
        backlogged = {r.tenant for r in waiting if r.priority == urgent}
        for pair in list(self.since):
            if not set(pair) <= backlogged:
                del self.since[pair]
        for pair in itertools.combinations(sorted(backlogged), 2):
            start = self.since.setdefault(pair, (counters.get(pair[0], 0.0), counters.get(pair[1], 0.0)))
            gap = (counters.get(pair[0], 0.0) - start[0]) - (counters.get(pair[1], 0.0) - start[1])
            assert abs(gap) <= self.bound, (pair, gap, self.bound)

    def teardown(self) -> None:
        for _ in range(20_000):
            if not self.scheduler.requests:
                break
            run_step(self.scheduler)
        assert not self.scheduler.requests, "requests never finished"
        table = self.scheduler.block_table
        assert table.num_free_blocks == table.num_blocks


TestFairShareMachine = FairShareMachine.TestCase
