"""Token ids → text for the per-token paths (streaming, stop strings): the Rust decoder itself where that is exact.

A fast tokenizer's `decode` wraps its Rust `backend_tokenizer.decode` in Python that normalizes the ids, reads its
settings and, for WordPiece-style tokenizers, cleans up spaces afterwards. Streaming decodes two small windows per
token, so that wrapper costs more than the decoding itself; where it would not change the text, it is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

Decoder = Callable[[Sequence[int]], str]


def token_decoder(tokenizer: Any, skip_special_tokens: bool) -> Decoder:
    """A function giving exactly `tokenizer.decode(ids, skip_special_tokens=...)`, fast where it can be."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


def _plain_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer behind `tokenizer` when its `decode` is only that tokenizer's decode, else None."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # no transformers: whatever this tokenizer is, its own decode is the rule
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    # A subclass that decodes its own way (or a future transformers that does more) keeps its own decode.
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # the wrapper may rewrite spaces around punctuation afterwards
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if callable(getattr(backend, "decode", None)) else None
