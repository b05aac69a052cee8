"""Overlapped steps (async scheduling) change when tokens reach the head, never which tokens: outputs with overlap
on and off are identical, through preemption, chunked prefill, sessions, aborts and failed steps."""

from __future__ import annotations

import pytest

from pagerail import LLM, SamplingParams
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.request import RequestStatus
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from tests.fake_workers import FakeKVWorkers
from tests.tiny_models import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [3, 17, 29, 41] * 10, list(range(20, 90)), [100 + (i * 7) % 120 for i in range(23)]]


def tiny_llm_outputs(model_dir, async_scheduling: bool) -> tuple[list[list[int]], LLM]:
    # A 16-token budget and 24 blocks of 4 force chunked prefill and preemption on the way.
    llm = LLM(
        str(model_dir),
        block_size=4,
        num_gpu_blocks=24,
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
    ]
    outputs = llm.generate(PROMPTS * 2, params * 2)
    return [list(o.outputs[0].token_ids) for o in outputs], llm


def test_greedy_and_seeded_outputs_are_identical_with_overlap_on_and_off(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    serial, serial_llm = tiny_llm_outputs(model_dir, async_scheduling=False)
    overlapped, overlapped_llm = tiny_llm_outputs(model_dir, async_scheduling=True)
    assert overlapped == serial
    assert [len(tokens) for tokens in serial] == [20, 17, 24, 9] * 2
    for llm in (serial_llm, overlapped_llm):
        assert llm.stats.num_preemptions > 0 and llm.stats.num_mixed_steps > 0
        assert llm.engine.block_table.num_free_blocks == llm.engine.block_table.num_blocks
    # The overlapped run really had a step on the ranks while the next one was submitted; the serial one never.
    assert overlapped_llm.engine.num_overlapped_steps > 10
    assert serial_llm.engine.num_overlapped_steps == 0


# -- the engine loop against fake workers: sessions, aborts and failures, event-driven so both modes meet them ----

VOCAB = 97
EOS = 96


def fake_engine(async_scheduling: bool, num_blocks: int = 40) -> tuple[EngineCore, FakeKVWorkers]:
    workers = FakeKVWorkers(num_blocks, 4, VOCAB)
    config = EngineConfig(
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6, async_scheduling=async_scheduling),
    )
    engine = EngineCore(config, workers, max_model_len=128, vocab_size=VOCAB, eos_token_ids=[EOS])
    engine.restart_backoff_s = 0.0
    return engine, workers


def scenario(async_scheduling: bool, fail_at_token: int | None) -> dict[str, tuple[list[int], str]]:
    """Requests, a session fed chunk by chunk, an abort after a few tokens, optionally a worker failure."""
    engine, workers = fake_engine(async_scheduling)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = [engine.add_request(EngineRequest(f"r{i}", [i + 1] * (5 + 7 * i), params)) for i in range(5)]
    doomed = engine.add_request(EngineRequest("doomed", [9] * 30, SamplingParams(max_tokens=40, ignore_eos=True)))
    session_params = SamplingParams(max_tokens=6, ignore_eos=True)
    session = engine.add_request(EngineRequest("session", [2, 4, 6], session_params, final=False))
    chunks = [[8, 10, 12, 14], [16] * 9, []]
    failed = False
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
        if session.awaiting_input and chunks:
            chunk = chunks.pop(0)
            engine.append_input("session", chunk, final=not chunks)
        if doomed.num_output_tokens >= 5 and not doomed.finished:
            engine.abort("doomed")
        if fail_at_token is not None and not failed and requests[0].num_output_tokens >= fail_at_token:
            workers.fail_next = "worker"  # the next step to reach the ranks dies half-way
            failed = True
    assert not engine.has_unfinished()
    assert not workers.corrupt_reads and not workers.empty_rows
    engine.step()  # the ranks forget the last finished requests
    assert not workers.states.states
    assert engine.block_table.num_free_blocks == engine.block_table.num_blocks
    if fail_at_token is not None:
        assert engine.num_restarts == 1
    results = {r.request_id: (r.output_token_ids, r.status.value) for r in [*requests, session]}
    # Aborted with at least 5 tokens (a step in flight may add one before the abort lands): compare the five.
    assert doomed.status is RequestStatus.FINISHED_ABORTED and 5 <= doomed.num_output_tokens <= 7
    results["doomed"] = (doomed.output_token_ids[:5], doomed.status.value)
    return results


