"""The front doors under hostile or careless clients: admin key, streamed body limit, disconnects, client trace
sampling, TLS on the public gRPC port, and secrets kept out of reprs."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

from pagerail.cluster.frontend.grpc_api import build_grpc_server
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.server import FrontendServer
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.common import telemetry
from pagerail.common.tls import ServerTls
from pagerail.proto import api_pb2, api_pb2_grpc
from tests.fake_engine import FakeEngineClient
from tests.http_server import BackgroundServer
from tests.test_worker_server import make_certificates

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-inference"
ADMIN_KEY = "sk-admin"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


async def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagerail") as client:
        return await client.request(method, path, **kwargs)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# -- admin routes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("api_key", [None, KEY], ids=["no-keys", "inference-key-only"])
def test_admin_routes_are_off_without_an_admin_key(api_key):
    engine = FakeEngineClient()
    app = create_app(ServerState(engine, None, FrontendSettings("fake", api_key=api_key)))
    for headers in ({}, bearer(KEY)):
        for path in ("/pause?mode=all", "/resume"):
            assert_openai_error(asyncio.run(call(app, "POST", path, headers=headers)), 404)
    assert not engine.paused


def test_admin_routes_take_the_admin_key_and_never_the_inference_key():
    engine = FakeEngineClient()
    app = create_app(ServerState(engine, None, FrontendSettings("fake", api_key=KEY, admin_api_key=ADMIN_KEY)))
    for headers in ({}, bearer(KEY), bearer(ADMIN_KEY + "x"), {"Authorization": ADMIN_KEY}):
        error = assert_openai_error(asyncio.run(call(app, "POST", "/pause?mode=all", headers=headers)), 401)
        assert ADMIN_KEY not in error["message"]
    assert not engine.paused
    assert asyncio.run(call(app, "POST", "/pause?mode=all", headers=bearer(ADMIN_KEY))).status_code == 200
    assert engine.paused
    assert asyncio.run(call(app, "POST", "/resume", headers=bearer(KEY))).status_code == 401 and engine.paused
    assert asyncio.run(call(app, "POST", "/resume", headers=bearer(ADMIN_KEY))).status_code == 200
    assert not engine.paused
    # The admin key is no inference key either.
    models = asyncio.run(call(app, "GET", "/v1/models", headers=bearer(ADMIN_KEY)))
    assert models.status_code == 401


# -- body limit on the stream ----------------------------------------------------------------------


def test_chunked_body_over_the_limit_is_refused_before_it_is_read_whole():
    limit, chunk, chunks = 64 << 10, 1 << 10, 1024  # a 1 MiB body against a 64 KiB limit
    pulled = 0

    async def body():
        nonlocal pulled
        for _ in range(chunks):
            pulled += 1
            yield b" " * chunk

    app = create_app(ServerState(FakeEngineClient(), None, FrontendSettings("fake", max_body_bytes=limit)))
    response = asyncio.run(call(app, "POST", "/v1/completions", content=body()))
    assert assert_openai_error(response, 413)["code"] == "request_too_large"
    assert pulled <= limit // chunk + 1, f"{pulled} of {chunks} chunks were read"


def test_chunked_body_over_the_limit_gets_413_from_a_real_server_while_the_client_still_sends():
    limit = 16 << 10
    app = create_app(ServerState(FakeEngineClient(), None, FrontendSettings("fake", max_body_bytes=limit)))
    with BackgroundServer(app) as base_url:
        port = int(base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: pagerail\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            piece = b" " * 4096
            for _ in range(limit // len(piece) + 2):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            # The body is never terminated: the answer can only come from counting what arrived.
            reply = b""
            while b"\r\n\r\n" not in reply:
                data = sock.recv(65536)
                assert data, "the server closed the connection without an answer"
                reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


# -- disconnects -----------------------------------------------------------------------------------


class AbandonCountingEngine(FakeEngineClient):
    """The fake engine, recording (like the head client does by aborting) every request whose stream was closed
    before it finished, and how many tokens it had produced by then."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.abandoned: dict[str, int] = {}
        self.finished: dict[str, int] = {}

    async def generate(self, request):
        produced, done = 0, False
        try:
            async for delta in super().generate(request):
                produced, done = delta.num_output_tokens, delta.finished
                yield delta
        finally:
            (self.finished if done else self.abandoned)[request.request_id] = produced


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [5, 6, 7]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
    ids=["completions", "chat"],
)
def test_non_streaming_request_is_aborted_when_its_client_disconnects(tokenizer, path, body):
    max_tokens = 200
    engine = AbandonCountingEngine(vocab_size=len(tokenizer), step_delay_s=0.01)
    body = {"model": "fake", "max_tokens": max_tokens, "ignore_eos": True, **body}
    with BackgroundServer(create_app(ServerState(engine, tokenizer, FrontendSettings("fake")))) as base_url:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(base_url + path, json=body, timeout=0.3)  # gives up, closing its connection
        deadline = time.monotonic() + 30
        while not (engine.abandoned or engine.finished) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not engine.finished, f"generated to the end for a client that was gone: {engine.finished}"
    ((_, produced),) = engine.abandoned.items()
    assert produced < max_tokens // 2, f"aborted only after {produced} of {max_tokens} tokens"
    assert not engine.active


