"""The host KV tier: a stateful property test of the block table with a second tier against a model of what every
device block and host slot holds, the ranks' copies, the engine with and without the tier (same tokens, prompt
tokens loaded instead of recomputed), a failed step, and the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagerail.cluster.core.block_table import BlockTable
from pagerail.cluster.core.host_kv_tier import HostKvTier
from pagerail.proto import step_pb2
from pagerail.worker.kv_offload import HostKvPool, host_slots_for

BLOCK = 2
NUM_BLOCKS = 6
NUM_SLOTS = 5


class HostTierMachine(RuleBasedStateMachine):
    """Requests over a few shared prefixes come and go on a tiny device cache with a tinier host tier. The model
    plays the ranks: every step it applies the offloads, then the loads, moving the token content a block or slot
    holds; a request's computed blocks hold its tokens. Whatever the table can find, on the device or the host,
    must hold the tokens it is found for."""

    def __init__(self) -> None:
        super().__init__()
        self.table = BlockTable(NUM_BLOCKS, BLOCK, host_tier=HostKvTier(NUM_SLOTS))
        self.device: dict[int, tuple[int, ...]] = {}  # block → the tokens its KV holds
        self.host: dict[int, tuple[int, ...]] = {}  # slot → the same
        self.requests: dict[str, list[int]] = {}
        self.next_id = 0
        self.host_hits = 0

    def _step(self) -> list[tuple[int, int]]:
        """The ranks run the step's copies that precede its forward (offloads marked so, then loads); the rest,
        returned, run beside the forward and are applied after its writes (the latest they may land)."""
        offloads, loads = self.table.take_host_transfers()
        later = []
        for block, slot, now in offloads:
            assert block in self.device, "an offload of a block whose KV was never written"
            if now:
                self.host[slot] = self.device[block]
            else:
                later.append((block, slot))
        for slot, block in loads:
            self.device[block] = self.host[slot]
        return later

    def _finish_step(self, later: list[tuple[int, int]]) -> None:
        for block, slot in later:
            self.host[slot] = self.device[block]

    @rule(prefix=st.integers(0, 2), extra=st.integers(0, 3), length=st.integers(3, 9))
    def admit(self, prefix: int, extra: int, length: int) -> None:
        tokens = ([prefix] * 4 + [10 + extra] * 8)[:length]
        request_id = f"r{self.next_id}"
        self.next_id += 1
        cached = self.table.find_cached_prefix(tokens)
        hosted = self.table.find_host_prefix(tokens, cached)
        computed = (len(cached) + len(hosted)) * BLOCK
        assert computed < len(tokens)
        new = self.table.allocate_slots(request_id, tokens, len(tokens), cached, hosted)
        later = self._step()
        if new is None:
            self._finish_step(later)
            return
        self.host_hits += len(hosted)
        blocks = self.table.block_ids(request_id)
        for i, block in enumerate(blocks[: computed // BLOCK]):
            assert self.device.get(block) == tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), "a hit's KV is not its tokens"
        # The step computes the rest; it succeeds, so the full blocks become findable.
        for i in range(computed // BLOCK, len(blocks)):
            self.device[blocks[i]] = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        self._finish_step(later)
        self.table.commit_computed(request_id, tokens, len(tokens))
        self.requests[request_id] = tokens

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        del self.requests[request_id]
        self.table.free(request_id)

    @rule()
    def workers_restart(self) -> None:
        """A failed step: the ranks come back with empty device and host memory."""
        for request_id in list(self.requests):
            self.table.free(request_id)
        self.requests.clear()
        self.table.reset()
        self.device.clear()
        self.host.clear()

    @invariant()
    def everything_findable_holds_its_tokens(self) -> None:
        tier = self.table.host_tier
        # An entry may wait for the next step's copy of a block freed since; the block holds its KV till then.
        host = {**self.host, **{slot: self.device.get(block) for block, slot in tier._offloads}}
        for block in tier._entries.values():
            assert host.get(block.slot) == block.token_ids, "a host entry's slot holds other KV"
        for entry in self.table._cached.values():
            assert self.device.get(entry.block_id) == entry.token_ids, "a findable device block holds other KV"
        assert len(set(b.slot for b in tier._entries.values())) == len(tier)


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_machine_reaches_host_hits() -> None:
    """The property test means something only if its runs load from the host: a fixed run that does (with a host
    tier larger than the device cache, as deployed: freed blocks are copied there while the device keeps them)."""
    machine = HostTierMachine()
    machine.table = BlockTable(NUM_BLOCKS, BLOCK, host_tier=HostKvTier(12))
    for prefix in (0, 1, 2, 0, 1, 2, 0):
        machine.admit(prefix=prefix, extra=prefix, length=9)
        machine.everything_findable_holds_its_tokens()
        for request_id in list(machine.requests):
            machine.table.free(request_id)
        machine.requests.clear()
    assert machine.host_hits > 0


def test_a_slot_a_step_loads_from_is_never_reused_by_an_offload_of_the_same_step() -> None:
    tier = HostKvTier(1)
    tier.store(7, block_hash=11, parent_hash=0, token_ids=(1, 2))
    tier.take_transfers()
    [hit] = tier.match([1, 2, 3], 0, 0, 2, lambda parent, tokens: 11)
    tier.pin([hit])
    tier.store(8, block_hash=12, parent_hash=0, token_ids=(5, 6))  # no free slot, and the only one is pinned
    assert tier.num_not_offloaded == 1
    tier.load([hit], [3])
    assert tier.take_transfers() == ([], [(0, 3)])
    tier.store(8, block_hash=12, parent_hash=0, token_ids=(5, 6))  # the next step may take it
    assert tier.take_transfers() == ([(8, 0, True)], [])


def test_the_rank_pool_copies_blocks_out_and_back() -> None:
    block_size, heads, dim = 4, 2, 8
    caches = [torch.randn(2, heads, 6 * block_size, dim) for _ in range(3)]
    original = [cache.clone() for cache in caches]
    pool = HostKvPool(caches, num_slots=4, block_size=block_size)
    pool.transfer(step_pb2.StepBatch(offload_blocks=[1, 4], offload_slots=[3, 0]))
    for cache in caches:
        cache.zero_()
    pool.transfer(step_pb2.StepBatch(load_slots=[0, 3], load_blocks=[2, 5]))
    for cache, before in zip(caches, original, strict=True):
        assert torch.equal(cache[:, :, 2 * block_size : 3 * block_size], before[:, :, 4 * block_size : 5 * block_size])
        assert torch.equal(cache[:, :, 5 * block_size : 6 * block_size], before[:, :, 1 * block_size : 2 * block_size])
        assert not cache[:, :, : 2 * block_size].any()
    assert pool.bytes_per_block == 3 * 2 * heads * block_size * dim * 4


def test_offload_bytes_beyond_host_memory_are_refused_with_both_numbers() -> None:
    with pytest.raises(
        ValueError, match="kv_offload_bytes=5000 exceeds the host memory available to this rank \\(4000"
    ):
        host_slots_for(5000, 100, available=4000)
    with pytest.raises(ValueError, match="holds no KV block of 100 bytes"):
        host_slots_for(99, 100, available=None)
    assert host_slots_for(1000, 100, available=4000) == 10


def _conversations(model_dir, turns: int = 4, **engine) -> tuple[list[list[int]], object, object, str]:
    """16 conversations whose histories outgrow a 120-block device cache, turn by turn: greedy outputs, the
    scheduler's counters, the host tier and the metrics."""
    import random

    from pagerail import LLM
    from pagerail.common.sampling_params import SamplingParams

    rng = random.Random(0)
    histories = [[rng.randrange(3, 240) for _ in range(40 + 6 * i)] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=120, max_num_batched_tokens=256, **engine)
    outputs = []
    for turn in range(turns):
        for history, result in zip(histories, llm.generate(histories, params), strict=True):
            tokens = list(result.outputs[0].token_ids)
            outputs.append(tokens)
            history.extend(tokens + [5 + turn, 6, 7, 8, 9, 10])
    engine = llm.engine
    metrics = engine.metrics_text().decode()
    llm.shutdown()
    return outputs, engine.scheduler.stats, engine.block_table.host_tier, metrics


