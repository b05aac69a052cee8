"""Engine loop against a fake worker group: restart after a failure, back off, give up with a clear error, and
fail alone a request that crashes the workers every time it runs."""

from __future__ import annotations

import pytest

import pagerail.cluster.core.engine as engine_module
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.executor import PendingStep, WorkerGroupError
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from pagerail.proto import step_pb2
from tests.fake_workers import run_now

VOCAB = 500
POISON = 499  # a prompt holding this token crashes the fake workers whenever it is in a step


class FakeGroup:
    """Keeps per-request tokens like a worker and 'samples' a token that depends only on them."""

    def __init__(self, num_blocks: int, failures: list[int]) -> None:
        self.num_blocks = num_blocks
        self.failures = failures  # step ids (counted across restarts) at which execute raises
        self.calls = 0
        self.restarts = 0
        self.tokens: dict[int, list[int]] = {}
        self.poisoned: set[int] = set()  # handles of requests whose prompt holds POISON
        self.batches: list[set[int]] = []  # the handles each step ran, failed ones included

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        self.calls += 1
        self.poisoned |= {new.handle for new in batch.new_requests if POISON in new.token_ids}
        handles = {new.handle for new in batch.new_requests} | {delta.handle for delta in batch.cached_requests}
        handles |= set(batch.decode_handles)
        self.batches.append(handles)
        if self.calls in self.failures:
            raise WorkerGroupError("rank 1 is gone")
        if handles & self.poisoned:
            raise WorkerGroupError("rank 0 crashed")
        for handle in batch.finished:
            self.tokens.pop(handle, None)
        result = step_pb2.StepResult(step_id=batch.step_id)
        for new in batch.new_requests:
            self.tokens[new.handle] = list(new.token_ids)
            self._sample(new.handle, new.skip_sampling, result)
        for delta in batch.cached_requests:
            self.tokens[delta.handle].extend(delta.new_token_ids)
            self._sample(delta.handle, delta.skip_sampling, result)
        for handle in batch.decode_handles:
            self._sample(handle, False, result)
        return result

    def _sample(self, handle: int, skip: bool, result: step_pb2.StepResult) -> None:
        if not skip:
            tokens = self.tokens[handle]
            result.handles.append(handle)
            token = (sum(tokens) * 31 + len(tokens)) % VOCAB
            result.token_ids.append(token)
            tokens.append(token)  # ranks keep what they sample; the head never sends it back

    def submit(self, batch: step_pb2.StepBatch) -> PendingStep:
        # The step runs when the engine asks for its answer (always in submission order): a step the engine
        # abandons after an earlier one failed never reaches these ranks, so `batches` holds what the engine saw.
        return _Deferred(lambda: run_now(self.execute, batch).result())

    def restart(self) -> int:
        self.restarts += 1
        self.tokens.clear()  # a fresh group knows nothing
        return self.num_blocks

    def shutdown(self) -> None:
        pass


class _Deferred:
    def __init__(self, run) -> None:
        self.result = run


def make_engine(group: FakeGroup) -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)
    )
    return EngineCore(config, group, max_model_len=512, vocab_size=VOCAB, eos_token_ids=[VOCAB + 1])


def run(
    engine: EngineCore, num_requests: int = 8, poison_at: int | None = None, poison_after_steps: int = 0
) -> dict[str, list[int]]:
    """Run r0..r{n-1}; with `poison_at`, a poisoned request is added before r{poison_at} (or, with
    `poison_after_steps`, once that many steps ran: into a batch already generating)."""
    requests = []
    poison_params = SamplingParams(max_tokens=20)
    for i in range(num_requests):
        if i == poison_at and not poison_after_steps:
            requests.append(engine.add_request(EngineRequest("poison", [POISON, 7, 8, 9, 10], poison_params)))
        prompt = [(i * 13 + j) % 400 + 1 for j in range(5 + 3 * i)]
        requests.append(engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=20))))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if poison_at is not None and steps == poison_after_steps:
            requests.append(engine.add_request(EngineRequest("poison", [POISON, 7, 8, 9, 10], poison_params)))
    return {r.request_id: (list(r.output_token_ids), r.status.value, r.error) for r in requests}


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    delays: list[float] = []
    monkeypatch.setattr(engine_module.time, "sleep", delays.append)
    return delays


