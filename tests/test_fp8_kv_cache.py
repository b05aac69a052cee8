"""The fp8 KV cache: block counts, every attention path over fp8 K/V against full precision, checkpoint scales,
greedy agreement on the embedded model, and the refusal of a format the chosen path cannot read."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.worker import kv_cache
from pagerail.worker.config import WorkerConfig
from pagerail.worker.kv_cache import bytes_per_block, resolve_kv_cache_dtype
from pagerail.worker.layers import cpu_paged_attention
from pagerail.worker.layers.attention import Attention, AttentionMetadata, PrefillSpan
from pagerail.worker.layers.kv_quant import dequantize, quantize
from pagerail.worker.model_loader import load_model
from pagerail.worker.worker import Worker
from tests.requirements import require
from tests.tiny_models import make_tiny_model
from tests.triton_interpreter import interpreted_report

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Scales away from 1 so a path that forgot one is caught: K's values land near 100 as stored, V's near 2.
K_SCALE, V_SCALE = 0.02, 0.5
# Attention outputs over fp8 K/V against the unquantized cache, (largest, mean) absolute error. e4m3 keeps 3
# mantissa bits, e5m2 2: half a step at the largest V (about 3.5) is 0.22 and 0.44, and the first row, which sees
# one key, returns its value as stored. Measured: 0.10/0.011 and 0.22/0.024 (native kernel, fp32).
FP8_TOLERANCE = {torch.float8_e4m3fn: (0.2, 0.02), torch.float8_e5m2: (0.4, 0.04)}

BLOCK_SIZE, HEADS, KV_HEADS, DIM = 4, 4, 2, 64  # head_dim 64, 2 heads per KV head: the native kernel's AVX shape
LENGTH = 21  # one sequence: a fresh prefill of 9, a chunk of 11 over the cached 9, one decode
BLOCKS = [5, 2, 8, 0, 7, 3]


def _steps(layout: str) -> list[tuple[slice, AttentionMetadata]]:
    """The sequence's three steps as the backends lay them out: "decode" (torch or native decodes, SDPA prefill),
    "paged" (every row through the native kernel) or "mixed" (the Triton mixed kernel for prefill steps)."""
    slots = torch.tensor([BLOCKS[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(LENGTH)])
    table = torch.tensor(BLOCKS)
    mask = torch.arange(20)[None, :] <= torch.arange(9, 20)[:, None]
    fresh = AttentionMetadata(slot_mapping=slots[:9], block_size=BLOCK_SIZE, prefills=[PrefillSpan(0, 9)])
    chunk = AttentionMetadata(
        slot_mapping=slots[9:20], block_size=BLOCK_SIZE, prefills=[PrefillSpan(0, 11, table[:5], 20, mask)]
    )
    decode = AttentionMetadata(
        slot_mapping=slots[20:],
        block_size=BLOCK_SIZE,
        num_decodes=1,
        decode_block_table=table[None],
        decode_context_lens=torch.tensor([LENGTH]),
    )
    for meta, first, count in ((fresh, 0, 9), (chunk, 9, 11)):
        if layout == "paged":
            meta.paged_block_table = table[None].repeat(count, 1)
            meta.paged_context_lens = torch.arange(first + 1, first + count + 1)
        elif layout == "mixed":
            meta.mixed_block_table = table[None]
            meta.mixed_context_lens = torch.tensor([first + count])
            meta.mixed_query_starts = torch.tensor([0, count])
    return [(slice(0, 9), fresh), (slice(9, 20), chunk), (slice(20, 21), decode)]


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(LENGTH, h * DIM, generator=generator) for h in (HEADS, KV_HEADS, KV_HEADS))
    sinks = torch.randn(HEADS, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype), sinks


def _run(layout: str, cache_dtype: torch.dtype, q, k, v, sinks=None, window=None) -> torch.Tensor:
    """Every row's attention output after the three steps, through a layer whose cache is `cache_dtype`."""
    attention = Attention(HEADS, KV_HEADS, DIM, DIM**-0.5, sliding_window=window)
    attention.kv_cache = torch.zeros(2, KV_HEADS, 10 * BLOCK_SIZE, DIM, dtype=cache_dtype)
    attention.k_scale.fill_(K_SCALE)
    attention.v_scale.fill_(V_SCALE)
    return torch.cat([attention(q[rows], k[rows], v[rows], meta, sinks) for rows, meta in _steps(layout)])


