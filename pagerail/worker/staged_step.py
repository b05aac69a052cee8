"""What passes between the input buffers and the attention backends: a step's rows, what to stage, what was staged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagerail.worker.request_state import RequestState


@dataclass(slots=True)
class StepShape:
    """The step's scheduled requests with a token to compute: its decodes (one token each), its prefill chunks,
    and both in row order (decodes first)."""

    decodes: list[RequestState]
    prefills: list[RequestState]
    ordered: list[RequestState]  # decodes + prefills


@dataclass(frozen=True, slots=True)
class Staging:
    """What a backend needs staged beyond the tokens, positions, slots and sample rows.

    all_sequences: a table row and a context length for every scheduled sequence, not only for the decodes.
    query_starts: the first row of each of those sequences, and one past the last row (R + 1 entries).
    """

    all_sequences: bool = False
    query_starts: bool = False


# One prefill chunk: its rows start:end of the flat batch, its first position (also the length of the context cached
# before it) and its block-table row. A plain tuple: one is made per chunk per step, a named one costs 5x as much.
PrefillChunk = tuple[int, int, int, int]


@dataclass(slots=True)
class StagedStep:
    """One step's common inputs after the single copy, as views of the staged buffer, and the host-side facts a
    backend's metadata builder reads. R sequences have their table row and context length staged: the decodes, or
    every sequence when the backend asked for all_sequences."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    sample_rows: torch.Tensor
    context_lens: torch.Tensor  # [R] each staged sequence's context length after this step
    query_starts: torch.Tensor | None  # [R + 1] each one's first row, then the row count; when Staging asked
    sample_states: list[RequestState]
    ordered: list[RequestState]
    num_decodes: int
    max_context: int  # the longest context among the R sequences; 0 when R is 0
    prefills: list[PrefillChunk]
    block_size: int
    block_table: torch.Tensor  # the persistent table on the device
    host_rows: np.ndarray  # [R] the staged table-row indices, in the host buffer
    host_lens: np.ndarray  # [R] the staged context lengths, in the host buffer
    # In place (the CPU): the table as a host array, so rows are gathered with numpy rather than a parallel torch
    # op. On the device path: None, and the staged table-row indices on the device instead.
    host_table: np.ndarray | None
    device_rows: torch.Tensor | None

    @property
    def num_seqs(self) -> int:
        """R: the sequences whose table row and context length are staged."""
        return len(self.host_rows)

    def table_rows(self, count: int, width: int) -> torch.Tensor:
        """[count, width] the block-table rows of the first `count` staged sequences."""
        if self.host_table is not None:
            # numpy's gather: one small single-threaded copy, no parallel region for a few kilobytes.
            return torch.from_numpy(self.host_table[:, :width][self.host_rows[:count]])
        return self.block_table[:, :width].index_select(0, self.device_rows[:count])
