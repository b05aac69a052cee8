"""Sampler: greedy, filtering, penalties, bans, seeded draws independent of the batch, logprobs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagerail.worker.penalty_state import PenaltyState
from pagerail.worker.sampler import Sampler, SamplingRow, TokenHistory, row_argmax

GREEDY = 0.0


def _history(rows: list[tuple[list[int], list[int]]], vocab: int) -> TokenHistory:
    """The token history the worker keeps for rows given as (prompt, outputs)."""
    states = [SimpleNamespace(handle=i, token_ids=p + o, num_prompt_tokens=len(p)) for i, (p, o) in enumerate(rows)]
    return PenaltyState(vocab, torch.device("cpu")).history(states)


def _logits_from_probs(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


def test_all_greedy_is_argmax_and_returns_no_logprobs() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [SamplingRow(temperature=GREEDY) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    assert out.top_ids == [[]] * 6 and out.top_logprobs == [[]] * 6


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(temperature=GREEDY), SamplingRow(), SamplingRow(temperature=GREEDY), SamplingRow(top_k=5)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] == logits[2].argmax().item()


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    rows = [SamplingRow(temperature=1.5, top_k=1) for _ in range(64)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_caller_logits_are_not_modified() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    rows = [
        SamplingRow(repetition_penalty=1.3, banned_token_ids=(4,)),
        SamplingRow(temperature=0.7, top_p=0.5, min_p=0.1, frequency_penalty=0.5),
    ]
    Sampler(torch.Generator().manual_seed(0))(logits, rows, _history([([1, 2], []), ([], [3, 3])], 10))
    assert torch.equal(logits, before)


def _seeded_run(seed: int, companions: str) -> list[int]:
    """Sample 6 steps for one seeded row, placed alone or among other rows; the row's logits are the same each run."""
    vocab = 1000
    row_generator = torch.Generator().manual_seed(seed)
    # The companions' shared generator differs from run to run: it must not matter to the seeded row.
    sampler = Sampler(torch.Generator().manual_seed(len(companions) * 7 + 1))
    other_seeded = torch.Generator().manual_seed(seed + 99)
    tokens = []
    for step in range(6):
        row_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(100 + step))
        ours = SamplingRow(temperature=0.9, top_p=0.95, top_k=500, generator=row_generator)
        if companions == "alone":
            rows, position = [ours], 0
        else:
            rows = [SamplingRow(), SamplingRow(temperature=GREEDY), ours, SamplingRow(min_p=0.01)]
            rows.append(SamplingRow(temperature=1.2, generator=other_seeded))
            position = 2
        noise = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(step))
        logits = noise * 3
        logits[position] = row_logits
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_seeded_row_is_independent_of_batch_composition() -> None:
    alone = _seeded_run(seed=42, companions="alone")
    crowded = _seeded_run(seed=42, companions="mixed")
    assert alone == crowded
    assert _seeded_run(seed=43, companions="alone") != alone  # the seed does steer the draws


