"""Prometheus metrics of one model replica's engine: queue, memory, latency and network, vLLM's names."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pagerail.cluster.core.fast_metrics import FastCounter, FastHistogram
from pagerail.cluster.core.request import RequestStatus

if TYPE_CHECKING:
    from pagerail.cluster.core.request import Request
    from pagerail.cluster.core.scheduler_output import SchedulerOutput
    from pagerail.proto import step_pb2

# promtool (CI checks the exposition with it) rejects ":" in exported names, so vLLM's names take "pagerail_".
PREFIX = "pagerail_"
# LLM latencies run from milliseconds (one decode step) to minutes (a long generation in a queue).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# "constrain" (token masks of constrained requests, on the sampling rank) is observed only in steps that have some.
STEP_PHASES = ("schedule", "dispatch", "forward", "sample", "constrain")
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Tenant label values an engine keeps (the frontend's tenants file names them, plus "default"); a tenant past them is
# counted as "other", so no caller can grow the series without bound.
MAX_TENANT_LABELS = 64
OTHER_TENANTS = "other"


@dataclass(frozen=True, slots=True)
class _TenantSeries:
    """One tenant's children of the per-tenant families, bound once."""

    queue_time: FastHistogram
    ttft: FastHistogram
    prompt_tokens: Counter
    generation_tokens: Counter
    preemptions: Counter


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's gauges and running totals at one moment, as the metrics read them at scrape time."""

    num_running: int
    num_waiting: int
    pause_mode: str  # "none", "new" or "all"
    kv_usage: float
    num_free_blocks: int
    num_used_slots: int  # the used blocks' token slots
    num_live_tokens: int  # tokens computed by the running requests
    num_preemptions: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_host_hit_tokens: int
    num_restarts: int
    # The host KV tier's copies, None without a tier.
    host_tier_copies: tuple[int, int] | None = None  # (offloaded, loaded) blocks
    # The LoRA adapters of the running and of the waiting requests (names), and the slots; None without LoRA.
    lora_adapters: tuple[tuple[str, ...], tuple[str, ...], int] | None = None


