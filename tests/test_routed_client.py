"""One engine client over several in-process replicas: failover with no token lost or repeated, spill when a replica
is full, abort and sessions on the replica holding the request, and metrics labelled per replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest, SiblingGroup
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.core.local_client import LocalEngineClient
from pagerail.cluster.routing.failover import ReplicaFailed
from pagerail.cluster.routing.routed_client import RoutedEngineClient
from pagerail.cluster.routing.router import NoReplicaError
from pagerail.cluster.routing.router_metrics import with_label
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from tests.fake_workers import FakeKVWorkers, next_token

VOCAB = 250
NAMES = ("r0", "r1", "r2")


class Recorder:
    """A replica client that notes which request ids reach it, and can die as a head actor does: every stream
    breaks once one of them has delivered `die_after` deltas, and later calls fail."""

    def __init__(self, inner: LocalEngineClient, die_after: int | None = None) -> None:
        self.inner = inner
        self.model_name, self.max_model_len, self.vocab_size = inner.model_name, inner.max_model_len, inner.vocab_size
        self.eos_token_ids = inner.eos_token_ids
        self.die_after = die_after
        self.refuse_after_s: float | None = None  # refuse every request as full, this long after it came
        self.dead = False
        self.calls: list[tuple[str, str]] = []

    def _check(self) -> None:
        if self.dead:
            raise ReplicaFailed("the replica's actor died")

    async def generate(self, request: EngineRequest):
        self.calls.append(("generate", request.request_id))
        self._check()
        if self.refuse_after_s is not None:
            await asyncio.sleep(self.refuse_after_s)
            raise QueueFullError("full", retry_after_s=2.0)
        count = 0
        async for delta in self.inner.generate(request):
            self._check()
            yield delta
            count += 1
            if self.die_after is not None and count >= self.die_after:
                self.dead = True
                self._check()

    async def append_input(self, request_id, token_ids, final):
        self.calls.append(("append", request_id))
        self._check()
        await self.inner.append_input(request_id, token_ids, final)

    async def abort(self, request_id, stopped=False):
        self.calls.append(("abort", request_id))
        await self.inner.abort(request_id, stopped)

    async def is_ready(self):
        return not self.dead

    async def pause(self, mode):
        await self.inner.pause(mode)

    async def resume(self):
        await self.inner.resume()

    async def stats(self):
        self._check()
        return await self.inner.stats()

    async def metrics(self):
        self._check()
        return await self.inner.metrics()

    async def kv_events(self, epoch, seq):
        self._check()
        return await self.inner.kv_events(epoch, seq)

    def ids(self, method: str = "generate") -> set[str]:
        return {request_id for kind, request_id in self.calls if kind == method}


@pytest.fixture
def replicas():
    """Three fake-rank replicas, each with its engine; two settings come from the test through `make`."""
    engines: list[AsyncEngine] = []

    def make(max_waiting_requests: int | None = None, die_after: dict[str, int] | None = None):
        built = {}
        for name in NAMES:
            workers = FakeKVWorkers(256, 16, VOCAB, step_delay_s=0.002)
            scheduler = SchedulerConfig(max_num_batched_tokens=256, max_waiting_requests=max_waiting_requests)
            config = EngineConfig(cache=CacheConfig(block_size=16), scheduler=scheduler)
            core = EngineCore(config, workers, max_model_len=1024, vocab_size=VOCAB, eos_token_ids=[VOCAB - 1])
            core.restart_backoff_s = 0.0
            engine = AsyncEngine(core)
            engines.append(engine)
            built[name] = Recorder(LocalEngineClient(engine, "fake"), (die_after or {}).get(name))
        return built

    yield make
    for engine in engines:
        engine.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def clean_run(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens a replica that never fails produces for this prompt (the fake ranks' sampler)."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(next_token(sequence, VOCAB))
    return sequence[len(prompt) :]


async def collect(stream: AsyncIterator[RequestDelta], num_prompt: int | None) -> tuple[list[int], RequestDelta]:
    """Every token of a stream, checking that the counts each delta reports run on without a gap (and that the
    prompt length stays `num_prompt`; a session's grows)."""
    tokens: list[int] = []
    last = None
    async for delta in stream:
        tokens.extend(delta.token_ids)
        assert delta.num_output_tokens == len(tokens), (delta, len(tokens))
        assert num_prompt is None or delta.num_prompt_tokens == num_prompt
        last = delta
    return tokens, last


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def test_a_replica_dying_mid_stream_loses_and_repeats_no_token(replicas):
    clients = replicas(die_after={"r0": 4})
    routed = RoutedEngineClient(clients, policy="round-robin")
    prompts = {f"req{i}": [3 + (i * 7 + j) % 200 for j in range(20 + i)] for i in range(6)}

    async def scenario():
        results = await asyncio.gather(
            *(
                collect(routed.generate(EngineRequest(rid, prompt, greedy(24))), len(prompt))
                for rid, prompt in prompts.items()
            )
        )
        return dict(zip(prompts, results, strict=True)), await routed.stats(), await routed.metrics()

    results, stats, metrics = run(scenario())
    moved = clients["r0"].ids()
    assert moved and all(rid in clients["r1"].ids() | clients["r2"].ids() for rid in moved)
    for rid, (tokens, last) in results.items():
        assert tokens == clean_run(prompts[rid], 24), rid
        assert (last.finished, last.finish_reason, last.error) == (True, "length", None)
    assert not routed.router.routable("r0")
    assert stats["router"]["replicas"]["r0"]["healthy"] is False and stats["router"]["num_failovers"] >= 1
    assert 'pagerail_router_failovers_total{model_name="fake",replica="r0"}' in metrics
    assert 'reason="failover"' in metrics
    # Its stats fail, so a refresh keeps it out; the others stay in.
    run(routed.refresh_loads())
    assert routed.router.in_rotation() == ["r1", "r2"]


def test_a_request_whose_replica_dies_while_no_other_is_in_rotation_waits_for_one(replicas):
    """r0 dies mid-stream while r1 and r2 are drained: the half-finished request waits until one is back and ends
    exactly; with nothing back within resume_wait_s it ends with a retriable error instead of hanging."""
    prompt = [5 + j for j in range(20)]

    async def scenario(wait_s: float, back: str | None):
        clients = replicas(die_after={"r0": 4})
        routed = RoutedEngineClient(clients, policy="round-robin")
        routed.resume_wait_s = wait_s
        routed.set_in_rotation("r1", False)
        routed.set_in_rotation("r2", False)
        result = asyncio.create_task(collect(routed.generate(EngineRequest("q", prompt, greedy(24))), len(prompt)))
        while not clients["r0"].ids() or routed.router.routable("r0"):  # until r0 has died under it
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not result.done()
        if back is not None:
            routed.set_in_rotation(back, True)
        return await result, clients

    (tokens, last), clients = run(scenario(30.0, "r2"))
    assert tokens == clean_run(prompt, 24) and (last.finish_reason, last.error) == ("length", None)
    assert "q" in clients["r2"].ids()
    (tokens, last), _ = run(scenario(0.5, None))
    assert last.finish_reason == "abort" and "no replica" in last.error and len(tokens) < 24


def test_a_request_moved_off_a_draining_replica_waits_while_the_others_are_full(replicas):
    """r0 is drained while it streams a request and r1, r2 refuse everything as full: the moved request waits
    (as a failed-over one does) and ends exactly once r2 takes it, instead of ending aborted."""
    prompt = [7 + j for j in range(20)]

    async def scenario():
        clients = replicas()
        routed = RoutedEngineClient(clients, policy="round-robin")
        routed.resume_wait_s = 30.0
        for name in ("r1", "r2"):
            clients[name].refuse_after_s = 0.0
        result = asyncio.create_task(collect(routed.generate(EngineRequest("m", prompt, greedy(60))), len(prompt)))
        while "m" not in routed.open_on("r0"):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert await routed.moves.drain("r0") == 1
        await asyncio.sleep(0.3)
        assert not result.done()  # refused by both others, it waits instead of ending
        clients["r2"].refuse_after_s = None
        return await result, clients

    (tokens, last), clients = run(scenario())
    assert tokens == clean_run(prompt, 60) and (last.finish_reason, last.error) == ("length", None)
    assert "m" in clients["r2"].ids()


def test_an_engine_whose_workers_give_up_hands_its_request_to_another_replica(replicas):
    clients = replicas()
    engine = clients["r0"].inner._engine
    engine.engine.max_restarts = 0  # the first worker failure fails the request with a retriable error
    routed = RoutedEngineClient(clients, policy="round-robin")
    prompt = list(range(10, 50))

    async def scenario():
        tokens: list[int] = []
        async for delta in routed.generate(EngineRequest("w", prompt, greedy(30))):
            tokens.extend(delta.token_ids)
            assert delta.num_output_tokens == len(tokens) and not delta.error
            if len(tokens) >= 5 and not engine.engine.num_restarts:
                engine.engine.executor.fail_next = "worker"
        healthy_before_refresh = routed.router.routable("r0")
        await routed.refresh_loads()
        return tokens, healthy_before_refresh

    tokens, healthy_before_refresh = run(scenario())
    assert tokens == clean_run(prompt, 30)
    assert "w" in clients["r1"].ids()
    # Out of rotation after the failure; the replica still answers, so the next refresh takes it back.
    assert not healthy_before_refresh and routed.router.routable("r0")


def test_a_full_replica_spills_to_another_and_all_full_is_queue_full(replicas):
    clients = replicas(max_waiting_requests=1)
    routed = RoutedEngineClient(clients, policy="round-robin")

    async def hold(name: str, request_id: str):
        """Fill a paused replica's one waiting place, bypassing the router."""
        stream = clients[name].inner.generate(EngineRequest(request_id, [1, 2, 3], greedy(2)))
        return asyncio.ensure_future(collect(stream, 3))

    async def scenario():
        await clients["r0"].pause("new")
        fillers = [await hold("r0", "fill-r0")]
        await asyncio.sleep(0.05)
        tokens, _ = await collect(routed.generate(EngineRequest("spilled", [5] * 20, greedy(8))), 20)
        for name in ("r1", "r2"):
            await clients[name].pause("new")
            fillers.append(await hold(name, f"fill-{name}"))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError, match="all 3 replicas"):
            await anext(routed.generate(EngineRequest("refused", [6] * 20, greedy(8))))
        await routed.resume()
        await asyncio.gather(*fillers)
        return tokens, await routed.metrics()

    tokens, metrics = run(scenario())
    assert tokens == clean_run([5] * 20, 8)
    assert "spilled" in clients["r0"].ids() and "spilled" in clients["r1"].ids()
    assert 'pagerail_router_requests_total{model_name="fake",reason="spill",replica="r1"} 1.0' in metrics
    assert routed.router.in_rotation() == list(NAMES)  # full is not failed
    assert all(state.in_flight == 0 for state in routed.router.replicas.values())


