"""Finds when a sequence's decoded output first contains a stop string, decoding only a small window per token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.frontend.token_text import token_decoder

_REPLACEMENT = "\ufffd"
# A partial UTF-8 character spans at most 3 more bytes: past this many tokens, a trailing replacement character
# is real output (an invalid byte sequence), and the window slides on rather than grow.
_MAX_HELD_TOKENS = 6


class StopStringMatcher:
    """Answers "does decode(output so far) contain a stop string?" as tokens arrive.

    Token ids:   [ prefix ... read | read ... end ]
                   settled context    not settled yet
    The text of the unsettled tokens is what decoding the whole window adds to decoding its settled context;
    a stop string found in it must overlap it, so only the last (longest stop - 1) settled characters are kept.
    The window settles once its text no longer ends inside a multi-byte character.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], skip_special_tokens: bool = True) -> None:
        self._decode_ids = token_decoder(tokenizer, skip_special_tokens)
        self._stop = tuple(stop)
        self._keep = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._read = 0  # tokens before this are settled; those before it in _ids are the decoding context
        self._settled_tail = ""  # the last _keep characters of the settled text
        self.num_tokens = 0

    def add(self, token_ids: Sequence[int]) -> bool:
        """Take the next output tokens; True when the output decoded so far contains a stop string."""
        hit = False
        for token_id in token_ids:
            self._ids.append(token_id)
            self.num_tokens += 1
            context = self._decode(self._ids[: self._read])
            window = self._decode(self._ids)
            # A context ending inside a character is not a prefix of the window's text; the whole window is new.
            new_text = window[len(context) :] if window.startswith(context) else window
            text = self._settled_tail + new_text
            hit = hit or any(stop in text for stop in self._stop)
            if not window.endswith(_REPLACEMENT) or len(self._ids) - self._read >= _MAX_HELD_TOKENS:
                self._settled_tail = text[len(text) - self._keep :] if self._keep else ""
                # The tokens just settled become the next window's context; older ones are no longer needed.
                del self._ids[: self._read]
                self._read = len(self._ids)
        return hit

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids)
