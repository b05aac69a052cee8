"""The engine loop: schedule, run the step on the workers, fold the sampled tokens back in."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagerail.cluster.core.block_table import BlockTable
from pagerail.cluster.core.engine_metrics import EngineMetrics, EngineSnapshot
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.core.executor import Executor, PendingStep, WorkerGroupError
from pagerail.cluster.core.host_kv_tier import HostKvTier
from pagerail.cluster.core.kv_events import KvEventLog
from pagerail.cluster.core.lora_adapters import LoRAAdapters
from pagerail.cluster.core.lora_readiness import LoRAReadiness
from pagerail.cluster.core.model_info import ModelInfo
from pagerail.cluster.core.quarantine import Quarantine
from pagerail.cluster.core.request import Request, RequestStatus
from pagerail.cluster.core.scheduler import Scheduler
from pagerail.cluster.core.scheduler_output import PauseMode, SchedulerOutput
from pagerail.cluster.core.speculation import SpeculationPolicy, unpack_spec_runs
from pagerail.cluster.core.step_builder import StepMessageBuilder
from pagerail.cluster.core.step_tracing import dispatch_span, end_step_span, start_step_span
from pagerail.common.engine_config import EngineConfig
from pagerail.proto import step_pb2

logger = logging.getLogger(__name__)

# Worker-group restarts in a row before the engine gives up and fails every request (retriable).
DEFAULT_MAX_RESTARTS = 3

# The shortest context worth serving: a cache that cannot hold this many tokens for one sequence is refused.
MIN_USEFUL_CONTEXT = 16

SampledTokens = dict[int, int]
SampledLogprobs = dict[int, tuple[float, dict[int, float]]]


def unpack_result(result: step_pb2.StepResult) -> tuple[SampledTokens, SampledLogprobs | None]:
    """handle → token id, and handle → (logprob, top logprobs) when the step returned logprobs."""
    # Repeated fields are read once as lists, not element by element.
    sampled = dict(zip(result.handles, result.token_ids, strict=True))
    if len(result.logprobs) != len(result.handles):
        return sampled, None
    logprobs: SampledLogprobs = {}
    for i, handle in enumerate(result.handles):
        top = result.top_logprobs[i]
        logprobs[handle] = (result.logprobs[i], dict(zip(top.token_ids, top.logprobs, strict=True)))
    return sampled, logprobs


def keep_prompt_logprobs(out: SchedulerOutput, entries) -> None:
    """Hold each scored prompt token's (logprob, rank, top logprobs) on its request, by position; a prompt scored
    again (a recompute after preemption or a restart) scores the same tokens to the same values."""
    by_handle = {item.request.handle: item.request for item in out.scheduled}
    for entry in entries:
        request = by_handle.get(entry.handle)
        if request is None or request.finished:
            continue
        scored = request.prompt_logprobs
        if scored is None:
            scored = request.prompt_logprobs = []
        if len(scored) < request.num_prompt_tokens:  # a session's prompt grows with each input chunk
            scored.extend([None] * (request.num_prompt_tokens - len(scored)))
        tops = entry.top_logprobs
        for i, (logprob, rank) in enumerate(zip(entry.logprobs, entry.ranks, strict=True)):
            top = dict(zip(tops[i].token_ids, tops[i].logprobs, strict=True)) if tops else {}
            scored[entry.start + i] = (logprob, rank, top)


@dataclass
class _InflightStep:
    """A step handed to the ranks, with what is needed to apply its answer."""

    out: SchedulerOutput
    batch: step_pb2.StepBatch
    pending: PendingStep
    span: object
    started: float
    dispatched: float


class EngineCore:
    """Owns the scheduler and the global block table of one model replica."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        sliding_window: int | None = None,
        pooling_only: bool = False,
        lora_adapters: LoRAAdapters | None = None,
    ) -> None:
        """`pooling_only`: generation requests are refused (an encoder, or --runner pooling). `lora_adapters` checks
        the adapters requests name (default: by their config files alone)."""
        self.config = config
        self.sliding_window = sliding_window
        self.executor = executor
        # The model's context as asked for; the KV cache (and the step budget) may serve less, and a restarted
        # worker group with another block count re-derives it.
        self.context_limit = max_model_len
        self.max_model_len = effective_max_model_len(config, max_model_len, executor.num_blocks)
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pooling_only = pooling_only
        # Block events for a router that follows what this replica's caches hold (cluster/core/kv_events.py).
        self.kv_events = KvEventLog()
        self.block_table = self._new_block_table(executor.num_blocks)
        lora = config.lora
        self.lora_adapters = lora_adapters or LoRAAdapters(lora)
        max_loras = lora.max_loras if lora.enable_lora else 0
        self.scheduler = Scheduler(config.scheduler, self.block_table, self.max_model_len, max_loras=max_loras)
        # Which adapters rank 0 holds read: their requests are scheduled once it does (reads run beside steps).
        self.lora_readiness = LoRAReadiness(lora.host_cache_size)
        if max_loras:
            self.scheduler.lora_ready = self.lora_readiness.ready
        self.speculation = SpeculationPolicy(config.speculative_config)
        self.step_builder = StepMessageBuilder()
        self._handles = itertools.count(1)
        self.metrics = EngineMetrics(config.model_name)
        self.metrics.observe_weights(getattr(executor, "weights", None))
        # Worker-group failures in a row; reset by every successful step.
        self.max_restarts = DEFAULT_MAX_RESTARTS
        self.restart_backoff_s = 0.5
        self._consecutive_failures = 0
        self.num_restarts = 0
        self.num_quarantined = 0
        # Singles out a request that keeps crashing the workers; it sees each step's outcome through the executor.
        self.quarantine = Quarantine(self.scheduler)
        self.last_step_idle = True
        self._lora_news = False  # the last step brought adapters' read news (more may be scheduled at once)
        self.schedule_seconds: deque[float] = deque(maxlen=4096)
        # Steps submitted and not yet applied, oldest first. Two: one runs on the ranks while the next waits
        # there, built from placeholders for the tokens still being sampled. One: strictly serial steps.
        overlap = config.scheduler.async_scheduling
        if overlap is None:
            overlap = bool(getattr(executor, "overlap_by_default", False))
        self.max_inflight_steps = 2 if overlap else 1
        self._inflight: deque[_InflightStep] = deque()
        self.num_overlapped_steps = 0

    @classmethod
    def for_model(cls, config: EngineConfig, executor: Executor, info: ModelInfo) -> EngineCore:
        """The engine of one replica of the model `info` describes: what every entry point (`LLM`, the head actor)
        builds, so a model stops at the same tokens (its EOS ids) within the same context whichever serves it."""
        if info.pooling.encoder:
            # An encoder's prompt is attended as a whole: it runs in one step, never in chunks.
            config = dataclasses.replace(
                config, scheduler=dataclasses.replace(config.scheduler, enable_chunked_prefill=False)
            )
        limit = config.scheduler.context_limit(info.max_position_embeddings)
        return cls(
            config,
            executor,
            limit,
            info.vocab_size,
            info.eos_token_ids,
            info.sliding_window,
            pooling_only=info.pooling.pooling_only,
            lora_adapters=LoRAAdapters(config.lora, info.projection_shapes, info.num_layers),
        )

    def _new_block_table(self, num_blocks: int) -> BlockTable:
        cache = self.config.cache
        host_slots = getattr(self.executor, "num_host_blocks", 0)
        host_tier = HostKvTier(host_slots) if host_slots else None
        return BlockTable(
            num_blocks, cache.block_size, cache.enable_prefix_caching, self.sliding_window, host_tier, self.kv_events
        )

    def add_request(self, request: EngineRequest) -> Request:
        """Queue a new request (final=False: the first chunk of a streaming-input session).

        Its `request_id` must be new: ids are made by the server, and a duplicate is refused, never merged. Its
        `trace_context` is the W3C carrier of the caller's request span, which this request's steps link to.

        A request with `resumed_output_token_ids` starts as a preempted one would: those outputs are already
        its own (they count toward max_tokens and min_tokens, and the ranks seed and penalise by them), they are
        recomputed with the prompt, and sampling continues after them.
        """
        prompt, resumed = request.prompt_token_ids, request.resumed_output_token_ids
        if self.pooling_only and request.pooling is None:
            raise ValueError(
                "this model serves pooling requests only (embeddings, classification, scores); it does not generate"
            )
        if request.lora is not None:
            self.lora_adapters.check(request.lora)
        # The envelope holds ints >= 0 already: only the vocabulary bound is left to check.
        if max(prompt) >= self.vocab_size:
            self._check_tokens(prompt)
        params = request.params
        named = params.token_ids_named()
        if named and max(named) >= self.vocab_size:
            # A stop, biased or allowed id past the vocabulary would index past the logits on every rank.
            raise ValueError(
                f"stop_token_ids, logit_bias and allowed_token_ids must name tokens in [0, {self.vocab_size}), "
                f"got {max(named)}"
            )
        if resumed:
            if max(resumed) >= self.vocab_size:
                self._check_tokens(resumed, "resumed_output_token_ids")
            if params.max_tokens is not None and len(resumed) >= params.max_tokens:
                raise ValueError(
                    f"resumed_output_token_ids already hold {len(resumed)} tokens, max_tokens={params.max_tokens}: "
                    "nothing is left to generate"
                )
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(f"{limit} requests are already waiting (max_waiting_requests); retry shortly")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        queued = Request(
            request,
            handle=next(self._handles),
            stop_token_ids=frozenset(stop),
            input_open=not request.final,
            output_token_ids=list(resumed),
            num_reported_tokens=len(resumed),  # produced elsewhere: not this engine's generated tokens
            speculative=request.pooling is None and self.speculation.eligible(params, request.final),
        )
        if resumed and params.logprobs is not None:
            # Logprobs stay aligned with the outputs; the resumed ones are never sent again, so these are never read.
            queued.logprobs.extend([0.0] * len(resumed))
            queued.top_logprobs.extend({} for _ in resumed)
        self.scheduler.add_request(queued)
        if request.lora is not None:
            self.lora_readiness.want(queued)
        return queued

    def append_input(self, request_id: str, token_ids: Sequence[int], final: bool) -> Request:
        """The next chunk of an open streaming-input session; a chunk that would not fit leaves it unchanged."""
        self._check_tokens(token_ids)
        return self.scheduler.append_input(request_id, list(token_ids), final)

    def _check_tokens(self, token_ids: Sequence[int], what: str = "prompt token ids") -> None:
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise ValueError(f"{what} must be ints in [0, {self.vocab_size}), got {token!r}")

    def abort(self, request_id: str, stopped: bool = False) -> Request | None:
        """End a request now; `stopped`: on a stop string its caller found (reason "stop", not an abort)."""
        request = self.scheduler.abort(request_id, stopped)
        if request is not None:
            self.metrics.observe_finished(request)
        return request

    def pause(self, mode: PauseMode) -> None:
        self.scheduler.pause(mode)

    def snapshot(self) -> EngineSnapshot:
        """The gauges and running totals the metrics read at scrape time."""
        scheduler, table = self.scheduler, self.block_table
        stats, tier = scheduler.stats, table.host_tier
        return EngineSnapshot(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            pause_mode=scheduler.pause_mode.value,
            kv_usage=table.usage,
            num_free_blocks=table.num_free_blocks,
            num_used_slots=table.num_used_blocks * table.block_size,
            num_live_tokens=sum(r.num_computed_tokens for r in scheduler.running),
            num_preemptions=stats.num_preemptions,
            num_prefix_query_tokens=stats.num_prefix_query_tokens,
            num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
            num_host_hit_tokens=stats.num_host_hit_tokens,
            num_restarts=self.num_restarts,
            host_tier_copies=None if tier is None else (tier.num_offloaded, tier.num_loaded),
            lora_adapters=self._lora_adapters_in_use() if self.config.lora.enable_lora else None,
        )

    def _lora_adapters_in_use(self) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.envelope.lora.lora_name for r in requests if r.envelope.lora is not None}))

        scheduler = self.scheduler
        return names(scheduler.running), names(scheduler.waiting), self.config.lora.max_loras

    def metrics_text(self) -> bytes:
        """The Prometheus text exposition of this engine."""
        return self.metrics.render(self.snapshot())

    def drain(self) -> list[Request]:
        """Apply every step in flight without scheduling more (a caller whose requests all ended, e.g. on a stop
        string found by the caller, while a step for them was still running)."""
        changed: list[Request] = []
        while self._inflight:
            changed.extend(self._apply_oldest())
        return changed

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._inflight)

    def step(self) -> list[Request]:
        """schedule → run → postprocess; returns requests that got a token or finished.

        With overlap on, the next step is scheduled and submitted before the previous one's tokens are back,
        so the ranks never wait on the head: one call submits step N+1, then applies step N.
        """
        changed: list[Request] = []
        computing = False
        self._lora_news = False
        if len(self._inflight) < self.max_inflight_steps:
            computing, expired = self._schedule_and_submit()
            changed.extend(expired)
        if computing:
            if len(self._inflight) >= self.max_inflight_steps:
                changed.extend(self._apply_oldest())
        else:
            # Nothing new to compute: there is nothing to overlap, so wait for every step in flight.
            while self._inflight:
                changed.extend(self._apply_oldest())
        # A step that only waited on adapter reads is followed at once: the ranks pace it, answering when a read ends.
        self.last_step_idle = not computing and not changed and not self._lora_news and not self.lora_readiness.reading
        return changed

    def _schedule_and_submit(self) -> tuple[bool, list[Request]]:
        """Schedule and submit a step; True when it computes something (not only forgets finished requests)."""
        started = time.perf_counter()
        started_ns = time.time_ns()
        if self.speculation.enabled:
            self.scheduler.spec_lookahead = self.speculation.lookahead(len(self.scheduler.running))
        out = self.scheduler.schedule()
        self.schedule_seconds.append(time.perf_counter() - started)
        expired = out.expired
        for request in expired:
            self.metrics.observe_finished(request)
        reads = self.lora_readiness.next_reads(self.scheduler.waiting)
        if out.empty and not reads and not self.lora_readiness.reading:
            return False, expired
        # An empty step still goes while adapters are being read: it asks for them and brings back their news.
        span = start_step_span(out, started_ns)
        batch = self.step_builder.build(out)
        for lora_id, path in reads:
            batch.lora_prefetch.add(lora_id=lora_id, lora_path=path)
        dispatched = time.perf_counter()
        if self._inflight and out.scheduled:
            self.num_overlapped_steps += 1  # submitted while the ranks still run the previous step
        with dispatch_span(span, batch):
            pending = self.executor.submit(batch)
        self._inflight.append(_InflightStep(out, batch, pending, span, started, dispatched))
        return bool(out.scheduled), expired

    def _apply_oldest(self) -> list[Request]:
        step = self._inflight.popleft()
        try:
            result = step.pending.result()
        except WorkerGroupError as error:
            end_step_span(step.span, error)
            return self._recover(error, step.batch)
        except Exception:
            # The worker broke in a way a restart cannot mend (the in-process rank): later steps are abandoned.
            self._abandon_inflight()
            raise
        waited = time.perf_counter() - step.dispatched
        self._consecutive_failures = 0
        self.quarantine.step_succeeded(step.batch)
        sampled, logprobs = unpack_result(result)
        spec_runs = unpack_spec_runs(result)
        if spec_runs:
            for handle, run in spec_runs.items():
                self.step_builder.ranks_appended(handle, len(run.tokens) - 1)
        if self.speculation.enabled:
            drafted = sum(run.num_drafts for run in spec_runs.values())
            lookahead = sum(item.lookahead for item in step.out.scheduled)
            rows = step.out.num_batched_tokens - lookahead + drafted
            self.speculation.observe_step(rows, result.compute_seconds, spec_runs)
            self.metrics.observe_speculation(self.speculation, spec_runs)
        if result.prompt_logprobs:
            keep_prompt_logprobs(step.out, result.prompt_logprobs)
        if result.pooled:
            by_handle = {item.request.handle: item.request for item in step.out.scheduled}
            for entry in result.pooled:
                request = by_handle.get(entry.handle)
                if request is not None:
                    request.pooled = list(entry.values)
        changed = self.scheduler.update_from_output(
            step.out, sampled, frozenset(result.constraint_done), logprobs, spec_runs
        )
        if result.lora_ready or result.lora_dropped or result.lora_failed:
            self._lora_news = True
            failed = self.lora_readiness.observe(result, self.scheduler.waiting)
            if failed:
                changed.extend(self._fail_adapters(failed))
        dispatch_stats = getattr(self.executor, "dispatch_stats", None)
        self.metrics.observe_step(step.out, result, step.dispatched - step.started, waited, changed, dispatch_stats)
        end_step_span(step.span, result=result)
        return changed

    def _abandon_inflight(self) -> None:
        """Forget the steps in flight: their answers are never applied, and the ranks are told to forget too."""
        for step in self._inflight:
            end_step_span(step.span, WorkerGroupError("abandoned after an earlier step failed"))
        self._inflight.clear()
        self.scheduler.requeue_all()
        self.step_builder.reset()
        # The abandoned steps' adapter news is lost (and restarted ranks hold none): ask again for every adapter
        # the requeued requests need; a rank that holds one says so at once.
        self.lora_readiness.reset(self.scheduler.waiting)

    def _recover(self, error: WorkerGroupError, batch: step_pb2.StepBatch) -> list[Request]:
        """Rebuild the worker group and recompute every request; give up after repeated failures.

        Clients see a pause: generated tokens are kept and recomputed, none is lost or repeated. A request that
        keeps crashing the workers is failed alone and the others carry on (the rule: cluster/core/quarantine.py).
        """
        convicted = self.quarantine.step_failed(batch)
        self._abandon_inflight()  # every request is recomputed: later steps' answers must not count
        for request, strikes in convicted:
            logger.error(
                "request %s failed alone: the workers crashed in the %d steps in a row it was in (%s)",
                request.request_id,
                strikes,
                error,
                extra={"request_id": request.request_id},
            )
            request.error = (
                f"the request was failed alone because it crashed the workers repeatedly: every one of the {strikes} "
                f"steps in a row it ran in failed, while the requests batched with it ran ({error})"
            )
            request.error_code = "quarantined"
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_ABORTED)
            self.metrics.observe_finished(request)
            self.num_quarantined += 1
        if convicted:
            self._consecutive_failures = 0  # its cause is gone: the restarts in a row count afresh
        failed = [request for request, _ in convicted]
        while True:
            self._consecutive_failures += 1
            if self._consecutive_failures > self.max_restarts:
                return failed + self._fail_all(error)
            delay = self.restart_backoff_s * 2 ** (self._consecutive_failures - 1)
            logger.warning("worker group failed (%s); restart %d in %.1fs", error, self._consecutive_failures, delay)
            time.sleep(delay)
            try:
                num_blocks = self.executor.restart()
            except Exception as restart_error:  # a failed restart counts as another failure
                error = WorkerGroupError(f"restart failed: {restart_error}")
                continue
            self.num_restarts += 1
            if num_blocks != self.block_table.num_blocks:
                # A restarted group may hold another count: the table, and the longest sequence it can hold.
                self.max_model_len = effective_max_model_len(self.config, self.context_limit, num_blocks)
                self.scheduler.max_model_len = self.max_model_len
                self.block_table = self._new_block_table(num_blocks)
                self.scheduler.block_table = self.block_table
            self.quarantine.arrange()  # suspects of repeated failures rejoin one at a time
            return failed

    def _fail_adapters(self, failed: dict[int, str]) -> list[Request]:
        """Finish every request of an adapter whose read failed on the ranks, with the reason (a later request
        for it has it read again)."""
        ended = [r for r in self.scheduler.requests.values() if r.lora_id in failed]
        for request in ended:
            request.error = failed[request.lora_id]
            request.error_code = "lora_load_failed"
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_ABORTED)
            self.metrics.observe_finished(request)
        return ended

    def _fail_all(self, error: WorkerGroupError) -> list[Request]:
        """Finish every in-flight request with a retriable error instead of restarting forever."""
        message = f"worker group failed {self._consecutive_failures - 1} times in a row; retry the request ({error})"
        failed = list(self.scheduler.requests.values())
        for request in failed:
            request.error = message
            request.error_code = "worker_failure"
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_ABORTED)
            self.metrics.observe_finished(request)
        self._consecutive_failures = 0
        self.quarantine.reset()
        return failed


def effective_max_model_len(config: EngineConfig, max_model_len: int, num_blocks: int) -> int:
    """The longest sequence this replica can serve: the model's limit, capped to what one sequence can hold in
    the KV cache (and, without chunked prefill, to one step's token budget, which bounds a recompute).

    A request without max_tokens runs up to this limit, so it must never exceed what the cache can hold.
    """
    capacity = num_blocks * config.cache.block_size
    limit = min(max_model_len, capacity)
    if not config.scheduler.enable_chunked_prefill:
        limit = min(limit, config.scheduler.max_num_batched_tokens)
    if limit < min(max_model_len, MIN_USEFUL_CONTEXT):
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.cache.block_size}), below the "
            f"{MIN_USEFUL_CONTEXT}-token minimum context; raise kv_cache_memory_bytes / gpu_memory_utilization"
        )
    if limit < max_model_len:
        logger.warning(
            "max_model_len lowered from %d to %d: the most one sequence can hold in this KV cache (%d blocks of %d)%s",
            max_model_len,
            limit,
            num_blocks,
            config.cache.block_size,
            "" if config.scheduler.enable_chunked_prefill else " or the step budget without chunked prefill",
        )
    return limit
