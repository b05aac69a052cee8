"""Token-budget scheduler: each step, running requests first, then waiting ones; preempt when memory runs out.

Under the priority policy both queues are kept in (priority, arrival) order, lower first: the running requests
get the step's budget in that order and a preemption takes the last of them, the lowest priority; the waiting
ones are admitted in that order; and an arrival that outranks the last running request preempts it while the
batch has no room for the arrival (no sequence slot, or too few free blocks for its first chunk).

Flex work (batch jobs that only fill spare capacity) comes after every interactive request in both queues, under
either policy: it is admitted only when no interactive request waits, preempted first, preempted by an interactive
arrival the batch has no room for, and given at most `flex_tokens_per_step` of a step while interactive work runs
or waits, so it cannot stretch the interactive requests' steps (their time per token) beyond that.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

from pagerail.cluster.core.admission import check_fits
from pagerail.cluster.core.block_table import BlockTable
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.core.fair_share import VirtualTokenCounters
from pagerail.cluster.core.request import Request, RequestStatus
from pagerail.cluster.core.scheduler_output import PauseMode, ScheduledRequest, SchedulerOutput, SchedulerStats
from pagerail.cluster.core.speculation import SpecRun, follows_run, speculation_room
from pagerail.common.engine_config import SchedulerConfig

logger = logging.getLogger(__name__)

# The block list of an item that needs no new blocks; shared by every such item, so never changed.
NO_NEW_BLOCKS: list[int] = []


def _urgency(request: Request) -> tuple[bool, int, int]:
    """The priority policy's order: interactive before flex, then lower priority value first, then earlier
    arrival (handles count up)."""
    return request.flex, request.priority, request.handle


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_table: BlockTable,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        max_loras: int = 0,
    ) -> None:
        """`max_loras`: distinct LoRA adapters that may run at once (the ranks' device slots; 0: no adapters)."""
        self.config = config
        self.max_loras = max_loras
        self.by_priority = config.scheduling_policy == "priority"
        # Fair share between tenants (cluster/core/fair_share.py); None: off.
        self.fair_share = VirtualTokenCounters() if config.fairness == "vtc" else None
        # Adapters the ranks hold read (cluster/core/lora_readiness.py); a request for another waits, set aside.
        # None: every adapter counts as ready (an engine that does not track reads).
        self.lora_ready: set[int] | None = None
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
        # Tokens flex work may still take in the step being scheduled (None: no cap; see schedule).
        self._flex_room: int | None = None
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
        threshold = self.config.flex_priority_threshold
        if threshold is not None and request.priority >= threshold:
            request.flex = True
        self.requests[request.request_id] = request
        if self.fair_share is not None:
            self.fair_share.arrive(request, self.waiting, self.running)
        self._enqueue(request)

    def append_input(self, request_id: str, token_ids: list[int], final: bool) -> Request:
        """Next chunk of a streaming-input session. A chunk that would not fit is refused, the session unchanged."""
        request = self.requests.get(request_id)
        if request is None or not request.input_open:
            raise ValueError(f"request_id {request_id!r} is not an open streaming-input session")
        num_tokens = request.num_tokens + len(token_ids)
        check_fits(request, num_tokens, self.max_model_len, self.config, self.block_table)
        request.append_input(token_ids)
        request.input_open = not final
        if not request.awaiting_input:
            return request  # still running or waiting: the new tokens are picked up by the next steps
        if not token_ids and not final:
            request.idle_since = self.clock()  # an empty chunk only shows the client is still there
            return request
        del self.idle_sessions[request_id]
        request.idle_since = None
        if not token_ids and request.num_computed_tokens == request.num_tokens:
            # The input ended after its last chunk was computed, but positions computed while input was open
            # kept no logits: recompute the last one to sample the first output token.
            request.num_computed_tokens -= 1
            request.needs_resync = True
        request.status = RequestStatus.WAITING
        self._enqueue(request)
        return request

    def abort(self, request_id: str, stopped: bool = False) -> Request | None:
        """Drop a request wherever it is and free its blocks. `stopped`: its caller found a stop string in its
        text, so it finished (reason "stop") rather than being aborted."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if stopped:
            self.stats.num_stopped_by_caller += 1
        else:
            self.stats.num_aborted += 1
        self.finish_request(request, RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED)
        return request

    def requeue_all(self) -> None:
        """After the workers lost their KV cache: every request recomputes from its tokens so far.

        Running requests go back to the head of the queue in their running order, generated tokens
        kept; streaming-input sessions keep waiting for input with nothing cached.
        """
        for request in reversed(self.running):
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self._enqueue(request, front=True)
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
        expired = self._expire_idle_sessions() if self.idle_sessions else []
        out = SchedulerOutput(finished_handles=self._finished_handles, expired=expired)
        self._finished_handles = []
        if self.pause_mode is PauseMode.ALL:
            return out
        budget = self.config.max_num_batched_tokens
        waiting, running = self.waiting, self.running
        if waiting and running and self.pause_mode is PauseMode.NONE and (self.by_priority or running[-1].flex):
            self._preempt_for_urgent(out)
        fair_victim = None
        if self.fair_share is not None and waiting and running and not out.preempted:
            if self.pause_mode is PauseMode.NONE:
                fair_victim = self._preempt_for_fair_share(out)
        # Flex work's share of this step: capped while interactive work runs or waits (both queues hold
        # interactive requests first); None: no cap.
        interactive = (running and not running[0].flex) or (waiting and not waiting[0].flex)
        self._flex_room = self.config.flex_tokens_per_step if interactive else None
        budget = self._schedule_running(out, budget)
        # A step that preempted for memory admits nobody; one that only freed a slot for fair share admits into it.
        preempted_running = any(r.status is RequestStatus.PREEMPTED and r is not fair_victim for r in out.preempted)
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
        fair_share = self.fair_share
        flex_room = self._flex_room
        # Iterating while a preemption pops from the end is safe: the loop sees the shortened list.
        for request in running:
            if budget <= 0:
                break
            room = budget
            if flex_room is not None and request.flex:
                if flex_room <= 0:
                    break  # flex requests come last: the rest are flex too
                room = min(budget, flex_room)
            # Drafts a speculating step in flight may still add: where it ends is known only once it answers.
            extra = request.spec_in_flight
            position = request.num_computed_tokens + request.num_inflight_tokens
            pending = request.num_pending_samples
            expected = len(request.all_token_ids) + pending
            num_new = expected - position
            if num_new > room:
                num_new = room
            if num_new <= 0 or (pending and request.ends_in_flight(max_model_len)):
                continue
            if extra and not follows_run(request, num_new, extra, position, max_model_len):
                continue
            lookahead = 0
            if spec_lookahead and num_new == 1 and request.speculative and not extra and not request.needs_resync:
                lookahead = speculation_room(request, spec_lookahead, room - 1, max_model_len - position - 1)
            # Slots for this step's tokens, its drafts, and the drafts a step in flight may have kept before it.
            reach = num_new + lookahead + extra
            if position + reach <= slots_owned.get(request.request_id, 0):
                new_blocks = no_new_blocks  # read-only: consumers never change an item's block list
            else:
                new_blocks = self._allocate_or_preempt(request, reach, out)
                if new_blocks is None:
                    break  # the request itself was preempted: only pooling requests (or none) ran after it
            if lookahead:
                if fair_share is not None:
                    fair_share.charge(request, position, 1 + lookahead)
                # Its drafts' KV slots are allocated; the ranks report how many of them it keeps.
                item = ScheduledRequest(request, 1, new_blocks, epoch=request.epoch, lookahead=lookahead)
                scheduled.append(item)
                request.num_inflight_tokens += 1
                request.num_pending_samples = pending + 1
                request.spec_in_flight = lookahead
                budget -= 1 + lookahead
                if flex_room is not None and request.flex:
                    flex_room -= 1 + lookahead
                continue
            if fair_share is not None:
                fair_share.charge(request, position, num_new)
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
            if flex_room is not None and request.flex:
                flex_room -= num_new
        self._flex_room = flex_room
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
            new_blocks = self.block_table.allocate_slots(
                request.request_id, request.all_token_ids, num_tokens, root=request.root_hash
            )
            if new_blocks is not None:
                return new_blocks
            # Out of blocks: parked blocks go first (an idle session's, or a session's whose next chunk waits in
            # the queue; recomputed from the prefix cache later), then the most recently admitted running request's.
            if self._release_parked_blocks(out):
                continue
            victim = self._pop_victim(request)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return None

    def _pop_victim(self, request: Request) -> Request:
        """Take the most recently admitted running request that is not a pooling one, or `request` itself.

        Pooling requests hold every block of their prompt from admission and are never chosen, so they never
        recompute. Only requests after `request` are candidates: this step has not scheduled them yet.
        """
        running = self.running
        for index in range(len(running) - 1, -1, -1):
            candidate = running[index]
            if candidate is request or not candidate.pooling:
                return running.pop(index)
        raise RuntimeError(f"request {request.request_id} needs blocks but is not running")

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        # LoRA adapters that run (or were admitted in this step); a request whose adapter would be one more than
        # the ranks' slots, or whose adapter is still being read, waits, set aside, while the requests behind it
        # go on (vLLM's skipped waiting requests).
        adapters = {r.lora_id for r in self.running if r.lora_id} if self.max_loras else None
        ready = self.lora_ready
        set_aside: list[Request] = []
        while self.waiting and budget > 0 and self._has_sequence_slot(out):
            if self.fair_share is not None:
                self._fair_share_to_front()
            request = self.waiting[0]
            if request.num_inflight_tokens or request.num_pending_samples:
                break  # preempted while a step of it was in flight: it resumes once that step answered
            lora_id = request.lora_id
            if lora_id and (
                (lora_id not in adapters and len(adapters) >= self.max_loras)
                or (ready is not None and lora_id not in ready)
            ):
                set_aside.append(self.waiting.popleft())
                continue
            if request.flex and self._flex_room is not None and self._flex_room <= 0:
                break  # flex requests wait last: the rest are flex too
            cached, hosted = [], []  # the device prefix hit, and the host tier's continuation of it
            # A returning streaming-input session still owns its blocks; everything else starts empty (and looks up).
            admitted = not self.block_table.has_request(request.request_id)
            # A prompt whose logprobs are asked for is computed whole until they are out (the first token):
            # the logprobs come from its rows' logits, which a prefix-cache hit would skip.
            # So is an embedding request's, whose vector pools its prompt rows' hidden states.
            scores_prompt = not request.output_token_ids and (
                request.sampling_params.prompt_logprobs is not None or request.pooling
            )
            if admitted:
                if not scores_prompt:
                    root = request.root_hash
                    cached = self.block_table.find_cached_prefix(request.all_token_ids, root)
                    hosted = self.block_table.find_host_prefix(request.all_token_ids, cached, root)
                request.num_computed_tokens = (len(cached) + len(hosted)) * self.block_table.block_size
            num_new = request.num_tokens - request.num_computed_tokens
            room = budget if not request.flex or self._flex_room is None else min(budget, self._flex_room)
            if not self.config.enable_chunked_prefill and num_new > room:
                break
            num_new = min(num_new, room)
            # A pooling request reserves its whole prompt now: once running it never asks for a block, so it is
            # never out of memory mid-prompt (and never a victim, see _pop_victim).
            reserve = request.num_tokens if request.pooling else request.num_computed_tokens + num_new
            new_blocks = self.block_table.allocate_slots(
                request.request_id,
                request.all_token_ids,
                reserve,
                cached,
                hosted,
                cacheable=not request.pooling,
                root=request.root_hash,
            )
            if new_blocks is None:
                if cached or hosted:
                    request.num_computed_tokens = 0
                if self._release_parked_blocks(out, keep=request):
                    continue
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if lora_id:
                adapters.add(lora_id)
            if admitted:
                self.stats.num_prefix_query_tokens += request.num_tokens
            request.status = RequestStatus.RUNNING
            self._into_running(request)
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
            if self.fair_share is not None:
                self.fair_share.charge(request, request.num_computed_tokens, num_new)
            budget -= num_new
            if request.flex and self._flex_room is not None:
                self._flex_room -= num_new
        self.waiting.extendleft(reversed(set_aside))  # back at the front, in their order
        return budget

    def _has_sequence_slot(self, out: SchedulerOutput) -> bool:
        """Room for one more sequence under max_num_seqs, idle sessions holding blocks included."""
        limit = self._sequence_limit()
        if len(self.running) >= limit:
            return False
        while len(self.running) + self.num_idle_sessions_holding_blocks >= limit:
            if not self._release_idle_session(out):
                return False
        return True

    def _sequence_limit(self) -> int:
        """Sequences that may run at once: max_num_seqs, or the admission cap when it is lower."""
        cap = self.admission_cap
        return self.config.max_num_seqs if cap is None else min(self.config.max_num_seqs, cap)

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
        changed: list[Request] = []
        # Runs once per scheduled request per step: the block table is asked to hash only when a block filled
        # (hash_due_at).
        commit_computed = self.block_table.commit_computed
        hash_due_at = self.block_table.hash_due_at
        running = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        for item in out.scheduled:
            request = item.request
            if item.lookahead:
                request.spec_in_flight = 0
            if request.status is not running and request.finished:
                continue
            if item.lookahead and spec_runs and request.handle in spec_runs:
                # A speculating step: several tokens, or one when the rank found nothing to propose.
                self._apply_run(item, spec_runs[request.handle], request.handle in constraint_done)
                changed.append(request)
                continue
            if not item.skip_sampling:
                request.num_pending_samples -= 1
            if item.epoch == request.epoch:
                request.num_inflight_tokens -= item.num_tokens
                computed = request.num_computed_tokens = request.num_computed_tokens + item.num_tokens
                due = hash_due_at.get(request.request_id)
                if due is not None and computed >= due:
                    # The step succeeded: the blocks it filled may now serve other requests from the prefix cache.
                    commit_computed(request.request_id, request.all_token_ids, computed)
            # else: preempted after this step was scheduled; its sampled token still counts, its KV is gone.
            token_id = sampled.get(request.handle)
            if token_id is None:
                self._after_unsampled_step(request, item.skip_sampling)
                continue
            entry = logprobs[request.handle] if logprobs is not None else None
            done = bool(constraint_done) and request.handle in constraint_done
            status = request.append_output(token_id, entry, max_model_len, done)
            if status is not None:
                self.finish_request(request, status)
            changed.append(request)
        return changed

    def _after_unsampled_step(self, request: Request, skipped_sampling: bool) -> None:
        """A step that sampled nothing for `request`: a session that computed all its input waits for more; a
        chunk computed without logits while the input closed recomputes its last position to sample."""
        if request.input_open and request.num_computed_tokens == request.num_tokens and not request.num_inflight_tokens:
            self._park_until_input(request)
        elif (
            skipped_sampling
            and request.status is RequestStatus.RUNNING
            and not request.num_inflight_tokens
            and not request.num_pending_samples
            and request.num_computed_tokens == request.num_tokens
        ):
            # The input closed while this chunk was in flight, so it was computed without logits: recompute its
            # last position to sample the first output token (as append_input does for a session that was
            # already waiting for input).
            request.num_computed_tokens -= 1
            request.needs_resync = True

    def _apply_run(self, item: ScheduledRequest, run: SpecRun, constraint_done: bool = False) -> None:
        """Append a speculating step's tokens one by one (a stop or max_tokens inside the run ends it there), then
        count the positions whose KV the step left valid: the next token's and each kept draft's, one per token."""
        request = item.request
        request.num_pending_samples -= 1
        current = item.epoch == request.epoch
        if current:
            request.num_inflight_tokens -= 1
        last = len(run.tokens) - 1
        for index, token_id in enumerate(run.tokens):
            entry = run.logprobs[index] if run.logprobs is not None else None
            # The ranks cut a run after the token that completed its constraint: its last token.
            status = request.append_output(token_id, entry, self.max_model_len, constraint_done and index == last)
            if status is not None:
                self.finish_request(request, status)
                return
        if current:
            computed = request.num_computed_tokens = request.num_computed_tokens + len(run.tokens)
            due = self.block_table.hash_due_at.get(request.request_id)
            if due is not None and computed >= due:
                # Only kept tokens are in all_token_ids: a rejected draft's slot is past `computed` and never hashed.
                self.block_table.commit_computed(request.request_id, request.all_token_ids, computed)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request for a reason found outside the scheduler (a worker failure, a quarantine); a caller's
        stop string ends its request through abort(stopped=True)."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, status)

    # -- streaming-input sessions --------------------------------------------------------------

    def _park_until_input(self, request: Request) -> None:
        """A running session computed all the input it has: it waits, out of the batch, for its next chunk."""
        self.running.remove(request)
        request.status = RequestStatus.AWAITING_INPUT
        request.idle_since = self.clock()
        self.idle_sessions[request.request_id] = request

    def _expire_idle_sessions(self) -> list[Request]:
        """Close sessions that waited longer than session_idle_timeout_s for their next chunk."""
        timeout = self.config.session_idle_timeout_s
        now = self.clock()
        expired = [r for r in self.idle_sessions.values() if now - r.idle_since > timeout]
        for request in expired:
            request.error = f"the session received no input for {timeout:g} s (session_idle_timeout) and was closed"
            request.error_code = "session_idle_timeout"
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return expired

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
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._enqueue(request, front=True)

    def _fair_share_to_front(self) -> None:
        """Put first the waiting request fair share admits next: among those of the most urgent priority (all of
        them under fcfs), the first of the tenant with the lowest virtual token counter."""
        waiting = self.waiting
        urgent = self._rank(waiting[0])
        candidates = list(itertools.takewhile(lambda r: self._rank(r) == urgent, waiting))
        chosen = self.fair_share.pick(candidates)
        if chosen is not waiting[0]:
            waiting.remove(chosen)
            waiting.appendleft(chosen)

    def _rank(self, request: Request) -> tuple[bool, int]:
        """How urgent a request's class is: interactive before flex, then (under the priority policy) its
        priority; requests of one rank are served in arrival order (or by fair share)."""
        return request.flex, request.priority if self.by_priority else 0

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at its (priority, arrival) place under the priority policy; else at the back, or
        at the front (`front`: a request that ran before, ahead of those that never did), of its class's part of
        the queue (interactive requests first, then flex)."""
        waiting = self.waiting
        if self.by_priority:
            waiting.insert(bisect.bisect_right(waiting, _urgency(request), key=_urgency), request)
        elif front and not request.flex:
            waiting.appendleft(request)
        elif not front and (request.flex or not waiting or not waiting[-1].flex):
            waiting.append(request)
        elif request.flex:  # a flex request that ran before: ahead of the flex requests that never did
            waiting.insert(next((i for i, r in enumerate(waiting) if r.flex), len(waiting)), request)
        else:  # an interactive arrival: behind the interactive requests, ahead of the flex ones
            waiting.insert(next(i for i, r in enumerate(waiting) if r.flex), request)

    def _into_running(self, request: Request) -> None:
        """Into the running list: at its (priority, arrival) place under the priority policy, else last of its
        class (interactive requests first, then flex): the step's budget goes in this order, and a preemption
        takes the last."""
        running = self.running
        if self.by_priority:
            bisect.insort(running, request, key=_urgency)
        elif not request.flex and running and running[-1].flex:
            running.insert(next(i for i, r in enumerate(running) if r.flex), request)
        else:
            running.append(request)

    def _preempt_for_urgent(self, out: SchedulerOutput) -> None:
        """The most urgent waiting request outranks the least urgent running one (a lower priority, or flex work
        beside an interactive arrival) and the batch has no room for it (no sequence slot, or too few free blocks
        for its first chunk): preempt running requests it outranks, least urgent first, until it has room. It is
        admitted from the next step on (a step that preempted admits nobody)."""
        head = self.waiting[0]
        if head.num_inflight_tokens or head.num_pending_samples:
            return  # preempted with a step in flight: it resumes once that step answered
        if head.lora_id and self.lora_ready is not None and head.lora_id not in self.lora_ready:
            return  # its adapter is still being read: it could not run yet anyway
        limit = self._sequence_limit()
        chunk = min(head.num_tokens - head.num_computed_tokens, self.config.max_num_batched_tokens)
        needed = self.block_table.num_blocks_needed(head.request_id, head.num_computed_tokens + chunk)
        running = self.running
        while running and (len(running) >= limit or self.block_table.num_free_blocks < needed):
            victim = running[-1]
            if self._rank(victim) <= self._rank(head) or victim.pooling:
                return  # nothing less urgent to take room from (a pooling request is never preempted)
            running.pop()
            self._preempt(victim)
            out.preempted.append(victim)

    def _preempt_for_fair_share(self, out: SchedulerOutput) -> Request | None:
        """The request fair share admits next has no sequence slot, and its tenant runs at least one request fewer
        than its weighted share of the slots while another tenant, given as much service or more, runs at least one
        more than its own: preempt the most recently admitted request of that tenant (the most served such one),
        one a step, and admit into its slot. Without it a tenant arriving beside a flood waits for one of the flood's
        requests to end; with shares, two backlogged tenants settle at their shares instead of taking slots from each
        other in turn."""
        running, limit = self.running, self._sequence_limit()
        if len(running) < limit:
            return None  # a slot is free: admission alone serves the fair share
        self._fair_share_to_front()
        waiting, counters = self.waiting, self.fair_share.counters
        weights = {r.tenant: r.tenant_weight for r in itertools.chain(running, waiting)}
        slots_per_weight = limit / sum(weights.values())
        counts: dict[str, int] = {}
        for request in running:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        # Of the tenants fair share would admit next (the lowest counter; ties go by queue order), the first one
        # still within its share of the slots with one more; the victim's tenant keeps at least its share without
        # one. So neither can take the slot back from the other in turn.
        rank, lowest = self._rank(waiting[0]), counters.get(waiting[0].tenant, 0.0)
        head = next(
            (
                r
                for r in itertools.takewhile(lambda r: self._rank(r) == rank, waiting)
                if counters.get(r.tenant, 0.0) <= lowest
                and counts.get(r.tenant, 0) + 1 <= weights[r.tenant] * slots_per_weight
            ),
            None,
        )
        if head is None or head.num_inflight_tokens or head.num_pending_samples:
            return None  # every such tenant holds its share already (or the request has a step in flight)
        if head.lora_id and self.lora_ready is not None and head.lora_id not in self.lora_ready:
            return None
        # A tenant given as much service as the head's (a tenant lifted on arrival ties with the floor) or more.
        floor = counters.get(head.tenant, 0.0)
        victim, most = None, floor
        for request in reversed(running):  # the most recently admitted first
            tenant = request.tenant
            served = counters.get(tenant, 0.0)
            over = counts[tenant] - 1 >= weights[tenant] * slots_per_weight
            if over and served >= most and (victim is None or served > most):
                if self._rank(request) == rank and not request.pooling:
                    victim, most = request, served
        if victim is not None:
            running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if head is not waiting[0]:  # admitted into the slot it freed, ahead of its ties
                waiting.remove(head)
                waiting.appendleft(head)
        return victim

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
