"""One choice's output as its engine deltas arrive: text, stop strings after `min_tokens`, the `n` fan-out rule.

The one output path of the `LLM` API, the HTTP routes and the gRPC service: each of them feeds a choice's deltas
through a `ChoiceState` and gets the same text, token ids, logprobs and finish reason back. Nothing here imports a
server library, so the offline API runs where only torch and transformers are installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest, SiblingGroup
from pagerail.cluster.core.outputs import RequestOutput
from pagerail.cluster.frontend.detokenizer import IncrementalDetokenizer
from pagerail.common.sampling_params import SamplingParams


@dataclass
class ChoiceDelta:
    """New output of one choice since its previous delta; the last one carries finish_reason.

    `token_ids` stop at the token that completed a stop string: tokens the engine produced after it are dropped,
    whichever transport delivered them and however its deltas were merged on the way.
    """

    index: int
    text: str
    token_ids: list[int]
    # Aligned with token_ids when logprobs were asked for: the sampled token's, and {token id: logprob} of the
    # most likely ones.
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why the engine gave up, when it did (finish_reason "abort")
    error_code: str | None = None
    # On the first delta of a request with prompt_logprobs: RequestDelta.prompt_logprobs.
    prompt_logprobs: list | None = None


def fan_out(
    request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, **envelope: Any
) -> list[EngineRequest]:
    """The engine requests of one prompt's `params.n` choices (vLLM's ParentRequest), the only place they are made.

    Choice i is named `{request_id}-{i}` (the request id itself when n is 1; a label the engine never parses); a
    seeded request's choices draw from `seed`, `seed + 1`, ... so they are not copies of each other; siblings share
    a group the router keeps on one replica. `envelope`: EngineRequest's other fields (final, trace_context, stream);
    the tenant is the caller's (CALLER_TENANT) unless given.
    """
    n = params.n
    if n == 1:
        return [EngineRequest(request_id, prompt_token_ids, params, **envelope)]
    return [
        EngineRequest(
            f"{request_id}-{index}",
            prompt_token_ids,
            replace(params, seed=params.seed + index) if params.seed is not None and index else params,
            group=SiblingGroup(request_id, index, n),
            **envelope,
        )
        for index in range(n)
    ]


class ChoiceState:
    """Follows one choice through its deltas. `stopped` turns true when a stop string ended it: the engine
    request is still running then, and the caller aborts it."""

    def __init__(
        self,
        tokenizer: Any | None,
        prompt_token_ids: list[int] | tuple[int, ...],
        params: SamplingParams,
        index: int = 0,
        *,
        detokenize: bool = True,
        incremental: bool = True,
    ) -> None:
        if params.stop and tokenizer is None:
            raise ValueError("stop: stop strings are matched on text, and this model has no tokenizer")
        self.index = index
        self.want_logprobs = params.logprobs is not None
        # Stop strings need the text even when the caller does not.
        self.detokenizer: IncrementalDetokenizer | None = None
        if tokenizer is not None and (detokenize or params.stop):
            self.detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
        # A caller that wants only the whole text (not streamed) and has no stop strings to look for gets it decoded
        # once at the end: two decodes per choice instead of two per token.
        whole = self.detokenizer is not None and not incremental and not params.stop
        self._held: list[int] | None = [] if whole else None
        self.num_output_tokens = 0  # kept so far: never past a stop string
        self.finish_reason: str | None = None
        self.stopped = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, delta: RequestDelta) -> ChoiceDelta:
        """The caller's view of the engine's next delta of this choice."""
        token_ids = delta.token_ids
        text = ""
        reason = (delta.finish_reason or "stop") if delta.finished else None
        detokenizer = self.detokenizer
        if self._held is not None:
            self._held.extend(token_ids)
            if reason is not None:
                text = detokenizer.add(self._held) + detokenizer.flush()
        elif detokenizer is not None:
            text = detokenizer.add(token_ids)
            if detokenizer.stopped:
                self.stopped = not delta.finished
                reason = "stop"
                token_ids = token_ids[: detokenizer.num_output_tokens - self.num_output_tokens]
            elif reason is not None:
                text += detokenizer.flush()
        self.num_output_tokens += len(token_ids)
        self.finish_reason = reason
        out = ChoiceDelta(self.index, text, token_ids, finish_reason=reason, num_cached_tokens=delta.num_cached_tokens)
        if self.want_logprobs:
            out.logprobs = delta.logprobs[: len(token_ids)]
            out.top_logprobs = delta.top_logprobs[: len(token_ids)]
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        if reason is not None and delta.error and not self.stopped:
            out.error, out.error_code = delta.error, delta.error_code
        return out


def append_choice(output: RequestOutput, delta: ChoiceDelta) -> None:
    """Fold one choice's delta into the `LLM` API's result for its prompt."""
    completion = output.outputs[delta.index]
    completion.text += delta.text
    completion.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        # Per token: {token id: logprob}, the sampled token first, then the most likely ones.
        entries = completion.logprobs if completion.logprobs is not None else []
        for token, logprob, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs, strict=True):
            entries.append({token: logprob, **top})
        completion.logprobs = entries
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(delta.logprobs)
    if delta.prompt_logprobs is not None and output.prompt_logprobs is None:
        tokens = output.prompt_token_ids
        output.prompt_logprobs = [
            None if entry is None else {tokens[position]: entry[0], **entry[2]}
            for position, entry in enumerate(delta.prompt_logprobs)
        ]
    output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)
    if delta.finish_reason is not None:
        completion.finish_reason = delta.finish_reason
        completion.error = delta.error
