"""Incremental detokenizer: streamed text equals a full decode, stop strings never leak, cost per token is flat."""

from __future__ import annotations

import pytest

from pagerail.cluster.frontend.detokenizer import IncrementalDetokenizer
from pagerail.cluster.frontend.generation import token_text

TEXTS = [
    "Hello world, this is a plain sentence.",
    "naïve café — 日本語 🙂",
    "🙂🙂🙂 emoji runs, Ωμέγα, Привет, עברית, 한국어 and ＦＵＬＬＷＩＤＴＨ",
    "  leading spaces\n\ttabs\n\nand blank lines  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagerail.common.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_full_decode(tokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Question: say something.\nAnswer:"))
    pieces = _stream(detok, ids, chunk)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)  # partial UTF-8 sequences are held back, never streamed


def test_multibyte_characters_are_held_until_complete(tokenizer) -> None:
    ids = tokenizer.encode("日本語")
    assert len(ids) > 3  # byte-level pieces of single characters
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = _stream(detok, ids)
    assert "" in pieces and "".join(pieces) == "日本語"


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    assert "".join(_stream(IncrementalDetokenizer(tokenizer, []), ids)) == "hi"
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(_stream(kept, ids)) == "hi" + tokenizer.eos_token


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_never_leaked(tokenizer, include: bool) -> None:
    text = "The answer is forty-two, END OF STORY and more text after it"
    stop = "forty-two, END"
    ids = tokenizer.encode(text)
    assert len(tokenizer.encode(" " + stop)) > 3  # the stop string spans several tokens
    detok = IncrementalDetokenizer(tokenizer, [], stop=(stop,), include_stop_str_in_output=include)
    streamed = ""
    for token_id in ids:
        streamed += detok.add([token_id])
        if not include:
            # No streamed tail may already be the start of the stop string.
            assert not any(stop.startswith(streamed[k:]) for k in range(len(streamed)))
        if detok.stopped:
            break
    assert detok.stopped
    assert streamed == "The answer is " + (stop if include else "")
    assert detok.add(ids[:3]) == "" and detok.flush() == ""


def test_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("delta", "beta g", "zzz"))
    assert "".join(_stream(detok, ids, chunk=4)) == "alpha "


def test_held_prefix_is_released_when_no_stop_matches(tokenizer) -> None:
    ids = tokenizer.encode("counting to fort")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("forty-two",))
    streamed = "".join(detok.add([t]) for t in ids)
    assert streamed == "counting to "  # "fort" could still become the stop string
    assert detok.flush() == "fort" and not detok.stopped


def test_held_prefix_is_released_when_the_text_diverges(tokenizer) -> None:
    ids = tokenizer.encode("forty winks")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("forty-two",))
    assert "".join(_stream(detok, ids)) == "forty winks" and not detok.stopped


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    ids = tokenizer.encode("stop here, then stop again")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("stop",), min_tokens=3)
    assert "".join(_stream(detok, ids)) == "stop here, then "


def test_token_text(tokenizer) -> None:
    ids = tokenizer.encode("Hello world")
    assert [token_text(tokenizer, t) for t in ids] == ["Hello", " world"]


class CountingTokenizer:
    """A tokenizer that records how many ids each decode call was given: the detokenizer's work, not its time."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.decoded_lengths.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def test_cost_per_token_does_not_grow(tokenizer) -> None:
    ids = tokenizer.encode("Lorem ipsum dolor sit amet, consectetur adipiscing elit; café 日本語. " * 120)[:2000]
    assert len(ids) == 2000
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [], stop=("never appears", "nor this"))
    first_half = "".join(detok.add([t]) for t in ids[:1000])
    first = list(counting.decoded_lengths)
    counting.decoded_lengths.clear()
    second_half = "".join(detok.add([t]) for t in ids[1000:]) + detok.flush()
    second = counting.decoded_lengths
    assert first_half + second_half == tokenizer.decode(ids)
    # At most two decodes per token, each of a window a few tokens wide wherever the token falls in the
    # sequence; decoding the whole output each step would pass up to 2000 ids and grow with every token.
    assert len(first) <= 2 * 1000 and len(second) <= 2 * 1000 + 2
    assert max(first + second) <= 16
    # The second thousand tokens cost what the first did.
    assert sum(second) <= 1.1 * sum(first) + 16
