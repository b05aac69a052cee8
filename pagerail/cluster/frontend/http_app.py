"""The OpenAI-compatible HTTP server: routes, API key, body limit, request ids, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.core.engine_request import CALLER_TENANT
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.frontend import anthropic_messages, embeddings, openai_routes, responses_api, scoring
from pagerail.cluster.frontend.anthropic_messages import MessagesRequest
from pagerail.cluster.frontend.chat import encode_prompt, render_chat
from pagerail.cluster.frontend.embeddings import EmbeddingRequest
from pagerail.cluster.frontend.errors import (
    APIError,
    bad_request,
    error_body,
    from_validation_error,
    from_value_error,
    internal_error,
    not_found_model,
    overloaded,
    payload_too_large,
    unauthorized,
    unavailable,
)
from pagerail.cluster.frontend.lora_modules import LoRAModules
from pagerail.cluster.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagerail.cluster.frontend.responses_api import ResponsesRequest, ResponseStore, not_found_response
from pagerail.cluster.frontend.scoring import ClassifyRequest, PoolingRequest, RerankRequest, ScoreRequest
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.cluster.frontend.tenant_quotas import MeteredEngine, TenantQuotas
from pagerail.cluster.frontend.tracing import traced_http
from pagerail.common.auth import bearer_matches, bearer_token

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
_OPEN_PATHS = ("/health", "/ready", "/version", "/metrics")
# Opened by the admin key alone, never the inference one; without an admin key they do not exist.
_ADMIN_PATHS = (
    "/pause",
    "/resume",
    "/replicas/drain",
    "/replicas/undrain",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
# The routes a LoRA adapter's name may be the `model` of.
_ADAPTER_ROUTES = frozenset(
    (openai_routes.completions, openai_routes.chat_completions, responses_api.responses, anthropic_messages.messages)
)
# What a request that its client abandoned is logged with (nobody reads it): nginx's "client closed request".
CLIENT_CLOSED_REQUEST = 499
MAX_CLIENT_REQUEST_ID_LEN = 128


@dataclass
class ServerState:
    """What the routes share: the engine, the tokenizer, and whether new requests are still admitted."""

    engine: EngineClient
    tokenizer: object
    settings: FrontendSettings  # the served model's name, the API keys, the body limit, the tool-call format
    draining: bool = False
    in_flight: int = 0
    # Responses kept for previous_response_id and GET /v1/responses/{id}.
    responses: ResponseStore = field(default_factory=ResponseStore)
    # The LoRA adapters served by name; None when the engine serves none.
    lora_modules: LoRAModules | None = None
    # Each tenant's requests in flight and tokens of the last minute, against its quotas.
    quotas: TenantQuotas = field(default_factory=TenantQuotas)

    def __post_init__(self) -> None:
        lora = self.settings.lora
        if lora is not None and self.lora_modules is None:
            self.lora_modules = LoRAModules(self.settings.served_model_name, lora.max_lora_rank, lora.modules)


# The routes that read a JSON body through a model of their own (to answer bad input with OpenAI's 400s rather
# than FastAPI's 422s); /openapi.json names the same models as their request bodies.
_BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/pooling": PoolingRequest,
    "/classify": ClassifyRequest,
    "/score": ScoreRequest,
    "/v1/score": ScoreRequest,
    "/rerank": RerankRequest,
    "/v1/rerank": RerankRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def _with_request_bodies(app: FastAPI) -> Callable[[], dict]:
    """app.openapi, with each _BODIES route's request body described by its model's JSON schema."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        # Every route but the open ones takes the API key as a bearer token (when the server has one).
        schema.setdefault("components", {})["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            if path not in _OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"apiKey": []}]
        components = schema["components"].setdefault("schemas", {})
        for path, model in _BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            reference = {"$ref": f"#/components/schemas/{model.__name__}"}
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": reference}},
            }
        app.openapi_schema = schema
        return schema

    return openapi


