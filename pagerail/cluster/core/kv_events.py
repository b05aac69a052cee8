"""What a replica's caches hold, as events a router can follow: block hashes stored and removed, per tier.

The block table and the host tier report every hash that becomes findable or stops being findable; the log
numbers them and keeps the current holdings, so a reader that asks for the events after the last one it saw gets
exactly those, or, when it fell behind the log's window or the replica restarted (a new epoch), a snapshot of
everything held now. The log is read from another thread than the engine loop's, hence its lock.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque

DEVICE, HOST = "device", "host"
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
DEFAULT_WINDOW = 65_536


class KvEventLog:
    """Numbered block events of one replica, the last `window` of them, and the hashes each tier holds now."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, int, str]] = deque(maxlen=window)
        self._seq = 0
        # A new log (a new engine) starts a new epoch: a reader's sequence numbers from before mean nothing here.
        self.epoch = int.from_bytes(os.urandom(6), "big")
        self._held: dict[str, set[int]] = {DEVICE: set(), HOST: set()}

    def stored(self, block_hash: int, tier: str) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, STORED, block_hash, tier))
            self._held[tier].add(block_hash)

    def removed(self, block_hash: int, tier: str) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, REMOVED, block_hash, tier))
            self._held[tier].discard(block_hash)

    def cleared(self, tier: str) -> None:
        """Every block of `tier` is gone (the ranks restarted)."""
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, CLEARED, 0, tier))
            self._held[tier].clear()

    def since(self, epoch: int | None, seq: int) -> dict:
        """The events after `seq` of `epoch`; a snapshot of the holdings instead when the reader has another epoch
        or missed events that left the window. Plain data, to travel as a message."""
        with self._lock:
            first = self._events[0][0] if self._events else self._seq + 1
            if epoch == self.epoch and first - 1 <= seq <= self._seq:
                start = max(0, len(self._events) - (self._seq - seq))
                events = list(itertools.islice(self._events, start, None))
                return {"epoch": self.epoch, "seq": self._seq, "events": [e[1:] for e in events]}
            return {
                "epoch": self.epoch,
                "seq": self._seq,
                "snapshot": {tier: sorted(held) for tier, held in self._held.items()},
            }