def test_a_conversation_workload_loads_its_history_instead_of_recomputing_it(tmp_path) -> None:
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "llama")
    plain, before, _, _ = _conversations(model_dir)
    tiered, after, tier, metrics = _conversations(model_dir, kv_offload_bytes=1 << 22)
    assert tiered == plain
    assert tier is not None and tier.num_offloaded > 100 and tier.num_loaded > 100
    assert after.num_host_hit_tokens > 3000
    assert after.num_computed_tokens < before.num_computed_tokens - after.num_host_hit_tokens // 2
    assert "pagerail_prefix_cache_host_hits_total{model_name=" in metrics
    assert 'direction="load"' in metrics and "pagerail_kv_offload_transfer_bytes_total" in metrics


def test_a_failed_step_empties_the_host_tier(monkeypatch) -> None:
    """The ranks restart with empty host memory, so nothing the tier listed may be loaded after a failure."""
    from tests.test_engine_recovery import FakeGroup, make_engine, run

    group = FakeGroup(256, failures=[9])
    group.num_host_blocks = 16
    resets = []
    monkeypatch.setattr(HostKvTier, "reset", lambda self: resets.append(self) or HostKvTier._reset(self))
    engine = make_engine(group)
    assert engine.block_table.host_tier is not None
    created = len(resets)
    run(engine)
    assert engine.num_restarts == 1 and len(resets) == created + 1


def test_blocks_still_arriving_are_neither_found_nor_evicted() -> None:
    tier = HostKvTier(2)
    chain = lambda parent, tokens: hash((parent, tokens))  # noqa: E731
    first = chain(0, (1, 2))
    assert tier.inject(first, 0, (1, 2), ready=False) == 0
    assert tier.match([1, 2, 3], 0, 0, 2, chain) == []  # not findable while its KV arrives
    tier.store(5, block_hash=77, parent_hash=0, token_ids=(8, 9))  # takes the free slot
    tier.store(6, block_hash=78, parent_hash=0, token_ids=(8, 8))  # evicts 77, never the arriving block
    assert [entry.slot for entry in tier._entries.values()] == [0, 1]
    tier.settle([first], arrived=True)
    assert [block.slot for block in tier.match([1, 2, 3], 0, 0, 2, chain)] == [0]
    second = chain(0, (4, 4))
    slot = tier.inject(second, 0, (4, 4), ready=False)
    tier.settle([second], arrived=False)  # the transfer failed: forgotten, its slot free again
    assert second not in tier._entries and slot in tier._free_slots
