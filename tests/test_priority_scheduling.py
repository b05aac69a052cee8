"""The priority scheduling policy: admission in (priority, arrival) order, an urgent arrival preempting less urgent
running work when the batch is full, memory preemptions always taking the lowest priority, and greedy outputs
unchanged by any of it; and the same requests under fcfs, where priorities are ignored. Flex work (service tier
"flex", or a priority at the flex threshold) under either policy: behind every interactive request, preempted
first, and held to its share of a step while interactive work runs."""

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


def make_request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0, tier: str = "default") -> Request:
    prompt = [(7 * i + len(rid)) % 500 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens)
    envelope = EngineRequest(rid, prompt, params, priority=priority, service_tier=tier)
    return Request(envelope, handle=next(_handles), stop_token_ids=frozenset({EOS}))


def make_scheduler(policy: str, num_blocks: int = 64, max_seqs: int = 16, budget: int = 64, **options) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, scheduling_policy=policy, **options)
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


def preempting_runs(policy: str, make_requests, judge) -> tuple[dict, dict, list]:
    """The same requests in a roomy cache and in one too small for their growth: both runs' outputs, and `judge`'s
    verdict on each preemption of the tight run (given the victim and the requests still running)."""

    def run(num_blocks: int) -> tuple[dict[str, list[int]], list]:
        scheduler = make_scheduler(policy, num_blocks=num_blocks, max_seqs=8, budget=32)
        requests = make_requests()
        verdicts: list = []
        preempt = scheduler._preempt

        def checked(victim: Request) -> None:
            verdicts.append(judge(victim, scheduler.running))
            preempt(victim)

        scheduler._preempt = checked
        for request in requests:
            scheduler.add_request(request)
        finish_order(scheduler, requests)
        return {r.request_id: list(r.output_token_ids) for r in requests}, verdicts

    roomy, none = run(256)
    tight, verdicts = run(14)
    assert not none and verdicts, "the tight cache must preempt"
    return roomy, tight, verdicts


def test_memory_preemption_takes_the_lowest_priority_and_outputs_are_unchanged():
    """A cache too small for every request's growth: each preemption takes the least urgent running request (the
    latest among equals), never a more urgent one; every output equals a roomy run's."""
    roomy, tight, victims = preempting_runs(
        "priority",
        lambda: [make_request(f"r{n}", 5 + n % 3, 24, priority=p) for n, p in enumerate([3, 0, 2, 1, 3, 0, 2])],
        # (the victim's priority, the largest priority still running)
        lambda victim, running: (victim.priority, max((r.priority for r in running), default=victim.priority)),
    )
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


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_interactive_arrival_preempts_flex_work_and_finishes_first(policy):
    """One sequence slot held by flex work, five more flex requests queued: an interactive arrival (at a worse
    priority, which the flex class still outranks) preempts the running one and finishes before all six; the
    preempted one resumes ahead of the flex requests that never ran."""
    scheduler = make_scheduler(policy, max_seqs=1)
    flex = [make_request(f"flex-{n}", 6, 8, priority=-5, tier="flex") for n in range(6)]
    for request in flex:
        scheduler.add_request(request)
    for _ in range(3):
        run_step(scheduler)
    assert flex[0].num_output_tokens > 0 and not flex[0].finished
    chat = make_request("chat", 6, 8, priority=5)
    scheduler.add_request(chat)
    order = finish_order(scheduler, [chat, *flex])
    assert order[0] == "chat" and flex[0].num_preemptions == 1, order
    assert order[1:] == [r.request_id for r in flex]
    assert scheduler.block_table.num_free_blocks == scheduler.block_table.num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_flex_work_takes_at_most_its_share_of_a_step_beside_interactive_work_and_all_of_it_alone(policy):
    scheduler = make_scheduler(policy, budget=64, flex_tokens_per_step=5)
    flex = [make_request(f"flex-{n}", 20, 30, tier="flex") for n in range(8)]
    for request in flex:
        scheduler.add_request(request)
    out = run_step(scheduler)
    assert out.num_batched_tokens == 64  # alone, flex work fills the whole step (prefill chunks)
    chat = make_request("chat", 10, 40)
    scheduler.add_request(chat)
    for _ in range(12):
        out = run_step(scheduler)
        by_class = {True: 0, False: 0}
        for item in out.scheduled:
            by_class[item.request.flex] += item.num_tokens
        assert by_class[False] >= 1 and by_class[True] <= 5, by_class  # the chat runs every step; flex shares 5
    assert any(r.num_output_tokens for r in flex)  # flex work still progresses beside it
    finish_order(scheduler, [chat, *flex])
    assert chat.finished and all(r.finished for r in flex)


def test_a_priority_at_the_flex_threshold_makes_a_request_flex_under_fcfs_too():
    scheduler = make_scheduler("fcfs", max_seqs=1, flex_priority_threshold=10)
    batch = [make_request(f"batch-{n}", 4, 4, priority=10) for n in range(3)]
    later = make_request("later", 4, 4, priority=9)
    for request in [*batch, later]:
        scheduler.add_request(request)
    assert [r.flex for r in (*batch, later)] == [True, True, True, False]
    assert finish_order(scheduler, [*batch, later])[0] == "later"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_memory_preemption_takes_flex_work_first_and_outputs_are_unchanged(policy):
    tiers = ["flex", "default", "flex", "default", "default", "flex", "default"]
    roomy, tight, verdicts = preempting_runs(
        policy,
        lambda: [make_request(f"r{n}", 5 + n % 3, 24, tier=t) for n, t in enumerate(tiers)],
        # whether an interactive request was preempted while flex work ran
        lambda victim, running: not victim.flex and any(r.flex for r in running),
    )
    assert not any(verdicts), verdicts
    assert tight == roomy
