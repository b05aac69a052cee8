"""The prefix cache's second tier: full blocks evicted from the device cache wait in host-memory slots of the ranks.

The head decides everything here, the ranks only copy: when the block table reuses a cached block for new content,
the block is copied to a host slot first (an offload, in the same step, before that step's forward overwrites
it); when a new request's prompt continues past its device prefix hit into blocks the host tier holds, fresh
device blocks are allocated and filled from the host slots (a load, before the forward reads them). The
transfers travel in the step message, offloads before loads.

Only blocks the device cache had made findable are offloaded, and those are written by steps that succeeded; a
failed step resets the whole tier (the ranks restart with empty memory). Loaded blocks become findable on the
device the way computed ones do: after their step succeeds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.core.kv_events import HOST, KvEventLog


@dataclass(frozen=True, slots=True)
class HostBlock:
    """One block held on the host: where, and what it caches (checked on every hit, as hashes can collide)."""

    slot: int
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    # False while its KV is still arriving from another replica: never matched, never evicted.
    ready: bool = True


class HostKvTier:
    """`num_slots` host blocks with their own LRU, and the copies the next step must make."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.num_offloaded = 0  # blocks copied to the host, ever
        self.num_loaded = 0  # blocks copied back, ever
        self.num_not_offloaded = 0  # evicted blocks that found no slot (every slot read by this step's loads)
        self.events: KvEventLog | None = None  # set by the block table that owns the tier
        self.reset()

    def reset(self) -> None:
        """Forget every block (the ranks' host memory is gone or untrusted)."""
        self._reset()

    def _reset(self) -> None:
        if self.events is not None:
            self.events.cleared(HOST)
        # block hash → HostBlock, least recently used first.
        self._entries: OrderedDict[int, HostBlock] = OrderedDict()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        # Slots this step loads from (count of loads): no offload may overwrite them before the step copies them.
        self._pinned: dict[int, int] = {}
        self._offloads: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, block_id: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> None:
        """Device block `block_id` is about to be reused: copy it to a host slot this step, unless one holds it."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            if entry.parent_hash == parent_hash and entry.token_ids == token_ids:
                self._entries.move_to_end(block_hash)
            return  # the same hash for other tokens: keep the entry there is
        slot = self._take_slot()
        if slot is None:
            self.num_not_offloaded += 1
            return
        self._entries[block_hash] = HostBlock(slot, block_hash, parent_hash, token_ids)
        self._offloads.append((block_id, slot))
        if self.events is not None:
            self.events.stored(block_hash, HOST)
        self.num_offloaded += 1

    def inject(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...], ready: bool = True) -> int | None:
        """A slot for a block that arrives from another replica (its KV written there by the caller: between
        steps, or, not `ready`, while steps run, until `settle`); None when the tier holds it or has no slot."""
        if block_hash in self._entries:
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._entries[block_hash] = HostBlock(slot, block_hash, parent_hash, token_ids, ready)
        if self.events is not None:
            self.events.stored(block_hash, HOST)
        return slot

    def settle(self, hashes: Sequence[int], arrived: bool) -> None:
        """Blocks injected not ready: their KV arrived (now findable), or did not (forgotten, slots freed)."""
        for block_hash in hashes:
            entry = self._entries.get(block_hash)
            if entry is None or entry.ready:
                continue
            if arrived:
                self._entries[block_hash] = HostBlock(entry.slot, block_hash, entry.parent_hash, entry.token_ids)
            else:
                del self._entries[block_hash]
                self._free_slots.append(entry.slot)
                if self.events is not None:
                    self.events.removed(block_hash, HOST)

    def match(
        self, token_ids: Sequence[int], first_block: int, parent_hash: int, block_size: int, hash_block
    ) -> list[HostBlock]:
        """The host blocks that continue `token_ids` from block `first_block` (whose parent hash is `parent_hash`),
        never covering the last token (it is recomputed for its logits). Changes nothing."""
        found: list[HostBlock] = []
        parent = parent_hash
        for i in range(first_block, (len(token_ids) - 1) // block_size):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            h = hash_block(parent, tokens)
            entry = self._entries.get(h)
            if entry is None or not entry.ready or entry.parent_hash != parent or entry.token_ids != tokens:
                break
            found.append(entry)
            parent = h
        return found

    def pin(self, blocks: Sequence[HostBlock]) -> None:
        """Keep these slots from being reused until this step's transfers are taken (a load will read them)."""
        for block in blocks:
            self._pinned[block.slot] = self._pinned.get(block.slot, 0) + 1

    def unpin(self, blocks: Sequence[HostBlock]) -> None:
        for block in blocks:
            left = self._pinned[block.slot] - 1
            if left:
                self._pinned[block.slot] = left
            else:
                del self._pinned[block.slot]

    def load(self, blocks: Sequence[HostBlock], block_ids: Sequence[int]) -> None:
        """Copy pinned host blocks into device blocks `block_ids` this step; they stay on the host too."""
        for block, block_id in zip(blocks, block_ids, strict=True):
            self._loads.append((block.slot, block_id))
            self._entries.move_to_end(block.block_hash)
        self.num_loaded += len(blocks)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (device block, slot) offloads and (slot, device block) loads; the step starts afresh."""
        offloads, loads = self._offloads, self._loads
        self._offloads, self._loads = [], []
        self._pinned.clear()
        return offloads, loads

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h, entry in self._entries.items() if entry.ready and entry.slot not in self._pinned), None)
        if victim is None:
            return None
        if self.events is not None:
            self.events.removed(victim, HOST)
        return self._entries.pop(victim).slot
