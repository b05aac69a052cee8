"""Request fields that constrain the output (OpenAI's `response_format`, the `structured_outputs` extension) and the
StructuredOutputs they ask for."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from pagerail.cluster.frontend.errors import bad_request
from pagerail.common.structured_outputs import StructuredOutputs

# Older request fields of the same constraints; refused with a pointer to their replacement rather than ignored.
LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_json_object": "json_object",
}


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the output must follow (`strict` is always the case here)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _needs_schema(cls, value: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        if value is None and info.data.get("type") == "json_schema":
            raise ValueError("json_schema is required when type is 'json_schema'")
        return value

    def constrains(self) -> bool:
        return self.type != "text"


class StructuredOutputsField(BaseModel):
    """The `structured_outputs` extension: exactly one of its fields, with vLLM's names."""

    # A misspelt or unknown kind would otherwise leave the output unconstrained without a word.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kind(self) -> str | None:
        """The one constraint set, or None (an error is raised when it is built)."""
        kinds = ("json", "json_object", "regex", "choice", "grammar")
        names = [name for name in kinds if self._value(name) is not None and self._value(name) is not False]
        return names[0] if len(names) == 1 else None

    def _value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)


class ConstrainedOutputFields(BaseModel):
    """The request fields that constrain the output, shared by completions and chat."""

    # As the other request models: unknown fields are ignored, and strict types keep "5" from passing as 5.
    model_config = ConfigDict(extra="ignore", strict=True)

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_json_object: Any = None

    @field_validator("structured_outputs")
    @classmethod
    def _check_one_constraint(cls, value: StructuredOutputsField | None, info: ValidationInfo) -> Any:
        response_format = info.data.get("response_format")
        if value is not None and response_format is not None and response_format.constrains():
            raise ValueError("structured_outputs cannot be combined with a response_format other than 'text'")
        return value

    @field_validator(*LEGACY_FIELDS)
    @classmethod
    def _refuse_legacy(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(
                f"{info.field_name} is not supported; use structured_outputs.{LEGACY_FIELDS[info.field_name]}"
            )
        return value

    def output_constraint(self) -> tuple[StructuredOutputs | None, str | None]:
        """The constraint on the output, and the request field to name when it does not compile."""
        return requested_constraint(self.response_format, self.structured_outputs)


def requested_constraint(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsField | None
) -> tuple[StructuredOutputs | None, str | None]:
    """The constraint a request asks for and the request field to name when it does not compile."""
    if structured_outputs is not None:
        kind = structured_outputs.kind()
        values = structured_outputs.model_dump(by_alias=True, exclude_none=True)
        values = {name: value for name, value in values.items() if value is not False}
        field = f"structured_outputs.{kind}" if kind else "structured_outputs"
        return _built(field, None, **values), field
    if response_format is None or not response_format.constrains():
        return None, None
    if response_format.type == "json_object":
        return _built("response_format", "structured_outputs.json_object", json_object=True), "response_format"
    field = "response_format.json_schema.schema"
    return _built(field, "structured_outputs.json", json=response_format.json_schema.schema_), field


def _built(field: str, own_name: str | None, **values: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**values)
    except ValueError as error:
        # StructuredOutputs names its own fields (`own_name`); the client wrote `field`.
        message = str(error)
        if own_name is not None and message.startswith(own_name):
            message = field + message[len(own_name) :]
        raise bad_request(message, field) from None
