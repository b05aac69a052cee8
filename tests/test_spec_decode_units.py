"""Speculative decoding's pieces: the configuration's refusals, n-gram proposals, and the acceptance rule's
distribution, tested by chi-square against the target distribution (and failing for a wrong rule)."""

from __future__ import annotations

import pytest
import torch

from pagerail.common.engine_args import engine_config
from pagerail.common.sampling_params import SamplingParams
from pagerail.common.speculative_config import speculative_config_from
from pagerail.worker.sampler import Sampler, SamplingRow, _apply_temperature_and_filters
from pagerail.worker.spec_decode.ngram import propose_ngram
from pagerail.worker.spec_decode.verify import accepted_tokens


@pytest.mark.parametrize(
    "given, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, r"method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in 1\.\.16"),
        ({"method": "ngram", "num_speculative_tokens": 17}, r"in 1\.\.16, got 17"),
        ({"method": "ngram"}, r"num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"model is required for method 'draft_model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, r"unknown fields \['draft'\]"),
        ('{"method": "ngram", "num_speculative_tokens": ', r"must be a JSON object"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_field(given, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config(speculative_config=given)


def test_the_flag_and_the_dict_give_one_config() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    config = engine_config(speculative_config=text).speculative_config
    assert config == speculative_config_from({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 5)
    assert engine_config().speculative_config is None


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    # The 3-gram [1, 2, 3] occurred at 0 and 6; the latest is followed by 5, 6, 7, 1.
    assert propose_ngram(tokens, 1, 3, 4) == [5, 6, 7, 1]
    # A longer n wins over a later shorter match: [9, 1, 2, 3]? absent, so n=3 still decides.
    assert propose_ngram(tokens, 1, 4, 2) == [5, 6]
    # Proposals stop where the sequence does.
    assert propose_ngram([4, 5, 6, 4, 5], 2, 2, 8) == [6, 4, 5]
    assert propose_ngram([1, 2, 3, 4], 1, 3, 4) == []  # no earlier occurrence of any suffix
    assert propose_ngram([7], 1, 3, 4) == [] and propose_ngram([7, 7], 1, 3, 0) == []
    # min_n is respected: a 1-token match does not count when min_n is 2.
    assert propose_ngram([5, 1, 9, 1], 2, 3, 3) == [] and propose_ngram([5, 1, 9, 1], 1, 3, 3) == [9, 1]


def test_acceptance_keeps_the_agreeing_prefix_and_the_first_disagreement() -> None:
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted_tokens([4, 5, 6], [4, 8, 6, 7]) == [4, 8]
    assert accepted_tokens([4, 5, 6], [3, 5, 6, 7]) == [3]
    assert accepted_tokens([], [9]) == [9]
    with pytest.raises(ValueError, match="expected 3 sampled tokens"):
        accepted_tokens([1, 2], [1])


VOCAB = 8
SAMPLES = 20_000


def _target(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    return _apply_temperature_and_filters(logits[None].clone(), [row]).softmax(dim=-1)[0].double()


def _chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, "a token of zero probability was emitted"
    expected = expected_probs[keep] * counts.sum()
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def _emitted(rule: str, row: SamplingRow, logits: list[torch.Tensor], drafts: list[int], seed: int):
    """First and second emitted tokens of SAMPLES independent verifications of `drafts`."""
    torch.manual_seed(seed)
    rows = len(drafts) + 1
    batch = torch.stack(logits).repeat(SAMPLES, 1)
    sampled = torch.tensor(Sampler()(batch, [row] * (SAMPLES * rows)).token_ids).view(SAMPLES, rows)
    if rule == "exact":
        runs = [accepted_tokens(drafts, sample.tolist()) for sample in sampled]
    else:
        # Wrong: keep d with probability p(d), but on rejection draw from all of p, d included.
        p0 = _target(logits[0], row)
        keep = torch.rand(SAMPLES, dtype=torch.float64) < p0[drafts[0]]
        runs = [[drafts[0], int(s[1])] if k else [int(s[0])] for k, s in zip(keep, sampled, strict=True)]
    first = torch.bincount(torch.tensor([run[0] for run in runs]), minlength=VOCAB).double()
    second = [run[1] for run in runs if len(run) > 1]
    return first, torch.bincount(torch.tensor(second, dtype=torch.long), minlength=VOCAB).double()


@pytest.mark.parametrize(
    "row",
    [
        SamplingRow(temperature=1.0),
        SamplingRow(temperature=0.7, top_p=0.95),
        SamplingRow(temperature=1.3, top_k=5, min_p=0.02),
    ],
)
def test_speculative_tokens_follow_the_target_distribution(row: SamplingRow) -> None:
    generator = torch.Generator().manual_seed(5)
    logits = [torch.randn(VOCAB, generator=generator) * 0.8 for _ in range(2)]
    p0, p1 = _target(logits[0], row), _target(logits[1], row)
    draft = int(p0.argsort()[-2])  # a likely token that is not the most likely: both branches run often
    assert 0.05 < p0[draft] < 0.6 and (p0 > 0).sum() >= 3
    first, second = _emitted("exact", row, logits, [draft], seed=1)
    assert _chi_square_p_value(first, p0) > 1e-3
    # Given the draft was kept, the next token follows the next position's distribution.
    assert second.sum() > 0.1 * SAMPLES and _chi_square_p_value(second, p1) > 1e-3
    # The test has the power to see a wrong rule: resampling from p instead of the residual over-emits the draft.
    wrong_first, _ = _emitted("wrong", row, logits, [draft], seed=1)
    assert _chi_square_p_value(wrong_first, p0) < 1e-6


def test_a_speculating_chunk_samples_every_row_beside_decodes_that_do_not_sample() -> None:
    """A decode that samples nothing (a one-token input chunk) next to a speculating chunk whose extra rows make
    the sample count equal the request count: the decodes' sampled rows must still be looked up one by one."""
    from pagerail.worker.attention_backends.settings import AttentionSettings
    from pagerail.worker.input_buffers import InputBuffers
    from pagerail.worker.request_state import RequestState
    from pagerail.worker.step_inputs import prepare_step

    def state(handle: int, skip: bool, drafts: list[int] | None) -> RequestState:
        tokens = [handle * 10 + i for i in range(5)] + (drafts or [])
        return RequestState(
            handle, tokens, 3, SamplingParams(), [handle], 4, None, 1 + len(drafts or []), skip,
            drafts=drafts,
        )  # fmt: skip

    states = [state(1, True, None), state(2, False, None), state(3, False, [77])]
    buffers = InputBuffers(8, torch.device("cpu"), max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=2)
    flat = prepare_step(buffers, AttentionSettings("native", 0, None), states)
    assert [s.handle for s in flat.sample_states] == [2, 3]
    assert flat.sample_rows.tolist() == [1, 2, 3]
    assert flat.input_ids.tolist() == [14, 24, 34, 77]
