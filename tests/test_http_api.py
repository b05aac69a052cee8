"""HTTP API over the fake engine: bad input gets its documented status and OpenAI error body; admin routes."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.fake_engine import FakeEngineClient
from tests.http_server import BackgroundServer

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "sk-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = FakeEngineClient(model_name="fake", max_model_len=256, vocab_size=len(tokenizer))
    state = ServerState(
        engine, tokenizer, FrontendSettings("fake", api_key=KEY, admin_api_key=ADMIN_KEY, max_body_bytes=64 << 10)
    )
    with BackgroundServer(create_app(state)) as base_url:
        yield base_url, engine, state


def chat(**extra):
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def completion(**extra):
    return {"model": "fake", "prompt": "hello", "max_tokens": 4, **extra}


BAD_REQUESTS = [
    # (name, path, body or raw bytes, headers, status, param)
    ("wrong type for temperature", "/v1/chat/completions", chat(temperature="hot"), AUTH, 400, "temperature"),
    ("negative max_tokens", "/v1/chat/completions", chat(max_tokens=-5), AUTH, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", completion(max_tokens=10**9), AUTH, 400, None),
    ("prompt beyond the context", "/v1/completions", completion(prompt=[5] * 300), AUTH, 400, None),
    ("unknown model", "/v1/chat/completions", chat(model="gpt-9"), AUTH, 404, "model"),
    ("bad JSON", "/v1/chat/completions", b'{"model": "fake", "messages": [', AUTH, 400, None),
    ("JSON that is not an object", "/v1/completions", b"[1, 2, 3]", AUTH, 400, None),
    ("oversized body", "/v1/completions", completion(prompt="x" * (70 << 10)), AUTH, 413, None),
    ("missing key", "/v1/chat/completions", chat(), {}, 401, None),
    ("wrong key", "/v1/chat/completions", chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("invalid stop", "/v1/chat/completions", chat(stop=[1, 2]), AUTH, 400, "stop"),
    ("n = 0", "/v1/chat/completions", chat(n=0), AUTH, 400, "n"),
    ("top_p above 1", "/v1/completions", completion(top_p=1.5), AUTH, 400, "top_p"),
    ("missing messages", "/v1/chat/completions", {"model": "fake"}, AUTH, 400, "messages"),
    ("empty messages", "/v1/chat/completions", chat(messages=[]), AUTH, 400, "messages"),
    ("unknown role", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400, None),
    ("token id out of vocabulary", "/v1/completions", completion(prompt=[10**8]), AUTH, 400, "prompt"),
    ("logprobs above 20", "/v1/completions", completion(logprobs=50), AUTH, 400, "logprobs"),
    ("stop_token_ids of strings", "/v1/completions", completion(stop_token_ids=["a"]), AUTH, 400, "stop_token_ids[0]"),
    ("priority not an integer", "/v1/completions", completion(priority="high"), AUTH, 400, "priority"),
    ("priority out of range", "/v1/chat/completions", chat(priority=2**40), AUTH, 400, "priority"),
    ("bad pause mode", "/pause?mode=sideways", None, ADMIN, 400, "mode"),
    ("drain without replicas", "/replicas/drain?replica=r1", None, ADMIN, 400, "replica"),
    ("undrain without replicas", "/replicas/undrain?replica=r1", None, ADMIN, 400, "replica"),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "headers", "status", "param"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_input_gets_its_status_and_error_body(server, name, path, body, headers, status, param):
    base_url, _, _ = server
    if isinstance(body, bytes):
        response = httpx.post(base_url + path, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        response = httpx.post(base_url + path, json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert response.headers["x-request-id"]


def test_server_keeps_serving_after_bad_input(server):
    base_url, _, _ = server
    for _name, path, body, headers, _, _ in BAD_REQUESTS[:5]:
        httpx.post(base_url + path, json=body, headers=headers)
    response = httpx.post(base_url + "/v1/chat/completions", json=chat(), headers=AUTH)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_request_id_is_echoed(server):
    base_url, _, _ = server
    response = httpx.post(base_url + "/v1/completions", json=completion(), headers={**AUTH, "X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123" and response.json()["id"].endswith("abc-123")


def test_open_routes_tokenize_and_admin(server, tokenizer):
    base_url, engine, state = server
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(base_url + "/ready").status_code == 200
    assert httpx.get(base_url + "/version").json()["version"]
    assert httpx.get(base_url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "fake"
    tokens = httpx.post(base_url + "/tokenize", json={"prompt": "hello world"}, headers=AUTH).json()["tokens"]
    assert tokens == tokenizer.encode("hello world")
    assert httpx.post(base_url + "/detokenize", json={"tokens": tokens}, headers=AUTH).json()["prompt"] == "hello world"
    assert httpx.post(base_url + "/pause?mode=new").status_code == 401
    assert httpx.post(base_url + "/pause?mode=new", headers=AUTH).status_code == 401  # no admin key
    assert httpx.post(base_url + "/pause?mode=new", headers=ADMIN).status_code == 200 and engine.paused
    assert httpx.post(base_url + "/resume", headers=ADMIN).status_code == 200 and not engine.paused
    engine.ready = False
    assert httpx.get(base_url + "/ready").status_code == 503
    engine.ready = True


def test_full_queue_is_answered_with_retry_after(tokenizer):
    engine = FakeEngineClient(max_waiting=0, vocab_size=len(tokenizer))
    with BackgroundServer(create_app(ServerState(engine, tokenizer, FrontendSettings("fake")))) as base_url:
        response = httpx.post(base_url + "/v1/completions", json=completion())
    assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": None}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": None, "prompt": None}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": [1, -2]}, "prompt"),
        ("/detokenize", {"tokens": "x"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens[0]"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_malformed_tokenizer_bodies_are_400_naming_the_field(server, path, body, param):
    base_url = server[0]
    response = httpx.post(base_url + path, json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_openapi_describes_each_request_body_with_the_model_that_validates_it(server):
    import jsonschema

    base_url = server[0]
    schema = httpx.get(base_url + "/openapi.json", headers=AUTH).json()
    components = schema["components"]["schemas"]
    samples = {
        "/v1/completions": ({"model": "m", "prompt": "hi", "max_tokens": 4, "logit_bias": {"5": 1.0}}, {"prompt": 3}),
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}]}, {"messages": "hi"}),
        "/v1/messages": ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, {}),
        "/tokenize": ({"prompt": "hi"}, {"prompt": 3.5}),
        "/detokenize": ({"tokens": [1, 2]}, {"tokens": "x"}),
    }
    for path, (good, bad) in samples.items():
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        resolved = {**components[body["$ref"].rsplit("/", 1)[1]], "components": {"schemas": components}}
        jsonschema.validate(good, resolved)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, resolved)
        # The server refuses what the schema refuses.
        assert httpx.post(base_url + path, json=bad, headers=AUTH).status_code == 400
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
