"""Adapter affinity across data-parallel replicas: a request for a LoRA adapter goes where that adapter was sent
recently (its device slots likely hold it), balanced against load, so replicas load adapters less often than
when requests are spread in turn."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict

import pytest

from pagerail.cluster.core.block_table import BlockTable, root_hash
from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.kv_events import KvEventLog
from pagerail.cluster.routing.kv_event_index import KvEventIndex
from pagerail.cluster.routing.prefix_index import PrefixIndex
from pagerail.cluster.routing.routed_client import RoutedEngineClient
from pagerail.cluster.routing.router import Router
from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import SamplingParams

SLOTS = 2  # each replica's --max-loras
ADAPTERS = [LoRARequest(f"adapter-{i}", i, f"/adapters/{i}") for i in range(1, 9)]


class SlotReplica:
    """A replica that holds SLOTS adapters on its device, least recently used out, and counts the loads a real
    rank would make (worker/lora.py's rule); each request takes a few event-loop turns."""

    model_name, max_model_len, vocab_size, eos_token_ids = "fake", 1024, 100, (99,)

    def __init__(self) -> None:
        self.slots: OrderedDict[int, None] = OrderedDict()
        self.loads = 0
        self.requests = 0

    async def generate(self, request: EngineRequest):
        self.requests += 1
        lora_id = request.lora.lora_int_id if request.lora is not None else 0
        if lora_id:
            if lora_id not in self.slots:
                self.loads += 1
                if len(self.slots) == SLOTS:
                    self.slots.popitem(last=False)
            self.slots[lora_id] = None
            self.slots.move_to_end(lora_id)
        for _ in range(3):
            await asyncio.sleep(0)
        yield RequestDelta(request.request_id, [7], len(request.prompt_token_ids), 1, True, "length")

    async def abort(self, request_id, stopped=False):
        pass

    async def is_ready(self):
        return True


def loads_with(policy: str, seed: int = 0) -> tuple[int, list[int]]:
    """Adapter loads over both replicas for 400 requests over 8 adapters, 4 at a time; and each one's requests."""
    replicas = {"r0": SlotReplica(), "r1": SlotReplica()}
    routed = RoutedEngineClient(replicas, policy=policy, adapter_slots=SLOTS)
    rng = random.Random(seed)
    # Each client keeps to its adapter for a while (a conversation, a tenant's burst), then moves on.
    streams = [[rng.choice(ADAPTERS)] for _ in range(4)]
    for stream in streams:
        for _ in range(99):
            stream.append(stream[-1] if rng.random() < 0.7 else rng.choice(ADAPTERS))
    params = SamplingParams(max_tokens=1)

    async def client(number: int, adapters: list[LoRARequest]) -> None:
        for turn, adapter in enumerate(adapters):
            request = EngineRequest(f"c{number}-{turn}", [1, 2, 3], params, lora=adapter)
            async for _ in routed.generate(request):
                pass

    async def run() -> None:
        await asyncio.gather(*(client(number, adapters) for number, adapters in enumerate(streams)))

    asyncio.run(asyncio.wait_for(run(), 60))
    return sum(r.loads for r in replicas.values()), [r.requests for r in replicas.values()]


def test_affinity_loads_adapters_less_often_than_round_robin_and_stays_balanced():
    affinity, spread = loads_with("prefix-aware")
    turns, _ = loads_with("round-robin")
    print(
        f"adapter loads for 400 requests over 8 adapters, 2 replicas of 2 slots: affinity {affinity}, "
        f"round-robin {turns}; requests per replica with affinity {spread}"
    )
    assert affinity < turns * 0.8
    assert min(spread) >= 100, "affinity must not pile the work onto one replica"


def test_a_replica_holding_the_adapter_is_preferred_unless_it_is_over_the_balance_threshold():
    router = Router("least-loaded", adapter_slots=2, balance_slack=2.0)
    for name in ("a", "b"):
        router.add_replica(name)
    router.begin("b", [1, 2], lora_id=5)
    first = router.rank([1, 2], lora_id=5)[0]
    assert first.replica == "b" and first.reason == "adapter"
    for _ in range(4):
        router.begin("b", [1, 2], lora_id=5)  # b is now 5 requests deep, a idle: beyond 0 * 1.5 + 2
    assert router.rank([1, 2], lora_id=5)[0].replica == "a"
    # Only the last `adapter_slots` adapters sent there count as held.
    router.begin("b", [1, 2], lora_id=6)
    router.begin("b", [1, 2], lora_id=7)
    for _ in range(5):
        router.end("b")
    assert router.rank([1, 2], lora_id=5)[0].reason == "load"


@pytest.mark.parametrize("slots", [0, -1, True])
def test_adapter_slots_must_be_a_positive_integer(slots):
    with pytest.raises(ValueError, match="adapter_slots"):
        Router(adapter_slots=slots)


def test_kv_events_and_the_router_key_an_adapters_blocks_by_the_adapter():
    """An adapter's blocks reach a replica's KV events under hashes rooted at the adapter (as its block table keys
    them); the router's index, fed by those events, finds the prompt's cached prefix for that adapter only, never
    for the base model or another adapter. So does the router's own prefix index of what it sent."""
    events = KvEventLog()
    table = BlockTable(16, 4, True, None, None, events)
    tokens = list(range(10, 23))  # three full blocks and one token
    assert table.allocate_slots("r", tokens, len(tokens), root=root_hash(3)) is not None
    table.commit_computed("r", tokens, len(tokens))
    followed = KvEventIndex(4)
    followed.apply("a", events.since(None, 0))
    assert followed.match(tokens, followed.block_hashes(tokens, 3)) == {"a": 12}
    assert followed.match(tokens, followed.block_hashes(tokens, 0)) == {}
    assert followed.match(tokens, followed.block_hashes(tokens, 5)) == {}

    for index in (KvEventIndex(4), PrefixIndex(4)):
        router = Router("prefix-aware", block_size=4, index=index, adapter_slots=2)
        router.add_replica("a")
        router.add_replica("b")
        router.begin("b", tokens, lora_id=3)  # b computed the prompt with adapter 3, and holds that adapter
        router.begin("a", tokens, lora_id=4)  # a computed it with adapter 4, and holds that adapter too
        router.begin("a", [1, 2, 3], lora_id=3)  # ... and adapter 3
        router.end("a")
        router.end("a")
        router.end("b")
        best = router.rank(tokens, lora_id=3)[0]
        assert (best.replica, best.reason, best.cached_tokens) == ("b", "adapter", 12), type(index).__name__
        assert router.rank(tokens, lora_id=4)[0].cached_tokens == 12
        assert router.rank(tokens, lora_id=0)[0].cached_tokens == 0  # the base model holds nothing of it