def test_abort_reaches_the_replica_holding_the_request_and_frees_its_blocks(replicas):
    clients = replicas()
    routed = RoutedEngineClient(clients)

    async def scenario():
        stream = routed.generate(EngineRequest("long", list(range(1, 40)), greedy(500)))
        tokens, last = [], None
        async for delta in stream:
            tokens.extend(delta.token_ids)
            last = delta
            if len(tokens) == 3:
                await routed.abort("long")
        return last

    last = run(scenario())
    assert last.finish_reason == "abort"
    holders = [name for name in NAMES if "long" in clients[name].ids("abort")]
    assert len(holders) == 1 and "long" in clients[holders[0]].ids()
    core = clients[holders[0]].inner._engine.engine
    assert core.block_table.num_free_blocks == core.block_table.num_blocks
    assert core.scheduler.stats.num_aborted == 1
    run(routed.abort("unknown"))  # no holder: nothing happens


def test_sessions_stay_on_their_replica_and_fail_with_it(replicas):
    clients = replicas(die_after={"r1": 1})
    routed = RoutedEngineClient(clients, policy="round-robin")

    async def session(request_id: str, chunks: list[list[int]]):
        stream = routed.generate(EngineRequest(request_id, [7] * 10, greedy(6), final=False))
        task = asyncio.ensure_future(collect(stream, None))
        await asyncio.sleep(0)
        for chunk in chunks:
            await routed.append_input(request_id, chunk, False)
        await routed.append_input(request_id, [], True)
        return await asyncio.gather(task, return_exceptions=True)

    (first,) = run(session("s0", [[8] * 5, [9] * 5]))  # round robin: r0
    tokens, last = first
    assert last.finish_reason == "length" and len(tokens) == 6
    assert [name for name in NAMES if "s0" in clients[name].ids("append")] == ["r0"]
    # A replica that refuses the session only after some chunks were sent there: they are replayed, in order.
    clients["r1"].refuse_after_s = 0.05
    (moved,) = run(session("s-moved", [[8] * 5, [9] * 5, [10] * 3]))
    tokens, last = moved
    assert tokens == clean_run([7] * 10 + [8] * 5 + [9] * 5 + [10] * 3, 6) and last.finish_reason == "length"
    assert "s-moved" in clients["r1"].ids("append") and "s-moved" in clients["r2"].ids("append")
    clients["r1"].refuse_after_s = None
    routed.set_in_rotation("r0", False)  # the next session goes to r1 again
    routed.set_in_rotation("r2", False)
    (second,) = run(session("s1", [[8] * 5]))  # r1, which dies after its first delta
    assert isinstance(second, ReplicaFailed) and "session" in str(second)
    assert [name for name in NAMES if "s1" in clients[name].ids()] == ["r1"]  # no failover for sessions
    with pytest.raises(ValueError, match="not an open streaming-input session"):
        run(routed.append_input("s1", [1], True))

    # A chunk that finds the replica dead gets the session's error, as the stream does, not the transport's.
    routed.set_in_rotation("r0", True)

    async def chunk_after_death():
        stream = routed.generate(EngineRequest("s2", [7] * 10, greedy(6), final=False))
        task = asyncio.ensure_future(collect(stream, None))
        while "s2" not in clients["r0"].ids():
            await asyncio.sleep(0.01)
        clients["r0"].dead = True
        with pytest.raises(ReplicaFailed, match="failed during streaming-input session 's2'.*open a new one"):
            await routed.append_input("s2", [8] * 5, False)
        task.cancel()  # the caller gives up on the session, which ends it at the replica
        await asyncio.gather(task, return_exceptions=True)

    run(chunk_after_death())


