"""The choices of a completions or chat request with vLLM's use_beam_search: each prompt's n best of n beams."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pagerail.cluster.core.beam_search import BeamSearchFailed, beam_search
from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.frontend.errors import from_value_error, unavailable
from pagerail.cluster.frontend.generation import Usage
from pagerail.common.lora import LoRARequest


@dataclass
class BeamChoice:
    text: str
    finish_reason: str


async def beam_choices(
    engine: EngineClient,
    tokenizer,
    body,
    prompts: list[list[int]],
    request_id: str,
    usage: Usage,
    lora: LoRARequest | None = None,
) -> list[list[BeamChoice]]:
    """Per prompt, its beams best first as choices' text and finish reason, with adapter `lora` (None: the base
    model); `usage` counts the prompts and the returned beams' tokens. Bad settings are a 400 naming the field, a
    failed step a 503."""

    async def one(number: int, prompt: list[int]) -> list[BeamChoice]:
        params = body.beam_search_params(default_max_tokens=max(1, engine.max_model_len - len(prompt)))
        sequences = await beam_search(engine, prompt, params, f"{request_id}-{number}", engine.eos_token_ids, lora)
        usage.prompt_tokens += len(prompt)
        usage.completion_tokens += sum(len(s.token_ids) for s in sequences)
        skip = body.skip_special_tokens is not False
        return [BeamChoice(tokenizer.decode(s.token_ids, skip_special_tokens=skip), s.finish_reason) for s in sequences]

    try:
        return list(await asyncio.gather(*(one(number, prompt) for number, prompt in enumerate(prompts))))
    except BeamSearchFailed as error:
        raise unavailable(str(error)) from None
    except ValueError as error:
        raise from_value_error(error) from None
