"""Tenants: the --tenants file read and refused with its line and field, keys mapped to tenants (any other key, or
none, to `default`), per-tenant quotas (429 for the tenant over its concurrency or tokens per minute, nobody else)
and a tenant's default priority, through the HTTP API over the fake engine; and the service tier a request names
reaching the engine."""

from __future__ import annotations

import threading

import httpx
import pytest

from pagerail.cluster.frontend.errors import APIError
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.cluster.frontend.tenant_quotas import TenantQuotas
from pagerail.cluster.frontend.tenants import Tenant, TenantsFileError, load_tenants, parse_tenants
from tests.fake_engine import FakeEngineClient
from tests.http_server import BackgroundServer

GOOD = """\
tenants:
  - name: chat
    api_keys: [sk-chat-1, sk-chat-2]
    weight: 4
    max_concurrency: 1
    priority: -1
  - name: batch
    api_keys: ["sk-batch"]
    weight: 0.5
    tokens_per_minute: 30
  - name: default
    priority: 3
"""


def test_keys_map_to_their_tenant_and_every_other_key_to_default():
    tenants = parse_tenants(GOOD)
    assert tenants.of_key("sk-chat-2") == Tenant("chat", 4.0, 1, None, -1)
    assert tenants.of_key("sk-batch") == Tenant("batch", 0.5, None, 30, None)
    assert (
        tenants.of_key("sk-unknown")
        == tenants.of_key(None)
        == tenants.of_key("")
        == Tenant("default", 1.0, None, None, 3)
    )
    assert parse_tenants("tenants: []").default == Tenant("default")


BAD_FILES = [
    # (file text, its line, what the message must name)
    ("tenants: [", 1, "not valid YAML"),
    ("- a\n- b\n", None, "mapping with a `tenants` list"),
    ("tenant: []\n", 1, "unknown top-level key 'tenant'"),
    ("tenants: {name: a}\n", 1, "tenants must be a list"),
    ("tenants:\n  - api_keys: [k]\n", 2, "tenants[0].name is missing"),
    ("tenants:\n  - name: 'a b'\n    api_keys: [k]\n", 2, "tenants[0].name must be"),
    ("tenants:\n  - {name: a, api_keys: [k]}\n  - {name: a, api_keys: [j]}\n", 3, "tenant 'a' is already defined"),
    ("tenants:\n  - name: a\n    api_keys: k\n", 3, "tenants[0].api_keys must be a list"),
    ("tenants:\n  - name: a\n    api_keys: ['']\n", 3, "tenants[0].api_keys[0] must be a non-empty string"),
    ("tenants:\n  - {name: a, api_keys: [k]}\n  - name: b\n    api_keys: [j, k]\n", 4, "already belongs to 'a'"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    weight: heavy\n", 4, "tenants[0].weight must be a number"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    weight: 0\n", 4, "tenants[0].weight must be a number > 0"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    max_concurrency: 0\n", 4, "tenants[0].max_concurrency"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    tokens_per_minute: 1.5\n", 4, "tenants[0].tokens_per_minute"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    priority: 9999999999\n", 4, "tenants[0].priority"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    wieght: 2\n", 4, "unknown field 'wieght'"),
    ("tenants:\n  - name: default\n    api_keys: [k]\n", 3, "the default tenant takes every other key"),
    ("tenants:\n  - name: a\n", 2, "tenants[0].api_keys must list at least one key"),
]


@pytest.mark.parametrize(("text", "line", "named"), BAD_FILES, ids=[case[2] for case in BAD_FILES])
def test_a_malformed_tenants_file_is_refused_naming_the_line_and_the_field(tmp_path, text, line, named):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(TenantsFileError) as refused:
        load_tenants(path)
    message = str(refused.value)
    assert str(path) in message and named in message, message
    if line is not None:
        assert f"line {line}:" in message, message


