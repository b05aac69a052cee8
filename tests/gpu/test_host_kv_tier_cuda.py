"""The host KV tier's copies on CUDA: a freed block's background offload (its own stream) must be done before a
later step overwrites that block, whether or not that step copies anything, and before an import writes its slot."""

from __future__ import annotations

import pytest
import torch

from pagerail.proto import step_pb2
from pagerail.worker.kv_offload import HostKvPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK_SIZE, HEADS, DIM, BLOCKS, LAYERS = 16, 8, 128, 512, 8


def _caches() -> list[torch.Tensor]:
    # Large enough (8 layers of 32 MiB, 128 blocks of 64 KiB copied out of each) that the device-to-host copies
    # are still running when the next kernel is queued, so an unordered overwrite would show.
    return [torch.randn(2, HEADS, BLOCKS * BLOCK_SIZE, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]


def _block(cache: torch.Tensor, block: int) -> torch.Tensor:
    return cache[:, :, block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]


def test_a_step_without_copies_waits_for_the_last_steps_background_offloads_before_overwriting() -> None:
    caches = _caches()
    blocks = list(range(0, 256, 2))
    before = [torch.stack([_block(cache, b) for b in blocks]).clone() for cache in caches]
    pool = HostKvPool(caches, num_slots=len(blocks), block_size=BLOCK_SIZE)
    # Step N: the freed blocks are copied out beside its forward.
    pool.transfer(
        step_pb2.StepBatch(
            offload_blocks=blocks, offload_slots=list(range(len(blocks))), offload_now=[False] * len(blocks)
        )
    )
    # Step N+1 copies nothing and reuses every one of those blocks at once.
    pool.transfer(step_pb2.StepBatch())
    for cache in caches:
        cache.fill_(-1.0)
    # Step N+2 loads them back into other blocks.
    targets = [b + 1 for b in blocks]
    pool.transfer(step_pb2.StepBatch(load_slots=list(range(len(blocks))), load_blocks=targets))
    torch.cuda.synchronize()
    for cache, expected in zip(caches, before, strict=True):
        assert torch.equal(torch.stack([_block(cache, b) for b in targets]), expected)


def test_an_import_waits_for_a_background_copy_into_its_slot() -> None:
    caches = _caches()
    blocks = list(range(128))
    pool = HostKvPool(caches, num_slots=len(blocks), block_size=BLOCK_SIZE)
    pool.transfer(step_pb2.StepBatch(offload_blocks=blocks, offload_slots=blocks, offload_now=[False] * len(blocks)))
    # The tier gave slot 0 to blocks arriving from another replica while the copy into it may still run.
    arriving = torch.full((1, LAYERS, 2, HEADS, BLOCK_SIZE, DIM), 7.0, dtype=torch.bfloat16)
    pool.write([0], arriving)
    torch.cuda.synchronize()
    for layer, host in enumerate(pool.pools):
        assert torch.equal(host[0], arriving[0, layer])
