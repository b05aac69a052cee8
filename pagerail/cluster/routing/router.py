"""Picks the data-parallel replica for each request: cache affinity (prefix index, LoRA adapters) against load."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.routing.kv_event_index import KvEventIndex
from pagerail.cluster.routing.prefix_index import PrefixIndex

POLICIES = ("prefix-aware", "least-loaded", "round-robin")
# Names end up in metric labels and logs: keep them plain.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


class NoReplicaError(QueueFullError):
    """No replica is in rotation. A QueueFullError, so callers answer "retry later": replicas rejoin when healthy."""


class Route(NamedTuple):
    """One routing decision: where, why, and how many prompt tokens that replica likely has cached."""

    replica: str
    reason: str
    cached_tokens: int


@dataclass
class ReplicaState:
    """What the router knows of one replica."""

    in_flight: int = 0  # requests this router has open there: known at once, unlike the replica's own report
    running: int = 0  # the replica's last reports
    waiting: int = 0
    # What that report held beyond this router's own requests (other frontends' load). The report counts this
    # router's requests too, but it ages: added to in_flight it would count them twice, and once they finished
    # a stale report would keep steering new work away from a replica that is already idle.
    others: int = 0
    kv_usage: float = 0.0
    in_rotation: bool = True  # the owner's say: False while draining
    healthy: bool = True  # False after a failure, until the replica answers again
    # The LoRA adapters (ids) most recently sent there, most recent last: those its device slots likely hold.
    adapters: OrderedDict[int, None] = field(default_factory=OrderedDict)

    @property
    def routable(self) -> bool:
        return self.in_rotation and self.healthy


def check_replica_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"replica name must be 1-64 characters of letters, digits, '_', '.', ':' or '-', got {name!r}")
    return name


class Router:
    """Chooses a replica per request by policy:

    - prefix-aware: the replica likely holding the longest prefix of the prompt, unless its load exceeds the least
      loaded replica's by more than the balance threshold (load > min_load * balance_ratio + balance_slack), so one
      hot prefix cannot pile onto one replica; without a usable prefix, the least loaded.
    - least-loaded: the least loaded.
    - round-robin: the next replica in turn.

    A request for a LoRA adapter (prefix-aware and least-loaded) goes first to a replica within the balance
    threshold that likely holds the adapter in a device slot (one of the last `adapter_slots` distinct adapters
    sent there), so adapters stay where they were loaded instead of being loaded everywhere; among those,
    prefix-aware prefers the longest prefix cached for that adapter (the index keys an adapter's blocks by the
    adapter, as the engines' block tables do: an adapter never matches another's KV or the base model's).

    Load = requests open there (this router's own count, plus what the replica's last report of its running and
    waiting requests held beyond that count when it came) plus kv_weight * KV cache usage (0..1): a full cache
    costs like kv_weight more requests, as new work would preempt.
    Ties go to the lower load, then round robin.
    """

    def __init__(
        self,
        policy: str = "prefix-aware",
        *,
        block_size: int = 16,
        balance_ratio: float = 1.5,
        balance_slack: float = 8.0,
        kv_weight: float = 4.0,
        index: PrefixIndex | KvEventIndex | None = None,
        adapter_slots: int = 1,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        for name, value, low in (("balance_ratio", balance_ratio, 1.0), ("balance_slack", balance_slack, 0.0)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
                raise ValueError(f"{name} must be a number >= {low}, got {value!r}")
        if isinstance(kv_weight, bool) or not isinstance(kv_weight, int | float) or not kv_weight >= 0:
            raise ValueError(f"kv_weight must be a number >= 0, got {kv_weight!r}")
        self.policy = policy
        self.balance_ratio = float(balance_ratio)
        self.balance_slack = float(balance_slack)
        self.kv_weight = float(kv_weight)
        if isinstance(adapter_slots, bool) or not isinstance(adapter_slots, int) or adapter_slots < 1:
            raise ValueError(f"adapter_slots must be an integer >= 1, got {adapter_slots!r}")
        self.adapter_slots = adapter_slots
        self.index = index if index is not None else PrefixIndex(block_size)
        self.block_size = self.index.block_size
        self.replicas: dict[str, ReplicaState] = {}  # insertion order is the round-robin order
        self._cursor = 0  # the round-robin position in that order

    # -- membership and load --------------------------------------------------------------------

    def add_replica(self, name: str) -> None:
        check_replica_name(name)
        if name in self.replicas:
            raise ValueError(f"replica {name!r} is already known")
        self.replicas[name] = ReplicaState()

    def remove_replica(self, name: str) -> None:
        """Forget a replica, its load and what the index knew of its cache; unknown names are ignored."""
        if self.replicas.pop(name, None) is not None:
            self.index.remove_replica(name)

    def set_in_rotation(self, name: str, in_rotation: bool) -> None:
        """The owner takes a replica out (draining) or puts it back."""
        self._state(name).in_rotation = bool(in_rotation)

    def set_healthy(self, name: str, healthy: bool) -> None:
        """A replica failed (out of rotation) or answers again (back in, unless the owner took it out)."""
        self._state(name).healthy = bool(healthy)

    def set_load(self, name: str, running: int, waiting: int, kv_usage: float) -> None:
        """The replica's own report of its running and waiting requests and its KV cache usage (0..1)."""
        state = self._state(name)
        state.running = max(0, int(running))
        state.waiting = max(0, int(waiting))
        state.others = max(0, state.running + state.waiting - state.in_flight)
        state.kv_usage = min(1.0, max(0.0, float(kv_usage)))

    def routable(self, name: str) -> bool:
        state = self.replicas.get(name)
        return state is not None and state.routable

    def in_rotation(self) -> list[str]:
        return [name for name, state in self.replicas.items() if state.routable]

    def load(self, name: str) -> float:
        state = self._state(name)
        return state.in_flight + state.others + self.kv_weight * state.kv_usage

    # -- requests -------------------------------------------------------------------------------

    def begin(self, name: str, token_ids: Sequence[int], hashes: list[bytes] | None = None, lora_id: int = 0) -> None:
        """A request was sent to `name`: count it, and remember its prompt (and its adapter) there."""
        state = self._state(name)
        state.in_flight += 1
        if lora_id:
            state.adapters[lora_id] = None
            state.adapters.move_to_end(lora_id)
            while len(state.adapters) > self.adapter_slots:
                state.adapters.popitem(last=False)
        self.index.insert(name, token_ids, hashes, lora_id)

    def end(self, name: str, token_ids: Sequence[int] | None = None, lora_id: int = 0) -> None:
        """A request sent to `name` ended; `token_ids` (prompt and output, computed with adapter `lora_id`; None:
        not known whole) are now in that replica's cache."""
        state = self.replicas.get(name)
        if state is None:  # removed while the request was open
            return
        if state.in_flight <= 0:
            raise RuntimeError(f"replica {name!r} has no request in flight to end")
        state.in_flight -= 1
        if token_ids is not None:
            self.index.insert(name, token_ids, lora_id=lora_id)

    # -- decisions ------------------------------------------------------------------------------

    def rank(
        self,
        token_ids: Sequence[int],
        *,
        exclude: Collection[str] = (),
        hashes: list[bytes] | None = None,
        lora_id: int = 0,
    ) -> list[Route]:
        """Every eligible replica, best first: the first is the decision, the rest are where to spill when it is
        full (reason "spill"); `lora_id` the request's LoRA adapter (0: the base model). Raises NoReplicaError when
        none is eligible."""
        names = [name for name, state in self.replicas.items() if state.routable and name not in exclude]
        if not names:
            total = len(self.replicas)
            raise NoReplicaError(
                f"no replica is in rotation ({total} known, {total - len(self.in_rotation())} out of rotation"
                f"{f', {len(exclude)} excluded' if exclude else ''}); retry shortly"
            )
        loads = {name: self.load(name) for name in names}
        matched: dict[str, int] = {}
        if self.policy == "prefix-aware":
            if hashes is None and lora_id:
                hashes = self.index.block_hashes(token_ids, lora_id)
            limit = self._cacheable(len(token_ids))
            matched = {
                name: min(tokens, limit)
                for name, tokens in self.index.match(token_ids, hashes).items()
                if name in loads
            }
        turn = self._turn_order(names)
        if lora_id and self.policy != "round-robin":
            order, reason = self._adapter_order(names, loads, lora_id, matched, turn)
        elif self.policy == "round-robin":
            order, reason = turn, "round_robin"
        elif self.policy == "least-loaded":
            order, reason = sorted(names, key=lambda n: (loads[n], turn.index(n))), "load"
        else:
            order, reason = self._prefix_order(names, loads, matched, turn)
        self._cursor = (list(self.replicas).index(order[0]) + 1) % len(self.replicas)
        first = Route(order[0], reason, matched.get(order[0], 0))
        return [first, *(Route(name, "spill", matched.get(name, 0)) for name in order[1:])]

    def _prefix_order(
        self, names: list[str], loads: dict[str, float], matched: dict[str, int], turn: list[str]
    ) -> tuple[list[str], str]:
        threshold = self._balance_threshold(loads)
        # Replicas within the balance threshold first; among them the longest cached prefix, then the smaller cache
        # footprint (a prefix no replica holds goes where it evicts least, so the hot prefixes spread evenly over
        # the caches instead of piling onto whichever replica was idle when each first came), then the lower load.
        held = self.index.held
        order = sorted(
            names, key=lambda n: (loads[n] > threshold, -matched.get(n, 0), held(n), loads[n], turn.index(n))
        )
        best = max(matched.values(), default=0)
        chosen = matched.get(order[0], 0)
        if chosen and chosen == best:
            return order, "prefix"
        # Either nothing is cached anywhere (plain load), or the best holder is over the threshold (balance).
        return order, "balance" if best > chosen else "load"

    def _adapter_order(
        self, names: list[str], loads: dict[str, float], lora_id: int, matched: dict[str, int], turn: list[str]
    ) -> tuple[list[str], str]:
        """Within the balance threshold, replicas that likely hold the adapter first, then (prefix-aware) the
        longest prefix of the prompt cached for this adapter, then the lower load."""
        threshold = self._balance_threshold(loads)
        holds = {name for name in names if lora_id in self.replicas[name].adapters}
        order = sorted(
            names,
            key=lambda n: (loads[n] > threshold, n not in holds, -matched.get(n, 0), loads[n], turn.index(n)),
        )
        if order[0] in holds:
            return order, "adapter"
        return order, "balance" if holds else "load"

    def _balance_threshold(self, loads: dict[str, float]) -> float:
        """The load above which a replica loses its cache or adapter affinity to the least loaded one."""
        return min(loads.values()) * self.balance_ratio + self.balance_slack

    def _turn_order(self, names: list[str]) -> list[str]:
        """`names` starting from the round-robin cursor, in the replicas' order."""
        everyone = list(self.replicas)
        position = {name: (everyone.index(name) - self._cursor) % len(everyone) for name in names}
        return sorted(names, key=position.__getitem__)

    def _cacheable(self, num_tokens: int) -> int:
        """The most prompt tokens a replica can take from its cache: full blocks, never the last token."""
        return max(0, (num_tokens - 1) // self.block_size * self.block_size)

    def _state(self, name: str) -> ReplicaState:
        state = self.replicas.get(name)
        if state is None:
            raise ValueError(f"unknown replica {name!r}; known: {sorted(self.replicas)}")
        return state