def test_a_missing_tenants_file_is_refused(tmp_path):
    with pytest.raises(TenantsFileError, match="cannot read"):
        load_tenants(tmp_path / "nowhere.yaml")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_quotas_refuse_the_tenant_over_them_and_nobody_else():
    clock = Clock()
    quotas = TenantQuotas(clock)
    busy, metered, other = Tenant("busy", max_concurrency=2), Tenant("metered", tokens_per_minute=100), Tenant("x")
    quotas.enter(busy)
    quotas.enter(busy)
    with pytest.raises(APIError, match="max_concurrency") as refused:
        quotas.enter(busy)
    assert refused.value.retry_after_s >= 1
    for _ in range(50):
        quotas.enter(other)  # no limits: never refused
    quotas.leave(busy)
    quotas.enter(busy)  # room again once one ended
    quotas.enter(metered)
    quotas.count(metered, 60)
    clock.now += 30
    quotas.count(metered, 50)
    quotas.leave(metered)
    with pytest.raises(APIError, match="tokens per minute") as refused:
        quotas.enter(metered)
    # The first 60 tokens leave the window 30 s from now, which brings it under the rate.
    assert refused.value.retry_after_s == pytest.approx(30.0)
    clock.now += 30.5
    quotas.enter(metered)
    assert quotas.tokens_used(metered) == 50


@pytest.fixture(scope="module")
def server(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    engine = FakeEngineClient(model_name="fake", max_model_len=256, vocab_size=len(tokenizer), step_delay_s=0.01)
    settings = FrontendSettings("fake", tenants=parse_tenants(GOOD))
    with BackgroundServer(create_app(ServerState(engine, tokenizer, settings))) as base_url:
        yield base_url, engine


def _completion(base_url: str, key: str | None, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "fake", "prompt": "hello", "max_tokens": 4, **extra}
    return httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=30)


def test_a_tenant_at_its_concurrency_gets_429_while_others_are_served(server):
    base_url, engine = server
    engine.paused = True  # the first request of `chat` stays in flight
    first = threading.Thread(target=_completion, args=(base_url, "sk-chat-1"))
    first.start()
    try:
        for _ in range(500):
            if any(request.priority == -1 for request in engine.requests):
                break
            threading.Event().wait(0.01)
        refused = _completion(base_url, "sk-chat-2")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "max_concurrency" in refused.json()["error"]["message"]
        engine.paused = False
        assert _completion(base_url, "sk-batch").status_code == 200  # another tenant: served
        assert _completion(base_url, None).status_code == 200
    finally:
        engine.paused = False
        first.join(timeout=30)
    assert _completion(base_url, "sk-chat-1").status_code == 200  # its request ended: room again


def test_a_tenants_default_priority_applies_unless_the_request_names_one_and_its_name_and_weight_travel(server):
    base_url, engine = server
    cases = (("sk-chat-1", {}, -1, "chat", 4.0), ("sk-chat-1", {"priority": 7}, 7, "chat", 4.0))
    for key, extra, priority, tenant, weight in (*cases, ("nobody", {}, 3, "default", 1.0)):
        assert _completion(base_url, key, **extra).status_code == 200
        sent = engine.requests[-1]
        assert (sent.priority, sent.tenant, sent.tenant_weight) == (priority, tenant, weight)


def test_tokens_per_minute_counts_prompt_and_output_and_refuses_past_it(server):
    base_url, _ = server
    # 30 tokens a minute: one request (its prompt and 40 output tokens) uses more than all of it.
    assert _completion(base_url, "sk-batch", max_tokens=40, ignore_eos=True).status_code == 200
    refused = _completion(base_url, "sk-batch")
    assert refused.status_code == 429 and "tokens per minute" in refused.json()["error"]["message"]
    assert _completion(base_url, "sk-chat-1").status_code == 200
    # The refusals are on /metrics by tenant and quota (the concurrency one by the test that ran before).
    text = httpx.get(base_url + "/metrics", timeout=30).text
    assert 'pagerail_tenant_refused_requests_total{quota="tokens_per_minute",tenant="batch"} 1.0' in text
    assert 'quota="tokens_per_minute",tenant="chat"' not in text


def test_the_service_tier_reaches_the_engine_and_an_unknown_one_is_refused_naming_the_field(server):
    base_url, engine = server
    for tier, sent in (("flex", "flex"), ("auto", "default"), ("default", "default"), (None, "default")):
        assert _completion(base_url, "nobody", service_tier=tier).status_code == 200
        assert engine.requests[-1].service_tier == sent
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "service_tier": "flex"}
    assert httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    assert engine.requests[-1].service_tier == "flex"
    refused = _completion(base_url, "nobody", service_tier="scale")
    assert refused.status_code == 400 and "service_tier" in refused.json()["error"]["message"]


