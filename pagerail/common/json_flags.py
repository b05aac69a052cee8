"""Flags whose value is a JSON object (`--speculative-config`, `--pooler-config`): parsed once, errors naming them."""

from __future__ import annotations

import json
from typing import Any


def json_object(name: str, value: Any) -> dict:
    """`value` (a dict, or a JSON object's text) as a dict; ValueError naming the flag `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {type(value).__name__}")
    return value
