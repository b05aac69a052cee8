"""CPU matmuls: each batch size of a weight shape runs on the library this machine measured fastest (MKL, oneDNN or
the packed kernel); all give the same product, and the measurement is made once per machine."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from pagerail.worker.layers import cpu_matmul
from pagerail.worker.layers.cpu_matmul import (
    HANDICAP,
    LARGE_ROWS,
    MKL,
    ONEDNN,
    ONEDNN_MIN_ELEMENTS,
    PACKED,
    PACKED_MIN_ELEMENTS,
    ROW_BUCKETS,
    CpuWeights,
    attach_cpu_weights,
    choose_buckets,
    linear,
    rows_table,
    stream_timer,
)
from pagerail.worker.layers.embedding import ParallelLMHead
from pagerail.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagerail.worker.layers.native_build import find_compiler
from pagerail.worker.layers.packed_linear import build_packed_linear
from tests.native_isa import compiler_targets_avx512, source_without_avx512
from tests.requirements import require

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
BUCKETS = len(ROW_BUCKETS) + 1


@pytest.fixture(scope="module")
def kernel():
    require(find_compiler(), "needs a C compiler (cc or gcc) for the packed CPU matmul")
    return build_packed_linear()


@pytest.fixture(scope="module")
def avx2_kernel(tmp_path_factory):
    """The AVX2 build of the same source, also on an AVX-512 CPU (where the default build is the AVX-512 one)."""
    require(find_compiler(), "needs a C compiler (cc or gcc) for the packed CPU matmul")
    scratch = tmp_path_factory.mktemp("avx2")
    source = source_without_avx512("packed_linear_cpu.c", "PACKED_LINEAR_NO_AVX512", scratch)
    return build_packed_linear(source, scratch)


def everywhere(library: str, weight: torch.Tensor, kernel=None) -> CpuWeights:
    by_rows, larger = rows_table([library] * BUCKETS)
    if library == ONEDNN:
        return CpuWeights(by_rows, larger, onednn=weight.to_mkldnn())
    return CpuWeights(by_rows, larger, packed=kernel.pack(weight), kernel=kernel)


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


@pytest.fixture
def packed_calls(kernel, monkeypatch) -> list[int]:
    calls: list[int] = []
    real = type(kernel).linear

    def counting(self, x, weight):
        calls.append(x.shape[0])
        return real(self, x, weight)

    monkeypatch.setattr(type(kernel), "linear", counting)
    return calls


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 16, 17, ROW_BUCKETS[-1], ROW_BUCKETS[-1] + 1, 600])
def test_onednn_and_mkl_agree(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(200, 96, generator=generator)
    got = linear(x, weight, everywhere(ONEDNN, weight))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert got.layout == torch.strided and got.shape == (rows, 200)


@pytest.mark.parametrize("build", ["default", "avx2"])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    # Remainders of rows against both builds' passes (6 rows in AVX2, 12 in AVX-512) and the chunks of 96; outputs
    # that are and are not a multiple of the 16-wide panels, an odd and an even number of panels (AVX-512 takes
    # them in pairs, a single row one at a time), and inner sizes of 1 and odd.
    [
        (1, 16, 8), (1, 129, 40), (2, 33, 5), (5, 17, 3), (6, 31, 64), (7, 200, 96), (12, 32, 64), (13, 1, 1),
        (25, 47, 40), (96, 48, 33), (97, 40, 96), (300, 129, 576),
    ],
)  # fmt: skip
def test_packed_kernel_and_mkl_agree(kernel, avx2_kernel, build, rows, out_features, in_features):
    kernel = kernel if build == "default" else avx2_kernel
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    got = linear(x, weight, everywhere(PACKED, weight, kernel))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert got.shape == (rows, out_features) and got.is_contiguous()


def test_the_default_build_uses_avx512_exactly_where_the_compiler_targets_it(kernel, avx2_kernel):
    assert kernel.isa == (512 if compiler_targets_avx512() else 256)
    assert avx2_kernel.isa == 256
    assert kernel.build != avx2_kernel.build  # a different build: choices measured with one do not serve the other


def test_packed_kernel_reads_strided_rows_and_empty_batches(kernel):
    base = torch.randn(9, 160)
    x = base[:, 32:128]  # rows 160 floats apart, 96 wide
    weight = torch.randn(40, 96)
    packed = kernel.pack(weight)
    torch.testing.assert_close(kernel.linear(x, packed), x @ weight.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernel.linear(x.t().contiguous().t(), packed), x @ weight.T, rtol=1e-5, atol=1e-4)
    assert kernel.linear(torch.empty(0, 96), packed).shape == (0, 40)


def test_packed_kernel_refuses_what_it_cannot_run(kernel):
    packed = kernel.pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"expects \[rows, 4\] float32"):
        kernel.linear(torch.randn(2, 5), packed)
    with pytest.raises(ValueError, match="expects"):
        kernel.linear(torch.randn(2, 4, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="packs 2-D float32 CPU weights"):
        kernel.pack(torch.randn(8, 4, dtype=torch.bfloat16))


def test_rows_table_maps_each_row_count_to_its_bucket():
    choices = [MKL, ONEDNN, PACKED, MKL, ONEDNN, PACKED]  # <=1, <=16, <=64, <=128, <=256, larger
    table, larger = rows_table(choices)
    assert len(table) == ROW_BUCKETS[-1] + 1 and table[0] == MKL and table[1] == MKL
    assert table[2] == table[16] == ONEDNN and table[17] == table[64] == PACKED
    assert table[65] == table[128] == MKL and table[129] == table[256] == ONEDNN and larger == PACKED
    with pytest.raises(ValueError, match="expected 6 bucket choices"):
        rows_table(choices[:-1])


@needs_onednn
def test_linear_takes_each_row_count_to_its_library(kernel, onednn_calls, packed_calls):
    weight = torch.randn(32, 16)
    table = rows_table([MKL, ONEDNN, PACKED, MKL, MKL, PACKED])  # oneDNN 2..16, packed 17..64 and above 256
    cpu = CpuWeights(*table, onednn=weight.to_mkldnn(), packed=kernel.pack(weight), kernel=kernel)
    for rows in (1, 2, 16, 17, 64, 65, 256, 257, 600):
        linear(torch.randn(rows, 16), weight, cpu)
    linear(torch.randn(4, 16), weight, None)  # no choice: MKL
    assert onednn_calls == [2, 16]
    assert packed_calls == [17, 64, 257, 600]


def test_each_bucket_goes_to_the_fastest_library_after_its_handicap():
    # Times per bucket (1, 16, 64, 128, 256, larger): oneDNN must win by more than its handicap, the packed kernel
    # by more than its own; the best of the rounds decides, so one slow pass does not.
    mkl = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    onednn = [1.5, 2.0 / 1.3, 3.0 / (HANDICAP[ONEDNN] * 1.01), 4.0 / 1.1, 5.0 / 2, 6.0]
    packed = [0.5, 2.0 / 1.02, 3.0 / 3.0, 4.0, 5.0 / 1.5, 6.0 / 1.1]
    times = {MKL: mkl, ONEDNN: onednn, PACKED: packed}
    buckets = (*ROW_BUCKETS, LARGE_ROWS)
    noise = iter([10.0])

    def timer(rows: int, library: str) -> float:
        if library == MKL and rows == 16:
            return next(noise, mkl[1])
        return times[library][buckets.index(rows)]

    assert choose_buckets(timer, [MKL, ONEDNN, PACKED]) == [PACKED, ONEDNN, PACKED, MKL, ONEDNN, PACKED]
    assert choose_buckets(timer, [MKL, ONEDNN]) == [MKL, ONEDNN, ONEDNN, MKL, ONEDNN, MKL]


@needs_onednn
def test_stream_timer_runs_every_weight_through_the_library_asked_for(kernel, onednn_calls, packed_calls):
    weights = [torch.randn(24, 8) for _ in range(8)]
    copies = {ONEDNN: [w.to_mkldnn() for w in weights], PACKED: [kernel.pack(w) for w in weights]}
    timer = stream_timer(weights, copies, kernel)
    assert timer(16, MKL) > 0 and onednn_calls == [] and packed_calls == []
    assert timer(16, ONEDNN) > 0 and onednn_calls == [16] * 8
    assert timer(16, PACKED) > 0 and packed_calls == [16] * 8
    # Bound by arithmetic from 128 rows on: a quarter of the weights are enough.
    assert timer(LARGE_ROWS, PACKED) > 0 and packed_calls == [16] * 8 + [LARGE_ROWS] * 2


def _model() -> torch.nn.ModuleDict:
    wide = ONEDNN_MIN_ELEMENTS // 16  # 16 x wide reaches oneDNN's threshold exactly
    narrow = PACKED_MIN_ELEMENTS // 16  # and 16 x narrow the packed kernel's
    model = torch.nn.ModuleDict(
        {
            "column": ColumnParallelLinear(16, wide, bias=True, dtype=torch.float32),
            "column_twin": ColumnParallelLinear(16, wide, dtype=torch.float32),
            "row": RowParallelLinear(wide, 16, dtype=torch.float32),
            "head": ParallelLMHead(2 * wide, 16, dtype=torch.float32),
            "mid": ColumnParallelLinear(16, narrow, dtype=torch.float32),
            "small": ColumnParallelLinear(16, narrow - 1, dtype=torch.float32),
            "bf16": ColumnParallelLinear(16, wide, dtype=torch.bfloat16),
        }
    )
    for parameter in model.parameters():
        parameter.data.normal_()
    return model


class FakeMeasure:
    """oneDNN twice as fast as MKL up to 16 rows and the packed kernel four times as fast from 17 to 64 rows, for
    every shape but the head's, where MKL wins everywhere."""

    def __init__(self, head_rows: int) -> None:
        self.head_rows = head_rows
        self.shapes: list[tuple[int, ...]] = []
        self.libraries: list[set[str]] = []

    def __call__(self, weights, copies, kernel):
        shape = tuple(weights[0].shape)
        self.shapes.append(shape)
        self.libraries.append(set(copies))
        assert all(len(c) == len(weights) for c in copies.values()) and all(tuple(w.shape) == shape for w in weights)
        # Streamed past the caches: more weights than the model has of a shape, when it has few.
        assert sum(w.numel() * 4 for w in weights) >= cpu_matmul.STREAM_BYTES
        head = shape[0] == self.head_rows

        def timer(rows: int, library: str) -> float:
            if head:
                return 1.0 if library == MKL else 2.0
            if library == ONEDNN:
                return 0.5 if rows <= 16 else 2.0
            if library == PACKED:
                return 0.25 if 16 < rows <= 64 else 2.0
            return 1.0

        return timer


