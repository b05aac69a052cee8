"""The public gRPC API on the embedded model: a three-chunk Session reuses the KV cache of earlier chunks."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagerail import LLM
from pagerail.cluster.frontend.grpc_api import build_grpc_server
from pagerail.proto import api_pb2, api_pb2_grpc

pytestmark = pytest.mark.slow

CHUNKS = [
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter.",
    " Every morning he walked into the woods with his axe and his dog.",
    " One day he found",
]


def test_session_chunks_reuse_cached_blocks_and_match_one_generate(smollm2_dir):
    # Without prefix caching only the session itself can avoid recomputing.
    llm = LLM(str(smollm2_dir), served_model_name="smollm2", enable_prefix_caching=False, num_gpu_blocks=256)
    tokenizer = llm.tokenizer
    engine = llm.engine_client
    chunk_ids = [tokenizer.encode(CHUNKS[0])] + [tokenizer.encode(c, add_special_tokens=False) for c in CHUNKS[1:]]
    whole_ids = sum(chunk_ids, [])
    sampling = api_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def scenario():
        server, port = build_grpc_server(engine, tokenizer, host="127.0.0.1", port=0)
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = api_pb2_grpc.GenerationStub(channel)
            request = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=whole_ids), sampling_params=sampling)
            whole = [t for r in [r async for r in stub.Generate(request)] for t in r.token_ids]
            before = (await engine.stats())["num_computed_tokens"]

            async def messages():
                for i, ids in enumerate(chunk_ids):
                    message = api_pb2.SessionRequest(token_ids=api_pb2.TokenIds(ids=ids), final=i == len(chunk_ids) - 1)
                    if i == 0:
                        message.sampling_params.CopyFrom(sampling)
                    yield message
                    await asyncio.sleep(0.3)  # each chunk is computed before the next arrives

            responses = [r async for r in stub.Session(messages())]
            computed = (await engine.stats())["num_computed_tokens"] - before
        await server.stop(None)
        return whole, responses, computed

    whole, responses, computed = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert [t for r in responses for t in r.token_ids] == whole
    assert responses[-1].finish_reason == "length" and responses[-1].usage.prompt_tokens == len(whole_ids)
    # Every input token computed once, then one per decode step: earlier chunks were never recomputed.
    assert computed == len(whole_ids) + 12 - 1
