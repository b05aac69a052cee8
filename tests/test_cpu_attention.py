"""The native CPU decode kernel against the torch gather path it replaces, and the switch back to torch.

The kernel is built strictly here: a compile error fails these tests, and so does a missing compiler in CI.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pagerail.worker.input_batch import GatherWorkspace
from pagerail.worker.layers import cpu_paged_attention
from pagerail.worker.layers.attention import Attention, AttentionMetadata
from pagerail.worker.layers.cpu_paged_attention import (
    KernelBuildError,
    NativeKernel,
    build_native_kernel,
    find_compiler,
    native_kernel,
)
from tests.native_isa import compiler_targets_avx512, source_without_avx512
from tests.requirements import require

NEEDS_COMPILER = "needs a C compiler (cc or gcc) for the native CPU attention kernel"


@pytest.fixture(scope="module")
def kernel() -> NativeKernel:
    """The shipped kernel, compiled and loaded; its build error, if any, fails the test that asks for it."""
    require(find_compiler(), NEEDS_COMPILER)
    return build_native_kernel()


@pytest.fixture(scope="module")
def generic_kernel(tmp_path_factory) -> NativeKernel:
    """The same source built without its AVX-512 paths: what a CPU without AVX-512 runs, also on one with it."""
    require(find_compiler(), NEEDS_COMPILER)
    scratch = tmp_path_factory.mktemp("generic")
    source = source_without_avx512("paged_attention_cpu.c", "PAGED_ATTENTION_NO_AVX512", scratch)
    return build_native_kernel(source, scratch)


@pytest.fixture
def fresh_native_kernel(monkeypatch):
    """native_kernel() decided anew for one test, with the switch at its default."""
    monkeypatch.delenv("PAGERAIL_CPU_ATTENTION", raising=False)
    native_kernel.cache_clear()
    yield
    native_kernel.cache_clear()


def _attention_decode(q, cache, block_table, lens, num_kv_heads, block_size):
    """Decode attention as a model layer runs it, through whichever path `Attention` picks."""
    n, num_heads, head_dim = q.shape
    attention = Attention(num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    attention.kv_cache = cache
    workspace = GatherWorkspace(block_size, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    max_slots = block_table.shape[1] * block_size
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_size=block_size,
        num_decodes=n,
        decode_block_table=block_table,
        decode_context_lens=lens,
        decode_mask=(torch.arange(max_slots)[None, :] < lens[:, None])[:, None, None, :],
    )
    meta.decode_key_buffer, meta.decode_value_buffer = workspace.buffers(block_table.numel())
    return attention._decode(q, cache[0], cache[1], meta)


def _torch_decode(q, cache, block_table, lens, num_kv_heads, block_size):
    os.environ["PAGERAIL_CPU_ATTENTION"] = "torch"
    native_kernel.cache_clear()
    try:
        return _attention_decode(q, cache, block_table, lens, num_kv_heads, block_size)
    finally:
        del os.environ["PAGERAIL_CPU_ATTENTION"]
        native_kernel.cache_clear()


@pytest.mark.parametrize("build", ["default", "generic"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    # The AVX-512 paths' head sizes (32, 64, 128) with 1 to 4 query heads per KV head, blocks shorter than, equal
    # to and longer than their 16 keys at a time; and shapes left to the generic loop (8 query heads per KV head,
    # head size 16, blocks of 1).
    [
        (9, 3, 64, 16), (4, 4, 32, 8), (6, 3, 32, 16), (8, 2, 64, 32), (12, 4, 64, 64), (8, 4, 128, 16),
        (4, 1, 128, 16), (8, 1, 128, 32), (16, 2, 16, 1),
    ],
)  # fmt: skip
def test_native_decode_matches_torch_gather(
    kernel, generic_kernel, build, num_heads, num_kv_heads, head_dim, block_size
):
    kernel = kernel if build == "default" else generic_kernel
    q, cache, table, lens = _decode_inputs(num_heads, num_kv_heads, head_dim, block_size)
    got = kernel.decode(q, cache[0], cache[1], table, lens, block_size, head_dim**-0.5)
    want = _torch_decode(q, cache, table, lens, num_kv_heads, block_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", ["default", "generic"])
def test_native_decode_is_exact_when_every_score_is_far_below_zero(kernel, generic_kernel, build):
    """Scores around -150: a softmax whose maximum is taken over anything but the real scores (say, a block's
    unused lanes at 0) underflows every weight to zero and returns NaN."""
    kernel = kernel if build == "default" else generic_kernel
    q, cache, table, lens = _decode_inputs(9, 3, 64, 16)
    q = torch.full_like(q, 10.0)
    cache[0] = -cache[0].abs() - 1.0  # every key entry negative: every dot product far below zero
    got = kernel.decode(q, cache[0], cache[1], table, lens, 16, 64**-0.5)
    want = _torch_decode(q, cache, table, lens, 3, 16)
    assert torch.isfinite(got).all()
    # Scores of this size carry their float rounding into the weights: a looser bound than for unit scores.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _decode_inputs(num_heads, num_kv_heads, head_dim, block_size):
    """Queries, a [2, kv_heads, slots, d] cache, a scattered block table and context lengths for 7 decodes."""
    generator = torch.Generator().manual_seed(num_heads * head_dim)
    n = 7
    lens = torch.tensor([1, 2, block_size, block_size + 1, 3 * block_size - 1, 70, 5], dtype=torch.long)
    max_blocks = int(-(-lens.max() // block_size))
    num_blocks = n * max_blocks + 3
    cache = torch.randn(2, num_kv_heads, num_blocks * block_size, head_dim, generator=generator)
    # Blocks scattered over the cache, and padding entries pointing at block 0 as the scheduler leaves them.
    table = torch.randperm(num_blocks, generator=generator)[: n * max_blocks].view(n, max_blocks).clone()
    for row, length in enumerate(lens.tolist()):
        table[row, -(-length // block_size) :] = 0
    q = torch.randn(n, num_heads, head_dim, generator=generator)
    return q, cache, table, lens


def test_the_default_build_takes_the_avx512_paths_exactly_where_the_compiler_targets_avx512(kernel, generic_kernel):
    assert kernel.isa == (512 if compiler_targets_avx512() else 0)
    assert generic_kernel.isa == 0


def test_kernel_declines_what_it_cannot_run(kernel):
    assert kernel.supports(9, 3, 64, torch.float32)
    assert not kernel.supports(9, 3, 64, torch.bfloat16)
    assert not kernel.supports(64, 1, 64, torch.float32)  # a 64-head group exceeds the kernel's scratch
    assert not kernel.supports(8, 8, 512, torch.float32)


def test_environment_switch_selects_the_torch_path(monkeypatch):
    monkeypatch.setenv("PAGERAIL_CPU_ATTENTION", "torch")
    native_kernel.cache_clear()
    try:
        assert cpu_paged_attention.native_kernel() is None
    finally:
        native_kernel.cache_clear()


def test_decode_attention_runs_in_the_native_kernel(kernel, fresh_native_kernel, monkeypatch):
    """Where the kernel builds, the attention layer really decodes through it instead of falling back to torch."""
    used = native_kernel()
    assert used is not None, "the kernel builds, yet decode attention fell back to torch"
    calls = []
    decode = used.decode

    def counting_decode(*args, **kwargs):
        calls.append(args[0].shape)
        return decode(*args, **kwargs)

    monkeypatch.setattr(used, "decode", counting_decode)
    q, cache, table, lens = _decode_inputs(9, 3, 64, 16)
    got = _attention_decode(q, cache, table, lens, 3, 16)
    assert calls == [q.shape]
    torch.testing.assert_close(got, _torch_decode(q, cache, table, lens, 3, 16), rtol=1e-5, atol=1e-5)


def _mixed_step(paged: bool) -> tuple[Attention, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step of a decode (context 10), a prefill chunk after a cached prefix (rows at positions 6..11) and a
    fresh prefill (positions 0..4), block size 4, laid out as InputBuffers lays it; `paged` adds every row's
    table row and context length, the native kernel's one-call view of the same step."""
    from pagerail.worker.layers.attention import PrefillSpan

    bs, heads, kv_heads, dim = 4, 4, 2, 16
    generator = torch.Generator().manual_seed(7)
    attention = Attention(heads, kv_heads, dim, dim**-0.5)
    attention.kv_cache = torch.randn(2, kv_heads, 16 * bs, dim, generator=generator)  # block 0 .. 15
    blocks = {"decode": [3, 7, 1], "chunk": [5, 2, 8], "fresh": [0, 6]}
    positions = [("decode", 9)] + [("chunk", p) for p in range(6, 12)] + [("fresh", p) for p in range(5)]
    slots = [blocks[name][p // bs] * bs + p % bs for name, p in positions]
    q = torch.randn(len(positions), heads * dim, generator=generator)
    k = torch.randn(len(positions), kv_heads * dim, generator=generator)
    v = torch.randn(len(positions), kv_heads * dim, generator=generator)
    keys = torch.arange(12)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_size=bs,
        num_decodes=1,
        decode_block_table=torch.tensor([blocks["decode"]]),
        decode_context_lens=torch.tensor([10]),
        prefills=[
            PrefillSpan(1, 7, torch.tensor(blocks["chunk"]), 12, keys[None, :] <= torch.arange(6, 12)[:, None]),
            PrefillSpan(7, 12),
        ],
    )
    if paged:
        rows = [blocks["decode"]] + [blocks["chunk"]] * 6 + [blocks["fresh"] + [0]] * 5
        meta.paged_block_table = torch.tensor(rows)
        meta.paged_context_lens = torch.tensor([p + 1 for _, p in positions])
    return attention, q, k, v, meta


def test_a_step_of_decodes_and_short_prefill_chunks_runs_as_one_paged_call(kernel, fresh_native_kernel, monkeypatch):
    """The native kernel over every row (each its own query, its context its position + 1) gives what the decode
    kernel plus SDPA over each chunk give, in one call per layer."""
    reference = _mixed_step(paged=False)
    want = reference[0](*reference[1:])
    attention, q, k, v, meta = _mixed_step(paged=True)
    used = native_kernel()
    calls = []
    decode = used.decode

    def counting_decode(*args, **kwargs):
        calls.append(args[0].shape[0])
        return decode(*args, **kwargs)

    monkeypatch.setattr(used, "decode", counting_decode)
    got = attention(q, k, v, meta)
    assert calls == [12], "one call for all twelve rows"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(attention.kv_cache, reference[0].kv_cache), "both wrote the same K/V"


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_missing_compiler_falls_back_to_torch_with_a_warning(fresh_native_kernel, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PAGERAIL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=cpu_paged_attention.__name__):
        assert native_kernel() is None
    assert "uses the slower torch path: no C compiler on PATH" in _warnings(caplog)
    with pytest.raises(KernelBuildError, match="no C compiler on PATH"):
        build_native_kernel(cache_dir=tmp_path)


def test_unrunnable_compiler_is_a_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelBuildError, match="cannot run the C compiler .*no-such-compiler"):
        build_native_kernel(cache_dir=tmp_path)


