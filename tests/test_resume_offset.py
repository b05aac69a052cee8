"""A request resumed from its first k output tokens continues exactly as the undisturbed run: per-position seeds,
penalty counts and the length limits pick up where they stopped, and the resumed tokens are never sent again."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.request import Request, RequestStatus
from pagerail.common.sampling_params import SamplingParams
from tests.tiny_engine import close, tiny_engine
from tests.tiny_models import make_tiny_model

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101]
NUM_TOKENS = 24
PENALISED = SamplingParams(
    max_tokens=NUM_TOKENS,
    temperature=0.9,
    top_p=0.95,
    seed=1234,
    presence_penalty=0.6,
    frequency_penalty=0.8,
    repetition_penalty=1.4,
    min_tokens=NUM_TOKENS,  # a stop token is banned until the end, however many outputs were resumed
    ignore_eos=True,
)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def run(engine: EngineCore, request: EngineRequest) -> Request:
    admitted = engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    return admitted


def fresh_run(model_dir, request: EngineRequest) -> Request:
    engine = tiny_engine(model_dir)
    try:
        return run(engine, request)
    finally:
        close(engine)


@pytest.mark.parametrize("params", [PENALISED, GREEDY], ids=["seeded-penalised", "greedy"])
def test_a_resumed_request_continues_exactly_where_the_undisturbed_run_went(model_dir, params):
    undisturbed = fresh_run(model_dir, EngineRequest("r", PROMPT, params)).output_token_ids
    assert len(undisturbed) == NUM_TOKENS
    for k in (1, 9, NUM_TOKENS - 1):
        resumed = fresh_run(model_dir, EngineRequest("r", PROMPT, params, resumed_output_token_ids=undisturbed[:k]))
        assert resumed.output_token_ids == undisturbed, k
        assert resumed.status is RequestStatus.FINISHED_LENGTH  # max_tokens counted the resumed tokens
        assert resumed.num_prompt_tokens == len(PROMPT)


def test_the_penalised_run_depends_on_its_earlier_outputs(model_dir):
    """Guards the test above: resuming after tokens the run never produced changes what follows, so an engine that
    ignored the resumed outputs' seeds and penalty counts could not pass it by chance."""
    undisturbed = fresh_run(model_dir, EngineRequest("r", PROMPT, PENALISED)).output_token_ids
    rest = replace(PENALISED, max_tokens=NUM_TOKENS - 9, min_tokens=NUM_TOKENS - 9)
    as_prompt = fresh_run(model_dir, EngineRequest("r", PROMPT + undisturbed[:9], rest)).output_token_ids
    assert as_prompt != undisturbed[9:]  # outputs handed back as prompt: seeds and penalty counts start afresh


def test_a_resume_with_nothing_left_to_generate_or_past_the_context_is_refused(model_dir):
    engine = tiny_engine(model_dir, num_blocks=16)
    try:
        resumed = [7] * NUM_TOKENS
        with pytest.raises(ValueError, match="max_tokens"):
            engine.add_request(EngineRequest("full", PROMPT, GREEDY, resumed_output_token_ids=resumed))
        with pytest.raises(ValueError, match="resumed_output_token_ids must be ints"):
            engine.add_request(EngineRequest("bad", PROMPT, GREEDY, resumed_output_token_ids=[engine.vocab_size]))
        # Without max_tokens the context bounds the prompt and the resumed outputs together.
        unbounded = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
        long_resume = [7] * (engine.max_model_len - len(PROMPT))
        with pytest.raises(ValueError, match="resumed outputs"):
            engine.add_request(EngineRequest("long", PROMPT, unbounded, resumed_output_token_ids=long_resume))
        request = engine.add_request(
            EngineRequest("fits", PROMPT, unbounded, resumed_output_token_ids=long_resume[:-1])
        )
        while engine.has_unfinished():
            engine.step()
        assert request.num_output_tokens == len(long_resume) and request.num_tokens == engine.max_model_len
    finally:
        close(engine)


def test_deltas_of_a_resumed_request_carry_only_new_tokens_and_count_the_resumed_ones(model_dir):
    params = replace(PENALISED, logprobs=2)
    undisturbed = fresh_run(model_dir, EngineRequest("r", PROMPT, params)).output_token_ids
    engine = AsyncEngine(tiny_engine(model_dir))

    async def collect():
        request = EngineRequest("r", PROMPT, params, resumed_output_token_ids=undisturbed[:5])
        return [delta async for delta in engine.stream(request)]

    try:
        deltas = asyncio.run(asyncio.wait_for(collect(), 60))
        metrics = engine.metrics_text()
    finally:
        engine.shutdown()
        close(engine.engine)
    tokens = [token for delta in deltas for token in delta.token_ids]
    assert tokens == undisturbed[5:]
    counted = 5
    for delta in deltas:
        counted += len(delta.token_ids)
        assert delta.num_output_tokens == counted and delta.num_prompt_tokens == len(PROMPT)
        assert len(delta.logprobs) == len(delta.token_ids) == len(delta.top_logprobs)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    # The engine generated only what followed the resumed tokens, and its first token here is no time-to-first-token.
    assert _sample(metrics, "pagerail_generation_tokens_total") == NUM_TOKENS - 5
    assert _sample(metrics, "pagerail_time_to_first_token_seconds_count") == 0.0


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in the exposition")
