"""KV cache sizing from a profiling forward, on the CPU against a fake device whose counters the forward drives."""

from __future__ import annotations

import logging
import weakref

import pytest
import torch

import pagerail.worker.memory_profile as memory_profile
import pagerail.worker.worker as worker_module
from pagerail.common.engine_args import engine_config
from pagerail.worker.config import WorkerConfig
from pagerail.worker.kv_cache import DEFAULT_CPU_KV_BYTES, bytes_per_block
from pagerail.worker.memory_profile import GRAPH_FIXED_RESERVE, largest_capture, memory_probe, profile_kv_cache
from pagerail.worker.model_loader import load_model
from pagerail.worker.worker import Worker
from tests.tiny_models import make_tiny_model

MiB = 1 << 20
TOTAL = 8 << 30
WEIGHTS = 300 * MiB
NON_TORCH = 700 * MiB
PER_TOKEN = 64 * 1024  # bytes the fake forward "allocates" for each token it runs
PER_ROW = 4096  # bytes compute_logits "allocates" for each row: below PER_TOKEN, so the forward sets the peak
BLOCK_SIZE = 16


class FakeProbe:
    """A caching allocator's counters on a device with TOTAL bytes, NON_TORCH of them held outside torch."""

    def __init__(self, weights: int = WEIGHTS, non_torch: int = NON_TORCH, total: int = TOTAL) -> None:
        self.total, self.non_torch = total, non_torch
        self.live = self.peak = weights
        self.cached = 0  # freed bytes the allocator keeps until empty_cache

    def alloc(self, size: int) -> None:
        self.live += size
        self.peak = max(self.peak, self.live)

    def free(self, size: int) -> None:
        self.live -= size
        self.cached += size

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.non_torch - self.reserved(), self.total

    def reset_peak(self) -> None:
        self.peak = self.live

    def peak_allocated(self) -> int:
        return self.peak

    def allocated(self) -> int:
        return self.live

    def reserved(self) -> int:
        return self.live + self.cached

    def empty_cache(self) -> None:
        self.cached = 0

    def synchronize(self) -> None:
        pass


class Recorder:
    """Instruments a real tiny model: each forward and compute_logits bumps the probe in proportion to its size
    and records what it saw; the temporary cache counts on the probe until its tensors are garbage."""

    def __init__(self, model: torch.nn.Module, probe: FakeProbe, monkeypatch: pytest.MonkeyPatch) -> None:
        self.model, self.probe = model, probe
        self.forwards: list[dict] = []
        self.logit_rows: list[int] = []
        self.temp_caches: list[weakref.ref] = []
        self.temp_ids: list[int] = []
        model.register_forward_hook(self._forward)
        real_logits = model.compute_logits

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor | None:
            self.logit_rows.append(hidden.shape[0])
            probe.alloc(PER_ROW * hidden.shape[0])
            probe.free(PER_ROW * hidden.shape[0])
            return real_logits(hidden)

        model.compute_logits = compute_logits
        real_allocate = memory_profile.allocate_kv_caches

        def allocate(*args, **kwargs) -> list[torch.Tensor]:
            caches = real_allocate(*args, **kwargs)
            for cache in caches:
                size = cache.numel() * cache.element_size()
                probe.alloc(size)
                weakref.finalize(cache, probe.free, size)
                self.temp_caches.append(weakref.ref(cache))
                self.temp_ids.append(id(cache))
            return caches

        monkeypatch.setattr(memory_profile, "allocate_kv_caches", allocate)

    def _forward(self, module, args, output) -> None:
        input_ids, _, meta = args
        num_tokens = input_ids.shape[0]
        self.forwards.append(
            dict(
                tokens=num_tokens,
                decodes=meta.num_decodes,
                spans=[(span.start, span.end) for span in meta.prefills],
                # Ids and shapes only: holding the tensors would keep the temporary cache alive.
                caches=[(id(c), tuple(c.shape)) for c in (layer.kv_cache for layer in module.attention_layers())],
            )
        )
        self.probe.alloc(PER_TOKEN * num_tokens)
        self.probe.free(PER_TOKEN * num_tokens)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def model(model_dir):
    return load_model(model_dir, dtype=torch.float32, device="cpu", load_format="dummy")


def per_block(model: torch.nn.Module) -> int:
    return bytes_per_block(model.num_layers, model.num_kv_heads_per_rank, model.head_dim, BLOCK_SIZE, torch.float32)


