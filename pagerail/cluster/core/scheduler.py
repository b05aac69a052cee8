"""Token-budget scheduler: each step, running requests first, then waiting ones; preempt when memory runs out."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from pagerail.cluster.core import session_inputs
from pagerail.cluster.core.admission import check_fits
from pagerail.cluster.core.block_table import BlockTable
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.core.request import Request, RequestStatus
from pagerail.cluster.core.scheduler_output import PauseMode, ScheduledRequest, SchedulerOutput, SchedulerStats
from pagerail.cluster.core.speculation import SpecRun, follows_run, speculation_room
from pagerail.cluster.core.step_update import apply_step_output
from pagerail.cluster.core.stop_conditions import ends_in_flight
from pagerail.common.engine_config import SchedulerConfig

logger = logging.getLogger(__name__)

# The block list of an item that needs no new blocks; shared by every such item, so never changed.
NO_NEW_BLOCKS: list[int] = []


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_table: BlockTable,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_table = block_table
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Streaming-input sessions waiting for their next chunk, longest idle first. They may hold blocks, which
        # count against max_num_seqs and are the first to be reclaimed when memory or sequence slots run out.
        self.idle_sessions: dict[str, Request] = {}
        # A lower max_num_seqs for admissions while requests suspected of crashing the workers rejoin one at a
        # time (set by the engine's quarantine); None: max_num_seqs alone.
        self.admission_cap: int | None = None
        self.pause_mode = PauseMode.NONE
        # Speculative decoding: draft tokens a decode may verify after its next token this step (0: none); the
        # engine sets it before each step from its back-off policy.
        self.spec_lookahead = 0
        self.stats = SchedulerStats()
        # Handles the workers must forget, sent with the next step.
        self._finished_handles: list[int] = []

    # -- interface -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request, refusing one that could never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} already exists")
        check_fits(request, request.num_tokens, self.max_model_len, self.config, self.block_table)
        if request.input_open:
            limit = self.config.session_limit
            if self.num_open_sessions >= limit:
                raise QueueFullError(f"{limit} streaming-input sessions are already open (max_sessions); retry later")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def append_input(self, request_id: str, token_ids: list[int], final: bool) -> Request:
        """Next chunk of a streaming-input session (cluster/core/session_inputs.py)."""
        return session_inputs.append_input(self, request_id, token_ids, final)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.stats.num_aborted += 1
        self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def requeue_all(self) -> None:
        """After the workers lost their KV cache: every request recomputes from its tokens so far.

        Running requests go back to the head of the queue in their running order, generated tokens
        kept; streaming-input sessions keep waiting for input with nothing cached.
        """
        for request in reversed(self.running):
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(request)
        self.running.clear()
        for request in self.requests.values():
            request.num_computed_tokens = 0
            request.num_inflight_tokens = 0
            request.num_pending_samples = 0  # the steps in flight are abandoned, their tokens never come
            request.epoch += 1
            request.needs_resync = False
            request.spec_in_flight = 0
        self.block_table.reset()
        self._finished_handles.clear()

    def pause(self, mode: PauseMode) -> None:
        self.pause_mode = mode

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_open_sessions(self) -> int:
        return sum(1 for r in self.requests.values() if r.input_open)

    @property
    def num_idle_sessions_holding_blocks(self) -> int:
        return sum(1 for r in self.idle_sessions.values() if self.block_table.has_request(r.request_id))

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Spend this step's token budget: running requests first, then waiting ones."""
        expired = session_inputs.expire_idle(self) if self.idle_sessions else []
        out = SchedulerOutput(finished_handles=self._finished_handles, expired=expired)
        self._finished_handles = []
        if self.pause_mode is PauseMode.ALL:
            return out
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        preempted_running = any(r.status is RequestStatus.PREEMPTED for r in out.preempted)
        if not preempted_running and self.pause_mode is PauseMode.NONE:
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.kv_offloads, out.kv_loads = self.block_table.take_host_transfers()
        self.stats.record_step(out, self.running, self.block_table)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Runs once per running request per step: properties and helpers are inlined (see next_position,
        # num_tokens_expected, _skips and _add for the same rules spelled out). A step that still fits the
        # request's blocks asks the block table nothing.
        running, scheduled = self.running, out.scheduled
        slots_owned = self.block_table.slots_owned
        no_new_blocks = NO_NEW_BLOCKS
        max_model_len = self.max_model_len
        spec_lookahead = self.spec_lookahead
        # Iterating while a preemption pops from the end is safe: the loop sees the shortened list.
        for request in running:
            if budget <= 0:
                break
            # Drafts a speculating step in flight may still add: where it ends is known only once it answers.
            extra = request.spec_in_flight
            position = request.num_computed_tokens + request.num_inflight_tokens
            pending = request.num_pending_samples
            expected = len(request.all_token_ids) + pending
            num_new = expected - position
            if num_new > budget:
                num_new = budget
            if num_new <= 0 or (pending and ends_in_flight(request, max_model_len)):
                continue
            if extra and not follows_run(request, num_new, extra, position, max_model_len):
                continue
            lookahead = 0
            if spec_lookahead and num_new == 1 and request.speculative and not extra and not request.needs_resync:
                lookahead = speculation_room(request, spec_lookahead, budget - 1, max_model_len - position - 1)
            # Slots for this step's tokens, its drafts, and the drafts a step in flight may have kept before it.
            reach = num_new + lookahead + extra
            if position + reach <= slots_owned.get(request.request_id, 0):
                new_blocks = no_new_blocks  # read-only: consumers never change an item's block list
            else:
                new_blocks = self._allocate_or_preempt(request, reach, out)
                if new_blocks is None:
                    break  # the request itself was preempted: it was the last running one
            if lookahead:
                # Its drafts' KV slots are allocated; the ranks report how many of them it keeps.
                item = ScheduledRequest(request, 1, new_blocks, epoch=request.epoch, lookahead=lookahead)
                scheduled.append(item)
                request.num_inflight_tokens += 1
                request.num_pending_samples = pending + 1
                request.spec_in_flight = lookahead
                budget -= 1 + lookahead
                continue
            skip = position + num_new != expected or request.input_open
            if num_new == 1 and new_blocks is no_new_blocks and not skip and not request.needs_resync:
                # A plain decode: the same item as the request's previous plain decode, unless it lost its KV since.
                item = request.decode_item
                if item is None or item.epoch != request.epoch:
                    item = request.decode_item = ScheduledRequest(
                        request, 1, no_new_blocks, False, False, False, request.epoch, True
                    )
            else:
                item = ScheduledRequest(request, num_new, new_blocks, False, False, skip, request.epoch)
                if skip and not request.input_open:
                    out.has_partial_prefill = True
                if request.needs_resync:
                    # The ranks move back to num_computed_tokens (a last position recomputed for its logits).
                    item.resync, item.new_block_ids = True, self.block_table.block_ids(request.request_id)
                    request.needs_resync = False
            scheduled.append(item)
            request.num_inflight_tokens += num_new
            if not skip:
                request.num_pending_samples = pending + 1
            budget -= num_new
        return budget

    def _add(self, out: SchedulerOutput, item: ScheduledRequest) -> None:
        """Put a request in this step; until the ranks answer, its tokens count as in flight."""
        request = item.request
        item.epoch = request.epoch
        if item.admitted:
            out.has_admissions = True
        if item.skip_sampling and not request.input_open:
            out.has_partial_prefill = True
        request.num_inflight_tokens += item.num_tokens
        if not item.skip_sampling:
            request.num_pending_samples += 1
        out.scheduled.append(item)

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> list[int] | None:
        num_tokens = request.next_position + num_new
        while True:
            new_blocks = self.block_table.allocate_slots(request.request_id, request.all_token_ids, num_tokens)
            if new_blocks is not None:
                return new_blocks
            # Out of blocks: parked blocks go first (an idle session's, or a session's whose next chunk waits in
            # the queue; recomputed from the prefix cache later), then the most recently admitted running request's.
            if self._release_parked_blocks(out):
                continue
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return None

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and self._has_sequence_slot(out):
            request = self.waiting[0]
            if request.num_inflight_tokens or request.num_pending_samples:
                break  # preempted while a step of it was in flight: it resumes once that step answered
            cached, hosted = [], []  # the device prefix hit, and the host tier's continuation of it
            # A returning streaming-input session still owns its blocks; everything else starts empty (and looks up).
            admitted = not self.block_table.has_request(request.request_id)
            if admitted:
                cached = self.block_table.find_cached_prefix(request.all_token_ids)
                hosted = self.block_table.find_host_prefix(request.all_token_ids, cached)
                request.num_computed_tokens = (len(cached) + len(hosted)) * self.block_table.block_size
            num_new = request.num_tokens - request.num_computed_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            new_blocks = self.block_table.allocate_slots(
                request.request_id, request.all_token_ids, request.num_computed_tokens + num_new, cached, hosted
            )
            if new_blocks is None:
                if cached or hosted:
                    request.num_computed_tokens = 0
                if self._release_parked_blocks(out, keep=request):
                    continue
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if admitted:
                self.stats.num_prefix_query_tokens += request.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if cached or hosted:
                self.stats.record_hit(request, len(hosted) * self.block_table.block_size)
            # A new or resumed request gets its whole block list; a session chunk only the new blocks.
            resync = admitted or request.needs_resync
            request.needs_resync = False
            blocks = self.block_table.block_ids(request.request_id) if resync else new_blocks
            self._add(
                out,
                ScheduledRequest(
                    request,
                    num_new,
                    blocks,
                    admitted=admitted,
                    resync=resync,
                    skip_sampling=self._skips(request, num_new),
                ),
            )
            budget -= num_new
        return budget

    def _has_sequence_slot(self, out: SchedulerOutput) -> bool:
        """Room for one more sequence under max_num_seqs, idle sessions holding blocks included."""
        limit = self.config.max_num_seqs
        if self.admission_cap is not None:
            limit = min(limit, self.admission_cap)
        if len(self.running) >= limit:
            return False
        while len(self.running) + self.num_idle_sessions_holding_blocks >= limit:
            if not self._release_idle_session(out):
                return False
        return True

    def _release_idle_session(self, out: SchedulerOutput) -> bool:
        """Take the blocks of the longest-idle session that holds any; False when none does."""
        for request in self.idle_sessions.values():
            if self.block_table.has_request(request.request_id):
                self._release_blocks(request, out)
                return True
        return False

    def _release_parked_blocks(self, out: SchedulerOutput, keep: Request | None = None) -> bool:
        """Take the blocks of a request that holds some without running: an idle session first, else a session
        whose next chunk is queued (from the back of the queue). False when there is none."""
        if self._release_idle_session(out):
            return True
        for request in reversed(self.waiting):
            if request is not keep and self.block_table.has_request(request.request_id):
                self._release_blocks(request, out)
                return True
        return False

    def _release_blocks(self, request: Request, out: SchedulerOutput) -> None:
        logger.info(
            "released the KV blocks of session %s; its %d tokens will be recomputed when it runs again",
            request.request_id,
            request.num_computed_tokens,
            extra={"request_id": request.request_id},
        )
        self._take_blocks(request)
        self.stats.num_idle_sessions_released += 1
        out.preempted.append(request)

    def _skips(self, request: Request, num_new: int) -> bool:
        """True when this step does not end at the last known token, or the input is still open."""
        reaches_end = request.next_position + num_new == request.num_tokens_expected
        return not reaches_end or request.input_open

    # -- after the step ------------------------------------------------------------------------

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[int, int],
        constraint_done: frozenset[int] = frozenset(),
        logprobs: dict[int, tuple[float, dict[int, float]]] | None = None,
        spec_runs: dict[int, SpecRun] | None = None,
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what hit a stop condition.

        `sampled` maps handles to this step's token ids; `logprobs`, when the step returned them, handles to each
        token's logprob and top logprobs. `constraint_done` holds the handles whose output constraint is complete
        with this step's token.

        Returns the requests that changed (got a token or finished), for streaming to callers.
        """
        return apply_step_output(self, out, sampled, constraint_done, logprobs, spec_runs)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, status)

    # -- internals -----------------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        logger.info(
            "preempted request %s: the KV cache ran out of blocks (%d free of %d); %d tokens will be recomputed",
            request.request_id,
            self.block_table.num_free_blocks,
            self.block_table.num_blocks,
            request.num_computed_tokens,
            extra={"request_id": request.request_id},
        )
        self._take_blocks(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _take_blocks(self, request: Request) -> None:
        """Free a request's blocks; it recomputes its tokens (from the prefix cache where it can) when it runs."""
        self.block_table.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_inflight_tokens = 0
        request.epoch += 1
        request.needs_resync = False
        self.stats.num_preemptions += 1

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request: out of its queue, its blocks freed, its handle sent to the workers to forget."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status is RequestStatus.AWAITING_INPUT:
            del self.idle_sessions[request.request_id]
        self.block_table.free(request.request_id)
        request.status = status
        request.input_open = False
        request.decode_item = None  # it points back at the request: a cycle only the garbage collector would break
        del self.requests[request.request_id]
        self._finished_handles.append(request.handle)
        self.stats.num_finished += 1
