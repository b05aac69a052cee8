"""Two real tensor-parallel ranks (processes over gloo) running a mixture-of-experts model, with and without expert
parallelism, against one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.model_harness import prefill_logits
from tests.tiny_models import make_tiny_model
from worker.model_loader import load_model
from worker.parallel_state import TensorParallelGroup

pytestmark = pytest.mark.slow

SIZE = 2


def _rank_main(rank: int, model_dir: str, init_file: str, expert_parallel: bool, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SIZE)
    try:
        tp = TensorParallelGroup(rank, SIZE, dist.group.WORLD)
        model = load_model(model_dir, tp, enable_expert_parallel=expert_parallel)
        ids = torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(1))
        logits = prefill_logits(model, ids)
        if rank == 0:
            torch.save(logits, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("kind", "expert_parallel"), [("qwen2_moe", False), ("qwen2_moe", True), ("mixtral", True)])
def test_two_gloo_ranks_match_one(kind, expert_parallel, tmp_path):
    model_dir = make_tiny_model(kind, tmp_path / kind)
    out_file = tmp_path / "logits.pt"
    mp.start_processes(
        _rank_main,
        args=(str(model_dir), str(tmp_path / "rendezvous"), expert_parallel, str(out_file)),
        nprocs=SIZE,
        start_method="spawn",
    )
    ids = torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(1))
    single = prefill_logits(load_model(model_dir), ids)
    torch.testing.assert_close(torch.load(out_file), single, atol=1e-4, rtol=1e-4)
