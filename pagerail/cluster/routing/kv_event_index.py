"""Which blocks each replica's caches hold (device and host tier), as the replicas' own block events say.

Where PrefixIndex estimates from the prompts the router sent, this index follows the events each replica's block
table publishes (cluster/core/kv_events.py): a hash is listed for a replica from the event that stored it to the
one that removed it, and a replica that restarted or whose events the router missed is read again whole from a
snapshot. Requests the router sent in the last `recent_s` seconds count too, so a burst sharing a new prefix
still lands together before the replica's events report it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pagerail.cluster.core.block_table import hash_block, root_hash
from pagerail.cluster.core.kv_events import CLEARED, DEVICE, HOST, REMOVED, STORED

logger = logging.getLogger(__name__)
_TIER_BITS = {DEVICE: 1, HOST: 2}
DEFAULT_MAX_BLOCKS_PER_PROMPT = 4096
DEFAULT_RECENT_S = 5.0
DEFAULT_MAX_RECENT = 100_000


class KvEventIndex:
    """Exact holdings per replica from block events, plus the router's own recent sends as short-lived hints."""

    def __init__(
        self,
        block_size: int = 16,
        *,
        max_blocks_per_prompt: int = DEFAULT_MAX_BLOCKS_PER_PROMPT,
        recent_s: float = DEFAULT_RECENT_S,
        max_recent: int = DEFAULT_MAX_RECENT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.max_blocks_per_prompt = max_blocks_per_prompt
        self.recent_s = recent_s
        self.max_recent = max_recent
        self._clock = clock
        # replica → hash → tiers holding it (bits), and hash → replicas holding it in any tier.
        self._by_replica: dict[str, dict[int, int]] = {}
        self._holders: dict[int, set[str]] = {}
        # replica → (epoch, seq) of the last event applied: where its next read starts.
        self._cursor: dict[str, tuple[int | None, int]] = {}
        # hash → {replica: when sent}, oldest first; and per replica how many such hashes it has.
        self._recent: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._recent_count: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def held(self, replica: str) -> int:
        """How many blocks `replica` holds (device and host), counting those of recent sends its events have not
        reported yet: the footprint the router balances, which must grow as it sends, not only at refreshes."""
        return len(self._by_replica.get(replica, ())) + self._recent_count.get(replica, 0)

    def holds(self, replica: str) -> dict[int, int]:
        """A copy of `replica`'s holdings: hash → tier bits (1 device, 2 host)."""
        return dict(self._by_replica.get(replica, {}))

    def position(self, replica: str) -> tuple[int | None, int]:
        """(epoch, seq) to ask `replica` for events after; (None, 0) asks for a snapshot."""
        return self._cursor.get(replica, (None, 0))

    def block_hashes(self, token_ids: Sequence[int], lora_id: int = 0) -> list[int]:
        """The engine's chained hash of every full block of `token_ids` (up to max_blocks_per_prompt), computed
        with LoRA adapter `lora_id` (0: the base model): the chain starts at the adapter's own root, as the block
        table's does, so an adapter's blocks never match another adapter's or the base model's."""
        size = self.block_size
        hashes, parent = [], root_hash(lora_id)
        for start in range(0, min(len(token_ids) // size, self.max_blocks_per_prompt) * size, size):
            block = token_ids[start : start + size]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in block):
                raise ValueError("prompt token ids must be ints")
            parent = hash_block(parent, tuple(block))
            hashes.append(parent)
        return hashes

    # -- events ---------------------------------------------------------------------------------

    def apply(self, replica: str, report: dict) -> None:
        """A replica's answer to `position`: its events since, or a snapshot that replaces what was known."""
        if "snapshot" in report:
            self._drop(replica)
            for tier, hashes in report["snapshot"].items():
                for block_hash in hashes:
                    self._set(replica, block_hash, _TIER_BITS[tier])
        else:
            for kind, block_hash, tier in report["events"]:
                bit = _TIER_BITS[tier]
                if kind == STORED:
                    self._set(replica, block_hash, bit)
                elif kind == REMOVED:
                    self._unset(replica, block_hash, bit)
                elif kind == CLEARED:
                    for held in [h for h, bits in self._by_replica.get(replica, {}).items() if bits & bit]:
                        self._unset(replica, held, bit)
        self._cursor[replica] = (report["epoch"], report["seq"])

    def remove_replica(self, replica: str) -> None:
        """Forget `replica` (it left or died); it is read again from a snapshot if it rejoins."""
        self._drop(replica)
        self._cursor.pop(replica, None)
        for block_hash in list(self._recent):
            senders = self._recent[block_hash]
            if senders.pop(replica, None) is not None and not senders:
                del self._recent[block_hash]
        self._recent_count.pop(replica, None)

    # -- the router's side ----------------------------------------------------------------------

    def insert(self, replica: str, token_ids: Sequence[int], hashes: list[int] | None = None, lora_id: int = 0) -> None:
        """The router sent `token_ids` (for adapter `lora_id`) to `replica` now: a hint until its events tell, for
        recent_s seconds."""
        if self.recent_s <= 0:
            return
        now = self._clock()
        for block_hash in hashes if hashes is not None else self.block_hashes(token_ids, lora_id):
            senders = self._recent.pop(block_hash, None) or {}
            if replica not in senders:
                self._recent_count[replica] = self._recent_count.get(replica, 0) + 1
            senders[replica] = now
            self._recent[block_hash] = senders
        while len(self._recent) > self.max_recent:
            self._forget_recent(self._recent.popitem(last=False)[1])

    def match(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> dict[str, int]:
        """How many leading tokens of the prompt each replica holds as a run of blocks from the first (replicas
        with none are left out)."""
        if hashes is None:
            hashes = self.block_hashes(token_ids)
        self._expire()
        matched: dict[str, int] = {}
        candidates: set[str] | None = None
        for i, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash, set()) | set(self._recent.get(block_hash, ()))
            current = holders if candidates is None else candidates & holders
            for replica in (candidates or set()) - current:
                matched[replica] = i * self.block_size
            candidates = current
            if not candidates:
                break
        for replica in candidates or ():
            matched[replica] = len(hashes) * self.block_size
        return matched

    # -- internals ------------------------------------------------------------------------------

    def _set(self, replica: str, block_hash: int, bit: int) -> None:
        held = self._by_replica.setdefault(replica, {})
        held[block_hash] = held.get(block_hash, 0) | bit
        self._holders.setdefault(block_hash, set()).add(replica)

    def _unset(self, replica: str, block_hash: int, bit: int) -> None:
        held = self._by_replica.get(replica)
        if held is None or block_hash not in held:
            return
        bits = held[block_hash] & ~bit
        if bits:
            held[block_hash] = bits
            return
        del held[block_hash]
        holders = self._holders[block_hash]
        holders.discard(replica)
        if not holders:
            del self._holders[block_hash]

    def _drop(self, replica: str) -> None:
        for block_hash in self._by_replica.pop(replica, {}):
            holders = self._holders[block_hash]
            holders.discard(replica)
            if not holders:
                del self._holders[block_hash]

    def _expire(self) -> None:
        oldest = self._clock() - self.recent_s
        while self._recent:
            block_hash, senders = next(iter(self._recent.items()))
            if max(senders.values()) >= oldest:
                break
            del self._recent[block_hash]
            self._forget_recent(senders)

    def _forget_recent(self, senders: dict[str, float]) -> None:
        for replica in senders:
            left = self._recent_count.get(replica, 0) - 1
            if left > 0:
                self._recent_count[replica] = left
            else:
                self._recent_count.pop(replica, None)


async def read_kv_events(index: KvEventIndex, name: str, client, timeout_s: float, current) -> None:
    """A replica's block events since the index last read them (or a snapshot), applied unless `current()` is no
    longer `client` (the replica left or was replaced meanwhile); a replica that does not answer is asked again
    at the next refresh."""
    try:
        report = await asyncio.wait_for(client.kv_events(*index.position(name)), timeout_s)
    except Exception as error:
        logger.warning("replica %s did not report its block events: %r", name, error)
        return
    if current() is client:
        index.apply(name, report)
