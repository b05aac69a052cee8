"""Each attention backend's metadata for a staged step against the list-based reference, and the per-step choice."""

from __future__ import annotations

import random

import pytest
import torch

from pagerail.common.sampling_params import SamplingParams
from pagerail.worker.attention_backends.base import AttentionBackend
from pagerail.worker.attention_backends.select import CPU_PAGED, PAGED_DECODE, TORCH, TRITON_MIXED, select_backend
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.input_batch import GatherWorkspace
from pagerail.worker.input_buffers import InputBuffers
from pagerail.worker.layers.attention import AttentionMetadata
from pagerail.worker.request_state import RequestState
from pagerail.worker.staged_step import StepShape
from pagerail.worker.step_inputs import prepare_step
from tests.input_batch_reference import build_flat_batch

CPU = torch.device("cpu")
BLOCK_SIZE = 4
WORKSPACE = GatherWorkspace(BLOCK_SIZE, 2, 4, torch.float32, CPU)


def _state(handle: int, num_tokens: int, computed: int, scheduled: int, blocks: list[int], sample: bool):
    return RequestState(
        handle=handle,
        token_ids=[(handle * 37 + i * 11) % 500 for i in range(num_tokens)],
        num_prompt_tokens=num_tokens,
        sampling=SamplingParams(),
        block_ids=blocks,
        num_computed_tokens=computed,
        generator=None,
        num_scheduled_tokens=scheduled,
        skip_sampling=not sample,
    )


def _random_step(rng: random.Random, kinds: list[str]) -> list[RequestState]:
    """One request per kind ("decode", "fresh" prefill, "cached": a chunk after a cached prefix), shuffled."""
    states = []
    for handle, kind in enumerate(kinds):
        num_tokens = rng.randint(3, 40)
        if kind == "decode":
            computed, scheduled = num_tokens - 1, 1
        elif kind == "fresh":
            computed, scheduled = 0, rng.randint(2, num_tokens)
        else:
            computed = rng.randint(1, num_tokens - 2)
            scheduled = rng.randint(2, num_tokens - computed)
        num_blocks = -(-(computed + scheduled) // BLOCK_SIZE) + rng.choice([0, 0, 1])
        blocks = [rng.randrange(1, 512) for _ in range(num_blocks)]
        states.append(_state(handle, num_tokens, computed, scheduled, blocks, sample=rng.random() < 0.8))
    rng.shuffle(states)
    return states


def _step(states: list[RequestState]) -> StepShape:
    """The step's shape, split as prepare_step splits it."""
    decodes = [s for s in states if s.num_scheduled_tokens == 1]
    prefills = [s for s in states if s.num_scheduled_tokens > 1]
    return StepShape(decodes, prefills, decodes + prefills)


def _build(backend: AttentionBackend, settings: AttentionSettings, states: list[RequestState], in_place: bool):
    """Stage the step as the backend asks, on a fresh set of buffers, and build its metadata."""
    buffers = InputBuffers(BLOCK_SIZE, CPU, max_num_tokens=8, max_num_seqs=2, max_blocks_per_seq=2, in_place=in_place)
    for state in states:
        state.table_row = -1  # a row in another test's buffers: these ones have none yet
    staged = buffers.prepare(_step(states), backend.staging)
    return staged, backend.build(staged, settings)


def _same(mine: torch.Tensor | None, theirs: torch.Tensor | None, name: str) -> None:
    if mine is None or theirs is None:
        assert mine is None and theirs is None, f"{name}: {mine} vs {theirs}"
        return
    assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), f"{name}:\n{mine}\nvs reference\n{theirs}"


def _compare(staged, got: AttentionMetadata, want, *, fields: tuple[str, ...]) -> None:
    """The common inputs, the spans, and the named metadata fields equal the reference's; the rest unset."""
    for name in ("input_ids", "positions", "sample_rows"):
        _same(getattr(staged, name), getattr(want, name), name)
    meta = want.attention
    _same(got.slot_mapping, meta.slot_mapping, "slot_mapping")
    assert (got.block_size, got.num_decodes) == (meta.block_size, meta.num_decodes)
    for name in fields:
        _same(getattr(got, name), getattr(meta, name), name)
    for name in {"decode_block_table", "decode_context_lens", "decode_mask"} - set(fields):
        assert getattr(got, name) is None, name
    for name in ("mixed_block_table", "mixed_context_lens", "mixed_query_starts"):
        if name not in fields:
            assert getattr(got, name) is None, name
    assert len(got.prefills) == len(meta.prefills)
    for mine, theirs in zip(got.prefills, meta.prefills, strict=True):
        assert (mine.start, mine.end, mine.context_len) == (theirs.start, theirs.end, theirs.context_len)
        _same(mine.context_blocks, theirs.context_blocks, "context_blocks")
        _same(mine.mask, theirs.mask, "prefill mask")


