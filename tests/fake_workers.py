"""A fake worker group that keeps a model of every KV slot, so tests can see what a step reads and writes.

Each slot holds a fingerprint of the token sequence up to and including its position. A step that attends over
a slot whose fingerprint is not the one its own tokens imply would, on real ranks, read another sequence's KV
or garbage: the fake records it in `corrupt_reads`. Failures can be injected half-way through a step, after some
of its slots were written, as a crashing rank would leave them.
"""

from __future__ import annotations

import time

from pagerail.cluster.core.executor import CompletedStep, PendingStep, WorkerGroupError
from pagerail.proto import step_pb2
from pagerail.worker.request_state import RequestStates
from pagerail.worker.spec_decode.verify import accepted_tokens


def fingerprint(token_ids: list[int], position: int, lora_id: int = 0) -> int:
    """What the KV at `position` depends on: every token up to and including it, and the LoRA adapter (if any)
    whose projections computed it."""
    tokens = tuple(token_ids[: position + 1])
    return hash((lora_id, tokens)) if lora_id else hash(tokens)


def next_token(token_ids: list[int], vocab_size: int) -> int:
    """A deterministic 'sample' that depends on the whole sequence, so a wrong context changes the output."""
    return (sum(t * (i + 1) for i, t in enumerate(token_ids)) * 31 + len(token_ids)) % vocab_size


def run_now(execute, batch: step_pb2.StepBatch) -> CompletedStep:
    """Run `execute(batch)` at once and wrap its outcome, a WorkerGroupError included."""
    try:
        return CompletedStep(execute(batch))
    except WorkerGroupError as error:
        return CompletedStep(error=error)


class FakeKVWorkers:
    """Implements the engine's executor interface over the real worker-side request state (RequestStates)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        step_delay_s: float = 0.0,
        sliding_window: int | None = None,
    ) -> None:
        self.step_delay_s = step_delay_s  # a forward pass's duration, so that concurrent callers overlap
        # Attention of a model whose every layer slides reads only the last sliding_window positions.
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv: dict[int, int] = {}  # slot -> fingerprint
        self.states = RequestStates(device="cpu")
        self.steps = 0
        self.restarts = 0
        self.corrupt_reads: list[tuple[int, int]] = []  # (handle, position)
        self.empty_rows: list[int] = []  # handles scheduled with no token to compute
        # The next step fails after writing half of its slots: "worker" (WorkerGroupError) or "crash" (other).
        self.fail_next: str | None = None
        # Fail every step that runs one of these handles (a request that crashes the workers).
        self.poison_handles: set[int] = set()

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        self.steps += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        scheduled = self.states.apply(batch)
        for state in scheduled:
            if state.num_lookahead and state.num_scheduled_tokens == 1:
                self._propose(state)
        failure, self.fail_next = self.fail_next, None
        if any(state.handle in self.poison_handles for state in scheduled):
            failure = "worker"
        writes = [
            (state, pos)
            for state in scheduled
            for pos in range(state.num_computed_tokens, state.num_computed_tokens + state.num_scheduled_tokens)
        ]
        if failure is not None:
            # A rank that fails part-way has written some of the step's KV; the rest of the slots keep whatever
            # they held before (another sequence's KV, or nothing).
            for state, pos in writes[: len(writes) // 2]:
                self.kv[self._slot(state.block_ids, pos)] = fingerprint(state.token_ids, pos, state.lora_id)
            if failure == "worker":
                raise WorkerGroupError("a rank died during the step")
            raise RuntimeError("the forward pass failed")
        result = step_pb2.StepResult(step_id=batch.step_id)
        for state in scheduled:
            if state.num_scheduled_tokens < 1:
                # The real input batch drops such a row: it computes nothing and samples nothing.
                self.empty_rows.append(state.handle)
                continue
            end = state.num_computed_tokens + state.num_scheduled_tokens
            for pos in range(state.num_computed_tokens, end):
                self.kv[self._slot(state.block_ids, pos)] = fingerprint(state.token_ids, pos, state.lora_id)
            # Attention reads every slot of the context, or with a window every slot some query of the step sees.
            first_read = (
                0 if self.sliding_window is None else max(0, state.num_computed_tokens - self.sliding_window + 1)
            )
            for pos in range(first_read, end):
                if self.kv.get(self._slot(state.block_ids, pos)) != fingerprint(state.token_ids, pos, state.lora_id):
                    self.corrupt_reads.append((state.handle, pos))
                    break
            if state.drafts:
                self._verify(state, result)
                continue
            if not state.skip_sampling:
                token = next_token(state.token_ids[:end], self.vocab_size)
                result.handles.append(state.handle)
                result.token_ids.append(token)
                state.token_ids.append(token)  # as the real ranks do: the head never sends it back
            state.num_computed_tokens = end
        return result

    def _propose(self, state) -> None:
        """Drafts for the lookahead the head made room for: each the true next token two times in three, another
        token otherwise, so runs are kept whole, in part, or not at all. They are appended as the real ranks do."""
        drafts: list[int] = []
        for index in range(state.num_lookahead):
            true = next_token(state.token_ids + drafts, self.vocab_size)
            wrong = hash((self.steps, state.handle, index)) % 3 == 0
            drafts.append((true + 1) % self.vocab_size if wrong else true)
        state.drafts = drafts
        state.token_ids.extend(drafts)
        state.num_scheduled_tokens = 1 + len(drafts)

    def _verify(self, state, result: step_pb2.StepResult) -> None:
        """Every row's target token, the kept run, and the drafts dropped: their KV stays in slots past the kept
        positions, as a real rank leaves it."""
        drafts, start = state.drafts, state.num_computed_tokens
        targets = [next_token(state.token_ids[: start + row + 1], self.vocab_size) for row in range(len(drafts) + 1)]
        run = accepted_tokens(drafts, targets)
        del state.token_ids[-len(drafts) :]
        state.token_ids.extend(run)
        state.num_computed_tokens = start + len(run)
        state.drafts = None
        result.spec_handles.append(state.handle)
        result.spec_counts.append(len(run))
        result.spec_num_drafts.append(len(drafts))
        result.spec_token_ids.extend(run)

    def submit(self, batch: step_pb2.StepBatch) -> PendingStep:
        """Runs the step at once, in submission order; its outcome (a WorkerGroupError too) waits for result()."""
        return run_now(self.execute, batch)

    def restart(self) -> int:
        self.restarts += 1
        self.kv.clear()
        self.states = RequestStates(device="cpu")
        return self.num_blocks

    def shutdown(self) -> None:
        pass