def test_distribution_matches_softmax() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    draws = 20000
    out = Sampler(torch.Generator().manual_seed(0))(_logits_from_probs(probs, draws), [SamplingRow()] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / draws
    assert torch.allclose(counts, torch.tensor(probs), atol=0.02)


def test_distribution_follows_temperature() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 20000
    logits = probs.log().expand(draws, -1).contiguous()
    out = Sampler(torch.Generator().manual_seed(1))(logits, [SamplingRow(temperature=0.5)] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / draws
    assert torch.allclose(counts, (probs.log() / 0.5).softmax(-1), atol=0.02)


@pytest.mark.parametrize(
    ("row", "allowed"),
    [
        (SamplingRow(top_k=2), {4, 5}),
        (SamplingRow(top_k=3, temperature=3.0), {3, 4, 5}),
        (SamplingRow(top_p=0.6), {4, 5}),  # 0.35 < 0.6 <= 0.35 + 0.3
        (SamplingRow(top_p=0.7), {3, 4, 5}),  # 0.65 < 0.7 <= 0.65 + 0.15
        (SamplingRow(top_p=1e-6), {5}),
        (SamplingRow(min_p=0.4), {3, 4, 5}),  # threshold 0.14 keeps 0.15, 0.3, 0.35
        (SamplingRow(min_p=0.9), {5}),
        (SamplingRow(top_k=4, top_p=0.6, min_p=0.2), {4, 5}),
    ],
)
def test_filters_never_pick_a_filtered_token(row: SamplingRow, allowed: set[int]) -> None:
    probs = [0.02, 0.08, 0.1, 0.15, 0.3, 0.35]
    draws = 3000
    out = Sampler(torch.Generator().manual_seed(0))(_logits_from_probs(probs, draws), [row] * draws)
    assert set(out.token_ids) == allowed  # nothing outside, and every allowed token shows up


def test_banned_tokens_are_never_sampled() -> None:
    probs = [0.05, 0.05, 0.1, 0.8]
    draws = 2000
    rows = [SamplingRow(banned_token_ids=(3, 2)) for _ in range(draws - 1)]
    rows.append(SamplingRow(temperature=GREEDY, banned_token_ids=(3,)))
    out = Sampler(torch.Generator().manual_seed(0))(_logits_from_probs(probs, draws), rows)
    assert set(out.token_ids[:-1]) == {0, 1}
    assert out.token_ids[-1] == 2


def _processed_logits(logits: list[float], row: SamplingRow, prompt: list[int], outputs: list[int]) -> list[float]:
    """The logits after penalties, read back through the full top logprobs of a greedy row."""
    row.temperature, row.num_logprobs = GREEDY, len(logits)
    out = Sampler()(torch.tensor([logits]), [row], _history([(prompt, outputs)], len(logits)))
    by_token = dict(zip(out.top_ids[0], out.top_logprobs[0], strict=True))
    # logprobs differ from logits by one constant per row; anchor on token 0 to compare logits.
    return [by_token[t] - by_token[0] for t in range(len(logits))]


def test_logit_bias_adds_to_the_logits_before_the_draw() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    forced = SamplingRow(temperature=1.0, logit_bias=((7, 100.0),), generator=torch.Generator().manual_seed(0))
    banned_greedy = SamplingRow(temperature=GREEDY, logit_bias=((int(logits[1].argmax()), -100.0),))
    shifted = SamplingRow(temperature=GREEDY, num_logprobs=0, logit_bias=((5, 2.0), (9, -1.0)))
    out = Sampler(torch.Generator().manual_seed(1))(logits, [forced, banned_greedy, shifted])
    assert out.token_ids[0] == 7
    assert out.token_ids[1] == int(logits[1].topk(2).indices[1])  # the runner-up once the argmax is pushed down
    expected = logits[2].clone()
    expected[5] += 2.0
    expected[9] -= 1.0
    assert out.token_ids[2] == int(expected.argmax())
    assert out.logprobs[2] == pytest.approx(float(expected.log_softmax(-1)[out.token_ids[2]]), abs=1e-6)


def test_only_allowed_tokens_are_sampled_and_bans_still_apply() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=generator)
    rows = [
        SamplingRow(temperature=1.0, allowed_token_ids=(2, 11, 29), generator=torch.Generator().manual_seed(i))
        for i in range(3)
    ]
    best_allowed = 11 if logits[3, 11] > logits[3, 2] else 2
    rows.append(SamplingRow(temperature=GREEDY, allowed_token_ids=(2, 11), banned_token_ids=(best_allowed,)))
    for _ in range(20):
        out = Sampler(generator)(logits, rows)
        assert all(token in (2, 11, 29) for token in out.token_ids[:3])
        assert out.token_ids[3] in (2, 11) and out.token_ids[3] not in rows[3].banned_token_ids
    # A bias cannot bring back a token outside the allowed set.
    row = SamplingRow(temperature=GREEDY, allowed_token_ids=(4,), logit_bias=((6, 100.0),))
    assert Sampler()(logits[:1], [row]).token_ids == [4]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = [0.0, 2.0, -1.0, 3.0, -2.0]
    got = _processed_logits(logits, SamplingRow(repetition_penalty=2.0), [1, 2], [2, 4, 4])
    assert got == pytest.approx([0.0, 1.0, -2.0, 3.0, -4.0], abs=1e-5)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = [0.0, 1.0, 1.0, 1.0, 1.0]
    row = SamplingRow(presence_penalty=0.5, frequency_penalty=0.25)
    got = _processed_logits(logits, row, [1, 1, 1], [2, 3, 3, 3])
    # token 1 is only in the prompt; token 2 once: 1 - 0.5 - 0.25; token 3 three times: 1 - 0.5 - 0.75.
    assert got == pytest.approx([0.0, 1.0, 0.25, -0.25, 1.0], abs=1e-5)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    row = SamplingRow(temperature=GREEDY, frequency_penalty=2.0)
    out = Sampler()(logits, [row], _history([([], [1])], 3))
    assert out.token_ids == [2]


def test_logprobs_are_log_softmax_of_the_processed_distribution() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(5))
    rows = [
        SamplingRow(temperature=0.5, top_k=3, num_logprobs=5),
        SamplingRow(temperature=GREEDY, num_logprobs=4),
    ]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)

    top3 = logits[0].topk(3).indices
    expected = torch.full((30,), float("-inf"))
    expected[top3] = (logits[0, top3] / 0.5).log_softmax(-1)
    assert out.top_ids[0][:3] == top3.tolist()
    assert out.top_logprobs[0][:3] == pytest.approx(expected[top3].tolist(), abs=1e-5)
    assert out.top_logprobs[0][3:] == [float("-inf")] * 2  # filtered tokens have no mass
    assert out.logprobs[0] == pytest.approx(expected[out.token_ids[0]].item(), abs=1e-5)

    greedy_expected = logits[1].log_softmax(-1)
    assert out.top_ids[1] == greedy_expected.topk(4).indices.tolist()
    assert out.top_logprobs[1] == pytest.approx(greedy_expected.topk(4).values.tolist(), abs=1e-5)
    assert out.logprobs[1] == pytest.approx(greedy_expected.max().item(), abs=1e-5)

    for values in out.top_logprobs:
        assert values == sorted(values, reverse=True)


