"""A point-to-point channel for KV blocks between the ranks of two replicas: a process group of its own (gloo on
CPU ranks, NCCL on GPUs) over the sender's ranks (group ranks 0..S-1) and the receiver's (S..S+R-1), set up
beside each rank's tensor-parallel group, which it leaves alone.

Each receiving rank needs its own KV heads of every block; each head comes from the first sending rank that holds
it (with fewer KV heads than ranks, several hold it). Both sides derive the same plan from the two
tensor-parallel sizes, so no message says who sends what.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from pagerail.worker.kv_transfer import kv_heads_of_rank

# A transfer gets this long plus its bytes at the slowest bandwidth a link between replicas should have: a peer that
# died or stopped taking part then fails the move within seconds (the request recomputes) instead of keeping the
# ranks busy, and later moves waiting behind them, for the whole group timeout.
TRANSFER_BASE_S = 10.0
SLOWEST_BYTES_PER_S = 100e6


def transfer_deadline_s(nbytes: int, base_s: float = TRANSFER_BASE_S) -> float:
    """How long one side of a transfer of `nbytes` may wait for the other."""
    return base_s + nbytes / SLOWEST_BYTES_PER_S


def transfer_plan(num_kv_heads: int, senders: int, receivers: int) -> dict[tuple[int, int], list[int]]:
    """(sending rank, receiving rank) → the KV heads that pair moves, in the receiver's order."""
    plan: dict[tuple[int, int], list[int]] = {}
    for receiver in range(receivers):
        for head in kv_heads_of_rank(num_kv_heads, receivers, receiver):
            sender = next(rank for rank in range(senders) if head in kv_heads_of_rank(num_kv_heads, senders, rank))
            plan.setdefault((sender, receiver), []).append(head)
    return plan


def listening_store(host: str, timeout_s: float = 20.0) -> dist.TCPStore:
    """A channel's store, listening already on a port the system picked (its `.port`): group rank 0 hosts it from
    before the port is handed out, so no other process can take the port in between."""
    return dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class KvChannel:
    """This rank's end of a channel: `group_rank` of `senders + receivers`, its store hosted by group rank 0 (which
    passes the store it listens on as `store`)."""

    def __init__(
        self, store_host: str, store_port: int, group_rank: int, senders: int, receivers: int, device: torch.device,
        timeout_s: float = 20.0, transfer_base_s: float = TRANSFER_BASE_S, store: dist.Store | None = None,
    ) -> None:  # fmt: skip
        # Both replicas' ranks join at once when the router opens the channel, so live ones meet within a second;
        # `timeout_s` bounds how long a rank stays busy joining a peer that died meanwhile.
        size = senders + receivers
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(store_host, store_port, size, is_master=group_rank == 0, timeout=timeout)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, group_rank, size)
        else:
            self.group = dist.ProcessGroupGloo(store, group_rank, size, timeout)
        self.group_rank, self.senders, self.receivers, self.device = group_rank, senders, receivers, device
        self.transfer_base_s = transfer_base_s

    def _wait(self, works: list, nbytes: int) -> None:
        """Wait for `works` within the transfer's deadline; a failure closes the channel (it may hold a pending
        operation), so the next move opens a new one."""
        deadline = datetime.timedelta(seconds=transfer_deadline_s(nbytes, self.transfer_base_s))
        try:
            for work in works:
                work.wait(deadline)
        except BaseException:
            self.close()
            raise

    def send(self, blocks: torch.Tensor, num_kv_heads: int) -> int:
        """This sending rank's blocks [n, layers, 2, its heads, block_size, head_dim] to the receivers that need
        them; the bytes sent."""
        rank = self.group_rank
        mine = kv_heads_of_rank(num_kv_heads, self.senders, rank)
        sent, works = 0, []
        for (sender, receiver), heads in transfer_plan(num_kv_heads, self.senders, self.receivers).items():
            if sender != rank:
                continue
            part = blocks[:, :, :, [mine.index(h) for h in heads]].contiguous().to(self.device)
            works.append((self.group.send([part], self.senders + receiver, 0), part))
            sent += part.numel() * part.element_size()
        self._wait([work for work, _ in works], sent)
        return sent

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, num_kv_heads: int) -> torch.Tensor:
        """This receiving rank's heads of the blocks: [n, layers, 2, its heads, block_size, head_dim] on the CPU."""
        receiver = self.group_rank - self.senders
        mine = kv_heads_of_rank(num_kv_heads, self.receivers, receiver)
        n, layers, two, _, block_size, head_dim = shape
        out = torch.empty((n, layers, two, len(mine), block_size, head_dim), dtype=dtype)
        parts = []
        for (sender, to), heads in transfer_plan(num_kv_heads, self.senders, self.receivers).items():
            if to != receiver:
                continue
            part = torch.empty((n, layers, two, len(heads), block_size, head_dim), dtype=dtype, device=self.device)
            parts.append((self.group.recv([part], sender, 0), part, heads))
        self._wait([work for work, _, _ in parts], out.numel() * out.element_size())
        for _, part, heads in parts:
            out[:, :, :, [mine.index(h) for h in heads]] = part.cpu()
        return out

    def close(self) -> None:
        """Leave the channel. On NCCL an operation still pending is aborted with its communicator, before the
        group's watchdog would end the whole process for it."""
        group, self.group = self.group, None
        if group is not None and self.device.type == "cuda":
            group.abort()
