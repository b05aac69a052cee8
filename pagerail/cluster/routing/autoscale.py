"""When to add or remove a data-parallel replica: a queue above target grows the set, lasting idleness shrinks it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


def _check_count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


@dataclass
class ScalingPolicy:
    """Decides +1 (add a replica), -1 (drain one) or 0, from the replicas' waiting requests and idleness.

    - Up when the waiting requests exceed `target_waiting_per_replica` per replica (and below max), or below min.
    - Down only when a replica has had no open request for `scale_down_idle_s`, and the waiting requests would stay
      under half the target on one replica fewer (and above min), or above max. The gap between the two thresholds
      keeps a steady load from flapping between two sizes.
    - After any change, nothing for `cooldown_s`: a new replica needs time to take load before it is judged.
    """

    min_replicas: int
    max_replicas: int
    target_waiting_per_replica: float = 8.0
    cooldown_s: float = 30.0
    scale_down_idle_s: float = 60.0
    last_change_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        _check_count("min_replicas", self.min_replicas, 1)
        _check_count("max_replicas", self.max_replicas, 1)
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be at least min_replicas ({self.min_replicas})")
        target = self.target_waiting_per_replica
        if isinstance(target, bool) or not isinstance(target, int | float) or not target > 0:
            raise ValueError(f"target_waiting_per_replica must be a number > 0, got {target!r}")
        self.cooldown_s = _check_seconds("cooldown_s", self.cooldown_s)
        self.scale_down_idle_s = _check_seconds("scale_down_idle_s", self.scale_down_idle_s)

    def decide(
        self, num_replicas: int, total_waiting: int, idle_seconds_per_replica: Mapping[str, float], now: float
    ) -> int:
        """+1, -1 or 0 for `num_replicas` replicas (those serving or starting, not those draining).

        `idle_seconds_per_replica`: for each replica that may be drained, how long it has had no open request
        (0 while it has one).
        """
        if self.last_change_at is not None and now - self.last_change_at < self.cooldown_s:
            return 0
        decision = self._wanted(num_replicas, total_waiting, idle_seconds_per_replica)
        if decision:
            self.last_change_at = now
        return decision

    def _wanted(self, num_replicas: int, total_waiting: int, idle: Mapping[str, float]) -> int:
        idlest = max(idle.values(), default=0.0)
        if num_replicas < self.min_replicas:
            return 1
        if num_replicas > self.max_replicas:
            return -1 if idlest > 0 else 0
        if num_replicas < self.max_replicas and total_waiting > self.target_waiting_per_replica * num_replicas:
            return 1
        if (
            num_replicas > self.min_replicas
            and idlest > 0
            and idlest >= self.scale_down_idle_s
            and total_waiting <= self.target_waiting_per_replica * (num_replicas - 1) / 2
        ):
            return -1
        return 0

    @staticmethod
    def drain_candidate(idle_seconds_per_replica: Mapping[str, float]) -> str | None:
        """The replica idle the longest, which a -1 drains; None when every one has an open request."""
        name, seconds = max(idle_seconds_per_replica.items(), key=lambda item: item[1], default=(None, 0.0))
        return name if seconds > 0 else None
