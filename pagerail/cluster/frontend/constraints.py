"""Checks a request's output constraint against the served tokenizer before anything is queued; over HTTP one that
does not compile is a 400 naming the request field the client wrote it in."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from pagerail.cluster.frontend.errors import bad_request
from pagerail.cluster.frontend.tool_choice import ToolDefinition
from pagerail.common.grammar import TOKENIZERS, GrammarError, check_constraint
from pagerail.common.sampling_params import SamplingParams
from pagerail.common.structured_outputs import StructuredOutputs


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


async def check_output_constraint(
    params: SamplingParams,
    tokenizer: Any,
    vocab_size: int | None,
    field: str | None,
    tools: list[ToolDefinition] | None = None,
) -> None:
    """Raise APIError(400) when the constraint of `params` does not compile; `field` is where it came from.

    The constraint of tool_choice "required" joins every tool's schema, so its failure is traced to the first
    tool whose schema does not compile alone.
    """
    try:
        await check_constraint_of(params, tokenizer, vocab_size, param=field)
    except GrammarError as error:
        failing = await _failing_tool(params, tokenizer, vocab_size, tools) if field == "tools" and tools else None
        raise _invalid(failing or error) from None


async def _failing_tool(
    params: SamplingParams, tokenizer: Any, vocab_size: int | None, tools: list[ToolDefinition]
) -> GrammarError | None:
    for index, tool in enumerate(tools):
        alone = replace(params, structured_outputs=StructuredOutputs(json=tool.function.arguments_schema()))
        try:
            await check_constraint_of(alone, tokenizer, vocab_size, param=f"tools[{index}].function.parameters")
        except GrammarError as error:
            return error
    return None


def _invalid(error: GrammarError):
    return bad_request(f"{error.field} is invalid: {error.message}", error.field)
