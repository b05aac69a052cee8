"""Beam search against transformers' `generate(num_beams=...)` on the same tiny random weights, and the prompt blocks
its beams share."""

from __future__ import annotations

import json

import pytest
import torch

from pagerail import LLM, BeamSearchParams
from tests.tiny_models import make_tiny_model

PROMPT = [5, 17, 42, 99, 7, 30, 12, 64, 3, 200, 11, 90, 150, 8, 77, 19, 21, 33, 44, 55]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama whose end-of-sequence token is its own 4th greedy token after PROMPT, so beams finish early
    and the length penalty decides between sequences of different lengths."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("llama", tmp_path_factory.mktemp("beam-llama"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, eos_token_id=None)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = int(greedy[0, -1])
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' beam search: (sequences as token lists ending at their end-of-sequence token, scores)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = model.config.eos_token_id

    def search(beams: int, length_penalty: float) -> tuple[list[list[int]], list[float]]:
        out = model.generate(
            torch.tensor([PROMPT]),
            num_beams=beams,
            num_return_sequences=beams,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=False,
            eos_token_id=eos,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
        sequences = []
        for row in out.sequences[:, len(PROMPT) :].tolist():
            sequences.append(row[: row.index(eos) + 1] if eos in row else row)  # padding follows the end token
        return sequences, out.sequences_scores.tolist()

    return search


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory_bytes=8 << 20, block_size=8)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -1.0])
def test_four_beams_equal_transformers_token_for_token(llm, reference, length_penalty):
    expected, scores = reference(4, length_penalty)
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=length_penalty)
    (output,) = llm.beam_search([PROMPT], params)
    assert [s.token_ids for s in output.sequences] == expected
    assert [s.score for s in output.sequences] == pytest.approx(scores, abs=1e-3)
    eos = next(iter(llm.engine_client.eos_token_ids))
    for sequence in output.sequences:
        assert sequence.finish_reason == ("stop" if sequence.token_ids[-1] == eos else "length")
        assert sequence.cumulative_logprob == pytest.approx(sum(sequence.logprobs), abs=1e-4)


def test_the_length_penalty_changes_which_beam_wins(reference):
    """Otherwise the comparisons above would not show that the penalty is applied as transformers applies it."""
    assert reference(4, 2.0)[0] != reference(4, -1.0)[0]
    lengths = {len(sequence) for sequence in reference(4, 1.0)[0]}
    assert len(lengths) > 1  # some beams ended early on the end-of-sequence token


def test_beams_share_their_prompts_blocks(llm):
    """Four beams hold fewer than four times the blocks of one: their prompt's blocks are held once."""
    table = llm.engine.block_table
    peaks = {}
    for width in (1, 4):
        table.reset_peak()
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=True))
        peaks[width] = table.peak_used_blocks
    one_sequence = -(-(len(PROMPT) + MAX_TOKENS) // table.block_size)
    assert peaks[1] <= one_sequence, peaks
    assert peaks[4] < 4 * peaks[1], peaks


def test_bad_beam_settings_name_the_field():
    for fields, name in [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 11, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
    ]:
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**fields)
