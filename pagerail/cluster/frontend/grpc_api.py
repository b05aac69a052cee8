"""The public gRPC API: the Generation service over an EngineClient, plus health, reflection and API keys."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from pagerail.cluster.core.beam_search import BeamSearchParams, beam_search
from pagerail.cluster.core.engine_client import EngineClient, RequestDelta
from pagerail.cluster.core.engine_request import CALLER_TENANT, EngineRequest, engine_service_tier
from pagerail.cluster.frontend import tracing
from pagerail.cluster.frontend.bad_words import with_bad_words
from pagerail.cluster.frontend.constraints import check_constraint_of
from pagerail.cluster.frontend.grpc_convert import (
    RpcError,
    constraint_field,
    numeric_stats,
    prompt_token_logprobs,
    sampling_params_from_proto,
    status_on_error,
    token_logprobs,
    usage,
)
from pagerail.cluster.frontend.grpc_guards import ApiKeyInterceptor, EngineHealth
from pagerail.cluster.frontend.grpc_responses import response_message, responses_request
from pagerail.cluster.frontend.lora_modules import LoRAModules
from pagerail.cluster.frontend.output_processor import ChoiceState, fan_out
from pagerail.cluster.frontend.responses_api import ResponseStore, not_found_response, respond_whole
from pagerail.cluster.frontend.tenant_quotas import MeteredEngine, TenantQuotas
from pagerail.cluster.frontend.tenants import NO_TENANTS, Tenant, Tenants
from pagerail.common.auth import bearer_token
from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import MAX_N, SamplingParams, truncate_prompt
from pagerail.common.tls import ServerTls
from pagerail.proto import api_pb2, api_pb2_grpc

# How each kind of engine failure reaches a gRPC caller; anything else is UNAVAILABLE (retriable).
_ERROR_CODES = {
    "session_idle_timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "quarantined": grpc.StatusCode.ABORTED,
}
GENERATION_SERVICE = api_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_REQUEST_ID_LEN = 256


@dataclass
class _Choice:
    """One of a stream's n choices: its engine request and how far it got."""

    index: int
    request: EngineRequest  # its id is always made here: callers can never name another caller's request
    state: ChoiceState | None = None  # created with the first delta: a session's prompt is complete only then
    last: RequestDelta | None = None
    finished: bool = False  # the client got this choice's last message
    engine_done: bool = False  # the engine finished it or was told to abort it: nothing left to free

    @property
    def engine_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params  # the request's, with this choice's seed


@dataclass
class _Stream:
    """One call streaming from this server: its choices, and where their deltas arrive."""

    request_id: str  # the caller's label (its own request_id, or one made here), echoed in every response
    engine_id: str  # names the call's engine requests (one per choice)
    prompt_ids: list[int]  # grows with each chunk of a streaming-input session
    params: SamplingParams
    send_text: bool
    lora: LoRARequest | None = None  # the adapter its lora_name picked
    priority: int = 0  # its scheduling priority (Generate's priority field, else its tenant's default)
    service_tier: str = "default"  # "flex": batch work that only fills spare capacity
    tenant: Tenant = NO_TENANTS.default  # whose call it is (the caller's key), for quotas and fair share
    engine: EngineClient | None = None  # the call's engine client: its tokens counted against the tenant's rate
    choices: list[_Choice] = field(default_factory=list)  # one per `n`, made when the stream starts
    # (choice, RequestDelta), or the exception that ended the call.
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    span: trace.Span = trace.INVALID_SPAN  # the call's request span (Generate only)

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)


