"""Every Triton kernel variant the engine and tests/gpu launch, compiled offline for sm_90 (H100/H200), no GPU.

The kernel wrappers run on CPU tensors of each shape below with the launches recorded, not run
(tests/triton_launches.py); each distinct launch is compiled for GPUTarget("cuda", 90, 32) by the Triton of
this environment and by the GPU image's (3.6, installed beside the venv by the Makefile). The test asserts that
every kernel compiles, fits the 227 KiB of shared memory a block may use on sm_90, and does not spill
registers at bf16 (ptxas -v from the Triton wheel). `python -m tests.test_hopper_builds [image] [--summary]`
prints every variant, or the per-kernel table docs/gpu.md carries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.requirements import TRITON_REQUIRED, missing, require_module

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow

require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)

ROOT = Path(__file__).resolve().parent.parent
# The GPU image's Triton, installed by `make` beside the venv (see the Makefile).
IMAGE_TRITON_VERSION = "3.6.0"
IMAGE_TRITON = Path(os.environ.get("PAGERAIL_IMAGE_TRITON", ROOT / ".venv" / "triton-3.6"))

# (name, query heads, KV heads, head_dim, hidden, intermediate, block_size, per-head q/k norm, dtypes)
SHAPES = [
    ("llama-3.1-8b", 32, 8, 128, 4096, 14336, 16, False, ("bfloat16", "float16", "float32")),
    ("smollm2-135m", 9, 3, 64, 576, 1536, 16, False, ("bfloat16",)),
    ("qwen3-parity-tiny", 8, 2, 32, 256, 768, 16, True, ("bfloat16",)),
    ("tests-gpu-tiny", 4, 2, 16, 64, 128, 16, True, ("bfloat16", "float16", "float32")),
    ("tests-gpu-d80-bs128", 12, 4, 80, 5120, 1536, 128, False, ("bfloat16",)),
    ("tests-gpu-gqa7-bs32", 28, 4, 128, 4096, 14336, 32, False, ("bfloat16",)),
    ("tests-gpu-mha-d64", 16, 16, 64, 1024, 2816, 16, False, ("bfloat16",)),
    ("tests-gpu-gqa8-d256", 8, 1, 256, 2048, 8192, 16, False, ("bfloat16",)),
]

# Shapes whose attention kernels are also built over an fp8 cache (bf16 only): the common head and the widest.
FP8_KV_SHAPES = ("llama-3.1-8b", "tests-gpu-gqa8-d256")


def _launch_shape(name, heads, kv_heads, head_dim, hidden, intermediate, block_size, qk_norm, dtype) -> None:
    """Call every kernel wrapper the engine uses for a model of this shape, with small CPU tensors."""
    import torch

    from pagerail.worker.layers import triton_attention, triton_fused, triton_mixed_attention

    seqs, blocks = 4, 96
    q = torch.zeros(seqs, heads, head_dim, dtype=dtype)
    cache = torch.zeros(2, kv_heads, blocks * block_size, head_dim, dtype=dtype)  # head-major, as the worker's
    key_cache, value_cache = cache[0].transpose(0, 1), cache[1].transpose(0, 1)
    table = torch.zeros(seqs, 4, dtype=torch.long)
    lens = torch.ones(seqs, dtype=torch.long)
    scale = head_dim**-0.5
    triton_attention.paged_decode_attention(q, key_cache, value_cache, table, lens, block_size, scale)
    # The split-context pass: a table wide enough for two partitions.
    wide = torch.zeros(seqs, -(-1024 // block_size), dtype=torch.long)
    triton_attention.paged_decode_attention(
        q, key_cache, value_cache, wide, lens, block_size, scale, partition_size=512
    )
    starts = torch.arange(seqs + 1, dtype=torch.long)
    triton_mixed_attention.paged_mixed_attention(q, key_cache, value_cache, table, starts, lens, block_size, scale)
    x = torch.zeros(seqs, hidden, dtype=dtype)
    weight = torch.ones(hidden, dtype=dtype)
    triton_fused.rms_norm(x, weight, 1e-5)
    triton_fused.rms_norm(x, weight, 1e-5, residual=x.clone())
    qkv = torch.zeros(seqs, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q_view, k_view = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    if qk_norm:
        triton_fused.rms_norm(q_view.view(seqs, heads, head_dim), torch.ones(head_dim, dtype=dtype), 1e-6)
    tables = torch.zeros(256, head_dim // 2)
    triton_fused.rotary_embedding(q_view, k_view, tables, tables, head_dim, torch.zeros(seqs, dtype=torch.long))
    triton_fused.silu_and_mul(torch.zeros(seqs, 2 * intermediate, dtype=dtype))
    if dtype != torch.bfloat16:
        return  # the per-layer options below are built in the serving dtype only, to bound this test's time
    # Every per-layer option at once, the variant with the most live values: a sliding window (Mistral, Gemma,
    # gpt-oss), a logit softcap (Gemma 2) and attention sinks (gpt-oss).
    window, softcap, sinks = 128, 50.0, torch.zeros(heads, dtype=torch.float32)
    options = (window, softcap, sinks)
    triton_attention.paged_decode_attention(q, key_cache, value_cache, table, lens, block_size, scale, *options)
    triton_attention.paged_decode_attention(
        q, key_cache, value_cache, wide, lens, block_size, scale, *options, partition_size=512
    )
    triton_mixed_attention.paged_mixed_attention(
        q, key_cache, value_cache, table, starts, lens, block_size, scale, *options
    )
    if name in FP8_KV_SHAPES:
        # kv_cache_dtype="fp8": e4m3 K/V converted to bf16 in the kernels, the scales read in place (e5m2 differs
        # only in the conversion).
        fp8 = cache.to(torch.float8_e4m3fn)
        keys, values = fp8[0].transpose(0, 1), fp8[1].transpose(0, 1)
        one = torch.ones((), dtype=torch.float32)
        kv = dict(k_scale=one, v_scale=one)
        triton_attention.paged_decode_attention(q, keys, values, table, lens, block_size, scale, **kv)
        triton_attention.paged_decode_attention(
            q, keys, values, wide, lens, block_size, scale, partition_size=512, **kv
        )
        triton_mixed_attention.paged_mixed_attention(q, keys, values, table, starts, lens, block_size, scale, **kv)


def _report() -> None:
    """Entry point of the child process: every variant's build for sm_90 with this process's Triton, as JSON."""
    import time

    import torch
    import triton

    from tests.triton_launches import HopperBuild, LaunchRecorder, build_for_hopper, engine_kernels

    builds, failures = [], []
    # Shapes share variants (the same hidden size, head_dim or block size give the same sm_90 key): each key is
    # compiled once and its build (or failure) reported under every shape and dtype that launches it.
    done: dict[tuple[str, str], HopperBuild | str] = {}
    started = time.perf_counter()
    for name, heads, kv_heads, head_dim, hidden, intermediate, block_size, qk_norm, dtypes in SHAPES:
        for dtype_name in dtypes:
            with LaunchRecorder(forward=False) as recorder:
                _launch_shape(
                    name,
                    heads,
                    kv_heads,
                    head_dim,
                    hidden,
                    intermediate,
                    block_size,
                    qk_norm,
                    getattr(torch, dtype_name),
                )
            for launch in recorder.distinct():
                key = (launch.kernel, launch.key)
                if key not in done:
                    try:
                        done[key] = build_for_hopper(launch)
                    except Exception as error:  # reported with the variant, so one failure names its kernel and shape
                        done[key] = repr(error)[:2000]
                build = done[key]
                if isinstance(build, str):
                    failures.append(dict(shape=name, dtype=dtype_name, kernel=launch.kernel, error=build))
                    continue
                builds.append(dict(shape=name, dtype=dtype_name, **asdict(build)))
    print(
        json.dumps(
            dict(
                triton=triton.__version__,
                kernels=sorted(engine_kernels()),
                builds=builds,
                failures=failures,
                seconds=round(time.perf_counter() - started, 1),
            )
        )
    )


def _start_report(extra_path: Path | None, cache: str) -> subprocess.Popen:
    """`_report()` in a child process with a cold Triton cache, optionally with another Triton first on the path."""
    path = [str(extra_path)] if extra_path else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*path, str(ROOT)]),
        "TRITON_CACHE_DIR": cache,
        "TRITON_DEFAULT_FP_FUSION": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen(
        [sys.executable, "-c", "from tests.test_hopper_builds import _report; _report()"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish_report(child: subprocess.Popen) -> dict:
    try:
        stdout, stderr = child.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    assert child.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    """Both Tritons' reports: two child processes build at once, each compiling on one core, so the module takes
    about as long as the longer of the two."""
    with tempfile.TemporaryDirectory() as this_cache, tempfile.TemporaryDirectory() as image_cache:
        children = {"this": _start_report(None, this_cache)}
        if (IMAGE_TRITON / "triton" / "__init__.py").is_file():
            children["image"] = _start_report(IMAGE_TRITON, image_cache)
        return {name: _finish_report(child) for name, child in children.items()}


def _check(report: dict) -> None:
    assert not report["failures"], json.dumps(report["failures"], indent=1)
    built = {build["kernel"] for build in report["builds"]}
    # Every launchable kernel of the kernel modules was built: a new kernel cannot miss this test.
    assert built == set(report["kernels"]), sorted(set(report["kernels"]) - built)
    for build in report["builds"]:
        where = f"{build['kernel']} for {build['shape']} {build['dtype']} {build['constexprs']}"
        assert build["shared_bytes"] <= 232448, f"{where}: {build['shared_bytes']} bytes of shared memory"
        if build["dtype"] == "bfloat16":
            assert build["spill_stores"] == 0 and build["spill_loads"] == 0, (
                f"{where}: spills {build['spill_stores']}/{build['spill_loads']} bytes with "
                f"{build['registers']} registers"
            )


def test_every_kernel_builds_for_sm90_with_this_triton(reports):
    _check(reports["this"])


def test_every_kernel_builds_for_sm90_with_the_gpu_images_triton(reports):
    if "image" not in reports:
        missing(f"the GPU image's Triton {IMAGE_TRITON_VERSION} is not installed at {IMAGE_TRITON} (make venv)")
    report = reports["image"]
    assert report["triton"] == IMAGE_TRITON_VERSION
    _check(report)


def _table(report: dict) -> str:
    """Markdown: one row per kernel variant at bf16 (registers, spills, shared memory, warps)."""
    rows = [
        "| kernel | shape | constexprs | registers | spills (B) | shared (B) | warps |",
        "|---|---|---|---|---|---|---|",
    ]
    keep = (
        "HEAD_DIM",
        "GROUP_PAD",
        "BLOCK_SIZE",
        "BLOCK_Q",
        "TILE",
        "TILE_N",
        "SPLIT",
        "BLOCK_ROWS",
        "BLOCK_COLS",
        "HAS_RESIDUAL",
        "HEADS",
        "BLOCK",
    )
    for build in report["builds"]:
        if build["dtype"] != "bfloat16":
            continue
        shown = ", ".join(f"{k}={v}" for k, v in build["constexprs"].items() if k in keep)
        rows.append(
            f"| {build['kernel']} | {build['shape']} | {shown} | {build['registers']} | "
            f"{build['spill_stores']} | {build['shared_bytes']} | {build['num_warps']} |"
        )
    return "\n".join(rows)


def _summary(report: dict) -> str:
    """Markdown: per kernel at bf16, Llama-3.1-8B's variants and the most any shape of SHAPES uses."""
    rows = [
        "| kernel | variants | Llama-3.1-8B registers | Llama-3.1-8B shared (B) | max registers | max shared (B) "
        "| spills |",
        "|---|---|---|---|---|---|---|",
    ]
    bf16 = [build for build in report["builds"] if build["dtype"] == "bfloat16"]
    for kernel in sorted({build["kernel"] for build in bf16}):
        mine = [build for build in bf16 if build["kernel"] == kernel]
        llama = [build for build in mine if build["shape"] == "llama-3.1-8b"]
        rows.append(
            f"| {kernel} | {len(mine)} | {'/'.join(str(b['registers']) for b in llama)} | "
            f"{'/'.join(str(b['shared_bytes']) for b in llama)} | {max(b['registers'] for b in mine)} | "
            f"{max(b['shared_bytes'] for b in mine)} | {sum(b['spill_stores'] + b['spill_loads'] for b in mine)} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    which = "image" if "image" in sys.argv[1:] else "this"
    with tempfile.TemporaryDirectory() as cache:
        result = _finish_report(_start_report(IMAGE_TRITON if which == "image" else None, cache))
    print(f"Triton {result['triton']}, {len(result['builds'])} builds in {result['seconds']} s")
    print(_summary(result) if "--summary" in sys.argv else _table(result))
    if result["failures"]:
        print(json.dumps(result["failures"], indent=1))