@needs_onednn
def test_attach_measures_each_shape_once_and_keeps_the_choice_per_machine(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "auto")
    path = tmp_path / "choices.json"
    model = _model()
    measure = FakeMeasure(head_rows=model["head"].weight.shape[0])
    assert attach_cpu_weights(model, path, measure) == 4  # column, its twin (one shape), row, mid
    assert len(measure.shapes) == 4  # column, row, head and mid shapes: each measured once
    assert measure.libraries[:3] == [{ONEDNN, PACKED}] * 3 and measure.libraries[3] == {PACKED}  # mid: below oneDNN's
    assert model["head"].cpu_weights is None  # MKL won everywhere: no copy kept
    assert model["small"].cpu_weights is None  # below the size worth measuring
    assert model["bf16"].cpu_weights is None  # not fp32
    expected = rows_table([ONEDNN, ONEDNN, PACKED, MKL, MKL, MKL])
    for name in ("column", "column_twin", "row"):
        cpu = model[name].cpu_weights
        assert (cpu.by_rows, cpu.larger) == expected and cpu.onednn is not None and cpu.packed is not None
    mid = model["mid"].cpu_weights
    assert (mid.by_rows, mid.larger) == rows_table([MKL, MKL, PACKED, MKL, MKL, MKL]) and mid.onednn is None
    for rows in (5, 40, 300):  # oneDNN, packed, MKL: each gives the reference product
        x = torch.randn(rows, 16)
        reference = torch.nn.functional.linear(x, model["column"].weight, model["column"].bias)
        torch.testing.assert_close(model["column"](x), reference, rtol=1e-5, atol=1e-4)
    saved = json.loads(path.read_text())
    assert saved["row_buckets"] == list(ROW_BUCKETS) and saved["large_rows"] == LARGE_ROWS
    assert len(saved["choices"]) == 4

    # The next load on this machine reads the choices instead of measuring.
    again = _model()
    unused = FakeMeasure(head_rows=-1)
    assert attach_cpu_weights(again, path, unused) == 4 and unused.shapes == []
    assert (again["column"].cpu_weights.by_rows, again["column"].cpu_weights.larger) == expected

    # Choices measured with another build of the packed kernel (an updated source, other flags) are measured again,
    # and saved with the build that measured them.
    other = copy.copy(kernel)
    other.build = "packed_linear_cpu-another-build"
    monkeypatch.setattr(cpu_matmul, "packed_linear_kernel", lambda: other)
    rebuilt = FakeMeasure(head_rows=model["head"].weight.shape[0])
    assert attach_cpu_weights(_model(), path, rebuilt) == 4 and len(rebuilt.shapes) == 4
    assert {entry["packed_build"] for entry in json.loads(path.read_text())["choices"].values()} == {other.build}
    monkeypatch.setattr(cpu_matmul, "packed_linear_kernel", lambda: kernel)
    back = FakeMeasure(head_rows=model["head"].weight.shape[0])
    assert attach_cpu_weights(_model(), path, back) == 4 and len(back.shapes) == 4  # this build's own, again

    # Choices measured among other libraries (here: before the packed kernel could be built) are measured again.
    monkeypatch.setattr(cpu_matmul, "packed_linear_kernel", lambda: None)
    without = FakeMeasure(head_rows=model["head"].weight.shape[0])
    assert attach_cpu_weights(_model(), path, without) == 3  # column, twin, row; mid has only MKL left
    assert without.libraries == [{ONEDNN}] * 3  # column, row and head measured again, mid not at all
    monkeypatch.undo()

    # A damaged file is measured afresh, not trusted.
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "auto")
    path.write_text("{not json")
    fresh = FakeMeasure(head_rows=model["head"].weight.shape[0])
    assert attach_cpu_weights(_model(), path, fresh) == 4 and len(fresh.shapes) == 4


