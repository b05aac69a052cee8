"""A request's output constraint (JSON schema, any JSON, regex, choice or grammar), checked for shape when built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Bounds on what one request may ask the grammar engine to build; each is far above any real schema.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 4096

# The kinds the ranks know, in the order the fields are checked.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint on the generated text, mirroring vLLM's `structured_outputs` names.

    json: a JSON schema (a dict or its JSON text); json_object: any JSON object; regex: a regular expression the
    whole output matches; choice: one of these strings; grammar: an EBNF/GBNF (`root ::= ...`) or Lark grammar.
    Whether the constraint compiles is checked against the tokenizer by common.grammar before a request is queued.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if _is_set(name, getattr(self, name))]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} must be at most {MAX_SPEC_CHARS} characters")

    @classmethod
    def from_spec(cls, kind: str, spec: str) -> StructuredOutputs:
        """The constraint whose `kind` and `spec` these are (the inverse of the two properties below)."""
        if kind not in KINDS:
            raise ValueError(f"structured_outputs kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "choice":
            try:
                return cls(choice=json.loads(spec))
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.choice is not a JSON list: {error}") from None
        return cls(**{kind: spec})

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(name for name in KINDS if _is_set(name, getattr(self, name)))

    @property
    def spec(self) -> str:
        """The constraint as text, canonical for its kind: the cache key of its compiled grammar."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        return getattr(self, kind)


def _is_set(name: str, value: object) -> bool:
    return value is not False if name == "json_object" else value is not None


def _schema_text(schema: object) -> str:
    """A JSON schema given as a dict (or bool) or as JSON text, as canonical JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    try:
        # Key order is kept: it is the order the properties are generated in.
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"structured_outputs.json cannot be written as JSON: {error}") from None


def _choices(choices: object) -> tuple[str, ...]:
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise ValueError("structured_outputs.choice must be a list of strings")
    if not choices:
        raise ValueError("structured_outputs.choice must hold at least one string")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice must hold at most {MAX_CHOICES} strings, got {len(choices)}")
    for choice in choices:
        if not isinstance(choice, str) or not choice:
            raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {choice!r}")
    return tuple(choices)
