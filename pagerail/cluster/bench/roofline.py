"""Compute roofline measured in the run: the model's own matmul shapes timed on the device.

The bound counts only the weight matmuls a workload cannot avoid: every prompt token and every output token
but the last passes through each layer once, and every output token is scored by the LM head. Timing them
at a large row count gives the device's best matmul rate for this model, so the result is the most tokens/s
the device could produce if attention, norms, sampling and scheduling were free.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagerail.cluster.bench.workload import BenchRequest


@dataclass(frozen=True)
class MatmulShapes:
    """(in_features, out_features) of one decoder layer's weights and of the LM head."""

    layer: list[tuple[int, int]]
    num_layers: int
    lm_head: tuple[int, int]
    kv_width: int = 0  # K and V elements one token stores per layer: 2 * kv_heads * head_dim

    @property
    def num_weights(self) -> int:
        """Matmul weights of every layer and the LM head (embeddings and norms are not matmuls)."""
        return sum(k * n for k, n in self.layer) * self.num_layers + self.lm_head[0] * self.lm_head[1]

    @property
    def flops_per_token(self) -> int:
        """Multiply-adds ×2 for one token through every layer and the LM head."""
        return 2 * self.num_weights


def shapes_from_config(model_dir: str | Path) -> MatmulShapes:
    """Llama-family shapes: fused QKV, output projection, fused gate/up, down projection."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    layer = [
        (hidden, (heads + 2 * kv_heads) * head_dim),
        (heads * head_dim, hidden),
        (hidden, 2 * inter),
        (inter, hidden),
    ]
    return MatmulShapes(
        layer=layer,
        num_layers=config.num_hidden_layers,
        lm_head=(hidden, config.vocab_size),
        kv_width=2 * kv_heads * head_dim,
    )


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: first calls pay for allocation and kernel selection
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


@torch.inference_mode()
def measure_roofline(
    shapes: MatmulShapes,
    requests: list[BenchRequest],
    *,
    rows: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int = 5,
) -> dict:
    """Time one layer's matmuls and the LM head at `rows` rows; scale to the workload's token counts."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def weights(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, k, generator=generator).to(device=device, dtype=dtype)
        w = torch.randn(n, k, generator=generator).to(device=device, dtype=dtype)
        return x, w

    layer = [weights(k, n) for k, n in shapes.layer]
    head = weights(*shapes.lm_head)
    layer_s = _time(lambda: [torch.nn.functional.linear(x, w) for x, w in layer], device, repeats)
    head_s = _time(lambda: torch.nn.functional.linear(*head), device, repeats)

    forwarded = sum(r.prompt_len + r.output_len - 1 for r in requests)
    scored = sum(r.output_len for r in requests)
    seconds = forwarded / rows * layer_s * shapes.num_layers + scored / rows * head_s
    layer_flops = 2 * rows * sum(k * n for k, n in shapes.layer)
    return {
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "layer_matmul_gflops": layer_flops / layer_s / 1e9,
        "lm_head_gflops": 2 * rows * shapes.lm_head[0] * shapes.lm_head[1] / head_s / 1e9,
        "flops_per_token": shapes.flops_per_token,
        "seconds": seconds,
        "output_tokens_per_s": scored / seconds,
        "total_tokens_per_s": (sum(r.prompt_len for r in requests) + scored) / seconds,
    }
