"""The priority scheduling policy: admission in (priority, arrival) order, an urgent arrival preempting less urgent
running work when the batch is full, memory preemptions always taking the lowest priority, and greedy outputs
unchanged by any of it; and the same requests under fcfs, where priorities are ignored."""

from __future__ import annotations

import itertools

import pytest

from pagerail.cluster.core.block_table import BlockTable
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.request import Request
from pagerail.cluster.core.scheduler import Scheduler
from pagerail.common.engine_config import SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from tests.test_scheduler import EOS, run_step

_handles = itertools.count(1)


def make_request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    prompt = [(7 * i + len(rid)) % 500 for i in range(prompt_len)]
    envelope = EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
    return Request(envelope, handle=next(_handles), stop_token_ids=frozenset({EOS}))


def make_scheduler(policy: str, num_blocks: int = 64, max_seqs: int = 16, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, scheduling_policy=policy)
    return Scheduler(config, BlockTable(num_blocks, 4, enable_prefix_caching=True), 256)


def finish_order(scheduler: Scheduler, requests: list[Request]) -> list[str]:
    order: list[str] = []
    for _ in range(10_000):
        if not scheduler.requests:
            return order
        run_step(scheduler)
        order += [r.request_id for r in requests if r.finished and r.request_id not in order]
    raise AssertionError("requests never finished")


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_an_urgent_arrival_overtakes_low_priority_work_with_one_sequence_slot(policy):
    """One running sequence allowed; six low-priority requests in flight (one running, five waiting), then an
    urgent one: under priority it preempts the running one and finishes before all six; under fcfs, last."""
    scheduler = make_scheduler(policy, max_seqs=1)
    low = [make_request(f"low-{n}", 6, 8, priority=10) for n in range(6)]
    for request in low:
        scheduler.add_request(request)
    for _ in range(3):
        run_step(scheduler)
    assert low[0].num_output_tokens > 0 and not low[0].finished  # it runs
    urgent = make_request("urgent", 6, 8, priority=0)
    scheduler.add_request(urgent)
    order = finish_order(scheduler, [urgent, *low])
    before = order.index("urgent")
    if policy == "priority":
        assert before == 0 and low[0].num_preemptions == 1, order
        assert order[1:] == [r.request_id for r in low]  # the preempted one resumes first: it is the oldest
    else:
        assert before == 6 and urgent.num_preemptions == 0, order
    assert scheduler.block_table.num_free_blocks == scheduler.block_table.num_blocks


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    scheduler = make_scheduler("priority", max_seqs=1)
    requests = [make_request(f"r{n}", 4, 2, priority=p) for n, p in enumerate([5, 1, 5, 0, 1])]
    for request in requests:
        scheduler.add_request(request)
    assert finish_order(scheduler, requests) == ["r3", "r1", "r4", "r0", "r2"]


def test_memory_preemption_takes_the_lowest_priority_and_outputs_are_unchanged():
    """A cache too small for every request's growth: each preemption takes the least urgent running request (the
    latest among equals), never a more urgent one; every output equals a roomy run's."""

    def run(num_blocks: int) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
        scheduler = make_scheduler("priority", num_blocks=num_blocks, max_seqs=8, budget=32)
        requests = [make_request(f"r{n}", 5 + n % 3, 24, priority=p) for n, p in enumerate([3, 0, 2, 1, 3, 0, 2])]
        victims: list[tuple[int, int]] = []  # (the victim's priority, the largest priority still running)
        preempt = scheduler._preempt

        def checked(victim: Request) -> None:
            others = [r.priority for r in scheduler.running]
            victims.append((victim.priority, max(others, default=victim.priority)))
            preempt(victim)

        scheduler._preempt = checked
        for request in requests:
            scheduler.add_request(request)
        finish_order(scheduler, requests)
        return {r.request_id: list(r.output_token_ids) for r in requests}, victims

    roomy, none = run(256)
    tight, victims = run(14)
    assert not none and victims, "the tight cache must preempt"
    for victim, least_urgent_left in victims:
        assert victim >= least_urgent_left, victims  # nothing running was less urgent than the victim
    assert tight == roomy


def test_llm_generate_sends_each_prompts_priority_and_refuses_bad_ones(tmp_path):
    from pagerail import LLM
    from pagerail.cluster.bench.tiny_llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(str(model), scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=8 << 20) as llm:
        seen: list[int] = []
        add = llm.engine.add_request

        def recording(request: EngineRequest):
            seen.append(request.priority)
            return add(request)

        llm.engine.add_request = recording
        outputs = llm.generate([[5, 6, 7], [8, 9, 10]], params, priority=[3, -1])
        assert sorted(seen) == [-1, 3] and all(len(o.outputs[0].token_ids) == 2 for o in outputs)
        for bad in ("high", [1], [1, 2**40]):
            with pytest.raises(ValueError, match="priority"):
                llm.generate([[5, 6, 7], [8, 9, 10]], params, priority=bad)
