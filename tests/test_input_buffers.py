"""Persistent input buffers against the list-based reference builder, driven through random step sequences.

A simulated head keeps each request's tokens, blocks and progress and sends the worker the same kind of deltas
the engine does: new requests (with and without a cached prefix), decodes, chunked prefills, preemption and
resumption with a new block list, streaming-input chunks that grow the prompt, finished requests and reused
handles. After every step the tensors the model would see must be exactly those the reference builds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagerail.proto import step_pb2
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.input_batch import FlatBatch, GatherWorkspace
from pagerail.worker.input_buffers import InputBuffers
from pagerail.worker.layers.attention import decode_key_mask
from pagerail.worker.request_state import RequestStates
from pagerail.worker.step_inputs import prepare_step
from tests.input_batch_reference import build_flat_batch

CPU = torch.device("cpu")
HANDLES = range(8)  # a small pool, so finished handles come back as new requests
VOCAB = 1000
# What the head does with a known request in a step; "run" resumes a preempted one.
ACTIONS = ["run"] * 6 + ["wait", "wait", "finish", "preempt", "grow"]


@dataclass
class HeadRequest:
    """The head's view of one request."""

    handle: int
    tokens: list[int]
    num_prompt: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    preempted: bool = False


class InputBuffersMachine(RuleBasedStateMachine):
    """Random steps sent to two workers: one with the reference builder, one with the persistent buffers."""

    device = CPU  # tests/gpu runs the same machine on CUDA

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 16]),
        capacity=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 8)),
        torch_decode=st.booleans(),
        in_place=st.booleans(),
        mixed=st.booleans(),
        paged_limit=st.sampled_from([0, 8, 64, 1 << 20]),
    )
    def setup(
        self,
        block_size: int,
        capacity: tuple[int, int, int],
        torch_decode: bool,
        in_place: bool,
        mixed: bool,
        paged_limit: int,
    ) -> None:
        """`in_place` False runs the device path on the CPU: table writes staged, then applied by index. The rank's
        decode path is torch's (`torch_decode`), else Triton's (`mixed`: steps with prefill chunks are laid out for
        the mixed-batch kernel), else the native CPU kernel's, whose steps with prefill chunks ending within
        `paged_limit` also get every row's table row and context length."""
        self.block_size = block_size
        path = "torch" if torch_decode else "triton" if mixed else "native"
        self.paged_limit = paged_limit if path == "native" else 0  # a setting of the native kernel alone
        self.in_place = in_place and self.device.type == "cpu"
        self.mixed = path == "triton"
        self.torch_decode = torch_decode
        # Only the torch path gathers into a workspace.
        self.settings = AttentionSettings(path, self.paged_limit, self._workspace() if torch_decode else None)
        num_seqs, blocks_per_seq, num_tokens = capacity
        # Tiny starting sizes, so every buffer has to grow along the way.
        self.buffers = InputBuffers(
            block_size,
            self.device,
            max_num_tokens=num_tokens,
            max_num_seqs=num_seqs,
            max_blocks_per_seq=blocks_per_seq,
            in_place=in_place if self.device.type == "cpu" else None,
        )
        self.ours = RequestStates(self.device, on_drop=self.buffers.release)
        self.reference = RequestStates(self.device)
        self.reference_workspace = self._workspace() if torch_decode else None
        self.requests: dict[int, HeadRequest] = {}
        self.batch = step_pb2.StepBatch(step_id=0)
        self.counter = 1

    def _workspace(self) -> GatherWorkspace:
        return GatherWorkspace(self.block_size, 2, 4, torch.float32, self.device)

    def _blocks(self, rng: random.Random, request: HeadRequest, num_tokens: int) -> list[int]:
        """New block ids so the request covers `num_tokens` tokens, sometimes with a spare block or two."""
        needed = max(-(-num_tokens // self.block_size) - len(request.blocks), 0)
        return self._ids(needed + rng.choice([0, 0, 1, 2]), 4096)

    def _ids(self, count: int, bound: int) -> list[int]:
        """Distinct-looking ids from a counter: their values only need to tell misplaced entries apart."""
        start, self.counter = self.counter, self.counter + count
        return [(i * 2654435761) % bound for i in range(start, start + count)]

    def _chunk(self, rng: random.Random, request: HeadRequest) -> int:
        remaining = len(request.tokens) - request.computed
        return rng.choice([remaining, 1, rng.randint(1, remaining)])

    def _cached_prefix(self, rng: random.Random, num_tokens: int) -> int:
        """A prefix-cache hit: whole blocks, never the last token."""
        return rng.choice([0, rng.randint(0, (num_tokens - 1) // self.block_size) * self.block_size])

    # --- one step ---------------------------------------------------------------------------------------------

    @rule(seed=st.integers(0, 2**32 - 1))
    def step(self, seed: int) -> None:
        """The head changes and schedules some requests; both workers build the step's inputs; they must match.

        Everything happens in this one rule, so every rule call is a step with a full batch behind it. The
        step's choices come from `seed` rather than from one hypothesis draw each, which would spend the test's
        time in hypothesis instead of in the buffers; hypothesis still picks, and shrinks, the step sequence.
        """
        rng = random.Random(seed)
        known = sorted(self.requests)
        rng.shuffle(known)  # the order of the deltas is the order of the rows
        for handle in known:
            request = self.requests[handle]
            action = rng.choice(ACTIONS)
            if action == "finish":
                del self.requests[handle]
                self.batch.finished.append(handle)
            elif action == "preempt" and not request.preempted:
                request.preempted, request.blocks, request.computed = True, [], 0
                self.batch.preempted.append(handle)
            elif action == "grow":
                # A streaming-input chunk: the prompt grows, earlier outputs become prompt.
                self._schedule_known(rng, request, self._ids(rng.randint(1, 12), VOCAB))
            elif action == "run":
                self._schedule_known(rng, request, [])
        # Finished handles come straight back as new requests, as the head reuses them.
        free = [h for h in HANDLES if h not in self.requests]
        for handle in rng.sample(free, min(len(free), rng.choice([0, 0, 1, 1, 2, 3]))):
            self._join(rng, handle)

        ours = prepare_step(self.buffers, self.settings, self.ours.apply(self.batch))
        reference_states = self.reference.apply(self.batch)
        reference = None
        if any(s.num_scheduled_tokens > 0 for s in reference_states):
            reference = build_flat_batch(
                reference_states, self.block_size, self.device, self.reference_workspace, mixed=self.mixed
            )
        self._compare(ours, reference)
        if ours is not None:
            self._finish_step(ours, reference)
        self.batch = step_pb2.StepBatch(step_id=self.batch.step_id + 1)

    def _join(self, rng: random.Random, handle: int) -> None:
        """A new request, maybe with a cached prefix, maybe restarted with outputs already in its tokens."""
        tokens = self._ids(rng.randint(1, 32), VOCAB)
        num_prompt = rng.choice([len(tokens), rng.randint(1, len(tokens))])
        cached = self._cached_prefix(rng, len(tokens))
        request = HeadRequest(handle, tokens, num_prompt, computed=cached)
        count = self._chunk(rng, request)
        request.blocks = self._blocks(rng, request, cached + count)
        self.batch.new_requests.add(
            handle=handle,
            token_ids=tokens,
            num_prompt_tokens=num_prompt,
            sampling=step_pb2.SamplingParams(),
            block_ids=request.blocks,
            num_computed_tokens=cached,
            num_scheduled_tokens=count,
            skip_sampling=cached + count < len(tokens) or rng.random() < 0.2,
        )
        self.requests[handle] = request

    def _schedule_known(self, rng: random.Random, request: HeadRequest, chunk: list[int]) -> None:
        delta = self.batch.cached_requests.add(handle=request.handle)
        if request.computed == len(request.tokens) and not chunk:
            # Nothing left to compute: only a new input chunk can run it again.
            chunk = self._ids(rng.randint(1, 6), VOCAB)
        if request.preempted:
            request.preempted = False
            request.computed = self._cached_prefix(rng, len(request.tokens))
            delta.resumed = True
            delta.num_computed_tokens = request.computed
        if chunk:
            request.tokens.extend(chunk)
            request.num_prompt = len(request.tokens)
            delta.new_token_ids.extend(chunk)
            delta.num_prompt_tokens = request.num_prompt
        # Now and then a row with nothing to compute (it only gets blocks): the worker drops it from the batch.
        count = 0 if rng.random() < 0.1 else self._chunk(rng, request)
        new_blocks = self._blocks(rng, request, request.computed + count)
        request.blocks.extend(new_blocks)
        delta.new_block_ids.extend(request.blocks if delta.resumed else new_blocks)
        delta.num_scheduled_tokens = count
        partial = request.computed + count < len(request.tokens)
        delta.skip_sampling = count == 0 or partial or rng.random() < 0.2
        plain = count == 1 and not (delta.skip_sampling or delta.resumed or chunk or delta.new_block_ids)
        if plain and rng.random() < 0.7:
            # A plain decode travels as a bare handle, as the head's step builder sends it.
            del self.batch.cached_requests[-1]
            self.batch.decode_handles.append(request.handle)

    def _finish_step(self, ours: FlatBatch, reference: FlatBatch) -> None:
        """What the runner does after the forward: append sampled tokens, advance the computed counts."""
        sampled = self._ids(len(ours.sample_states), VOCAB)
        for flat in (ours, reference):
            for state, token in zip(flat.sample_states, sampled, strict=True):
                state.token_ids.append(token)
            for state in flat.ordered:
                state.num_computed_tokens += state.num_scheduled_tokens
        for state, token in zip(ours.sample_states, sampled, strict=True):
            self.requests[state.handle].tokens.append(token)
        for state in ours.ordered:
            self.requests[state.handle].computed += state.num_scheduled_tokens

    def _compare(self, ours: FlatBatch | None, reference: FlatBatch | None) -> None:
        assert (ours is None) == (reference is None)
        if ours is None:
            return
        for name in ("input_ids", "positions", "sample_rows"):
            _same(getattr(ours, name), getattr(reference, name), name)
        assert [s.handle for s in ours.ordered] == [s.handle for s in reference.ordered]
        assert [s.handle for s in ours.sample_states] == [s.handle for s in reference.sample_states]
        got, want = ours.attention, reference.attention
        _same(got.slot_mapping, want.slot_mapping, "slot_mapping")
        _same(got.mixed_query_starts, want.mixed_query_starts, "mixed_query_starts")
        assert (got.block_size, got.num_decodes) == (want.block_size, want.num_decodes)
        for name in ("decode_block_table", "decode_context_lens", "mixed_block_table", "mixed_context_lens"):
            _same(getattr(got, name), getattr(want, name), name)
        if self.torch_decode:
            _same(got.decode_mask, want.decode_mask, "decode_mask")
        else:
            assert got.decode_mask is None, "the kernels do not read a decode mask: none is built for them"
            if want.decode_mask is not None:
                # What the torch path derives on the device is the reference's mask.
                width = want.decode_mask.shape[-1]
                _same(decode_key_mask(got.decode_context_lens, width), want.decode_mask, "derived decode_mask")
        for name in ("decode_key_buffer", "decode_value_buffer"):
            mine, theirs = getattr(got, name), getattr(want, name)
            assert (mine is None and theirs is None) or mine.shape == theirs.shape, name
        self._compare_paged_rows(ours, reference)
        assert len(got.prefills) == len(want.prefills)
        for mine, theirs in zip(got.prefills, want.prefills, strict=True):
            assert (mine.start, mine.end, mine.context_len) == (theirs.start, theirs.end, theirs.context_len)
            _same(mine.context_blocks, theirs.context_blocks, "context_blocks")
            _same(mine.mask, theirs.mask, "prefill mask")

    def _compare_paged_rows(self, ours: FlatBatch, reference: FlatBatch) -> None:
        """Every row's table row and context length, when (and only when) the step's prefill chunks are short."""
        got, n = ours.attention, ours.attention.num_decodes
        spans = reference.attention.prefills
        positions = reference.positions.cpu()
        expected = bool(spans) and self.in_place and not self.mixed and int(positions[n:].max()) + 1 <= self.paged_limit
        assert (got.paged_block_table is not None) == expected, "the paged rows are built exactly when they apply"
        if not expected:
            return
        _same(got.paged_context_lens, positions + 1, "paged_context_lens")
        owners = list(ours.ordered[:n])
        for span, state in zip(spans, ours.ordered[n:], strict=True):
            owners += [state] * (span.end - span.start)
        width = got.paged_block_table.shape[1]
        assert width == -(-int(positions.max() + 1) // self.block_size)
        rows = [(state.block_ids + [0] * width)[:width] for state in owners]
        assert got.paged_block_table.tolist() == rows

    @invariant()
    def rows_are_owned_once(self) -> None:
        if not hasattr(self, "buffers"):
            return
        rows = [row.index for row in self.buffers._rows.values()]
        assert len(rows) == len(set(rows)) and not set(rows) & set(self.buffers._free)
        assert set(self.buffers._rows) <= set(self.ours.states)

    @invariant()
    def a_state_marked_current_has_its_block_list_in_its_row(self) -> None:
        if not hasattr(self, "buffers"):
            return
        table = self.buffers.block_table
        for state in self.ours.states.values():
            if state.table_row >= 0:
                row = table[state.table_row]
                count = len(state.block_ids)
                assert row[:count].tolist() == state.block_ids and not row[count:].any(), state.handle


def test_every_change_of_a_block_list_marks_its_row_for_a_rewrite():
    states = RequestStates(CPU)
    greedy = step_pb2.SamplingParams(temperature=0.0)
    batch = step_pb2.StepBatch()
    batch.new_requests.add(handle=1, token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=greedy, block_ids=[4])
    (state,) = states.apply(batch)
    assert state.table_row == -1  # never written
    state.table_row = 5  # as the input buffers leave it once they wrote the row

    def step(**delta) -> None:
        batch = step_pb2.StepBatch()
        if delta:
            batch.cached_requests.add(handle=1, num_scheduled_tokens=1, **delta)
        else:
            batch.decode_handles.append(1)
        states.apply(batch)

    step()
    assert state.table_row == 5  # a bare decode keeps its blocks
    step(new_block_ids=[7])
    assert state.table_row == -1 and state.block_ids == [4, 7]
    state.table_row = 5
    step(resumed=True, new_block_ids=[8, 9], num_computed_tokens=2)
    assert state.table_row == -1 and state.block_ids == [8, 9]
    state.table_row = 5
    states.apply(step_pb2.StepBatch(preempted=[1]))
    assert state.table_row == -1 and state.block_ids == []


def test_the_table_knows_when_every_request_samples_by_argmax():
    states = RequestStates(CPU)
    greedy, sampled = step_pb2.SamplingParams(temperature=0.0), step_pb2.SamplingParams(temperature=0.8)

    def new(handle: int, sampling: step_pb2.SamplingParams) -> None:
        batch = step_pb2.StepBatch()
        batch.new_requests.add(handle=handle, token_ids=[1, 2], num_prompt_tokens=2, sampling=sampling, block_ids=[0])
        states.apply(batch)

    new(1, greedy)
    assert states.all_argmax_only
    new(2, sampled)
    assert not states.all_argmax_only
    new(2, greedy)  # the handle reused by a greedy request replaces the sampled one
    assert states.all_argmax_only
    new(3, sampled)
    states.apply(step_pb2.StepBatch(finished=[3]))
    assert states.all_argmax_only
    states.apply(step_pb2.StepBatch(finished=[3, 1, 2]))  # finishing an unknown handle changes nothing
    assert states.all_argmax_only and not states.states


def _same(mine: torch.Tensor | None, theirs: torch.Tensor | None, name: str) -> None:
    if mine is None or theirs is None:
        assert mine is None and theirs is None, f"{name}: {mine} vs {theirs}"
        return
    assert mine.dtype == theirs.dtype and mine.device == theirs.device, f"{name}: {mine.dtype} vs {theirs.dtype}"
    assert torch.equal(mine, theirs), f"{name}:\n{mine}\nvs reference\n{theirs}"


TestInputBuffers = InputBuffersMachine.TestCase
