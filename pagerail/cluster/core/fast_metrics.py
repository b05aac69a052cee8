"""Histograms and counters cheap enough to update per request per step, exported as ordinary Prometheus series.

prometheus_client's Histogram takes a lock and walks every bucket on each observation, a few microseconds; the
engine loop observes one inter-token latency per request per step, hundreds per step. These keep plain bucket
counts (one bisect per observation) on the engine thread and are read only at scrape time.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class HistogramChild:
    """One label combination's bucket counts; `observe` is a bisect and two additions."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are "less than or equal": bisect_left puts a value equal to a bound in that bucket.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_repeated(self, value: float, count: int) -> None:
        """`count` observations of the same value."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)


class FastHistogram(Collector):
    """A labelled histogram whose children are updated without locks; only the engine thread writes them."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        if list(buckets) != sorted(buckets):
            raise ValueError(f"buckets of {name} must be sorted, got {buckets}")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = HistogramChild(self.buckets)
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            counts = list(child.counts)  # a snapshot: the engine thread may be adding meanwhile
            cumulative, running = [], 0
            for bound, count in zip([*self.buckets, math.inf], counts, strict=True):
                running += count
                cumulative.append((_bound_label(bound), running))
            family.add_metric(list(values), cumulative, child.sum)
        yield family


class FastCounter(Collector):
    """A labelled counter of plain integers: `inc` is one dictionary update."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"{self.name} only goes up, got {amount}")
        self.values[labels] = self.values.get(labels, 0) + amount

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, total in list(self.values.items()):
            family.add_metric(list(values), total)
        yield family


def _bound_label(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))