@pytest.mark.parametrize("fail_at_token", [None, 3])
def test_sessions_aborts_and_failures_give_identical_outputs_with_overlap_on_and_off(fail_at_token):
    serial = scenario(async_scheduling=False, fail_at_token=fail_at_token)
    overlapped = scenario(async_scheduling=True, fail_at_token=fail_at_token)
    assert overlapped == serial
    assert serial["session"][1] == "length" and len(serial["session"][0]) == 6
    # A failed step is recomputed: no token lost or repeated.
    assert overlapped == scenario(async_scheduling=False, fail_at_token=None)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_is_never_scheduled_past_its_last_token_by_length(async_scheduling):
    engine, workers = fake_engine(async_scheduling)
    request = engine.add_request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    assert request.num_output_tokens == 4
    assert workers.steps == 4  # one prefill and three decodes: nothing computed for a fifth token


def test_a_stop_token_costs_at_most_one_step_in_flight_and_its_token_is_dropped():
    engine, _ = fake_engine(async_scheduling=False)
    probe = engine.add_request(EngineRequest("probe", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    stop = probe.output_token_ids[2]
    counts = {}
    for async_scheduling in (False, True):
        engine, workers = fake_engine(async_scheduling)
        params = SamplingParams(max_tokens=8, stop_token_ids=[stop])
        request = engine.add_request(EngineRequest("r", [1, 2, 3], params))
        while engine.has_unfinished():
            engine.step()
        assert request.output_token_ids == probe.output_token_ids[:3]
        assert request.status is RequestStatus.FINISHED_STOPPED
        engine.step()
        assert not workers.states.states and engine.block_table.num_free_blocks == engine.block_table.num_blocks
        counts[async_scheduling] = workers.steps
    assert counts[True] <= counts[False] + 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_session_closed_while_its_last_chunk_is_in_flight_still_generates(async_scheduling):
    """The chunk was computed without logits because input was open when it was scheduled; the close arrives
    while it runs (only possible with overlap): its last position is recomputed to sample the first token."""
    engine, workers = fake_engine(async_scheduling)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    session = engine.add_request(EngineRequest("s", [1, 0, 0, 0, 0], params, final=False))
    engine.step()  # the chunk is submitted (and, without overlap, done)
    engine.append_input("s", [], final=True)
    for _ in range(50):
        if not engine.has_unfinished():
            break
        engine.step()
    assert session.status is RequestStatus.FINISHED_LENGTH and session.num_output_tokens == 3
    serial, _ = fake_engine(False)
    expected = serial.add_request(EngineRequest("e", [1, 0, 0, 0, 0], SamplingParams(max_tokens=3, ignore_eos=True)))
    while serial.has_unfinished():
        serial.step()
    assert session.output_token_ids == expected.output_token_ids
    assert not workers.corrupt_reads


@pytest.mark.parametrize(
    ("overlap_by_default", "async_scheduling", "inflight"),
    [(True, None, 2), (False, None, 1), (True, False, 1), (False, True, 2), (None, None, 1)],
)
def test_the_default_follows_the_executor_and_the_setting_overrides_it(overlap_by_default, async_scheduling, inflight):
    engine, workers = fake_engine(async_scheduling)
    if overlap_by_default is not None:  # None: a transport that does not say counts as serial
        workers.overlap_by_default = overlap_by_default
    engine = EngineCore(engine.config, workers, max_model_len=128, vocab_size=VOCAB, eos_token_ids=[EOS])
    assert engine.max_inflight_steps == inflight


def test_ranks_in_processes_of_their_own_overlap_by_default_and_an_in_process_cpu_rank_does_not(tmp_path):
    from tests.requirements import require_module

    require_module("ray", "needs Ray")
    from pagerail.cluster.distributed.local_executor import InProcessExecutor
    from pagerail.cluster.distributed.worker_group import WorkerGroup
    from pagerail.worker.config import worker_config

    model_dir = make_tiny_model("llama", tmp_path / "llama")
    config = worker_config(EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=16)), str(model_dir))
    assert WorkerGroup(config, 1, "token").overlap_by_default  # nothing starts before start()
    in_process = InProcessExecutor(config)
    try:
        assert in_process.overlap_by_default is False
    finally:
        in_process.shutdown()
