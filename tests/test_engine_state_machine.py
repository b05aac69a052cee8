"""Stateful property test: random interleavings of requests, sessions, aborts, pauses, memory pressure and failed
steps against the real block table, scheduler and engine loop, with fake workers that model every KV slot.

After every rule the invariants below must hold; at the end every request finishes and nothing leaks.
`pytest --hypothesis-profile=long` runs far more examples (see tests/conftest.py).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagerail.cluster.core.block_table import RELEASED, BlockTable, root_hash
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.core.request import RequestStatus
from pagerail.cluster.core.scheduler_output import PauseMode
from pagerail.common.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import SamplingParams
from tests.fake_workers import FakeKVWorkers, fingerprint, next_token
from tests.test_block_table import check_lookups

VOCAB = 50
EOS = 49
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
# Shared prompt starts, so prefix-cache hits happen often.
BASES = [[1] * 24, list(range(2, 26)), [3, 4] * 12]


def _adapter_dirs() -> dict[int, str]:
    """Three LoRA adapter directories; the engine reads their configs (the fake workers never load weights)."""
    root = Path(tempfile.mkdtemp(prefix="state-machine-loras-"))
    paths = {}
    for lora_id in (1, 2, 3):
        path = root / f"adapter-{lora_id}"
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
        (path / "adapter_model.safetensors").write_bytes(b"")
        paths[lora_id] = str(path)
    return paths


ADAPTERS = _adapter_dirs()


class EngineMachine(RuleBasedStateMachine):
    """One replica's engine loop, driven by a client that does everything a client may do."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: EngineCore | None = None
        self.next_id = 0
        self.now = 0.0

    @initialize(
        num_blocks=st.integers(min_value=10, max_value=40),
        budget=st.integers(min_value=4, max_value=40),
        max_num_seqs=st.integers(min_value=1, max_value=6),
        max_sessions=st.integers(min_value=1, max_value=4),
        async_scheduling=st.booleans(),
        # A model whose every layer slides: blocks that leave the window go back to the pool mid-sequence.
        sliding_window=st.one_of(st.none(), st.integers(min_value=1, max_value=13)),
        # Speculative decoding's lookahead (0: off): drafts kept whole, in part or not at all, their KV left behind.
        speculate=st.sampled_from([0, 0, 1, 3]),
        max_loras=st.integers(min_value=1, max_value=3),
        scheduling_policy=st.sampled_from(["fcfs", "priority"]),
        fairness=st.sampled_from(["none", "vtc"]),
        # Flex work: at or above this priority (None: only service_tier flex), and its share of a step beside
        # interactive work.
        flex_priority_threshold=st.sampled_from([None, 1]),
        flex_tokens_per_step=st.integers(min_value=1, max_value=6),
    )
    def start(
        self,
        num_blocks: int,
        budget: int,
        max_num_seqs: int,
        max_sessions: int,
        async_scheduling: bool,
        sliding_window: int | None,
        speculate: int,
        max_loras: int,
        scheduling_policy: str,
        fairness: str,
        flex_priority_threshold: int | None,
        flex_tokens_per_step: int,
    ) -> None:
        self.workers = FakeKVWorkers(num_blocks, BLOCK_SIZE, VOCAB, sliding_window=sliding_window)
        # The ranks keep as many adapters read as they have slots (--max-cpu-loras' default): with three adapters
        # and fewer slots, reads push each other out and the head asks again.
        self.workers.lora_capacity = max_loras
        config = EngineConfig(
            cache=CacheConfig(block_size=BLOCK_SIZE),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=max_num_seqs,
                max_sessions=max_sessions,
                session_idle_timeout_s=100.0,
                async_scheduling=async_scheduling,
                scheduling_policy=scheduling_policy,
                fairness=fairness,
                flex_priority_threshold=flex_priority_threshold,
                flex_tokens_per_step=flex_tokens_per_step,
            ),
            speculative_config={"method": "ngram", "num_speculative_tokens": speculate} if speculate else None,
            lora=LoRAConfig(enable_lora=True, max_loras=max_loras),
        )
        self.engine = EngineCore(
            config, self.workers, MAX_MODEL_LEN, VOCAB, eos_token_ids=[EOS], sliding_window=sliding_window
        )
        self.engine.restart_backoff_s = 0.0
        self.engine.scheduler.clock = lambda: self.now
        self.all_requests = []
        self._check_flex_share(self.engine.scheduler)

    def _check_flex_share(self, scheduler) -> None:
        """Every step that begins with interactive work running or waiting gives flex work at most its share (but
        while the engine quarantines requests suspected of crashing the ranks, held at the back of the queue)."""
        schedule = scheduler.schedule

        def checked():
            queued = [*scheduler.running, *scheduler.waiting]
            interactive = scheduler.admission_cap is None and any(not r.flex for r in queued)
            out = schedule()
            flex_tokens = sum(item.num_tokens + item.lookahead for item in out.scheduled if item.request.flex)
            if interactive:
                assert flex_tokens <= scheduler.config.flex_tokens_per_step, (flex_tokens, out.scheduled)
            return out

        scheduler.schedule = checked

    # -- what clients do --------------------------------------------------------------------------------------

    def _prompt(self, base: int, length: int, tail: list[int]) -> list[int]:
        return BASES[base][:length] + tail

    @rule(
        base=st.integers(0, len(BASES) - 1),
        length=st.integers(1, 24),
        tail=st.lists(st.integers(0, VOCAB - 2), max_size=6),
        max_tokens=st.one_of(st.none(), st.integers(1, 8)),
        session=st.booleans(),
        # The base model, or one of three LoRA adapters: the same prompts must never share KV across them.
        lora_id=st.sampled_from([0, 0, 1, 2, 3]),
        # Under the priority policy: admission order, preemption victims and urgent arrivals preempting running work.
        priority=st.integers(-2, 2),
        # Under fair share: three tenants of different weights.
        tenant=st.sampled_from(["default", "light", "heavy"]),
        flex=st.booleans(),
    )
    def add(
        self,
        base: int,
        length: int,
        tail: list[int],
        max_tokens: int | None,
        session: bool,
        lora_id: int,
        priority: int,
        tenant: str,
        flex: bool,
    ) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=self.next_id % 3 != 0)
        lora = LoRARequest(f"adapter-{lora_id}", lora_id, ADAPTERS[lora_id]) if lora_id else None
        try:
            prompt = self._prompt(base, length, tail)
            weight = {"default": 1.0, "light": 0.5, "heavy": 3.0}[tenant]
            envelope = EngineRequest(
                request_id, prompt, params, final=not session, lora=lora, priority=priority, tenant=tenant,
                tenant_weight=weight, service_tier="flex" if flex else "default",
            )  # fmt: skip
            request = self.engine.add_request(envelope)
        except (ValueError, QueueFullError):
            return
        self.all_requests.append(request)

    @rule(base=st.integers(0, len(BASES) - 1), length=st.integers(1, 24), tail=st.lists(st.integers(0, 48), max_size=6))
    def embed(self, base: int, length: int, tail: list[int]) -> None:
        """An embedding request: its prompt computed (in chunks under the budget), one unshown token sampled."""
        request_id = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            request = self.engine.add_request(
                EngineRequest(request_id, self._prompt(base, length, tail), params, pooling="last", stream=False)
            )
        except (ValueError, QueueFullError):
            return
        self.all_requests.append(request)

    def _sessions(self):
        return [r for r in self.engine.scheduler.requests.values() if r.input_open]

    @precondition(lambda self: self.engine is not None and self._sessions())
    @rule(data=st.data(), tokens=st.lists(st.integers(0, VOCAB - 2), max_size=10), final=st.booleans())
    def session_chunk(self, data, tokens: list[int], final: bool) -> None:
        session = data.draw(st.sampled_from(self._sessions()))
        before = (session.num_tokens, session.input_open, session.status)
        try:
            self.engine.append_input(session.request_id, tokens, final)
        except ValueError:
            # Refused: the session is exactly as it was.
            assert (session.num_tokens, session.input_open, session.status) == before

    @precondition(lambda self: self.engine is not None and self._sessions())
    @rule(data=st.data())
    def close_session(self, data) -> None:
        """The client half-closes its side without a final chunk."""
        session = data.draw(st.sampled_from(self._sessions()))
        self.engine.append_input(session.request_id, [], True)

    @precondition(lambda self: self.engine is not None and self.engine.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.engine.scheduler.requests)))
        self.engine.abort(request_id)

    @precondition(lambda self: self.engine is not None)
    @rule(mode=st.sampled_from([PauseMode.NEW, PauseMode.ALL, PauseMode.NONE, PauseMode.NONE]))
    def pause(self, mode: PauseMode) -> None:
        self.engine.pause(mode)

    @precondition(lambda self: self.engine is not None)
    @rule(seconds=st.sampled_from([1.0, 1.0, 30.0, 120.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    # -- what the engine loop does ---------------------------------------------------------------------------

    @precondition(lambda self: self.engine is not None)
    @rule(count=st.integers(1, 6))
    def step(self, count: int) -> None:
        for _ in range(count):
            self.engine.step()

    @precondition(lambda self: self.engine is not None and self.engine.has_unfinished())
    @rule(kind=st.sampled_from(["worker", "crash"]))
    def failed_step(self, kind: str) -> None:
        """The next step that reaches the workers fails part-way through."""
        self.workers.fail_next = kind
        for _ in range(3):
            try:
                self.engine.step()
            except RuntimeError:
                # The serving loop fails every request of a step that crashed in-process.
                for request_id in list(self.engine.scheduler.requests):
                    self.engine.abort(request_id)
            if self.workers.fail_next is None:
                break
        self.workers.fail_next = None

    # -- invariants ------------------------------------------------------------------------------------------

    @invariant()
    def block_table_is_consistent(self) -> None:
        if self.engine is None:
            return
        table: BlockTable = self.engine.block_table
        held = Counter(b for r in table._requests.values() for b in r.block_ids if b != RELEASED)
        for block_id in range(table.num_blocks):
            assert table._ref_counts[block_id] == held[block_id], "ref count differs from the references held"
        free = set(table._free_queue)
        assert not free & set(held), "a block is both free and held"
        assert len(free) + len(set(held)) == table.num_blocks == table.num_free_blocks + table.num_used_blocks
        for h, entry in table._cached.items():
            assert table._block_hashes[entry.block_id] == h
        check_lookups(table)

    @invariant()
    def every_findable_block_holds_its_tokens_kv(self) -> None:
        """Walk the prefix cache from the root as a lookup would: each block reached was written whole."""
        if self.engine is None:
            return
        table = self.engine.block_table
        children: dict[int, list] = {}
        for h, entry in table._cached.items():
            children.setdefault(entry.parent_hash, []).append((h, entry))
        # Each adapter's chain starts at its own root: a block found from it holds KV that adapter computed.
        frontier = [(root_hash(lora_id), [], lora_id) for lora_id in (0, *ADAPTERS)]
        while frontier:
            parent, prefix, lora_id = frontier.pop()
            for h, entry in children.get(parent, []):
                tokens = prefix + list(entry.token_ids)
                for offset in range(BLOCK_SIZE):
                    position = len(prefix) + offset
                    slot = entry.block_id * BLOCK_SIZE + offset
                    assert self.workers.kv.get(slot) == fingerprint(tokens, position, lora_id), (
                        f"block {entry.block_id} is findable but its KV at position {position} was never written"
                    )
                frontier.append((h, tokens, lora_id))

    @invariant()
    def requests_are_where_their_status_says(self) -> None:
        if self.engine is None:
            return
        scheduler = self.engine.scheduler
        waiting, running, idle = list(scheduler.waiting), scheduler.running, scheduler.idle_sessions
        places = Counter(r.request_id for r in [*waiting, *running, *idle.values()])
        assert set(places) == set(scheduler.requests) and all(n == 1 for n in places.values())
        for request in running:
            assert request.status is RequestStatus.RUNNING
        for request in waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        for request in idle.values():
            assert request.status is RequestStatus.AWAITING_INPUT and request.input_open
        assert len(running) <= scheduler.config.max_num_seqs
        # No step may need more adapters than the ranks have slots for, nor one they have not read yet.
        assert len({r.lora_id for r in running if r.lora_id}) <= scheduler.max_loras
        assert not self.workers.unready_adapter_runs, "a request ran before its adapter's read ended"
        if scheduler.by_priority:  # the order that makes the last running request the one a preemption takes
            keys = [(r.flex, r.priority, r.handle) for r in running]
            assert keys == sorted(keys), "running requests out of (flex, priority, arrival) order"
        # Flex work after every interactive request in both queues: preempted first, admitted last (but for
        # requests suspected of crashing the ranks, held at the back of the queue while the engine quarantines them).
        for queue in (running, waiting) if scheduler.admission_cap is None else (running,):
            flags = [r.flex for r in queue]
            assert flags == sorted(flags), "a flex request ahead of an interactive one"
        # The offline loop skips its look at a step's requests when this counter says none of them ended.
        assert scheduler.stats.num_finished == sum(1 for r in self.all_requests if r.finished)

    @invariant()
    def pooling_requests_are_never_preempted(self) -> None:
        """They hold their whole prompt's blocks from admission; others are preempted around them."""
        for request in self.all_requests:
            if request.pooling:
                assert request.num_preemptions == 0, f"{request.request_id}: a pooling request was preempted"
                if request.status is RequestStatus.RUNNING:
                    owned = self.engine.block_table.slots_owned.get(request.request_id, 0)
                    assert owned >= request.num_prompt_tokens, "a running pooling request lacks its prompt's blocks"

    @invariant()
    def outputs_follow_from_their_sequences_and_no_step_read_garbage(self) -> None:
        if self.engine is None:
            return
        assert not self.workers.corrupt_reads, f"steps read unwritten KV: {self.workers.corrupt_reads[:3]}"
        assert not self.workers.empty_rows, "a request was scheduled with no token to compute"
        for request in self.all_requests:
            tokens = request.all_token_ids
            for i, token in enumerate(request.output_token_ids):
                assert token == next_token(tokens[: request.num_prompt_tokens + i], VOCAB)
            assert request.num_tokens <= MAX_MODEL_LEN

    @invariant()
    def workers_hold_the_heads_tokens(self) -> None:
        """The ranks keep the tokens they sample; with steps in flight they may be ahead by those samples only."""
        if self.engine is None:
            return
        for request in self.engine.scheduler.requests.values():
            state = self.workers.states.states.get(request.handle)
            if state is None:
                continue
            worker, head = state.token_ids, request.all_token_ids
            common = min(len(worker), len(head))
            assert worker[:common] == head[:common], f"{request.request_id}: the ranks hold other tokens"
            # A speculating step in flight may leave the ranks a whole run ahead.
            assert len(worker) <= len(head) + request.num_pending_samples + request.spec_in_flight

    def teardown(self) -> None:
        """Every request finishes once clients end their sessions and the engine runs; nothing leaks."""
        if self.engine is None:
            return
        engine = self.engine
        engine.pause(PauseMode.NONE)
        for request in list(engine.scheduler.requests.values()):
            if request.input_open:
                engine.append_input(request.request_id, [], True)
        # Long runs leave a hundred requests behind, so the bound grows with them (each one needs at most
        # MAX_MODEL_LEN tokens, recomputed a few times when preempted); a stretch of steps in which no token is
        # computed and no request finishes means the engine is stuck.
        idle_steps, budget = 0, 1000 + 40 * MAX_MODEL_LEN * engine.scheduler.num_unfinished
        while engine.has_unfinished() and idle_steps < 500 and budget > 0:
            before = engine.scheduler.stats.num_computed_tokens, engine.scheduler.num_unfinished
            engine.step()
            budget -= 1
            progressed = (engine.scheduler.stats.num_computed_tokens, engine.scheduler.num_unfinished) != before
            idle_steps = 0 if progressed else idle_steps + 1
        assert not engine.has_unfinished(), "requests never finished"
        engine.step()  # tells the workers to forget the last finished requests
        assert engine.block_table.num_free_blocks == engine.block_table.num_blocks
        assert not engine.block_table._requests
        assert not self.workers.states.states, "the workers still hold request state"
        assert not self.workers.corrupt_reads
        for request in self.all_requests:
            assert request.finished


# Example counts come from the Hypothesis profile (tests/conftest.py): CI-sized by default, hours with "long".
TestEngineStateMachine = EngineMachine.TestCase