def expected_blocks(model, util: float, tokens: int, seqs: int, eager: bool, probe: FakeProbe | None = None) -> int:
    probe = probe or FakeProbe()
    total, weights, non_torch = probe.total, probe.live, probe.non_torch  # live: back to the weights after profiling
    reserve = 0 if eager else PER_TOKEN * min(seqs, tokens) + GRAPH_FIXED_RESERVE
    usable = int(total * util) - weights - PER_TOKEN * tokens - non_torch - reserve
    return usable // per_block(model) - 1  # one scratch block


def profile(model, probe, tokens=96, seqs=8, util=0.9, eager=False, max_model_len=256):
    return profile_kv_cache(
        model,
        probe,
        block_size=BLOCK_SIZE,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        max_model_len=max_model_len,
        gpu_memory_utilization=util,
        enforce_eager=eager,
    )


def test_profile_runs_the_token_budget_and_the_sampled_rows(model, monkeypatch):
    probe = FakeProbe()
    recorder = Recorder(model, probe, monkeypatch)
    result = profile(model, probe, tokens=96, seqs=8)
    prefill, decode = recorder.forwards
    assert (prefill["tokens"], prefill["decodes"], prefill["spans"]) == (96, 0, [(0, 96)])
    assert recorder.logit_rows == [8]  # the decode forward is not sampled
    assert (decode["tokens"], decode["decodes"], decode["spans"]) == (8, 8, [])
    assert (result.prefill_peak, result.decode_peak) == (PER_TOKEN * 96, PER_TOKEN * 8)
    assert result.num_blocks == expected_blocks(model, 0.9, 96, 8, eager=False)


def test_spans_stop_at_max_model_len_and_rows_at_the_token_budget(model, monkeypatch):
    probe = FakeProbe()
    recorder = Recorder(model, probe, monkeypatch)
    profile(model, probe, tokens=300, seqs=512, max_model_len=128, eager=True)
    (prefill,) = recorder.forwards
    assert prefill["spans"] == [(0, 128), (128, 256), (256, 300)]
    assert recorder.logit_rows == [300]  # no more requests than tokens


def test_temporary_cache_is_bound_during_the_profile_and_released_after(model, monkeypatch):
    probe = FakeProbe()
    recorder = Recorder(model, probe, monkeypatch)
    layers = model.attention_layers()
    before = [torch.zeros(1) for _ in layers]
    for layer, cache in zip(layers, before, strict=True):
        layer.kv_cache = cache
    profile(model, probe, tokens=40)
    assert len(recorder.forwards) == 2
    for seen in recorder.forwards:
        assert [cache_id for cache_id, _ in seen["caches"]] == recorder.temp_ids
        assert {shape[2] for _, shape in seen["caches"]} == {48}  # 40 tokens: 3 blocks of 16 slots
    assert all(layer.kv_cache is cache for layer, cache in zip(layers, before, strict=True))
    assert [ref() for ref in recorder.temp_caches] == [None] * len(layers)  # freed: nothing kept a reference
    assert probe.allocated() == WEIGHTS


def test_blocks_follow_the_formula_and_exclude_the_temporary_cache(model, monkeypatch):
    probe = FakeProbe()
    Recorder(model, probe, monkeypatch)
    result = profile(model, probe, tokens=96, seqs=8, util=0.6)
    # The temporary cache was on the probe during the forward, yet neither the peak nor the weights count it.
    assert (result.weights, result.activation_peak, result.non_torch) == (WEIGHTS, PER_TOKEN * 96, NON_TORCH)
    assert result.graph_reserve == PER_TOKEN * 8 + GRAPH_FIXED_RESERVE
    assert result.num_blocks == expected_blocks(model, 0.6, 96, 8, eager=False)
    assert result.kv_cache_bytes >= (result.num_blocks + 1) * result.bytes_per_block


def test_enforce_eager_drops_the_graph_reserve_and_the_decode_profile(model, monkeypatch):
    probe = FakeProbe()
    recorder = Recorder(model, probe, monkeypatch)
    result = profile(model, probe, tokens=96, seqs=8, eager=True)
    assert [seen["decodes"] for seen in recorder.forwards] == [0]
    assert (result.graph_reserve, result.decode_peak) == (0, 0)
    assert "enforce_eager" in result.graph_reserve_kind
    assert result.num_blocks == expected_blocks(model, 0.9, 96, 8, eager=True)
    assert result.num_blocks > expected_blocks(model, 0.9, 96, 8, eager=False)


def test_decode_profile_runs_the_largest_captured_batch(model, monkeypatch):
    assert (largest_capture(20), largest_capture(600)) == (20, 512)  # the model runner captures at most 512
    probe = FakeProbe()
    recorder = Recorder(model, probe, monkeypatch)
    result = profile(model, probe, tokens=600, seqs=600, max_model_len=256)
    assert [seen["decodes"] for seen in recorder.forwards] == [0, 512]
    assert result.graph_reserve == PER_TOKEN * 512 + GRAPH_FIXED_RESERVE


