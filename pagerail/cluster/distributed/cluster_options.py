"""How a replica's ranks are placed and protected: the one definition of these settings and their defaults."""

from __future__ import annotations

from dataclasses import dataclass

from pagerail.cluster.core.engine import DEFAULT_MAX_RESTARTS
from pagerail.common.tls import TlsConfig

# Ray's placement-group strategies for a replica's rank bundles: SPREAD / STRICT_SPREAD put ranks on different nodes.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ClusterOptions:
    """How the replica's workers are placed and protected."""

    placement_strategy: str = "PACK"
    use_gpu: bool = False
    cpus_per_worker: float = 1
    # Seconds a step may take before its ranks count as hung and are restarted (a dead rank is noticed at once).
    step_timeout_s: float = 300.0
    max_restarts: int = DEFAULT_MAX_RESTARTS
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        check_placement_strategy(self.placement_strategy)


def check_placement_strategy(strategy: str) -> None:
    """Raise ValueError naming the field unless `strategy` is one of Ray's placement-group strategies."""
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {strategy!r}")


# The defaults, for signatures that take these settings one by one.
DEFAULT_OPTIONS = ClusterOptions()
