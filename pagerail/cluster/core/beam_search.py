"""Beam search through any engine client: each step asks the engine for every live beam's next-token logprobs
(one one-token request per beam, its prompt the beam's whole sequence) and keeps the best beams.

The beams of a step are requests that share their prompt and earlier output: the prefix cache gives each one the
full KV blocks its parent computed, so beams hold the blocks they have in common once (copy-on-write in effect: a
beam that diverges writes only its own last block), and only the tail since the last full block is computed again.

The selection follows Hugging Face transformers' `generate(num_beams=..., length_penalty=...)` with its default
`early_stopping=False`, so the two give the same sequences on the same weights:
- from all live beams, the best `2 × beams` (3 × with two end-of-sequence ids, ...) continuations by summed logprob;
- a continuation that ends the sequence (an end-of-sequence token, or the last allowed token) finishes a beam when
  it ranks among the first `beams`, scored `summed logprob / generated length ** length_penalty`; the rest go on;
- the search stops once `beams` sequences finished and the best live beam, scored at its current length, cannot
  beat the worst of them; the answer is the finished sequences, best score first.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import MAX_LOGPROBS, SamplingParams, check_int


class BeamSearchFailed(RuntimeError):
    """The engine ended a beam's step without its logprobs (a worker failure, an abort)."""


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam-search settings: `beam_width` beams, up to `max_tokens` new tokens each; a length penalty above 0
    favours longer sequences, below 0 shorter ones."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        # Each step reads 2 × beam_width candidates per beam from the engine's top logprobs.
        check_int("beam_width", self.beam_width, low=1, high=MAX_LOGPROBS // 2)
        check_int("max_tokens", self.max_tokens, low=1)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise ValueError(f"length_penalty must be a finite number, got {penalty!r}")
        object.__setattr__(self, "length_penalty", float(penalty))


@dataclass
class BeamSequence:
    """One finished beam: its new tokens (an ending end-of-sequence token included), their summed logprob, and its
    score (the sum over the length penalty) by which the beams are ranked."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (an end-of-sequence token) or "length"
    logprobs: list[float] = field(default_factory=list)  # per new token
    text: str = ""  # the new tokens' text, filled in by the front door that has the tokenizer


@dataclass
class BeamSearchOutput:
    """One prompt's beam search: its finished beams, best score first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


@dataclass
class _Beam:
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[float]


async def beam_search(
    engine: EngineClient,
    prompt_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    eos_token_ids: frozenset[int] = frozenset(),
    lora: LoRARequest | None = None,
) -> list[BeamSequence]:
    """The `beam_width` best sequences after `prompt_ids`, best first, with LoRA adapter `lora` (None: the base
    model). `eos_token_ids` end a beam (unless the params ignore them); a beam's prompt plus output stays within
    the engine's context."""
    width = params.beam_width
    ends = frozenset() if params.ignore_eos else eos_token_ids
    # transformers keeps one more set of `width` candidates per end token, so enough non-ending ones go on.
    keep = max(2, 1 + len(ends)) * width
    if keep > MAX_LOGPROBS:
        raise ValueError(f"beam_width × (end-of-sequence ids + 1) must be at most {MAX_LOGPROBS}, got {keep}")
    max_tokens = min(params.max_tokens, engine.max_model_len - len(prompt_ids))
    if max_tokens < 1:
        limit = engine.max_model_len
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) leaves no room for output in the context of {limit}")
    step_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=keep, speculative=False)
    live = [_Beam([], 0.0, [])]
    finished: list[BeamSequence] = []
    improvable = True
    for step in range(max_tokens):
        generated = step + 1
        tops = await asyncio.gather(
            *(_next_logprobs(engine, f"{request_id}-{step}-{n}", prompt_ids + beam.token_ids, step_params, lora)
              for n, beam in enumerate(live))
        )  # fmt: skip
        candidates = sorted(
            ((beam.cumulative_logprob + logprob, number, token, logprob)
             for number, (beam, top) in enumerate(zip(live, tops, strict=True)) for token, logprob in top.items()),
            key=lambda c: -c[0],
        )[:keep]  # fmt: skip
        going_on: list[_Beam] = []
        for rank, (total, number, token, logprob) in enumerate(candidates):
            parent = live[number]
            beam = _Beam(parent.token_ids + [token], total, parent.logprobs + [logprob])
            ended = token in ends
            if not ended and generated < max_tokens:
                if len(going_on) < width:
                    going_on.append(beam)
                continue
            if rank < width and improvable:
                score = total / generated**params.length_penalty
                reason = "stop" if ended else "length"
                finished.append(BeamSequence(beam.token_ids, total, score, reason, beam.logprobs))
        finished = sorted(finished, key=lambda s: -s.score)[:width]
        live = going_on
        if live and improvable and len(finished) == width:
            best_possible = live[0].cumulative_logprob / generated**params.length_penalty
            improvable = best_possible > finished[-1].score
        if not live or not improvable:
            break
    return finished


async def _next_logprobs(
    engine: EngineClient, request_id: str, sequence: list[int], params: SamplingParams, lora: LoRARequest | None
) -> dict:
    """The engine's top logprobs for the token after `sequence`."""
    last = None
    async for delta in engine.generate(EngineRequest(request_id, sequence, params, stream=False, lora=lora)):
        last = delta
        if delta.top_logprobs:
            return delta.top_logprobs[0]
    reason = (last.error if last is not None else None) or "the engine ended the step without logprobs"
    raise BeamSearchFailed(f"beam search step {request_id} failed: {reason}")
