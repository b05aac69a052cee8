"""The per-token decoder gives exactly the tokenizer's own decode, takes the Rust path only where that is exact,
and keeps the tokenizer's decode for any tokenizer it cannot vouch for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagerail.cluster.frontend.token_text import _plain_backend, token_decoder


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The tokenizer the overhead benchmark writes: SmolLM2's, cut to a 1024-token vocabulary."""
    from transformers import AutoTokenizer

    from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama

    model = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", TinyLlamaShape())
    return AutoTokenizer.from_pretrained(str(model))


def test_the_embedded_tokenizer_takes_the_rust_path(smollm2_tokenizer):
    assert _plain_backend(smollm2_tokenizer) is smollm2_tokenizer.backend_tokenizer


def _ids(vocab: int):
    # Around the special tokens (the first ids), byte tokens that split UTF-8 characters, and anywhere else.
    return st.lists(st.one_of(st.integers(0, 20), st.integers(0, vocab - 1)), max_size=24)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_equals_the_tokenizers_decode_on_any_ids(smollm2_tokenizer, tiny_tokenizer, data, skip):
    for tokenizer in (smollm2_tokenizer, tiny_tokenizer):
        ids = data.draw(_ids(len(tokenizer)))
        assert token_decoder(tokenizer, skip)(ids) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(smollm2_tokenizer, "clean_up_tokenization_spaces", True)
    assert _plain_backend(smollm2_tokenizer) is None
    ids = smollm2_tokenizer.encode("Hello , world !")
    assert token_decoder(smollm2_tokenizer, True)(ids) == smollm2_tokenizer.decode(ids, skip_special_tokens=True)


def test_a_subclass_with_its_own_decode_keeps_it(smollm2_tokenizer):
    class Shouting(type(smollm2_tokenizer)):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(smollm2_tokenizer.__dict__)
    ids = smollm2_tokenizer.encode("quiet words")
    assert _plain_backend(shouting) is None
    assert token_decoder(shouting, True)(ids) == "QUIET WORDS"


def test_any_other_tokenizer_is_asked_itself():
    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids if not (skip_special_tokens and i == 0))

    assert token_decoder(Letters(), True)([0, 1, 2]) == "bc"
    assert token_decoder(Letters(), False)([0, 1, 2]) == "abc"


def test_the_detokenize_benchmark_streams_the_same_text_both_ways(smollm2_tokenizer):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "detokenize.py"
    spec = importlib.util.spec_from_file_location("detokenize_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ids = smollm2_tokenizer.encode("naïve café — 日本語 🙂 and some plain words after it")
    slow, slow_text = bench.stream_seconds(smollm2_tokenizer, ids, through_tokenizer=True)
    fast, fast_text = bench.stream_seconds(smollm2_tokenizer, ids, through_tokenizer=False)
    assert slow_text == fast_text == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert slow > 0 and fast > 0 and bench.match_seconds(smollm2_tokenizer, ids, through_tokenizer=False) > 0
