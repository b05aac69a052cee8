"""The API surface as clients reach it, through the official openai and anthropic clients against the HTTP server on
a tiny random Llama: sampling fields (logit_bias, allowed_token_ids, bad_words, truncation), scored prompts (echo,
prompt_logprobs), routes and errors, Anthropic's Messages API and OpenAI's Responses API (also on gRPC, from the
same frontend)."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from pagerail import LLM, SamplingParams
from pagerail.cluster.bench.tiny_llama import write_tiny_llama
from pagerail.cluster.frontend.generation import token_text
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.proto import api_pb2, api_pb2_grpc
from tests.http_server import BackgroundFrontend, BackgroundServer

MODEL = "tiny"
PROMPT = [5, 17, 42, 99, 7, 300, 12]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    llm = LLM(str(model_dir), served_model_name=MODEL, kv_cache_memory_bytes=16 << 20)
    # A plain template, so chat requests render (the trimmed tokenizer has none).
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    return llm


@pytest.fixture(scope="module")
def greedy(llm):
    """The unbiased greedy tokens of PROMPT, before the server's loop thread owns the engine."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def frontend(llm, greedy):
    """The HTTP and gRPC APIs of one frontend: (base URL, gRPC target)."""
    with BackgroundFrontend(llm.engine_client, llm.tokenizer, FrontendSettings(MODEL)) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def api(frontend):
    return openai.OpenAI(base_url=frontend[0] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def rpc(frontend):
    with grpc.insecure_channel(frontend[1]) as channel:
        yield api_pb2_grpc.GenerationStub(channel)


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


@pytest.fixture(scope="module")
def prompt_scores(llm):
    """Each PROMPT token's logprob given the tokens before it, from transformers on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float32)
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    return [float(logprobs[position - 1, PROMPT[position]]) for position in range(1, len(PROMPT))]


def test_echo_scores_the_prompt_as_an_evaluation_harness_reads_it(api, llm, prompt_scores):
    """lm-evaluation-harness's loglikelihood request: the prompt echoed with one logprob per token (the first
    null) and the top logprobs, whose best entry says whether the token was the greedy one."""
    completion = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = completion.choices[0]
    prompt_text = llm.tokenizer.decode(PROMPT)
    assert choice.text.startswith(prompt_text)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(PROMPT) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1 : len(PROMPT)] == pytest.approx(prompt_scores, abs=1e-4)
    rows = zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True)
    for token, logprob, top in rows:
        assert top[token] == pytest.approx(logprob) and max(top.values()) >= logprob
    assert logprobs.text_offset[1] == len(logprobs.tokens[0])
    assert completion.usage.completion_tokens == 1


def test_echo_with_no_tokens_returns_the_scored_prompt_alone_cached_or_not(api, llm, prompt_scores):
    answers = [
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True) for _ in range(2)
    ]
    for completion in answers:  # the second prompt is in the prefix cache: it is computed again for its logprobs
        choice = completion.choices[0]
        assert choice.text == llm.tokenizer.decode(PROMPT) and choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(PROMPT)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(prompt_scores, abs=1e-4)
        assert completion.usage.completion_tokens == 0
    assert answers[0].choices[0].logprobs.token_logprobs == answers[1].choices[0].logprobs.token_logprobs


def test_streamed_echo_puts_the_prompt_first(api, llm, prompt_scores):
    stream = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=0, echo=True, temperature=0, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    whole = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=0, echo=True, temperature=0)
    assert "".join(chunk.text for chunk in chunks) == whole.choices[0].text
    streamed = [lp for chunk in chunks for lp in chunk.logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs and streamed[0] is None
    assert streamed[1 : len(PROMPT)] == pytest.approx(prompt_scores, abs=1e-4)


def test_prompt_logprobs_in_vllms_shape(api, prompt_scores):
    completion = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    scored = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(PROMPT) and scored[0] is None
    for position, entry in enumerate(scored[1:], start=1):
        own = entry[str(PROMPT[position])]
        assert own["logprob"] == pytest.approx(prompt_scores[position - 1], abs=1e-4) and own["rank"] >= 1
        # The top two and the token itself, each with its rank among the vocabulary.
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks == ([1, 2] if own["rank"] <= 2 else [1, 2, own["rank"]])
        assert (own["rank"] == 1) == (max(e["logprob"] for e in entry.values()) == own["logprob"])


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ],
)
def test_scoring_requests_out_of_bounds_are_400_naming_the_field(api, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt=PROMPT, **fields)
    assert info.value.body["param"] == param


def test_grpc_returns_the_prompts_logprobs_in_each_choices_first_message(api, llm, prompt_scores):
    import asyncio

    import grpc

    from pagerail.cluster.frontend.grpc_api import build_grpc_server
    from pagerail.proto import api_pb2, api_pb2_grpc

    async def generate() -> list[api_pb2.GenerateResponse]:
        server, port = build_grpc_server(llm.engine_client, llm.tokenizer, host="127.0.0.1", port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                sampling = api_pb2.SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, n=2, seed=1)
                request = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=PROMPT), sampling_params=sampling)
                return [m async for m in api_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)]
        finally:
            await server.stop(None)

    messages = asyncio.run(generate())
    for index in (0, 1):
        ours = [m for m in messages if m.index == index]
        first, later = ours[0], ours[1:]
        assert [entry.token_id for entry in first.prompt_logprobs] == PROMPT[1:]
        assert [entry.logprob for entry in first.prompt_logprobs] == pytest.approx(prompt_scores, abs=1e-4)
        assert all(len(entry.top_logprobs) == 1 for entry in first.prompt_logprobs)
        assert all(not m.prompt_logprobs for m in later)


def test_tokenizer_info_describes_the_served_tokenizer(api, llm):
    root = api.with_options(base_url=str(api.base_url).removesuffix("/").removesuffix("/v1"))  # outside /v1
    info = root.get("/tokenizer_info", cast_to=object)
    assert info["tokenizer_class"] == type(llm.tokenizer).__name__
    assert info["eos_token"] == llm.tokenizer.eos_token and info["model_max_length"] == llm.engine_client.max_model_len
    assert info["vocab_size"] == llm.engine_client.vocab_size


def test_chat_returns_the_rendered_prompts_logprobs_once(api, llm):
    messages = [{"role": "user", "content": "hello there"}]
    chat = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, n=2, seed=0, extra_body={"prompt_logprobs": 0}
    )
    scored = chat.model_extra["prompt_logprobs"]
    prompt_ids = llm.tokenizer(llm.tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    prompt_ids = prompt_ids["input_ids"]
    assert len(scored) == len(prompt_ids) and scored[0] is None
    assert all(list(entry) == [str(token)] for entry, token in zip(scored[1:], prompt_ids[1:], strict=True))


@pytest.fixture(scope="module")
def claude(api):
    import anthropic

    root = str(api.base_url).removesuffix("/").removesuffix("/v1")
    return anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0)


# Anthropic's current SDK no longer names temperature; older clients send it, and the server reads it.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    # A short answer whatever the random model prefers: the grammar allows two cities.
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_anthropic_messages_answer_as_chat_completions_do_whole_and_streamed(api, claude):
    turns = [{"role": "user", "content": "hello there"}]
    chat = api.chat.completions.create(model=MODEL, messages=turns, max_tokens=12, temperature=0)
    message = claude.messages.create(model="claude-any", max_tokens=12, messages=turns, extra_body=GREEDY)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.role == "assistant" and message.model == MODEL
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    with claude.messages.stream(model="claude-any", max_tokens=12, messages=turns, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == message.usage.output_tokens


def test_anthropic_system_prompt_and_tool_turns_render_as_chat_messages(api, claude):
    turns = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]},
    ]
    chat_turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    message = claude.messages.create(
        model="m", max_tokens=6, system="Be brief.", messages=turns, extra_body=GREEDY, tools=[WEATHER]
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": WEATHER["name"],
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    chat = api.chat.completions.create(model=MODEL, messages=chat_turns, max_tokens=6, temperature=0, tools=tools)
    assert message.usage.input_tokens == chat.usage.prompt_tokens  # the same rendered prompt
    assert message.content[0].text == chat.choices[0].message.content


def test_a_tool_call_comes_back_as_a_tool_use_block_whole_and_streamed(claude):
    asked = dict(
        model="m",
        max_tokens=64,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    message = claude.messages.create(**asked)
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Oslo", "Paris") and call.id
    assert message.stop_reason == "tool_use"
    with claude.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    (streamed,) = [block for block in final.content if block.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input) and final.stop_reason == "tool_use"


def test_anthropic_bad_requests_are_400(claude):
    import anthropic

    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="m", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}],
        )
    assert "messages[0].content" in str(info.value)


def test_anthropic_clients_authenticate_with_their_x_api_key_header(llm, api):
    import anthropic

    app = create_app(ServerState(llm.engine_client, llm.tokenizer, FrontendSettings(MODEL, api_key="sk-anthropic")))
    with BackgroundServer(app) as base_url:
        turns = [{"role": "user", "content": "hi"}]
        good = anthropic.Anthropic(base_url=base_url, api_key="sk-anthropic", max_retries=0)
        assert good.messages.create(model="m", max_tokens=2, messages=turns).content
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base_url, api_key="sk-wrong", max_retries=0).messages.create(
                model="m", max_tokens=2, messages=turns
            )


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_everywhere(api, llm, greedy):
    from pagerail.common.sampling_params import SamplingParams

    tail = PROMPT[-4:]
    expected = llm.generate([tail], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    through_llm = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=4)
    )[0]
    assert through_llm.prompt_token_ids == tail and through_llm.outputs[0].token_ids == expected.outputs[0].token_ids
    completion = api.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 4},
    )
    assert completion.usage.prompt_tokens == 4 and completion.choices[0].text == expected.outputs[0].text
    echoed = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, extra_body={"truncate_prompt_tokens": 4}
    )
    assert echoed.choices[0].text == llm.tokenizer.decode(tail)
    whole = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(PROMPT)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": 0})
    assert info.value.body["param"] == "truncate_prompt_tokens"


def test_bad_words_never_come_out(api, llm, texts, canonical, greedy):
    from pagerail.cluster.frontend.bad_words import bad_word_sequences
    from pagerail.common.sampling_params import SamplingParams

    # A two-token word, spelled as the greedy run's first two tokens: the second is masked right after the first.
    word = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[tuple(greedy[:2])])
    (tokens,) = [o.outputs[0].token_ids for o in llm.generate([PROMPT], word)]
    assert tokens[0] == greedy[0] and tokens[1] != greedy[1]
    # Over HTTP, as a client sends them: words as text, spelled with the server's tokenizer.
    first = llm.tokenizer.decode([greedy[0]]).strip()
    sequences = bad_word_sequences(llm.tokenizer, (first,))
    assert sequences and all(isinstance(token, int) for sequence in sequences for token in sequence)
    banned = {sequence[0] for sequence in sequences if len(sequence) == 1}
    out = _tokens(api, texts, extra_body={"bad_words": [first]})
    assert not banned & set(out)
    # The greedy first token is one of the word's spellings, so the answer had to change.
    assert (greedy[0],) in sequences and out[0] != canonical(greedy[0])


def test_responses_create_answers_as_chat_completions_does(api):
    turns = [{"role": "user", "content": "hello there"}]
    chat = api.chat.completions.create(model=MODEL, messages=turns, max_tokens=10, temperature=0)
    response = api.responses.create(model=MODEL, input="hello there", max_output_tokens=10, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert api.responses.retrieve(response.id).output_text == response.output_text


def test_streamed_response_deltas_make_the_whole_text_and_end_with_usage(api):
    whole = api.responses.create(model=MODEL, input="hello there", max_output_tokens=10, temperature=0)
    events = list(
        api.responses.create(model=MODEL, input="hello there", max_output_tokens=10, temperature=0, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[-1].response.output_text == whole.output_text


def test_a_continuation_equals_sending_the_whole_history_and_reuses_its_prefix(api):
    first = api.responses.create(
        model=MODEL,
        input="the first question, long enough to fill some blocks",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
    )
    follow = api.responses.create(
        model=MODEL,
        input="and the second one",
        previous_response_id=first.id,
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
    )
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "the first question, long enough to fill some blocks"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and the second one"},
    ]
    whole = api.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
    assert follow.output_text == whole.choices[0].message.content
    assert follow.usage.input_tokens == whole.usage.prompt_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the first turn's blocks, from the prefix cache


def test_a_function_call_comes_back_as_a_function_call_item(api):
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER["input_schema"],
    }
    response = api.responses.create(
        model=MODEL,
        input="weather?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Paris") and call.call_id
    streamed = list(
        api.responses.create(
            model=MODEL,
            input="weather?",
            tools=[tool],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments


@pytest.mark.parametrize(
    "fields, error, param",
    [
        ({"max_output_tokens": -1}, openai.BadRequestError, "max_output_tokens"),
        ({"previous_response_id": "resp_nothing"}, openai.NotFoundError, "previous_response_id"),
        ({"input": [{"type": "image_generation_call"}]}, openai.BadRequestError, "input[0]"),
    ],
)
def test_bad_responses_requests_name_the_field(api, fields, error, param):
    with pytest.raises(error) as info:
        api.responses.create(model=MODEL, **{"input": "hi", **fields})
    assert info.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve("resp_nothing")


def test_responses_on_grpc_answer_as_http_does_and_share_its_store(api, rpc):
    """CreateResponse gives the HTTP API's text and usage; a response made on either API continues on the other."""
    over_http = api.responses.create(model=MODEL, input="hello there", max_output_tokens=10, temperature=0)
    over_grpc = rpc.CreateResponse(
        api_pb2.ResponseRequest(input_text="hello there", max_output_tokens=10, temperature=0.0)
    )
    assert over_grpc.output_text == over_http.output_text and over_grpc.status == over_http.status
    assert over_grpc.usage.prompt_tokens == over_http.usage.input_tokens
    assert over_grpc.usage.completion_tokens == over_http.usage.output_tokens
    assert over_grpc.id.startswith("resp_") and over_grpc.model == MODEL
    # Continued over gRPC from the HTTP response, and fetched over HTTP: the same as continuing over HTTP.
    follow = dict(input="and the second one", previous_response_id=over_http.id, max_output_tokens=6, temperature=0)
    expected = api.responses.create(model=MODEL, **follow)
    continued = rpc.CreateResponse(
        api_pb2.ResponseRequest(
            input_text="and the second one", previous_response_id=over_http.id, max_output_tokens=6, temperature=0.0
        )
    )
    assert continued.output_text == expected.output_text and continued.usage.cached_tokens > 0
    assert api.responses.retrieve(continued.id).output_text == continued.output_text
    assert rpc.GetResponse(api_pb2.GetResponseRequest(response_id=expected.id)).output_text == expected.output_text


