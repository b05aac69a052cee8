"""LLM.shutdown() in-process frees the engine: model, KV cache and worker go, and a second engine starts clean."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagerail import LLM, SamplingParams
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _engine_objects(llm: LLM) -> dict[str, weakref.ref]:
    worker = llm.engine.executor.worker
    layer = next(iter(worker.model.attention_layers()))
    return {
        "worker": weakref.ref(worker),
        "model": weakref.ref(worker.model),
        "runner": weakref.ref(worker.runner),
        "kv_cache": weakref.ref(layer.kv_cache),
        "embedding": weakref.ref(next(worker.model.parameters())),
    }


def test_shutdown_frees_the_model_and_the_kv_cache(tmp_path):
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3")
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=32)
    first = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    alive = _engine_objects(llm)
    engine = llm.engine  # a reference kept elsewhere must not keep the device memory alive
    llm.shutdown()
    gc.collect()
    assert {name: ref() is not None for name, ref in alive.items()} == dict.fromkeys(alive, False)
    assert engine.executor.worker is None
    llm.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY)
    # The next engine in this process answers the same.
    with LLM(str(model_dir), block_size=4, num_gpu_blocks=32) as second:
        assert second.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids == first
        alive = _engine_objects(second)
    gc.collect()
    assert all(ref() is None for ref in alive.values())
