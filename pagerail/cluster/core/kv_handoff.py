"""A request's KV moving between replicas of one model (live migration, prefill/decode disaggregation): what
leaves the source (its computed full blocks: their tokens, hashes and data) and what the receiver checks before
its host tier takes them. The request itself then resumes on the receiver from its tokens, where its admission
finds those blocks in the host tier and loads them instead of computing them.

The data is the ranks' business (every KV head of each block, gathered from the source's ranks, split again
over the receiver's): here it is an opaque array with a `shape` and a `dtype`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagerail.cluster.core.block_table import ROOT_PARENT_HASH, hash_block

if TYPE_CHECKING:
    from pagerail.cluster.core.engine import EngineCore

logger = logging.getLogger(__name__)
LAYOUT_FIELDS = ("block_size", "num_layers", "num_kv_heads", "head_dim", "dtype")


@dataclass
class KvHandoff:
    """The full blocks of a request's first `len(token_ids)` tokens, as the source computed them."""

    token_ids: list[int]
    hashes: list[int]
    layout: dict
    data: Any  # [blocks, layers, 2, kv_heads, block_size, head_dim]

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel() * self.data.element_size())


def export_prefix(engine: EngineCore, token_ids: list[int]) -> KvHandoff | None:
    """The device blocks this replica holds for the longest run of full blocks of `token_ids` (an open request's
    history, or a finished prompt's, still in the prefix cache), with their data, or None (none, or a model whose
    old blocks leave a sliding window)."""
    found = _cached_blocks(engine, token_ids)
    if found is None:
        return None
    handoff, block_ids = found
    handoff.data = engine.executor.export_blocks(block_ids)
    return handoff


def describe_prefix(engine: EngineCore, token_ids: list[int], holder: str) -> KvHandoff | None:
    """export_prefix without the data, which will travel over a channel of the ranks: the blocks are held under
    `holder` (a reference that is not a request) so nothing reuses them until `release_held`."""
    found = _cached_blocks(engine, token_ids)
    if found is None:
        return None
    handoff, block_ids = found
    engine.block_table.allocate_slots(holder, handoff.token_ids, len(handoff.token_ids), block_ids)
    return handoff


def held_blocks(engine: EngineCore, holder: str, rows: list[int]) -> list[int]:
    """The device blocks at `rows` of those held under `holder`, to send while steps go on: being held, none of
    them is reused or overwritten until `release_held`."""
    block_ids = engine.block_table.block_ids(holder)
    return [block_ids[row] for row in rows]


def release_held(engine: EngineCore, holder: str) -> None:
    engine.block_table.free(holder)


def _cached_blocks(engine: EngineCore, token_ids: list[int]) -> tuple[KvHandoff, list[int]] | None:
    table = engine.block_table
    if getattr(engine.executor, "export_blocks", None) is None or engine.sliding_window is not None:
        return None
    # The lookup never covers a sequence's last token (it is recomputed for its logits): one more lets it cover all.
    block_ids = table.find_cached_prefix([*token_ids, 0])
    if not block_ids:
        return None
    tokens = list(token_ids[: len(block_ids) * table.block_size])
    return KvHandoff(tokens, chain_hashes(tokens, table.block_size), dict(engine.executor.kv_layout), None), block_ids


def chain_hashes(token_ids: list[int], block_size: int) -> list[int]:
    hashes, parent = [], ROOT_PARENT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


def check_roles(layouts: dict[str, dict], prefill: Sequence[str]) -> None:
    """Refuse, naming the field and the replicas, decode replicas whose KV (model shape, block size, dtype) differs
    from the prefill replicas': their blocks could not move."""
    first = prefill[0]
    for name, layout in layouts.items():
        for field in (*LAYOUT_FIELDS, "vocab_size"):
            if layout.get(field) != layouts[first].get(field):
                raise ValueError(
                    f"replica {name} has {field}={layout.get(field)!r}, prefill replica {first} "
                    f"{layouts[first].get(field)!r}: KV blocks cannot move between them"
                )


def check_handoff(handoff: KvHandoff, layout: dict) -> str | None:
    """Why `handoff` cannot be taken by a replica of `layout`, or None."""
    for field in LAYOUT_FIELDS:
        if handoff.layout.get(field) != layout.get(field):
            return f"{field} {handoff.layout.get(field)!r} differs from this replica's {layout.get(field)!r}"
    size = layout["block_size"]
    if len(handoff.token_ids) != handoff.num_blocks * size:
        return f"{len(handoff.token_ids)} tokens for {handoff.num_blocks} blocks of {size}"
    if chain_hashes(handoff.token_ids, size) != handoff.hashes:
        return "block hashes do not match their tokens"
    if handoff.data is None:  # the data comes over a channel of its own, shaped by the layout
        return None
    shape = (handoff.num_blocks, layout["num_layers"], 2, layout["num_kv_heads"], size, layout["head_dim"])
    if tuple(handoff.data.shape) != shape:
        return f"data of shape {tuple(handoff.data.shape)}, expected {shape}"
    if str(handoff.data.dtype).removeprefix("torch.") != layout["dtype"]:
        return f"data of dtype {handoff.data.dtype}, expected {layout['dtype']}"
    return None


def import_handoff(engine: EngineCore, handoff: KvHandoff) -> int:
    """Give the handoff's blocks host-tier slots and write them there; how many blocks it took (0: refused, or
    nothing new). Call between steps with none in flight: the slots it takes may not be read by a queued step."""
    rows, slots = reserve_slots(engine, handoff, ready=True)
    if slots:
        engine.executor.import_host(slots, handoff.data[rows])
    return len(slots)


def reserve_slots(engine: EngineCore, handoff: KvHandoff, ready: bool) -> tuple[list[int], list[int]]:
    """Host-tier slots for the handoff's blocks this replica lacks: (their rows in the handoff, the slots); none
    when it is refused. Not `ready`, the blocks are not findable until the tier settles them (their KV arrives
    while steps run)."""
    table, executor = engine.block_table, engine.executor
    tier = table.host_tier
    if tier is None or getattr(executor, "import_host", None) is None:
        logger.warning("KV handoff of %d blocks dropped: this replica has no host KV tier", handoff.num_blocks)
        return [], []
    problem = check_handoff(handoff, executor.kv_layout)
    if problem is not None:
        logger.warning("KV handoff of %d blocks dropped (the request recomputes): %s", handoff.num_blocks, problem)
        return [], []
    size, parent = table.block_size, ROOT_PARENT_HASH
    slots, rows = [], []
    for row, block_hash in enumerate(handoff.hashes):
        tokens = tuple(handoff.token_ids[row * size : (row + 1) * size])
        if not table.caches_on_device(block_hash):
            slot = tier.inject(block_hash, parent, tokens, ready)
            if slot is not None:
                slots.append(slot)
                rows.append(row)
        parent = block_hash
    return rows, slots
