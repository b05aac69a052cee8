"""Token ids → streamed text: whole characters only, stop strings cut across token boundaries."""

from __future__ import annotations

from typing import Any

from pagerail.cluster.frontend.token_text import token_decoder

# Prompt tokens decoded ahead of the first output token, so tokenizers that drop a leading space at the
# start of a decode (SentencePiece "▁word") render the first output word the way they would mid-sequence.
_PROMPT_CONTEXT_TOKENS = 5
# A partial UTF-8 character is at most 3 bytes, so a replacement char still at the end after this many held
# tokens is real output (an invalid byte sequence), not a character in progress; holding on would grow the window.
_MAX_HELD_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one sequence's output tokens as they arrive, at a cost per token bounded by a small window.

    Token ids:   [ ... | prefix_offset ... read_offset | read_offset ... end ]
                         already emitted (context)       not yet emitted
    Each step decodes both windows and emits what the longer one adds beyond the shorter one.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int] | tuple[int, ...] = (),
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] | list[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decode = token_decoder(tokenizer, skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        # Only the tail of the prompt matters; older tokens are dropped from the window as it slides.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_output_tokens = 0
        self._pending = ""  # decoded, but held back because it may be the start of a stop string
        self.stopped = False

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def add(self, token_ids: list[int]) -> str:
        """Take new output tokens; return the text they complete (possibly ""). Returns "" once stopped.

        Once stopped, `num_output_tokens` counts the tokens up to the one that completed the stop string: those
        after it were never taken.
        """
        if not self._stop and len(token_ids) > 1:
            # Nothing to look for between tokens: the chunk is decoded as one window (two decodes, not two per
            # token), holding back only what ends inside a character however many tokens came with it.
            self._ids.extend(token_ids)
            self._num_output_tokens += len(token_ids)
            return self._decode_step(force=False, max_held=len(token_ids) - 1 + _MAX_HELD_TOKENS)
        delta: list[str] = []
        for token_id in token_ids:
            if self.stopped:
                break
            self._ids.append(token_id)
            self._num_output_tokens += 1
            piece = self._decode_step(force=False)
            if piece:
                delta.append(self._scan(piece, final=False))
        return "".join(delta)

    def flush(self) -> str:
        """At the end of the sequence: release what was held back (a partial character, a stop-string prefix)."""
        if self.stopped:
            return ""
        piece = self._decode_step(force=True)
        return self._scan(piece, final=True)

    def _decode_step(self, force: bool, max_held: int = _MAX_HELD_TOKENS) -> str:
        """Text that the tokens past read_offset add; "" while they end inside a multi-byte character."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        held = len(self._ids) - self._read_offset
        if full_text.endswith(_REPLACEMENT) and not force and held < max_held:
            return ""
        # A prompt ending inside a character decodes to a replacement char that the output then completes;
        # the prefix is then not a prefix of the full text, and the whole new window is the best answer.
        new_text = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else full_text
        # Slide the window: the tokens just emitted become the context for the next step.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > 0:  # drop what no window will look at again, keeping offsets small
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _scan(self, piece: str, final: bool) -> str:
        """Append `piece` to the held text; return what can be streamed now, stopping at a stop string."""
        text = self._pending + piece
        if not self._stop:
            self._pending = ""
            return text
        if self._num_output_tokens >= self._min_tokens:
            match = self._find_stop(text, len(self._pending))
            if match is not None:
                start, stop = match
                self.stopped = True
                self._pending = ""
                return text[: start + len(stop)] if self._include_stop else text[:start]
        keep = 0 if final else _partial_stop_len(text, self._stop, self._max_stop_len)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _find_stop(self, text: str, old_len: int) -> tuple[int, str] | None:
        """Earliest stop string in `text` that ends inside the new part (after `old_len` chars)."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # A match lying wholly in the held part would have been found when that part arrived.
            index = text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best


def _partial_stop_len(text: str, stops: tuple[str, ...], max_stop_len: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    window_start = max(0, len(text) - max_stop_len + 1)
    for stop in stops:
        # Candidate starts are where the stop string's first character occurs; the earliest is the longest.
        index = text.find(stop[0], max(window_start, len(text) - len(stop) + 1))
        while index != -1 and len(text) - index > best:
            if stop.startswith(text[index:]):
                best = len(text) - index
                break
            index = text.find(stop[0], index + 1)
    return best
