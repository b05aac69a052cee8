"""The worker's gRPC server: the step stream over a real channel, bearer-token refusals, and TLS."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
import torch

from pagerail.cluster.distributed.remote_executor import RemoteExecutor
from pagerail.common.auth import auth_metadata, check_token
from pagerail.common.engine_args import engine_config
from pagerail.common.tls import TlsConfig
from pagerail.proto import step_pb2, worker_pb2_grpc
from pagerail.worker.config import WorkerConfig
from pagerail.worker.grpc_server import start_worker_server
from pagerail.worker.worker import Worker
from tests.tiny_models import make_tiny_model

TOKEN = "s3cret-token-for-tests"
PROMPT = [5, 6, 7, 8, 9]
BLOCK_SIZE = 4
RPC_TIMEOUT_S = 10


def prefill_batch(handle: int, step_id: int = 1) -> step_pb2.StepBatch:
    """One new greedy request whose whole prompt is scheduled, with blocks enough to hold it."""
    num_blocks = -(-len(PROMPT) // BLOCK_SIZE)
    request = step_pb2.NewRequest(
        handle=handle,
        request_id=f"req-{handle}",
        token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        sampling=step_pb2.SamplingParams(temperature=0.0),
        block_ids=[handle * num_blocks + i for i in range(num_blocks)],
        num_scheduled_tokens=len(PROMPT),
    )
    return step_pb2.StepBatch(step_id=step_id, new_requests=[request])


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model_dir = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    threads = torch.get_num_threads()  # the Worker pins this process to one thread; give the rest back after
    yield Worker(WorkerConfig(str(model_dir), engine_config(num_gpu_blocks=64, block_size=BLOCK_SIZE), num_threads=1))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stub(worker):
    server, port = start_worker_server(worker, "127.0.0.1", TOKEN)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield worker_pb2_grpc.WorkerServiceStub(channel)
    channel.close()
    server.stop(grace=None)


def run_step(stub, batch: step_pb2.StepBatch, metadata=None) -> step_pb2.StepResult:
    """One step on a stream of its own; a failed step raises the stream's INTERNAL status."""
    metadata = auth_metadata(TOKEN) if metadata is None else metadata
    (result,) = stub.StepStream(iter([batch]), metadata=metadata, timeout=RPC_TIMEOUT_S)
    return result


def test_a_step_samples_one_token(stub):
    result = run_step(stub, prefill_batch(handle=1, step_id=7))
    assert result.step_id == 7
    assert list(result.handles) == [1]
    assert len(result.token_ids) == 1 and 0 <= result.token_ids[0] < 250


def decode_batch(handle: int, step_id: int) -> step_pb2.StepBatch:
    """The next step of `handle` as the head sends it: the rank kept the token it sampled, one token scheduled."""
    return step_pb2.StepBatch(
        step_id=step_id, cached_requests=[step_pb2.CachedRequest(handle=handle, num_scheduled_tokens=1)]
    )


def test_step_stream_runs_pipelined_steps_like_one_step_streams(stub):
    # The decode is on the stream before the prefill it depends on has run.
    replies = stub.StepStream(
        iter([prefill_batch(handle=3, step_id=1), decode_batch(handle=3, step_id=2)]),
        metadata=auth_metadata(TOKEN),
        timeout=RPC_TIMEOUT_S,
    )
    streamed = list(replies)
    single = [
        run_step(stub, batch) for batch in (prefill_batch(handle=4, step_id=3), decode_batch(handle=4, step_id=4))
    ]
    assert [result.step_id for result in streamed] == [1, 2]
    assert [list(result.handles) for result in streamed] == [[3], [3]]
    assert [list(r.token_ids) for r in streamed] == [list(r.token_ids) for r in single]  # greedy: same tokens


def test_step_stream_error_ends_the_stream_and_skips_later_steps(stub):
    unknown = step_pb2.StepBatch(step_id=5, cached_requests=[step_pb2.CachedRequest(handle=998)])
    replies = stub.StepStream(
        iter([unknown, prefill_batch(handle=5, step_id=6)]), metadata=auth_metadata(TOKEN), timeout=RPC_TIMEOUT_S
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(replies)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "step 5: KeyError" in caught.value.details() and "998" in caught.value.details()
    # Step 6 was never run: handle 5 is still unknown, so a decode for it fails.
    with pytest.raises(grpc.RpcError, match="KeyError"):
        run_step(stub, decode_batch(handle=5, step_id=7))


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        auth_metadata("not-the-token"),
        (("authorization", f"Basic {TOKEN}"),),
        (("authorization", TOKEN),),
        (("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer other")),
    ],
    ids=["none", "wrong-token", "basic-scheme", "no-scheme", "two-headers"],
)
def test_refuses_bad_credentials_and_keeps_serving(stub, metadata):
    with pytest.raises(grpc.RpcError) as caught:
        run_step(stub, prefill_batch(2), metadata)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "not-the-token" not in caught.value.details() and TOKEN not in caught.value.details()
    assert run_step(stub, step_pb2.StepBatch(step_id=8)).step_id == 8  # the server still answers with the token


def test_token_and_address_validation(worker):
    for bad in ("", "has space", "ünïcode", None):
        with pytest.raises(ValueError, match="token"):
            check_token(bad)
    with pytest.raises(ValueError, match="port"):
        start_worker_server(worker, "127.0.0.1", TOKEN, port=70000)


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a certificate it signed for 127.0.0.1 and localhost; returns (cert, key, ca)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        subprocess.run(["/usr/bin/openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30)

    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.cnf",
    )  # fmt: skip
    return directory / "server.pem", directory / "server.key", directory / "ca.pem"


def test_tls(worker, tmp_path):
    tls = TlsConfig.from_files(*make_certificates(tmp_path))
    assert b"PRIVATE KEY" not in repr(tls).encode()
    server, port = start_worker_server(worker, "127.0.0.1", TOKEN, tls=tls)
    try:
        with grpc.secure_channel(f"127.0.0.1:{port}", tls.channel_credentials()) as channel:
            result = run_step(worker_pb2_grpc.WorkerServiceStub(channel), prefill_batch(handle=9))
            assert list(result.handles) == [9]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as caught:
                run_step(worker_pb2_grpc.WorkerServiceStub(channel), prefill_batch(handle=10))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        # The head's executor streams its steps over the same TLS.
        executor = RemoteExecutor([f"127.0.0.1:{port}"], TOKEN, tls=tls)
        try:
            first = executor.submit(prefill_batch(handle=6, step_id=1))
            second = executor.submit(decode_batch(handle=6, step_id=2))
            assert [list(first.result().handles), list(second.result().handles)] == [[6], [6]]
        finally:
            executor.close()
    finally:
        server.stop(grace=None)


def test_tls_config_rejects_non_pem(tmp_path):
    (tmp_path / "junk").write_text("not a certificate")
    with pytest.raises(ValueError, match="not PEM"):
        TlsConfig.from_files(tmp_path / "junk", tmp_path / "junk", tmp_path / "junk")
    with pytest.raises(ValueError, match="cannot read"):
        TlsConfig.from_files(tmp_path / "missing", tmp_path / "junk", tmp_path / "junk")
