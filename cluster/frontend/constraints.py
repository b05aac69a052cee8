"""Checks a request's output constraint against the served tokenizer before anything is queued."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.core.sampling_params import SamplingParams
from common.grammar import TOKENIZERS, GrammarError, check_constraint


def check_constraint_now(
    params: SamplingParams, tokenizer: Any, vocab_size: int | None, param: str | None = None
) -> None:
    """Compile the constraint of `params`, if any; raise GrammarError naming `param` (default: its own field).

    Compiled grammars are cached per constraint, so a schema seen before costs a dictionary lookup.
    """
    constraint = params.structured_outputs
    if constraint is None:
        return
    if tokenizer is None:
        raise GrammarError(
            param or "structured_outputs", "constraints are compiled against the tokenizer, and this model has none"
        )
    try:
        check_constraint(constraint.kind, constraint.spec, TOKENIZERS.for_hf(tokenizer, vocab_size))
    except GrammarError as error:
        if param is None:
            raise
        raise GrammarError(param, error.message) from None


async def check_constraint_of(
    params: SamplingParams, tokenizer: Any, vocab_size: int | None, param: str | None = None
) -> None:
    """check_constraint_now off the event loop: the first use of a tokenizer walks its whole vocabulary."""
    if params.structured_outputs is not None:
        await asyncio.to_thread(check_constraint_now, params, tokenizer, vocab_size, param)