def test_a_function_call_on_grpc_comes_back_as_a_function_call_item(rpc):
    tool = api_pb2.FunctionTool(
        name="get_weather", description="The weather in a city", parameters=json.dumps(WEATHER["input_schema"])
    )
    items = [api_pb2.ResponseItem(message=api_pb2.ResponseMessage(role="user", text="weather?"))]
    response = rpc.CreateResponse(
        api_pb2.ResponseRequest(
            input=items, tools=[tool], tool_choice="get_weather", max_output_tokens=64, temperature=0.0
        )
    )
    (call,) = [item.function_call for item in response.output if item.HasField("function_call")]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Paris") and call.call_id


@pytest.mark.parametrize(
    "fields, code, field",
    [
        ({"max_output_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT, "max_output_tokens"),
        ({"previous_response_id": "resp_nothing"}, grpc.StatusCode.NOT_FOUND, "previous_response_id"),
        ({"json_schema": "{not json"}, grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
        ({"input": [api_pb2.ResponseItem()]}, grpc.StatusCode.INVALID_ARGUMENT, "input[0]"),
    ],
)
def test_bad_responses_on_grpc_name_the_field(rpc, fields, code, field):
    with pytest.raises(grpc.RpcError) as info:
        rpc.CreateResponse(
            api_pb2.ResponseRequest(**{"input_text": "hi", **fields})
            if "input" not in fields
            else api_pb2.ResponseRequest(**fields)
        )
    assert info.value.code() == code and field in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        rpc.GetResponse(api_pb2.GetResponseRequest(response_id="resp_nothing"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_response_store_is_bounded_by_count_and_age():
    from pagerail.cluster.frontend.responses_api import ResponseStore

    store = ResponseStore(max_responses=2, max_age_s=60.0)
    for name in ("a", "b", "c"):
        store.put(name, {"id": name}, [])
    assert store.get("a") is None and store.get("c").body == {"id": "c"} and len(store) == 2
    store.max_age_s = 0.0
    assert store.get("b") is None and len(store) == 1


def test_a_json_schema_response_completes_streamed_and_whole(api):
    text = {"format": {"type": "json_schema", "name": "city", "schema": WEATHER["input_schema"], "strict": True}}
    whole = api.responses.create(model=MODEL, input="which city?", text=text, max_output_tokens=64, temperature=0)
    assert whole.status == "completed" and json.loads(whole.output_text)["city"] in ("Oslo", "Paris")
    events = list(
        api.responses.create(
            model=MODEL, input="which city?", text=text, max_output_tokens=64, temperature=0, stream=True
        )
    )
    assert events[-1].type == "response.completed" and events[-1].response.usage.total_tokens > 0
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


@pytest.fixture(scope="module")
def hidden_states(llm):
    """Final hidden states of transformers on the same weights, for a text's tokens."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(llm.model_dir, dtype=torch.float32)

    def states(token_ids: list[int]):
        with torch.no_grad():
            return model(torch.tensor([token_ids])).last_hidden_state[0]

    return states


def _cosine(a, b) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.as_tensor(b), dim=0))


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_match_transformers_pooling_in_input_order(api, llm, hidden_states, pooling):
    texts = ["the first input", "a second, longer input that takes more tokens than the first", "3"]
    answer = api.embeddings.create(model=MODEL, input=texts, encoding_format="float", extra_body={"pooling": pooling})
    assert [item.index for item in answer.data] == [0, 1, 2]
    for text, item in zip(texts, answer.data, strict=True):
        states = hidden_states(llm.tokenizer.encode(text))
        expected = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
        assert _cosine(item.embedding, expected) >= 0.999
        assert abs(sum(x * x for x in item.embedding) - 1.0) < 1e-4  # unit length
    tokens = sum(len(llm.tokenizer.encode(text)) for text in texts)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens


def test_base64_embeddings_decode_to_the_same_floats_and_dimensions_cut_them(api):
    import base64
    import struct

    floats = api.embeddings.create(model=MODEL, input=[[5, 17, 42], [8, 9]], encoding_format="float")
    encoded = api.embeddings.with_raw_response.create(
        model=MODEL, input=[[5, 17, 42], [8, 9]], encoding_format="base64"
    )
    for item, raw in zip(floats.data, encoded.http_response.json()["data"], strict=True):
        data = base64.b64decode(raw["embedding"])
        assert list(struct.unpack(f"<{len(data) // 4}f", data)) == pytest.approx(item.embedding, abs=1e-7)
    short = api.embeddings.create(model=MODEL, input=[5, 17, 42], dimensions=16, encoding_format="float").data[0]
    head = floats.data[0].embedding[:16]
    norm = sum(x * x for x in head) ** 0.5
    assert short.embedding == pytest.approx([x / norm for x in head], abs=1e-6) and len(floats.data[0].embedding) > 16


def test_llm_embed_equals_the_served_embedding(api, llm):
    served = api.embeddings.create(model=MODEL, input=[PROMPT], encoding_format="float").data[0].embedding
    (offline,) = llm.embed([PROMPT])
    assert offline == pytest.approx(served, abs=1e-6)


@pytest.mark.parametrize(
    "fields, error, param",
    [
        ({"input": []}, openai.BadRequestError, "input"),
        ({"input": "x", "dimensions": 100000}, openai.BadRequestError, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, openai.BadRequestError, "encoding_format"),
        ({"input": "x", "model": "other"}, openai.NotFoundError, "model"),
    ],
)
def test_bad_embedding_requests_name_the_field(api, fields, error, param):
    with pytest.raises(error) as info:
        api.embeddings.create(**{"model": MODEL, **fields})
    assert info.value.body["param"] == param


def test_beam_search_answers_the_n_best_beams_as_llm_beam_search_does(api, llm):
    from pagerail import BeamSearchParams

    (offline,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    extra = {"use_beam_search": True, "length_penalty": 0.5}
    served = api.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=0, extra_body=extra)
    assert [c.text for c in served.choices] == [s.text for s in offline.sequences]
    assert [c.index for c in served.choices] == [0, 1, 2]
    assert served.usage.completion_tokens == sum(len(s.token_ids) for s in offline.sequences)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, extra_body=extra
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content


def test_best_of_answers_the_choices_with_the_highest_summed_logprob(api):
    fields = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    every = api.completions.create(n=4, logprobs=0, extra_body={"ignore_eos": True}, **fields)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.index for c in ranked[:2]] != [0, 1]  # so answering the first two would fail below
    best = api.completions.create(n=2, best_of=4, extra_body={"ignore_eos": True}, **fields)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all four ran


def test_best_of_on_grpc_answers_as_on_http(api, rpc):
    """The same seeded request over both APIs: the same two best choices, best first, each whole."""
    fields = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    over_http = api.completions.create(n=2, best_of=4, logprobs=0, extra_body={"ignore_eos": True}, **fields)
    params = api_pb2.SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    request = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=PROMPT), sampling_params=params, best_of=4)
    over_grpc = list(rpc.Generate(request))
    assert [m.index for m in over_grpc] == [0, 1] and all(m.finish_reason == "length" for m in over_grpc)
    assert [m.text for m in over_grpc] == [c.text for c in over_http.choices]
    assert not over_grpc[0].logprobs  # ranked by them, not asked for
    request.sampling_params.logprobs = 0
    shown = list(rpc.Generate(request))
    for message, choice in zip(shown, over_http.choices, strict=True):
        assert [e.logprob for e in message.logprobs] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    request.best_of = 1
    with pytest.raises(grpc.RpcError) as info:
        list(rpc.Generate(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "best_of" in info.value.details()


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"extra_body": {"use_beam_search": True}, "stream": True}, "stream"),
        ({"extra_body": {"use_beam_search": True}, "temperature": 0.7}, "temperature"),
        ({"extra_body": {"use_beam_search": True}, "n": 11}, "n"),
        ({"extra_body": {"use_beam_search": True}, "stop": ["x"]}, "stop"),
    ],
)
def test_bad_best_of_and_beam_requests_are_400_naming_the_field(api, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **fields)
    assert info.value.body["param"] == param


def test_a_background_response_is_polled_to_the_foreground_answer_and_can_be_cancelled(api, llm):
    import asyncio
    import time

    fields = {"model": MODEL, "input": "hello there", "max_output_tokens": 10, "temperature": 0}
    foreground = api.responses.create(**fields)
    started = api.responses.create(background=True, **fields)
    assert started.status == "queued" and started.background
    deadline = time.monotonic() + 30
    while (polled := api.responses.retrieve(started.id)).status in (
        "queued",
        "in_progress",
    ) and time.monotonic() < deadline:
        time.sleep(0.02)  # a client polls; the engine finishes ten tokens in well under a second
    assert polled.status == "incomplete" and polled.output_text == foreground.output_text

    engine = llm.engine_client
    asyncio.run(engine.pause("all"))  # held by the engine: the cancel below finds it running
    try:
        held = api.responses.create(background=True, **fields)
        cancelled = api.responses.cancel(held.id)
        assert cancelled.status == "cancelled" and api.responses.retrieve(held.id).status == "cancelled"
        with pytest.raises(openai.BadRequestError):
            api.responses.cancel(held.id)  # nothing left to cancel
    finally:
        asyncio.run(engine.resume())
    deadline = time.monotonic() + 30
    while asyncio.run(engine.stats())["num_unfinished"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert asyncio.run(engine.stats())["num_unfinished"] == 0  # the engine request was aborted, not left running
    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(background=True, stream=True, **fields)
    assert info.value.body["param"] == "background"


def test_grpc_beam_search_answers_the_beams_llm_beam_search_finds(llm):
    import asyncio

    import grpc

    from pagerail import BeamSearchParams
    from pagerail.cluster.frontend.grpc_api import build_grpc_server
    from pagerail.proto import api_pb2, api_pb2_grpc

    async def generate(sampling: api_pb2.SamplingParams) -> list[api_pb2.GenerateResponse]:
        server, port = build_grpc_server(llm.engine_client, llm.tokenizer, host="127.0.0.1", port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                beams = api_pb2.BeamSearch(beam_width=3, length_penalty=0.5)
                request = api_pb2.GenerateRequest(
                    token_ids=api_pb2.TokenIds(ids=PROMPT), sampling_params=sampling, beam_search=beams
                )
                return [m async for m in api_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)]
        finally:
            await server.stop(None)

    (offline,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    messages = asyncio.run(generate(api_pb2.SamplingParams(max_tokens=6)))
    assert [list(m.token_ids) for m in messages] == [s.token_ids for s in offline.sequences]
    assert [m.index for m in messages] == [0, 1, 2] and [m.text for m in messages] == [
        s.text for s in offline.sequences
    ]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(generate(api_pb2.SamplingParams(max_tokens=6, temperature=0.8)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in info.value.details()
