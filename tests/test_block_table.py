"""Unit tests for the global KV block table: allocation, ref counts, prefix caching and eviction order."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagerail.cluster.core import block_table as block_table_module
from pagerail.cluster.core.block_table import RELEASED
from pagerail.cluster.core.block_table import BlockTable as EngineBlockTable

BS = 4  # small block size keeps the token lists in these tests readable


class BlockTable(EngineBlockTable):
    """Each allocation followed by a successful step that computes every allocated known token (the scheduler
    commits after the step); the tests of uncommitted blocks use EngineBlockTable itself."""

    def allocate_slots(self, request_id, token_ids, num_tokens, cached_block_ids=()):
        new = super().allocate_slots(request_id, token_ids, num_tokens, cached_block_ids)
        if new is not None:
            self.commit_computed(request_id, token_ids, num_tokens)
        return new


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def snapshot(table: BlockTable) -> tuple:
    """Everything observable plus the internals that a failed allocation must not touch."""
    return (
        table.num_free_blocks,
        {rid: list(r.block_ids) for rid, r in table._requests.items()},
        list(table._ref_counts),
        list(table._free_queue),
        dict(table._cached),
        list(table._block_hashes),
    )


def check_invariants(table: BlockTable) -> None:
    owners = Counter(b for r in table._requests.values() for b in r.block_ids)
    for block_id, ref in enumerate(table._ref_counts):
        assert ref >= 0
        assert ref == owners[block_id]
    assert set(table._free_queue) == {b for b, ref in enumerate(table._ref_counts) if ref == 0}
    assert table.num_free_blocks + table.num_used_blocks == table.num_blocks
    for h, entry in table._cached.items():
        assert table._block_hashes[entry.block_id] == h
    assert sum(h is not None for h in table._block_hashes) == len(table._cached)
    check_lookups(table)


def check_lookups(table: EngineBlockTable) -> None:
    """The scheduler's per-step shortcuts agree with the request block lists they summarise."""
    bs = table.block_size
    assert dict(table.slots_owned) == {rid: len(r.block_ids) * bs for rid, r in table._requests.items()}
    window = table._sliding_window
    expected = {}
    for rid, r in table._requests.items():
        due = [(r.num_hashed + 1) * bs] if table._enable_prefix_caching and r.cacheable else []
        if window is not None:
            due.append((r.num_released + 1) * bs + window)
            # Released entries lead the list, and nothing but them is RELEASED.
            assert r.block_ids[: r.num_released] == [RELEASED] * r.num_released
            assert RELEASED not in r.block_ids[r.num_released :]
        if due:
            expected[rid] = min(due)
    assert dict(table.hash_due_at) == expected


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (-1, 16), (8, 0), (8, -4)])
def test_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockTable(num_blocks, block_size)


def test_initial_state() -> None:
    table = BlockTable(10)
    assert table.num_blocks == 10 and table.block_size == 16
    assert table.num_free_blocks == 10 and table.num_used_blocks == 0 and table.usage == 0.0
    assert table.block_ids("nope") == [] and not table.has_request("nope")


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (12, 3)])
def test_block_count_for_length(num_tokens: int, expected: int) -> None:
    table = BlockTable(8, BS)
    assert table.num_blocks_needed("r", num_tokens) == expected
    new = table.allocate_slots("r", toks(0, num_tokens), num_tokens)
    assert new is not None and len(new) == expected
    assert table.block_ids("r") == new and len(set(new)) == expected
    assert table.num_used_blocks == expected and table.usage == expected / 8
    check_invariants(table)


def test_incremental_growth_only_adds_missing_blocks() -> None:
    table = BlockTable(8, BS)
    prompt = toks(0, 6)
    first = table.allocate_slots("r", prompt, 6)
    assert first is not None and len(first) == 2
    assert table.num_blocks_needed("r", 8) == 0
    assert table.allocate_slots("r", prompt + [6, 7], 8) == []
    assert table.num_blocks_needed("r", 9) == 1
    third = table.allocate_slots("r", prompt + [6, 7, 8], 9)
    assert third is not None and len(third) == 1
    assert table.block_ids("r") == first + third
    check_invariants(table)


def test_failure_returns_none_and_changes_nothing() -> None:
    table = BlockTable(3, BS)
    assert table.allocate_slots("a", toks(0, 8), 8) is not None
    before = snapshot(table)
    assert table.allocate_slots("b", toks(100, 8), 8) is None
    assert table.allocate_slots("a", toks(0, 13), 13) is None
    assert snapshot(table) == before
    assert not table.has_request("b")


