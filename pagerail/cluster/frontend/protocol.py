"""Pydantic models of the OpenAI completions and chat requests, and their mapping to SamplingParams."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagerail.cluster.core.beam_search import BeamSearchParams
from pagerail.cluster.core.engine_request import MAX_PRIORITY, MIN_PRIORITY, engine_service_tier
from pagerail.cluster.frontend.errors import from_value_error
from pagerail.cluster.frontend.output_format import ConstrainedOutputFields
from pagerail.cluster.frontend.tool_choice import (
    MessageToolCall,
    NamedToolChoice,
    ToolChoice,
    ToolDefinition,
    check_distinct,
    effective_choice,
    parse_tool_choice,
    tool_constraint,
)
from pagerail.common.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, check_stop
from pagerail.common.structured_outputs import StructuredOutputs

# SamplingParams fields that _SamplingRequest.build reads in a way of their own; every other SamplingParams field
# is a request field of the same name, passed through as sent (tests/test_http_protocol.py keeps that true).
_BUILT_APART = frozenset(
    {"max_tokens", "stop", "stop_token_ids", "logprobs", "structured_outputs", "logit_bias", "bad_words_token_ids"}
)
_PASSED_THROUGH = tuple(field.name for field in dataclasses.fields(SamplingParams) if field.name not in _BUILT_APART)


class LenientModel(BaseModel):
    # Clients send fields this server does not know (extra_body, vendor options); they are ignored, not refused.
    # Strict types keep "0.5" from passing as a number and true from passing as 1.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(LenientModel):
    include_usage: bool | None = False


class _SamplingRequest(ConstrainedOutputFields):
    """Fields shared by completions and chat; None means "the default", as OpenAI allows explicit nulls.
    Lenient like LenientModel; response_format and structured_outputs come from ConstrainedOutputFields."""

    model: str | None = None  # None: the model this server serves
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (scores the prompt alone)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    min_tokens: int | None = None
    skip_special_tokens: bool | None = True
    # False keeps the request out of speculative decoding, where the server has it on.
    speculative: bool | None = True
    user: str | None = None
    # {token id as a string (JSON keys are strings): bias in [-100, 100]}, as OpenAI takes it.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: each prompt token's logprob (after the first) with the top k, in a whole response's choices.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    # vLLM's: the n best of n beams (whole responses at temperature 0), ranked with this length penalty.
    use_beam_search: bool | None = False
    length_penalty: float | None = None
    # vLLM's: under --scheduling-policy priority, lower is served first (ties by arrival); ignored under fcfs.
    priority: int | None = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # OpenAI's: "flex" is batch work that only fills spare capacity (docs/serving.md); "auto" and "default" are
    # interactive.
    service_tier: Literal["auto", "default", "flex"] | None = None

    @property
    def tier(self) -> str:
        """The service tier the engine is given: "flex", or "default" for every interactive request."""
        return engine_service_tier(self.service_tier)

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is not None:
            check_stop(value)  # SamplingParams' own rule, before anything else is read
        return value

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key, bias in value.items():
                if not (isinstance(key, str) and key.strip().isdigit()):
                    raise ValueError(f"logit_bias keys must be token ids (strings of digits), got {key!r}")
                if isinstance(bias, int) and not isinstance(bias, bool):
                    value = {**value, key: float(bias)}  # strict floats refuse 5; OpenAI takes it
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are only returned in whole responses; leave stream out")
        return value

    @model_validator(mode="after")
    def _check_max_tokens_above_zero(self) -> _SamplingRequest:
        if self.max_tokens == 0 and not getattr(self, "echo", False):
            raise ValueError("max_tokens must be >= 1 (0 only with echo, which returns the scored prompt alone)")
        return self

    @model_validator(mode="after")
    def _check_beam_search(self) -> _SamplingRequest:
        if not self.use_beam_search:
            return self
        # Beams are ranked by the model's own logprobs and end on its end-of-sequence token: settings that sample,
        # cut or reshape the output would be ignored, so they are refused instead.
        refused = {
            "stream": self.stream,
            "temperature": self.temperature,
            "echo": getattr(self, "echo", False),
            "logprobs": getattr(self, "logprobs", None) not in (None, False),
            "stop": self.stop,
            "best_of": getattr(self, "best_of", None) not in (None, self.n or 1),
            "tools": getattr(self, "tools", None),
            "structured_outputs": self.structured_outputs,
            "response_format": self.response_format is not None and self.response_format.constrains(),
            "prompt_logprobs": self.prompt_logprobs is not None,
        }
        for name, value in refused.items():
            if value:
                raise ValueError(f"{name} is not supported with use_beam_search; leave it out")
        return self

    @field_validator("suffix", check_fields=False)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        # Ignoring these would silently return something other than what was asked for.
        if value:
            raise ValueError(f"{info.field_name} is not supported; leave it out")
        return value

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a chunk carrying token usage."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        """The beam search this request asks for (use_beam_search): n beams, the n best returned."""
        try:
            return BeamSearchParams(
                beam_width=self.n if self.n is not None else 1,
                max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                ignore_eos=bool(self.ignore_eos),
                length_penalty=self.length_penalty if self.length_penalty is not None else 1.0,
            )
        except ValueError as err:  # n is the beam width on the wire
            raise from_value_error(ValueError(str(err).replace("beam_width", "n", 1))) from err

    def _build(self, max_tokens: int | None, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        constraint, _ = self.output_constraint()  # raises APIError naming its field
        stop = self.stop if self.stop is not None else ()
        # Explicit nulls fall back to SamplingParams' own defaults.
        values = {name: value for name in _PASSED_THROUGH if (value := getattr(self, name)) is not None}
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                stop=tuple([stop] if isinstance(stop, str) else stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                logprobs=logprobs,
                structured_outputs=constraint,
                logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
                **values,
            )
        except ValueError as err:
            raise from_value_error(err) from err


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return check_prompt_batch("prompt", value)

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        # The best n of best_of choices by their tokens' summed logprob: known only once all of them ended.
        if value is None:
            return value
        n = info.data.get("n") or 1
        if not n <= value <= MAX_N:
            raise ValueError(f"best_of must be between n ({n}) and {MAX_N}, got {value}")
        if value > n and info.data.get("stream"):
            raise ValueError("best_of is only answered whole; leave stream out")
        return value

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt as a batch: one entry per choice group, each a string or a list of token ids."""
        return prompt_batch(self.prompt)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for this request; raises APIError (400) naming the offending field. With echo, max_tokens
        0 runs one token (dropped from the answer) and logprobs k scores the prompt with the top k too."""
        params = self._build(1 if self.max_tokens == 0 else self.max_tokens, default_max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0))
        return params


class ContentPart(LenientModel):
    type: str
    text: str | None = None


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # which call a tool turn answers

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(p, dict) for p in value):
            raise ValueError("content must be a string or a list of content parts")
        return value


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True

    @field_validator("max_completion_tokens")
    @classmethod
    def _check_max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and other != value:
            raise ValueError(f"max_completion_tokens must equal max_tokens when both are sent, got {value} and {other}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        if value:
            check_distinct(value)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: Any, info: ValidationInfo) -> ToolChoice | None:
        if "tools" not in info.data:
            return None  # the tools are invalid, and that is the error to report
        choice = parse_tool_choice(value, info.data["tools"])
        constrained = isinstance(choice, NamedToolChoice) or choice == "required"
        response_format = info.data.get("response_format")
        if constrained and (info.data.get("structured_outputs") or (response_format and response_format.constrains())):
            raise ValueError("tool_choice cannot name a function or be 'required' when the output is constrained by "
                             "response_format or structured_outputs")  # fmt: skip
        return choice

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def tool_choice_in_effect(self) -> ToolChoice:
        """The tool_choice that applies: "auto" when tools are given without one, "none" without tools."""
        return effective_choice(self.tools, self.tool_choice)

    def output_constraint(self) -> tuple[StructuredOutputs | None, str | None]:
        """A named or "required" tool_choice constrains the output to its calls; otherwise response_format or
        structured_outputs may."""
        parallel = self.parallel_tool_calls is not False
        constraint, field = tool_constraint(self.tools, self.tool_choice_in_effect(), parallel)
        return (constraint, field) if constraint is not None else super().output_constraint()

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them; None when there are none."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for this request; raises APIError (400) naming the offending field."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._build(max_tokens, default_max_tokens, logprobs)


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt_batch(field: str, value: Any) -> Any:
    """`value` when it is a string, a list of strings, a list of token ids or a list of token-id lists (the prompt
    shapes of completions and embeddings); ValueError naming `field` otherwise."""
    if isinstance(value, str):
        return value
    shape = f"{field} must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if not isinstance(value, list) or not value:
        raise ValueError(shape + (" (got an empty list)" if value == [] else ""))
    if all(isinstance(p, str) for p in value) or all(is_token_id(t) for t in value):
        return value
    if all(isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in value):
        return value
    raise ValueError(shape)


def prompt_batch(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A checked prompt (check_prompt_batch) as a batch: each entry a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if all(isinstance(t, int) for t in value):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


class TokenizeRequest(LenientModel):
    """POST /tokenize: a completion prompt (text or token ids) or a conversation, rendered as chat renders it."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)


class DetokenizeRequest(LenientModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