def test_sibling_choices_share_a_replica_while_any_is_open(replicas):
    clients = replicas()
    routed = RoutedEngineClient(clients, policy="round-robin")
    prompt = [4, 5, 6]  # shorter than a block: only the pin can keep them together

    async def scenario():
        siblings = [
            EngineRequest(f"cmpl-abc-{i}", prompt, greedy(10), group=SiblingGroup("cmpl-abc", i, 4)) for i in range(4)
        ]
        streams = [collect(routed.generate(request), 3) for request in siblings]
        # Named like a fifth sibling, but no group says so: ids are labels, never parsed.
        other = collect(routed.generate(EngineRequest("cmpl-abc-4", prompt, greedy(10))), 3)
        return await asyncio.gather(*streams, other), await routed.metrics()

    results, metrics = run(scenario())
    holders = {name for name in NAMES if clients[name].ids() & {f"cmpl-abc-{i}" for i in range(4)}}
    assert len(holders) == 1
    assert f'reason="pinned",replica="{holders.pop()}"}} 3.0' in metrics
    assert all(tokens == clean_run(prompt, 10) for tokens, _ in results)
    assert not routed._pins


def test_bad_input_passes_through_and_leaves_the_replica_in_rotation(replicas):
    routed = RoutedEngineClient(replicas())

    async def scenario():
        with pytest.raises(ValueError, match="prompt token ids"):
            await anext(routed.generate(EngineRequest("bad", [1, VOCAB + 5], greedy(2))))
        with pytest.raises(ValueError, match="prompt_token_ids must be ints"):
            EngineRequest("bad", ["x"] * 20, greedy(2))
        first = routed.generate(EngineRequest("dup", [1, 2], greedy(50)))
        await anext(first)
        with pytest.raises(ValueError, match="already in use"):
            await anext(routed.generate(EngineRequest("dup", [1, 2], greedy(2))))
        await first.aclose()
        for name in NAMES:
            routed.set_in_rotation(name, False)
        with pytest.raises(NoReplicaError, match="no replica is in rotation"):
            await anext(routed.generate(EngineRequest("none", [1, 2], greedy(2))))
        return await routed.is_ready()

    assert run(scenario()) is False
    assert routed.router.in_rotation() == [] and routed.num_failovers == 0
    assert all(state.in_flight == 0 for state in routed.router.replicas.values())


