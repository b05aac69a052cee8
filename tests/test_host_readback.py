"""A step's results reach the host through one wait: the readback's buffers and event, and the sampler on it."""

from __future__ import annotations

import pytest
import torch

from pagerail.worker.host_readback import HostReadback
from pagerail.worker.sampler import GREEDY_TEMPERATURE, Sampler, SamplingRow, row_argmax


class CountingEvent:
    """Stands in for torch.cuda.Event on the CPU: counts records and waits, and checks they pair up."""

    def __init__(self) -> None:
        self.records = self.waits = 0

    def record(self) -> None:
        self.records += 1

    def synchronize(self) -> None:
        if self.waits >= self.records:
            raise AssertionError("waited on an event that was never recorded")
        self.waits += 1


def _readback() -> tuple[HostReadback, CountingEvent]:
    event = CountingEvent()
    return HostReadback(torch.device("cpu"), event_factory=lambda: event), event


def test_read_returns_each_tensor_as_tolist_would_with_one_wait():
    readback, event = _readback()
    tensors = [
        torch.arange(7),
        torch.randn(3, 4),
        torch.tensor([5, 6], dtype=torch.int32),
        torch.randn(3, 2).topk(1).values,
        torch.arange(12).view(3, 4)[:, 1],  # not contiguous
    ]
    assert readback.read(*tensors) == [t.tolist() for t in tensors]
    assert (event.records, event.waits, readback.num_waits) == (1, 1, 1)


def test_buffers_grow_and_earlier_values_are_not_overwritten_within_a_read():
    readback, event = _readback()
    for size in (3, 300, 2000, 5):
        first, second = torch.arange(size), torch.arange(size) * -1
        assert readback.read(first, second) == [first.tolist(), second.tolist()]
    assert event.waits == 4


@pytest.mark.parametrize(
    "rows",
    [
        [SamplingRow(temperature=GREEDY_TEMPERATURE)] * 4,
        [SamplingRow(), SamplingRow(top_k=5), SamplingRow(temperature=GREEDY_TEMPERATURE), SamplingRow(top_p=0.5)],
        [SamplingRow(num_logprobs=3), SamplingRow(num_logprobs=0), SamplingRow(), SamplingRow(num_logprobs=5)],
        [SamplingRow(temperature=GREEDY_TEMPERATURE, num_logprobs=2, repetition_penalty=1.0)] * 4,
    ],
    ids=["greedy", "sampled", "logprobs", "greedy_logprobs"],
)
def test_sampler_through_a_readback_matches_and_waits_once(rows):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    readback, event = _readback()
    plain = Sampler(torch.Generator().manual_seed(9))(logits, rows)
    read = Sampler(torch.Generator().manual_seed(9), readback=readback)(logits, rows)
    assert read == plain
    # The greedy-only step takes numpy's argmax on the CPU: no device wait at all there.
    expected = 0 if all(r.greedy for r in rows) and all(r.num_logprobs is None for r in rows) else 1
    assert (event.waits, readback.num_waits) == (expected, expected)


def test_row_argmax_off_the_cpu_fast_path_uses_the_readback():
    readback, event = _readback()
    logits = torch.randn(6, 30, dtype=torch.float16)  # not the numpy path
    assert row_argmax(logits, readback) == logits.argmax(dim=-1).tolist()
    assert event.waits == 1


def test_the_runner_reads_back_through_one_event_only_on_cuda():
    import inspect

    import pagerail.worker.model_runner as model_runner

    source = inspect.getsource(model_runner.ModelRunner.execute)
    # The device-wide wait the readback replaced must not come back into the step.
    assert "torch.cuda.synchronize" not in source
    assert ".tolist()" not in inspect.getsource(model_runner.ModelRunner._sample)


class TimingEvent(CountingEvent):
    """A CUDA timing event's stand-in: 2.5 ms between any two."""

    def elapsed_time(self, other: TimingEvent) -> float:
        if not (self.records and other.records and other.waits):
            raise AssertionError("elapsed_time read before both events were recorded and the later one waited on")
        return 2.5


def test_runner_on_the_cuda_branch_times_the_forward_by_events_and_waits_once_per_step(tmp_path):
    """The runner's CUDA branch (events around the forward, readback for tokens) run on the CPU with stand-ins."""
    from tests.test_cuda_graphs import SHORT_STAGES, make_runner, run_stages
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3")
    runs = []
    for branch in ("cpu", "cuda"):
        runner = make_runner(model_dir, 8, None)
        if branch == "cuda":
            runner._forward_events = (TimingEvent(), TimingEvent())
            runner.readback, _ = _readback()
            runner.sampler.readback = runner.readback
        results = []

        def step(stage, batch, runner=runner, results=results):
            results.append(runner.execute(batch))
            return results[-1]

        run_stages(SHORT_STAGES, 5, step)
        runs.append(results)
    cpu, cuda = runs
    assert [list(r.token_ids) for r in cuda] == [list(r.token_ids) for r in cpu]
    forward_events = runner._forward_events
    assert forward_events[1].waits == forward_events[1].records == len(cuda)
    assert all(r.forward_seconds == pytest.approx(0.0025) for r in cuda)
    assert all(0 < r.forward_seconds != pytest.approx(0.0025) for r in cpu)
