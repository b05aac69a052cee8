"""Applying a finished step to the scheduler's requests: computed counts, sampled tokens, stop conditions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagerail.cluster.core import session_inputs
from pagerail.cluster.core.request import Request, RequestStatus
from pagerail.cluster.core.scheduler_output import SchedulerOutput
from pagerail.cluster.core.speculation import SpecRun
from pagerail.cluster.core.stop_conditions import stop_status

if TYPE_CHECKING:
    from pagerail.cluster.core.scheduler import Scheduler


def apply_step_output(
    scheduler: Scheduler,
    out: SchedulerOutput,
    sampled: dict[int, int],
    constraint_done: frozenset[int],
    logprobs: dict[int, tuple[float, dict[int, float]]] | None,
    spec_runs: dict[int, SpecRun] | None = None,
) -> list[Request]:
    """The body of `Scheduler.update_from_output` (see there); returns the requests that changed."""
    changed: list[Request] = []
    # Runs once per scheduled request per step: the block table is asked to hash only when a block filled
    # (hash_due_at), and stop_status only when some stop rule can fire (the same rules, tested cheaply).
    commit_computed = scheduler.block_table.commit_computed
    hash_due_at = scheduler.block_table.hash_due_at
    running = RequestStatus.RUNNING
    max_model_len = scheduler.max_model_len
    for item in out.scheduled:
        request = item.request
        if item.lookahead:
            request.spec_in_flight = 0
        if request.status is not running and request.finished:
            continue
        if item.lookahead and spec_runs and request.handle in spec_runs:
            # A speculating step: several tokens, or one when the rank found nothing to propose (answered plainly).
            _apply_run(scheduler, item, spec_runs[request.handle], request.handle in constraint_done)
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
            if (
                request.input_open
                and request.num_computed_tokens == request.num_tokens
                and not request.num_inflight_tokens
            ):
                session_inputs.park_until_input(scheduler, request)
            elif (
                item.skip_sampling
                and request.status is running
                and not request.num_inflight_tokens
                and not request.num_pending_samples
                and request.num_computed_tokens == request.num_tokens
            ):
                # The input closed while this chunk was in flight, so it was computed without logits:
                # recompute its last position to sample the first output token (as append_input does for
                # a session that was already waiting for input).
                request.num_computed_tokens -= 1
                request.needs_resync = True
            continue
        outputs = request.output_token_ids
        outputs.append(token_id)
        all_tokens = request.all_token_ids
        all_tokens.append(token_id)
        if logprobs is not None:
            logprob, top = logprobs[request.handle]
            request.logprobs.append(logprob)
            request.top_logprobs.append(top)
        max_tokens = request.max_tokens
        if (
            token_id in request.stop_token_ids
            or (max_tokens is not None and len(outputs) >= max_tokens)
            or len(all_tokens) >= max_model_len
            or (constraint_done and request.handle in constraint_done)
        ):
            status = stop_status(request, token_id, max_model_len, request.handle in constraint_done)
            if status is not None:
                scheduler.finish_request(request, status)
        changed.append(request)
    return changed


def _apply_run(scheduler: Scheduler, item, run: SpecRun, constraint_done: bool = False) -> None:
    """Append a speculating step's tokens one by one (a stop or max_tokens inside the run ends it there), then
    count the positions whose KV the step left valid: the next token's and each kept draft's, one per token."""
    request = item.request
    request.num_pending_samples -= 1
    current = item.epoch == request.epoch
    if current:
        request.num_inflight_tokens -= 1
    outputs, all_tokens = request.output_token_ids, request.all_token_ids
    max_tokens, max_model_len = request.max_tokens, scheduler.max_model_len
    for index, token_id in enumerate(run.tokens):
        outputs.append(token_id)
        all_tokens.append(token_id)
        if run.logprobs is not None:
            logprob, top = run.logprobs[index]
            request.logprobs.append(logprob)
            request.top_logprobs.append(top)
        # The ranks cut a run after the token that completed its constraint: its last token.
        complete = constraint_done and index == len(run.tokens) - 1
        if (
            token_id in request.stop_token_ids
            or (max_tokens is not None and len(outputs) >= max_tokens)
            or len(all_tokens) >= max_model_len
            or complete
        ):
            status = stop_status(request, token_id, max_model_len, complete)
            if status is not None:
                scheduler.finish_request(request, status)
                return
    if current:
        computed = request.num_computed_tokens = request.num_computed_tokens + len(run.tokens)
        due = scheduler.block_table.hash_due_at.get(request.request_id)
        if due is not None and computed >= due:
            # Only kept tokens are in all_token_ids: a rejected draft's slot is past `computed` and never hashed.
            scheduler.block_table.commit_computed(request.request_id, all_tokens, computed)
