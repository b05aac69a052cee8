"""Engine loop against a fake worker group: restart after a failure, back off, give up with a clear error."""

from __future__ import annotations

import pytest

import cluster.engine as engine_module
from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine import EngineCore
from cluster.executor import WorkerGroupError
from cluster.sampling_params import SamplingParams
from proto import step_pb2

VOCAB = 500


class FakeGroup:
    """Keeps per-request tokens like a worker and 'samples' a token that depends only on them."""

    def __init__(self, num_blocks: int, failures: list[int]) -> None:
        self.num_blocks = num_blocks
        self.failures = failures  # step ids (counted across restarts) at which execute raises
        self.calls = 0
        self.restarts = 0
        self.tokens: dict[int, list[int]] = {}

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        self.calls += 1
        if self.calls in self.failures:
            raise WorkerGroupError("rank 1 is gone")
        for handle in batch.finished:
            self.tokens.pop(handle, None)
        result = step_pb2.StepResult(step_id=batch.step_id)
        for new in batch.new_requests:
            self.tokens[new.handle] = list(new.token_ids)
            self._sample(new.handle, new.skip_sampling, result)
        for delta in batch.cached_requests:
            self.tokens[delta.handle].extend(delta.new_token_ids)
            self._sample(delta.handle, delta.skip_sampling, result)
        return result

    def _sample(self, handle: int, skip: bool, result: step_pb2.StepResult) -> None:
        if not skip:
            tokens = self.tokens[handle]
            result.handles.append(handle)
            result.token_ids.append((sum(tokens) * 31 + len(tokens)) % VOCAB)

    def restart(self) -> int:
        self.restarts += 1
        self.tokens.clear()  # a fresh group knows nothing
        return self.num_blocks

    def shutdown(self) -> None:
        pass


def make_engine(group: FakeGroup) -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)
    )
    return EngineCore(config, group, max_model_len=512, vocab_size=VOCAB, eos_token_ids=[VOCAB + 1])


def run(engine: EngineCore, num_requests: int = 8) -> dict[str, list[int]]:
    requests = [
        engine.add_request(f"r{i}", [(i * 13 + j) % 400 + 1 for j in range(5 + 3 * i)], SamplingParams(max_tokens=20))
        for i in range(num_requests)
    ]
    while engine.has_unfinished():
        engine.step()
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


def test_repeated_failures_back_off_then_fail_with_a_retriable_error(no_sleep):
    group = FakeGroup(256, failures=list(range(3, 100)))
    engine = make_engine(group)
    outcome = run(engine, num_requests=3)
    assert all(status == "abort" and "retry" in error for _, status, error in outcome.values())
    assert no_sleep[: engine.max_restarts] == [engine.restart_backoff_s * 2**i for i in range(engine.max_restarts)]
    assert engine.block_table.num_free_blocks == engine.block_table.num_blocks
