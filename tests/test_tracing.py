"""Traces: no-op when off; gRPC Generate's request span; one chat request traced from HTTP to two ranks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
import uuid

import grpc
import httpx
import pytest
from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from pagerail.common import telemetry
from pagerail.common.engine_config import ObservabilityConfig
from pagerail.proto import api_pb2, api_pb2_grpc
from tests.fake_engine import FakeEngineClient
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.ray_start import start_ray
from tests.requirements import require_module

CALLER_SPAN_ID = "00f067aa0ba902b7"


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{CALLER_SPAN_ID}-01"


@pytest.fixture(scope="module")
def receiver():
    """This process traces as the frontend into an in-test OTLP receiver; afterwards its spans are dropped."""
    receiver = OtlpReceiver()
    receiver.start()
    assert telemetry.configure_tracing("frontend", endpoint=receiver.endpoint)
    yield receiver
    trace.get_tracer_provider().shutdown()  # flushes, then drops later spans
    receiver.stop()


def exported(receiver: OtlpReceiver, trace_id: str, name: str, timeout_s: float = 10.0) -> list[ReceivedSpan]:
    """The spans of `trace_id`, flushing this process until one called `name` is among them."""
    # A request span ends just after the reply's last byte, so one flush may come too early.
    deadline = time.monotonic() + timeout_s
    while True:
        telemetry.flush()
        spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
        if any(s.name == name for s in spans):
            return spans
        assert time.monotonic() < deadline, f"no {name} span was exported"
        time.sleep(0.05)


def test_tracing_off_installs_nothing_and_spans_are_noops():
    # A fresh interpreter: this one traces once the receiver fixture ran.
    script = textwrap.dedent(
        """
        import sys
        from opentelemetry import trace
        from pagerail.common import telemetry
        from pagerail.cluster.core.step_tracing import start_step_span
        from pagerail.cluster.core.scheduler_output import SchedulerOutput

        assert telemetry.configure_tracing("head", endpoint=None) is False
        assert not telemetry.tracing_enabled()
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        span = telemetry.get_tracer("t").start_span("s")
        assert not span.is_recording() and not span.get_span_context().is_valid
        assert start_step_span(SchedulerOutput(), 0) is trace.INVALID_SPAN
        assert telemetry.inject_carrier() is None
        assert telemetry.flush()
        assert "opentelemetry.sdk.trace" not in sys.modules, "tracing off must not load the SDK"
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


def test_context_round_trips_through_grpc_metadata():
    trace_id = uuid.uuid4().hex
    caller = SpanContext(int(trace_id, 16), int(CALLER_SPAN_ID, 16), is_remote=True, trace_flags=TraceFlags(1))
    metadata = list(telemetry.inject_carrier(trace.set_span_in_context(NonRecordingSpan(caller))).items())
    assert metadata == [("traceparent", traceparent(trace_id))]
    extracted = trace.get_current_span(telemetry.extract_metadata([("authorization", "Bearer x"), *metadata]))
    assert extracted.get_span_context() == caller


def test_observability_config_is_validated():
    with pytest.raises(ValueError, match="trace_sampling_ratio"):
        ObservabilityConfig(trace_sampling_ratio=1.5)
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ObservabilityConfig(otlp_traces_endpoint=" ")
    with pytest.raises(ValueError, match="sampling ratio"):
        telemetry.configure_tracing("head", endpoint=None, sampling_ratio=-0.1)


def test_serve_flags_reach_the_config(capsys):
    from pagerail.cluster.cli import build_parser, main

    args = build_parser().parse_args(
        ["serve", "--otlp-traces-endpoint", "http://c:4317", "--trace-sampling-ratio", "0.25"]
    )
    assert (args.otlp_traces_endpoint, args.trace_sampling_ratio) == ("http://c:4317", 0.25)
    assert main(["serve", "--trace-sampling-ratio", "2"]) == 2  # refused before anything starts
    assert "trace_sampling_ratio" in capsys.readouterr().err


