"""Prefill/decode disaggregation on a local Ray with real process deaths: the prefill replica's head is killed
while a prompt's KV is on its way, and a decode replica's head is killed while it streams. Every request
finishes once, with the tokens of a replica that never failed."""

from __future__ import annotations

import asyncio

import pytest

from tests.requirements import require_module

ray = require_module("ray", "needs Ray")

from pagerail import LLM  # noqa: E402
from pagerail.cluster.distributed.cluster_options import ClusterOptions  # noqa: E402
from pagerail.cluster.distributed.head_client import HeadEngineClient  # noqa: E402
from pagerail.cluster.distributed.launcher import start_heads  # noqa: E402
from pagerail.cluster.routing.routed_client import RoutedEngineClient  # noqa: E402
from pagerail.common.engine_config import CacheConfig, EngineConfig  # noqa: E402
from pagerail.common.sampling_params import SamplingParams  # noqa: E402
from tests.ray_start import start_ray  # noqa: E402
from tests.test_cluster_failures import _answers, wait_for  # noqa: E402
from tests.test_kv_moves import _stream  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

NAMES = ["pd-prefill", "pd-decode-1", "pd-decode-2"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [list(range(10 + i, 50 + i)) for i in range(6)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = make_tiny_model("llama", tmp_path_factory.mktemp("pd") / "llama")
    start_ray(num_cpus=5, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    try:
        cache = CacheConfig(block_size=4, num_gpu_blocks=256, kv_offload_bytes=1 << 20)
        config = EngineConfig(model=str(model_dir), cache=cache)
        heads = dict(zip(NAMES, start_heads(config, ClusterOptions(), NAMES), strict=True))
        reference = LLM(str(model_dir), block_size=4, num_gpu_blocks=256)
        expected = [list(o.outputs[0].token_ids) for o in reference.generate(PROMPTS, PARAMS)]
        reference.shutdown()
        yield heads, expected
        for head in heads.values():
            # Not a graceful stop: a head the tests killed may still be restarting, and Ray ends everything next.
            ray.kill(head, no_restart=True)
    finally:
        ray.shutdown()


def _routed(heads) -> tuple[RoutedEngineClient, dict]:
    info = ray.get(heads[NAMES[0]].model_info.remote())
    clients = {name: HeadEngineClient(head, "tiny", info) for name, head in heads.items()}
    return RoutedEngineClient(clients, prefill_replicas={NAMES[0]}), clients


def test_the_prefill_replica_killed_mid_transfer(setup) -> None:
    heads, expected = setup
    wait_for(lambda: all(_answers(head) for head in heads.values()), 120, "every head is ready")
    routed, clients = _routed(heads)
    prefill = clients[NAMES[0]]
    forward = prefill.kv_call
    killed = []

    async def kill_on_send(method: str, *args):
        if method == "kv_send" and not killed:
            killed.append(method)
            ray.kill(heads[NAMES[0]], no_restart=False)  # the head dies with the prompt's blocks on their way
        return await forward(method, *args)

    prefill.kv_call = kill_on_send

    async def scenario():
        return [await _stream(routed, f"kill-p-{i}", prompt, PARAMS) for i, prompt in enumerate(PROMPTS)]

    results = asyncio.run(scenario())
    assert killed and [tokens for tokens, _ in results] == expected
    assert all(finishes == 1 for _, finishes in results)


def test_a_decode_replica_killed_mid_stream(setup) -> None:
    heads, expected = setup
    wait_for(lambda: all(_answers(head) for head in heads.values()), 120, "every head is ready")
    routed, _ = _routed(heads)

    async def scenario():
        streams = [asyncio.create_task(_stream(routed, f"kill-d-{i}", p, PARAMS)) for i, p in enumerate(PROMPTS)]
        victim = None
        while victim is None:
            await asyncio.sleep(0.01)
            busy = [name for name in NAMES[1:] if routed.open_on(name)]
            victim = busy[0] if busy else None
        await asyncio.sleep(0.05)  # it is streaming
        ray.kill(heads[victim], no_restart=False)
        return await asyncio.gather(*streams), victim

    results, victim = asyncio.run(scenario())
    assert [tokens for tokens, _ in results] == expected
    assert all(finishes == 1 for _, finishes in results)
    assert routed.num_failovers >= 1
