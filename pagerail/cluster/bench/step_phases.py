"""Where a run's wall time went, from the engine's step-duration histograms (the forward pass, the rank's work
around it, and the time the rank sat idle waiting for the head) or from each step's result."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PHASES = ("schedule", "dispatch", "forward", "sample")
_METRIC = "pagerail_step_duration_seconds"

# phase → (seconds summed over steps, number of steps)
PhaseTotals = dict[str, tuple[float, float]]


def totals_from_registry(registry: Any) -> PhaseTotals:
    """Totals read from an in-process engine's Prometheus registry (`engine.metrics.registry`)."""
    return _totals(registry.collect())


def totals_from_text(text: str) -> PhaseTotals:
    """Totals read from a server's /metrics exposition (every model replica's series added up)."""
    from prometheus_client.parser import text_string_to_metric_families

    return _totals(text_string_to_metric_families(text))


def _totals(families) -> PhaseTotals:
    totals: PhaseTotals = {phase: (0.0, 0.0) for phase in PHASES}
    samples = [sample for family in families if family.name == _METRIC for sample in family.samples]
    for sample in samples:
        phase = sample.labels.get("phase")
        if phase not in totals:
            continue
        seconds, steps = totals[phase]
        if sample.name == _METRIC + "_sum":
            totals[phase] = (seconds + sample.value, steps)
        elif sample.name == _METRIC + "_count":
            totals[phase] = (seconds, steps + sample.value)
    return totals


def outside_forward(before: PhaseTotals, after: PhaseTotals, wall_seconds: float) -> dict[str, float]:
    """How the run's wall time divides, from the histograms' growth between two readings.

    The rank runs one step at a time, so its compute (forward + "sample", which is everything else the rank does
    in a step: inputs, sampling) never overlaps itself; what is left of the wall time the rank sat idle, waiting
    for the head to schedule, send, or take in results. Outside the forward = 1 - forward / wall.
    With overlapped steps the head's phases (schedule, dispatch) run while the rank computes, so only their
    means per step are given, not shares.
    """
    grown = {phase: (after[phase][0] - before[phase][0], after[phase][1] - before[phase][1]) for phase in PHASES}
    steps = grown["forward"][1]
    forward, rank_other = grown["forward"][0], grown["sample"][0]
    wall = max(wall_seconds, 1e-12)

    def mean_ms(phase: str) -> float:
        seconds, count = grown[phase]
        return 1e3 * seconds / count if count else 0.0

    return {
        "steps": int(steps),
        "wall_seconds": wall_seconds,
        "forward_seconds": forward,
        "outside_forward_share": max(0.0, 1.0 - forward / wall),
        "rank_other_share": rank_other / wall,
        "rank_idle_share": max(0.0, 1.0 - (forward + rank_other) / wall),
        "outside_forward_ms_per_step": 1e3 * max(0.0, wall_seconds - forward) / steps if steps else 0.0,
        "forward_ms_per_step": mean_ms("forward"),
        "schedule_ms_per_step": mean_ms("schedule"),
        "dispatch_ms_per_step": mean_ms("dispatch"),
        "rank_other_ms_per_step": mean_ms("sample"),
    }


def counter_total(text: str, name: str) -> float:
    """The sum of one counter's series in a /metrics exposition (e.g. "pagerail_num_preemptions")."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
        if sample.name == name + "_total"
    )


@contextmanager
def on_step_results(engine: Any, on_submit: Callable[[Any], Callable[[Any], None]]) -> Iterator[None]:
    """While active, `on_submit(batch)` runs as the in-process engine submits each step, and the recorder it returns
    gets that step's StepResult once, when the engine first asks for it."""
    executor = engine.executor
    submit = executor.submit
    executor.submit = lambda batch: _RecordedStep(submit(batch), on_submit(batch))
    try:
        yield
    finally:
        executor.submit = submit


class _RecordedStep:
    """A submitted step whose result is handed to its recorder once."""

    def __init__(self, pending: Any, record: Callable[[Any], None]) -> None:
        self._pending = pending
        self._record: Callable[[Any], None] | None = record

    def result(self) -> Any:
        result = self._pending.result()
        if self._record is not None:
            record, self._record = self._record, None
            record(result)
        return result
