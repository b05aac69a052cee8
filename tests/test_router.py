"""The data-parallel router and its prefix index: affinity against load, balance, and their invariants under random
interleavings of replicas joining, leaving, failing and requests coming and going."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.routing.prefix_index import PrefixIndex
from pagerail.cluster.routing.router import NoReplicaError, Router

BLOCK = 4
# Without subnormals: a library in the same process may set flush-to-zero, and hypothesis then refuses to draw them.
unit_floats = st.floats(0, 1, allow_subnormal=False)
NAMES = ("r0", "r1", "r2", "r3")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the prefix index ---------------------------------------------------------------------------------------------


def test_match_counts_full_blocks_of_the_longest_prefix_each_replica_was_sent():
    index = PrefixIndex(BLOCK)
    index.insert("a", list(range(10)))  # two full blocks; the last two tokens are not a block
    index.insert("b", list(range(4)) + [99] * 8)
    assert index.match(list(range(12))) == {"a": 8, "b": 4}
    assert index.match([99] * 12) == {}
    assert index.match([0, 1, 2]) == {}


def test_entries_expire_after_the_ttl_and_the_least_recently_used_go_first():
    clock = Clock()
    index = PrefixIndex(BLOCK, max_entries=6, ttl_s=10, clock=clock)
    index.insert("a", list(range(8)))
    clock.now = 5
    index.insert("b", list(range(100, 108)))
    clock.now = 11  # a's entries are past the ttl, b's are not
    assert index.match(list(range(8))) == {}
    assert index.match(list(range(100, 108))) == {"b": 8}
    index.insert("c", list(range(200, 216)))  # four blocks: the bound of six pushes out the oldest
    assert len(index) <= 6
    assert index.match(list(range(200, 216))) == {"c": 16}


def test_a_prefix_survives_the_eviction_of_its_longer_extensions():
    index = PrefixIndex(BLOCK, max_entries=3)
    index.insert("a", list(range(12)))  # three chained blocks
    index.insert("a", list(range(50, 54)))  # one more entry: the deepest block of the first prompt goes
    assert index.match(list(range(12))) == {"a": 8}


def test_remove_replica_forgets_only_that_replica():
    index = PrefixIndex(BLOCK)
    index.insert("a", list(range(8)))
    index.insert("b", list(range(8)))
    index.remove_replica("a")
    assert index.match(list(range(8))) == {"b": 8}
    index.remove_replica("b")
    assert len(index) == 0


def test_long_prompts_are_indexed_up_to_a_bound_and_bad_tokens_are_refused():
    index = PrefixIndex(BLOCK, max_blocks_per_prompt=3)
    assert len(index.block_hashes(list(range(400)))) == 3
    with pytest.raises(ValueError, match="ints"):
        index.block_hashes(["x", 1, 2, 3])
    with pytest.raises(ValueError, match="ints"):
        index.block_hashes([2**70, 1, 2, 3])
    for bad in ({"block_size": 0}, {"max_entries": -1}, {"ttl_s": 0}, {"ttl_s": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PrefixIndex(**{"block_size": BLOCK, **bad})


# -- the router ---------------------------------------------------------------------------------------------------


def make_router(policy: str = "prefix-aware", names=("r0", "r1", "r2"), **kwargs) -> Router:
    router = Router(policy, block_size=BLOCK, **kwargs)
    for name in names:
        router.add_replica(name)
    return router


def test_requests_sharing_a_long_prefix_stay_on_one_replica_until_the_balance_threshold_trips():
    router = make_router(balance_ratio=1.5, balance_slack=2)
    system = list(range(1000, 1064))  # 16 blocks shared by every request
    decisions = []
    for user in range(5):
        prompt = system + [user] * 7
        decision = router.rank(prompt)[0]
        router.begin(decision.replica, prompt)  # all stay open
        decisions.append(decision)
    holder = decisions[0].replica
    assert decisions[0].reason == "load" and decisions[0].cached_tokens == 0
    # Loads 1 and 2 are within min_load (0) * 1.5 + 2: affinity wins, with the whole shared prefix cached.
    assert [(d.replica, d.reason, d.cached_tokens) for d in decisions[1:3]] == [(holder, "prefix", 64)] * 2
    # The holder now has 3 open: the next goes to the least loaded replica, which has none of the prefix.
    assert decisions[3].replica != holder and decisions[3].reason == "balance" and decisions[3].cached_tokens == 0
    # Once the holder's load is back within the threshold, affinity wins again.
    router.end(holder)
    router.end(holder)
    again = router.rank(system + [9] * 7)[0]
    assert again.reason == "prefix" and again.cached_tokens == 64


def test_prefixes_no_replica_holds_spread_evenly_over_the_caches():
    router = make_router()  # three replicas
    # r0 is always the least loaded, yet within the balance threshold the others' small loads do not decide.
    router.set_load("r1", 2, 0, 0.0)
    router.set_load("r2", 2, 0, 0.0)
    rng = random.Random(0)
    prefixes = [[1000 + 100 * p + i for i in range(64)] for p in range(6)]
    order = [p for p in range(6) for _ in range(20)]
    rng.shuffle(order)
    homes: dict[int, set[str]] = {p: set() for p in range(6)}
    for number, p in enumerate(order):
        prompt = prefixes[p] + [number % 50 + 1] * 5
        decision = router.rank(prompt)[0]
        router.begin(decision.replica, prompt)
        router.end(decision.replica)
        homes[p].add(decision.replica)
    # Each prefix lives on one replica, and each replica holds two of the six.
    assert all(len(replicas) == 1 for replicas in homes.values())
    assert sorted(Counter(next(iter(r)) for r in homes.values()).values()) == [2, 2, 2]


def test_the_estimate_never_counts_the_last_prompt_token():
    router = make_router(names=("r0",))
    prompt = list(range(16))  # exactly four blocks: the engine recomputes the last one
    router.begin("r0", prompt)
    assert router.rank(prompt)[0] == ("r0", "prefix", 12)


@pytest.mark.parametrize("policy", ["prefix-aware", "least-loaded", "round-robin"])
def test_unique_prompts_spread_evenly_over_equal_replicas(policy):
    rng = random.Random(7)
    names = ("r0", "r1", "r2", "r3")
    router = make_router(policy, names=names)
    counts: Counter[str] = Counter()
    open_requests: list[str] = []
    for _ in range(200):
        prompt = [rng.randrange(50_000) for _ in range(rng.randrange(1, 200))]
        replica = router.rank(prompt)[0].replica
        router.begin(replica, prompt)
        counts[replica] += 1
        open_requests.append(replica)
        # Requests finish at random: the loads the router sees keep changing.
        for replica in [r for r in open_requests if rng.random() < 0.3]:
            open_requests.remove(replica)
            router.end(replica)
    mean = 200 / len(names)
    assert max(counts.values()) <= 1.3 * mean, counts


def test_round_robin_cycles_and_skips_replicas_out_of_rotation():
    router = make_router("round-robin")
    assert [router.rank([1])[0].replica for _ in range(6)] == ["r0", "r1", "r2"] * 2
    router.set_in_rotation("r1", False)
    assert [router.rank([1])[0].replica for _ in range(4)] == ["r0", "r2"] * 2
    router.set_healthy("r0", False)
    assert {router.rank([1])[0].replica for _ in range(3)} == {"r2"}


def test_ties_go_to_the_lower_reported_load_and_kv_usage_counts():
    router = make_router("least-loaded")
    router.set_load("r0", running=3, waiting=1, kv_usage=0.0)
    router.set_load("r1", running=0, waiting=0, kv_usage=0.9)
    router.set_load("r2", running=0, waiting=0, kv_usage=0.1)
    assert [route.replica for route in router.rank([1, 2, 3])] == ["r2", "r1", "r0"]
    assert [route.reason for route in router.rank([1, 2, 3])] == ["load", "spill", "spill"]


def _wave(router: Router, size: int) -> list[str]:
    """Route `size` prompts no replica holds, each begun where it went; the replicas chosen, in order."""
    chosen = []
    for number in range(size):
        replica = router.rank([7000 + number, 1, 2, 3])[0].replica
        router.begin(replica, [7000 + number, 1, 2, 3])
        chosen.append(replica)
    return chosen


def test_a_report_that_aged_after_the_requests_ended_does_not_steer_the_next_wave():
    router = make_router("least-loaded", names=("r0", "r1"))
    first = _wave(router, 10)
    assert sorted(first) == ["r0"] * 5 + ["r1"] * 5
    # Both replicas report the wave while it runs: its requests are this router's own, counted once.
    router.set_load("r0", running=5, waiting=0, kv_usage=0.0)
    router.set_load("r1", running=3, waiting=2, kv_usage=0.0)
    assert router.load("r0") == router.load("r1") == 5
    for replica in first:
        router.end(replica)
    # r0 reports again once idle; r1's report is still the one from during the wave.
    router.set_load("r0", running=0, waiting=0, kv_usage=0.0)
    second = _wave(router, 10)
    assert second.count("r0") == second.count("r1") == 5, second


def test_load_the_replica_reports_beyond_this_routers_own_counts():
    # Another frontend keeps 6 requests on r0: this router sends its own to r1 until the loads meet.
    router = make_router("least-loaded", names=("r0", "r1"))
    router.set_load("r0", running=4, waiting=2, kv_usage=0.0)
    assert _wave(router, 6) == ["r1"] * 6
    assert router.load("r0") == router.load("r1") == 6
    # The next report from r0 holds this router's requests that have reached it too; still 6 beyond them.
    router.begin("r0", [1])
    router.set_load("r0", running=7, waiting=0, kv_usage=0.0)
    assert router.load("r0") == 7
    # A report that does not yet hold requests this router just sent there never counts below them.
    router.set_load("r1", running=2, waiting=0, kv_usage=0.0)
    assert router.load("r1") == 6


def test_no_replica_in_rotation_is_a_clear_retryable_error():
    router = make_router(names=("r0",))
    router.set_in_rotation("r0", False)
    with pytest.raises(NoReplicaError, match="no replica is in rotation") as caught:
        router.rank([1, 2, 3])[0]
    assert isinstance(caught.value, QueueFullError)
    router.set_in_rotation("r0", True)
    with pytest.raises(NoReplicaError, match="1 excluded"):
        router.rank([1, 2, 3], exclude={"r0"})[0]


def test_bad_settings_and_names_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="policy"):
        Router("fastest")
    with pytest.raises(ValueError, match="balance_ratio"):
        Router(balance_ratio=0.5)
    with pytest.raises(ValueError, match="balance_slack"):
        Router(balance_slack=float("nan"))
    with pytest.raises(ValueError, match="kv_weight"):
        Router(kv_weight=-1)
    router = make_router(names=("r0",))
    for name in ("", "has space", 'quo"te', "x" * 65, 3):
        with pytest.raises(ValueError, match="replica name"):
            router.add_replica(name)
    with pytest.raises(ValueError, match="already known"):
        router.add_replica("r0")
    with pytest.raises(ValueError, match="unknown replica"):
        router.set_load("nope", 1, 1, 0.5)


# -- invariants under random interleavings ------------------------------------------------------------------------

PREFIXES = [list(range(base, base + 3 * BLOCK)) for base in (0, 100, 200)]
prompts = st.builds(
    lambda prefix, tail: prefix + tail,
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 500), max_size=3 * BLOCK),
)


class RouterMachine(RuleBasedStateMachine):
    """The router never picks a replica out of rotation, counts exactly the requests open at each replica, keeps
    its index bounded, and remembers at once what it was just sent."""

    MAX_ENTRIES = 24

    @initialize(policy=st.sampled_from(["prefix-aware", "least-loaded", "round-robin"]))
    def start(self, policy):
        self.clock = Clock()
        index = PrefixIndex(BLOCK, max_entries=self.MAX_ENTRIES, ttl_s=50, clock=self.clock)
        self.router = Router(policy, index=index, balance_slack=1)
        self.open: list[tuple[str, list[int]]] = []  # (replica, prompt) of each open request

    @rule(name=st.sampled_from(NAMES))
    def add(self, name):
        if name in self.router.replicas:
            with pytest.raises(ValueError):
                self.router.add_replica(name)
        else:
            self.router.add_replica(name)

    @rule(name=st.sampled_from(NAMES))
    def remove(self, name):
        self.router.remove_replica(name)
        self.open = [(replica, prompt) for replica, prompt in self.open if replica != name]

    @precondition(lambda self: self.router.replicas)
    @rule(data=st.data(), in_rotation=st.booleans(), healthy=st.booleans())
    def change_rotation(self, data, in_rotation, healthy):
        name = data.draw(st.sampled_from(sorted(self.router.replicas)))
        self.router.set_in_rotation(name, in_rotation)
        self.router.set_healthy(name, healthy)

    @precondition(lambda self: self.router.replicas)
    @rule(data=st.data(), running=st.integers(0, 20), waiting=st.integers(0, 20), kv=unit_floats)
    def report_load(self, data, running, waiting, kv):
        self.router.set_load(data.draw(st.sampled_from(sorted(self.router.replicas))), running, waiting, kv)

    @rule(prompt=prompts, exclude=st.sets(st.sampled_from(NAMES), max_size=2))
    def route(self, prompt, exclude):
        eligible = {name for name in self.router.in_rotation() if name not in exclude}
        if not eligible:
            with pytest.raises(NoReplicaError):
                self.router.rank(prompt, exclude=exclude)[0]
            return
        ranked = self.router.rank(prompt, exclude=exclude)
        assert {route.replica for route in ranked} == eligible
        replica = ranked[0].replica
        self.router.begin(replica, prompt)
        self.open.append((replica, prompt))
        full = min(len(prompt) // BLOCK, self.MAX_ENTRIES) * BLOCK
        assert self.router.index.match(prompt)[replica] == full

    @precondition(lambda self: self.open)
    @rule(data=st.data(), with_output=st.booleans())
    def finish(self, data, with_output):
        replica, prompt = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        self.router.end(replica, prompt + [7] * 5 if with_output else None)

    @rule(seconds=st.floats(0, 30, allow_subnormal=False))
    def wait(self, seconds):
        self.clock.now += seconds

    @invariant()
    def in_flight_counts_are_the_open_requests(self):
        expected = Counter(replica for replica, _ in self.open)
        for name, state in self.router.replicas.items():
            assert state.in_flight == expected[name] >= 0

    @invariant()
    def the_load_counts_each_open_request_and_at_most_the_last_report_beside_them(self):
        for name, state in self.router.replicas.items():
            requests = self.router.load(name) - self.router.kv_weight * state.kv_usage
            assert state.in_flight <= requests + 1e-9
            assert requests <= state.in_flight + state.running + state.waiting + 1e-9

    @invariant()
    def the_index_stays_bounded(self):
        assert len(self.router.index) <= self.MAX_ENTRIES

    @invariant()
    def each_replica_footprint_counts_the_blocks_it_holds(self):
        index = self.router.index
        counts = Counter(replica for holders in index._entries.values() for replica in holders)
        for name in set(counts) | set(self.router.replicas):
            assert index.held(name) == counts[name]


TestRouterMachine = RouterMachine.TestCase