def test_zero_logprobs_returns_only_the_sampled_token() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(6))
    rows = [SamplingRow(num_logprobs=0), SamplingRow(), SamplingRow(temperature=GREEDY, num_logprobs=2)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    assert out.top_ids[0] == [] and out.top_logprobs[0] == []
    assert out.logprobs[0] == pytest.approx(logits[0].log_softmax(-1)[out.token_ids[0]].item(), abs=1e-5)
    assert out.logprobs[1] is None and out.top_ids[1] == []
    assert len(out.top_ids[2]) == 2 and math.isclose(out.top_logprobs[2][0], out.logprobs[2], abs_tol=1e-6)


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="logits must have shape"):
        Sampler()(torch.zeros(2, 5), [SamplingRow()])


def test_rows_with_penalties_need_their_history() -> None:
    with pytest.raises(ValueError, match="history"):
        Sampler()(torch.zeros(2, 5), [SamplingRow(), SamplingRow(repetition_penalty=1.2)])
    # Only the part the rows' penalties read is needed.
    counts_only = TokenHistory(output_counts=_history([([], [1, 1])], 5).output_counts, seen=None)
    row = SamplingRow(temperature=GREEDY, frequency_penalty=1.0)
    assert Sampler()(torch.tensor([[0.0, 1.5, 1.0, 0.0, 0.0]]), [row], counts_only).token_ids == [2]
    with pytest.raises(ValueError, match="history.seen"):
        Sampler()(torch.zeros(1, 5), [SamplingRow(repetition_penalty=1.2)], counts_only)


def _penalize_row_by_row(logits: torch.Tensor, rows: list[SamplingRow], tokens: list[tuple[list[int], list[int]]]):
    """The per-row penalties the batched ones replace: index writes from each row's token lists."""
    logits = logits.clone()
    for row_logits, row, (prompt, outputs) in zip(logits, rows, tokens, strict=True):
        if row.repetition_penalty != 1.0 and prompt + outputs:
            seen = torch.tensor(prompt + outputs)
            values = row_logits[seen]
            penalty = row.repetition_penalty
            row_logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (row.presence_penalty != 0.0 or row.frequency_penalty != 0.0) and outputs:
            counts = torch.bincount(torch.tensor(outputs), minlength=row_logits.shape[0]).to(row_logits.dtype)
            row_logits -= row.frequency_penalty * counts + row.presence_penalty * (counts > 0).to(row_logits.dtype)
    return logits


