"""A simulated two-node Ray cluster runs tensor-parallel size 2 with one rank on each node."""

from __future__ import annotations

import pytest

from tests.requirements import require_module

ray = require_module("ray", "needs Ray")
from ray.cluster_utils import Cluster  # noqa: E402

from pagerail import LLM  # noqa: E402
from tests.actor_probes import worker_nodes  # noqa: E402
from tests.parity import compare, engine_greedy, reference_greedy  # noqa: E402
from tests.ray_start import with_one_retry  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    started: list[Cluster] = []

    def start() -> Cluster:
        started.append(Cluster(initialize_head=True, head_node_args={"num_cpus": 1}))
        return started[-1]

    def cleanup() -> None:
        ray.shutdown()
        for cluster in started:
            cluster.shutdown()

    cluster = with_one_retry(start, cleanup)
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_one_rank_per_node_gives_the_same_tokens(two_nodes, tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [3, 17, 29, 41] * 6]
    llm = LLM(
        str(model_dir),
        block_size=4,
        num_gpu_blocks=128,
        tensor_parallel_size=2,
        ray_address=two_nodes.address,
        placement_strategy="STRICT_SPREAD",
    )
    try:
        nodes = worker_nodes(llm._cluster.heads[0])
        assert len(set(nodes)) == 2, "each rank must run on its own node"
        ours = engine_greedy(llm, prompts, 16)
    finally:
        llm.shutdown()
    assert compare(ours, reference_greedy(model_dir, prompts, 16)).identical == len(prompts)