def test_non_streaming_request_still_completes_for_a_patient_client(tokenizer):
    engine = AbandonCountingEngine(vocab_size=len(tokenizer), step_delay_s=0.001)
    body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True, "n": 2}
    with BackgroundServer(create_app(ServerState(engine, tokenizer, FrontendSettings("fake")))) as base_url:
        reply = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 40
    assert not engine.abandoned and set(engine.finished.values()) == {20}


# -- client trace sampling -------------------------------------------------------------------------

_TRACE_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys

    import httpx
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from transformers import AutoTokenizer

    from pagerail.cluster.frontend import tracing
    from pagerail.cluster.frontend.http_app import ServerState, create_app
    from pagerail.cluster.frontend.server import configure_frontend_tracing
    from pagerail.cluster.frontend.settings import FrontendSettings
    from tests.fake_engine import FakeEngineClient
    from pagerail.common import telemetry

    ratio, respect, tokenizer_dir, traceparent = float(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], sys.argv[4]
    exporter = InMemorySpanExporter()
    settings = FrontendSettings("fake", trace_sampling_ratio=ratio, trace_respect_client_sampling=respect)
    assert configure_frontend_tracing(settings, exporter=exporter)
    carriers = []

    class Recording(FakeEngineClient):
        def generate(self, request):
            carriers.append(request.trace_context)
            return super().generate(request)

    async def main():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        app = create_app(ServerState(Recording(vocab_size=len(tokenizer)), tokenizer, settings))
        body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagerail") as client:
            reply = await client.post("/v1/completions", json=body, headers={"traceparent": traceparent})
            assert reply.status_code == 200, reply.text

    asyncio.run(main())
    span = tracing.start_grpc_span("Generate", [("traceparent", traceparent)])
    grpc_context = span.get_span_context()
    tracing.end_grpc_span(span, None)
    assert telemetry.flush()
    spans = [(s.name, format(s.context.trace_id, "032x")) for s in exporter.get_finished_spans()]
    grpc_trace = [format(grpc_context.trace_id, "032x"), grpc_context.trace_flags.sampled]
    print(json.dumps({"spans": spans, "carriers": carriers, "grpc": grpc_trace}))
    """
)

HTTP_SPAN, GRPC_SPAN = "POST /v1/completions", "pagerail.api.Generation/Generate"


# id: (server ratio, --trace-respect-client-sampling, the client's sampled flag, whether the trace is kept)
TRACE_CASES = {
    "server-decides-drop": (0.0, False, "01", False),  # default: a sampled client does not force tracing on
    "client-decides": (0.0, True, "01", True),  # --trace-respect-client-sampling: it does
    "server-decides-keep": (1.0, False, "00", True),  # and an unsampled client does not turn it off
}


def start_frontend_traces(smollm2_dir, ratio: float, respect: bool, traceparent: str) -> subprocess.Popen:
    """Start one frontend process tracing into memory; it prints what it exported and what it handed the engine."""
    argv = [str(ratio), "1" if respect else "0", str(smollm2_dir), traceparent]
    return subprocess.Popen(
        [sys.executable, "-c", _TRACE_SCRIPT, *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def trace_children(smollm2_dir):
    """Every case's child interpreter (tracing is configured once per process), started at once: each spends its
    seconds importing, and they overlap instead of running one after the other. Case id: (trace id, process)."""
    children = {}
    for case, (ratio, respect, client_flag, _) in TRACE_CASES.items():
        trace_id = uuid.uuid4().hex
        traceparent = f"00-{trace_id}-00f067aa0ba902b7-{client_flag}"
        children[case] = (trace_id, start_frontend_traces(smollm2_dir, ratio, respect, traceparent))
    yield children
    for _, process in children.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.slow  # a child interpreter per case
@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_server_ratio_decides_for_client_traces_unless_told_to_respect_them(trace_children, case):
    kept = TRACE_CASES[case][3]
    trace_id, process = trace_children[case]
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    if kept:
        assert sorted(result["spans"]) == sorted([[HTTP_SPAN, trace_id], [GRPC_SPAN, trace_id]])
    else:
        assert result["spans"] == []
    # The client's trace id goes on either way; the engine (head, ranks) follows the frontend's decision.
    ((carrier),) = result["carriers"]
    version, carried_trace, _, flags = carrier["traceparent"].split("-")
    assert (carried_trace, flags) == (trace_id, "01" if kept else "00")
    assert result["grpc"] == [trace_id, kept]


def test_internal_processes_follow_the_remote_parents_decision():
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.sampling import Decision
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    trace_id = uuid.uuid4().int

    def decision(ratio: float, respect: bool, sampled: bool) -> Decision:
        parent = SpanContext(trace_id, 0xF067AA0BA902B7, is_remote=True, trace_flags=TraceFlags(int(sampled)))
        context = set_span_in_context(NonRecordingSpan(parent), Context())
        sampler = telemetry.make_sampler(ratio, respect_remote_sampling=respect)
        return sampler.should_sample(context, trace_id, "s").decision

    # Head and workers: a trace is kept or dropped whole, whatever their own ratio says.
    assert decision(0.0, True, sampled=True) == Decision.RECORD_AND_SAMPLE
    assert decision(1.0, True, sampled=False) == Decision.DROP
    # The frontend facing clients: its own ratio decides.
    assert decision(0.0, False, sampled=True) == Decision.DROP
    assert decision(1.0, False, sampled=False) == Decision.RECORD_AND_SAMPLE


# -- TLS on the public gRPC port, and secrets in reprs ---------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("tls"))


def get_model_info(port: int, credentials: grpc.ChannelCredentials | None) -> api_pb2.ModelInfo:
    target = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        return api_pb2_grpc.GenerationStub(channel).GetModelInfo(api_pb2.ModelInfoRequest(), timeout=5)


async def serve_grpc(tls: ServerTls, check) -> None:
    server, port = build_grpc_server(FakeEngineClient(model_name="fake"), None, port=0, tls=tls)
    await server.start()
    try:
        await asyncio.to_thread(check, port)
    finally:
        await server.stop(None)


def test_grpc_tls_serves_clients_that_trust_its_ca_and_refuses_plaintext(certificates):
    cert, key, ca = certificates

    def check(port: int) -> None:
        assert get_model_info(port, grpc.ssl_channel_credentials(ca.read_bytes())).model_name == "fake"
        with pytest.raises(grpc.RpcError) as caught:
            get_model_info(port, None)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(serve_grpc(ServerTls.from_files(cert, key), check))


def test_grpc_tls_with_a_client_ca_requires_client_certificates(certificates):
    cert, key, ca = certificates
    trust_only = grpc.ssl_channel_credentials(ca.read_bytes())
    # The test CA signed one certificate usable by both ends.
    with_cert = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())

    def check(port: int) -> None:
        assert get_model_info(port, with_cert).model_name == "fake"
        with pytest.raises(grpc.RpcError) as caught:
            get_model_info(port, trust_only)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(serve_grpc(ServerTls.from_files(cert, key, client_ca=ca), check))


def test_server_tls_refuses_what_is_not_pem(tmp_path, certificates):
    cert, key, _ = certificates
    (tmp_path / "junk").write_text("not a certificate")
    with pytest.raises(ValueError, match="not PEM"):
        ServerTls.from_files(cert, tmp_path / "junk")
    with pytest.raises(ValueError, match="cannot read"):
        ServerTls.from_files(tmp_path / "missing", key)


def test_frontend_settings_repr_hides_the_keys(certificates):
    settings = FrontendSettings(
        "fake", api_key="sk-secret", admin_api_key="sk-admin-secret", grpc_tls=ServerTls.from_files(*certificates[:2])
    )
    text = repr(settings)
    assert "sk-secret" not in text and "sk-admin-secret" not in text and "PRIVATE KEY" not in text
    assert "fake" in text
    state = ServerState(
        FakeEngineClient(), None, FrontendSettings("fake", api_key="sk-secret", admin_api_key="sk-admin-secret")
    )
    assert "sk-secret" not in repr(state) and "sk-admin-secret" not in repr(state)


def test_frontend_server_wires_the_admin_key_and_grpc_tls(certificates):
    cert, key, ca = certificates
    settings = FrontendSettings(
        "fake", port=0, grpc_port=0, api_key=KEY, admin_api_key=ADMIN_KEY, grpc_tls=ServerTls.from_files(cert, key)
    )

    async def run() -> None:
        engine = FakeEngineClient(model_name="fake")
        server = FrontendServer(engine, None, settings)
        ports = await server.start()
        try:
            base = f"http://127.0.0.1:{ports['http_port']}"
            async with httpx.AsyncClient(base_url=base) as client:
                assert (await client.post("/pause", headers=bearer(KEY))).status_code == 401
                assert (await client.post("/pause", headers=bearer(ADMIN_KEY))).status_code == 200 and engine.paused
            credentials = grpc.ssl_channel_credentials(ca.read_bytes())
            metadata = (("authorization", f"Bearer {KEY}"),)

            def model_name() -> str:
                with grpc.secure_channel(f"127.0.0.1:{ports['grpc_port']}", credentials) as channel:
                    stub = api_pb2_grpc.GenerationStub(channel)
                    return stub.GetModelInfo(api_pb2.ModelInfoRequest(), metadata=metadata, timeout=5).model_name

            assert await asyncio.to_thread(model_name) == "fake"
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(run(), timeout=60))


# -- serve flags -----------------------------------------------------------------------------------


def test_serve_flags_for_the_front_door(monkeypatch, certificates):
    from pagerail.cluster.entrypoints.serve import add_serve_arguments

    monkeypatch.setenv("PAGERAIL_ADMIN_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    defaults = parser.parse_args([])
    assert defaults.admin_api_key == "from-env" and defaults.trace_respect_client_sampling is False
    assert defaults.grpc_tls_cert is None and defaults.grpc_tls_key is None and defaults.grpc_tls_client_ca is None
    cert, key, ca = (str(path) for path in certificates)
    args = parser.parse_args(
        ["--admin-api-key", "adm", "--trace-respect-client-sampling", "--grpc-tls-cert", cert, "--grpc-tls-key", key,
         "--grpc-tls-client-ca", ca]
    )  # fmt: skip
    assert (args.admin_api_key, args.trace_respect_client_sampling) == ("adm", True)
    assert (args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_client_ca) == (cert, key, ca)


def test_serve_refuses_half_a_tls_pair_before_starting_anything(capsys, certificates):
    from pagerail.cluster.cli import main

    assert main(["serve", "--grpc-tls-cert", str(certificates[0])]) == 2
    assert "--grpc-tls-key" in capsys.readouterr().err
    assert main(["serve", "--grpc-tls-client-ca", str(certificates[2])]) == 2
    assert "--grpc-tls-cert" in capsys.readouterr().err