def create_app(state: ServerState) -> FastAPI:
    # FastAPI's own request spans would duplicate the request span GuardMiddleware opens (with gen_ai attributes).
    app = FastAPI(title="pagerail", version=VERSION, docs_url=None, redoc_url=None, telemetry={"tracing": False})
    app.state.server = state
    app.openapi = _with_request_bodies(app)

    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        return _error_response(error)

    @app.exception_handler(QueueFullError)
    async def queue_full(_: Request, error: QueueFullError):
        return _error_response(overloaded(error.retry_after_s))

    @app.exception_handler(ValueError)
    async def value_error(_: Request, error: ValueError):
        return _error_response(from_value_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        # Routing's own answers (an unknown path, a method a route does not take) in the error shape every
        # other answer has, so clients show the reason rather than a bare status.
        if error.status_code == 404:
            return _error_response(APIError(404, f"No route {request.url.path} on this server", code="not_found"))
        if error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            return _error_response(APIError(405, message, code="method_not_allowed"))
        return _error_response(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError):
        return _error_response(bad_request(str(error.errors()[0].get("msg", error)) if error.errors() else str(error)))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def is_ready():
        if state.draining or not await state.engine.is_ready():
            return _error_response(unavailable("not ready" if not state.draining else "draining", 1))
        return {"status": "ready"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        engine = await state.engine.metrics()
        engine = engine.decode() if isinstance(engine, bytes) else engine
        return PlainTextResponse(engine + state.quotas.metrics_text().decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    def model_card() -> dict:
        return {
            "id": state.settings.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pagerail",
            "max_model_len": state.engine.max_model_len,
        }

    def adapter_cards() -> list[dict]:
        return state.lora_modules.cards("pagerail") if state.lora_modules is not None else []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(), *adapter_cards()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id == state.settings.served_model_name:
            return model_card()
        card = next((card for card in adapter_cards() if card["id"] == model_id), None)
        if card is None:
            raise not_found_model(model_id)
        return card

    async def generation(request: Request, model, route, **options):
        """Parse the body as `model` and run `route` over it, counted as in flight until its response ends: a
        streamed one when its event stream ends (the route calls `left` there), a whole one when it is made."""
        body = await _parse(request, state, model)
        ids = (request.state.request_id, request.state.client_request_id)
        served = state.settings.served_model_name
        adapters = state.lora_modules
        if adapters is not None and getattr(body, "model", None) in adapters:
            if route not in _ADAPTER_ROUTES:
                raise bad_request(f"model {body.model!r} is a LoRA adapter; this route serves the base model", "model")
            served, options["lora"] = body.model, adapters.get(body.model)
        tenant = state.settings.tenants.of_key(_bearer_key(request))
        if "priority" in type(body).model_fields:  # the tenant's default, where the request names none
            body.priority = tenant.priority_for(body.priority if "priority" in body.model_fields_set else None)
        state.quotas.enter(tenant)  # 429 for this tenant's requests only, over its quotas

        def left() -> None:
            state.in_flight -= 1
            state.quotas.leave(tenant)

        state.in_flight += 1
        engine = state.engine if tenant.tokens_per_minute is None else MeteredEngine(state.engine, tenant, state.quotas)
        # The route makes its engine requests (fan_out) before it returns, a streamed response included.
        caller = CALLER_TENANT.set((tenant.name, tenant.weight))
        try:
            route_call = route(
                body,
                engine,
                state.tokenizer,
                served,
                *ids,
                on_stream_end=left,
                **options,
            )
            response = await _unless_disconnected(request, route_call)
        except BaseException:
            left()
            raise
        finally:
            CALLER_TENANT.reset(caller)
        if not isinstance(response, StreamingResponse):
            left()
        return response

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, CompletionRequest, openai_routes.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generation(
            request,
            ChatCompletionRequest,
            openai_routes.chat_completions,
            tool_call_parser=state.settings.tool_call_parser,
        )

    @app.post("/v1/embeddings")
    async def embeddings_route(request: Request):
        return await generation(request, EmbeddingRequest, embeddings.embeddings, pooling=state.settings.pooling)

    pooling = state.settings.pooling

    @app.post("/pooling")
    async def pooling_route(request: Request):
        return await generation(request, PoolingRequest, scoring.pooling_route, pooling=pooling)

    @app.post("/classify")
    async def classify_route(request: Request):
        return await generation(request, ClassifyRequest, scoring.classify_route, pooling=pooling)

    @app.post("/score")
    @app.post("/v1/score")
    async def score_route(request: Request):
        return await generation(request, ScoreRequest, scoring.score_route, pooling=pooling)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank_route(request: Request):
        return await generation(request, RerankRequest, scoring.rerank_route, pooling=pooling)

    @app.post("/v1/responses")
    async def responses_route(request: Request):
        return await generation(
            request,
            ResponsesRequest,
            responses_api.responses,
            tool_call_parser=state.settings.tool_call_parser,
            store=state.responses,
        )

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        kept = state.responses.get(response_id)
        if kept is None:
            raise not_found_response(response_id)
        return kept.body

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return state.responses.cancel(response_id).body

    @app.post("/v1/messages")
    async def anthropic_messages_route(request: Request):
        return await generation(
            request, MessagesRequest, anthropic_messages.messages, tool_call_parser=state.settings.tool_call_parser
        )

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _validated(request, state, TokenizeRequest)
        if body.messages is not None:
            tokens = render_chat(state.tokenizer, body.messages)
        elif body.prompt is not None:
            tokens = encode_prompt(state.tokenizer, body.prompt, state.engine.vocab_size)
        else:
            raise bad_request("either prompt or messages is required", "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """The tokenizer's settings (as vLLM answers it), so a client can count and format tokens as the server
        does: its class, special tokens, chat template and the context this server serves."""
        tokenizer = state.tokenizer
        settings = getattr(tokenizer, "init_kwargs", {})
        info = {key: value for key, value in settings.items() if isinstance(value, (str, int, float, bool))}
        info.update(
            tokenizer_class=type(tokenizer).__name__,
            model_max_length=state.engine.max_model_len,
            vocab_size=state.engine.vocab_size,
            chat_template=getattr(tokenizer, "chat_template", None),
        )
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[name] = getattr(tokenizer, name, None)
        return info

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tokens = (await _validated(request, state, DetokenizeRequest)).tokens
        if any(not 0 <= t < state.engine.vocab_size for t in tokens):
            raise bad_request(f"tokens must be in [0, {state.engine.vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(tokens)}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """vLLM's runtime adapter loading: {"lora_name", "lora_path"}; the name is then a `model` to request."""
        adapters = _adapters(state)
        body = await _json(request, state)
        try:
            adapters.load(body.get("lora_name"), body.get("lora_path"), body.get("base_model_name"))
        except ValueError as error:
            field = str(error).split(":", 1)[0]
            param = field if field in ("lora_name", "lora_path", "base_model_name") else None
            raise bad_request(str(error), param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        """{"lora_name"}: new requests naming it get 404; its running requests finish."""
        adapters = _adapters(state)
        name = (await _json(request, state)).get("lora_name")
        if not isinstance(name, str) or name not in adapters:
            raise APIError(404, f"No LoRA adapter {name!r} is loaded", param="lora_name", code="not_found")
        adapters.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/pause")
    async def pause(mode: str = "all"):
        if mode not in ("new", "all"):
            raise bad_request("mode must be 'new' or 'all'", "mode")
        await state.engine.pause(mode)
        return {"status": "paused", "mode": mode}

    @app.post("/resume")
    async def resume():
        await state.engine.resume()
        return {"status": "running"}

    @app.post("/replicas/drain")
    async def drain_replica(replica: str = ""):
        """Take a replica out of rotation and move its running requests, with their KV, to the others."""
        moves = getattr(state.engine, "moves", None)
        if moves is None:
            raise bad_request("this server serves a single replica: there is no other to move requests to", "replica")
        if replica not in state.engine.replicas:
            raise bad_request(f"replica must be one of {sorted(state.engine.replicas)}, got {replica!r}", "replica")
        if not [name for name in state.engine.router.in_rotation() if name != replica]:
            # Its requests would have nowhere to go, and every new request would be refused.
            raise bad_request(f"draining {replica!r} would leave no replica in rotation", "replica")
        return {"status": "draining", "replica": replica, "moved_requests": await moves.drain(replica)}

    @app.post("/replicas/undrain")
    async def undrain_replica(replica: str = ""):
        """Put a drained replica back into rotation."""
        replicas = getattr(state.engine, "replicas", None)
        if replicas is None or replica not in replicas:
            raise bad_request(f"replica must be one of {sorted(replicas or ())}, got {replica!r}", "replica")
        state.engine.set_in_rotation(replica, True)
        return {"status": "in rotation", "replica": replica}

    return app


class GuardMiddleware:
    """Plain ASGI (so streaming and client disconnects pass straight through): request id, API key, body size,
    and the request span of the generation routes."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        # The engine's id is always made here; the client's X-Request-Id is only a label (logs, spans, the
        # response header), so no client can name, join or abort another client's request.
        engine_request_id = uuid.uuid4().hex
        request_id = client_request_label(headers.get("x-request-id")) or engine_request_id
        scope.setdefault("state", {}).update(request_id=engine_request_id, client_request_id=request_id)

        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        limit, received = self.state.settings.max_body_bytes, 0

        async def receive_within_limit() -> dict:
            # Content-Length is only a claim, and a chunked body has none: count what actually arrives, and stop
            # reading at the limit. The route's APIError handler answers the 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise payload_too_large(limit)
            return message

        try:
            # Anthropic's clients send the key as x-api-key; OpenAI's as a bearer token.
            key_header = headers.get("authorization") or (
                f"Bearer {headers['x-api-key']}" if "x-api-key" in headers else ""
            )
            _check_key(self.state, scope["path"], key_header)
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                raise payload_too_large(limit)
        except APIError as error:
            await _error_response(error)(scope, receive_within_limit, send_with_id)
            return
        try:
            await traced_http(self.app, scope, receive_within_limit, send_with_id, headers)
        except Exception:
            if started:
                raise  # mid-body: the server drops the connection, so no client takes a cut stream for a whole one
            # A bug, not the client's fault: the traceback goes to the log, the client gets no internals.
            logger.exception(
                "unexpected error answering %s %s (request %s, client label %s)",
                scope.get("method"),
                scope["path"],
                engine_request_id,
                request_id,
                extra={"request_id": engine_request_id},
            )
            await _error_response(internal_error())(scope, receive_within_limit, send_with_id)


def client_request_label(value: str | None) -> str | None:
    """A client's X-Request-Id made safe to echo and log: printable ASCII, at most MAX_CLIENT_REQUEST_ID_LEN."""
    if not value:
        return None
    cleaned = "".join(c for c in value if 32 < ord(c) < 127)[:MAX_CLIENT_REQUEST_ID_LEN]
    return cleaned or None


def _adapters(state: ServerState) -> LoRAModules:
    if state.lora_modules is None:
        raise bad_request("this server was started without --enable-lora", "lora_name")
    return state.lora_modules


def _bearer_key(request: Request) -> str | None:
    """The key a request carries: `Authorization: Bearer <key>`, or Anthropic's `x-api-key`."""
    return bearer_token(request.headers.get("authorization", "")) or request.headers.get("x-api-key") or None


def _check_key(state: ServerState, path: str, header: str) -> None:
    if path in _ADMIN_PATHS:
        if state.settings.admin_api_key is None:
            raise APIError(404, f"No route {path} on this server", code="not_found")
        expected = state.settings.admin_api_key
    elif state.settings.api_key is None or path in _OPEN_PATHS:
        return
    else:
        expected = state.settings.api_key
    if not bearer_matches(header, expected.encode()):
        raise unauthorized()


async def _json(request: Request, state: ServerState) -> dict:
    raw = await request.body()  # GuardMiddleware stops reading past max_body_bytes with a 413
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    return payload


async def _parse(request: Request, state: ServerState, model):
    """The body of a generation route as `model`; refused while the server drains."""
    if state.draining:
        raise unavailable("the server is shutting down", retry_after_s=5)
    return await _validated(request, state, model)


async def _validated(request: Request, state: ServerState, model):
    """The body as `model`; a 400 naming the first bad field otherwise."""
    payload = await _json(request, state)
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise from_validation_error(error) from None


async def _unless_disconnected(request: Request, handler: Awaitable[Response]) -> Response:
    """Run a generation route until its response is ready; if the client hangs up first, cancel it, which closes
    its engine streams and so aborts their requests. (A streamed body is watched by the streaming response.)"""
    work = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and watch.exception() is not None:
            await asyncio.wait((work,))  # the receive channel failed, which is no hang-up: let the route finish
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return work.result()


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection; the body was read before the route ran."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)
