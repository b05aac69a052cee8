"""An approximate, bounded record of which replica likely holds which prompt prefix in its KV cache."""

from __future__ import annotations

import hashlib
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

DEFAULT_MAX_ENTRIES = 200_000
DEFAULT_TTL_S = 600.0
# A prompt longer than this many blocks is indexed by its first blocks only: the router's memory and time per
# request stay bounded whatever a client sends (the engine checks the real length limit afterwards).
DEFAULT_MAX_BLOCKS_PER_PROMPT = 4096


def _check_positive(name: str, value: object, kind: type) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r}")


class PrefixIndex:
    """Chained block hashes of the prompts sent to each replica, as the engines' prefix caches hash them.

    The hash of block i covers blocks 0..i (hash of (parent hash, block tokens)), so one hit at block i means the
    whole prefix up to it was sent there. Only full blocks count, like the engine's cache. The index is a hint,
    never a promise: a replica may have evicted what the index still lists, so entries expire after `ttl_s` and
    the least recently used entries go first once `max_entries` chain hashes are held.

    Hashes are keyed with a per-process secret: prompts are client input, and a client able to craft colliding
    prefixes could otherwise steer other clients' requests.
    """

    def __init__(
        self,
        block_size: int = 16,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        max_blocks_per_prompt: int = DEFAULT_MAX_BLOCKS_PER_PROMPT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_positive("block_size", block_size, int)
        _check_positive("max_entries", max_entries, int)
        _check_positive("max_blocks_per_prompt", max_blocks_per_prompt, int)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number, got {ttl_s!r}")
        self.block_size = block_size
        self.max_entries = max_entries
        self.ttl_s = float(ttl_s)
        self.max_blocks_per_prompt = max_blocks_per_prompt
        self._clock = clock
        self._key = os.urandom(16)
        # chain hash -> {replica: last time a prompt through this block was sent there}; oldest touched first.
        self._entries: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        # Blocks each replica holds in this index: its likely cache footprint.
        self._held: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def held(self, replica: str) -> int:
        """How many blocks sent to `replica` this index still holds."""
        return self._held.get(replica, 0)

    def block_hashes(self, token_ids: Sequence[int], lora_id: int = 0) -> list[bytes]:
        """The chain hash of every full block of `token_ids` (up to max_blocks_per_prompt blocks), computed with
        LoRA adapter `lora_id` (0: the base model), whose KV is its own: its chain starts from its own root."""
        size = self.block_size
        num_blocks = min(len(token_ids) // size, self.max_blocks_per_prompt)
        hashes: list[bytes] = []
        # 12 bytes: no base-model block's input (a multiple of 8 bytes) can equal an adapter's first.
        parent = b"lora" + lora_id.to_bytes(8, "little") if lora_id else b""
        for start in range(0, num_blocks * size, size):
            try:
                tokens = array("q", token_ids[start : start + size]).tobytes()
            except (TypeError, OverflowError):
                raise ValueError("prompt token ids must be ints") from None
            parent = hashlib.blake2b(parent + tokens, digest_size=16, key=self._key).digest()
            hashes.append(parent)
        return hashes

    def match(self, token_ids: Sequence[int], hashes: list[bytes] | None = None) -> dict[str, int]:
        """How many leading tokens of the prompt each replica likely holds (replicas with none are left out)."""
        if hashes is None:
            hashes = self.block_hashes(token_ids)
        oldest = self._clock() - self.ttl_s
        matched: dict[str, int] = {}
        # Longest first: a hit at block i implies the prefix before it, even where LRU dropped an ancestor.
        for i in range(len(hashes) - 1, -1, -1):
            holders = self._entries.get(hashes[i])
            if not holders:
                continue
            for replica, used in holders.items():
                if used >= oldest and replica not in matched:
                    matched[replica] = (i + 1) * self.block_size
        return matched

    def insert(
        self, replica: str, token_ids: Sequence[int], hashes: list[bytes] | None = None, lora_id: int = 0
    ) -> None:
        """Record that `token_ids` (for adapter `lora_id`) were sent to `replica` now."""
        if hashes is None:
            hashes = self.block_hashes(token_ids, lora_id)
        now = self._clock()
        entries = self._entries
        # Deepest first, so that a prefix is always at least as recent as its extensions and LRU drops leaves.
        for chain_hash in reversed(hashes):
            holders = entries.get(chain_hash)
            if holders is None:
                holders = entries[chain_hash] = {}
            else:
                entries.move_to_end(chain_hash)
            if replica not in holders:
                self._held[replica] = self._held.get(replica, 0) + 1
            holders[replica] = now
        self._evict(now)

    def remove_replica(self, replica: str) -> None:
        """Forget everything sent to `replica` (it left, or restarted with an empty cache)."""
        for chain_hash in list(self._entries):
            holders = self._entries[chain_hash]
            if holders.pop(replica, None) is not None and not holders:
                del self._entries[chain_hash]
        self._held.pop(replica, None)

    def _evict(self, now: float) -> None:
        entries = self._entries
        while len(entries) > self.max_entries:
            self._release(entries.popitem(last=False)[1])
        # Entries are ordered by last touch: expired ones sit at the front.
        oldest = now - self.ttl_s
        while entries:
            chain_hash, holders = next(iter(entries.items()))
            if max(holders.values(), default=oldest - 1) >= oldest:
                break
            del entries[chain_hash]
            self._release(holders)

    def _release(self, holders: dict[str, float]) -> None:
        for replica in holders:
            self._held[replica] -= 1
