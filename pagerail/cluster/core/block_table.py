"""Global KV block table: a pool of fixed-size blocks, per-request block lists, ref counts and prefix caching."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagerail.cluster.core.host_kv_tier import HostBlock, HostKvTier
from pagerail.cluster.core.kv_events import DEVICE, KvEventLog

# Parent hash of the first block of every sequence. Any fixed value works; it only has to be the same for
# every request so that identical first blocks hash identically.
ROOT_PARENT_HASH = 0x5EED_B10C
# A request's block-list entry whose block left its sliding window and went back to the pool.
RELEASED = -1
# What a released entry reads as outside the table: any real block id works, since no attention path reads a
# position before the window, and block 0 always exists.
RELEASED_PLACEHOLDER = 0


def root_hash(lora_id: int = 0) -> int:
    """Where a request's hash chain starts: the same for every base-model request, its own for each LoRA adapter,
    so that two adapters (or an adapter and the base model) never share KV."""
    # Ints only: a tuple of ints hashes the same in every process (a str would not: its hash is salted).
    return ROOT_PARENT_HASH if not lora_id else hash((ROOT_PARENT_HASH, 0x10FA, lora_id))


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: the same tokens after a different prefix give a different hash."""
    # Python hashes ints and tuples of ints deterministically (no per-process salt), so the value is
    # stable across runs; collisions are still possible, which is why a hit also compares token ids.
    return hash((parent_hash, token_ids))


@dataclass(frozen=True, slots=True)
class _CachedBlock:
    """What the hash map remembers about one cached block, to reject hash collisions on lookup."""

    block_id: int
    parent_hash: int
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class _RequestBlocks:
    """The blocks a request owns, plus how far its full blocks have been hashed (so hashing is incremental)."""

    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0
    last_hash: int = ROOT_PARENT_HASH
    # Leading entries already released (sliding window): block_ids[:num_released] are all RELEASED.
    num_released: int = 0
    # False: the KV is never looked up by another request (an embedding's prompt), so its blocks get no hash.
    cacheable: bool = True