def _broken_source(tmp_path):
    """A copy of the kernel source with a syntax error (a missing semicolon) appended."""
    source = tmp_path / "paged_attention_cpu.c"
    source.write_text(cpu_paged_attention._SOURCE.read_text() + "\nint pagerail_broken(void) { return 0 }\n")
    return source


def test_compile_error_is_raised_with_the_compiler_output(tmp_path):
    require(find_compiler(), NEEDS_COMPILER)
    source = _broken_source(tmp_path)
    with pytest.raises(KernelBuildError, match="failed with exit status") as raised:
        build_native_kernel(source, cache_dir=tmp_path / "kernels")
    assert f"{source}:" in str(raised.value) and "error" in str(raised.value)  # the compiler's own diagnostic
    assert not list((tmp_path / "kernels").rglob("*.so"))  # nothing half-built is left for a later load


def test_compile_error_when_serving_falls_back_with_the_compiler_output(
    fresh_native_kernel, monkeypatch, tmp_path, caplog
):
    require(find_compiler(), NEEDS_COMPILER)
    monkeypatch.setattr(cpu_paged_attention, "_SOURCE", _broken_source(tmp_path))
    monkeypatch.setenv("PAGERAIL_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=cpu_paged_attention.__name__):
        assert native_kernel() is None
    warnings = _warnings(caplog)
    assert "uses the slower torch path" in warnings and "failed with exit status" in warnings
    assert "pagerail_broken" in warnings  # the compiler's diagnostic quotes the offending line


_FLOAT_MODE_PROBE = """
import sys
import torch
from pagerail.worker.layers.cpu_paged_attention import build_native_kernel

def subnormals_kept():
    return 2.2250738585072014e-308 / 3.0 != 0.0 and torch.tensor([1e-40]).mul(1.0).item() != 0.0

before = subnormals_kept()
kernel = build_native_kernel(cache_dir=__import__("pathlib").Path(sys.argv[1]))
loaded = subnormals_kept()
q, cache = torch.randn(3, 4, 32), torch.randn(2, 2, 8 * 16, 32)
kernel.decode(q, cache[0], cache[1], torch.arange(6).view(3, 2), torch.tensor([5, 17, 32]), 16, 0.2)
print(before, loaded, subnormals_kept())
"""


@pytest.mark.slow
def test_loading_and_running_the_kernel_leave_the_process_float_mode_alone(tmp_path):
    # A library linked with -ffast-math turns on flush-to-zero for the whole process when it is loaded: every
    # later float operation of torch and of the caller would drop its subnormals. A fresh interpreter, so no
    # earlier test has loaded a kernel into it.
    import subprocess
    import sys

    require(find_compiler(), NEEDS_COMPILER)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = [sys.executable, "-c", _FLOAT_MODE_PROBE, str(tmp_path)]
    result = subprocess.run(probe, capture_output=True, text=True, check=False, cwd=repo)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True"]
