"""The router's exact index follows replicas' block events: a stateful property test over stored / removed /
cleared events, reads that fall behind a replica's event window, replica death and rejoin (a restarted engine, a
new epoch), against a model of what each replica holds; then the engine's events and the routed client."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagerail.cluster.core.kv_events import DEVICE, HOST, KvEventLog
from pagerail.cluster.routing.kv_event_index import KvEventIndex

BLOCK = 2
REPLICAS = ("a", "b", "c")
TIERS = (DEVICE, HOST)
# Prompts sharing prefixes: their chained block hashes are what replicas store.
PROMPTS = ([1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 4, 4], [1, 1, 5, 5], [6, 6, 7, 7, 8, 8])
INDEX = KvEventIndex(BLOCK)
HASHES = sorted({h for prompt in PROMPTS for h in INDEX.block_hashes(prompt)})


class EventIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = KvEventIndex(BLOCK, recent_s=0)
        # The replicas' logs (a small window, so readers fall behind) and what each truly holds.
        self.logs = {name: KvEventLog(window=6) for name in REPLICAS}
        self.truth = {name: {tier: set() for tier in TIERS} for name in REPLICAS}
        self.live = set(REPLICAS)  # replicas the router follows

    @rule(replica=st.sampled_from(REPLICAS), block=st.sampled_from(HASHES), tier=st.sampled_from(TIERS))
    def store(self, replica: str, block: int, tier: str) -> None:
        if block not in self.truth[replica][tier]:  # a table stores a hash it does not hold
            self.truth[replica][tier].add(block)
            self.logs[replica].stored(block, tier)

    @rule(replica=st.sampled_from(REPLICAS), block=st.sampled_from(HASHES), tier=st.sampled_from(TIERS))
    def remove(self, replica: str, block: int, tier: str) -> None:
        if block in self.truth[replica][tier]:
            self.truth[replica][tier].discard(block)
            self.logs[replica].removed(block, tier)

    @rule(replica=st.sampled_from(REPLICAS), tier=st.sampled_from(TIERS))
    def clear(self, replica: str, tier: str) -> None:
        """The replica's workers restarted: the block table forgets a tier."""
        self.truth[replica][tier].clear()
        self.logs[replica].cleared(tier)

    @rule(replica=st.sampled_from(REPLICAS))
    def read(self, replica: str) -> None:
        if replica in self.live:
            epoch, seq = self.index.position(replica)
            self.index.apply(replica, self.logs[replica].since(epoch, seq))

    @rule(replica=st.sampled_from(REPLICAS))
    def dies(self, replica: str) -> None:
        """The replica's head died: the router forgets it; it comes back as a new engine, empty."""
        self.index.remove_replica(replica)
        self.live.discard(replica)
        self.logs[replica] = KvEventLog(window=6)
        self.truth[replica] = {tier: set() for tier in TIERS}

    @rule(replica=st.sampled_from(REPLICAS))
    def rejoins(self, replica: str) -> None:
        self.live.add(replica)

    def _caught_up(self) -> None:
        for replica in self.live:
            self.read(replica)

    @invariant()
    def after_reading_every_replica_the_index_is_exact(self) -> None:
        self._caught_up()
        for replica in REPLICAS:
            expected = {}
            if replica in self.live:
                for tier, bit in ((DEVICE, 1), (HOST, 2)):
                    for block in self.truth[replica][tier]:
                        expected[block] = expected.get(block, 0) | bit
            assert self.index.holds(replica) == expected
        for prompt in PROMPTS:
            hashes = self.index.block_hashes(prompt)
            want = {}
            for replica in self.live:
                held = self.truth[replica][DEVICE] | self.truth[replica][HOST]
                run = 0
                while run < len(hashes) and hashes[run] in held:
                    run += 1
                if run:
                    want[replica] = run * BLOCK
            assert self.index.match(prompt) == want


TestEventIndexMachine = EventIndexMachine.TestCase
TestEventIndexMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


def test_a_reader_behind_the_window_or_from_another_epoch_gets_a_snapshot() -> None:
    log = KvEventLog(window=3)
    for block in (1, 2, 3):
        log.stored(block, DEVICE)
    first = log.since(None, 0)
    assert first["snapshot"] == {DEVICE: [1, 2, 3], HOST: []} and first["seq"] == 3
    log.removed(2, DEVICE)
    assert log.since(first["epoch"], 3)["events"] == [("removed", 2, DEVICE)]
    for block in (4, 5, 6):
        log.stored(block, HOST)
    behind = log.since(first["epoch"], 3)  # events 4..7 exist, the window holds 5..7
    assert "events" not in behind and behind["snapshot"] == {DEVICE: [1, 3], HOST: [4, 5, 6]}
    assert "snapshot" in KvEventLog().since(first["epoch"], 3)  # a restarted replica: a new epoch


def test_recent_sends_count_until_they_expire() -> None:
    now = [0.0]
    index = KvEventIndex(BLOCK, recent_s=5.0, clock=lambda: now[0])
    index.insert("a", PROMPTS[0])
    assert index.match(PROMPTS[1]) == {"a": 4}
    now[0] = 6.0
    assert index.match(PROMPTS[1]) == {}


def test_the_engine_publishes_its_block_events(tmp_path) -> None:
    """A real engine: the blocks its prompts filled are stored on the device, evicted ones move to the host tier,
    and the index built from its events matches what its block table finds."""
    from pagerail import LLM
    from pagerail.common.sampling_params import SamplingParams
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "llama")
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=24, kv_offload_bytes=1 << 20)
    index = KvEventIndex(4, recent_s=0)
    prompts = [[10 + i] * 4 + list(range(20 + i, 50 + i)) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for prompt in prompts:
        llm.generate([prompt], params)
        index.apply("r", llm.engine.kv_events.since(*index.position("r")))
    table = llm.engine.block_table
    holds = index.holds("r")
    assert set(table._cached) == {h for h, bits in holds.items() if bits & 1}
    assert set(table.host_tier._entries) == {h for h, bits in holds.items() if bits & 2}
    assert any(bits & 2 for bits in holds.values())
    for prompt in prompts:
        device = len(table.find_cached_prefix(prompt + [0]))
        host = len(table.find_host_prefix(prompt + [0], table.find_cached_prefix(prompt + [0])))
        assert index.match(prompt).get("r", 0) == (device + host) * 4
    llm.shutdown()


def test_the_footprint_grows_with_each_send_before_any_event() -> None:
    """Prefix-aware routing spreads unseen prompts by footprint: it must count what was just sent."""
    now = [0.0]
    index = KvEventIndex(BLOCK, recent_s=5.0, clock=lambda: now[0])
    index.insert("a", PROMPTS[0])
    index.insert("a", PROMPTS[1])  # shares its first two blocks with the first
    assert index.held("a") == 4 and index.held("b") == 0
    now[0] = 6.0
    index.match(PROMPTS[0])  # expires the hints
    assert index.held("a") == 0
