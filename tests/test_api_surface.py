"""The OpenAI API's less common request fields and routes, through the official client against the HTTP server
on a tiny random Llama: logit_bias, allowed_token_ids, a model's own card, and errors in OpenAI's shape."""

from __future__ import annotations

import openai
import pytest

from pagerail import LLM, SamplingParams
from pagerail.cluster.bench.tiny_llama import write_tiny_llama
from pagerail.cluster.frontend.generation import token_text
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.http_server import BackgroundServer

MODEL = "tiny"
PROMPT = [5, 17, 42, 99, 7, 300, 12]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return LLM(str(model_dir), served_model_name=MODEL, kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def greedy(llm):
    """The unbiased greedy tokens of PROMPT, before the server's loop thread owns the engine."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def api(llm, greedy):
    engine = llm.engine_client
    app = create_app(ServerState(engine, llm.tokenizer, FrontendSettings(MODEL)))
    with BackgroundServer(app) as base_url:
        yield openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def texts(llm):
    """The text logprobs show for a token -> the token; a text several ids share stands for the lowest of them
    (and `canonical` maps each id to that one)."""
    by_text: dict[str, int] = {}
    for token_id in range(llm.engine_client.vocab_size - 1, -1, -1):
        by_text[token_text(llm.tokenizer, token_id)] = token_id
    return by_text


@pytest.fixture(scope="module")
def canonical(llm, texts):
    return lambda token_id: texts[token_text(llm.tokenizer, token_id)]


def _tokens(api, texts, **fields) -> list[int]:
    """The output token ids of a completion of PROMPT, read back from its logprobs' token texts."""
    fields = {"max_tokens": 8, "temperature": 0, **fields}
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    completion = api.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, extra_body=extra, **fields)
    return [texts[token] for token in completion.choices[0].logprobs.tokens]


def test_a_bias_of_100_makes_every_token_that_token_greedy_or_sampled(api, texts, canonical, greedy):
    assert _tokens(api, texts) == [canonical(t) for t in greedy]
    forced = next(t for t in sorted(texts.values()) if t not in greedy)
    assert _tokens(api, texts, logit_bias={str(forced): 100}) == [forced] * 8
    assert _tokens(api, texts, logit_bias={str(forced): 100}, temperature=1.0, seed=3) == [forced] * 8


def test_a_bias_of_minus_100_on_the_greedy_token_removes_it(api, texts, canonical, greedy):
    banned = greedy[0]
    assert canonical(banned) == banned, "the test needs a greedy token whose text no other token has"
    tokens = _tokens(api, texts, logit_bias={str(banned): -100})
    assert banned not in tokens


def test_allowed_token_ids_limit_what_is_sampled(api, texts):
    allowed = sorted(texts.values())[100:103]
    tokens = _tokens(api, texts, temperature=1.0, seed=1, extra_body={"allowed_token_ids": allowed})
    assert set(tokens) <= set(allowed) and len(tokens) == 8


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logit_bias": {"5000000": 1}}, "stop_token_ids, logit_bias and allowed_token_ids"),
        ({"logit_bias": {"5": 250}}, "logit_bias[5]"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ],
)
def test_bad_biases_and_allowed_sets_are_400_naming_the_field(api, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **fields)
    assert param in info.value.body["message"]


def test_a_model_has_its_own_card_and_an_unknown_one_is_404(api):
    card = api.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        api.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found" and "no-such-model" in info.value.body["message"]


def test_unknown_routes_and_methods_answer_in_openai_error_shape(api):
    with pytest.raises(openai.NotFoundError) as info:
        api.get("/no/such/route", cast_to=object)
    assert info.value.body["code"] == "not_found" and "/v1/no/such/route" in info.value.body["message"]
    with pytest.raises(openai.APIStatusError) as info:
        api.get("/completions", cast_to=object)
    assert info.value.status_code == 405 and info.value.body["code"] == "method_not_allowed"
