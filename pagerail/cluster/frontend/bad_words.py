"""vLLM's bad_words: each word spelled as the token sequences a model could write it with, for the ranks to mask."""

from __future__ import annotations

import dataclasses

from pagerail.common.sampling_params import SamplingParams


def bad_word_sequences(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each word's tokens on its own and after a space (mid-sentence, most tokenizers fold the space into the
    word's first token), without special tokens; each distinct sequence once, in order."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for spelled in (word.lstrip(), " " + word.lstrip()):
            tokens = tuple(tokenizer.encode(spelled, add_special_tokens=False))
            if tokens:
                sequences[tokens] = None
    return tuple(sequences)


def with_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with its bad words spelled in tokens; ValueError naming bad_words where there is no tokenizer."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise ValueError("bad_words are spelled with the model's tokenizer, and this model has none")
    return dataclasses.replace(params, bad_words_token_ids=bad_word_sequences(tokenizer, params.bad_words))
