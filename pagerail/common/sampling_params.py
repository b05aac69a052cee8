"""User-facing sampling parameters of one request, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagerail.common.structured_outputs import StructuredOutputs

# Below this temperature a request is decoded greedily (argmax); dividing by it would overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
# Every stop string is searched for after each token, so their number and length bound the per-token cost.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# OpenAI's bounds: a bias is added to the token's logit, and ±100 bans or forces it in practice.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
# Each bad word is matched against the outputs at every step.
MAX_BAD_WORDS = 128
# torch.Generator.manual_seed accepts exactly this range; checking here keeps a bad seed off the workers.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request and when to stop; mirrors the OpenAI and vLLM fields."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 turn it off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per token; 0 returns only the sampled token's logprob
    # The same for each prompt token after the first (vLLM's prompt_logprobs); such a request computes its whole
    # prompt (no prefix-cache hit) and is not speculated.
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()  # matched on text by the frontend, validated here
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrains the output to a JSON schema, regex, choice or grammar; a dict is read as StructuredOutputs(**dict).
    structured_outputs: StructuredOutputs | None = None
    # False keeps this request out of speculative decoding (when the engine has it on).
    speculative: bool = True
    # Added to these tokens' logits before anything else reads them (penalties, constraints, sampling); a dict
    # {token id: bias} is kept as (token id, bias) pairs in token order.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Only these tokens may be sampled (None: any); masked before the constraints and the sampling.
    allowed_token_ids: tuple[int, ...] | None = None
    # Keep only the prompt's last k tokens (-1: as many as the context holds); applied by the front doors.
    truncate_prompt_tokens: int | None = None
    # Words never to generate (vLLM's bad_words): the front door, which has the tokenizer, spells each as token
    # sequences (with and without a leading space) into bad_words_token_ids, which the ranks act on: a sequence's
    # last token is masked whenever the outputs end with the rest of it (a one-token word always).
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        self._validate_structured_outputs()
        self._validate_counts()
        self._validate_probabilities()
        self._validate_penalties()
        self._validate_stops()
        self._validate_token_masks()
        self._validate_bad_words()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """True when the request is decoded by argmax rather than by drawing from the distribution."""
        return self.temperature < GREEDY_TEMPERATURE

    def _validate_structured_outputs(self) -> None:
        value = self.structured_outputs
        if isinstance(value, dict):
            try:
                value = StructuredOutputs(**value)
            except TypeError as error:  # an unknown key
                raise ValueError(f"structured_outputs: {error}") from None
            object.__setattr__(self, "structured_outputs", value)
        if value is not None and not isinstance(value, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs or a dict, got {type(value).__name__}")

    def _validate_counts(self) -> None:
        check_int("n", self.n, low=1, high=MAX_N)
        check_int("top_k", self.top_k, low=-1)  # -1 is vLLM's spelling of "off", accepted as is
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, low=1)
        check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.seed is not None:
            check_int("seed", self.seed, low=_SEED_MIN, high=_SEED_MAX)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1)

    def _validate_probabilities(self) -> None:
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        top_p = _check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        min_p = _check_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        # Ints are accepted but stored as floats so consumers see one type.
        for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
            object.__setattr__(self, name, value)

    def _validate_penalties(self) -> None:
        repetition = _check_float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition}")
        object.__setattr__(self, "repetition_penalty", repetition)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            object.__setattr__(self, name, value)

    def _validate_stops(self) -> None:
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list or tuple of ints, got {type(ids).__name__}")
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must hold non-negative ints, got {token_id!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

        object.__setattr__(self, "stop", check_stop(self.stop))

    def _validate_token_masks(self) -> None:
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        if not isinstance(pairs, (list, tuple, type({}.items()))):
            raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
        pairs = [tuple(pair) if isinstance(pair, (list, tuple)) else pair for pair in pairs]
        if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}")
        normalized: dict[int, float] = {}
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to numbers, got {pair!r}")
            token_id, value = pair
            check_int("logit_bias token id", token_id, low=0)
            value = _check_float(f"logit_bias[{token_id}]", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {value}")
            normalized[token_id] = value
        object.__setattr__(self, "logit_bias", tuple(sorted(normalized.items())))

        allowed = self.allowed_token_ids
        if allowed is None:
            return
        if not isinstance(allowed, (list, tuple)) or not allowed:
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
        for token_id in allowed:
            check_int("allowed_token_ids", token_id, low=0)
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))

    def _validate_bad_words(self) -> None:
        words = self.bad_words
        if isinstance(words, str) or not isinstance(words, (list, tuple)) or len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} strings, got {words!r}")
        for word in words:
            if not isinstance(word, str) or not word.strip() or len(word) > MAX_STOP_LENGTH:
                raise ValueError(f"bad_words must hold non-blank strings of at most {MAX_STOP_LENGTH} characters")
        object.__setattr__(self, "bad_words", tuple(words))
        sequences = self.bad_words_token_ids
        if not isinstance(sequences, (list, tuple)) or len(sequences) > 2 * MAX_BAD_WORDS:
            raise ValueError(f"bad_words_token_ids must be a list of at most {2 * MAX_BAD_WORDS} token-id lists")
        for sequence in sequences:
            if not isinstance(sequence, (list, tuple)) or not sequence:
                raise ValueError(f"bad_words_token_ids must hold non-empty token-id lists, got {sequence!r}")
            for token_id in sequence:
                check_int("bad_words_token_ids", token_id, low=0)
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(sequence) for sequence in sequences))

    def token_ids_named(self) -> list[int]:
        """Every token id these settings name (stop, biased, allowed, bad words), to check against the vocabulary."""
        named = [*self.stop_token_ids, *(token for token, _ in self.logit_bias), *(self.allowed_token_ids or ())]
        return named + [token for sequence in self.bad_words_token_ids for token in sequence]


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (truncate_prompt_tokens; -1: the context's length), or all of it."""
    if keep is None:
        return prompt_ids
    keep = max_model_len if keep == -1 else keep
    return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids


def check_stop(stop: object) -> tuple[str, ...]:
    """The stop strings as a tuple; raise ValueError naming `stop` unless they are a string or a list of at most
    MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_LENGTH characters (the front doors check with it too)."""
    if isinstance(stop, str):  # the OpenAI API allows a single string
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for text in stop:
        # An empty stop string would match before the first token.
        if not isinstance(text, str) or not text:
            raise ValueError(f"stop must hold non-empty strings, got {text!r}")
        if len(text) > MAX_STOP_LENGTH:
            raise ValueError(f"stop must hold strings of at most {MAX_STOP_LENGTH} characters, got {len(text)}")
    return tuple(stop)


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    """Raise ValueError unless `value` is an int (not a bool) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_float(name: str, value: object) -> float:
    """Raise ValueError unless `value` is a finite int or float (not a bool); return it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)