def test_exporter_follows_the_standard_protocol_variable(monkeypatch):
    monkeypatch.delenv(telemetry.PROTOCOL_ENV, raising=False)
    assert "proto.grpc" in type(telemetry.otlp_exporter("http://127.0.0.1:4317")).__module__
    monkeypatch.setenv(telemetry.PROTOCOL_ENV, "http/protobuf")
    exporter = telemetry.otlp_exporter("http://127.0.0.1:4318")
    assert "proto.http" in type(exporter).__module__ and exporter._endpoint == "http://127.0.0.1:4318/v1/traces"
    monkeypatch.setenv(telemetry.PROTOCOL_ENV, "thrift")
    with pytest.raises(ValueError, match="http/protobuf"):
        telemetry.otlp_exporter("http://127.0.0.1:4318")


class CarrierRecordingEngine(FakeEngineClient):
    """The fake engine, remembering the trace context each request brought."""

    def __init__(self) -> None:
        super().__init__()
        self.trace_contexts: list[dict | None] = []

    def generate(self, request):
        self.trace_contexts.append(request.trace_context)
        return super().generate(request)


def test_grpc_generate_span_continues_the_callers_trace(receiver):
    from pagerail.cluster.frontend.grpc_api import build_grpc_server

    engine, trace_id = CarrierRecordingEngine(), uuid.uuid4().hex

    async def generate() -> list[api_pb2.GenerateResponse]:
        server, port = build_grpc_server(engine, None, host="127.0.0.1", port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                request = api_pb2.GenerateRequest(
                    request_id="traced",
                    token_ids=api_pb2.TokenIds(ids=[5, 6, 7]),
                    sampling_params=api_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
                )
                call = api_pb2_grpc.GenerationStub(channel).Generate(
                    request, metadata=(("traceparent", traceparent(trace_id)),)
                )
                return [response async for response in call]
        finally:
            await server.stop(None)

    responses = asyncio.run(asyncio.wait_for(generate(), timeout=10))
    (span,) = exported(receiver, trace_id, "pagerail.api.Generation/Generate")
    assert span.parent_span_id == CALLER_SPAN_ID and span.kind == ProtoSpan.SPAN_KIND_SERVER
    assert span.attributes["gen_ai.request.id"] == "traced" and span.attributes["gen_ai.request.max_tokens"] == 3
    assert span.attributes["gen_ai.usage.output_tokens"] == responses[-1].usage.completion_tokens == 3
    assert span.attributes["gen_ai.usage.input_tokens"] == 3 and span.attributes["rpc.grpc.status_code"] == 0
    assert span.attributes["pagerail.tenant"] == "default" and span.attributes["pagerail.priority"] == 0
    assert [name for name, _ in span.events] == ["queued", "first_token", "finished"]
    # The engine got the request span's own context, for the head's step spans to link to.
    assert engine.trace_contexts == [{"traceparent": f"00-{trace_id}-{span.span_id}-01"}]


def test_streamed_http_request_span_covers_every_choice(receiver, smollm2_dir):
    from transformers import AutoTokenizer

    from pagerail.cluster.frontend.http_app import ServerState, create_app
    from pagerail.cluster.frontend.settings import FrontendSettings
    from tests.http_server import BackgroundServer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    engine, trace_id = CarrierRecordingEngine(), uuid.uuid4().hex
    engine.vocab_size = len(tokenizer)
    body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "stream": True, "ignore_eos": True}
    body["priority"] = 4
    with BackgroundServer(create_app(ServerState(engine, tokenizer, FrontendSettings("fake")))) as base_url:
        with httpx.stream(
            "POST", f"{base_url}/v1/completions", json=body, headers={"traceparent": traceparent(trace_id)}
        ) as reply:
            assert reply.status_code == 200 and reply.read().endswith(b"data: [DONE]\n\n")
        (span,) = exported(receiver, trace_id, "POST /v1/completions")
    assert span.parent_span_id == CALLER_SPAN_ID and span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["gen_ai.request.n"] == 2 and span.attributes["http.response.status_code"] == 200
    assert span.attributes["pagerail.tenant"] == "default" and span.attributes["pagerail.priority"] == 4
    assert span.attributes["gen_ai.usage.input_tokens"] == 3 and span.attributes["gen_ai.usage.output_tokens"] == 6
    names = [name for name, _ in span.events]
    assert names.count("queued") == names.count("first_token") == names.count("finished") == 2
    # Both choices carry the same request span to the engine.
    assert engine.trace_contexts == [{"traceparent": f"00-{trace_id}-{span.span_id}-01"}] * 2


