"""Small CPU batches go through the oneDNN weight copy, large ones through MKL; both give the same product."""

from __future__ import annotations

import pytest
import torch

from worker.layers import cpu_matmul
from worker.layers.cpu_matmul import ONEDNN_MAX_ROWS, attach_onednn_weights, linear
from worker.layers.embedding import ParallelLMHead
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 600])
def test_onednn_and_mkl_agree(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(200, 96, generator=generator)
    got = linear(x, weight, weight.to_mkldnn())
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert got.layout == torch.strided and got.shape == (rows, 200)


@needs_onednn
def test_small_batches_take_the_onednn_copy(monkeypatch):
    calls = []
    real = torch._C._nn.mkldnn_linear

    class Spy:
        def __getattr__(self, name):
            return getattr(torch._C._nn, name)

        @staticmethod
        def mkldnn_linear(*args):
            calls.append(args[0].shape[0])
            return real(*args)

    monkeypatch.setattr(cpu_matmul.torch._C, "_nn", Spy())
    weight = torch.randn(32, 16)
    linear(torch.randn(4, 16), weight, weight.to_mkldnn())
    linear(torch.randn(ONEDNN_MAX_ROWS + 1, 16), weight, weight.to_mkldnn())
    linear(torch.randn(4, 16), weight, None)
    assert calls == [4]


@needs_onednn
def test_attach_covers_linear_layers_and_the_lm_head_only(monkeypatch):
    model = torch.nn.ModuleDict(
        {
            "column": ColumnParallelLinear(16, 32, bias=True, dtype=torch.float32),
            "row": RowParallelLinear(32, 16, dtype=torch.float32),
            "head": ParallelLMHead(50, 16, dtype=torch.float32),
            "bf16": ColumnParallelLinear(16, 32, dtype=torch.bfloat16),
        }
    )
    for parameter in model.parameters():
        parameter.data.normal_()
    assert attach_onednn_weights(model) == 3
    assert model["bf16"].onednn_weight is None  # bf16 stays on the dense path
    x = torch.randn(5, 16)
    expected = torch.nn.functional.linear(x, model["column"].weight, model["column"].bias)
    torch.testing.assert_close(model["column"](x), expected, rtol=1e-5, atol=1e-5)
    hidden = torch.randn(3, 16)
    torch.testing.assert_close(model["head"].compute_logits(hidden), hidden @ model["head"].weight.T)

    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "mkl")
    fresh = ColumnParallelLinear(16, 32, dtype=torch.float32)
    assert attach_onednn_weights(fresh) == 0 and fresh.onednn_weight is None