def test_failure_mid_generation_is_invisible_in_the_output(no_sleep):
    expected = run(make_engine(FakeGroup(256, failures=[])))
    group = FakeGroup(256, failures=[9])
    engine = make_engine(group)
    assert run(engine) == expected
    assert group.restarts == 1 and engine.num_restarts == 1
    assert engine.block_table.num_free_blocks == engine.block_table.num_blocks
    assert no_sleep == [engine.restart_backoff_s]


def test_a_restart_with_fewer_blocks_re_derives_the_longest_sequence(no_sleep):
    """The context limit follows the restarted group's cache: 256 blocks of 4 hold the model's 512 tokens, 64 hold
    256, and the scheduler refuses (and sizes requests without max_tokens by) the new limit."""
    group = FakeGroup(256, failures=[3])
    engine = make_engine(group)
    assert engine.max_model_len == 512
    group.num_blocks = 64  # the group comes back with a quarter of its cache
    run(engine, num_requests=2)
    assert group.restarts == 1 and engine.block_table.num_blocks == 64
    assert engine.max_model_len == engine.scheduler.max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine.add_request(EngineRequest("long", list(range(1, 200)), SamplingParams(max_tokens=100)))


def test_repeated_failures_back_off_then_fail_with_a_retriable_error(no_sleep):
    group = FakeGroup(256, failures=list(range(3, 100)))
    engine = make_engine(group)
    outcome = run(engine, num_requests=3)
    assert all(status == "abort" and "retry" in error for _, status, error in outcome.values())
    assert no_sleep[: engine.max_restarts] == [engine.restart_backoff_s * 2**i for i in range(engine.max_restarts)]
    assert engine.block_table.num_free_blocks == engine.block_table.num_blocks


@pytest.mark.parametrize(
    ("poison_at", "poison_after_steps"),
    [(0, 0), (3, 0), (7, 0), (0, 6)],
    ids=["first", "middle", "last", "joins-a-running-batch"],
)
def test_a_request_that_crashes_the_workers_is_failed_alone(no_sleep, poison_at, poison_after_steps):
    expected = run(make_engine(FakeGroup(256, failures=[])))
    group = FakeGroup(256, failures=[])
    engine = make_engine(group)
    outcome = run(engine, poison_at=poison_at, poison_after_steps=poison_after_steps)
    tokens, status, error = outcome.pop("poison")
    # Everyone else finishes as if the poisoned request had never come.
    assert outcome == expected
    assert status == "abort" and "crashed the workers repeatedly" in error
    assert engine.num_quarantined == 1
    # Found in a few restarts: two failures make suspects, the suspects rejoin one at a time, the culprit fails.
    assert group.restarts <= 4
    poisoned = group.poisoned.pop()
    failed_steps = [handles for handles in group.batches if poisoned in handles]
    assert len(failed_steps) == group.restarts and len(failed_steps[-1]) >= 1
    # The sequence cap of the isolation is lifted, nothing leaks.
    assert engine.scheduler.admission_cap is None
    assert engine.scheduler.config == engine.config.scheduler
    assert engine.block_table.num_free_blocks == engine.block_table.num_blocks


def test_quarantine_tells_the_client_why(no_sleep):
    group = FakeGroup(256, failures=[])
    engine = make_engine(group)
    innocent = engine.add_request(EngineRequest("innocent", [5, 6, 7], SamplingParams(max_tokens=4)))
    poison = engine.add_request(EngineRequest("poison", [POISON, 6, 7], SamplingParams(max_tokens=4)))
    changed: list = []
    while engine.has_unfinished():
        changed += engine.step()
    assert poison in changed and poison.error_code == "quarantined" and poison.output_token_ids == []
    assert innocent.status.value == "length" and innocent.error is None


def test_a_lone_request_on_broken_workers_gets_a_retriable_error(no_sleep):
    """Without a step that succeeds, nothing singles the request out: the workers, not it, may be at fault."""
    group = FakeGroup(256, failures=[])
    engine = make_engine(group)
    poison = engine.add_request(EngineRequest("poison", [POISON, 6, 7], SamplingParams(max_tokens=4)))
    while engine.has_unfinished():
        engine.step()
    assert poison.error_code == "worker_failure" and "retry" in poison.error
    assert group.restarts == engine.max_restarts


def test_serve_flags_for_step_deadline_and_worker_restarts():
    import argparse

    from pagerail.cluster.entrypoints.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.step_timeout, defaults.max_worker_restarts) == (300.0, 3)
    args = parser.parse_args(["--step-timeout", "45", "--max-worker-restarts", "5"])
    assert (args.step_timeout, args.max_worker_restarts) == (45.0, 5)
