"""What the scheduler hands the engine each step (the decision), and the counters it keeps across steps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagerail.cluster.core.request import Request

if TYPE_CHECKING:
    from pagerail.cluster.core.block_table import BlockTable


class PauseMode(enum.Enum):
    NONE = "none"
    NEW = "new"  # hold waiting requests, keep running ones going
    ALL = "all"  # schedule nothing


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: `num_tokens` new tokens starting at `num_computed_tokens`."""

    request: Request
    num_tokens: int
    new_block_ids: list[int]
    # Admitted this step from the waiting queue (new, or back after preemption).
    admitted: bool = False
    # The workers must take the full block list and num_computed_tokens from this step (admitted, or a
    # session whose last token is recomputed for its logits).
    resync: bool = False
    # A streaming-input chunk (not the final one): compute the KV, sample nothing.
    skip_sampling: bool = False
    # The request's epoch when scheduled; an answer for an older epoch confirms no KV (see Request.epoch).
    epoch: int = 0
    # A plain decode: one token, sampled, no new blocks, no resync (what most of a busy step is). The scheduler
    # keeps one such item per request and epoch and hands the same object out step after step (see
    # Scheduler._schedule_running), so it must never be changed once made.
    plain: bool = False
    # Speculative decoding: draft tokens the ranks may verify after this item's one token (their KV slots are
    # allocated); the answer says how many tokens it emitted.
    lookahead: int = 0


@dataclass
class SchedulerOutput:
    """What the scheduler decided for one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Running requests and idle sessions whose blocks were taken away this step.
    preempted: list[Request] = field(default_factory=list)
    finished_handles: list[int] = field(default_factory=list)
    # Sessions closed this step because no input came for session_idle_timeout_s.
    expired: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Some item was admitted from the waiting queue this step (the per-step consumers that look for admissions
    # skip the walk over a batch of running requests without it).
    has_admissions: bool = False
    # Some item is a prefill chunk that does not reach the end of its prompt (for the mixed-step count).
    has_partial_prefill: bool = False
    # Host KV tier copies the ranks make this step: (device block, host slot, before the forward) offloads, then
    # (host slot, device block) loads, before the forward.
    kv_offloads: list[tuple[int, int, bool]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled and not self.finished_handles and not self.preempted


@dataclass
class SchedulerStats:
    """Counters the tests and the benchmark read."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0  # requests a caller aborted (disconnects included)
    num_stopped_by_caller: int = 0  # requests their caller ended on a stop string (finished as "stop", not aborted)
    num_finished: int = 0  # requests that ended, for any reason (so a caller can tell a step ended none)
    num_idle_sessions_released: int = 0  # idle sessions whose blocks were reclaimed (also in num_preemptions)
    num_prefix_hit_tokens: int = 0  # found on the device
    num_host_hit_tokens: int = 0  # found in the host KV tier and loaded back
    num_prefix_query_tokens: int = 0
    num_computed_tokens: int = 0
    num_mixed_steps: int = 0  # steps with a partial prefill chunk next to decodes
    peak_used_slots: int = 0
    peak_utilisation: float = 0.0
    peak_running: int = 0  # most sequences holding KV blocks at once

    def record_hit(self, request: Request, host_tokens: int) -> None:
        """An admission found its first num_computed_tokens cached, `host_tokens` of them in the host tier."""
        request.num_cached_tokens = request.num_computed_tokens
        request.num_host_cached_tokens = host_tokens
        self.num_prefix_hit_tokens += request.num_computed_tokens - host_tokens
        self.num_host_hit_tokens += host_tokens

    def record_step(self, out: SchedulerOutput, running: list[Request], block_table: BlockTable) -> None:
        """Count a scheduled step: its tokens, the running batch's peak, and the KV slots' peak utilisation."""
        self.num_steps += 1
        self.num_computed_tokens += out.num_batched_tokens
        self.peak_running = max(self.peak_running, len(running))
        if out.has_partial_prefill and any(s.num_tokens == 1 and not s.skip_sampling for s in out.scheduled):
            self.num_mixed_steps += 1  # a partial prefill chunk next to decodes
        # Slot utilisation is read at the step that holds the most blocks.
        slots = block_table.num_used_blocks * block_table.block_size
        if slots and slots >= self.peak_used_slots:
            live = sum(r.num_computed_tokens for r in running) + out.num_batched_tokens
            if slots > self.peak_used_slots:
                self.peak_utilisation = 0.0
            self.peak_used_slots = slots
            self.peak_utilisation = max(self.peak_utilisation, live / slots)
