"""The native float32 CPU LoRA kernel against a per-row torch loop: tails of every size, base-model rows left
alone, strided inputs, the threaded path, and a fused projection's off-diagonal B never read.

The kernel is built strictly here: a compile error fails these tests, and so does a missing compiler in CI. The
engine-level parity (the kernel and the grouped torch path, each against transformers with the adapter merged) is
in tests/test_lora.py.
"""

from __future__ import annotations

import pytest
import torch

from pagerail.worker.layers.cpu_lora import LoRAKernel, build_lora_kernel
from pagerail.worker.layers.native_build import find_compiler
from tests.requirements import require


@pytest.fixture(scope="module")
def kernel() -> LoRAKernel:
    require(find_compiler(), "needs a C compiler (cc or gcc) for the native CPU LoRA kernel")
    return build_lora_kernel()


def _grouped(slot_of_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows with an adapter grouped by slot, and each group's (slot, first, end)."""
    listed, segments = [], []
    for slot in sorted(set(slot_of_row.tolist()) - {-1}):
        members = [row for row, s in enumerate(slot_of_row.tolist()) if s == slot]
        segments.append((slot, len(listed), len(listed) + len(members)))
        listed += members
    return torch.tensor(listed, dtype=torch.long), torch.tensor(segments, dtype=torch.long).view(-1, 3)


# (rows, in, output sizes of the parts, rank per part, slots): part widths and outputs that are and are not
# multiples of the kernel's 16-float chunks, row counts around its 4-row blocks, one row, and a prefill-sized
# batch that takes the threaded path.
CASES = [
    (1, 64, (96,), 16, 2),
    (9, 72, (40, 24, 24), 8, 3),
    (13, 128, (128, 64, 64), 16, 4),
    (33, 100, (90, 90), 12, 8),
    (700, 128, (256, 256), 16, 8),
]


@pytest.mark.parametrize(("rows", "in_features", "outputs", "rank", "slots"), CASES)
def test_kernel_matches_a_per_row_loop(kernel, rows, in_features, outputs, rank, slots):
    generator = torch.Generator().manual_seed(rows)
    parts = len(outputs)
    width, out_features = parts * rank, sum(outputs)
    # x as a column slice of a wider matrix: the kernel must honour the row stride.
    x = torch.randn(rows, in_features + 8, generator=generator)[:, 4 : 4 + in_features]
    a_t = torch.randn(slots, in_features, width, generator=generator) * 0.1
    # B's off-diagonal blocks are NaN: a kernel that reads them poisons its output.
    b = torch.full((slots, width, out_features), float("nan"))
    blocks, first = [], 0
    for part, size in enumerate(outputs):
        block = torch.randn(slots, rank, size, generator=generator)
        b[:, part * rank : (part + 1) * rank, first : first + size] = block
        blocks.append((part * rank, rank, first, first + size))
        first += size
    diagonal = torch.nan_to_num(b, nan=0.0)
    slot_of_row = torch.randint(-1, slots, (rows,), generator=generator)
    if rows > 1:
        slot_of_row[0] = -1  # at least one base-model row
    out = torch.randn(rows, out_features, generator=generator)
    want = out.clone()
    for row, slot in enumerate(slot_of_row.tolist()):
        if slot >= 0:
            want[row] += (x[row] @ a_t[slot]) @ diagonal[slot]
    listed, segments = _grouped(slot_of_row)
    kernel.delta(x, out, a_t, b, listed, segments, torch.tensor(blocks, dtype=torch.long))
    assert torch.isfinite(out).all()
    base = slot_of_row < 0
    assert torch.equal(out[base], want[base]), "a base-model row changed"
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_kernel_refuses_a_mismatched_shape(kernel):
    a_t, b = torch.zeros(2, 16, 8), torch.zeros(2, 8, 32)
    rows, segments = torch.tensor([0]), torch.tensor([[0, 0, 1]])
    blocks = torch.tensor([[0, 8, 0, 32]])
    with pytest.raises(ValueError, match="x \\[rows, 16\\]"):
        kernel.delta(torch.zeros(1, 12), torch.zeros(1, 32), a_t, b, rows, segments, blocks)
