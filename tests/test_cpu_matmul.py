"""Large CPU weights at small batches go through a oneDNN copy, everything else through MKL; both give the same
product."""

from __future__ import annotations

import pytest
import torch

from worker.layers import cpu_matmul
from worker.layers.cpu_matmul import (
    ONEDNN_LARGE_ELEMENTS,
    ONEDNN_MAX_ROWS,
    ONEDNN_MAX_ROWS_LARGE,
    ONEDNN_MIN_ELEMENTS,
    attach_onednn_weights,
    linear,
    onednn_max_rows,
)
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
    linear(torch.randn(ONEDNN_MAX_ROWS, 16), weight, weight.to_mkldnn())
    linear(torch.randn(ONEDNN_MAX_ROWS + 1, 16), weight, weight.to_mkldnn())
    linear(torch.randn(ONEDNN_MAX_ROWS + 1, 16), weight, weight.to_mkldnn(), max_rows=ONEDNN_MAX_ROWS_LARGE)
    linear(torch.randn(4, 16), weight, None)
    assert calls == [4, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1]


def test_only_large_weights_get_onednn_and_the_largest_keep_it_for_more_rows():
    assert onednn_max_rows(ONEDNN_MIN_ELEMENTS - 1) == 0
    assert onednn_max_rows(ONEDNN_MIN_ELEMENTS) == ONEDNN_MAX_ROWS
    assert onednn_max_rows(ONEDNN_LARGE_ELEMENTS - 1) == ONEDNN_MAX_ROWS
    assert onednn_max_rows(ONEDNN_LARGE_ELEMENTS) == ONEDNN_MAX_ROWS_LARGE
    assert onednn_max_rows(10, "onednn") == ONEDNN_MAX_ROWS_LARGE
    assert onednn_max_rows(ONEDNN_LARGE_ELEMENTS, "mkl") == 0


@needs_onednn
def test_attach_covers_large_fp32_linear_layers_and_the_lm_head_only(monkeypatch):
    wide = ONEDNN_MIN_ELEMENTS // 16  # 16 x wide reaches the threshold exactly
    model = torch.nn.ModuleDict(
        {
            "column": ColumnParallelLinear(16, wide, bias=True, dtype=torch.float32),
            "row": RowParallelLinear(wide, 16, dtype=torch.float32),
            "head": ParallelLMHead(ONEDNN_LARGE_ELEMENTS // 16, 16, dtype=torch.float32),
            "small": ColumnParallelLinear(16, 32, dtype=torch.float32),
            "bf16": ColumnParallelLinear(16, wide, dtype=torch.bfloat16),
        }
    )
    for parameter in model.parameters():
        parameter.data.normal_()
    assert attach_onednn_weights(model) == 3
    assert model["bf16"].onednn_weight is None  # bf16 stays on the dense path
    assert model["small"].onednn_weight is None and model["small"].onednn_max_rows == 0  # MKL is faster there
    assert model["column"].onednn_max_rows == model["row"].onednn_max_rows == ONEDNN_MAX_ROWS
    assert model["head"].onednn_max_rows == ONEDNN_MAX_ROWS_LARGE
    x = torch.randn(5, 16)
    expected = torch.nn.functional.linear(x, model["column"].weight, model["column"].bias)
    torch.testing.assert_close(model["column"](x), expected, rtol=1e-5, atol=1e-4)
    hidden = torch.randn(3, 16)
    torch.testing.assert_close(
        model["head"].compute_logits(hidden), hidden @ model["head"].weight.T, rtol=1e-5, atol=1e-4
    )

    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "mkl")
    fresh = ColumnParallelLinear(16, wide, dtype=torch.float32)
    assert attach_onednn_weights(fresh) == 0 and fresh.onednn_weight is None
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "onednn")
    small = ColumnParallelLinear(16, 32, dtype=torch.float32)
    assert attach_onednn_weights(small) == 1 and small.onednn_max_rows == ONEDNN_MAX_ROWS_LARGE
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "fast")
    with pytest.raises(ValueError, match="PAGERAIL_CPU_MATMUL must be auto, mkl or onednn"):
        attach_onednn_weights(small)
