"""Scheduler unit tests driven by a fake runner: no torch, milliseconds each."""

from __future__ import annotations

import pytest

from pagerail.cluster.core.block_table import BlockTable
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.request import Request, RequestStatus
from pagerail.cluster.core.scheduler import Scheduler
from pagerail.cluster.core.scheduler_output import PauseMode
from pagerail.common.engine_config import SchedulerConfig
from pagerail.common.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999


def fake_token(request: Request) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return (sum(request.all_token_ids) * 31 + request.num_tokens) % (VOCAB - 1)


def make_request(rid: str, prompt_len: int, max_tokens: int, handle: int = 0, **kwargs) -> Request:
    prompt = [(7 * i + len(rid)) % 500 for i in range(prompt_len)]
    return Request(
        EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens)),
        handle=handle or abs(hash(rid)) % 10**6,
        stop_token_ids=frozenset({EOS}),
        **kwargs,
    )


def run_step(scheduler: Scheduler):
    out = scheduler.schedule()
    sampled = {}
    for item in out.scheduled:
        request = item.request
        # Tokens are only known once the chunk reaches the end of the sequence.
        if not item.skip_sampling:
            assert request.num_computed_tokens + item.num_tokens == request.num_tokens
            sampled[request.handle] = fake_token(request)
    scheduler.update_from_output(out, sampled)
    return out


def run_all(scheduler: Scheduler, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not scheduler.requests:
            return
        run_step(scheduler)
    raise AssertionError("requests never finished")


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=16, max_len=256, caching=True) -> Scheduler:
    table = BlockTable(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(config, table, max_len)


def outputs_of(requests: list[Request]) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_token_ids) for r in requests}


def test_decode_to_max_tokens_and_blocks_return():
    scheduler = make_scheduler()
    requests = [make_request(f"r{i}", 5 + i, 6) for i in range(4)]
    for r in requests:
        scheduler.add_request(r)
    run_all(scheduler)
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6 for r in requests)
    assert scheduler.block_table.num_free_blocks == scheduler.block_table.num_blocks


def test_budget_and_max_num_seqs_are_respected():
    scheduler = make_scheduler(budget=10, max_seqs=3)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 4, 3))
    while scheduler.requests:
        out = run_step(scheduler)
        assert out.num_batched_tokens <= 10
        assert len(scheduler.running) <= 3


def test_chunked_prefill_is_mixed_with_decodes():
    scheduler = make_scheduler(budget=8)
    short = make_request("short", 3, 10)
    scheduler.add_request(short)
    run_step(scheduler)  # short is now decoding
    long = make_request("long", 30, 2)
    scheduler.add_request(long)
    out = run_step(scheduler)
    chunks = {s.request.request_id: s for s in out.scheduled}
    assert chunks["short"].num_tokens == 1 and not chunks["short"].skip_sampling
    assert chunks["long"].num_tokens == 7 and chunks["long"].skip_sampling
    run_all(scheduler)
    assert scheduler.stats.num_mixed_steps >= 3
    assert long.num_output_tokens == 2


def test_preemption_recomputes_and_keeps_outputs():
    def workload():
        return [make_request(f"r{i}", 10, 20) for i in range(6)]

    roomy = make_scheduler(num_blocks=200, caching=False)
    reference = workload()
    for r in reference:
        roomy.add_request(r)
    run_all(roomy)
    assert roomy.stats.num_preemptions == 0

    tight = make_scheduler(num_blocks=20, caching=False)
    squeezed = workload()
    for r in squeezed:
        tight.add_request(r)
    run_all(tight)
    assert tight.stats.num_preemptions > 0
    assert outputs_of(squeezed) == outputs_of(reference)
    assert tight.block_table.num_free_blocks == tight.block_table.num_blocks


def test_preempted_request_goes_to_head_of_queue():
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_request("a", 8, 12), make_request("b", 8, 12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler)  # both admitted: 2 blocks each (+1 for the sampled token later)
    preempted = []
    while not preempted:
        preempted = run_step(scheduler).preempted
    assert preempted == [b]
    assert scheduler.waiting[0] is b and b.num_computed_tokens == 0 and b.num_output_tokens > 0
    run_all(scheduler)
    assert a.num_output_tokens == b.num_output_tokens == 12


def test_prefix_hit_computes_only_uncached_tokens():
    scheduler = make_scheduler(block_size=4)
    first = make_request("first", 17, 2)
    scheduler.add_request(first)
    run_all(scheduler)
    second = make_request("secnd", 17, 2)  # same length id → same prompt tokens
    assert second.prompt_token_ids == first.prompt_token_ids
    scheduler.add_request(second)
    out = run_step(scheduler)
    assert out.scheduled[0].num_tokens == 1  # 16 cached tokens; the last prompt token is recomputed
    assert second.num_cached_tokens == 16
    assert scheduler.stats.num_prefix_hit_tokens == 16