def test_metrics_label_every_engine_sample_with_its_replica_and_parse(replicas):
    routed = RoutedEngineClient(replicas(), policy="round-robin")

    async def scenario():
        await asyncio.gather(
            *(collect(routed.generate(EngineRequest(f"m{i}", [i + 1] * 40, greedy(4))), 40) for i in range(3))
        )
        await routed.refresh_loads()
        return await routed.metrics(), await routed.stats()

    text, stats = run(scenario())
    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), "a family is declared twice"
    engine_samples = [s for f in families if not f.name.startswith("pagerail_router_") for s in f.samples]
    assert engine_samples and all(sample.labels.get("replica") in NAMES for sample in engine_samples)
    assert {s.labels["replica"] for s in engine_samples} == set(NAMES)
    router = {f.name: f for f in families if f.name.startswith("pagerail_router_")}
    assert {
        "pagerail_router_requests",
        "pagerail_router_estimated_cached_tokens",
        "pagerail_router_cached_tokens",
        "pagerail_router_routing_seconds",
        "pagerail_router_failovers",
        "pagerail_router_replicas_in_rotation",
    } <= set(router)
    rotation = router["pagerail_router_replicas_in_rotation"].samples
    assert [sample.value for sample in rotation] == [3.0]
    assert stats["num_unfinished"] == 0 and set(stats["replicas"]) == set(NAMES)
    assert stats["router"]["num_in_rotation"] == 3


