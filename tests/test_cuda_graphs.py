"""Decode graphs on the CPU: the capture-size ladder, the static inputs' padding, and a runner whose stand-in graphs
re-run the captured forward from the static buffers, against eager execution step by step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pagerail.worker.layers.attention as attention
import pagerail.worker.layers.triton_attention as triton_attention
from pagerail.proto import step_pb2
from pagerail.worker.cuda_graphs import CapturePlan, DecodeGraphs, StaticDecodeInputs, capture_sizes
from pagerail.worker.input_batch import FlatBatch
from pagerail.worker.kv_cache import allocate_kv_caches
from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan
from pagerail.worker.model_loader import load_model
from pagerail.worker.model_runner import ModelRunner, decode_path_of
from pagerail.worker.parallel_state import SINGLE_RANK
from tests.requirements import require
from tests.tiny_models import make_tiny_model
from tests.triton_interpreter import assert_interpreted_tests_pass

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 160  # the head's pool; the scratch block is one past it
SCRATCH = NUM_BLOCKS
MAX_NUM_SEQS = 24  # captured sizes 1, 2, 4, 8, 16, 24
MAX_BLOCKS_PER_SEQ = 10


# --- the capture-size plan --------------------------------------------------------------------------------------


def test_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(45) == [1, 2, 4, 8, 16, 24, 32, 40, 45]
    assert capture_sizes(256, max_capture_size=20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(0) == []


@given(st.integers(1, 1100), st.one_of(st.none(), st.integers(1, 600)), st.data())
def test_padded_size_is_the_smallest_captured_size_that_fits(max_num_seqs, max_capture_size, data):
    plan = CapturePlan.for_limits(max_num_seqs, max_capture_size)
    limit = max_num_seqs if max_capture_size is None else min(max_num_seqs, max_capture_size)
    assert plan.max_size == limit
    assert all(b - a <= 8 for a, b in zip(plan.sizes, plan.sizes[1:], strict=False))
    n = data.draw(st.integers(1, limit + 20))
    padded = plan.padded_size(n)
    if n > limit:
        assert padded is None
    else:
        # Checked against a linear scan, independent of the bisection.
        assert padded == min(size for size in plan.sizes if size >= n)


def test_every_size_up_to_the_limit_is_covered():
    plan = CapturePlan.for_limits(256)
    for n in range(1, 257):
        padded = plan.padded_size(n)
        assert padded is not None and n <= padded <= n + 7
    assert plan.padded_size(257) is None and plan.padded_size(0) is None


# --- static inputs ------------------------------------------------------------------------------------------------


def decode_step(rows: list[tuple[int, int, list[int]]], width: int) -> FlatBatch:
    """A decode-only FlatBatch: (token, position, blocks) per row, the table `width` columns wide."""
    n = len(rows)
    positions = torch.tensor([p for _, p, _ in rows])
    table = torch.tensor([blocks + [0] * (width - len(blocks)) for _, _, blocks in rows])
    slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for _, p, blocks in rows])
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_size=BLOCK_SIZE,
        num_decodes=n,
        decode_block_table=table,
        decode_context_lens=positions + 1,
    )
    return FlatBatch(torch.tensor([t for t, _, _ in rows]), positions, meta, [], [], torch.arange(n))


def random_rows(rng: random.Random, n: int) -> list[tuple[int, int, list[int]]]:
    rows = []
    for _ in range(n):
        position = rng.randrange(30)
        blocks = rng.sample(range(NUM_BLOCKS), position // BLOCK_SIZE + 1)
        rows.append((rng.randrange(1, 250), position, blocks))
    return rows


def assert_static_rows(inputs: StaticDecodeInputs, flat: FlatBatch, size: int) -> None:
    n = flat.attention.num_decodes
    meta = inputs.metadata(size)
    width = flat.attention.decode_block_table.shape[1]
    assert torch.equal(inputs.input_ids[:n], flat.input_ids)
    assert torch.equal(inputs.positions[:n], flat.positions)
    assert torch.equal(meta.slot_mapping[:n], flat.attention.slot_mapping)
    assert torch.equal(meta.decode_context_lens[:n], flat.attention.decode_context_lens)
    assert torch.equal(meta.decode_block_table[:n, :width], flat.attention.decode_block_table)
    # Padded rows: token 0 at position 0, writing and reading the scratch block's first slot only.
    assert (inputs.input_ids[n:size] == 0).all() and (inputs.positions[n:size] == 0).all()
    assert (meta.slot_mapping[n:] == SCRATCH * BLOCK_SIZE).all()
    assert (meta.decode_context_lens[n:] == 1).all()
    assert (meta.decode_block_table[n:, 0] == SCRATCH).all()
    assert meta.num_decodes == size and not meta.prefills
    assert meta.decode_block_table.shape == (size, MAX_BLOCKS_PER_SEQ)


def test_static_inputs_pad_rows_after_larger_steps():
    rng = random.Random(0)
    inputs = StaticDecodeInputs(24, MAX_BLOCKS_PER_SEQ, 8, torch.float32, CPU, BLOCK_SIZE, SCRATCH)
    plan = CapturePlan.for_limits(24)
    # Growing and shrinking batches: rows a larger step wrote must be padding again for a smaller one.
    for n in [3, 17, 5, 24, 1, 9, 2, 16]:
        flat = decode_step(random_rows(rng, n), width=rng.randint(8, MAX_BLOCKS_PER_SEQ))
        assert inputs.fill(flat) == n
        assert_static_rows(inputs, flat, plan.padded_size(n))
        assert_static_rows(inputs, flat, 24)  # every row past n is padding, not only those up to the padded size


class CountingBackend:
    """Stands in for CUDA graphs: capture runs the function once, as a capture does, and replay re-runs it."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays = 0

    def capture(self, fn):
        fn()
        self.captured.append(fn.args[0])

        def replay() -> None:
            self.replays += 1
            fn()

        return replay

    def memory(self) -> tuple[int, int]:
        return 0, 0

    def synchronize(self) -> None:
        pass