def test_request_that_can_never_fit_is_rejected():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_len=100)
    with pytest.raises(ValueError, match="max_model_len=100"):
        scheduler.add_request(make_request("long", 90, 20))
    with pytest.raises(ValueError, match="whole cache holds 4"):
        scheduler.add_request(make_request("big", 10, 10))
    with pytest.raises(ValueError, match="already exists"):
        scheduler.add_request(make_request("ok", 4, 4))
        scheduler.add_request(make_request("ok", 4, 4))


def test_abort_frees_everything_wherever_the_request_is():
    scheduler = make_scheduler(max_seqs=1)
    running, waiting = make_request("run", 6, 50), make_request("wait", 6, 50)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert running.status is RequestStatus.RUNNING and waiting.status is RequestStatus.WAITING
    scheduler.abort("run")
    scheduler.abort("wait")
    assert running.status is waiting.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.block_table.num_free_blocks == scheduler.block_table.num_blocks
    out = scheduler.schedule()
    assert sorted(out.finished_handles) == sorted([running.handle, waiting.handle])
    assert scheduler.abort("unknown") is None


def test_pause_modes():
    scheduler = make_scheduler()
    a = make_request("a", 4, 30)
    scheduler.add_request(a)
    run_step(scheduler)
    scheduler.pause(PauseMode.NEW)
    b = make_request("b", 4, 3)
    scheduler.add_request(b)
    out = run_step(scheduler)
    assert [s.request for s in out.scheduled] == [a]
    scheduler.pause(PauseMode.ALL)
    assert not run_step(scheduler).scheduled
    scheduler.pause(PauseMode.NONE)
    run_all(scheduler)
    assert b.num_output_tokens == 3


def test_stop_token_respects_min_tokens():
    scheduler = make_scheduler()
    request = make_request("r", 4, 10)
    request.sampling_params = SamplingParams(max_tokens=10, min_tokens=3)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {request.handle: EOS})
    assert not request.finished  # below min_tokens, EOS does not stop
    for _ in range(2):
        out = scheduler.schedule()
        scheduler.update_from_output(out, {request.handle: EOS})
    assert request.status is RequestStatus.FINISHED_STOPPED and request.num_output_tokens == 3


def test_streaming_input_session_keeps_its_blocks():
    scheduler = make_scheduler(block_size=4)
    session = make_request("s", 8, 4, input_open=True)
    scheduler.add_request(session)
    run_step(scheduler)
    assert session.status is RequestStatus.AWAITING_INPUT and not session.output_token_ids
    blocks = scheduler.block_table.block_ids("s")
    assert len(blocks) == 2
    scheduler.append_input("s", [1, 2, 3, 4, 5], final=False)
    out = run_step(scheduler)
    assert out.scheduled[0].num_tokens == 5 and not out.scheduled[0].admitted
    assert scheduler.block_table.block_ids("s")[:2] == blocks
    scheduler.append_input("s", [6, 7], final=True)
    out = run_step(scheduler)
    assert out.scheduled[0].num_tokens == 2 and not out.scheduled[0].skip_sampling
    run_all(scheduler)
    assert session.num_output_tokens == 4
    assert scheduler.stats.num_computed_tokens == 8 + 5 + 2 + 3
    with pytest.raises(ValueError, match="not an open streaming-input session"):
        scheduler.append_input("s", [1], final=True)


def test_unchunked_prefill_refuses_a_request_longer_than_the_step_budget():
    table = BlockTable(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, enable_chunked_prefill=False), table, 256)
    # Prompt plus output must fit: a preempted request recomputes both in one unchunked step.
    with pytest.raises(ValueError, match="max_num_batched_tokens=32"):
        scheduler.add_request(make_request("long", 30, 3))
    scheduler.add_request(make_request("fits", 28, 4))
    run_all(scheduler)
    assert table.num_free_blocks == 64


def test_peak_running_counts_sequences_holding_blocks_at_once():
    scheduler = make_scheduler(max_seqs=3)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 6, 4))
    run_all(scheduler)
    assert scheduler.stats.peak_running == 3


