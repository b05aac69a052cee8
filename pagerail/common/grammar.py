"""Output constraints compiled by llguidance: the front doors check them against the tokenizer, the sampling rank
enforces them. Both sides share this module so a constraint accepted at the door always compiles on the rank."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any

# Fixed separators and no free whitespace between JSON tokens: a small model cannot loop on blanks, and the output
# reads like json.dumps. A schema may still override these with its own "x-guidance" options.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Compiled grammars kept per process, keyed by (kind, spec); a grammar is text, so the cache stays small.
GRAMMAR_CACHE_SIZE = 1024


class GrammarError(ValueError):
    """A constraint that does not compile; `field` names the request field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def field_of(kind: str) -> str:
    """The request field a constraint of this kind came from, for error messages."""
    return f"structured_outputs.{kind}"


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def grammar_text(kind: str, spec: str) -> str:
    """llguidance's grammar for one constraint (pagerail.common.structured_outputs has the kinds)."""
    import llguidance

    if kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        except ValueError as error:
            raise GrammarError(field_of(kind), str(error)) from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # Lark string literals take JSON escapes, so each choice is matched exactly, quotes and all.
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(spec)  # GBNF ("root ::= ...") becomes Lark; Lark passes through
        except Exception as error:  # the converter raises its own error types on bad GBNF
            raise GrammarError(field_of(kind), f"cannot read the grammar: {error}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise GrammarError("structured_outputs", f"unknown constraint kind {kind!r}")


def check_constraint(kind: str, spec: str, tokenizer: Any) -> str:
    """Compile one constraint against an llguidance tokenizer; return its grammar or raise GrammarError.

    The outcome is cached per (constraint, tokenizer), failures included: a schema sent again costs a lookup.
    """
    grammar, error = _checked(kind, spec, tokenizer)
    if error is not None:
        raise GrammarError(field_of(kind), error)
    return grammar


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _checked(kind: str, spec: str, tokenizer: Any) -> tuple[str, str | None]:
    import llguidance

    try:
        grammar = grammar_text(kind, spec)
    except GrammarError as error:
        return "", error.message
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        return grammar, messages[0] if messages else "the constraint does not compile"
    return grammar, None


def clear_caches() -> None:
    """Forget every compiled and checked constraint (benchmarks time cold compiles)."""
    grammar_text.cache_clear()
    _checked.cache_clear()


class TokenizerCache:
    """llguidance tokenizers, built once per (tokenizer, vocabulary size): building one walks the whole vocabulary
    (about a second for 50k tokens), so it happens on first use and is shared by every later request."""

    def __init__(self, max_entries: int = 4) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int | str, int | None], Any] = OrderedDict()
        self._max_entries = max_entries

    def for_hf(self, hf_tokenizer: Any, vocab_size: int | None = None) -> Any:
        """The llguidance tokenizer of a transformers fast tokenizer, padded to `vocab_size` ids if given."""
        return self._get((id(hf_tokenizer), vocab_size), lambda: _from_hf(hf_tokenizer, vocab_size))

    def for_dir(self, tokenizer_dir: str | Path, vocab_size: int | None = None) -> Any:
        """The llguidance tokenizer of the transformers tokenizer saved in `tokenizer_dir`."""

        def build() -> Any:
            from transformers import AutoTokenizer

            return _from_hf(AutoTokenizer.from_pretrained(str(tokenizer_dir)), vocab_size)

        return self._get((str(Path(tokenizer_dir).resolve()), vocab_size), build)

    def _get(self, key: tuple, build) -> Any:
        with self._lock:  # one build per key even when two threads ask at once
            tokenizer = self._entries.get(key)
            if tokenizer is None:
                tokenizer = build()
                self._entries[key] = tokenizer
                while len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
            self._entries.move_to_end(key)
            return tokenizer


def _from_hf(hf_tokenizer: Any, vocab_size: int | None) -> Any:
    import llguidance.hf

    # The model's vocabulary may be padded past the tokenizer's; ids without text are never allowed.
    n_vocab = max(vocab_size or 0, len(hf_tokenizer)) or None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab)


TOKENIZERS = TokenizerCache()
