"""One step's model inputs: the common inputs staged once, then the metadata of the attention backend chosen for it."""

from __future__ import annotations

from pagerail.worker.attention_backends.select import select_backend
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.input_batch import FlatBatch
from pagerail.worker.input_buffers import InputBuffers
from pagerail.worker.request_state import RequestState
from pagerail.worker.staged_step import StepShape


def prepare_step(buffers: InputBuffers, settings: AttentionSettings, scheduled: list[RequestState]) -> FlatBatch | None:
    """The model's inputs for a step of `scheduled`; None when none of them has a token to compute.

    Rows are every decode (one token each), then each prefill chunk. The backend is chosen before staging, since
    what it reads decides the staged layout (Staging), and its metadata is built from the staged views after the
    copy. The split into decodes and prefills is inline, not a helper: this runs every step, where a call costs
    about a microsecond.
    """
    decodes = [s for s in scheduled if s.num_scheduled_tokens == 1]
    prefills = [s for s in scheduled if s.num_scheduled_tokens > 1]
    if not decodes and not prefills:
        return None
    # A decode-only step's row order is its decode list itself (never mutated): no copy of n entries.
    step = StepShape(decodes, prefills, decodes + prefills if prefills else decodes)
    backend = select_backend(step, settings, host_table=buffers.in_place)
    staged = buffers.prepare(step, backend.staging)
    return FlatBatch(
        input_ids=staged.input_ids,
        positions=staged.positions,
        attention=backend.build(staged, settings),
        ordered=step.ordered,
        sample_states=staged.sample_states,
        sample_rows=staged.sample_rows,
    )