def test_attaching_evictable_cached_blocks_counts_against_free_pool() -> None:
    table = BlockTable(3, BS)
    prompt = toks(0, 9)
    table.allocate_slots("a", prompt, 9)
    table.free("a")
    cached = table.find_cached_prefix(prompt)
    assert len(cached) == 2
    table.allocate_slots("other", toks(50, 4), 4)  # 2 free blocks left, both of them cached ones
    before = snapshot(table)
    # Needs 1 new block + revives 2 cached ones = 3 free blocks, only 2 exist.
    assert table.allocate_slots("b", prompt, 9, cached) is None
    assert snapshot(table) == before
    table.free("other")
    new = table.allocate_slots("b", prompt, 9, cached)
    assert new is not None and len(new) == 1
    assert table.block_ids("b") == cached + new
    assert table.num_free_blocks == 0
    check_invariants(table)


def test_negative_num_tokens_rejected() -> None:
    with pytest.raises(ValueError):
        BlockTable(4, BS).allocate_slots("r", [1], -1)


def test_two_requests_share_cached_prefix() -> None:
    table = BlockTable(10, BS)
    prompt_a = toks(0, 10)  # 2 full blocks + 2 tokens
    new_a = table.allocate_slots("a", prompt_a, 10)
    assert new_a is not None
    prompt_b = toks(0, 8) + [99, 98, 97]
    cached = table.find_cached_prefix(prompt_b)
    assert cached == new_a[:2]
    new_b = table.allocate_slots("b", prompt_b, 11, cached)
    assert new_b is not None and len(new_b) == 1
    assert table.block_ids("b") == cached + new_b
    assert table.num_used_blocks == 4
    assert [table._ref_counts[b] for b in cached] == [2, 2]

    table.free("a")
    assert table.num_used_blocks == 3  # b keeps the shared prefix and its own block
    assert all(table._ref_counts[b] == 1 for b in cached)
    check_invariants(table)
    table.free("b")
    assert table.num_free_blocks == 10
    check_invariants(table)


def test_free_unknown_is_noop() -> None:
    table = BlockTable(4, BS)
    table.free("ghost")
    assert table.num_free_blocks == 4


def test_cached_ids_only_for_request_without_blocks() -> None:
    table = BlockTable(6, BS)
    table.allocate_slots("a", toks(0, 9), 9)
    table.allocate_slots("b", toks(50, 4), 4)
    with pytest.raises(ValueError):
        table.allocate_slots("b", toks(0, 9), 9, table.find_cached_prefix(toks(0, 9)))


def test_attaching_a_block_that_is_no_longer_cached_raises() -> None:
    table = BlockTable(2, BS)
    table.allocate_slots("a", toks(0, 5), 5)
    table.free("a")
    cached = table.find_cached_prefix(toks(0, 5))
    assert len(cached) == 1
    table.allocate_slots("x", toks(100, 8), 8)  # evicts the cached block
    table.free("x")
    with pytest.raises(ValueError):
        table.allocate_slots("b", toks(0, 5), 5, cached)


def test_last_token_always_recomputed() -> None:
    table = BlockTable(8, BS)
    prompt = toks(0, 8)  # exactly two full blocks
    ids = table.allocate_slots("a", prompt, 8)
    assert ids is not None
    assert table.find_cached_prefix(prompt) == ids[:1]
    assert table.find_cached_prefix(prompt + [42]) == ids
    assert table.find_cached_prefix(prompt[:1]) == []
    assert table.find_cached_prefix([]) == []


def test_same_block_after_different_prefix_does_not_hit() -> None:
    table = BlockTable(8, BS)
    shared_block = [7, 7, 7, 7]
    table.allocate_slots("a", [1, 2, 3, 4] + shared_block + [0], 9)
    hit = table.find_cached_prefix([5, 6, 7, 8] + shared_block + [0])
    assert hit == []
    assert len(table.find_cached_prefix([1, 2, 3, 4] + shared_block + [0])) == 2


def test_hash_collision_with_different_tokens_does_not_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_table_module, "hash_block", lambda parent, token_ids: 12345)
    table = BlockTable(8, BS)
    ids = table.allocate_slots("a", toks(0, 9), 9)
    assert ids is not None
    assert table.find_cached_prefix(toks(100, 9)) == []  # same hash, other tokens
    # Only the first block got the colliding hash; the second is a "duplicate" and stays unhashed.
    assert table.find_cached_prefix(toks(0, 9)) == ids[:1]


