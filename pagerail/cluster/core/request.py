"""A request as the head sees it: the envelope it came in, tokens so far, how many are in the KV cache, and why
it stopped."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagerail.cluster.core.block_table import root_hash
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # A streaming-input session whose chunk so far is computed; its blocks stay allocated.
    AWAITING_INPUT = "awaiting_input"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # By value: an Enum member hashes in Python, a str in C, and this is asked per request per step.
        return self._value_ in _FINISHED_VALUES


_FINISHED_VALUES = frozenset(
    status.value
    for status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
)


@dataclass(slots=True)
class Request:
    """One sequence. `num_computed_tokens` catches up with `len(all_token_ids)` step by step:
    that one mechanism covers prefill, chunked prefill, decode, prefix hits and recomputation.

    It holds the envelope the front door made (id, prompt, sampling settings, trace context) by reference; what
    the head adds is its own: the handle, the stop ids with the model's EOS, the tokens and progress.
    """

    envelope: EngineRequest
    handle: int
    # The request's stop token ids and, unless it ignores EOS, the model's.
    stop_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    # Open streaming-input session: more prompt chunks may follow.
    input_open: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    # The prompt (with a session's later chunks), then the outputs: the sequence the KV cache holds.
    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With prompt_logprobs: per prompt position, (logprob, rank, top logprobs) once scored; position 0 stays None.
    prompt_logprobs: list[tuple[float, int, dict[int, float]] | None] | None = None
    # An embedding request's pooled vector, once its prompt was computed to the end.
    pooled: list[float] | None = None
    num_computed_tokens: int = 0
    # Scheduled in steps the ranks have not answered yet: tokens being computed, and tokens being sampled.
    # The scheduler plans the next step as if they were done (its placeholders); the answer confirms them.
    num_inflight_tokens: int = 0
    num_pending_samples: int = 0
    # Bumped whenever the request loses its KV (preempted, or the workers restarted): an answer to a step
    # scheduled before then no longer advances it.
    epoch: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prefix-cache hit on the latest admission
    num_host_cached_tokens: int = 0  # of which the host KV tier held
    error: str | None = None  # why the engine gave up on it, when it did
    # What kind of failure `error` is: "worker_failure" (retriable), "session_idle_timeout", "quarantined".
    error_code: str | None = None
    # When a streaming-input session last started waiting for its next chunk (time.monotonic()).
    idle_since: float | None = None
    # The workers must be sent the full block list and num_computed_tokens with the next step.
    needs_resync: bool = False
    # Speculative decoding may propose drafts for it (no output constraint, no penalties, no open input).
    speculative: bool = False
    # The lookahead of its speculating step in flight (0: none): the most drafts that step may still add, which the
    # blocks of any step scheduled after it must cover.
    spec_in_flight: int = 0
    # The scheduler's plain-decode item for this request and epoch, handed out again every step it decodes
    # (a pagerail.cluster.core.scheduler_output.ScheduledRequest; typed loosely, that module imports this one).
    decode_item: object | None = None
    # Telemetry: when it was first scheduled, got its first and latest token; what the metrics counted.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_reported_tokens: int = 0
    metrics_done: bool = False
    # Times it lost its KV blocks to another request's need (a pooling request never does).
    num_preemptions: int = 0
    # Positions fair share charged its tenant for: a recompute after a preemption is not charged again.
    num_charged_tokens: int = 0

    # Read from the envelope on every step, so kept at hand: the same objects, not copies.
    request_id: str = field(init=False)
    sampling_params: SamplingParams = field(init=False)
    max_tokens: int | None = field(init=False)  # None: up to the context limit
    # A pooling (embedding, classification) request: its whole prompt's blocks are reserved when it is admitted.
    pooling: bool = field(init=False)
    # Its LoRA adapter's id (0: the base model), and where its blocks' hash chain starts (each adapter its own).
    lora_id: int = field(init=False)
    root_hash: int = field(init=False)
    priority: int = field(init=False)  # under the priority policy: lower first, ties by arrival (handle)
    # Flex work only fills spare capacity (service_tier "flex"; the scheduler adds its priority threshold).
    flex: bool = field(init=False)
    tenant: str = field(init=False)  # under fair share: whose virtual token counter its tokens go to
    tenant_weight: float = field(init=False)

    def __post_init__(self) -> None:
        envelope = self.envelope
        self.request_id = envelope.request_id
        self.sampling_params = envelope.params
        self.max_tokens = envelope.params.max_tokens
        self.pooling = envelope.pooling is not None
        self.lora_id = envelope.lora.lora_int_id if envelope.lora is not None else 0
        self.root_hash = root_hash(self.lora_id)
        self.priority = envelope.priority
        self.flex = envelope.service_tier == "flex"
        self.tenant = envelope.tenant
        self.tenant_weight = envelope.tenant_weight
        self.all_token_ids = [*envelope.prompt_token_ids, *self.output_token_ids]
        self.num_prompt_tokens = len(envelope.prompt_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt so far (a streaming-input session's grows chunk by chunk)."""
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def trace_context(self) -> dict[str, str] | None:
        """W3C carrier (traceparent, tracestate) of the frontend's request span; the step spans link to it."""
        return self.envelope.trace_context

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def next_position(self) -> int:
        """Where the next scheduled step starts: after the computed tokens and those of steps in flight."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_expected(self) -> int:
        """The tokens the request will have once every step in flight answered."""
        return len(self.all_token_ids) + self.num_pending_samples

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def awaiting_input(self) -> bool:
        return self.status is RequestStatus.AWAITING_INPUT

    def append_input(self, token_ids: list[int]) -> None:
        """A streaming-input session's next chunk: more prompt (a session has no outputs while its input is open)."""
        self.all_token_ids.extend(token_ids)
        self.num_prompt_tokens += len(token_ids)

    def append_output(
        self,
        token_id: int,
        logprobs: tuple[float, dict[int, float]] | None,
        max_model_len: int,
        constraint_done: bool = False,
    ) -> RequestStatus | None:
        """Append one sampled token (and its logprob with the top ones, when asked for); the reason the request
        finishes on it, or None when it goes on. The only stop rule: every path that appends a token uses it.

        `constraint_done`: the request's output constraint accepts nothing after this token (a closed JSON value).
        """
        outputs = self.output_token_ids
        outputs.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs[0])
            self.top_logprobs.append(logprobs[1])
        if constraint_done or (token_id in self.stop_token_ids and len(outputs) >= self.sampling_params.min_tokens):
            return RequestStatus.FINISHED_STOPPED
        max_tokens = self.max_tokens
        if (max_tokens is not None and len(outputs) >= max_tokens) or len(self.all_token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def ends_in_flight(self, max_model_len: int) -> bool:
        """True when a token still being sampled is the request's last by length: nothing more to schedule."""
        if not self.num_pending_samples:
            return False
        max_tokens = self.max_tokens
        num_outputs = len(self.output_token_ids) + self.num_pending_samples
        return (max_tokens is not None and num_outputs >= max_tokens) or self.num_tokens_expected >= max_model_len