class BlockTable:
    """Hands out KV cache blocks to requests and shares full blocks between requests with the same prefix.

    A block is in exactly one of three states:
      - used:      ref count > 0, owned by one or more requests;
      - free:      ref count 0, in the free queue, no hash;
      - evictable: ref count 0, in the free queue, still has a hash and can be found by find_cached_prefix
                   until allocation pops it from the queue front and drops its hash.

    A block gets its hash (becomes findable) only through commit_computed, which the engine calls after the
    step that wrote the block's KV succeeded: a block whose KV was never written can never be served.

    With `sliding_window` (a model whose every layer attends to only its last that many positions), commit_computed
    also releases a request's leading blocks once no later query can see them: a sequence then holds about
    window / block_size + 1 blocks however long it grows. Released blocks keep their hash, so a prefix hit still
    finds them while they wait in the pool.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        host_tier: HostKvTier | None = None,
        events: KvEventLog | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._enable_prefix_caching = enable_prefix_caching
        self._sliding_window = sliding_window
        # Where evicted cached blocks go, and where prompts continue past a device hit (None: no second tier).
        self.host_tier = host_tier if enable_prefix_caching else None
        # Told of every hash that becomes findable or stops being findable (a router follows them).
        self.events = events
        if host_tier is not None:
            host_tier.events = events
        self.reset()

    def reset(self) -> None:
        """Forget every request and every hash: all blocks are free (the workers' caches are empty)."""
        if self.host_tier is not None:
            self.host_tier.reset()
        if self.events is not None:
            self.events.cleared(DEVICE)
        self._ref_counts: list[int] = [0] * self._num_blocks
        # Hash of each block, or None. Kept per block so eviction can drop the map entry in O(1).
        self._block_hashes: list[int | None] = [None] * self._num_blocks
        self._cached: dict[int, _CachedBlock] = {}
        # Blocks with ref count 0, least recently freed first. OrderedDict gives O(1) pop from the front and
        # O(1) removal of an arbitrary block when a cached one is attached again.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(self._num_blocks))
        self._requests: dict[str, _RequestBlocks] = {}
        # Token slots each request's blocks hold (blocks × block size), for the scheduler's per-step look.
        self._slots: dict[str, int] = {}
        # The computed-token count at which each request's next block becomes full (prefix caching on) or, with a
        # sliding window, leaves the window, whichever comes first: from then on commit_computed has work.
        self._hash_due: dict[str, int] = {}
        # The most blocks requests held at once since the last reset_peak (how much sharing saved, for example).
        self.peak_used_blocks = 0

    # ------------------------------------------------------------------ sizes

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, including cached blocks that may still be reused by hash."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free_queue)

    def reset_peak(self) -> None:
        """Start peak_used_blocks again from the blocks held now."""
        self.peak_used_blocks = self.num_used_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks

    # ------------------------------------------------------------------ queries

    @property
    def slots_owned(self) -> Mapping[str, int]:
        """request id → token slots its blocks hold; read it, never write it. A request absent owns none.

        The scheduler reads it once per running request per step: a decode whose next token still fits needs
        no allocate_slots call."""
        return self._slots

    @property
    def hash_due_at(self) -> Mapping[str, int]:
        """request id → the computed-token count from which commit_computed has a block to hash or to release;
        read it, never write it. A request absent has neither (prefix caching off, no sliding window)."""
        return self._hash_due

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in sequence order (a copy), a released one as RELEASED_PLACEHOLDER; empty for an
        unknown request."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        if not req.num_released:
            return list(req.block_ids)
        return [RELEASED_PLACEHOLDER] * req.num_released + req.block_ids[req.num_released :]

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds now: its block list less what left its sliding window."""
        req = self._requests.get(request_id)
        return 0 if req is None else len(req.block_ids) - req.num_released

    def caches_on_device(self, block_hash: int) -> bool:
        """Whether a device block is findable under `block_hash`."""
        return block_hash in self._cached

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """How many new blocks allocate_slots would take for num_tokens, not counting cached attachments."""
        req = self._requests.get(request_id)
        num_owned = len(req.block_ids) if req is not None else 0
        return max(0, self._blocks_for(num_tokens) - num_owned)

    def find_cached_prefix(self, token_ids: Sequence[int], root: int = ROOT_PARENT_HASH) -> list[int]:
        """Block ids of the longest cached run of full blocks matching the start of token_ids, in the hash chain
        that starts at `root` (root_hash: the base model's or an adapter's).

        Never covers the last token: it must be recomputed to produce logits for the next one. Changes nothing.
        """
        if not self._enable_prefix_caching or not token_ids:
            return []
        bs = self._block_size
        found: list[int] = []
        parent = root
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens)
            entry = self._cached.get(h)
            # A hash match alone could be a collision: the block's own tokens and its parent must match too.
            if entry is None or entry.token_ids != tokens or entry.parent_hash != parent:
                break
            found.append(entry.block_id)
            parent = h
        return found

    def find_host_prefix(
        self, token_ids: Sequence[int], cached_block_ids: Sequence[int], root: int = ROOT_PARENT_HASH
    ) -> list[HostBlock]:
        """The host-tier blocks that continue the device hit `cached_block_ids` (from find_cached_prefix)."""
        if self.host_tier is None or not token_ids:
            return []
        parent = self._block_hashes[cached_block_ids[-1]] if cached_block_ids else root
        return self.host_tier.match(token_ids, len(cached_block_ids), parent, self._block_size, hash_block)

    def take_host_transfers(self) -> tuple[list[tuple[int, int, bool]], list[tuple[int, int]]]:
        """The host-tier copies this step must make before its forward (offloads, loads); empty without a tier."""
        return self.host_tier.take_transfers() if self.host_tier is not None else ([], [])

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        cached_block_ids: Sequence[int] = (),
        host_blocks: Sequence[HostBlock] = (),
        cacheable: bool = True,
        root: int = ROOT_PARENT_HASH,
    ) -> list[int] | None:
        """Make the request own blocks for its first num_tokens tokens; None (and no change) if they don't fit.

        cached_block_ids (from find_cached_prefix, only for a request without blocks) are attached first; the
        first new blocks are then filled from `host_blocks` (from find_host_prefix) in this step.
        Returns only the newly allocated block ids, in sequence order. `cacheable` False (for a request without
        blocks): its blocks are never hashed, and go back to be reused first when it ends. `root` (for a request
        without blocks) starts its hash chain (root_hash).
        """
        if host_blocks:
            # Pinned first: evictions this allocation makes must not take the slots it loads from.
            self.host_tier.pin(host_blocks)
            new_ids = self._allocate(request_id, token_ids, num_tokens, cached_block_ids, cacheable, root)
            if new_ids is None:
                self.host_tier.unpin(host_blocks)
            else:
                self.host_tier.load(host_blocks, new_ids[: len(host_blocks)])
            return new_ids
        return self._allocate(request_id, token_ids, num_tokens, cached_block_ids, cacheable, root)

    def _allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        cached_block_ids: Sequence[int],
        cacheable: bool = True,
        root: int = ROOT_PARENT_HASH,
    ) -> list[int] | None:
        req = self._requests.get(request_id)
        num_owned = len(req.block_ids) if req is not None else 0
        if not cached_block_ids and 0 <= num_tokens <= num_owned * self._block_size:
            return []  # the common decode step: the last block still has room
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if cached_block_ids:
            self._check_cached_ids(num_owned, token_ids, cached_block_ids, root)

        num_new = max(0, self._blocks_for(num_tokens) - num_owned - len(cached_block_ids))
        # An evictable cached block sits in the free queue: attaching it takes one free block away.
        num_revived = sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)
        if num_new + num_revived > len(self._free_queue):
            return None

        if req is None:
            req = self._requests[request_id] = _RequestBlocks(last_hash=root, cacheable=cacheable)
        for block_id in cached_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1
            req.block_ids.append(block_id)
        last_cached_hash = self._block_hashes[cached_block_ids[-1]] if cached_block_ids else None
        if last_cached_hash is not None:
            # Attached blocks are already hashed; continue the chain from the last one.
            req.num_hashed = len(cached_block_ids)
            req.last_hash = last_cached_hash
        self._set_due(request_id, req)

        new_ids = [self._pop_free_block() for _ in range(num_new)]
        for block_id in new_ids:
            self._ref_counts[block_id] = 1
        req.block_ids.extend(new_ids)
        self._slots[request_id] = len(req.block_ids) * self._block_size
        self.peak_used_blocks = max(self.peak_used_blocks, self._num_blocks - len(self._free_queue))
        return new_ids

    def commit_computed(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The KV of the request's first num_computed_tokens tokens is now written: make its full blocks findable,
        then release the blocks that left a sliding window.

        Call only after the step that wrote them succeeded; until then a block is private to its request.
        """
        req = self._requests.get(request_id)
        if req is None:
            return
        hashing = req.cacheable and self._enable_prefix_caching
        if hashing and num_computed_tokens >= (req.num_hashed + 1) * self._block_size:
            self._hash_full_blocks(req, token_ids, min(num_computed_tokens, len(token_ids)))
        if self._sliding_window is not None:
            # The next query sits at position num_computed_tokens and sees keys from window - 1 before it on; the
            # last computed position is kept seeing too, since a session whose input closes recomputes it.
            self._release_before(req, num_computed_tokens - self._sliding_window)
        self._set_due(request_id, req)

    def free(self, request_id: str) -> None:
        """Release the request's blocks; cached ones stay findable by hash until their block is reused."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        del self._slots[request_id]
        self._hash_due.pop(request_id, None)
        # Tail first: the queue front is evicted first, and a sequence's head is the part most likely shared. A
        # block without a hash holds nothing anyone can find: it goes to the very front, to be reused next, so
        # the blocks in use stay few and warm (a block first written costs the page faults of fresh memory).
        tier = self.host_tier
        for block_id in reversed(req.block_ids[req.num_released :]):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                h = self._block_hashes[block_id]
                if h is None:
                    self._free_queue.move_to_end(block_id, last=False)
                elif tier is not None:
                    # Copied to the host now, beside the next forward, so its eviction later costs no copy.
                    entry = self._cached[h]
                    tier.store(block_id, h, entry.parent_hash, entry.token_ids, reused=False)

    # ------------------------------------------------------------------ internals

    def _set_due(self, request_id: str, req: _RequestBlocks) -> None:
        due = []
        if self._enable_prefix_caching and req.cacheable:
            due.append((req.num_hashed + 1) * self._block_size)
        if self._sliding_window is not None:
            due.append((req.num_released + 1) * self._block_size + self._sliding_window)
        if due:
            self._hash_due[request_id] = min(due)

    def _release_before(self, req: _RequestBlocks, first_visible: int) -> None:
        """Release the request's blocks that end before position `first_visible`; their hashes stay findable."""
        # Never past the last block: a request whose KV lags its list (recomputing) keeps its tail.
        upto = min(first_visible // self._block_size, len(req.block_ids) - 1)
        for i in range(req.num_released, upto):
            block_id = req.block_ids[i]
            req.block_ids[i] = RELEASED
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
        req.num_released = max(req.num_released, upto)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _check_cached_ids(
        self, num_owned: int, token_ids: Sequence[int], cached_block_ids: Sequence[int], root: int
    ) -> None:
        # Attaching a block that was evicted and reused since the lookup would silently serve another
        # sequence's KV; refuse loudly instead. Walking the stored chain costs no more than the lookup did.
        if num_owned:
            raise ValueError("cached_block_ids may only be given for a request that owns no blocks yet")
        if not self._enable_prefix_caching:
            raise ValueError("cached_block_ids given but prefix caching is disabled")
        bs = self._block_size
        parent = root
        for i, block_id in enumerate(cached_block_ids):
            h = self._block_hashes[block_id] if 0 <= block_id < self._num_blocks else None
            entry = self._cached.get(h) if h is not None else None
            if (
                entry is None
                or entry.parent_hash != parent
                or entry.token_ids != tuple(token_ids[i * bs : (i + 1) * bs])
            ):
                raise ValueError(f"block {block_id} does not cache block {i} of these tokens")
            parent = h

    def _pop_free_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        h = self._block_hashes[block_id]
        if h is not None:
            # Reused for new content: its old hash must no longer lead here (the host tier may keep a copy).
            entry = self._cached.pop(h)
            if self.events is not None:
                self.events.removed(h, DEVICE)
            if self.host_tier is not None:
                self.host_tier.store(block_id, h, entry.parent_hash, entry.token_ids)
            self._block_hashes[block_id] = None
        return block_id

    def _hash_full_blocks(self, req: _RequestBlocks, token_ids: Sequence[int], num_known_tokens: int) -> None:
        bs = self._block_size
        num_full = min(num_known_tokens // bs, len(req.block_ids))
        parent = req.last_hash
        for i in range(req.num_hashed, num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens)
            # The same prefix computed twice concurrently: keep the existing mapping; this copy stays unhashed
            # and returns to the plain free pool when freed. The chain still continues from h.
            if h not in self._cached:
                block_id = req.block_ids[i]
                self._cached[h] = _CachedBlock(block_id, parent, tokens)
                self._block_hashes[block_id] = h
                if self.events is not None:
                    self.events.stored(h, DEVICE)
            parent = h
        if num_full > req.num_hashed:
            req.num_hashed = num_full
            req.last_hash = parent