@needs_onednn
def test_the_switch_forces_one_library_and_refuses_anything_else(kernel, tmp_path, monkeypatch):
    never = FakeMeasure(head_rows=-1)
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "mkl")
    model = _model()
    assert attach_cpu_weights(model, tmp_path / "c.json", never) == 0 and model["column"].cpu_weights is None
    everything = rows_table([ONEDNN] * BUCKETS)
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "onednn")
    small = ColumnParallelLinear(16, 32, dtype=torch.float32)
    assert attach_cpu_weights(small, tmp_path / "c.json", never) == 1
    assert (small.cpu_weights.by_rows, small.cpu_weights.larger) == everything and small.cpu_weights.packed is None
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "packed")
    small = ColumnParallelLinear(16, 32, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    small.weight.data.copy_(torch.randn(small.weight.shape, generator=generator))  # torch.empty may hold NaN
    assert attach_cpu_weights(small, tmp_path / "c.json", never) == 1
    assert set(small.cpu_weights.by_rows[1:]) == {PACKED} == {small.cpu_weights.larger} and not small.cpu_weights.onednn
    x = torch.randn(3, 16, generator=generator)
    torch.testing.assert_close(small(x), x @ small.weight.T, rtol=1e-5, atol=1e-5)
    assert never.shapes == []
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "fast")
    with pytest.raises(ValueError, match="PAGERAIL_CPU_MATMUL must be auto, mkl, onednn or packed"):
        attach_cpu_weights(small, tmp_path / "c.json", never)