def test_only_full_blocks_within_known_tokens_are_hashed() -> None:
    table = BlockTable(8, BS)
    prompt = toks(0, 12)
    table.allocate_slots("a", prompt, 4)  # chunked prefill: first chunk
    assert len(table.find_cached_prefix(prompt + [0])) == 1
    table.allocate_slots("a", prompt, 10)  # 2 full blocks, third partial
    assert len(table.find_cached_prefix(prompt + [0])) == 2
    # num_tokens beyond the known token ids (e.g. speculative slots): only known tokens are hashed.
    table.allocate_slots("a", prompt[:11], 12)
    assert len(table.find_cached_prefix(prompt + [0])) == 2
    table.allocate_slots("a", prompt, 12)
    assert len(table.find_cached_prefix(prompt + [0])) == 3
    check_invariants(table)


def test_decode_fills_and_hashes_blocks_one_token_at_a_time() -> None:
    table = BlockTable(8, BS)
    seq = toks(0, 3)
    table.allocate_slots("a", seq, 3)
    for t in range(3, 13):
        seq.append(t)
        table.allocate_slots("a", seq, len(seq))
    assert len(table.block_ids("a")) == 4
    assert table.find_cached_prefix(seq + [0]) == table.block_ids("a")[:3]
    assert table._requests["a"].num_hashed == 3
    check_invariants(table)


def test_concurrent_duplicate_prefix_keeps_first_mapping() -> None:
    table = BlockTable(6, BS)
    prompt = toks(0, 9)
    a = table.allocate_slots("a", prompt, 9)
    b = table.allocate_slots("b", prompt, 9)  # computed again without a lookup
    assert a is not None and b is not None and set(a).isdisjoint(b)
    assert table.find_cached_prefix(prompt) == a[:2]
    table.free("a")
    table.free("b")
    # b's duplicates are plain free blocks; a's cached blocks are still found after b's are freed.
    assert table.find_cached_prefix(prompt) == a[:2]
    check_invariants(table)


def test_tail_of_freed_sequence_is_evicted_before_head() -> None:
    table = BlockTable(6, BS)
    prompt = toks(0, 12)
    ids = table.allocate_slots("a", prompt, 12)
    assert ids is not None
    table.free("a")
    # Never-used blocks come first, then a's blocks tail first.
    new = table.allocate_slots("x", toks(100, 16), 16)
    assert new is not None and ids[2] in new and ids[0] not in new and ids[1] not in new
    assert table.find_cached_prefix(prompt + [0]) == ids[:2]
    table.allocate_slots("y", toks(200, 4), 4)
    assert table.find_cached_prefix(prompt + [0]) == ids[:1]
    check_invariants(table)


def test_least_recently_freed_is_evicted_first() -> None:
    table = BlockTable(4, BS)
    pa, pb = toks(0, 8), toks(100, 8)
    table.allocate_slots("a", pa, 8)
    table.allocate_slots("b", pb, 8)
    table.free("a")
    table.free("b")
    table.allocate_slots("x", toks(500, 8), 8)
    assert table.find_cached_prefix(pa + [0]) == []
    assert len(table.find_cached_prefix(pb + [0])) == 2


def test_a_freed_block_without_a_hash_is_reused_before_any_other() -> None:
    """A partly filled last block holds nothing findable: the next allocation takes it, not a never-used block (the
    blocks in use stay few and warm) and not a cached one."""
    table = BlockTable(8, BS)
    ids = table.allocate_slots("a", toks(0, 6), 6)  # one full (hashed) block and one partial
    table.free("a")
    assert table.allocate_slots("b", toks(50, 3), 3) == [ids[1]]
    assert table.find_cached_prefix(toks(0, 6)) == [ids[0]]  # the hashed one stayed findable
    check_invariants(table)


def test_blocks_of_a_request_nobody_looks_up_get_no_hash_and_come_back_first() -> None:
    table = EngineBlockTable(8, BS)
    prompt = toks(0, 12)
    ids = table.allocate_slots("embed", prompt, 12, cacheable=False)
    table.commit_computed("embed", prompt, 12)
    assert "embed" not in table.hash_due_at and table.find_cached_prefix(prompt + [0]) == []
    table.free("embed")
    assert table.allocate_slots("next", toks(100, 12), 12) == ids  # the freed ones first, in their order
    check_invariants(table)


def test_attached_cached_blocks_leave_the_evictable_set() -> None:
    table = BlockTable(4, BS)
    prompt = toks(0, 9)
    table.allocate_slots("a", prompt, 8)
    table.free("a")
    cached = table.find_cached_prefix(prompt)
    new = table.allocate_slots("b", prompt, 9, cached)
    assert new is not None and len(new) == 1
    assert table.num_free_blocks == 1
    table.allocate_slots("c", toks(300, 4), 4)  # takes the last free block, not b's cached ones
    assert table.block_ids("b")[:2] == cached
    assert table.find_cached_prefix(prompt) == cached
    check_invariants(table)


