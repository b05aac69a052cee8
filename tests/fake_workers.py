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
        # LoRA adapters as the ranks read them: a read asked for in a step batch ends `lora_read_steps` steps
        # later and is reported ready. At most `lora_capacity` adapters are held (None: any number); past it the
        # least recently read adapter no known request uses is dropped, and reported so. A request that runs with
        # an adapter not held was scheduled before its read ended (the head must never do that): its handle is
        # recorded.
        self.lora_read_steps = 2
        self.lora_capacity: int | None = None
        self.lora_reading: dict[int, int] = {}  # adapter id -> the step its read ends
        self.lora_held: dict[int, None] = {}  # least recently read first
        self.unready_adapter_runs: list[int] = []
        # Adapters dropped in a step whose answer never reached the head (it failed): the head may still count
        # them ready, and a rank then reads one in the step that needs it, as a real rank does.
        self.lora_drops_unsaid: set[int] = set()

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        self.steps += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        scheduled = self.states.apply(batch)
        ready, dropped = self._read_adapters(batch)
        for state in scheduled:
            if state.lora_id and state.lora_id not in self.lora_held:
                if state.lora_id in self.lora_drops_unsaid:
                    self.lora_held[state.lora_id] = None  # read in the step
                else:
                    self.unready_adapter_runs.append(state.handle)
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
            self.lora_drops_unsaid.update(dropped)
            # A rank that fails part-way has written some of the step's KV; the rest of the slots keep whatever
            # they held before (another sequence's KV, or nothing).
            for state, pos in writes[: len(writes) // 2]:
                self.kv[self._slot(state.block_ids, pos)] = fingerprint(state.token_ids, pos, state.lora_id)
            if failure == "worker":
                raise WorkerGroupError("a rank died during the step")
            raise RuntimeError("the forward pass failed")
        result = step_pb2.StepResult(step_id=batch.step_id)
        result.lora_ready.extend(ready)
        result.lora_dropped.extend(dropped)
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

    def _read_adapters(self, batch: step_pb2.StepBatch) -> tuple[list[int], list[int]]:
        """Start the reads the batch asks for; the adapters whose read ended (or that were held already), and
        those dropped to make room."""
        ready: list[int] = []
        dropped: list[int] = []
        for adapter in batch.lora_prefetch:
            if adapter.lora_id in self.lora_held:
                ready.append(adapter.lora_id)
            else:
                self.lora_reading.setdefault(adapter.lora_id, self.steps + self.lora_read_steps)
        for lora_id, ends in list(self.lora_reading.items()):
            if ends <= self.steps:
                del self.lora_reading[lora_id]
                self.lora_held[lora_id] = None
                self.lora_drops_unsaid.discard(lora_id)
                ready.append(lora_id)
        in_use = {state.lora_id for state in self.states.states.values()}
        while self.lora_capacity is not None and len(self.lora_held) > self.lora_capacity:
            victim = next((held for held in self.lora_held if held not in in_use), None)
            if victim is None:
                break  # every adapter held runs: a rank keeps them in its slots
            del self.lora_held[victim]
            dropped.append(victim)
        ready = [lora_id for lora_id in ready if lora_id in self.lora_held]
        return ready, dropped

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
        self.lora_reading.clear()
        self.lora_held.clear()
        self.lora_drops_unsaid.clear()
        return self.num_blocks

    def shutdown(self) -> None:
        pass