class EngineMetrics:
    """Every series carries `model_name`; a registry of its own so several replicas can live in one process."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets, extra: tuple[str, ...] = ()) -> FastHistogram:
            # Observed per request per step on the engine thread: bucket counts read at scrape time.
            return FastHistogram(PREFIX + name, doc, [*labels, *extra], buckets, self.registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.paused = gauge("num_requests_paused", "Requests held by a pause.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.slot_utilization = gauge(
            "kv_cache_slot_utilization", "Live tokens / allocated KV slots of the running batch (0 to 1)."
        )
        self.free_blocks = gauge("num_free_blocks", "KV cache blocks free for allocation.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = FastCounter(PREFIX + "generation_tokens", "Generated tokens.", labels, self.registry)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (on the device).")
        self.host_hits = counter(
            "prefix_cache_host_hits", "Prompt tokens found in the host KV tier and loaded back instead of recomputed."
        )
        self.kv_offload_blocks = counter(
            "kv_offload_blocks", "KV blocks copied to the host tier (offload) and back (load).", ("direction",)
        )
        self.kv_transfer_seconds = counter(
            "kv_offload_transfer_seconds", "Rank 0's time issuing host KV tier copies (with the bytes: bandwidth)."
        )
        self.kv_transfer_bytes = counter("kv_offload_transfer_bytes", "Bytes of host KV tier copies on rank 0.")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.")
        self.success = counter("request_success", "Finished requests by reason.", ("finished_reason",))
        self.restarts = counter("worker_restarts", "Worker group restarts after a failure.")
        self.dispatch_bytes = counter(
            "dispatch_bytes", "Bytes of step messages between head and ranks.", ("direction", "rank")
        )
        self.moe_collective_bytes = counter(
            "moe_collective_bytes",
            "Bytes each rank put into the mixture-of-experts all-reduces (expert or tensor parallel experts).",
        )
        self.weight_bytes = Gauge(
            PREFIX + "model_weight_bytes",
            "Bytes of the replica's weights over all its ranks, by weight format and KV cache dtype.",
            ("model_name", "weight_format", "kv_cache_dtype"),
            registry=self.registry,
        )
        self.lora_loads = counter("lora_adapter_loads", "LoRA adapters copied into a device slot.")
        self.lora_evictions = counter("lora_adapter_evictions", "LoRA adapters a load replaced in their slot.")
        self.lora_load_seconds = counter("lora_adapter_load_seconds", "Time spent reading and copying LoRA adapters.")
        self.lora_info = Gauge(
            PREFIX + "lora_requests_info",
            "The LoRA adapters of running and waiting requests (comma-separated), and the slots; the value is the "
            "time of the reading.",
            ("model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"),
            registry=self.registry,
        )
        # Adapter loads over the engine's life, for its stats (and the routing comparison).
        self.num_lora_loads = 0
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculating decodes that proposed drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens the target model kept.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens kept, by position in the draft.", ("position",)
        )
        self.spec_backed_off = gauge(
            "spec_decode_backed_off", "1 while speculation is off because verifying would cost more than it saves."
        )
        self.spec_backoff_steps = counter("spec_decode_backoff_steps", "Steps run without speculation by back-off.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens", "Tokens computed per engine step.", TOKEN_BUCKETS)
        self.step_duration = histogram("step_duration_seconds", "Engine step time by phase.", STEP_BUCKETS, ("phase",))
        self.dispatch_rtt = histogram("dispatch_rtt_seconds", "Step round trip per rank.", STEP_BUCKETS, ("rank",))
        self.tenant_queue_time = histogram(
            "tenant_request_queue_time_seconds", "Arrival to first scheduled, by tenant.", LATENCY_BUCKETS, ("tenant",)
        )
        self.tenant_ttft = histogram(
            "tenant_time_to_first_token_seconds", "Arrival to first token, by tenant.", LATENCY_BUCKETS, ("tenant",)
        )
        self.tenant_tokens = counter(
            "tenant_tokens", "Prompt and generated tokens of finished requests, by tenant.", ("tenant", "kind")
        )
        self.tenant_preemptions = counter(
            "tenant_preemptions", "Requests preempted for another's need (recomputed later), by tenant.", ("tenant",)
        )
        self._tenants: dict[str, _TenantSeries] = {}
        # Children bound once: the per-step path never looks labels up.
        name = model_name
        self._ttft, self._itl, self._e2e = self.ttft.labels(name), self.itl.labels(name), self.e2e.labels(name)
        self._queue_time, self._prefill_time = self.queue_time.labels(name), self.prefill_time.labels(name)
        self._decode_time, self._iteration_tokens = self.decode_time.labels(name), self.iteration_tokens.labels(name)
        self._phases = {phase: self.step_duration.labels(name, phase) for phase in STEP_PHASES}
        self._name_label = (name,)
        self._seen_preemptions = 0
        self._seen_prefix = (0, 0, 0)
        self._seen_offload = (0, 0)
        self._seen_restarts = 0
        self._moe_bytes = self.moe_collective_bytes.labels(name)

    def _tenant(self, tenant: str) -> _TenantSeries:
        """The series of `tenant`, made on its first request (past MAX_TENANT_LABELS tenants: "other")."""
        series = self._tenants.get(tenant)
        if series is None:
            if len(self._tenants) >= MAX_TENANT_LABELS:
                tenant = OTHER_TENANTS
                series = self._tenants.get(tenant)
            if series is None:
                name = self.model_name
                series = self._tenants[tenant] = _TenantSeries(
                    self.tenant_queue_time.labels(name, tenant),
                    self.tenant_ttft.labels(name, tenant),
                    self.tenant_tokens.labels(name, tenant, "prompt"),
                    self.tenant_tokens.labels(name, tenant, "generation"),
                    self.tenant_preemptions.labels(name, tenant),
                )
        return series

    def observe_speculation(self, policy, runs: dict) -> None:
        """A step's speculation: what its speculating decodes proposed and kept, and whether it backed off."""
        name = self._name_label[0]
        self.spec_backed_off.labels(name).set(1.0 if policy.backed_off else 0.0)
        if policy.backed_off:
            self.spec_backoff_steps.labels(name).inc()
        if not runs:
            return
        self.spec_drafts.labels(name).inc(len(runs))
        self.spec_draft_tokens.labels(name).inc(sum(run.num_drafts for run in runs.values()))
        kept = [len(run.tokens) - 1 for run in runs.values()]
        self.spec_accepted.labels(name).inc(sum(kept))
        for count in kept:
            for position in range(count):
                self.spec_accepted_per_pos.labels(name, str(position)).inc()

    def observe_weights(self, weights: dict | None) -> None:
        """The ranks' weight format and bytes, as they reported them when they started."""
        if weights:
            labels = (self._name_label[0], weights["weight_format"], weights["kv_cache_dtype"])
            self.weight_bytes.labels(*labels).set(weights["weight_bytes"])

    # -- per step (engine loop thread) ----------------------------------------------------------

    def observe_step(
        self,
        out: SchedulerOutput,
        result: step_pb2.StepResult,
        schedule_s: float,
        round_trip_s: float,
        changed: list[Request],
        dispatch_stats=None,
    ) -> None:
        """One step's phases, tokens and latencies; `dispatch_stats` (the remote executor's) its bytes per rank."""
        now = time.monotonic()
        if out.has_admissions:
            for item in out.scheduled:
                # A request is first scheduled when it is admitted; later steps need no look.
                if item.admitted and item.request.first_scheduled_time is None:
                    request = item.request
                    request.first_scheduled_time = now
                    self._queue_time.observe(now - request.arrival_time)
                    self._tenant(request.tenant).queue_time.observe(now - request.arrival_time)
        self._iteration_tokens.observe(out.num_batched_tokens)
        for request in out.preempted:
            if request.status is RequestStatus.PREEMPTED:  # not an idle session's blocks taken back
                self._tenant(request.tenant).preemptions.inc()
        forward, compute = result.forward_seconds, result.compute_seconds
        phases = self._phases
        phases["schedule"].observe(schedule_s)
        phases["dispatch"].observe(max(0.0, round_trip_s - compute))
        phases["forward"].observe(forward)
        constrain, transfer = result.constraint_seconds, result.kv_transfer_seconds
        phases["sample"].observe(max(0.0, compute - forward - constrain - transfer))
        if transfer:
            self.kv_transfer_seconds.labels(self.model_name).inc(transfer)
            self.kv_transfer_bytes.labels(self.model_name).inc(result.kv_transfer_bytes)
        if constrain:
            phases["constrain"].observe(constrain)
        if result.moe_collective_bytes:
            self._moe_bytes.inc(result.moe_collective_bytes)
        if result.lora_loads:
            self.num_lora_loads += result.lora_loads
            self.lora_loads.labels(self.model_name).inc(result.lora_loads)
            self.lora_evictions.labels(self.model_name).inc(result.lora_evictions)
            self.lora_load_seconds.labels(self.model_name).inc(result.lora_load_seconds)
        self._observe_tokens(changed, now)
        if dispatch_stats is not None:
            self._observe_dispatch(dispatch_stats)

    def _observe_tokens(self, changed: list[Request], now: float) -> None:
        """New-token counts and latencies of the requests a step changed: the per-request hot path.

        Requests that got their previous token in the same step share its time, so inter-token gaps are grouped
        by that time and each distinct gap is observed once with its count.
        """
        generated = 0
        # Gaps of requests that got one new token, by the time of their previous one; of several, by both.
        single_gaps: dict[float, int] = {}
        gaps: dict[tuple[float, int], int] = {}
        running = RequestStatus.RUNNING
        for request in changed:
            num_outputs = len(request.output_token_ids)
            new_tokens = num_outputs - request.num_reported_tokens
            if new_tokens > 0:
                generated += new_tokens
                last = request.last_token_time
                if request.first_token_time is None:
                    request.first_token_time = now
                    if new_tokens == num_outputs:  # a resumed request's first token reached its client elsewhere
                        self._ttft.observe(now - request.arrival_time)
                        self._tenant(request.tenant).ttft.observe(now - request.arrival_time)
                    if request.first_scheduled_time is not None:
                        self._prefill_time.observe(now - request.first_scheduled_time)
                elif last is not None:
                    if new_tokens == 1:
                        single_gaps[last] = single_gaps.get(last, 0) + 1
                    else:
                        key = (last, new_tokens)
                        gaps[key] = gaps.get(key, 0) + 1
                request.last_token_time = now
                request.num_reported_tokens = num_outputs
            status = request.status
            if status is not running and status.finished:
                self.observe_finished(request, now)
        for last, count in single_gaps.items():
            self._itl.observe_repeated(now - last, count)
        for (last, new_tokens), count in gaps.items():
            self._itl.observe_repeated((now - last) / new_tokens, count)
        if generated:
            self.generation_tokens.inc(self._name_label, generated)

    def observe_finished(self, request: Request, now: float | None = None) -> None:
        """Count a finished request once, whether it ended in a step or by an abort."""
        if request.metrics_done:
            return
        request.metrics_done = True
        now = time.monotonic() if now is None else now
        name = self.model_name
        self.prompt_tokens.labels(name).inc(request.num_prompt_tokens)
        self.success.labels(name, request.status.value).inc()
        tenant = self._tenant(request.tenant)
        tenant.prompt_tokens.inc(request.num_prompt_tokens)
        tenant.generation_tokens.inc(len(request.output_token_ids))
        self._e2e.observe(now - request.arrival_time)
        if request.first_token_time is not None:
            self._decode_time.observe(now - request.first_token_time)

    def _observe_dispatch(self, stats) -> None:
        if not stats.bytes_received_per_rank:
            return
        name = self.model_name
        for rank, received in enumerate(stats.bytes_received_per_rank):
            self.dispatch_bytes.labels(name, "sent", str(rank)).inc(stats.bytes_sent_per_rank)
            self.dispatch_bytes.labels(name, "received", str(rank)).inc(received)
        for rank, rtt in enumerate(stats.last_round_trip_per_rank):
            self.dispatch_rtt.labels(name, str(rank)).observe(rtt)

    # -- gauges and totals, read at any time ----------------------------------------------------

    def refresh(self, snapshot: EngineSnapshot) -> None:
        """Bring gauges and counters fed by the engine's totals up to date.

        Run at scrape time rather than every step, so the hot path never walks the running batch for them.
        """
        name = self.model_name
        running, waiting = snapshot.num_running, snapshot.num_waiting
        self.running.labels(name).set(running)
        self.waiting.labels(name).set(waiting)
        mode = snapshot.pause_mode
        self.paused.labels(name).set(running + waiting if mode == "all" else waiting if mode == "new" else 0)
        self.kv_usage.labels(name).set(snapshot.kv_usage)
        self.free_blocks.labels(name).set(snapshot.num_free_blocks)
        slots = snapshot.num_used_slots
        self.slot_utilization.labels(name).set(snapshot.num_live_tokens / slots if slots else 0.0)
        self.preemptions.labels(name).inc(snapshot.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = snapshot.num_preemptions
        queries, hits = snapshot.num_prefix_query_tokens, snapshot.num_prefix_hit_tokens
        host_hits = snapshot.num_host_hit_tokens
        self.prefix_queries.labels(name).inc(queries - self._seen_prefix[0])
        self.prefix_hits.labels(name).inc(hits - self._seen_prefix[1])
        self.host_hits.labels(name).inc(host_hits - self._seen_prefix[2])
        self._seen_prefix = (queries, hits, host_hits)
        if snapshot.host_tier_copies is not None:
            offloaded, loaded = snapshot.host_tier_copies
            seen = self._seen_offload if offloaded >= self._seen_offload[0] else (0, 0)  # a new tier
            self.kv_offload_blocks.labels(name, "offload").inc(offloaded - seen[0])
            self.kv_offload_blocks.labels(name, "load").inc(loaded - seen[1])
            self._seen_offload = (offloaded, loaded)
        self.restarts.labels(name).inc(snapshot.num_restarts - self._seen_restarts)
        self._seen_restarts = snapshot.num_restarts
        if snapshot.lora_adapters is not None:
            running_names, waiting_names, slots = snapshot.lora_adapters
            self.lora_info.clear()
            labels = (name, ",".join(running_names), ",".join(waiting_names), str(slots))
            self.lora_info.labels(*labels).set(time.time())

    def render(self, snapshot: EngineSnapshot) -> bytes:
        """The Prometheus text exposition."""
        self.refresh(snapshot)
        return generate_latest(self.registry)
