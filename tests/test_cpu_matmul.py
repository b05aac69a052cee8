"""CPU matmuls: oneDNN runs the row counts this machine measured it faster at, MKL everything else; both give the
same product, and the measurement is made once per machine."""

from __future__ import annotations

import json

import pytest
import torch

from worker.layers import cpu_matmul
from worker.layers.cpu_matmul import (
    MIN_GAIN,
    ONEDNN_MIN_ELEMENTS,
    ROW_BUCKETS,
    attach_onednn_weights,
    choose_buckets,
    linear,
    rows_table,
    stream_timer,
)
from worker.layers.embedding import ParallelLMHead
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
EVERY_BUCKET = rows_table([True] * len(ROW_BUCKETS))


class LibrarySpy:
    """Records the row count of every oneDNN call, passing it through to the real one."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self._real = torch._C._nn

    def __getattr__(self, name):
        return getattr(self._real, name)

    def mkldnn_linear(self, *args):
        self.calls.append(args[0].shape[0])
        return self._real.mkldnn_linear(*args)


@pytest.fixture
def onednn_calls(monkeypatch) -> list[int]:
    spy = LibrarySpy()
    monkeypatch.setattr(cpu_matmul.torch._C, "_nn", spy)
    return spy.calls


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 16, 17, ROW_BUCKETS[-1], ROW_BUCKETS[-1] + 1, 600])
def test_onednn_and_mkl_agree(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(200, 96, generator=generator)
    got = linear(x, weight, weight.to_mkldnn(), EVERY_BUCKET)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert got.layout == torch.strided and got.shape == (rows, 200)


def test_rows_table_maps_each_row_count_to_its_bucket():
    choices = [False, True, True, False, True]  # <=1, <=16, <=64, <=128, <=256
    table = rows_table(choices)
    assert len(table) == ROW_BUCKETS[-1] + 1 and table[0] is False
    assert table[1] is False and table[2] is table[16] is table[17] is table[64] is True
    assert table[65] is table[128] is False and table[129] is table[256] is True
    assert rows_table([False] * len(ROW_BUCKETS)) == ()


@needs_onednn
def test_linear_takes_the_onednn_copy_only_for_the_chosen_row_counts(onednn_calls):
    weight = torch.randn(32, 16)
    copy = weight.to_mkldnn()
    table = rows_table([False, True, False, False, False])  # oneDNN for 2..16 rows
    for rows in (1, 2, 16, 17, 300):
        linear(torch.randn(rows, 16), weight, copy, table)
    linear(torch.randn(4, 16), weight, None, table)  # no copy: MKL whatever the table says
    linear(torch.randn(4, 16), weight, copy, ())  # no table: MKL
    assert onednn_calls == [2, 16]


def test_a_bucket_goes_to_onednn_only_when_it_wins_by_the_margin():
    mkl = {1: 1.0, 16: 2.0, 64: 3.0, 128: 4.0, 256: 5.0}
    onednn = {1: 1.5, 16: 2.0 / 1.3, 64: 3.0 / MIN_GAIN, 128: 4.0 / 1.05, 256: 5.0 / 2}
    noise = iter([10.0])  # one slow MKL pass of the first bucket must not decide it: the best of the rounds does

    def timer(rows: int, use_onednn: bool) -> float:
        if not use_onednn and rows == 1:
            return next(noise, mkl[1])
        return onednn[rows] if use_onednn else mkl[rows]

    assert choose_buckets(timer) == [False, True, True, False, True]


@needs_onednn
def test_stream_timer_runs_every_weight_through_the_library_asked_for(onednn_calls):
    weights = [torch.randn(24, 8) for _ in range(3)]
    timer = stream_timer(weights, [w.to_mkldnn() for w in weights])
    assert timer(16, False) > 0 and onednn_calls == []
    assert timer(16, True) > 0 and onednn_calls == [16, 16, 16]


def _model() -> torch.nn.ModuleDict:
    wide = ONEDNN_MIN_ELEMENTS // 16  # 16 x wide reaches the threshold exactly
    model = torch.nn.ModuleDict(
        {
            "column": ColumnParallelLinear(16, wide, bias=True, dtype=torch.float32),
            "column_twin": ColumnParallelLinear(16, wide, dtype=torch.float32),
            "row": RowParallelLinear(wide, 16, dtype=torch.float32),
            "head": ParallelLMHead(2 * wide, 16, dtype=torch.float32),
            "small": ColumnParallelLinear(16, 32, dtype=torch.float32),
            "bf16": ColumnParallelLinear(16, wide, dtype=torch.bfloat16),
        }
    )
    for parameter in model.parameters():
        parameter.data.normal_()
    return model


class FakeMeasure:
    """oneDNN twice as fast up to 16 rows for every shape but the head's, where it loses everywhere."""

    def __init__(self, head_rows: int) -> None:
        self.head_rows = head_rows
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, weights, copies):
        shape = tuple(weights[0].shape)
        self.shapes.append(shape)
        assert len(weights) == len(copies) and all(tuple(w.shape) == shape for w in weights)
        # Streamed past the caches: more weights than the model has of a shape, when it has few.
        assert sum(w.numel() * 4 for w in weights) >= cpu_matmul.STREAM_BYTES
        head = shape[0] == self.head_rows
        return lambda rows, use_onednn: (0.5 if use_onednn and rows <= 16 and not head else 1.0)