def test_forcing_the_packed_kernel_where_it_cannot_be_built_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "packed_linear_kernel", lambda: None)
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "packed")
    with pytest.raises(ValueError, match="the packed kernel cannot be built here"):
        attach_cpu_weights(ColumnParallelLinear(16, 32, dtype=torch.float32), tmp_path / "c.json")


def test_a_loaded_model_runs_its_layers_on_the_packed_kernel_with_the_same_results(kernel, tmp_path, monkeypatch):
    """The loader gives every fp32 linear layer of a real model its packed copy, and the model's products match
    the ones MKL gives the same weights."""
    from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
    from pagerail.worker.model_loader import load_model

    model_dir = write_tiny_llama(tmp_path / "model", TinyLlamaShape(), seed=1)
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "packed")
    packed = load_model(model_dir)
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "mkl")
    reference = load_model(model_dir)
    layers = [m for m in packed.modules() if hasattr(m, "cpu_weights")]
    assert layers and all(m.cpu_weights is not None and m.cpu_weights.packed is not None for m in layers)
    assert all(m.cpu_weights is None for m in reference.modules() if hasattr(m, "cpu_weights"))
    hidden = torch.randn(7, packed.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(
            packed.model.layers[0].mlp(hidden), reference.model.layers[0].mlp(hidden), rtol=1e-4, atol=1e-5
        )
        logits, expected = packed.compute_logits(hidden), reference.compute_logits(hidden)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