class RecordingModel(torch.nn.Module):
    """Returns each row's token id as its hidden state, and remembers the inputs it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, AttentionMetadata]] = []

    def forward(self, input_ids, positions, meta):
        self.calls.append((input_ids.clone(), meta))
        return input_ids[:, None].float().expand(-1, 8)


def test_decode_graphs_pick_a_size_or_leave_the_step_to_eager():
    backend = CountingBackend()
    inputs = StaticDecodeInputs(16, MAX_BLOCKS_PER_SEQ, 8, torch.float32, CPU, BLOCK_SIZE, SCRATCH)
    graphs = DecodeGraphs(RecordingModel(), CapturePlan.for_limits(16), inputs, backend)
    graphs.capture()
    assert backend.captured == [16, 8, 4, 2, 1]  # largest first
    rng = random.Random(1)
    flat = decode_step(random_rows(rng, 5), width=MAX_BLOCKS_PER_SEQ)
    hidden = graphs.run(flat)
    assert backend.replays == 1 and graphs.model.calls[-1][0].shape == (8,)
    assert torch.equal(hidden[:, 0], flat.input_ids.float())
    assert graphs.run(decode_step(random_rows(rng, 17), width=8)) is None  # above the largest graph
    assert graphs.run(decode_step(random_rows(rng, 2), width=MAX_BLOCKS_PER_SEQ + 1)) is None  # table too wide
    mixed = decode_step(random_rows(rng, 3), width=8)
    mixed.attention.prefills.append(PrefillSpan(3, 3))
    assert graphs.run(mixed) is None
    assert backend.replays == 1


# --- the runner: stand-in graphs against eager execution -----------------------------------------------------------


@dataclass
class HeadRequest:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    known: bool = False


class Head:
    """Schedules every running request each step (whole prompt when new, one token after) and hands out blocks."""

    def __init__(self) -> None:
        self.free = list(range(NUM_BLOCKS))
        random.Random(2).shuffle(self.free)  # blocks out of order, so a wrong table row cannot pass by luck
        self.ever_used: set[int] = set()
        self.requests: dict[int, HeadRequest] = {}
        self.finished: list[int] = []
        self.step_id = 0

    def add(self, handle: int, prompt: list[int]) -> None:
        self.requests[handle] = HeadRequest(list(prompt))

    def finish(self, handle: int) -> None:
        self.free.extend(self.requests.pop(handle).blocks)
        self.finished.append(handle)

    def batch(self) -> step_pb2.StepBatch:
        self.step_id += 1
        batch = step_pb2.StepBatch(step_id=self.step_id, finished=self.finished)
        self.finished = []
        for handle, request in self.requests.items():
            scheduled = len(request.tokens) - request.computed
            needed = -(-(request.computed + scheduled) // BLOCK_SIZE) - len(request.blocks)
            new_blocks = [self.free.pop() for _ in range(needed)]
            self.ever_used.update(new_blocks)
            request.blocks.extend(new_blocks)
            if request.known:
                batch.cached_requests.append(
                    step_pb2.CachedRequest(handle=handle, new_block_ids=new_blocks, num_scheduled_tokens=scheduled)
                )
            else:
                request.known = True
                batch.new_requests.append(
                    step_pb2.NewRequest(
                        handle=handle,
                        request_id=f"r{handle}",
                        token_ids=request.tokens,
                        num_prompt_tokens=len(request.tokens),
                        sampling=step_pb2.SamplingParams(temperature=0.0, num_logprobs=0),
                        block_ids=request.blocks,
                        num_scheduled_tokens=scheduled,
                    )
                )
        return batch

    def keep(self, result: step_pb2.StepResult) -> None:
        for handle, token in zip(result.handles, result.token_ids, strict=True):
            request = self.requests[handle]
            request.computed = len(request.tokens)
            request.tokens.append(token)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def make_runner(model_dir, max_num_seqs: int, backend: CountingBackend | None) -> ModelRunner:
    model = load_model(model_dir)
    caches = allocate_kv_caches(
        model.num_layers, NUM_BLOCKS + 1, BLOCK_SIZE, model.num_kv_heads_per_rank, model.head_dim, torch.float32, CPU
    )
    for layer, cache in zip(model.attention_layers(), caches, strict=True):
        layer.kv_cache = cache
    return ModelRunner(
        model,
        BLOCK_SIZE,
        CPU,
        SINGLE_RANK,
        max_num_tokens=256,
        max_num_seqs=max_num_seqs,
        max_blocks_per_seq=MAX_BLOCKS_PER_SEQ,
        enforce_eager=backend is None,
        scratch_block=SCRATCH,
        graph_backend=backend,
    )


@dataclass
class Stage:
    """Handles finished, then requests added, then `steps` steps; `decode_rows` set: decode-only steps of that size."""

    finish: list[int]
    add: int
    steps: int
    decode_rows: int | None


def run_stages(stages: list[Stage], seed: int, step) -> Head:
    """Drive `step(stage, batch) -> StepResult` through `stages` as a head would: requests with random prompts
    join and leave, and each result's sampled tokens become the next step's inputs. Returns the head."""
    rng, head, next_handle = random.Random(seed), Head(), 0
    for stage in stages:
        for handle in stage.finish:
            head.finish(handle)
        for handle in range(next_handle, next_handle + stage.add):
            head.add(handle, [rng.randrange(3, 250) for _ in range(rng.randint(3, 14))])
        next_handle += stage.add
        for _ in range(stage.steps):
            head.keep(step(stage, head.batch()))
    return head


# Captured sizes 1, 2, 4, 8, 16, 24: decode steps of 3 → 4, 5 → 8, 17 → 24, 9 → 16 and 2 (exact), with requests
# joining in mixed steps (eager) and leaving between steps.
STAGES = [
    Stage([], 3, 1, None),
    Stage([], 0, 2, 3),
    Stage([], 2, 1, None),
    Stage([], 0, 2, 5),
    Stage([1], 13, 1, None),
    Stage([], 0, 3, 17),
    Stage([0, 2, 5, 7, 9, 11, 13, 15], 0, 2, 9),
    Stage([3, 4, 6, 8, 10, 12, 14], 0, 2, 2),
]
# The interpreted Triton kernels are slow: captured sizes 1, 2, 4, 8 and a shorter run.
SHORT_STAGES = [
    Stage([], 3, 1, None),
    Stage([], 0, 2, 3),
    Stage([], 2, 1, None),
    Stage([], 0, 2, 5),
    Stage([0, 2], 0, 2, 3),
]


@pytest.mark.parametrize("decode_path", ["torch", "native", "triton"])
def test_replayed_decodes_match_eager(model_dir, decode_path, monkeypatch):
    if decode_path == "triton":
        # Run by test_replayed_decodes_match_eager_through_interpreted_triton, under the interpreter.
        if not triton_attention.INTERPRETED:
            pytest.skip("runs under TRITON_INTERPRET=1 only")
    else:
        if triton_attention.INTERPRETED:
            pytest.skip("the interpreter puts every decode on the Triton path")
        if decode_path == "torch":
            monkeypatch.setattr(attention, "native_kernel", lambda: None)
        else:
            require(attention.native_kernel() is not None, "needs the native CPU attention kernel (a C compiler)")
    stages, max_num_seqs = (SHORT_STAGES, 8) if decode_path == "triton" else (STAGES, MAX_NUM_SEQS)
    backend = CountingBackend()
    replayed, eager = make_runner(model_dir, max_num_seqs, backend), make_runner(model_dir, max_num_seqs, None)
    assert eager.graphs is None and replayed.graphs is not None
    assert backend.captured == sorted(CapturePlan.for_limits(max_num_seqs).sizes, reverse=True)
    assert decode_path_of(replayed.model, CPU, torch.float32) == decode_path

    def step(stage: Stage, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        ours, theirs = replayed.execute(batch), eager.execute(batch)
        if stage.decode_rows is not None:
            assert len(batch.new_requests) == 0 and len(ours.handles) == stage.decode_rows
        assert list(ours.handles) == list(theirs.handles)
        assert list(ours.token_ids) == list(theirs.token_ids), f"step {batch.step_id}"
        torch.testing.assert_close(list(ours.logprobs), list(theirs.logprobs), atol=1e-5, rtol=0)
        return ours

    head = run_stages(stages, 3, step)

    num_replays = sum(stage.steps for stage in stages if stage.decode_rows is not None)
    num_eager = sum(stage.steps for stage in stages if stage.decode_rows is None)
    assert (replayed.num_replayed_steps, replayed.num_eager_steps) == (num_replays, num_eager)
    assert (eager.num_replayed_steps, eager.num_eager_steps) == (0, num_replays + num_eager)
    assert backend.replays == num_replays

    # The padded rows wrote into the scratch block's first slot and nowhere else.
    scratch = slice(SCRATCH * BLOCK_SIZE, (SCRATCH + 1) * BLOCK_SIZE)
    unused = sorted(set(range(NUM_BLOCKS)) - head.ever_used)
    for ours, theirs in zip(replayed.model.attention_layers(), eager.model.attention_layers(), strict=True):
        torch.testing.assert_close(ours.kv_cache[:, :, : scratch.start], theirs.kv_cache[:, :, : scratch.start])
        assert not theirs.kv_cache[:, :, scratch].any()
        assert ours.kv_cache[:, :, scratch.start].abs().sum() > 0
        assert not ours.kv_cache[:, :, scratch.start + 1 : scratch.stop].any()
        paged = ours.kv_cache.view(2, ours.num_kv_heads, -1, BLOCK_SIZE, ours.head_dim)
        assert not paged[:, :, unused].any()


@pytest.mark.slow
def test_replayed_decodes_match_eager_through_interpreted_triton():
    """The Triton decode kernel (and fused ops) the GPU captures, reading the static full-width table, on the CPU."""
    assert_interpreted_tests_pass(__file__, "match_eager[triton]", 1)
