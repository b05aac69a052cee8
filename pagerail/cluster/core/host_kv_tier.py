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

from pagerail.cluster.core.kv_events import HOST, KvEventLog


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
        # This step's offloads by device block, and the blocks whose copy must precede its forward (reused, or
        # loaded back, in the same step); the others may run beside it.
        self._offloading: dict[int, int] = {}
        self._before_forward: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def store(
        self, block_id: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...], reused: bool = True
    ) -> None:
        """Copy device block `block_id` to a host slot this step, unless one holds it: because it is about to be
        reused (the copy must precede this step's forward), or, not `reused`, because it was just freed (the copy
        may run beside the forward, ahead of any later reuse)."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            if entry.parent_hash == parent_hash and entry.token_ids == token_ids:
                self._entries.move_to_end(block_hash)
                if reused and block_id in self._offloading:
                    self._before_forward.add(block_id)  # freed and reused in one step: copy it first
            return  # the same hash for other tokens: keep the entry there is
        slot = self._take_slot()
        if slot is None:
            self.num_not_offloaded += 1
            return
        self._entries[block_hash] = HostBlock(slot, block_hash, parent_hash, token_ids)
        self._offloads.append((block_id, slot))
        self._offloading[block_id] = slot
        if reused:
            self._before_forward.add(block_id)
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
        offloaded = {slot: block_id for block_id, slot in self._offloading.items()}
        for block, block_id in zip(blocks, block_ids, strict=True):
            self._loads.append((block.slot, block_id))
            self._entries.move_to_end(block.block_hash)
            if block.slot in offloaded:  # copied out this step and loaded back: out first, then in
                self._before_forward.add(offloaded[block.slot])
        self.num_loaded += len(blocks)

    def take_transfers(self) -> tuple[list[tuple[int, int, bool]], list[tuple[int, int]]]:
        """This step's (device block, slot, before the forward) offloads and (slot, device block) loads; the step
        starts afresh."""
        offloads = [(block_id, slot, block_id in self._before_forward) for block_id, slot in self._offloads]
        loads = self._loads
        self._offloads, self._loads = [], []
        self._offloading, self._before_forward = {}, set()
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
        slot = self._entries.pop(victim).slot
        if slot in self._offloading.values():
            # A copy into it was due this step (a freed block's): the slot's new content must not be overwritten.
            self._offloads = [(block_id, s) for block_id, s in self._offloads if s != slot]
            self._offloading = {block_id: s for block_id, s in self._offloading.items() if s != slot}
        return slot
