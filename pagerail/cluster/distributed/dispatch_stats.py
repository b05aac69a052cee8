"""Per-step wire figures of the head → worker dispatch: bytes, round trip, and the time outside the ranks' compute."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

_WINDOW = 4096


def _window() -> deque:
    return deque(maxlen=_WINDOW)


@dataclass
class DispatchStats:
    """What the observability layer exports and bench/dispatch.py reports.

    A step's round trip runs from when the ranks could start it (its submission, or the arrival of the previous
    step's last reply when it was queued behind that step) to the arrival of its last reply. Its overhead is that
    round trip minus the slowest rank's own compute: the dispatch cost the forward pass did not hide.
    """

    num_steps: int = 0
    bytes_sent_per_rank: int = 0  # latest step
    bytes_received_per_rank: list[int] = field(default_factory=list)  # latest step
    last_round_trip_per_rank: list[float] = field(default_factory=list)  # latest step
    total_bytes_sent: int = 0
    total_bytes_received: int = 0
    round_trip_s: deque = field(default_factory=_window)
    overhead_s: deque = field(default_factory=_window)
    # Time between two consecutive steps' last replies minus the later step's compute: what the ranks spend per
    # step not computing, the head's own lateness included. Meaningful under continuous load (idle time counts).
    idle_s: deque = field(default_factory=_window)

    def reset(self) -> None:
        self.__init__()

    def record(
        self,
        sent: int,
        received: list[int],
        round_trip_per_rank: list[float],
        compute: float,
        since_previous: float | None,
    ) -> None:
        """One step: bytes sent to each rank, bytes each rank answered, each rank's round trip, the slowest
        rank's compute, and the seconds since the previous step's last reply (None for the first step)."""
        self.num_steps += 1
        self.bytes_sent_per_rank = sent
        self.bytes_received_per_rank = received
        self.last_round_trip_per_rank = round_trip_per_rank
        self.total_bytes_sent += sent * len(received)
        self.total_bytes_received += sum(received)
        round_trip = max(round_trip_per_rank)
        self.round_trip_s.append(round_trip)
        self.overhead_s.append(max(0.0, round_trip - compute))
        if since_previous is not None:
            self.idle_s.append(max(0.0, since_previous - compute))

    def summary(self) -> dict:
        return {
            "steps": self.num_steps,
            "round_trip_p50_s": _median(self.round_trip_s),
            "round_trip_p99_s": _percentile(self.round_trip_s, 0.99),
            "overhead_p50_s": _median(self.overhead_s),
            "overhead_p99_s": _percentile(self.overhead_s, 0.99),
            "idle_p50_s": _median(self.idle_s),
            "bytes_sent_per_rank": self.bytes_sent_per_rank,
            "total_bytes_sent": self.total_bytes_sent,
            "total_bytes_received": self.total_bytes_received,
        }


def _median(values: deque) -> float:
    return statistics.median(values) if values else 0.0


def _percentile(values: deque, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