STEPS = [["decode"] * 3, ["decode", "fresh", "cached"], ["cached", "cached"], ["fresh"], ["decode", "decode", "cached"]]


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_decode_layout_backends_match_the_reference(seed: int, in_place: bool) -> None:
    """Torch: decode rows, their mask and gather buffers, prefill chunks with their cached context; the paged decode
    kernels: the same without the mask and buffers."""
    rng = random.Random(seed)
    states = _random_step(rng, STEPS[seed % len(STEPS)])
    want = build_flat_batch(states, BLOCK_SIZE, CPU, workspace=WORKSPACE)
    decode_fields = ("decode_block_table", "decode_context_lens") if want.attention.num_decodes else ()

    staged, got = _build(TORCH, AttentionSettings("torch", workspace=WORKSPACE), states, in_place)
    _compare(staged, got, want, fields=(*decode_fields, "decode_mask") if decode_fields else ())
    if decode_fields:
        assert got.decode_key_buffer.shape == want.attention.decode_key_buffer.shape

    staged, got = _build(PAGED_DECODE, AttentionSettings("triton"), states, in_place)
    _compare(staged, got, want, fields=decode_fields)
    assert got.decode_key_buffer is None and got.paged_block_table is None


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_triton_mixed_backend_matches_the_reference(seed: int, in_place: bool) -> None:
    """Every sequence's table row, context length and query rows (R + 1 starts); no decode rows, no masks."""
    rng = random.Random(seed)
    states = _random_step(rng, STEPS[seed % len(STEPS)][:-1] + ["fresh"])  # a mixed step has a prefill chunk
    want = build_flat_batch(states, BLOCK_SIZE, CPU, mixed=True)
    staged, got = _build(TRITON_MIXED, AttentionSettings("triton"), states, in_place)
    _compare(staged, got, want, fields=("mixed_block_table", "mixed_context_lens", "mixed_query_starts"))
    assert staged.num_seqs == len(states) and got.mixed_query_starts.shape == (len(states) + 1,)


@pytest.mark.parametrize("seed", range(12))
def test_cpu_paged_backend_matches_the_reference(seed: int) -> None:
    """Every row's own table row and context (its position + 1), and the decodes' view of the same rows."""
    rng = random.Random(seed)
    states = _random_step(rng, STEPS[seed % len(STEPS)][:-1] + ["cached"])
    want = build_flat_batch(states, BLOCK_SIZE, CPU)
    settings = AttentionSettings("native", paged_prefill_max_context=64)
    staged, got = _build(CPU_PAGED, settings, states, in_place=True)
    fields = ("decode_block_table", "decode_context_lens") if want.attention.num_decodes else ()
    _compare(staged, got, want, fields=fields)

    positions = want.positions
    _same(got.paged_context_lens, positions + 1, "paged_context_lens")
    width = -(-int(positions.max() + 1) // BLOCK_SIZE)
    n = want.attention.num_decodes
    owners = list(want.ordered[:n])
    for span, state in zip(want.attention.prefills, want.ordered[n:], strict=True):
        owners += [state] * (span.end - span.start)
    assert got.paged_block_table.tolist() == [(state.block_ids + [0] * width)[:width] for state in owners]


def _shape(*scheduled: tuple[int, int]) -> StepShape:
    """A step of requests with (computed, scheduled) tokens each."""
    states = [
        _state(handle, computed + count, computed, count, list(range(-(-(computed + count) // BLOCK_SIZE))), True)
        for handle, (computed, count) in enumerate(scheduled)
    ]
    return _step(states)


def test_select_backend_picks_one_backend_per_step() -> None:
    decode_only, mixed = _shape((9, 1), (3, 1)), _shape((9, 1), (0, 12))
    long_prefill = _shape((9, 1), (100, 30))
    triton, torch_path = AttentionSettings("triton"), AttentionSettings("torch", workspace=WORKSPACE)
    native = AttentionSettings("native", paged_prefill_max_context=64)

    assert select_backend(decode_only, triton, host_table=False) is PAGED_DECODE
    assert select_backend(mixed, triton, host_table=False) is TRITON_MIXED
    assert select_backend(mixed, triton, host_table=True) is TRITON_MIXED  # Triton under the CPU interpreter
    assert select_backend(decode_only, torch_path, host_table=True) is TORCH
    assert select_backend(mixed, torch_path, host_table=True) is TORCH
    # The native CPU kernel: every row in one call while the prefill chunks are short, else decodes and SDPA.
    assert select_backend(mixed, native, host_table=True) is CPU_PAGED
    assert select_backend(long_prefill, native, host_table=True) is PAGED_DECODE
    assert select_backend(decode_only, native, host_table=True) is PAGED_DECODE
    assert select_backend(mixed, native, host_table=False) is PAGED_DECODE  # its rows are gathered on the host
    assert select_backend(mixed, AttentionSettings("native"), host_table=True) is PAGED_DECODE
    nothing = _state(0, 3, 3, 0, [1], True)
    assert prepare_step(InputBuffers(BLOCK_SIZE, CPU), triton, [nothing]) is None  # no step, no backend


def test_only_the_mixed_backend_stages_every_sequence() -> None:
    assert TRITON_MIXED.staging.all_sequences and TRITON_MIXED.staging.query_starts
    for backend in (TORCH, PAGED_DECODE, CPU_PAGED):
        assert not backend.staging.all_sequences and not backend.staging.query_starts, backend


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="decode_path"):
        AttentionSettings("cuda")
    with pytest.raises(ValueError, match="native"):
        AttentionSettings("triton", paged_prefill_max_context=64)
