"""The fused RMSNorm / add+RMSNorm / RoPE / SiLU-and-mul Triton kernels, run by triton's CPU interpreter, against
the eager torch code of the layer modules; and the CPU forward pass, which must stay bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan
from pagerail.worker.parallel_state import SINGLE_RANK
from tests.tiny_models import tiny_config
from tests.triton_interpreter import interpreted_report

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "float16", "bfloat16")
_MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}

# (name, tokens, hidden, with residual). 576 is SmolLM2's hidden size; 80 is not a power of two either.
NORM_CASES = [("576_t1", 1, 576, False), ("576_t33_res", 33, 576, True), ("80_t7_res", 7, 80, True)]
NORM_CASES += [("4096_t3_res", 3, 4096, True), ("64_t5", 5, 64, False)]
# (name, tokens, q heads, kv heads, head_dim, max positions)
ROPE_CASES = [("d64_gqa4_t9", 9, 8, 2, 64, 4096), ("d128_mha_t1", 1, 4, 4, 128, 2048)]
ROPE_CASES += [("d128_gqa6_t4", 4, 6, 1, 128, 8192), ("d80_gqa2_t3", 3, 4, 2, 80, 300)]
# (name, leading shape, d): 1536 is SmolLM2's intermediate size.
SILU_CASES = [("d1536_t3", (3,), 1536), ("d200_t9", (9,), 200), ("d96_3d", (2, 5), 96)]
# What each comparison may differ by, in units in the last place of the reference value. The rotation and the
# residual add do the same roundings as torch and must agree exactly; the norm sums in another order and SiLU's
# exp is another implementation, which may move a result by one unit (a little more in float32, whose unit is
# smaller than those differences).
ULPS = {"add": 0, "rope": 0, "norm": {"float32": 8, "float16": 1, "bfloat16": 1}}
ULPS["silu"] = ULPS["norm"]
# Whole-model checks (kind, dtype, allowed relative difference); qwen3 adds the per-head q/k norm on [T, H, D].
MODEL_CASES = [("llama", "float32", 1e-5), ("qwen3", "bfloat16", 3e-2)]


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of the last place of `want` in want's dtype (0 when equal)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    exponent = torch.frexp(want.float()).exponent
    unit = torch.ldexp(torch.ones_like(want, dtype=torch.float32), exponent - 1 - _MANTISSA_BITS[want.dtype])
    unit = unit.clamp_min(torch.finfo(want.dtype).tiny)
    return ((got.float() - want.float()).abs() / unit).max().item() if got.numel() else 0.0


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0):
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def _torch_path(fn, *args):
    from pagerail.worker.layers import cpu_fused, triton_fused

    triton_fused.ENABLED = cpu_fused.ENABLED = False
    try:
        return fn(*args)
    finally:
        triton_fused.ENABLED = cpu_fused.ENABLED = True


def _norm_errors(dtype: torch.dtype, generator: torch.Generator) -> dict[str, float]:
    from pagerail.worker.layers.norm import RMSNorm

    errors = {}
    for name, tokens, hidden, with_residual in NORM_CASES:
        norm = RMSNorm(hidden, 1e-5, dtype)
        norm.weight.data = _random((hidden,), dtype, generator, 0.5) + 1
        x = _random((tokens, hidden), dtype, generator, 3.0)
        if not with_residual:
            errors[f"norm/{name}"] = _ulps(norm(x), _torch_path(norm, x))
            continue
        residual = _random((tokens, hidden), dtype, generator, 3.0)
        want, want_residual = _torch_path(norm, x, residual)
        buffer = residual.clone()
        got, got_residual = norm(x, buffer)
        assert got_residual.data_ptr() == buffer.data_ptr(), "the fused add must update the residual in place"
        errors[f"norm/{name}"] = _ulps(got, want)
        errors[f"add/{name}"] = _ulps(got_residual, want_residual)
    # Qwen3's q norm: a [T, H, D] view into a fused qkv row, whose rows are not evenly strided.
    qkv = _random((6, 10 * 128), dtype, generator)
    q = qkv[:, : 8 * 128].reshape(6, 8, 128)
    norm = RMSNorm(128, 1e-6, dtype)
    norm.weight.data = _random((128,), dtype, generator, 0.5) + 1
    errors["norm/per_head_view"] = _ulps(norm(q), _torch_path(norm, q))
    return errors


def _rope_errors(dtype: torch.dtype, generator: torch.Generator) -> dict[str, float]:
    from pagerail.worker.layers.rotary import RotaryEmbedding

    errors = {}
    for name, tokens, heads, kv_heads, head_dim, max_position in ROPE_CASES:
        rope = RotaryEmbedding(head_dim, max_position, {"rope_type": "default", "rope_theta": 500000.0})
        # Positions over the whole cache, the first and last rows included, in no order.
        positions = torch.randint(0, max_position, (tokens,), generator=generator)
        positions[0] = max_position - 1
        if tokens > 1:
            positions[1] = 0
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        qkv = _random((tokens, q_size + 2 * kv_size), dtype, generator, 2.0)
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views, as the model passes them
        want_q, want_k = _torch_path(rope, positions, q, k)
        paths = {"cache": rope(positions, q, k)}
        if name == ROPE_CASES[0][0]:  # the per-step tables path runs the same kernel with another row index
            paths["tables"] = rope.apply(q, k, rope.tables(positions))
        for path, (got_q, got_k) in paths.items():
            errors[f"rope/{name}/{path}"] = max(_ulps(got_q, want_q), _ulps(got_k, want_k))
    return errors


def _silu_errors(dtype: torch.dtype, generator: torch.Generator) -> dict[str, float]:
    from pagerail.worker.layers.activation import SiluAndMul

    act = SiluAndMul()
    errors = {}
    for name, leading, d in SILU_CASES:
        x = _random((*leading, 2 * d), dtype, generator, 4.0)
        errors[f"silu/{name}"] = _ulps(act(x), _torch_path(act, x))
    return errors


def _random_model(kind: str, dtype: torch.dtype, seed: int = 0):
    from pagerail.worker.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config(kind), SINGLE_RANK, dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
    return model


def _prefill(model, input_ids: torch.Tensor, forward=None) -> torch.Tensor:
    """Final hidden states of one whole-prompt prefill into a fresh KV cache."""
    tokens = input_ids.shape[0]
    dtype = model.model.embed_tokens.weight.dtype
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, model.num_kv_heads_per_rank, tokens, model.head_dim, dtype=dtype)
    meta = AttentionMetadata(slot_mapping=torch.arange(tokens), prefills=[PrefillSpan(0, tokens)])
    with torch.inference_mode():
        return (forward or model)(input_ids, torch.arange(tokens), meta)


def _model_errors() -> dict[str, float]:
    """Whole prefill with the fused kernels against the torch path, largest difference relative to the largest
    hidden value. Not bit-exact: the norm's sum order differs, and every layer feeds that on."""
    errors = {}
    for kind, dtype_name, _ in MODEL_CASES:
        model = _random_model(kind, getattr(torch, dtype_name))
        ids = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(1))
        got = _prefill(model, ids).float()
        want = _torch_path(_prefill, model, ids).float()
        errors[f"model/{kind}/{dtype_name}"] = ((got - want).abs().max() / want.abs().max()).item()
    return errors


