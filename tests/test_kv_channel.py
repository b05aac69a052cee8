"""The point-to-point KV channel between two replicas' ranks, in real processes over gloo: blocks re-sharded by KV
head between tensor-parallel sizes (two ranks to one, one to two, a replicated head), every value in place."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from pagerail.worker.kv_channel import KvChannel, transfer_plan
from pagerail.worker.kv_transfer import kv_heads_of_rank

pytestmark = pytest.mark.slow

SHAPE = (3, 2, 2, 4, 4, 8)  # blocks, layers, K/V, KV heads, block size, head dim


def _full(num_kv_heads: int) -> torch.Tensor:
    shape = (*SHAPE[:3], num_kv_heads, *SHAPE[4:])
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


# (sending ranks, receiving ranks, KV heads): two ranks to one, one to two, a head both hold, two heads to one rank.
LAYOUTS = [(2, 1, 4), (1, 2, 4), (2, 2, 1), (2, 1, 2)]


def _rank(process: int, ports: list[int], results) -> None:
    """One process takes its part in every layout in turn (a layout of fewer ranks leaves the last ones out), each
    over a channel of its own: the processes and their imports are paid once for all layouts."""
    for layout, ((senders, receivers, heads), port) in enumerate(zip(LAYOUTS, ports, strict=True)):
        if process >= senders + receivers:
            continue
        channel = KvChannel("127.0.0.1", port, process, senders, receivers, torch.device("cpu"), timeout_s=60)
        full = _full(heads)
        if process < senders:
            channel.send(full[:, :, :, kv_heads_of_rank(heads, senders, process)], heads)
        else:
            received = channel.receive((*SHAPE[:3], heads, *SHAPE[4:]), torch.float32, heads)
            expected = full[:, :, :, kv_heads_of_rank(heads, receivers, process - senders)]
            results[(layout, process)] = bool(torch.equal(received, expected))
        channel.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def layout_results() -> dict:
    manager = mp.Manager()
    results = manager.dict()
    ports = [_free_port() for _ in LAYOUTS]
    processes = max(senders + receivers for senders, receivers, _ in LAYOUTS)
    mp.start_processes(_rank, args=(ports, results), nprocs=processes, join=True, start_method="spawn")
    found = dict(results)
    manager.shutdown()
    return found


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=[f"{s}to{r}-heads{h}" for s, r, h in LAYOUTS])
def test_blocks_arrive_whole_with_each_receiving_rank_holding_its_heads(layout_results: dict, layout: int):
    senders, receivers, _ = LAYOUTS[layout]
    received = {rank: ok for (index, rank), ok in layout_results.items() if index == layout}
    assert received == {rank: True for rank in range(senders, senders + receivers)}


def test_the_plan_sends_each_head_once_to_every_rank_that_needs_it() -> None:
    plan = transfer_plan(4, 2, 1)
    assert plan == {(0, 0): [0, 1], (1, 0): [2, 3]}
    assert transfer_plan(4, 1, 2) == {(0, 0): [0, 1], (0, 1): [2, 3]}
    # One KV head held by both sending ranks: the first one sends it, to both receivers.
    assert transfer_plan(1, 2, 2) == {(0, 0): [0], (0, 1): [0]}


def _one_side_waits(group_rank: int, port: int, waiting_rank: int, results) -> None:
    """Rank `waiting_rank` transfers; its peer joins the channel and then takes no part until the waiting side has
    its outcome, or for 6 s at most, longer than the test allows (it stays alive, so no broken connection ends the
    wait)."""
    import time

    channel = KvChannel("127.0.0.1", port, group_rank, 1, 1, torch.device("cpu"), timeout_s=60, transfer_base_s=1.0)
    if group_rank != waiting_rank:
        # Polling for the outcome rather than sleeping the whole 6 s: a side that only ends once its peer leaves
        # still fails the test, with an outcome after 6 s instead of at its deadline.
        idle_until = time.monotonic() + 6
        while waiting_rank not in results and time.monotonic() < idle_until:
            time.sleep(0.05)
        return
    started = time.monotonic()
    try:
        if group_rank == 0:
            channel.send(torch.zeros((64, 2, 2, 1, 16, 64)), 1)  # gloo's send, too, waits for its receive
        else:
            channel.receive((64, 2, 2, 1, 16, 64), torch.float32, 1)
        results[group_rank] = ("finished", time.monotonic() - started, channel.group is None)
    except RuntimeError:
        results[group_rank] = ("failed", time.monotonic() - started, channel.group is None)


@pytest.mark.parametrize("waiting", ["sender", "receiver"])
def test_a_peer_that_takes_no_part_fails_the_transfer_at_its_deadline_not_the_group_timeout(waiting: str) -> None:
    manager = mp.Manager()
    results = manager.dict()
    rank = 0 if waiting == "sender" else 1
    mp.start_processes(_one_side_waits, args=(_free_port(), rank, results), nprocs=2, join=True, start_method="spawn")
    outcome, seconds, closed = results[rank]
    # The deadline is 1 s plus 1 MiB at the slowest bandwidth: about 1.01 s; the group's own timeout is 60 s and the
    # idle peer stays until the outcome is in, or 6 s at most.
    assert outcome == "failed" and 0.9 < seconds < 4.5 and closed


def test_the_store_of_a_channel_holds_its_port_from_the_moment_it_is_handed_out() -> None:
    """Group rank 0 listens before the port goes to the other side: another process binding the port in between
    (what failed moves under parallel load with a probed-then-released port) now cannot, and the channel opens on
    the held store and moves blocks."""
    import threading

    from pagerail.worker.kv_channel import listening_store

    store = listening_store("127.0.0.1", timeout_s=30)
    with socket.socket() as squatter, pytest.raises(OSError):
        squatter.bind(("127.0.0.1", store.port))
    blocks = _full(1)
    received = {}

    def receiver() -> None:
        channel = KvChannel("127.0.0.1", store.port, 1, 1, 1, torch.device("cpu"), timeout_s=30)
        received["blocks"] = channel.receive(tuple(blocks.shape), torch.float32, 1)

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = KvChannel("127.0.0.1", store.port, 0, 1, 1, torch.device("cpu"), timeout_s=30, store=store)
    sender.send(blocks, 1)
    thread.join(timeout=30)
    assert torch.equal(received["blocks"], blocks)
