"""OpenAI function tools and tool_choice: their request models, and the output constraint and tool-call parser
that each choice asks for."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from pagerail.cluster.frontend.errors import bad_request
from pagerail.cluster.frontend.tool_calls import (
    ContentParser,
    FirstCallOnly,
    NamedCallParser,
    RequiredCallsParser,
    ToolCallParser,
    auto_parser,
)
from pagerail.common.structured_outputs import StructuredOutputs

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MODES = ("none", "auto", "required")
# A function declared without parameters takes none: its arguments are `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_CHOICE_SHAPE = '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not TOOL_NAME.match(value):
            raise ValueError(f"name must be 1 to 64 letters, digits, underscores or dashes, got {value!r}")
        return value

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # The arguments of a call are a JSON object, so the schema describes one.
        if value is not None and value.get("type", "object") != "object":
            raise ValueError(f"parameters must be a JSON schema of type 'object', got type {value['type']!r}")
        return value

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class ToolDefinition(_Strict):
    """One entry of `tools`: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice naming one function: the output is a call of it."""

    type: Literal["function"] = "function"
    function: NamedFunction


class CalledFunction(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    """A call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = str | NamedToolChoice


def check_distinct(tools: list[ToolDefinition]) -> None:
    """A named tool_choice and the parsed calls refer to tools by name, so each name is one tool."""
    seen: set[str] = set()
    for tool in tools:
        if tool.function.name in seen:
            raise ValueError(f"tools must have distinct function names; {tool.function.name!r} appears twice")
        seen.add(tool.function.name)


def parse_tool_choice(value: Any, tools: list[ToolDefinition] | None) -> ToolChoice | None:
    """tool_choice as a mode ("none", "auto", "required") or a NamedToolChoice; raises ValueError naming it."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in MODES:
            raise ValueError(f"tool_choice must be {_CHOICE_SHAPE}, got {value!r}")
        choice: ToolChoice = value
    else:
        shape = value if isinstance(value, dict) else {}
        function = shape.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if shape.get("type") != "function" or not isinstance(name, str):
            raise ValueError(f"tool_choice must be {_CHOICE_SHAPE}")
        choice = NamedToolChoice(function=NamedFunction(name=name))
    if choice == "none":
        return choice
    if not tools:
        raise ValueError("tool_choice requires tools; send tools or leave tool_choice out")
    if isinstance(choice, NamedToolChoice) and all(t.function.name != choice.function.name for t in tools):
        names = ", ".join(repr(t.function.name) for t in tools)
        raise ValueError(f"tool_choice must name one of the tools ({names}), got {choice.function.name!r}")
    return choice


def effective_choice(tools: list[ToolDefinition] | None, choice: ToolChoice | None) -> ToolChoice:
    """What the request asks for: "auto" when tools are given without a choice, "none" without tools."""
    if not tools:
        return "none"
    return choice if choice is not None else "auto"


def tool_constraint(
    tools: list[ToolDefinition] | None, choice: ToolChoice, parallel: bool
) -> tuple[StructuredOutputs | None, str | None]:
    """The output constraint of a named or "required" tool_choice, and the request field to name when it does not
    compile; (None, None) for "auto" and "none", where the model writes its calls its own way."""
    if isinstance(choice, NamedToolChoice):
        index, tool = next((i, t) for i, t in enumerate(tools or []) if t.function.name == choice.function.name)
        field = f"tools[{index}].function.parameters"
        return _built(field, json=tool.function.arguments_schema()), field
    if choice == "required":
        return _built("tools", json=required_schema(tools or [], parallel)), "tools"
    return None, None


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of at least one (at most one without parallel calls) `{"name": <tool>, "parameters": ...}`.

    Each tool's schema moves under `$defs` and its own `#...` references are rebased there, so schemas that
    reference their own definitions keep working inside the array.
    """
    definitions, options = {}, []
    for tool in tools:
        name = tool.function.name
        definitions[name] = _rebased(tool.function.arguments_schema(), f"#/$defs/{name}")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{name}"}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "items": options[0] if len(options) == 1 else {"anyOf": options},
        "minItems": 1,
        "$defs": definitions,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebased(schema: Any, base: str) -> Any:
    if isinstance(schema, dict):
        return {
            key: base + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#") else
            _rebased(value, base)
            for key, value in schema.items()
        }  # fmt: skip
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    return schema


def _built(field: str, **values: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**values)
    except ValueError as error:
        raise bad_request(f"{field} cannot be used as a constraint: {error}", field) from None


def output_parser(choice: ToolChoice, auto_format: str, parallel: bool) -> ToolCallParser:
    """How a choice's text becomes content and tool calls; `auto_format` names the model's own call format."""
    if isinstance(choice, NamedToolChoice):
        return NamedCallParser(choice.function.name)
    if choice == "required":
        return RequiredCallsParser()
    if choice == "auto":
        parser = auto_parser(auto_format)
        return parser if parallel else FirstCallOnly(parser)
    return ContentParser()