@pytest.mark.parametrize("seed", range(5))
def test_batched_penalties_are_bit_identical_to_row_by_row(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    vocab, num_rows = 64, 9
    logits = torch.randn(num_rows, vocab, generator=generator) * 4
    logits[0, :5] = float("-inf")  # banned tokens stay banned

    def draw(high: int, size: int) -> list[int]:
        return torch.randint(0, high, (size,), generator=generator).tolist()

    tokens = [(draw(vocab, draw(20, 1)[0]), draw(vocab, draw(20, 1)[0])) for _ in range(num_rows)]
    choices = [1.0, 1.0, 0.8, 1.3, 2.0]
    rows = [
        SamplingRow(
            temperature=GREEDY,
            num_logprobs=vocab,
            repetition_penalty=choices[draw(5, 1)[0]],
            presence_penalty=[0.0, 0.0, 0.5, -0.3][draw(4, 1)[0]],
            frequency_penalty=[0.0, 0.0, 0.25, 1.1][draw(4, 1)[0]],
        )
        for _ in range(num_rows)
    ]
    penalized = [i for i, row in enumerate(rows) if row.has_penalties]
    history = _history([tokens[i] for i in penalized], vocab)
    out = Sampler()(logits, rows, history if penalized else None)
    want = _penalize_row_by_row(logits, rows, tokens).log_softmax(dim=-1)
    for i in range(num_rows):
        got = torch.full((vocab,), float("nan"))
        got[torch.tensor(out.top_ids[i])] = torch.tensor(out.top_logprobs[i])
        assert torch.equal(got, want[i]), f"row {i}: {rows[i]}"


@pytest.mark.parametrize(
    "fields, fast",
    [
        (dict(temperature=0.0), True),
        (dict(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, seed=3), True),  # filters never change an argmax
        (dict(temperature=0.0, repetition_penalty=1.0, min_tokens=4), True),  # nothing to ban without stop ids
        (dict(temperature=0.7), False),
        (dict(temperature=0.0, repetition_penalty=1.2), False),
        (dict(temperature=0.0, presence_penalty=0.5), False),
        (dict(temperature=0.0, frequency_penalty=0.5), False),
        (dict(temperature=0.0, num_logprobs=0), False),
        (dict(temperature=0.0, min_tokens=4, stop_token_ids=[3]), False),
        (dict(temperature=0.0, logit_bias={3: -100.0}), False),
        (dict(temperature=0.0, allowed_token_ids=[4, 5]), False),
    ],
)
def test_argmax_only_requests_sample_the_argmax(fields, fast):
    """The rank's argmax shortcut is taken exactly for requests whose sampler path is a plain argmax."""
    from pagerail.common.sampling_wire import sampling_from_step
    from pagerail.proto import step_pb2
    from pagerail.worker.model_runner import sampling_row
    from pagerail.worker.request_state import RequestState, argmax_only

    sampling = sampling_from_step(step_pb2.SamplingParams(**fields))  # what a rank keeps of the step message
    assert argmax_only(sampling) is fast
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=generator)
    logits[0, 3] = logits.max() + 1.0  # the stop token is the argmax, so a ban would show
    state = RequestState(1, [5, 6], 2, sampling, [0], 2, None)
    row = sampling_row(state)
    if fast:
        assert Sampler()(logits, [row]).token_ids == [3]
        assert not row.has_penalties and not row.banned_token_ids and row.num_logprobs is None
    else:
        changed = row.has_penalties or row.banned_token_ids or row.num_logprobs is not None or row.reshapes_logits
        assert not row.greedy or changed
        if row.reshapes_logits:
            assert Sampler()(logits, [row]).token_ids != [3]  # the argmax shortcut would have sampled it


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 40),
    values=st.lists(
        st.sampled_from([0.0, 1.0, 2.0, -1.0, float("-inf"), float("inf"), float("nan")]), min_size=480, max_size=480
    ),
    strided=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_row_argmax_picks_the_same_index_as_torch(rows, vocab, values, strided, dtype):
    # Few distinct values, so ties, infinities and NaNs are common: the first maximum (or NaN) must win.
    logits = torch.tensor(values[: rows * vocab * 2], dtype=dtype).reshape(rows, vocab * 2)
    logits = logits[:, ::2] if strided else logits[:, :vocab]
    assert row_argmax(logits) == logits.argmax(dim=-1).tolist()


def test_row_argmax_of_half_precision_logits_goes_through_torch():
    logits = torch.tensor([[0.5, 2.0, 2.0], [3.0, -1.0, 3.0]], dtype=torch.bfloat16)
    assert row_argmax(logits) == [1, 0]
