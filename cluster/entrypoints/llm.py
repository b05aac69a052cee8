"""The offline Python API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages, params)`."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer

from cluster.core.config import CacheConfig, EngineConfig, ObservabilityConfig, SchedulerConfig
from cluster.core.engine import EngineCore
from cluster.core.model_info import read_model_info
from cluster.core.outputs import CompletionOutput, RequestOutput
from cluster.core.request import Request, RequestStatus
from cluster.core.sampling_params import SamplingParams
from cluster.distributed.local_executor import InProcessExecutor, locate_model, worker_config
from cluster.entrypoints.stop_strings import StopStringMatcher
from common import telemetry
from common.grammar import TOKENIZERS, GrammarError, check_constraint

Prompt = str | Sequence[int]


class LLM:
    """A model replica in this process (tensor-parallel size 1), or replicas on Ray (tensor or data parallel),
    behind a batch-generation API."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        served_model_name: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        load_format: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool = True,
        max_waiting_requests: int | None = None,
        session_idle_timeout_s: float = 300.0,
        max_sessions: int | None = None,
        async_scheduling: bool | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        data_parallel_size: int = 1,
        ray_address: str | None = None,
        placement_strategy: str = "PACK",
        head_name: str | None = None,
        otlp_traces_endpoint: str | None = None,
        trace_sampling_ratio: float = 1.0,
    ) -> None:
        self.config = EngineConfig(
            model=model,
            served_model_name=served_model_name,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            load_format=load_format,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                num_gpu_blocks=num_gpu_blocks,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=enable_chunked_prefill,
                max_waiting_requests=max_waiting_requests,
                session_idle_timeout_s=session_idle_timeout_s,
                max_sessions=max_sessions,
                async_scheduling=async_scheduling,
            ),
            observability=ObservabilityConfig(
                otlp_traces_endpoint=otlp_traces_endpoint, trace_sampling_ratio=trace_sampling_ratio
            ),
        )
        self.model_dir = locate_model(self.config)
        info = read_model_info(self.model_dir)
        self._vocab_size = info.vocab_size
        self.tokenizer = _load_tokenizer(tokenizer or self.model_dir)
        limit = min(max_model_len or info.max_position_embeddings, info.max_position_embeddings)
        eos = info.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self._ids = itertools.count()
        self._remote = None
        self.engine = None
        self._shut_down = False
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        if data_parallel_size > 1:
            # Data parallel: a head actor per replica on Ray, each batch split between them by prefix-aware routing.
            from cluster.distributed.data_parallel_engine import DataParallelEngine
            from cluster.distributed.head import ClusterOptions

            options = ClusterOptions(placement_strategy=placement_strategy)
            name = head_name or f"pagerail-head-{uuid.uuid4().hex[:8]}"
            self._remote = DataParallelEngine(self.config, options, ray_address, name, data_parallel_size, device)
        elif tensor_parallel_size > 1 or ray_address is not None:
            # Tensor parallel (or an existing cluster): a head actor on Ray drives worker actors over gRPC.
            from cluster.distributed.head import ClusterOptions
            from cluster.distributed.remote_engine import RemoteEngine

            options = ClusterOptions(placement_strategy=placement_strategy)
            name = head_name or f"pagerail-head-{uuid.uuid4().hex[:8]}"
            self._remote = RemoteEngine(self.config, options, ray_address, name, device)
        else:
            # This process is the head (and its only rank): its steps' spans go to the collector from here.
            telemetry.configure_tracing("head", endpoint=otlp_traces_endpoint, sampling_ratio=trace_sampling_ratio)
            executor = InProcessExecutor(worker_config(self.config, self.model_dir))
            self.engine = EngineCore(self.config, executor, limit, info.vocab_size, eos)

    # -- public API ----------------------------------------------------------------------------

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")
        params_list = _as_params_list(params, len(prompts))
        self._check_constraints(params_list)
        outputs: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, int, SamplingParams]] = {}
        pending: list[tuple[str, list[int], SamplingParams]] = []
        try:
            for prompt, sp in zip(prompts, params_list, strict=True):
                token_ids = self._encode(prompt)
                output = RequestOutput(str(next(self._ids)), prompt if isinstance(prompt, str) else None, token_ids)
                outputs.append(output)
                for index in range(sp.n):
                    # Each of the n sequences is its own request; they share the prompt's cached blocks.
                    child_params = sp if sp.seed is None or index == 0 else replace(sp, seed=sp.seed + index)
                    child_id = f"{output.request_id}-{index}" if sp.n > 1 else output.request_id
                    children[child_id] = (output, index, sp)
                    pending.append((child_id, token_ids, child_params))
                    output.outputs.append(CompletionOutput(index, "", [], None))
            if self._remote is not None:
                self._run_remote(children, pending)
            else:
                for child_id, token_ids, child_params in pending:
                    self.engine.add_request(child_id, token_ids, child_params)
                self._run(children)
        except BaseException:
            if self.engine is not None:
                for child_id in children:
                    self.engine.abort(child_id)
            raise
        return outputs

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            list(
                self.tokenizer.apply_chat_template(
                    list(c), add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for c in conversations
        ]
        return self.generate(prompts, params)

    @property
    def stats(self):
        """Scheduler counters (in-process), or the head actor's stats dict (tensor parallel; per replica with data
        parallel)."""
        if self._remote is not None:
            return self._remote.stats()
        return self.engine.scheduler.stats

    def shutdown(self) -> None:
        """Stop the head actor and its workers (tensor parallel), or release the in-process engine: its model, KV
        cache and captured graphs are freed (and CUDA's cached memory returned), so another engine in this process
        measures its memory from a clean device. Calling it again does nothing."""
        self._shut_down = True
        if self._remote is not None:
            self._remote.shutdown()
            self._remote = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- internals -----------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self._require_tokenizer().encode(prompt))
        return list(prompt)

    def _check_constraints(self, params_list: list[SamplingParams]) -> None:
        """Compile every distinct output constraint before anything is queued; GrammarError names the field."""
        for constraint in {sp.structured_outputs for sp in params_list if sp.structured_outputs is not None}:
            if self.tokenizer is None:
                raise GrammarError("structured_outputs", f"{self.model_dir} has no tokenizer to compile with")
            check_constraint(constraint.kind, constraint.spec, TOKENIZERS.for_hf(self.tokenizer, self._vocab_size))

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"the model at {self.model_dir} has no tokenizer; pass prompts as token id lists")
        return self.tokenizer

    def _run(self, children: dict[str, tuple[RequestOutput, int, SamplingParams]]) -> None:
        remaining = set(children)
        matchers = self._stop_matchers(children)
        stats = self.engine.scheduler.stats
        while remaining:
            num_finished = stats.num_finished
            changed = self.engine.step()
            if matchers:
                self._stop_at_strings(changed, matchers)
            if stats.num_finished == num_finished:
                continue  # most steps end no request: nothing to collect, no need to look at each one
            for request in changed:
                entry = children.get(request.request_id)
                if entry is None or not request.finished:
                    continue
                output, index, sp = entry
                self._fill(output.outputs[index], request, sp)
                output.num_cached_tokens = max(output.num_cached_tokens, request.num_cached_tokens)
                remaining.discard(request.request_id)
        # A request stopped here was already in the next step, which is still in flight: let it land, so the
        # engine is idle again when generate() returns.
        self.engine.drain()

    def _stop_at_strings(self, changed: list[Request], matchers: dict[str, StopStringMatcher]) -> None:
        """Finish the requests whose text now holds a stop string; checked once per step, on the text so far:
        the step's tokens are kept, later ones never come."""
        for request in changed:
            matcher = matchers.get(request.request_id)
            if matcher is not None and not request.finished:
                if matcher.add(request.output_token_ids[matcher.num_tokens :]):
                    self.engine.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _run_remote(self, children: dict[str, tuple[RequestOutput, int, SamplingParams]], pending: list) -> None:
        # The head works on token ids only: stop strings are matched here as the tokens stream in, and a request
        # that hits one is aborted at the head, its tokens cut where the in-process path would have stopped it.
        matchers = self._stop_matchers(children)

        def stops(request_id: str, token_ids: list[int]) -> bool:
            matcher = matchers.get(request_id)
            return matcher is not None and matcher.add(token_ids)

        for request_id, request in self._remote.run(pending, stops if matchers else None).items():
            output, index, sp = children[request_id]
            self._fill(output.outputs[index], request, sp)
            output.num_cached_tokens = max(output.num_cached_tokens, request.num_cached_tokens)

    def _stop_matchers(self, children: dict[str, tuple[RequestOutput, int, SamplingParams]]) -> dict:
        """A stop-string matcher per request that has stop strings."""
        matchers: dict[str, StopStringMatcher] = {}
        for request_id, (_, _, sp) in children.items():
            if sp.stop:
                matchers[request_id] = StopStringMatcher(self._require_tokenizer(), sp.stop, sp.skip_special_tokens)
        return matchers

    def _fill(self, completion: CompletionOutput, request: Request, sp: SamplingParams) -> None:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=sp.skip_special_tokens)
        finish_reason = request.status.value
        for stop in sp.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[: cut + (len(stop) if sp.include_stop_str_in_output else 0)]
                finish_reason = "stop"
        completion.text = text
        completion.token_ids = list(request.output_token_ids)
        completion.finish_reason = finish_reason
        completion.error = request.error
        if sp.logprobs is not None:
            completion.logprobs = [
                {token: lp, **top}
                for token, lp, top in zip(request.output_token_ids, request.logprobs, request.top_logprobs, strict=True)
            ]
            completion.cumulative_logprob = sum(request.logprobs)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _load_tokenizer(source: str | Path):
    """The model's tokenizer, or None for a checkpoint that ships none (token-id prompts only)."""
    path = Path(source)
    if path.is_dir() and not any((path / name).exists() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(source))


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"params must be one SamplingParams or one per prompt ({count}), got {len(params)}")
    return params