def _round_trip(values: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """What an fp8 cache holds of `values`, read back: the reference cache is filled with these."""
    scale = torch.tensor(scale)
    return dequantize(quantize(values, scale, fp8), scale, values.dtype)


def _errors(layout: str, fp8: torch.dtype, dtype: torch.dtype, **options) -> tuple[float, float, float]:
    """(max |fp8 - the same path over a full-precision cache of the round-tripped K/V|, then the max and the mean
    of |fp8 - the same path over the unquantized K/V|)."""
    q, k, v, sinks = _inputs(dtype)
    sinks = sinks if options.pop("sinks", False) else None
    got = _run(layout, fp8, q, k, v, sinks, **options).float()
    same = _run(layout, dtype, q, _round_trip(k, K_SCALE, fp8), _round_trip(v, V_SCALE, fp8), sinks, **options)
    full = _run(layout, dtype, q, k, v, sinks, **options)
    error = (got - full.float()).abs()
    return (got - same.float()).abs().max().item(), error.max().item(), error.mean().item()


def test_quantize_clamps_to_the_format_and_round_trips_within_its_precision():
    values = torch.tensor([0.0, 1.0, -3.0, 1e6, -1e6, 0.013])
    scale = torch.tensor(0.5)
    for fp8 in FORMATS.values():
        stored = quantize(values, scale, fp8)
        assert stored.dtype == fp8 and torch.isfinite(stored.float()).all()  # clamped, not NaN or inf
        assert stored.float()[3].item() == torch.finfo(fp8).max
        back = dequantize(stored, scale, torch.float32)
        torch.testing.assert_close(back[[0, 1, 2, 5]], values[[0, 1, 2, 5]], rtol=0.13, atol=1e-3)
    assert dequantize(values, scale, torch.float32) is values  # a full-precision cache is read as it is


@pytest.mark.parametrize("fp8", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("path", ["torch", "native", "native_paged"])
def test_cpu_paths_read_fp8_as_the_same_path_reads_its_values_in_full_precision(monkeypatch, path, fp8):
    """Fresh prefill, chunk over a cached prefix, decode; plain, and with a window and sinks (the generic loop)."""
    if path != "torch":
        require(cpu_paged_attention.find_compiler(), "needs a C compiler for the native CPU attention kernel")
    monkeypatch.setenv("PAGERAIL_CPU_ATTENTION", "torch" if path == "torch" else "native")
    cpu_paged_attention.native_kernel.cache_clear()
    try:
        layout = "paged" if path == "native_paged" else "decode"
        for options in ({}, {"window": 6, "sinks": True}):
            same, largest, mean = _errors(layout, fp8, torch.float32, **options)
            assert same < 2e-5, (options, same)
            assert largest < FP8_TOLERANCE[fp8][0] and mean < FP8_TOLERANCE[fp8][1], (options, largest, mean)
    finally:
        cpu_paged_attention.native_kernel.cache_clear()


def test_native_kernel_refuses_fp8_without_scales():
    require(cpu_paged_attention.find_compiler(), "needs a C compiler for the native CPU attention kernel")
    kernel = cpu_paged_attention.build_native_kernel()
    cache = torch.zeros(KV_HEADS, 8, DIM, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        kernel.decode(torch.zeros(1, HEADS, DIM), cache, cache, torch.zeros(1, 2, dtype=torch.long),
                      torch.ones(1, dtype=torch.long), BLOCK_SIZE, 1.0)  # fmt: skip


def _split_decode_error(fp8: torch.dtype) -> float:
    """The decode kernel's split-context pass (partials merged by the reduce kernel) over an fp8 cache, against
    the same pass over a float32 cache of the round-tripped values."""
    from pagerail.worker.layers.triton_attention import paged_decode_attention

    generator = torch.Generator().manual_seed(7)
    lens, slots = torch.tensor([150, 3, 70]), 160 * 3
    q = torch.randn(len(lens), HEADS, DIM, generator=generator)
    k, v = (torch.randn(slots, KV_HEADS, DIM, generator=generator) for _ in range(2))
    table = torch.randperm(slots // BLOCK_SIZE, generator=generator).view(len(lens), -1)
    k_scale, v_scale = torch.tensor(K_SCALE), torch.tensor(V_SCALE)
    stored_k, stored_v = quantize(k, k_scale, fp8), quantize(v, v_scale, fp8)
    args = (table, lens, BLOCK_SIZE, DIM**-0.5)
    got = paged_decode_attention(q, stored_k, stored_v, *args, partition_size=64, k_scale=k_scale, v_scale=v_scale)
    read_k, read_v = dequantize(stored_k, k_scale, q.dtype), dequantize(stored_v, v_scale, q.dtype)
    return (got - paged_decode_attention(q, read_k, read_v, *args, partition_size=64)).abs().max().item()


# (format, compute dtype, window and sinks): each format and each dtype once plain and once with both options, to
# keep the interpreter's run within a few seconds.
TRITON_CASES = [("fp8_e4m3", "float32", False), ("fp8_e4m3", "bfloat16", True), ("fp8_e5m2", "float32", True),
                ("fp8_e5m2", "bfloat16", False)]  # fmt: skip


def _report() -> None:
    """Under the Triton interpreter: the decode and mixed kernels' errors, as `_errors` gives them, and the split
    decode pass's, as JSON."""
    errors = {"fp8_e4m3/split_decode": (_split_decode_error(torch.float8_e4m3fn), 0.0, 0.0)}
    for name, dtype, options in TRITON_CASES:
        extra = {"window": 6, "sinks": True} if options else {}
        errors[f"{name}/{dtype}/{options}"] = _errors("mixed", FORMATS[name], getattr(torch, dtype), **extra)
    print(json.dumps(errors))


def test_triton_kernels_read_fp8_as_they_read_its_values_in_full_precision():
    """The mixed kernel for both prefill steps and the decode kernel for the last, in the interpreter."""
    report = interpreted_report("tests.test_fp8_kv_cache", timeout=120)
    assert len(report) == 1 + len(TRITON_CASES)
    for key, (same, largest, mean) in report.items():
        fp8 = FORMATS[key.split("/")[0]]
        # bf16 outputs round at 2**-8 relative (one step at 2 is 0.008); fp32 ones only where the scales fold in.
        assert same < (2e-2 if "bfloat16" in key else 2e-5), (key, same)
        assert largest < FP8_TOLERANCE[fp8][0] + 2e-2 and mean < FP8_TOLERANCE[fp8][1], (key, largest, mean)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture
def make_worker(tiny_llama):
    """CPU workers on the tiny model with random weights; torch's thread count put back afterwards."""
    threads, made = torch.get_num_threads(), []

    def make(dtype: str, kv_cache_dtype: str, **cache) -> Worker:
        engine = EngineConfig(
            model=str(tiny_llama),
            dtype=dtype,
            device="cpu",
            load_format="dummy",
            cache=CacheConfig(block_size=16, kv_cache_dtype=kv_cache_dtype, **cache),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
        )
        made.append(Worker(WorkerConfig(str(tiny_llama), engine, num_threads=1)))
        return made[-1]

    yield make
    for worker in made:
        worker.close()
    torch.set_num_threads(threads)


def test_for_one_budget_fp8_gets_twice_the_blocks_of_bf16_and_four_times_fp32(make_worker, caplog):
    # The tiny model's shard: 2 layers, 2 KV heads of 16.
    sizes = {
        dtype: bytes_per_block(2, 2, 16, 16, dtype) for dtype in (torch.float32, torch.bfloat16, *FORMATS.values())
    }
    assert sizes[torch.float32] == 4 * sizes[torch.float8_e4m3fn] == 2 * sizes[torch.bfloat16] == 8192
    assert sizes[torch.float8_e5m2] == sizes[torch.float8_e4m3fn]
    budget = 10 * sizes[torch.float32] + 100  # not a whole number of blocks of any size
    blocks, stored = {}, {}
    with caplog.at_level(logging.INFO, logger="pagerail.worker.worker"):
        for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8_e5m2")):
            worker = make_worker(dtype, kv, kv_cache_memory_bytes=budget)
            blocks[dtype, kv] = worker.num_blocks
            stored[dtype, kv] = {layer.kv_cache.dtype for layer in worker.model.attention_layers()}
    assert blocks == {("float32", "auto"): 10, ("bfloat16", "auto"): 20, ("float32", "fp8"): 40,
                      ("bfloat16", "fp8_e5m2"): 40}  # fmt: skip
    assert stored[("float32", "fp8")] == {torch.float8_e4m3fn} and stored[("bfloat16", "fp8_e5m2")] == {
        torch.float8_e5m2
    }
    assert "KV cache of 40 blocks in torch.float8_e4m3fn (2048 bytes each)" in caplog.text


@pytest.mark.slow
def test_the_engine_serves_from_an_fp8_cache(tiny_llama):
    """A whole LLM on the tiny model through chunked prefill and decodes: the head hands out the fp8 block count,
    and the first greedy token of every prompt (the prefill's) is the full-precision cache's. Later ones may part
    at the near-ties of random weights."""
    from pagerail import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9], [3, 17, 29, 41] * 6, list(range(20, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for kv in ("auto", "fp8"):
        budget = 64 * bytes_per_block(2, 2, 16, 4, torch.float32)
        with LLM(str(tiny_llama), block_size=4, kv_cache_memory_bytes=budget, max_num_batched_tokens=16,
                 kv_cache_dtype=kv) as llm:  # fmt: skip
            assert llm.engine.block_table.num_blocks == (64 if kv == "auto" else 256)
            tokens[kv] = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert [len(t) for t in tokens["fp8"]] == [8] * 3
    assert [t[0] for t in tokens["fp8"]] == [t[0] for t in tokens["auto"]]


def test_a_kv_cache_dtype_this_torch_cannot_store_is_refused_at_start(make_worker, monkeypatch):
    monkeypatch.delattr(torch, "float8_e5m2")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2' stores K/V as torch.float8_e5m2, which torch"):
        make_worker("float32", "fp8_e5m2")


def test_e4m3_is_refused_on_a_gpu_whose_triton_kernels_cannot_convert_it(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(kv_cache, "triton_available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for name in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{name}': .* compute capability 8.9 .* this GPU is 8.0"):
            resolve_kv_cache_dtype(name, torch.bfloat16, cuda)
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, cuda) == torch.float8_e5m2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cuda) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")


def _with_tensors(model_dir, extra: dict[str, torch.Tensor]):
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    return model_dir


def test_checkpoint_kv_scales_load_under_each_spelling(tmp_path):
    scaled = _with_tensors(
        make_tiny_model("llama", tmp_path / "scaled"),
        {
            "model.layers.0.self_attn.k_proj.output_scale": torch.tensor(0.25),
            "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
            "model.layers.1.self_attn.kv_scale": torch.tensor([0.125, 0.375]),  # per head: the largest is kept
            "model.layers.1.self_attn.q_scale": torch.tensor(2.0),  # queries are not quantized: dropped
        },
    )
    layers = load_model(scaled).attention_layers()
    assert [(layer.k_scale.item(), layer.v_scale.item()) for layer in layers] == [(0.25, 0.5), (0.375, 0.375)]
    assert all(layer.k_scale.dtype == torch.float32 and layer.k_scale.dim() == 0 for layer in layers)
    plain = load_model(make_tiny_model("llama", tmp_path / "plain")).attention_layers()
    assert [(layer.k_scale.item(), layer.v_scale.item()) for layer in plain] == [(1.0, 1.0)] * 2
    negative = _with_tensors(
        make_tiny_model("llama", tmp_path / "bad"), {"model.layers.0.self_attn.k_scale": -torch.ones(())}
    )
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.k_scale': a KV cache scale must be finite and > 0"
    ):
        load_model(negative)


LLM_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The quick brown fox",
    "What is the boiling point of water?",
    "Translate 'good morning' into Spanish:",
    "The best way to learn a language is",
    "In 1969, astronauts",
    "A recipe for pancakes needs",
    "Why is the sky blue?",
    "import numpy as np\n",
    "The three laws of motion are",
    "My favourite book is",
]


def _first_divergences(ours: list, full: list) -> list[tuple[int, bool] | None]:
    """Per prompt: None where the greedy tokens are identical, else (first differing step, whether each side's
    token there is in the other's top 5: tests/parity.py's rule for a near-tie)."""
    found = []
    for (our_tokens, our_tops), (full_tokens, full_tops) in zip(ours, full, strict=True):
        step = next((i for i, (a, b) in enumerate(zip(our_tokens, full_tokens, strict=True)) if a != b), None)
        tie = step is not None and our_tokens[step] in full_tops[step] and full_tokens[step] in our_tops[step]
        found.append(None if step is None else (step, tie))
    return found


@pytest.mark.slow
def test_greedy_on_the_embedded_model_parts_from_the_full_precision_cache_only_at_near_ties(smollm2_dir):
    """16 prompts, 32 greedy tokens with each fp8 format against the full-precision cache; prints how many are
    identical and where the rest part.

    Exact agreement is not what is asserted: this model's greedy choices sit on near-ties that fp8's 2-3 mantissa
    bits move, so a count of identical prompts measures the model's ties more than the cache. Measured on CPU:
    e4m3 4/16 identical, the rest parting at tokens 2-30, all within the top 5; K/V rounded to e4m3 inside an fp32
    cache part the same way, and reading the same fp8 values with another summation order alone flips 3 prompts.
    e5m2: 1/16 identical, 14 of 15 partings within the top 5. On another CPU of the same kind, e4m3 kept 3/16
    (mean agreement 15.6 tokens of 32) and e5m2 2/16 (8.6). So e4m3 must part only within the top 5 (both ways)
    and keep at least 2 prompts identical; e5m2, with half e4m3's precision, must do so on 14 prompts and agree
    for fewer tokens on average than e4m3 (a cache that ignored its scales would part at once, outside the top 5)."""
    from pagerail import LLM
    from tests.parity import engine_greedy

    runs = {}
    for kv in ("auto", *FORMATS):
        with LLM(str(smollm2_dir), num_gpu_blocks=128, kv_cache_dtype=kv) as llm:
            runs[kv] = engine_greedy(llm, [llm.tokenizer.encode(prompt) for prompt in LLM_PROMPTS], 32)
    found = {kv: _first_divergences(runs[kv], runs["auto"]) for kv in FORMATS}
    for kv, parts in found.items():
        print(f"{kv}: {parts.count(None)}/16 identical; (first differing token, within top 5) per prompt: {parts}")
    e4m3, e5m2 = found["fp8_e4m3"], found["fp8_e5m2"]
    assert all(part is None or part[1] for part in e4m3) and e4m3.count(None) >= 2, e4m3
    assert sum(part is None or part[1] for part in e5m2) >= 14, e5m2

    def agreement(parts: list) -> float:
        return sum(32 if part is None else part[0] for part in parts) / len(parts)

    assert agreement(e4m3) > agreement(e5m2), (agreement(e4m3), agreement(e5m2))