@needs_onednn
def test_attach_measures_each_large_shape_once_and_keeps_the_choice_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "auto")
    path = tmp_path / "choices.json"
    model = _model()
    measure = FakeMeasure(head_rows=model["head"].weight.shape[0])
    assert attach_onednn_weights(model, path, measure) == 3  # column, its twin (one shape) and row
    assert len(measure.shapes) == 3  # column shape, row shape, head shape: each measured once
    assert model["head"].onednn_weight is None and model["head"].onednn_rows == ()  # oneDNN lost everywhere
    assert model["small"].onednn_weight is None  # below the size worth measuring
    assert model["bf16"].onednn_weight is None  # not fp32
    expected = rows_table([True, True, False, False, False])
    assert model["column"].onednn_rows == model["column_twin"].onednn_rows == model["row"].onednn_rows == expected
    x = torch.randn(5, 16)
    reference = torch.nn.functional.linear(x, model["column"].weight, model["column"].bias)
    torch.testing.assert_close(model["column"](x), reference, rtol=1e-5, atol=1e-4)
    saved = json.loads(path.read_text())
    assert saved["row_buckets"] == list(ROW_BUCKETS) and len(saved["choices"]) == 3

    # The next load on this machine reads the choices instead of measuring.
    again = _model()
    unused = FakeMeasure(head_rows=-1)
    assert attach_onednn_weights(again, path, unused) == 3 and unused.shapes == []
    assert again["column"].onednn_rows == expected

    # A damaged file is measured afresh, not trusted.
    path.write_text("{not json")
    fresh = FakeMeasure(head_rows=model["head"].weight.shape[0])
    assert attach_onednn_weights(_model(), path, fresh) == 3 and len(fresh.shapes) == 3


@needs_onednn
def test_the_switch_forces_either_library_and_refuses_anything_else(tmp_path, monkeypatch):
    never = FakeMeasure(head_rows=-1)
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "mkl")
    model = _model()
    assert attach_onednn_weights(model, tmp_path / "c.json", never) == 0 and model["column"].onednn_weight is None
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "onednn")
    small = ColumnParallelLinear(16, 32, dtype=torch.float32)
    assert attach_onednn_weights(small, tmp_path / "c.json", never) == 1 and small.onednn_rows == EVERY_BUCKET
    assert never.shapes == []
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "fast")
    with pytest.raises(ValueError, match="PAGERAIL_CPU_MATMUL must be auto, mkl or onednn"):
        attach_onednn_weights(small, tmp_path / "c.json", never)
