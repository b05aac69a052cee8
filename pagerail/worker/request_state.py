"""What a worker remembers about each request between steps, and how it applies a step's deltas."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagerail.common.sampling_params import SamplingParams
from pagerail.common.sampling_wire import sampling_from_step
from pagerail.proto import step_pb2
from pagerail.worker.sampler import SamplingRow


@dataclass(slots=True)
class RequestState:
    """Tokens, blocks and progress of one request on this worker."""

    handle: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams  # decoded from the step message once, when the request arrives
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    # Set by each step's message.
    num_scheduled_tokens: int = 0
    skip_sampling: bool = False
    # Counts replacements of block_ids (preemption, resumption), so copies of it kept elsewhere (the persistent
    # block table) know to rewrite rather than append.
    block_epoch: int = 0
    # The persistent block-table row that holds block_ids (set by InputBuffers once it wrote them there), or -1
    # while the row is not known to be current: every change of block_ids below resets it.
    table_row: int = -1
    # Every token is the argmax of the (masked) logits: greedy, no penalties, no logprobs, no banned tokens.
    # Fixed for the request's life, so a step of such requests skips building per-row sampling settings.
    argmax_only: bool = False
    # Speculative decoding: the draft tokens the head made room for after this step's token, and the drafts
    # proposed for this step (appended to token_ids until the step keeps or drops them).
    num_lookahead: int = 0
    drafts: list[int] | None = None
    # An embedding request: how it pools its prompt ("last", "mean", "cls"; empty for generation), and what it
    # has pooled so far (a running sum for "mean", the first row for "cls").
    pooling: str = ""
    pooled: torch.Tensor | None = None
    # The LoRA adapter it runs with (0: the base model).
    lora_id: int = 0

    def seeded_generator(self, ahead: int = 0) -> torch.Generator | None:
        """The generator for this request's next token (or the one `ahead` positions after it, for a draft's
        row, on a generator of its own), reseeded from (seed, output position).

        Deriving the state from the position rather than carrying it from step to step keeps seeded
        output identical after preemption, after a worker group restarts with fresh state, and with
        speculation, whose rows sample the positions that plain decoding would sample one by one.
        """
        if self.generator is None:
            return None
        drafted = len(self.drafts) if self.drafts else 0
        position = len(self.token_ids) - drafted - self.num_prompt_tokens + ahead
        generator = self.generator if not ahead else torch.Generator(device=self.generator.device)
        generator.manual_seed((self.sampling.seed * 0x9E3779B97F4A7C15 + position) & 0xFFFFFFFFFFFFFFFF)
        return generator


def sampling_row(state: RequestState, ahead: int = 0) -> SamplingRow:
    """The sampler's view of one request (at `ahead` positions past its next token, for a draft's row); its
    token history, for penalties, is kept apart (PenaltyState)."""
    params = state.sampling
    drafted = len(state.drafts) if state.drafts else 0
    num_outputs = len(state.token_ids) - drafted - state.num_prompt_tokens + ahead
    banned = tuple(params.stop_token_ids) if num_outputs < params.min_tokens else ()
    if params.bad_words_token_ids:
        end = len(state.token_ids) - drafted + ahead
        banned += bad_word_bans(params.bad_words_token_ids, state.token_ids[state.num_prompt_tokens : end])
    return _row_settings(params, state.seeded_generator(ahead), banned)


def bad_word_bans(sequences: tuple[tuple[int, ...], ...], outputs: list[int]) -> tuple[int, ...]:
    """The tokens that would complete a bad word now: each sequence's last token where the outputs end with the
    rest of it (a one-token word: always)."""
    banned = []
    for sequence in sequences:
        before = len(sequence) - 1
        if before == 0 or (len(outputs) >= before and tuple(outputs[-before:]) == sequence[:-1]):
            banned.append(sequence[-1])
    return tuple(banned)


def argmax_only(sampling: SamplingParams) -> bool:
    """True when every token of the request is the argmax of its logits, whatever its outputs so far."""
    row = _row_settings(sampling)
    # Stop tokens are banned until min_tokens outputs exist: the one setting that changes with the outputs.
    banned_some_time = (sampling.min_tokens > 0 and bool(sampling.stop_token_ids)) or bool(sampling.bad_words_token_ids)
    plain = not row.has_penalties and not row.reshapes_logits
    return row.greedy and plain and row.num_logprobs is None and not banned_some_time


def _row_settings(
    params: SamplingParams, generator: torch.Generator | None = None, banned: tuple[int, ...] = ()
) -> SamplingRow:
    """The sampler's row of a request's settings this step; top_k <= 0 (0 or vLLM's -1) is off in the sampler."""
    return SamplingRow(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        num_logprobs=params.logprobs,
        generator=generator,
        banned_token_ids=banned,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
    )


class RequestStates:
    """The per-request state table, updated by each StepBatch."""

    def __init__(self, device: torch.device, on_drop: Callable[[RequestState], None] | None = None) -> None:
        self.device = device
        self.states: dict[int, RequestState] = {}
        # Told of every state this table forgets, so per-request rows kept elsewhere are freed with it.
        self.on_drop = on_drop
        # States whose tokens are not all the argmax of their logits; none (the common case) spares the sampler a
        # look at each request of a step.
        self._num_not_argmax_only = 0
        self._num_prompt_logprobs = 0  # states that score their prompt: a step looks for their rows
        self._num_pooling = 0  # embedding requests: a step pools their prompt rows
        self._num_lora = 0  # requests with a LoRA adapter: a step groups their rows by adapter slot

    @property
    def all_argmax_only(self) -> bool:
        """True when every request held here samples each token as the argmax of its logits."""
        return not self._num_not_argmax_only

    @property
    def any_lora(self) -> bool:
        """True when some request held here runs with a LoRA adapter."""
        return bool(self._num_lora)

    @property
    def any_pooling(self) -> bool:
        """True when some request held here is an embedding request."""
        return bool(self._num_pooling)

    @property
    def any_prompt_logprobs(self) -> bool:
        """True when some request held here asked for its prompt tokens' logprobs."""
        return bool(self._num_prompt_logprobs)

    def apply(self, batch: step_pb2.StepBatch) -> list[RequestState]:
        """Apply one step's deltas; return the states scheduled in this step, in message order."""
        states = self.states
        for handle in batch.finished:
            self._drop(states.pop(handle, None))
        for handle in batch.preempted:
            state = states.get(handle)
            if state is not None:
                state.block_ids = []
                state.block_epoch += 1
                state.table_row = -1
                state.num_computed_tokens = 0
        scheduled: list[RequestState] = []
        for new in batch.new_requests:
            sampling = sampling_from_step(new.sampling)
            state = RequestState(
                handle=new.handle,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling=sampling,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=self._generator(sampling),
                num_scheduled_tokens=new.num_scheduled_tokens,
                skip_sampling=new.skip_sampling,
                argmax_only=argmax_only(sampling),
                pooling=new.pooling,
                lora_id=new.lora_id,
            )
            self._drop(states.get(new.handle))
            states[new.handle] = state
            if not state.argmax_only:
                self._num_not_argmax_only += 1
            if sampling.prompt_logprobs is not None:
                self._num_prompt_logprobs += 1
            if state.pooling:
                self._num_pooling += 1
            if state.lora_id:
                self._num_lora += 1
            scheduled.append(state)
        for delta in batch.cached_requests:
            state = states[delta.handle]
            if delta.new_token_ids:
                state.token_ids.extend(delta.new_token_ids)
            if delta.num_prompt_tokens:
                state.num_prompt_tokens = delta.num_prompt_tokens
            if delta.resumed:
                state.block_ids = list(delta.new_block_ids)
                state.block_epoch += 1
                state.table_row = -1
                state.num_computed_tokens = delta.num_computed_tokens
            elif delta.new_block_ids:
                state.block_ids.extend(delta.new_block_ids)
                state.table_row = -1
            state.num_scheduled_tokens = delta.num_scheduled_tokens
            state.skip_sampling = delta.skip_sampling
            state.num_lookahead = delta.num_lookahead_tokens
            scheduled.append(state)
        for handle in batch.decode_handles:
            # A CachedRequest with only its handle and one token to compute and sample.
            state = states[handle]
            state.num_scheduled_tokens = 1
            state.skip_sampling = False
            state.num_lookahead = 0
            scheduled.append(state)
        return scheduled

    def _drop(self, state: RequestState | None) -> None:
        """A state leaves the table (finished, or replaced by a new request under its handle)."""
        if state is None:
            return
        if not state.argmax_only:
            self._num_not_argmax_only -= 1
        if state.sampling.prompt_logprobs is not None:
            self._num_prompt_logprobs -= 1
        if state.pooling:
            self._num_pooling -= 1
        if state.lora_id:
            self._num_lora -= 1
        if self.on_drop is not None:
            self.on_drop(state)

    def _generator(self, sampling: SamplingParams) -> torch.Generator | None:
        if sampling.seed is None:
            return None
        return torch.Generator(device=self.device)