def test_a_caller_that_leaves_early_aborts_the_request_at_its_replica(replicas):
    clients = replicas()
    routed = RoutedEngineClient(clients, policy="round-robin")

    async def scenario():
        stream = routed.generate(EngineRequest("gone", list(range(1, 40)), greedy(500)))
        await anext(stream)
        await stream.aclose()
        core = clients["r0"].inner._engine.engine
        for _ in range(200):  # the engine thread applies the abort on its next turn
            if core.scheduler.stats.num_aborted:
                break
            await asyncio.sleep(0.01)
        return core

    core = run(scenario())
    assert core.scheduler.stats.num_aborted == 1 and not core.has_unfinished()
    assert core.block_table.num_free_blocks == core.block_table.num_blocks
    assert routed.router.replicas["r0"].in_flight == 0 and not routed._open


@pytest.mark.parametrize("policy", ["prefix-aware", "round-robin"])
def test_requests_sharing_a_prefix_find_it_cached_where_the_router_sent_them(replicas, policy):
    clients = replicas()
    routed = RoutedEngineClient(clients, policy=policy)
    system = [11 + i % 200 for i in range(96)]  # six blocks every request shares

    async def scenario():
        for user in range(6):  # one after another: each finds what the previous ones left
            await collect(routed.generate(EngineRequest(f"u{user}", system + [user + 1] * 9, greedy(3))), 105)
        return await routed.metrics()

    families = {f.name: f for f in text_string_to_metric_families(run(scenario()))}
    actual = {
        s.labels["replica"]: s.value
        for s in families["pagerail_router_cached_tokens"].samples
        if s.name.endswith("_total")
    }
    estimated = {
        s.labels["replica"]: s.value
        for s in families["pagerail_router_estimated_cached_tokens"].samples
        if s.name.endswith("_total")
    }
    if policy == "prefix-aware":
        # The first request goes anywhere; the five after it follow the prefix and find all six blocks cached.
        assert sum(actual.values()) == 5 * 96 and len(actual) == 1
        assert estimated == actual
    else:
        # Round robin: only the requests that come back to a replica find it there.
        assert sum(actual.values()) == 3 * 96


def test_merged_expositions_declare_each_family_once_with_every_sample_labelled():
    text = (
        "# HELP up Whether it runs.\n# TYPE up gauge\nup 1.0\n"
        '# HELP hits_total Hits.\n# TYPE hits_total counter\nhits_total{kind="a b"} 2.0\nhits_total{} 3.0\n'
        "# an ordinary comment\nloose_sample 4.0 1700000000000\n"
    )
    merged = with_label({"r0": text, "r1": text.replace("1.0", "0.0")})
    assert merged.count("# TYPE up gauge") == 1 and merged.count("# HELP hits_total") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert [(s.labels, s.value) for s in families["up"].samples] == [({"replica": "r0"}, 1.0), ({"replica": "r1"}, 0.0)]
    assert {"replica": "r1", "kind": "a b"} in [s.labels for s in families["hits"].samples]
    # The parser reads each untyped sample as a family of its own.
    loose = [s.labels for f in text_string_to_metric_families(merged) for s in f.samples if s.name == "loose_sample"]
    assert loose == [{"replica": "r0"}, {"replica": "r1"}]
    assert with_label({}) == ""