@pytest.mark.slow
def test_one_trace_from_http_through_head_to_both_ranks(receiver, tmp_path):
    ray = require_module("ray", "needs Ray")
    from transformers import AutoTokenizer

    from pagerail.cluster.distributed.cluster_options import ClusterOptions
    from pagerail.cluster.distributed.head_client import HeadEngineClient
    from pagerail.cluster.distributed.launcher import start_heads
    from pagerail.cluster.frontend.http_app import ServerState, create_app
    from pagerail.cluster.frontend.settings import FrontendSettings
    from pagerail.common.engine_config import CacheConfig, EngineConfig
    from pagerail.common.model_source import resolve_model_dir
    from tests.http_server import BackgroundServer
    from tests.tiny_models import make_tiny_model

    trace_id = uuid.uuid4().hex
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    # The embedded model's tokenizer renders the chat; a tiny model with its vocabulary answers it.
    model_dir = make_tiny_model("llama", tmp_path / "llama", vocab_size=len(tokenizer))
    start_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    head = None
    try:
        config = EngineConfig(
            model=str(model_dir),
            tensor_parallel_size=2,
            cache=CacheConfig(block_size=4, num_gpu_blocks=64),
            observability=ObservabilityConfig(otlp_traces_endpoint=receiver.endpoint),
        )
        head = start_heads(config, ClusterOptions(), [f"trace-head-{uuid.uuid4().hex[:8]}"])[0]
        info = ray.get(head.model_info.remote())
        engine = HeadEngineClient(head, "tiny", info)
        with BackgroundServer(create_app(ServerState(engine, tokenizer, FrontendSettings("tiny")))) as base_url:
            reply = httpx.post(
                f"{base_url}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
                headers={"traceparent": traceparent(trace_id)},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            usage = reply.json()["usage"]
            exported(receiver, trace_id, "POST /v1/chat/completions")
        assert ray.get(head.flush_traces.remote())
        spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
    finally:
        if head is not None:
            ray.get(head.shutdown.remote())
            ray.kill(head, no_restart=True)
        ray.shutdown()

    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    ids = {span.span_id: span for span in spans}

    # One trace over four processes: the frontend (this one), the head and both ranks.
    assert {s.resource["service.name"] for s in spans} == {"frontend", "head", "worker"}
    assert len({s.resource["process.pid"] for s in spans}) == 4
    assert all(s.resource.get("service.instance.id") for s in spans)

    (request,) = by_name["POST /v1/chat/completions"]
    assert request.parent_span_id == CALLER_SPAN_ID and request.kind == ProtoSpan.SPAN_KIND_SERVER
    assert request.resource["service.name"] == "frontend"
    attributes = request.attributes
    assert attributes["gen_ai.request.model"] == "tiny" and attributes["gen_ai.request.max_tokens"] == 4
    assert attributes["gen_ai.request.id"].startswith("chatcmpl-") and attributes["gen_ai.request.n"] == 1
    assert "gen_ai.request.temperature" in attributes and "gen_ai.request.top_p" in attributes
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["pagerail.usage.cached_tokens"] == 0
    assert [name for name, _ in request.events] == ["queued", "first_token", "finished"]

    steps = by_name["engine.step"]
    assert steps and all(s.resource["service.name"] == "head" for s in steps)
    for step in steps:
        # A lone request's steps are its children, and linked to it like every step is.
        assert step.parent_span_id == request.span_id
        assert (trace_id, request.span_id) in [(link_trace, link_span) for link_trace, link_span, _ in step.links]
    assert any(name == "scheduled" for step in steps for name, _ in step.events)
    for name in ("schedule", "dispatch"):
        assert by_name[name] and all(ids[s.parent_span_id].name == "engine.step" for s in by_name[name])

    executes = by_name["ExecuteStep"]
    assert all(ids[s.parent_span_id].name == "dispatch" for s in executes)
    assert {s.resource[telemetry.RANK_ATTRIBUTE] for s in executes} == {0, 1}
    assert len(executes) == 2 * len(by_name["dispatch"])
    for name in ("prepare_inputs", "forward", "sample"):
        assert by_name[name] and all(ids[s.parent_span_id].name == "ExecuteStep" for s in by_name[name])
    assert {s.resource[telemetry.RANK_ATTRIBUTE] for s in by_name["sample"]} == {0}  # only rank 0 samples
