"""`pagerail serve --data-parallel-size 2`: two replicas behind one endpoint, requests spread between them, metrics
labelled per replica, and SIGTERM stops both. A tiny random Llama with a real tokenizer: these are tests of routing,
not of a model."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagerail.cluster.bench.tiny_llama import write_tiny_llama
from tests.serve_process import start_serve, wait_ready

pytestmark = pytest.mark.slow
# Each replica's KV cache (and the host tier the prompts' KV moves into): 8 MiB, thousands of the tiny model's
# tokens, rather than the CPU default of 2 GiB (and a host tier that size, which is allocated up front).
KV_BYTES = 8 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def test_two_replicas_behind_one_endpoint(model_dir):
    process = start_serve(
        "--model", model_dir, "--data-parallel-size", "2", "--routing-policy", "round-robin", "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", str(KV_BYTES),
    )  # fmt: skip
    lines: list[str] = []
    try:
        base_url, _ = wait_ready(process, lines)
        assert any("2 replicas" in line for line in lines), lines
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        texts = [
            client.completions.create(
                model=model, prompt=f"Count to {n}:", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
            ).choices[0]
            for n in range(4)
        ]
        assert all(choice.text and choice.finish_reason == "length" for choice in texts), texts
        metrics = httpx.get(base_url + "/metrics").text
        routed: dict[str, float] = {}
        labelled: set[str] = set()
        for family in text_string_to_metric_families(metrics):
            for sample in family.samples:
                if family.name == "pagerail_router_requests" and sample.name.endswith("_total"):
                    routed[sample.labels["replica"]] = routed.get(sample.labels["replica"], 0) + sample.value
                elif "replica" in sample.labels:
                    labelled.add(sample.labels["replica"])
        assert sorted(routed.values()) == [2, 2], routed  # round robin over the two replicas
        assert labelled == set(routed), (labelled, routed)  # engine series of both, each under its own label
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=120) == 0
        rest = process.stdout.read()
        assert "stopped" in rest, rest
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_prefill_and_decode_replicas_behind_one_endpoint(model_dir):
    """`--prefill-replicas 1 --decode-replicas 1`: each completion's prompt runs on the prefill replica, its KV
    moves to the decode replica over the ranks' channel, and the text is that of a colocated server's."""
    process = start_serve(
        "--model", model_dir, "--prefill-replicas", "1", "--decode-replicas", "1", "--kv-offload-bytes", str(KV_BYTES),
        "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(KV_BYTES),
    )  # fmt: skip
    lines: list[str] = []
    try:
        base_url, _ = wait_ready(process, lines)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        prompts = [f"Write the numbers from one to {n}, separated by commas:" for n in (5, 9)]
        texts = [
            client.completions.create(
                model=model, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p in prompts
        ]
        transfers = 0.0
        for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
            for sample in family.samples:
                if family.name == "pagerail_router_kv_transfers" and sample.name.endswith("_total"):
                    transfers += sample.value
        assert transfers == 2, lines[-20:]
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    # The same prompts on one colocated replica give the same text.
    from pagerail import LLM, SamplingParams

    with LLM(model_dir, kv_cache_memory_bytes=KV_BYTES) as llm:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        assert [o.outputs[0].text for o in llm.generate(prompts, params)] == texts
