"""The engine loop against fake workers that model every KV slot: streaming-input sessions end, grow, yield
their memory and time out; the context limit follows the cache; failed steps never poison the prefix cache."""

from __future__ import annotations

import pytest

from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.core.request import RequestStatus
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from tests.fake_workers import FakeKVWorkers, next_token

VOCAB = 97
EOS = 96  # never sampled by these tests' prompts often enough to matter: ignore_eos is set where it would


def make_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    max_num_seqs: int = 8,
    **scheduler,
) -> tuple[EngineCore, FakeKVWorkers]:
    workers = FakeKVWorkers(num_blocks, block_size, VOCAB)
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=max_num_seqs, **scheduler),
    )
    engine = EngineCore(config, workers, max_model_len=max_model_len, vocab_size=VOCAB, eos_token_ids=[EOS])
    return engine, workers


def params(max_tokens: int | None = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_until(engine: EngineCore, done, max_steps: int = 200) -> int:
    for step in range(max_steps):
        if done():
            return step
        engine.step()
    raise AssertionError(f"not done after {max_steps} steps")


def expected_outputs(prompt: list[int], num: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num):
        tokens.append(next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


# -- sessions ----------------------------------------------------------------------------------------------


def test_session_closed_without_a_final_chunk_still_generates():
    engine, workers = make_engine()
    prompt = list(range(1, 10))
    session = engine.add_request(EngineRequest("s", prompt, params(3), final=False))
    run_until(engine, lambda: session.status is RequestStatus.AWAITING_INPUT)
    engine.append_input("s", [], final=True)  # the client half-closed: no more input, and no new tokens
    run_until(engine, lambda: session.finished)
    assert session.status is RequestStatus.FINISHED_LENGTH
    assert session.output_token_ids == expected_outputs(prompt, 3)
    assert not workers.corrupt_reads
    assert engine.block_table.num_free_blocks == engine.block_table.num_blocks


def test_session_without_max_tokens_grows_up_to_the_context_and_refuses_overflow_unchanged():
    engine, _ = make_engine(max_model_len=40)
    session = engine.add_request(EngineRequest("s", list(range(1, 13)), params(None), final=False))
    run_until(engine, lambda: session.status is RequestStatus.AWAITING_INPUT)
    engine.append_input("s", list(range(20, 32)), final=False)  # 24 tokens now: still fits
    run_until(engine, lambda: session.status is RequestStatus.AWAITING_INPUT)
    with pytest.raises(ValueError, match="max_model_len=40"):
        engine.append_input("s", list(range(1, 17)), final=False)  # 40 tokens would leave no room for output
    assert session.num_tokens == 24 and session.input_open and session.status is RequestStatus.AWAITING_INPUT
    engine.append_input("s", [5, 6], final=True)
    run_until(engine, lambda: session.finished)
    # No max_tokens: it generated until the context was full.
    assert session.status is RequestStatus.FINISHED_LENGTH and session.num_tokens == 40


def test_idle_sessions_give_their_blocks_to_waiting_requests_and_resume_exactly():
    # 12 blocks of 4: three idle sessions of 12 tokens hold 9 blocks; a 16-token request needs 5 blocks.
    engine, workers = make_engine(num_blocks=12, max_model_len=48)
    sessions = [
        engine.add_request(EngineRequest(f"s{i}", [i + 1] * 6 + [7, 8, 9, 10, 11, 12], params(2), final=False))
        for i in range(3)
    ]
    run_until(engine, lambda: all(s.status is RequestStatus.AWAITING_INPUT for s in sessions))
    assert engine.block_table.num_free_blocks == 3
    other = engine.add_request(EngineRequest("other", list(range(30, 46)), params(4)))
    run_until(engine, lambda: other.finished)
    assert other.output_token_ids == expected_outputs(list(range(30, 46)), 4)
    assert engine.scheduler.stats.num_idle_sessions_released >= 1
    for s in sessions:
        engine.append_input(s.request_id, [40, 41], final=True)
    run_until(engine, lambda: all(s.finished for s in sessions))
    for s in sessions:
        assert s.output_token_ids == expected_outputs(s.prompt_token_ids, 2)
    assert not workers.corrupt_reads
    assert engine.block_table.num_free_blocks == engine.block_table.num_blocks


def test_idle_sessions_count_against_max_num_seqs():
    engine, _ = make_engine(max_num_seqs=2)
    sessions = [engine.add_request(EngineRequest(f"s{i}", [i + 1] * 5, params(2), final=False)) for i in range(2)]
    run_until(engine, lambda: all(s.status is RequestStatus.AWAITING_INPUT for s in sessions))
    other = engine.add_request(EngineRequest("other", [3] * 5, params(2)))
    run_until(engine, lambda: other.finished)  # would wait forever if idle sessions kept their slots
    assert engine.scheduler.stats.num_idle_sessions_released == 1


def test_open_sessions_are_limited():
    engine, _ = make_engine(max_sessions=2)
    engine.add_request(EngineRequest("a", [1, 2], params(), final=False))
    engine.add_request(EngineRequest("b", [1, 2], params(), final=False))
    with pytest.raises(QueueFullError, match="max_sessions"):
        engine.add_request(EngineRequest("c", [1, 2], params(), final=False))
    engine.add_request(EngineRequest("d", [1, 2], params()))  # ordinary requests are not sessions


def test_idle_session_times_out_with_a_clear_error():
    now = [0.0]
    engine, _ = make_engine(session_idle_timeout_s=30)
    engine.scheduler.clock = lambda: now[0]
    session = engine.add_request(EngineRequest("s", [1, 2, 3], params(), final=False))
    run_until(engine, lambda: session.status is RequestStatus.AWAITING_INPUT)
    now[0] = 29.0
    assert engine.step() == [] and not session.finished
    now[0] = 31.0
    assert engine.step() == [session]
    assert session.status is RequestStatus.FINISHED_ABORTED and session.error_code == "session_idle_timeout"
    assert "30 s" in session.error
    assert engine.block_table.num_free_blocks == engine.block_table.num_blocks and not engine.has_unfinished()


def test_new_requests_never_join_an_open_session():
    engine, _ = make_engine()
    engine.add_request(EngineRequest("s", [1, 2, 3], params(), final=False))
    with pytest.raises(ValueError, match="already exists"):
        engine.add_request(EngineRequest("s", [9, 9], params()))
    assert engine.scheduler.requests["s"].prompt_token_ids == [1, 2, 3]


# -- context limit ---------------------------------------------------------------------------------------------


def test_max_model_len_is_capped_to_what_one_sequence_can_hold():
    engine, _ = make_engine(num_blocks=8, block_size=4, max_model_len=512)
    assert engine.max_model_len == 32
    # No max_tokens: up to the (capped) context.
    request = engine.add_request(EngineRequest("r", [1, 2, 3], params(None)))
    run_until(engine, lambda: request.finished)
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 32


def test_a_cache_below_the_smallest_useful_context_refuses_to_start():
    with pytest.raises(ValueError, match="KV cache holds 8 tokens"):
        make_engine(num_blocks=2, block_size=4, max_model_len=512)


# -- prefix cache integrity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["crash", "worker"])
def test_blocks_of_a_failed_step_are_never_served_from_the_prefix_cache(failure):
    engine, workers = make_engine()
    prompt = list(range(1, 30))
    engine.add_request(EngineRequest("a", prompt, params(2)))
    workers.fail_next = failure
    if failure == "crash":
        with pytest.raises(RuntimeError):
            engine.step()
        engine.abort("a")  # what the serving loop does with every request of a step that crashed
    else:
        engine.step()  # the group restarts; "a" is recomputed
    b = engine.add_request(EngineRequest("b", prompt, params(2)))
    run_until(engine, lambda: b.finished)
    assert not workers.corrupt_reads
    assert b.output_token_ids == expected_outputs(prompt, 2)