def test_a_plain_decode_item_is_handed_out_again_only_within_its_epoch():
    # Blocks of 4 and a prompt of 5: the second and third decodes fit the blocks already held, so they are plain.
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_request("a", 5, 12), make_request("b", 5, 12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = run_step(scheduler)  # both prompts, admitted: not plain decodes
    assert not any(item.plain for item in first.scheduled) and first.has_admissions
    decodes = [run_step(scheduler).scheduled for _ in range(2)]
    items = [{item.request.request_id: item for item in step} for step in decodes]
    plain = [step_items["a"] for step_items in items if step_items["a"].plain]
    assert plain and all(item is plain[0] for item in plain)  # the same object, step after step
    assert plain[0].num_tokens == 1 and not plain[0].new_block_ids and not plain[0].skip_sampling
    # Squeeze b out: after its preemption (a new epoch) it is admitted again and its first plain decode is a new
    # item, while the old one keeps the epoch it was scheduled under (a step in flight still reads it).
    old_b = items[-1]["b"]
    old_epoch = old_b.epoch
    preempted = []
    while not preempted:
        preempted = run_step(scheduler).preempted
    assert preempted == [b] and b.epoch > old_epoch
    for _ in range(200):
        out = run_step(scheduler)
        again = [item for item in out.scheduled if item.request is b and item.plain]
        if again:
            assert again[0] is not old_b and again[0].epoch == b.epoch and old_b.epoch == old_epoch
            break
    else:
        raise AssertionError("b never decoded again")
    run_all(scheduler)
    assert a.num_output_tokens == b.num_output_tokens == 12
    # A finished request lets go of its item, which points back at it: no cycle is left for the collector.
    assert a.decode_item is None and b.decode_item is None


def test_the_mixed_step_count_sees_a_partial_chunk_beside_plain_decodes():
    scheduler = make_scheduler(block_size=4, budget=8)
    scheduler.add_request(make_request("short", 2, 20))
    run_step(scheduler)
    run_step(scheduler)  # a plain decode; the next one still fits the first block of 4
    scheduler.add_request(make_request("long", 30, 4))
    out = run_step(scheduler)
    assert out.has_partial_prefill and any(item.plain for item in out.scheduled)
    assert scheduler.stats.num_mixed_steps == 1


def test_a_pooling_request_is_never_preempted_while_decodes_run_out_of_blocks():
    """Its whole prompt's blocks are reserved on admission; the decodes beside it preempt each other instead."""

    def workload():
        decodes = [make_request(f"d{i}", 8, 16) for i in range(2)]
        embedding = Request(
            EngineRequest("e", list(range(100, 124)), SamplingParams(max_tokens=1, ignore_eos=True), pooling="last"),
            handle=77,
            stop_token_ids=frozenset(),
        )
        return decodes, embedding

    def run(scheduler, decodes, embedding):
        for request in decodes:
            scheduler.add_request(request)
        run_step(scheduler)  # the decodes are admitted and decoding before the pooling request arrives
        scheduler.add_request(embedding)
        run_all(scheduler)

    roomy = make_scheduler(num_blocks=64, budget=4, caching=False)
    reference = workload()
    run(roomy, *reference)

    tight = make_scheduler(num_blocks=11, budget=4, caching=False)
    decodes, embedding = workload()
    run(tight, decodes, embedding)
    assert tight.stats.num_preemptions > 0, "the cache was meant to run out"
    assert embedding.num_preemptions == 0
    assert sum(r.num_preemptions for r in decodes) == tight.stats.num_preemptions
    assert outputs_of([*decodes, embedding]) == outputs_of([*reference[0], reference[1]])
    assert tight.block_table.num_free_blocks == tight.block_table.num_blocks


def test_a_request_whose_adapter_has_no_slot_waits_while_the_requests_behind_it_run():
    """One adapter slot: adapter 1 runs; a request for adapter 2 is set aside, the base-model and adapter-1
    requests queued behind it are admitted, and it runs once adapter 1's requests are done, still first in line."""
    from pagerail.common.lora import LoRARequest

    def request(rid: str, lora_id: int, max_tokens: int) -> Request:
        lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
        envelope = EngineRequest(rid, [3, 4, 5, 6], SamplingParams(max_tokens=max_tokens), lora=lora)
        return Request(envelope, handle=abs(hash(rid)) % 10**6, stop_token_ids=frozenset({EOS}))

    table = BlockTable(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), table, 256, max_loras=1)
    first = request("first", 1, 6)
    scheduler.add_request(first)
    run_step(scheduler)
    blocked, base, same = request("blocked", 2, 3), request("base", 0, 3), request("same", 1, 3)
    for r in (blocked, base, same):
        scheduler.add_request(r)
    run_step(scheduler)
    assert {r.request_id for r in scheduler.running} == {"first", "base", "same"}
    assert list(scheduler.waiting) == [blocked]
    while first.status is RequestStatus.RUNNING or same.status is RequestStatus.RUNNING:
        assert blocked.status is RequestStatus.WAITING
        run_step(scheduler)
    run_all(scheduler)
    assert blocked.num_output_tokens == 3 and scheduler.block_table.num_free_blocks == 64