def test_prefix_caching_disabled() -> None:
    table = BlockTable(8, BS, enable_prefix_caching=False)
    prompt = toks(0, 13)
    table.allocate_slots("a", prompt, 13)
    assert table.find_cached_prefix(prompt) == []
    table.free("a")
    assert table.find_cached_prefix(prompt) == []
    assert not table._cached
    with pytest.raises(ValueError):
        table.allocate_slots("b", prompt, 13, [0])


def test_reset_forgets_everything() -> None:
    table = BlockTable(6, BS)
    prompt = toks(0, 9)
    table.allocate_slots("a", prompt, 9)
    table.allocate_slots("b", toks(50, 4), 4)
    table.free("b")
    table.reset()
    assert table.num_free_blocks == 6 and table.num_used_blocks == 0
    assert not table.has_request("a") and table.block_ids("a") == []
    assert table.find_cached_prefix(prompt) == []
    check_invariants(table)


def test_random_workload_never_leaks_and_serves_correct_prefixes() -> None:
    rng = random.Random(1234)
    table = BlockTable(40, BS)
    # What each block "holds": the tokens written into it once full. A cache hit must hand out exactly the
    # tokens the request would have computed itself.
    contents: dict[int, tuple[int, ...]] = {}
    seqs: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    bases = [[rng.randrange(3) for _ in range(24)] for _ in range(4)]
    next_id = num_hit_blocks = 0

    def record(rid: str) -> None:
        seq, ids = seqs[rid], table.block_ids(rid)
        for i in range(min(computed[rid], len(seq)) // BS):
            block = tuple(seq[i * BS : (i + 1) * BS])
            if table._ref_counts[ids[i]] > 1:  # shared with another request: must already hold these tokens
                assert contents[ids[i]] == block
            contents[ids[i]] = block

    for _ in range(1500):
        op = rng.random()
        if op < 0.35 or not seqs:
            rid = f"r{next_id}"
            next_id += 1
            prompt = rng.choice(bases)[: rng.randrange(1, 25)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
            cached = table.find_cached_prefix(prompt)
            num_hit_blocks += len(cached)
            for i, b in enumerate(cached):
                assert contents[b] == tuple(prompt[i * BS : (i + 1) * BS])
            start = len(cached) * BS
            chunk = min(len(prompt), start + rng.randrange(1, 12))
            if table.allocate_slots(rid, prompt, chunk, cached) is not None:
                seqs[rid], computed[rid] = prompt, chunk
                record(rid)
        elif op < 0.8:
            rid = rng.choice(list(seqs))
            if computed[rid] >= len(seqs[rid]):
                seqs[rid].append(rng.randrange(3))  # decode: the sampled token joins the sequence
            target = min(len(seqs[rid]), computed[rid] + rng.randrange(1, 6))
            if table.allocate_slots(rid, seqs[rid], target) is not None:
                computed[rid] = target
                record(rid)
        else:
            rid = rng.choice(list(seqs))
            table.free(rid)
            del seqs[rid], computed[rid]
        check_invariants(table)

    assert num_hit_blocks > 100  # the workload does exercise prefix sharing
    for rid in list(seqs):
        table.free(rid)
    check_invariants(table)
    assert table.num_free_blocks == table.num_blocks
    assert not table._requests
    assert all(ref == 0 for ref in table._ref_counts)


def test_blocks_are_findable_only_after_their_step_is_committed() -> None:
    table = EngineBlockTable(8, BS)
    prompt = toks(0, 9)
    table.allocate_slots("a", prompt, 9)
    # Allocated, but the step that writes their KV has not succeeded yet: nobody may read them.
    assert table.find_cached_prefix(prompt) == []
    table.commit_computed("a", prompt, 4)  # a first chunk of 4 tokens was computed
    assert table.find_cached_prefix(prompt) == table.block_ids("a")[:1]
    table.commit_computed("a", prompt, 9)
    assert table.find_cached_prefix(prompt) == table.block_ids("a")[:2]
    check_invariants(table)


def test_a_failed_step_leaves_nothing_findable() -> None:
    table = EngineBlockTable(8, BS)
    prompt = toks(0, 13)
    table.allocate_slots("a", prompt, 13)
    table.free("a")  # the step failed and the request was aborted: its blocks were never written
    assert table.find_cached_prefix(prompt) == []
    assert not table._cached
    check_invariants(table)