class GenerationServicer(api_pb2_grpc.GenerationServicer):
    """pagerail.api.Generation over one engine replica; tokenization, detokenization and stop strings live here."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any | None,
        responses: ResponseStore | None = None,
        tool_call_parser: str | None = None,
        lora_modules: LoRAModules | None = None,
        tenants: Tenants = NO_TENANTS,
        quotas: TenantQuotas | None = None,
    ) -> None:
        self.engine = engine
        # Callers' tenants by their key, and each tenant's requests in flight and tokens (the HTTP API's when both
        # serve one frontend: one count per tenant).
        self.tenants = tenants
        self.quotas = quotas if quotas is not None else TenantQuotas()
        self.lora_modules = lora_modules  # the HTTP API's adapters by name; None without --enable-lora
        self.tokenizer = tokenizer
        # Kept Responses API responses: the HTTP API's store when both serve one frontend.
        self.responses = responses if responses is not None else ResponseStore()
        self.tool_call_parser = tool_call_parser
        # Keyed by (connection, the caller's request_id): a request_id is unique on its connection only.
        self._streams: dict[tuple[str, str], _Stream] = {}
        self._started = time.monotonic()

    async def Generate(self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        # Not made current: this generator's frames may resume in other contexts; the span travels on the stream.
        span = tracing.start_grpc_span("Generate", context.invocation_metadata())
        try:
            async with status_on_error(context):
                if request.WhichOneof("input") is None:
                    raise ValueError("input: set text or token_ids")
                if request.HasField("beam_search"):
                    async for response in self._beam_search(request, context):
                        yield response
                    return
                stream = self._new_stream(request)
                stream.lora = self._adapter(request.lora_name)
                tenant = stream.tenant = self.tenants.of_key(_caller_key(context))
                stream.priority = tenant.priority_for(request.priority if request.HasField("priority") else None)
                stream.service_tier = engine_service_tier(request.service_tier)
                tracing.annotate_adapter(span, stream.lora)
                tracing.annotate_tenant(span, tenant.name, stream.priority, stream.service_tier)
                best_of = self._best_of(request, stream)
                # Compiled against the tokenizer before anything is queued: a bad constraint never reaches the engine.
                await check_constraint_of(
                    stream.params, self.tokenizer, self.engine.vocab_size, constraint_field(request.sampling_params)
                )
                stream.span = span
                tracing.annotate_request(span, stream.request_id, self.engine.model_name, stream.params)
                with self._as_tenant(tenant) as stream.engine:
                    if best_of is not None:
                        for response in await self._best_n(stream, context, *best_of):
                            yield response
                        return
                    async for response in self._run(stream, context):
                        yield response
        finally:
            tracing.end_grpc_span(span, context.code())

    async def CreateResponse(self, request: api_pb2.ResponseRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        span = tracing.start_grpc_span("CreateResponse", context.invocation_metadata())
        try:
            with trace.use_span(span, end_on_exit=False):
                async with status_on_error(context):
                    if self.tokenizer is None:
                        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "this server has no tokenizer for chats")
                    body = responses_request(request)
                    tenant = self.tenants.of_key(_caller_key(context))
                    body.priority = tenant.priority_for(body.priority)
                    tracing.annotate_tenant(span, tenant.name, body.priority, engine_service_tier(body.service_tier))
                    with self._as_tenant(tenant) as engine:
                        answer = await respond_whole(
                            body,
                            engine,
                            self.tokenizer,
                            self.engine.model_name,
                            uuid.uuid4().hex,
                            self.tool_call_parser,
                            self.responses,
                        )
                    return response_message(answer)
        finally:
            tracing.end_grpc_span(span, context.code())

    async def GetResponse(self, request: api_pb2.GetResponseRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        async with status_on_error(context):
            kept = self.responses.get(request.response_id)
            if kept is None:
                raise not_found_response(request.response_id, "response_id")
            return response_message(kept.body)

    @contextlib.contextmanager
    def _as_tenant(self, tenant: Tenant) -> Iterator[EngineClient]:
        """Run a call as `tenant`: within its quotas (RESOURCE_EXHAUSTED over them), its engine requests made for it
        (CALLER_TENANT) and their tokens counted against its rate; the engine client to use."""
        self.quotas.enter(tenant)
        caller = CALLER_TENANT.set((tenant.name, tenant.weight))
        try:
            yield self.engine if tenant.tokens_per_minute is None else MeteredEngine(self.engine, tenant, self.quotas)
        finally:
            CALLER_TENANT.reset(caller)
            self.quotas.leave(tenant)

    def _adapter(self, name: str) -> LoRARequest | None:
        if not name:
            return None
        adapter = self.lora_modules.get(name) if self.lora_modules is not None else None
        if adapter is None:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"lora_name: no LoRA adapter {name!r} is served here")
        return adapter

    @staticmethod
    def _best_of(request: api_pb2.GenerateRequest, stream: _Stream) -> tuple[int, bool] | None:
        """(n, whether the caller asked for logprobs) when best_of asks for more choices than n; the stream then
        runs best_of choices with logprobs, to rank them. None when best_of is off."""
        if not request.HasField("best_of"):
            return None
        n = stream.params.n
        if not n <= request.best_of <= MAX_N:
            raise ValueError(f"best_of must be between n ({n}) and {MAX_N}, got {request.best_of}")
        if request.best_of == n:
            return None
        asked = stream.params.logprobs is not None
        logprobs = stream.params.logprobs if asked else 0
        stream.params = dataclasses.replace(stream.params, n=request.best_of, logprobs=logprobs)
        return n, asked

    async def _best_n(
        self, stream: _Stream, context: grpc.aio.ServicerContext, n: int, keep_logprobs: bool
    ) -> list[api_pb2.GenerateResponse]:
        """The n choices of the stream whose tokens have the highest summed logprob, one message each, best first."""
        messages: dict[int, list[api_pb2.GenerateResponse]] = {}
        async for response in self._run(stream, context):
            messages.setdefault(response.index, []).append(response)
        whole = [_merged(parts) for _, parts in sorted(messages.items())]
        whole.sort(key=lambda response: -sum(entry.logprob for entry in response.logprobs))
        for rank, response in enumerate(whole[:n]):
            response.index = rank
            if not keep_logprobs:
                del response.logprobs[:]
        return whole[:n]

    async def _beam_search(self, request: api_pb2.GenerateRequest, context) -> AsyncIterator[api_pb2.GenerateResponse]:
        """The best beams of a Generate with beam_search, one whole message each, best first."""
        sent = request.sampling_params
        refused = {
            "temperature": sent.HasField("temperature") and sent.temperature > 0,
            "stop": bool(sent.stop) or bool(sent.stop_token_ids),
            "logprobs": sent.HasField("logprobs") or sent.HasField("prompt_logprobs"),
            "constraint": sent.WhichOneof("constraint") is not None,
            "n": sent.HasField("n") and sent.n != request.beam_search.beam_width,
        }
        for name, value in refused.items():
            if value:
                raise ValueError(f"sampling_params.{name} is not supported with beam_search; leave it out")
        if request.HasField("best_of"):
            raise ValueError("best_of is not supported with beam_search; leave it out")
        stream = self._new_stream(request)
        stream.lora = self._adapter(request.lora_name)
        width = request.beam_search.beam_width
        penalty = request.beam_search.length_penalty if request.beam_search.HasField("length_penalty") else 1.0
        limit = self.engine.max_model_len - len(stream.prompt_ids)
        try:
            params = BeamSearchParams(
                width, stream.params.max_tokens or max(1, limit), stream.params.ignore_eos, penalty
            )
        except ValueError as error:
            raise ValueError(f"beam_search.{error}") from None
        await context.send_initial_metadata((("request-id", stream.request_id),))
        ends = self.engine.eos_token_ids
        beams = await beam_search(self.engine, stream.prompt_ids, params, stream.engine_id, ends, stream.lora)
        for rank, beam in enumerate(beams):
            text = ""
            if stream.send_text and self.tokenizer is not None:
                text = self.tokenizer.decode(beam.token_ids, skip_special_tokens=stream.params.skip_special_tokens)
            usage = api_pb2.Usage(prompt_tokens=len(stream.prompt_ids), completion_tokens=len(beam.token_ids))
            yield api_pb2.GenerateResponse(
                request_id=stream.request_id,
                token_ids=beam.token_ids,
                text=text,
                finish_reason=beam.finish_reason,
                usage=usage,
                index=rank,
            )

    async def Session(self, request_iterator: AsyncIterator[api_pb2.SessionRequest], context):  # noqa: N802
        async with status_on_error(context):
            messages = aiter(request_iterator)
            first = await anext(messages, None)
            if first is None:
                raise ValueError("the session ended before its first message")
            stream = self._new_stream(first)
            stream.lora = self._adapter(first.lora_name)
            tenant = stream.tenant = self.tenants.of_key(_caller_key(context))
            stream.priority = tenant.priority_for(None)
            if stream.params.n > 1:
                raise ValueError("sampling_params.n: a Session generates one sequence; use Generate for n > 1")
            if stream.params.structured_outputs is not None:
                # The grammar would have to follow input that is still arriving; a constraint covers a whole
                # generation from a complete prompt.
                raise ValueError(
                    f"{constraint_field(first.sampling_params)}: a Session takes no output constraint; "
                    "send the whole prompt with Generate to constrain the output"
                )
            feed = None if first.final else functools.partial(self._feed, messages)
            with self._as_tenant(tenant) as stream.engine:
                async for response in self._run(stream, context, feed):
                    yield response

    async def Abort(self, request: api_pb2.AbortRequest, context) -> api_pb2.AbortResponse:  # noqa: N802
        # Only a request started on this same connection: another caller's request_id finds nothing.
        stream = self._streams.get((context.peer(), request.request_id))
        if stream is None:
            return api_pb2.AbortResponse(found=False)
        for choice in stream.choices:
            if choice.engine_done:
                continue
            choice.engine_done = True
            # Ends the choice now, even when the engine has nothing to send (a session still waiting for input).
            last = choice.last or RequestDelta(choice.engine_id, [], len(stream.prompt_ids), 0)
            ended = RequestDelta(choice.engine_id, [], last.num_prompt_tokens, last.num_output_tokens, True, "abort")
            ended.num_cached_tokens = last.num_cached_tokens
            stream.events.put_nowait((choice, ended))
            await self.engine.abort(choice.engine_id)
        return api_pb2.AbortResponse(found=True)

    async def GetModelInfo(self, request: api_pb2.ModelInfoRequest, context) -> api_pb2.ModelInfo:  # noqa: N802
        engine = self.engine
        return api_pb2.ModelInfo(
            model_name=engine.model_name, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size
        )

    async def GetServerInfo(self, request: api_pb2.ServerInfoRequest, context) -> api_pb2.ServerInfo:  # noqa: N802
        async with status_on_error(context):
            stats = numeric_stats(await self.engine.stats())
            stats["grpc.active_streams"] = float(len(self._streams))
            uptime = time.monotonic() - self._started
            return api_pb2.ServerInfo(version=_version(), uptime_seconds=uptime, stats=stats)

    def _new_stream(self, message: api_pb2.GenerateRequest | api_pb2.SessionRequest) -> _Stream:
        engine_id = uuid.uuid4().hex
        request_id = message.request_id or engine_id
        if len(request_id) > MAX_REQUEST_ID_LEN:
            raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_LEN} characters, got {len(request_id)}")
        params = with_bad_words(sampling_params_from_proto(message.sampling_params), self.tokenizer)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings are matched on text, and this model has no tokenizer")
        prompt_ids = self._input_ids(message, first=True)
        if not prompt_ids:
            raise ValueError("input: the prompt must contain at least one token")
        prompt_ids = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, self.engine.max_model_len)
        return _Stream(request_id, engine_id, prompt_ids, params, send_text=not message.skip_detokenize)

    def _input_ids(self, message: api_pb2.GenerateRequest | api_pb2.SessionRequest, *, first: bool) -> list[int]:
        kind = message.WhichOneof("input")
        if kind == "token_ids":
            ids = list(message.token_ids.ids)
            vocab_size = self.engine.vocab_size
            bad = next((i for i, token in enumerate(ids) if not 0 <= token < vocab_size), None)
            if bad is not None:
                raise ValueError(f"token_ids.ids[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab_size})")
            return ids
        if kind == "text":
            if self.tokenizer is None:
                raise ValueError("text: this model has no tokenizer; send token_ids instead")
            # Special tokens such as BOS belong in front of the prompt, not in front of every chunk.
            return list(self.tokenizer.encode(message.text, add_special_tokens=first))
        return []

    async def _run(
        self,
        stream: _Stream,
        context: grpc.aio.ServicerContext,
        feed: Callable[[_Stream], Awaitable[None]] | None = None,
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        request_id = stream.request_id
        key = (context.peer(), request_id)
        if key in self._streams:
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already streaming on this connection"
            )
        carrier = tracing.engine_carrier(stream.span)
        final = feed is None
        children = fan_out(
            stream.engine_id,
            stream.prompt_ids,
            stream.params,
            final=final,
            trace_context=carrier,
            lora=stream.lora,
            priority=stream.priority,
            service_tier=stream.service_tier,
            tenant=stream.tenant.name,
            tenant_weight=stream.tenant.weight,
        )
        stream.choices = [_Choice(index, child) for index, child in enumerate(children)]
        self._streams[key] = stream
        tasks = [asyncio.create_task(self._pump(stream, choice)) for choice in stream.choices]
        try:
            await context.send_initial_metadata((("request-id", request_id),))
            if feed is not None:
                await asyncio.sleep(0)  # let the engine open the request before the first append_input reaches it
                tasks.append(asyncio.create_task(feed(stream)))
            while not stream.finished:
                event = await stream.events.get()
                if isinstance(event, BaseException):
                    raise event
                choice, delta = event
                if choice.finished:  # an abort's own ending may race the engine's last delta
                    continue
                yield self._response(stream, choice, delta)
                if choice.state.stopped and not choice.engine_done:
                    # A stop string ended this choice while its engine request runs on: end it there now (as a
                    # finish), not when the call's other choices are done.
                    choice.engine_done = True
                    await self.engine.abort(choice.engine_id, stopped=True)
        finally:
            self._streams.pop(key, None)
            for choice in stream.choices:
                if not choice.engine_done:  # a cancelled client or a stop string: free the KV blocks
                    stopped = choice.state is not None and choice.state.stopped
                    await self.engine.abort(choice.engine_id, stopped=stopped)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, stream: _Stream, choice: _Choice) -> None:
        """Move one choice's engine deltas into the call's queue, so that a cancelled client can abort it first."""
        try:
            generator = (stream.engine or self.engine).generate(choice.request)
            tracing.record_queued(stream.span, choice.engine_id)
            finished = False
            async for delta in generator:
                finished = delta.finished
                stream.events.put_nowait((choice, delta))
            if not finished:
                stream.events.put_nowait(RpcError(grpc.StatusCode.INTERNAL, "the engine ended the stream unfinished"))
        except Exception as exc:
            stream.events.put_nowait(exc)

    async def _feed(self, messages: AsyncIterator[api_pb2.SessionRequest], stream: _Stream) -> None:
        """Hand a session's later input chunks to the engine until the final one or the client's half-close."""
        try:
            async for message in messages:
                if (
                    message.request_id
                    or message.HasField("sampling_params")
                    or message.skip_detokenize
                    or message.lora_name
                ):
                    raise ValueError(
                        "request_id, sampling_params, skip_detokenize and lora_name go in the first message only"
                    )
                ids = self._input_ids(message, first=False)
                stream.prompt_ids.extend(ids)
                await self.engine.append_input(stream.choices[0].engine_id, ids, message.final)
                if message.final:
                    return
            await self.engine.append_input(stream.choices[0].engine_id, [], True)
        except Exception as exc:
            stream.events.put_nowait(exc)

    def _response(self, stream: _Stream, choice: _Choice, delta: RequestDelta) -> api_pb2.GenerateResponse:
        if delta.error:
            code = _ERROR_CODES.get(delta.error_code, grpc.StatusCode.UNAVAILABLE)
            raise RpcError(code, f"the engine gave up on this request: {delta.error}")
        choice.last = delta
        tracing.record_delta(stream.span, choice.engine_id, delta)
        if choice.state is None:
            choice.state = ChoiceState(
                self.tokenizer, stream.prompt_ids, choice.params, choice.index, detokenize=stream.send_text
            )
        out = choice.state.process(delta)
        response = api_pb2.GenerateResponse(request_id=stream.request_id, token_ids=out.token_ids, index=choice.index)
        if stream.send_text:
            response.text = out.text
        if stream.params.logprobs is not None:
            response.logprobs.extend(token_logprobs(out))
        if out.prompt_logprobs is not None:
            response.prompt_logprobs.extend(prompt_token_logprobs(stream.prompt_ids, out.prompt_logprobs))
        if delta.finished:
            choice.engine_done = True
        if out.finish_reason is not None:
            choice.finished = True
            response.finish_reason = out.finish_reason
            num_outputs = choice.state.num_output_tokens
            response.usage.CopyFrom(usage(delta, num_outputs))
            tracing.record_finished(stream.span, choice.engine_id, out.finish_reason, num_outputs)
            tracing.record_usage(stream.span, delta.num_prompt_tokens, num_outputs, delta.num_cached_tokens)
        return response


def _merged(parts: list[api_pb2.GenerateResponse]) -> api_pb2.GenerateResponse:
    """One choice's messages as one: its tokens, text and logprobs in order, its first prompt logprobs, its end."""
    whole = api_pb2.GenerateResponse(request_id=parts[0].request_id, index=parts[0].index)
    whole.prompt_logprobs.extend(parts[0].prompt_logprobs)
    for part in parts:
        whole.token_ids.extend(part.token_ids)
        whole.logprobs.extend(part.logprobs)
    whole.text = "".join(part.text for part in parts)
    whole.finish_reason = parts[-1].finish_reason
    whole.usage.CopyFrom(parts[-1].usage)
    return whole


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("pagerail")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_grpc_server(
    engine: EngineClient,
    tokenizer: Any | None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    health: EngineHealth | None = None,
    tls: ServerTls | None = None,
    responses: ResponseStore | None = None,
    tool_call_parser: str | None = None,
    lora_modules: LoRAModules | None = None,
    tenants: Tenants = NO_TENANTS,
    quotas: TenantQuotas | None = None,
) -> tuple[grpc.aio.Server, int]:
    """An unstarted grpc.aio server with Generation, Health and reflection, and the port it bound (port=0: any).

    Health follows engine.is_ready; pass your own `health` to flip it with set_serving(). `responses` is the
    store of kept Responses API responses (share the HTTP API's; a new one when None).
    With `tls` the port speaks TLS only (and asks for client certificates when tls.client_ca is set).
    Call from inside the event loop that will run the server.
    """
    interceptors = [ApiKeyInterceptor(api_key)] if api_key is not None else []
    server = grpc.aio.server(interceptors=interceptors)
    servicer = GenerationServicer(engine, tokenizer, responses, tool_call_parser, lora_modules, tenants, quotas)
    api_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = health or EngineHealth(engine.is_ready, (GENERATION_SERVICE,))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((GENERATION_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls is not None:
        return server, server.add_secure_port(address, tls.server_credentials())
    return server, server.add_insecure_port(address)


def _caller_key(context: grpc.aio.ServicerContext) -> str | None:
    """The key a call carries in its `authorization: Bearer <key>` metadata."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return bearer_token(value)
    return None
