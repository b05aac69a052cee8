"""Two tensor-parallel WorkerActor ranks on a local Ray over gloo, driven over gRPC (one step per stream, and the
head's pipelined step streams), match a single-rank Worker."""

from __future__ import annotations

import grpc
import pytest
import torch

from pagerail.cluster.distributed.remote_executor import RemoteExecutor
from pagerail.common.auth import auth_metadata
from pagerail.common.engine_args import engine_config
from pagerail.proto import step_pb2, worker_pb2_grpc
from pagerail.worker.actor import WorkerActor
from pagerail.worker.config import WorkerConfig
from pagerail.worker.worker import Worker
from tests.ray_start import start_ray
from tests.requirements import require_module
from tests.tiny_models import make_tiny_model

ray = require_module("ray", "needs Ray")

pytestmark = pytest.mark.slow  # a local Ray with two worker actors

TOKEN = "actor-test-token"
PROMPT = [5, 6, 7, 8, 9]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def local_ray():
    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def prefill_batch(handle: int = 1, step_id: int = 1) -> step_pb2.StepBatch:
    request = step_pb2.NewRequest(
        handle=handle,
        request_id=f"req-{handle}",
        token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        sampling=step_pb2.SamplingParams(temperature=0.0),
        block_ids=[2 * handle - 2, 2 * handle - 1],  # 4-token blocks hold the prompt and the first outputs
        num_scheduled_tokens=len(PROMPT),
    )
    return step_pb2.StepBatch(step_id=step_id, new_requests=[request])


def decode_batch(handle: int = 1, step_id: int = 2) -> step_pb2.StepBatch:
    """The next step as the head sends it: one token scheduled; every rank kept the token rank 0 sampled."""
    request = step_pb2.CachedRequest(handle=handle, num_scheduled_tokens=1)
    return step_pb2.StepBatch(step_id=step_id, cached_requests=[request])


def test_two_ranks_match_single_rank(local_ray, tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")  # 4 heads, 2 KV heads: one KV head per rank
    config = WorkerConfig(str(model_dir), engine_config(num_gpu_blocks=16, block_size=4))
    remote_actor = ray.remote(num_cpus=1)(WorkerActor)
    ranks = [remote_actor.remote(config, rank, 2, TOKEN) for rank in range(2)]
    threads = torch.get_num_threads()
    try:
        ip, port = ray.get([ranks[0].node_ip.remote(), ranks[0].reserve_port.remote()], timeout=TIMEOUT_S)
        rendezvous = f"{ip}:{port}"
        # Both at once: the rendezvous blocks until every rank has joined.
        started = ray.get([actor.start.remote(rendezvous) for actor in ranks], timeout=TIMEOUT_S)
        assert [info["rank"] for info in started] == [0, 1]
        assert all(info["num_blocks"] == 16 for info in started)
        assert started[0]["pid"] != started[1]["pid"]

        channels = [grpc.insecure_channel(info["address"]) for info in started]
        stubs = [worker_pb2_grpc.WorkerServiceStub(channel) for channel in channels]
        metadata = auth_metadata(TOKEN)

        reference = Worker(WorkerConfig(str(model_dir), engine_config(num_gpu_blocks=16, block_size=4), num_threads=1))
        batch = prefill_batch()
        for _ in range(2):
            expected = reference.execute_step(batch)
            assert list(expected.handles) == [1] and len(expected.token_ids) == 1
            # Concurrently (a call starts sending at once): each rank blocks in its all-reduce until the other one
            # runs the same step.
            calls = [stub.StepStream(iter([batch]), metadata=metadata, timeout=TIMEOUT_S) for stub in stubs]
            first, second = (next(call) for call in calls)
            assert first.step_id == second.step_id == batch.step_id
            assert list(first.handles) == [1] and list(first.token_ids) == list(expected.token_ids)
            assert list(second.handles) == [] and list(second.token_ids) == []
            batch = decode_batch()
        for channel in channels:
            channel.close()

        # The head's streams: the decode is queued on both ranks before the prefill ran; the ranks keep the token
        # they sampled (rank 0 shares it), so the decode carries none.
        executor = RemoteExecutor([info["address"] for info in started], TOKEN, step_timeout_s=TIMEOUT_S)
        try:
            batches = [prefill_batch(handle=2, step_id=3), decode_batch(handle=2, step_id=4)]
            steps = [executor.submit(batch) for batch in batches]
            reference_steps = [reference.execute_step(batch) for batch in batches]
            for pending, expected in zip(steps, reference_steps, strict=True):
                result = pending.result()
                assert (result.step_id, list(result.handles)) == (expected.step_id, [2])
                assert list(result.token_ids) == list(expected.token_ids)
            assert len(executor.stats.bytes_received_per_rank) == 2
        finally:
            executor.close()
    finally:
        torch.set_num_threads(threads)
        ray.get([actor.stop.remote() for actor in ranks], timeout=TIMEOUT_S)


def test_a_ranks_non_builtin_error_reaches_the_head_as_a_builtin_one():
    """Unpickling a torch error on the head would import torch there; ValueError and other builtins pass as is."""
    import pickle

    import pytest

    from pagerail.worker.actor import builtin_errors

    class DistStoreError(RuntimeError):  # stands in for torch.distributed's, defined outside builtins
        pass

    @builtin_errors
    def fails(error):
        raise error

    with pytest.raises(RuntimeError) as info:
        fails(DistStoreError("wait timeout after 20000ms"))
    assert type(info.value) is RuntimeError and "DistStoreError: wait timeout" in str(info.value)
    assert type(pickle.loads(pickle.dumps(info.value))) is RuntimeError
    with pytest.raises(ValueError, match="cannot split"):
        fails(ValueError("cannot split"))
