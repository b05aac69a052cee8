"""Stop strings in the offline LLM: matched incrementally by the output processor, with the same outcome as decoding
the whole output after every token, in-process and tensor parallel (the head ends the request, reason "stop",
once it appears)."""

from __future__ import annotations

import random
import time

import pytest
from transformers import AutoTokenizer

from pagerail import LLM, SamplingParams
from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.frontend.output_processor import ChoiceState
from tests.ray_start import start_ray
from tests.tiny_models import make_tiny_model

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def first_stop(tokenizer, token_ids: list[int], stops: list[str]) -> int | None:
    """The number of tokens after which the whole decoded output first contains a stop string."""
    for count in range(1, len(token_ids) + 1):
        if any(stop in tokenizer.decode(token_ids[:count], skip_special_tokens=True) for stop in stops):
            return count
    return None


def test_a_choice_stops_where_decoding_everything_first_holds_the_stop_string(tokenizer):
    rng = random.Random(0)
    texts = ["Hello, world! 1, 2, 3.", "don’t — café naïve 日本語 🎉 end.", "def add(a, b):\n    return a + b\n"]
    pieces = [t for text in texts for t in tokenizer.encode(text)]
    hits = 0
    for _ in range(150):
        ids = [rng.choice(pieces) if rng.random() < 0.7 else rng.randrange(len(tokenizer)) for _ in range(30)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        starts = [rng.randrange(len(text) - 3) for _ in range(2)]
        stops = [s for s in (text[a : a + rng.randint(1, 4)] for a in starts) if "\ufffd" not in s] or ["zz"]
        state = ChoiceState(tokenizer, [], SamplingParams(stop=stops, max_tokens=len(ids)))
        # Fed a step at a time, as deltas arrive: one or a few tokens.
        kept, count = [], 0
        while count < len(ids) and not state.finished:
            step = ids[count : count + rng.choice((1, 1, 1, 2))]
            count += len(step)
            kept += state.process(RequestDelta("r", step, 0, count, finished=count == len(ids))).token_ids
        expected = first_stop(tokenizer, ids, stops)
        if expected is not None:
            hits += 1
            # Cut at the token that completed the stop string, wherever it fell in its delta; a few tokens later
            # only while the text there ends inside a character, which streaming holds back until it is whole.
            assert state.finish_reason == "stop" and kept == ids[: len(kept)]
            if "\ufffd" in tokenizer.decode(ids[: len(kept)], skip_special_tokens=True):
                assert expected <= len(kept) <= expected + 6, (stops, ids)
            else:
                assert len(kept) == expected, (stops, ids)
        else:
            assert kept == ids and state.finish_reason == "stop" and not state.stopped
    assert hits > 100


def truncated_at_stop(tokenizer, token_ids: list[int], stop: str, include: bool) -> tuple[list[int], str, str]:
    """What the outputs were before stop strings were matched incrementally: tokens up to the step whose decoded
    output first contains the stop string, the text cut there; (tokens, text, finish reason)."""
    count = first_stop(tokenizer, token_ids, [stop])
    assert count is not None and count < MAX_TOKENS
    text = tokenizer.decode(token_ids[:count], skip_special_tokens=True)
    cut = text.find(stop)
    return token_ids[:count], text[: cut + (len(stop) if include else 0)], "stop"


def check_stops(llm: LLM, tokenizer) -> None:
    prompts = [[(p * 131 + i * 977) % 40000 + 200 for i in range(5 + p)] for p in range(4)]
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    free_runs = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    stops = []
    for tokens in free_runs:
        # A piece of the text near its sixth token, so the request stops well before max_tokens.
        text = tokenizer.decode(tokens[:6], skip_special_tokens=True)
        stop = text[-3:].strip() or text.strip()[-1:]
        assert stop and "\ufffd" not in stop, text
        stops.append(stop)
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop], include_stop_str_in_output=i % 2 == 1
        )
        for i, stop in enumerate(stops)
    ]
    outputs = llm.generate(prompts, params)
    for tokens, stop, sp, output in zip(free_runs, stops, params, outputs, strict=True):
        completion = output.outputs[0]
        got = (completion.token_ids, completion.text, completion.finish_reason)
        assert got == truncated_at_stop(tokenizer, tokens, stop, sp.include_stop_str_in_output)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("stops") / "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(path))
    return path


def finished_by_reason(metrics_text: str) -> dict[str, float]:
    """pagerail_request_success_total by finished_reason, from the engine's exposition."""
    counts = {}
    for line in metrics_text.splitlines():
        if line.startswith("pagerail_request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            counts[reason] = float(line.rsplit(" ", 1)[1])
    return counts


def test_in_process_llm_stops_where_the_whole_text_first_holds_the_stop_string(model_dir, tokenizer):
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=256)
    check_stops(llm, tokenizer)
    assert not llm.engine.has_unfinished()
    # A stop string ends its request as a finish with reason "stop" in every count, never as an abort: the four
    # free runs end by length, the four stopped ones by "stop", and before max_tokens (fewer tokens generated).
    assert llm.stats.num_aborted == 0 and llm.stats.num_stopped_by_caller == 4
    assert finished_by_reason(llm.engine.metrics_text().decode()) == {"length": 4.0, "stop": 4.0}


@pytest.mark.slow
def test_tensor_parallel_llm_stops_at_stop_strings_as_it_runs(model_dir, tokenizer):
    from tests.requirements import require_module

    ray = require_module("ray", "needs Ray")
    start_ray(num_cpus=3, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=256, tensor_parallel_size=2)
    try:
        before = llm.stats
        check_stops(llm, tokenizer)
        deadline = time.monotonic() + 30
        while (stats := llm.stats)["num_unfinished"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the aborts are sent without waiting for them
    finally:
        llm.shutdown()
        ray.shutdown()
    # Each stopped request was ended at the head while it ran (as a finish, not an abort), not generated to
    # max_tokens and cut afterwards.
    assert stats["num_stopped_by_caller"] - before["num_stopped_by_caller"] == 4
    assert stats["num_aborted"] == before["num_aborted"]
    assert stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
