"""The persistent block table on a worker: one row per known request, written only where its block list changed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagerail.worker.request_state import RequestState


@dataclass
class _Row:
    """The block-table row one request owns, and how much of its block list the row already holds."""

    index: int
    owner: RequestState  # a reused handle is a different request: it must not inherit the row
    epoch: int  # owner.block_epoch when the row was last written from scratch
    num_blocks: int  # leading entries of the row that equal owner.block_ids; the rest of the row is zero


class PersistentBlockTable:
    """One block-table row per known request, handed out from a free list when the request first runs and returned
    when it is dropped, so rows never move while requests join and leave. A row is written only when its request's
    block list grows (the new entries) or is replaced after preemption (the whole row, and zeros over what the
    previous list or owner left behind).

    In place (the CPU) the table is written through a numpy view of it; on the device path each write is staged as
    a (flat index, value) pair for the caller to apply on the device after its copy.
    """

    def __init__(self, device: torch.device, num_rows: int, num_blocks: int, in_place: bool) -> None:
        self.device = torch.device(device)
        self.in_place = in_place
        self.block_table = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._table_np: np.ndarray | None = None
        self._dirty: list[int] = []  # per row index: leading entries that may be nonzero (the rest are zero)
        self._free: list[int] = []
        self._rows: dict[int, _Row] = {}
        self._grow_table(max(1, num_rows), max(1, num_blocks))

    def release(self, state: RequestState) -> None:
        """Return a dropped request's row to the free list; its stale entries are zeroed when it is reused."""
        row = self._rows.get(state.handle)
        if row is not None and row.owner is state:
            del self._rows[state.handle]
            self._free.append(row.index)

    def sync_rows(self, ordered: list[RequestState], rows: list[int]) -> tuple[list[int], list[int]]:
        """Bring the rows marked -1 in `rows` (ordered's table rows) up to date, filling in their indices; returns
        the device writes (flat indices, values) still to apply, empty in place."""
        writes: tuple[list[int], list[int]] = ([], [])
        stale = [index for index, row in enumerate(rows) if row < 0]
        # Widen first: the device-side table writes are flat indices computed from the width. A current row
        # already fits the table, so only the stale ones can need a wider one.
        self._grow_table(0, max(len(ordered[index].block_ids) for index in stale))
        for index in stale:
            state = ordered[index]
            rows[index] = state.table_row = self._sync_row(state, writes)
        return writes

    def _sync_row(self, state: RequestState, writes: tuple[list[int], list[int]]) -> int:
        """Bring the state's table row up to date with its block list; returns the row index."""
        row = self._rows.get(state.handle)
        if row is None or row.owner is not state:
            if row is not None:
                self._free.append(row.index)  # the handle was reused without the old request being released
            if not self._free:
                self._grow_table(self.block_table.shape[0] + 1, 0)
            row = _Row(self._free.pop(), state, state.block_epoch, 0)
            self._rows[state.handle] = row
        elif row.epoch != state.block_epoch:
            row.epoch, row.num_blocks = state.block_epoch, 0
        blocks, start = state.block_ids, row.num_blocks
        stop = len(blocks)
        # Only a rewrite from the start can leave entries of an older list (or owner) behind the new one.
        clear_to = max(self._dirty[row.index], stop) if start == 0 else stop
        if clear_to > start:
            self._write_row(row.index, start, blocks[start:stop], clear_to - stop, writes)
            self._dirty[row.index] = stop
            row.num_blocks = stop
        return row.index

    def _write_row(
        self, index: int, start: int, blocks: list[int], zeros: int, writes: tuple[list[int], list[int]]
    ) -> None:
        """Entries start.. of one row: the given blocks, then `zeros` zeros (in place, or as device writes)."""
        stop = start + len(blocks)
        if self.in_place:
            self._table_np[index, start:stop] = blocks
            self._table_np[index, stop : stop + zeros] = 0
            return
        base = index * self.block_table.shape[1]
        writes[0].extend(range(base + start, base + stop + zeros))
        writes[1].extend(blocks)
        writes[1].extend([0] * zeros)

    def _grow_table(self, num_rows: int, num_blocks: int) -> None:
        """Make room for `num_rows` rows of `num_blocks` entries, doubling what is too small."""
        old_rows, old_width = self.block_table.shape
        rows = max(old_rows, num_rows if num_rows <= old_rows else max(num_rows, 2 * old_rows))
        width = max(old_width, num_blocks if num_blocks <= old_width else max(num_blocks, 2 * old_width))
        if (rows, width) == (old_rows, old_width):
            return
        table = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        table[:old_rows, :old_width] = self.block_table
        self.block_table = table
        if self.in_place:
            self._table_np = table.numpy()
        self._dirty.extend([0] * (rows - old_rows))
        # Lowest rows first: pop() takes from the end.
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
