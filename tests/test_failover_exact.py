"""A request whose replica dies mid-stream resumes on another replica after the tokens already streamed, with the
same parameters: seeded, penalised and greedy requests end with exactly the tokens of an undisturbed run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pagerail.cluster.bench.tiny_llama import write_tiny_llama
from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.local_client import LocalEngineClient
from pagerail.cluster.routing.routed_client import RoutedEngineClient
from pagerail.common.sampling_params import SamplingParams, StructuredOutputs
from tests.tiny_engine import close, tiny_engine
from tests.tiny_models import make_tiny_model

PROMPT = [9, 21, 33, 45, 57, 69, 81, 93, 105, 117, 129]
NUM_TOKENS = 20
DIE_AFTER = 4  # deltas a replica streams before it dies
SEEDED = SamplingParams(
    max_tokens=NUM_TOKENS,
    temperature=0.8,
    top_k=40,
    seed=77,
    presence_penalty=0.5,
    frequency_penalty=0.9,
    repetition_penalty=1.3,
    min_tokens=8,
    ignore_eos=True,
)
GREEDY_PENALISED = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, frequency_penalty=0.4, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


class DyingReplica:
    """A replica client over an in-process engine whose streams break as a dead replica's do, once: the first
    replica to stream `die_after` deltas of a request loses its connection."""

    def __init__(self, inner: LocalEngineClient, fate: dict) -> None:
        self.inner = inner
        self.model_name, self.max_model_len, self.vocab_size = inner.model_name, inner.max_model_len, inner.vocab_size
        self.eos_token_ids = inner.eos_token_ids
        self.fate = fate
        self.requests: list[EngineRequest] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        self.requests.append(request)
        stream = self.inner.generate(request)
        try:
            count = 0
            async for delta in stream:
                yield delta
                count += 1
                if count >= self.fate["die_after"] and self.fate["victim"] in (None, self):
                    self.fate["victim"] = self
                    raise ConnectionError("lost the connection to the replica")
        finally:
            await stream.aclose()

    async def append_input(self, request_id, token_ids, final):
        await self.inner.append_input(request_id, token_ids, final)

    async def abort(self, request_id, stopped=False):
        await self.inner.abort(request_id, stopped)

    async def is_ready(self):
        return self.fate["victim"] is not self

    async def pause(self, mode):
        await self.inner.pause(mode)

    async def resume(self):
        await self.inner.resume()

    async def stats(self):
        return await self.inner.stats()

    async def metrics(self):
        return await self.inner.metrics()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def undisturbed(model_dir, params: SamplingParams) -> list[int]:
    engine = tiny_engine(model_dir)
    try:
        request = engine.add_request(EngineRequest("alone", PROMPT, params))
        while engine.has_unfinished():
            engine.step()
        return list(request.output_token_ids)
    finally:
        close(engine)


async def collect(stream: AsyncIterator[RequestDelta]) -> tuple[list[int], RequestDelta]:
    tokens: list[int] = []
    last = None
    async for delta in stream:
        tokens.extend(delta.token_ids)
        assert delta.num_output_tokens == len(tokens) and delta.num_prompt_tokens == len(PROMPT), delta
        last = delta
    return tokens, last


@pytest.fixture(scope="module")
def tokenizer_model_dir(tmp_path_factory):
    """A random Llama with a tokenizer: output constraints compile against its vocabulary."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# Twelve two-letter words: many more tokens than a replica streams before it dies, on any tokenizer.
CONSTRAINED = SamplingParams(
    max_tokens=NUM_TOKENS, temperature=0.0, structured_outputs=StructuredOutputs(regex="([a-z]{2} ){12}")
)


@pytest.mark.parametrize(
    "params",
    [SEEDED, GREEDY_PENALISED, GREEDY, CONSTRAINED],
    ids=["seeded-penalised", "greedy-penalised", "greedy", "constrained"],
)
def test_failover_ends_with_exactly_the_tokens_of_an_undisturbed_run(request, params):
    # A constrained request resumes with its grammar where it was: the survivor's rank replays the outputs so far
    # through its matcher before it masks the next draw.
    model_dir = request.getfixturevalue("tokenizer_model_dir" if params is CONSTRAINED else "model_dir")
    expected = undisturbed(model_dir, params)
    fate = {"die_after": DIE_AFTER, "victim": None}
    engines = [AsyncEngine(tiny_engine(model_dir)) for _ in range(2)]
    replicas = {f"r{i}": DyingReplica(LocalEngineClient(engine, "tiny"), fate) for i, engine in enumerate(engines)}
    routed = RoutedEngineClient(replicas, policy="round-robin", block_size=4)
    try:
        tokens, last = asyncio.run(asyncio.wait_for(collect(routed.generate(EngineRequest("r", PROMPT, params))), 120))
    finally:
        for engine in engines:
            engine.shutdown()
            close(engine.engine)
    assert tokens == expected
    reason = "stop" if params is CONSTRAINED else "length"  # the grammar ends the constrained one
    assert (last.finished, last.finish_reason, last.error) == (True, reason, None)
    assert routed.num_failovers == 1
    victim = fate["victim"]
    (survivor,) = [replica for replica in replicas.values() if replica is not victim]
    (first,) = victim.requests
    (resumed,) = survivor.requests
    # The same envelope, resumed after what the caller had received: no prompt rewriting, no parameter rebasing.
    streamed = len(resumed.resumed_output_token_ids)
    assert first.resumed_output_token_ids == () and DIE_AFTER <= streamed < NUM_TOKENS
    assert resumed == first.resumed(expected[:streamed])