def test_quotas_hold_across_data_parallel_replicas(smollm2_dir):
    """The one frontend in front of the router counts a tenant's requests over every replica: with `chat` at its
    concurrency on one replica, its next request is refused though the other replica is idle; another tenant's
    request is routed and served meanwhile."""
    from transformers import AutoTokenizer

    from pagerail.cluster.routing.routed_client import RoutedEngineClient

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    fakes = {name: FakeEngineClient(vocab_size=len(tokenizer), step_delay_s=0.01) for name in ("r0", "r1")}
    routed = RoutedEngineClient(fakes, policy="round-robin")
    settings = FrontendSettings("fake", tenants=parse_tenants(GOOD))
    with BackgroundServer(create_app(ServerState(routed, tokenizer, settings))) as base_url:
        for fake in fakes.values():
            fake.paused = True
        first = threading.Thread(target=_completion, args=(base_url, "sk-chat-1"))
        first.start()
        try:
            for _ in range(500):
                if any(fake.requests for fake in fakes.values()):
                    break
                threading.Event().wait(0.01)
            (busy,) = [name for name, fake in fakes.items() if fake.requests]
            refused = _completion(base_url, "sk-chat-2")
            assert refused.status_code == 429 and "max_concurrency" in refused.json()["error"]["message"]
            for fake in fakes.values():
                fake.paused = False
            assert _completion(base_url, "nobody").status_code == 200
            served_on = [name for name, fake in fakes.items() if any(r.tenant == "default" for r in fake.requests)]
            assert served_on == [name for name in fakes if name != busy]  # the replica chat's request left idle
        finally:
            for fake in fakes.values():
                fake.paused = False
            first.join(timeout=30)


def test_responses_and_messages_take_a_priority_and_the_tenants_default(server):
    base_url, engine = server
    headers = {"Authorization": "Bearer sk-chat-2"}
    response = {"model": "fake", "input": "hi", "max_output_tokens": 2}
    assert httpx.post(base_url + "/v1/responses", json=response, headers=headers, timeout=30).status_code == 200
    assert (engine.requests[-1].priority, engine.requests[-1].tenant) == (-1, "chat")
    explicit = {**response, "priority": 6, "service_tier": "flex"}
    assert httpx.post(base_url + "/v1/responses", json=explicit, headers=headers, timeout=30).status_code == 200
    assert (engine.requests[-1].priority, engine.requests[-1].service_tier) == (6, "flex")
    message = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "priority": 2}
    assert httpx.post(base_url + "/v1/messages", json=message, timeout=30).status_code == 200
    assert (engine.requests[-1].priority, engine.requests[-1].tenant) == (2, "default")
    bad = httpx.post(base_url + "/v1/responses", json={**response, "priority": "high"}, timeout=30)
    assert bad.status_code == 400 and "priority" in bad.json()["error"]["message"]


def test_every_engine_request_made_for_a_call_takes_the_callers_tenant():
    """Not only a route's choices: an embedding's inputs (made by the engine-side helper) run as the tenant the
    frontend set for the call; outside any call, requests are the `default` tenant's."""
    import asyncio

    from pagerail.cluster.core.embedding import pooled_vectors
    from pagerail.cluster.core.engine_request import CALLER_TENANT, EngineRequest
    from pagerail.common.sampling_params import SamplingParams

    engine = FakeEngineClient()

    async def as_batch() -> None:
        caller = CALLER_TENANT.set(("batch", 0.5))
        try:
            await pooled_vectors(engine, [[1, 2], [3, 4, 5]], "last", "emb")
        finally:
            CALLER_TENANT.reset(caller)

    asyncio.run(as_batch())
    assert [(r.tenant, r.tenant_weight) for r in engine.requests] == [("batch", 0.5), ("batch", 0.5)]
    outside = EngineRequest("outside", [1], SamplingParams())
    assert (outside.tenant, outside.tenant_weight) == ("default", 1.0)