def test_too_little_memory_names_gpu_memory_utilization(model, monkeypatch):
    block = per_block(model)
    # Leave exactly two blocks (one for requests, one scratch), then one byte less.
    fits = int(TOTAL * 0.9) - WEIGHTS - PER_TOKEN * 96 - 2 * block
    probe = FakeProbe(non_torch=fits)
    Recorder(model, probe, monkeypatch)
    assert profile(model, probe, tokens=96, eager=True).num_blocks == 1
    probe = FakeProbe(non_torch=fits + 1)
    Recorder(model, probe, monkeypatch)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.9.*non_torch=") as error:
        profile(model, probe, tokens=96, eager=True)
    assert str(fits + 1) in str(error.value)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1"):
        profile(model, FakeProbe(), tokens=96, util=0.1)


@pytest.fixture
def make_worker(model_dir, monkeypatch):
    """A CPU worker whose cache sizing sees a FakeProbe (or none), on the instrumented tiny model."""
    threads = torch.get_num_threads()
    made = {}

    def make(probe: FakeProbe | None, **overrides) -> Worker:
        real_load = worker_module.load_model

        def load(*args, **kwargs):
            model = real_load(*args, **kwargs)
            if probe is not None:
                made["recorder"] = Recorder(model, probe, monkeypatch)
            return model

        if probe is not None:  # None: the real probe lookup and loader
            monkeypatch.setattr(worker_module, "load_model", load)
            monkeypatch.setattr(worker_module, "memory_probe", lambda device: probe)
        settings = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=4, **overrides)
        engine = engine_config(device="cpu", load_format="dummy", **settings)
        return Worker(WorkerConfig(str(model_dir), engine, num_threads=1))

    make.made = made
    yield make
    torch.set_num_threads(threads)


def small_probe() -> FakeProbe:
    """A 1 GiB device, so the real CPU cache the worker then allocates stays small."""
    return FakeProbe(weights=16 * MiB, non_torch=32 * MiB, total=1 << 30)


def test_worker_sizes_its_cache_by_profiling_and_keeps_a_scratch_block(make_worker, caplog):
    probe = small_probe()
    with caplog.at_level(logging.INFO, logger="pagerail.worker.worker"):
        worker = make_worker(probe, gpu_memory_utilization=0.35)
    assert [seen["tokens"] for seen in make_worker.made["recorder"].forwards] == [64, 4]
    assert worker.num_blocks == expected_blocks(worker.model, 0.35, 64, 4, eager=False, probe=probe)
    assert worker.kv_profile is not None and worker.kv_profile.num_blocks == worker.num_blocks
    for layer in worker.model.attention_layers():
        assert layer.kv_cache.shape[2] == (worker.num_blocks + 1) * BLOCK_SIZE
    assert worker.runner.scratch_block == worker.num_blocks
    (line,) = [r.getMessage() for r in caplog.records if "profiling" in r.getMessage()]
    for number in ("weights=", "activation_peak=", "non_torch=", "graph_reserve=", "kv_cache=", "blocks of"):
        assert number in line


def test_worker_with_enforce_eager_profiles_only_the_prefill(make_worker):
    probe = small_probe()
    worker = make_worker(probe, enforce_eager=True, gpu_memory_utilization=0.1)
    assert [seen["decodes"] for seen in make_worker.made["recorder"].forwards] == [0]
    assert worker.num_blocks == expected_blocks(worker.model, 0.1, 64, 4, eager=True, probe=probe)


def test_explicit_budgets_skip_profiling(make_worker):
    probe = small_probe()
    worker = make_worker(probe, num_gpu_blocks=7)
    assert worker.num_blocks == 7 and worker.kv_profile is None
    assert make_worker.made["recorder"].forwards == []
    worker = make_worker(probe, kv_cache_memory_bytes=10 * per_block(worker.model) + 5)
    assert worker.num_blocks == 10 and worker.kv_profile is None
    assert make_worker.made["recorder"].forwards == []


def test_cpu_worker_keeps_the_default_budget(make_worker):
    # The whole 2 GiB default cache is mapped; only the blocks a step writes are ever resident.
    assert memory_probe(torch.device("cpu")) is None
    worker = make_worker(None)
    assert worker.kv_profile is None
    assert worker.num_blocks == DEFAULT_CPU_KV_BYTES // per_block(worker.model)
    assert worker.model.attention_layers()[0].kv_cache.shape[2] == (worker.num_blocks + 1) * BLOCK_SIZE
