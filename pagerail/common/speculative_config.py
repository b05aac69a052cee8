"""Speculative decoding's settings in vLLM's shape (`speculative_config`), validated where they are given: a field
outside its limits is refused naming the field and why."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagerail.common.json_flags import json_object

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
# Methods that read a model of their own (`model`).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How each decode step proposes up to `num_speculative_tokens` tokens for the target model to verify.

    ngram: the longest suffix of the sequence, between `prompt_lookup_min` and `prompt_lookup_max` tokens, that
    occurred earlier in it proposes the tokens that followed it there. draft_model / eagle / eagle3: `model`
    proposes them (a small model sharing the target's tokenizer, or a draft head reading its hidden states).
    `disable_by_batch_size`: no speculation in steps with at least this many running sequences (None: the
    engine backs off by itself when verification costs more than it saves).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            limit = MAX_SPECULATIVE_TOKENS
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in 1..{limit}, got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.method in MODEL_METHODS and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}: the draft's path")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model is not read by method 'ngram'; leave it out")
        batch = self.disable_by_batch_size
        if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {batch!r}")


_FIELDS = {f.name for f in fields(SpeculativeConfig)}


def speculative_config_from(value: Any) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict, a JSON object's text (the `--speculative-config` flag) or itself."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = json_object("speculative_config", value)
    unknown = sorted(set(value) - _FIELDS)
    if unknown:
        raise ValueError(f"speculative_config has unknown fields {unknown}; known: {sorted(_FIELDS)}")
    for name in ("method", "num_speculative_tokens"):
        if name not in value:
            raise ValueError(f"speculative_config.{name} is required")
    given = dict(value)
    if "prompt_lookup_max" in given and "prompt_lookup_min" not in given:
        given["prompt_lookup_min"] = (
            min(2, given["prompt_lookup_max"])
            if isinstance(given["prompt_lookup_max"], int)
            else given["prompt_lookup_max"]
        )
    return SpeculativeConfig(**given)
