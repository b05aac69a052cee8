"""Compiles a request's output constraint before anything is queued; one that does not compile is a 400 naming
the request field the client wrote it in."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cluster.core.sampling_params import SamplingParams
from cluster.core.structured_outputs import StructuredOutputs
from cluster.frontend.constraints import check_constraint_of
from cluster.frontend.errors import bad_request
from cluster.frontend.tool_choice import ToolDefinition
from common.grammar import GrammarError


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
