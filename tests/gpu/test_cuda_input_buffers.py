"""The persistent input buffers on CUDA (pinned staging, one copy per step, table writes on the device) against
the list-based reference builder, through the same random step sequences as on the CPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("hypothesis")

from tests.test_input_buffers import InputBuffersMachine  # noqa: E402


class CudaInputBuffersMachine(InputBuffersMachine):
    device = torch.device("cuda")


TestCudaInputBuffers = CudaInputBuffersMachine.TestCase
