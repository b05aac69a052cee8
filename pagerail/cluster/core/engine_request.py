"""The one typed envelope a request travels in from the front door to the engine core, validated when built."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import SamplingParams, check_int

__all__ = ["POOLING_TYPES", "EngineRequest", "SiblingGroup"]

# How an embedding request pools its prompt's final hidden states (vLLM's LAST, MEAN and CLS).
POOLING_TYPES = ("last", "mean", "cls")


# A request's priority: what gRPC's int32 carries, the same bounds on every API.
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1
# OpenAI's service tiers a request may ask for: "flex" is batch work that only fills spare capacity; "auto" is
# "default" here.
SERVICE_TIERS = ("auto", "default", "flex")


def engine_service_tier(value: str | None) -> str:
    """A requested service tier as the engine takes it: "flex", or "default" for every interactive request (None,
    empty, "auto" or "default"); ValueError naming `service_tier` for any other."""
    if value not in (None, "", *SERVICE_TIERS):
        raise ValueError(f"service_tier must be empty or one of {', '.join(SERVICE_TIERS)}, got {value!r}")
    return "flex" if value == "flex" else "default"


# The tenant of a request whose key belongs to no tenant of the server's tenants file (or that has no key).
DEFAULT_TENANT_NAME = "default"
# The tenant (name, weight) of the API call being served in this context: a frontend sets it around each call, and
# every engine request made for the call (its choices, an embedding's inputs, a beam search's steps) takes it
# unless it is given its own.
CALLER_TENANT: ContextVar[tuple[str, float]] = ContextVar("caller_tenant", default=(DEFAULT_TENANT_NAME, 1.0))


@dataclass(frozen=True, slots=True)
class SiblingGroup:
    """Names one of the `size` sibling choices (`n`) of one prompt: the router keeps siblings together."""

    parent_id: str
    index: int
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.parent_id, str) or not self.parent_id:
            raise ValueError(f"group.parent_id must be a non-empty str, got {self.parent_id!r}")
        check_int("group.size", self.size, low=1)
        check_int("group.index", self.index, low=0)
        if self.index >= self.size:
            raise ValueError(f"group.index must be < group.size ({self.size}), got {self.index}")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A token-level request as every engine client and the engine core receive it.

    `resumed_output_token_ids` is the resume offset: output tokens this request already produced elsewhere (a
    replica that failed). The engine continues after them as after a preemption, so per-position seeds, penalty
    counts, `max_tokens` and `min_tokens` go on exactly where the first run stopped; they are never sent again.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # False: the first chunk of a streaming-input session; later chunks arrive through append_input.
    final: bool = True
    # W3C carrier (traceparent, tracestate) of the caller's request span, which the engine's step spans link to.
    trace_context: Mapping[str, str] | None = None
    arrival_time: float = field(default_factory=time.time)  # wall clock: comparable across processes
    resumed_output_token_ids: tuple[int, ...] = ()
    group: SiblingGroup | None = None
    # False: the caller wants the output once, when the request ends (no delta per step to make and hand over).
    stream: bool = True
    # An embedding request: the prompt's final hidden states pooled into one vector ("last" token, "mean" over the
    # prompt, or "cls", its first token), returned with the request's end; None: a generation request.
    pooling: str | None = None
    # The LoRA adapter it runs with; None: the base model.
    lora: LoRARequest | None = None
    # Under the priority scheduling policy, lower is served first (ties by arrival); ignored under fcfs.
    priority: int = 0
    # "flex": work that only fills spare capacity (see SchedulerConfig); "default" (or "auto"): interactive.
    service_tier: str = "default"
    # Its tenant (a label from the server's tenants file) and that tenant's weight: under fair share, tenants are
    # given tokens in proportion to their weights.
    tenant: str = field(default_factory=lambda: CALLER_TENANT.get()[0])
    tenant_weight: float = field(default_factory=lambda: CALLER_TENANT.get()[1])

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        # Lists are accepted for convenience and frozen here: the envelope must not change on its way.
        object.__setattr__(self, "prompt_token_ids", _token_tuple("prompt_token_ids", self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must contain at least one token")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        if not isinstance(self.final, bool):
            raise ValueError(f"final must be a bool, got {self.final!r}")
        if not isinstance(self.stream, bool):
            raise ValueError(f"stream must be a bool, got {self.stream!r}")
        if self.trace_context is not None:
            if not isinstance(self.trace_context, Mapping) or not all(
                isinstance(key, str) and isinstance(value, str) for key, value in self.trace_context.items()
            ):
                raise ValueError("trace_context must be a mapping of str to str or None")
            object.__setattr__(self, "trace_context", dict(self.trace_context))
        if isinstance(self.arrival_time, bool) or not isinstance(self.arrival_time, (int, float)):
            raise ValueError(f"arrival_time must be a number, got {self.arrival_time!r}")
        resumed = _token_tuple("resumed_output_token_ids", self.resumed_output_token_ids)
        object.__setattr__(self, "resumed_output_token_ids", resumed)
        if resumed and not self.final:
            # A session's prompt is still growing: there is no fixed prompt for the outputs to follow.
            raise ValueError("resumed_output_token_ids require final=True (a streaming-input session cannot resume)")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.lora is not None and not isinstance(self.lora, LoRARequest):
            raise ValueError(f"lora must be a LoRARequest or None, got {type(self.lora).__name__}")
        if type(self.priority) is not int or not MIN_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")
        if self.service_tier not in SERVICE_TIERS:
            raise ValueError(f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {self.service_tier!r}")
        if not isinstance(self.tenant, str) or not 0 < len(self.tenant) <= 64:
            raise ValueError(f"tenant must be a str of 1 to 64 characters, got {self.tenant!r}")
        weight = self.tenant_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise ValueError(f"tenant_weight must be a finite number > 0, got {weight!r}")
        if self.group is not None and not isinstance(self.group, SiblingGroup):
            raise ValueError(f"group must be a SiblingGroup or None, got {type(self.group).__name__}")

    @property
    def num_resumed_tokens(self) -> int:
        return len(self.resumed_output_token_ids)

    def resumed(self, output_token_ids: Sequence[int]) -> EngineRequest:
        """The same request continuing after `output_token_ids` (its outputs so far, e.g. from a failed replica)."""
        return replace(self, resumed_output_token_ids=tuple(output_token_ids))


def _token_tuple(name: str, token_ids: object) -> tuple[int, ...]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise ValueError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    tokens = tuple(token_ids)
    # Builtins only for the common, valid prompt (thousands of tokens); exact `int` also refuses bools.
    if tokens and not ({*map(type, tokens)} == {int} and min(tokens) >= 0):
        bad = next(token for token in tokens if type(token) is not int or token < 0)
        raise ValueError(f"{name} must be ints >= 0, got {bad!r}")
    return tokens