def test_refresh_feeds_reported_load_and_takes_out_a_replica_that_hangs(replicas):
    clients = replicas()
    routed = RoutedEngineClient(clients, policy="least-loaded")

    async def hang():
        await asyncio.sleep(30)

    async def scenario():
        busy = asyncio.ensure_future(collect(clients["r0"].generate(EngineRequest("busy", [1, 2, 3], greedy(400))), 3))
        await asyncio.sleep(0.05)
        clients["r2"].stats = hang
        await routed.refresh_loads(timeout_s=0.2)
        in_rotation, load = routed.router.in_rotation(), routed.router.replicas["r0"].running
        del clients["r2"].stats  # it answers again
        await routed.refresh_loads()
        busy.cancel()
        return in_rotation, load

    in_rotation, load = run(scenario())
    assert in_rotation == ["r0", "r1"] and load == 1
    assert routed.router.in_rotation() == list(NAMES)


def test_the_routing_decision_is_an_event_on_the_request_span(replicas):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagerail.cluster.routing.routed_client import ROUTE_CACHED_TOKENS, ROUTE_REASON, ROUTE_REPLICA

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    routed = RoutedEngineClient(replicas(), policy="round-robin")
    prompt = list(range(3, 40))

    async def main():
        with tracer.start_as_current_span("request"):
            await collect(routed.generate(EngineRequest("traced", prompt, greedy(3))), len(prompt))

    run(main())
    (span,) = exporter.get_finished_spans()
    (event,) = [event for event in span.events if event.name == "routed"]
    assert event.attributes[ROUTE_REPLICA] in NAMES
    assert event.attributes[ROUTE_REASON] == "round_robin" and event.attributes[ROUTE_CACHED_TOKENS] == 0


def test_routing_on_the_replicas_block_events(replicas):
    """With index="events" the router learns what each replica caches from its block events (read with its load):
    a later request sharing a served prompt's prefix goes where those blocks are, with the exact count, even with
    the router's own send hints off; a replica that dies is forgotten, and read whole again once it answers."""
    clients = replicas()
    routed = RoutedEngineClient(clients, index="events")
    routed.router.index.recent_s = 0  # only the events count
    prompt = [7] * 16 + list(range(20, 84))  # five full blocks of 16

    async def scenario():
        await collect(routed.generate(EngineRequest("first", prompt, greedy(4))), len(prompt))
        served = next(name for name in NAMES if clients[name].ids() == {"first"})
        await routed.refresh_loads()
        assert routed.router.index.match(prompt) == {served: 80}
        route = routed.router.rank(prompt[:48] + [1, 2, 3])[0]
        assert (route.replica, route.cached_tokens) == (served, 48)
        await collect(routed.generate(EngineRequest("second", prompt[:48] + [1, 2, 3], greedy(2))), 51)
        clients[served].dead = True
        await routed.refresh_loads()  # it does not answer: out of rotation, its holdings still listed
        routed.remove_replica(served)
        assert routed.router.index.match(prompt) == {}
        return served

    served = run(scenario())
    assert clients[served].ids() == {"first", "second"}


def test_a_request_drained_before_its_first_token_moves_instead_of_ending_aborted(replicas):
    """r0 holds every request (paused) when it is drained: the request it just admitted is aborted there before
    its first token, and that abort is the move's, not the caller's. It resumes on another replica and completes."""
    prompt = [11 + j for j in range(20)]

    async def scenario():
        clients = replicas()
        routed = RoutedEngineClient(clients, policy="round-robin")
        await clients["r0"].pause("all")
        result = asyncio.create_task(collect(routed.generate(EngineRequest("m", prompt, greedy(12))), len(prompt)))
        while "m" not in clients["r0"].ids():
            await asyncio.sleep(0.01)
        assert await routed.moves.drain("r0") == 1
        tokens_last = await result
        await clients["r0"].resume()
        return tokens_last, clients

    (tokens, last), clients = run(scenario())
    assert tokens == clean_run(prompt, 12) and (last.finish_reason, last.error) == ("length", None)
    assert "m" in clients["r1"].ids() | clients["r2"].ids()
