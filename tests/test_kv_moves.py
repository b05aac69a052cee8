"""Requests moving between in-process replicas with their KV: the hand-off's checks, live migration off a draining
replica, prefill/decode disaggregation, and the faults of either side; outputs always equal a run that never
moved."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pagerail import LLM
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.kv_handoff import KvHandoff
from pagerail.cluster.routing.failover import ReplicaFailed
from pagerail.cluster.routing.routed_client import RoutedEngineClient
from pagerail.common.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

BLOCK = 4
# The tiny Llama's KV per token: 2 layers x (K and V) x 2 heads x 16 dims x 4 bytes.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("moves") / "llama")


def _llm(model_dir, tier: bool = True) -> LLM:
    return LLM(str(model_dir), block_size=BLOCK, num_gpu_blocks=256, kv_offload_bytes=(1 << 21) if tier else None)


def _reference(model_dir, prompts, params) -> list[list[int]]:
    """The tokens of a replica that never moved anything (its own engine, so no other one caches the prompts)."""
    llm = _llm(model_dir, tier=False)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    llm.shutdown()
    return tokens


def _prompts(count: int) -> list[list[int]]:
    return [list(range(10 + i, 50 + i)) for i in range(count)]  # 40 tokens: 10 full blocks


class Dying:
    """A replica client that fails like a dead head: on export, or after `after` deltas of its streams."""

    def __init__(self, inner, after: int | None = None, export_fails: bool = False) -> None:
        self.inner, self.after, self.export_fails = inner, after, export_fails
        self.model_name, self.max_model_len, self.vocab_size = inner.model_name, inner.max_model_len, inner.vocab_size
        self.eos_token_ids = inner.eos_token_ids
        self.dead = False

    async def generate(self, request):
        if self.dead:
            raise ReplicaFailed("dead")
        count = 0
        async for delta in self.inner.generate(request):
            yield delta
            count += 1
            if self.after is not None and count >= self.after:
                self.dead = True
                raise ReplicaFailed("the replica died mid-stream")

    async def export_kv(self, token_ids):
        if self.export_fails:
            self.dead = True
            raise ReplicaFailed("the replica died mid-transfer")
        return await self.inner.export_kv(token_ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def _stream(routed: RoutedEngineClient, request_id: str, prompt, params) -> tuple[list[int], int]:
    tokens, finishes = [], 0
    async for delta in routed.generate(EngineRequest(request_id, prompt, params)):
        tokens.extend(delta.token_ids)
        finishes += delta.finished
    return tokens, finishes


def test_a_handoff_that_fails_its_checks_is_dropped(model_dir) -> None:
    source, target, bare = _llm(model_dir, tier=False), _llm(model_dir), _llm(model_dir, tier=False)
    prompt = _prompts(1)[0]
    source.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))

    async def scenario():
        handoff = await source.engine_client.export_kv(prompt)
        assert handoff.num_blocks == 10 and handoff.nbytes == 40 * KV_BYTES_PER_TOKEN
        tokens = list(handoff.token_ids)
        tokens[5] += 1
        broken = [
            dataclasses.replace(handoff, layout={**handoff.layout, "block_size": 8}),
            dataclasses.replace(handoff, layout={**handoff.layout, "num_layers": 3}),
            dataclasses.replace(handoff, layout={**handoff.layout, "dtype": "bfloat16"}),
            dataclasses.replace(handoff, token_ids=tokens),  # the hashes no longer match the tokens
            dataclasses.replace(handoff, data=handoff.data[:, :1]),
            dataclasses.replace(handoff, data=handoff.data.half()),
            KvHandoff(handoff.token_ids[:4], handoff.hashes, handoff.layout, handoff.data),
        ]
        taken = [await target.engine_client.import_kv(h) for h in broken]
        return taken, await bare.engine_client.import_kv(handoff), await target.engine_client.import_kv(handoff)

    taken, into_bare, into_target = asyncio.run(scenario())
    assert taken == [0] * 7 and into_bare == 0 and into_target == 10
    for llm in (source, target, bare):
        llm.shutdown()


def test_draining_a_replica_moves_its_streams_with_their_kv(model_dir) -> None:
    """16 streams over two replicas; one is drained while they run: every stream goes on from the other replica
    with the same tokens, and that replica loads the moved histories instead of computing them."""
    a, b = _llm(model_dir), _llm(model_dir)
    prompts = _prompts(16)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    expected = _reference(model_dir, prompts, params)

    async def scenario():
        routed = RoutedEngineClient({"a": a.engine_client, "b": b.engine_client}, policy="round-robin")
        streams = [asyncio.create_task(_stream(routed, f"r{i}", p, params)) for i, p in enumerate(prompts)]
        while len(routed.open_on("a")) + len(routed.open_on("b")) < 16:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        on_a = len(routed.open_on("a"))
        moved = await routed.moves.drain("a")
        return await asyncio.gather(*streams), on_a, moved, routed.moves

    results, on_a, moved, moves = asyncio.run(scenario())
    stats = b.engine.scheduler.stats
    assert [tokens for tokens, _ in results] == expected and all(finishes == 1 for _, finishes in results)
    assert on_a >= 6 and moved == on_a and moves.num_moves == moved
    # Each moved stream's history (its prompt and what it had generated) came over as blocks, not recomputed.
    assert stats.num_host_hit_tokens >= moved * 40
    assert moves.bytes_moved == moves.num_blocks_moved * BLOCK * KV_BYTES_PER_TOKEN
    assert stats.num_computed_tokens < (16 - moved) * (40 + 120) + moved * (120 + 2 * BLOCK)
    a.shutdown()
    b.shutdown()


def test_disaggregated_requests_prefill_on_one_replica_and_decode_on_another(model_dir) -> None:
    prefill, decode = _llm(model_dir, tier=False), _llm(model_dir)
    prompts = _prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = _reference(model_dir, prompts, params)

    async def scenario():
        routed = RoutedEngineClient({"p": prefill.engine_client, "d": decode.engine_client}, prefill_replicas={"p"})
        results = await asyncio.gather(*(_stream(routed, f"r{i}", p, params) for i, p in enumerate(prompts)))
        return results, routed.moves

    results, moves = asyncio.run(scenario())
    assert [tokens for tokens, _ in results] == expected and all(finishes == 1 for _, finishes in results)
    # Every prompt's KV moved, block for block: 40 tokens each.
    assert moves.num_moves == 8 and moves.bytes_moved == 8 * 40 * KV_BYTES_PER_TOKEN
    # The decode replica computed one position per token after the first (the first token's included), never
    # a prompt position.
    assert decode.engine.scheduler.stats.num_computed_tokens == 8 * 19
    assert prefill.engine.scheduler.stats.num_computed_tokens == 8 * 40
    prefill.shutdown()
    decode.shutdown()


@pytest.mark.parametrize("fault", ["prefill dies mid-transfer", "decode dies mid-stream"])
def test_a_failed_side_costs_a_recomputation_never_a_token(model_dir, fault: str) -> None:
    prefill, first, second = _llm(model_dir, tier=False), _llm(model_dir), _llm(model_dir)
    prompts = _prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = _reference(model_dir, prompts, params)
    clients = {"p": prefill.engine_client, "d1": first.engine_client, "d2": second.engine_client}
    if fault.startswith("prefill"):
        clients["p"] = Dying(clients["p"], export_fails=True)
    else:
        clients["d1"] = Dying(clients["d1"], after=3)

    async def scenario():
        routed = RoutedEngineClient(clients, prefill_replicas={"p"})
        results = []
        for i, prompt in enumerate(prompts):  # one at a time: each meets the fault or its aftermath
            results.append(await _stream(routed, f"r{i}", prompt, params))
            if fault.startswith("prefill") and i == 0:
                routed.router.set_healthy("p", True)  # it "restarted": the next requests prefill there again
                clients["p"].export_fails = False
                clients["p"].dead = False
        return results, routed

    results, routed = asyncio.run(scenario())
    assert [tokens for tokens, _ in results] == expected and all(finishes == 1 for _, finishes in results)
    if fault.startswith("prefill"):
        # The failed transfer moved nothing (its request recomputed its prompt on a decode replica); the rest did.
        assert routed.moves.num_moves == 5
    else:
        assert routed.num_failovers >= 1
    for llm in (prefill, first, second):
        llm.shutdown()


def test_replicas_whose_blocks_could_not_move_are_refused_at_start() -> None:
    from pagerail.cluster.core.kv_handoff import check_roles

    layout = {"block_size": 16, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
    good = {**layout, "vocab_size": 250}
    check_roles({"p": good, "d": dict(good)}, ["p"])
    with pytest.raises(ValueError, match="replica d has block_size=32, prefill replica p 16"):
        check_roles({"p": good, "d": {**good, "block_size": 32}}, ["p"])
    with pytest.raises(ValueError, match="replica d has vocab_size=300"):
        check_roles({"p": good, "d": {**good, "vocab_size": 300}}, ["p"])