def _report() -> None:
    """Entry point of the interpreter subprocess: one JSON line of {check name: error}."""
    from pagerail.worker.layers import triton_fused

    assert triton_fused.fused_available(torch.zeros(1)), "the interpreter must be on for CPU tensors"
    errors = {}
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        generator = torch.Generator().manual_seed(0)
        for check in (_norm_errors, _rope_errors, _silu_errors):
            errors.update({f"{key}/{dtype_name}": value for key, value in check(dtype, generator).items()})
    errors.update(_model_errors())
    print(json.dumps(errors))


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    return interpreted_report("tests.test_fused_ops", env={"PAGERAIL_FUSED_OPS": "1"})


@pytest.mark.slow  # the Triton interpreter, in a child process
@pytest.mark.parametrize("op", ["norm", "add", "rope", "silu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_torch(op: str, dtype: str, interpreter_errors: dict[str, float]) -> None:
    allowed = ULPS[op] if isinstance(ULPS[op], int) else ULPS[op][dtype]
    checked = {key: error for key, error in interpreter_errors.items() if key.startswith(f"{op}/") and dtype in key}
    assert checked, f"no {op} checks ran for {dtype}"
    too_far = {key: error for key, error in checked.items() if error > allowed}
    assert not too_far, f"more than {allowed} ulps from torch: {too_far}"


@pytest.mark.slow  # the Triton interpreter, in a child process
@pytest.mark.parametrize(("kind", "dtype", "allowed"), MODEL_CASES)
def test_fused_forward_matches_torch_forward(kind: str, dtype: str, allowed: float, interpreter_errors) -> None:
    # The kernels carry the residual between layers in place; a mistake there would be far above rounding.
    assert interpreter_errors[f"model/{kind}/{dtype}"] <= allowed


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_forward_is_bit_identical_to_adding_residuals_in_place_of_norms(kind: str, dtype: torch.dtype) -> None:
    """The CPU path carries the residual beside the hidden states; it must run exactly the ops of the plain
    pre-norm block `h = h + attn(norm(h)); h = h + mlp(norm(h))`, which is written out here as the reference."""
    from pagerail.worker.layers import triton_fused

    model = _random_model(kind, dtype, seed=3)
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    assert not triton_fused.fused_available(model.model.embed_tokens.weight), "CPU tensors must keep the torch path"

    def plain_forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        inner = model.model
        hidden = inner.embed_tokens(input_ids)
        rope = inner.rotary.tables(positions)
        for layer in inner.layers:
            hidden = hidden + layer.self_attn(rope, layer.input_layernorm(hidden), meta)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return inner.norm(hidden)

    assert torch.equal(_prefill(model, ids), _prefill(model, ids, plain_forward))


def test_residual_norm_on_cpu_adds_out_of_place() -> None:
    from pagerail.worker.layers.norm import RMSNorm

    norm = RMSNorm(8, 1e-6)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    before = residual.clone()
    out, summed = norm(x, residual)
    assert torch.equal(residual, before) and torch.equal(summed, before + x) and torch.equal(out, norm(before + x))


@pytest.mark.slow
def test_switch_and_missing_triton_keep_the_torch_path() -> None:
    # PAGERAIL_FUSED_OPS=0 turns the kernels off even with the interpreter on; without triton the modules run.
    code = (
        "import torch\n"
        "from pagerail.worker.layers import triton_fused\n"
        "assert not triton_fused.ENABLED and not triton_fused.fused_available(torch.zeros(1))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PAGERAIL_FUSED_OPS": "0"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from pagerail.worker.layers import triton_fused\n"
        "from pagerail.worker.layers.norm import RMSNorm\n"
        "assert triton_fused.triton is None and not triton_fused.fused_available(torch.zeros(1))\n"
        "out, residual = RMSNorm(4)(torch.ones(2, 4), torch.ones(2, 4))\n"
        "assert torch.equal(residual, torch.full((2, 4), 2.0))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
