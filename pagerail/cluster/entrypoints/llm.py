"""The offline Python API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages, params)`."""

from __future__ import annotations

import asyncio
import itertools
import queue
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from pagerail.cluster.core.async_engine import AsyncEngine, OutputBatch
from pagerail.cluster.core.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagerail.cluster.core.embedding import finish_vector, pooled_vectors
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import MAX_PRIORITY, MIN_PRIORITY
from pagerail.cluster.core.local_client import LocalEngineClient
from pagerail.cluster.core.model_info import read_model_info
from pagerail.cluster.core.outputs import CompletionOutput, RequestOutput
from pagerail.cluster.distributed.cluster_options import DEFAULT_OPTIONS
from pagerail.cluster.distributed.local_executor import InProcessExecutor
from pagerail.cluster.frontend.bad_words import with_bad_words
from pagerail.cluster.frontend.output_processor import ChoiceState, append_choice, fan_out
from pagerail.common import telemetry
from pagerail.common.engine_args import engine_config
from pagerail.common.grammar import TOKENIZERS, GrammarError, check_constraint
from pagerail.common.lora import LoRARequest
from pagerail.common.model_source import resolve_model_dir
from pagerail.common.sampling_params import SamplingParams, truncate_prompt
from pagerail.worker.config import worker_config

Prompt = str | Sequence[int]


class LLM:
    """A model replica in this process (tensor-parallel size 1), or replicas on Ray (tensor or data parallel),
    behind a batch-generation API.

    A thin synchronous client: requests go to the same engine clients `pagerail serve` uses (the in-process
    engine loop, a head actor, routed replicas), and every choice's output through the front doors' ChoiceState,
    so a request gives the same tokens and text here as over HTTP or gRPC.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        data_parallel_size: int = 1,
        ray_address: str | None = None,
        placement_strategy: str = DEFAULT_OPTIONS.placement_strategy,
        head_name: str | None = None,
        **engine_args: Any,
    ) -> None:
        """`engine_args` are the engine's arguments (common/engine_args.py), the same settings and defaults as
        `pagerail serve`'s flags: `block_size=4` here is `--block-size 4` there. Where the ranks run: in this
        process, or on Ray (`tensor_parallel_size` > 1, `data_parallel_size` > 1 or a `ray_address`)."""
        self.config = engine_config(engine_args, model=model)
        self.model_dir = resolve_model_dir(self.config.model)
        info = read_model_info(self.model_dir, self.config.runner, self.config.convert, self.config.pooler_config)
        self._pooling = info.pooling
        info.check_engine(self.config)
        self._vocab_size = info.vocab_size
        self.tokenizer = _load_tokenizer(self.config.tokenizer or self.model_dir)
        self._ids = itertools.count()
        self._cluster = None
        self.engine: EngineCore | None = None
        self._shut_down = False
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        if data_parallel_size > 1 or self.config.tensor_parallel_size > 1 or ray_address is not None:
            # Head actors on Ray drive worker actors over gRPC; several are routed between as `serve` does.
            from pagerail.cluster.distributed.cluster_options import ClusterOptions
            from pagerail.cluster.entrypoints.cluster_client import ClusterClient

            options = ClusterOptions(placement_strategy=placement_strategy)
            name = head_name or f"pagerail-head-{uuid.uuid4().hex[:8]}"
            self._cluster = ClusterClient(self.config, options, ray_address, name, data_parallel_size)
        else:
            # This process is the head (and its only rank): its steps' spans go to the collector from here.
            observability = self.config.observability
            telemetry.configure_tracing(
                "head", endpoint=observability.otlp_traces_endpoint, sampling_ratio=observability.trace_sampling_ratio
            )
            executor = InProcessExecutor(worker_config(self.config, self.model_dir))
            self.engine = EngineCore.for_model(self.config, executor, info)
            # generate() drives the loop from its own thread until something else needs it running alone.
            self._engine_loop = AsyncEngine(self.engine, start=False)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) this LLM serves."""
        if self._cluster is not None:
            return self._cluster.client.max_model_len
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; create a new one")
        return self.engine.max_model_len

    @property
    def engine_client(self):
        """The engine client behind this LLM (the one `pagerail serve`'s frontend would use), for serving the same
        engine over HTTP or gRPC in this process; in-process, its loop thread starts on first use."""
        if self._cluster is not None:
            return self._cluster.client
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; create a new one")
        self._engine_loop.start()
        return LocalEngineClient(self._engine_loop, self.config.model_name)

    # -- public API ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs come back in prompt order. `lora_request`: the
        LoRA adapter every prompt runs with, or one per prompt (None: the base model). `priority`: every prompt's,
        or one per prompt, under scheduling_policy="priority" (lower first; ignored under fcfs)."""
        prompts = _as_prompt_list(prompts)
        priorities = _as_priority_list(priority, len(prompts))
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")
        params_list = [with_bad_words(sp, self.tokenizer) for sp in _as_params_list(params, len(prompts))]
        loras = _as_lora_list(lora_request, len(prompts))
        self._check_constraints(params_list)
        outputs: list[RequestOutput] = []
        for prompt, sp in zip(prompts, params_list, strict=True):
            token_ids = truncate_prompt(self._encode(prompt), sp.truncate_prompt_tokens, self.max_model_len)
            output = RequestOutput(str(next(self._ids)), prompt if isinstance(prompt, str) else None, token_ids)
            output.outputs = [CompletionOutput(index, "", [], None) for index in range(sp.n)]
            outputs.append(output)
        if self._cluster is not None:
            self._cluster.run(outputs, params_list, self.tokenizer, loras, priorities)
        else:
            self._run_in_process(outputs, params_list, loras, priorities)
        return outputs

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None, normalize: bool | None = None
    ) -> list[list[float]]:
        """Each prompt's embedding: its final hidden states pooled ("last" token, "mean", or "cls", the first),
        scaled to unit length unless `normalize` is False; in prompt order, the prompts batched together. None: the
        model's own (--pooler-config, else its sentence-transformers files, else "cls" for an encoder and "last")."""
        pooling = pooling or self._pooling.default_pooling
        normalize = self._pooling.normalize if normalize is None else normalize
        prompts = _as_prompt_list(prompts)
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")
        token_ids = [self._encode(prompt) for prompt in prompts]
        request_id = f"embed-{next(self._ids)}"
        if self._cluster is not None:
            vectors = self._cluster.call(pooled_vectors(self._cluster.client, token_ids, pooling, request_id))
        else:
            vectors = asyncio.run(pooled_vectors(self.engine_client, token_ids, pooling, request_id))
        return [finish_vector(vector, None, normalize) for vector in vectors]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Each prompt's `params.beam_width` best sequences by beam search (transformers' selection and length
        penalty), best first; the prompts' beams run batched together, in prompt order. `lora_request`: the LoRA
        adapter every prompt runs with, or one per prompt (None: the base model)."""
        prompts = _as_prompt_list(prompts)
        loras = _as_lora_list(lora_request, len(prompts))
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        token_ids = [self._encode(prompt) for prompt in prompts]
        request_id = f"beam-{next(self._ids)}"

        async def search_all(engine) -> list:
            searches = (
                beam_search(engine, ids, params, f"{request_id}-{n}", engine.eos_token_ids, lora)
                for n, (ids, lora) in enumerate(zip(token_ids, loras, strict=True))
            )
            return list(await asyncio.gather(*searches))

        if self._cluster is not None:
            results = self._cluster.call(search_all(self._cluster.client))
        else:
            results = asyncio.run(search_all(self.engine_client))
        outputs = []
        for prompt, ids, sequences in zip(prompts, token_ids, results, strict=True):
            for sequence in sequences if self.tokenizer is not None else ():
                sequence.text = self.tokenizer.decode(sequence.token_ids, skip_special_tokens=True)
            outputs.append(BeamSearchOutput(prompt if isinstance(prompt, str) else None, ids, sequences))
        return outputs

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate (with `lora_request` as in
        generate)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            list(
                self.tokenizer.apply_chat_template(
                    list(c), add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for c in conversations
        ]
        return self.generate(prompts, params, lora_request)

    @property
    def stats(self):
        """Scheduler counters (in-process), or the engine client's stats dict (on Ray; per replica, with the
        router's, under data parallel)."""
        if self._cluster is not None:
            return self._cluster.stats()
        return self.engine.scheduler.stats

    def shutdown(self) -> None:
        """Stop the head actors and their workers (on Ray), or release the in-process engine: its loop stops and
        its model, KV cache and captured graphs are freed (and CUDA's cached memory returned), so another engine in
        this process measures its memory from a clean device. Calling it again does nothing."""
        self._shut_down = True
        if self._cluster is not None:
            cluster, self._cluster = self._cluster, None
            cluster.shutdown()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            self._engine_loop.shutdown()
            self._engine_loop = None
            engine.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- internals -----------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"the model at {self.model_dir} has no tokenizer; pass prompts as token id lists")
        return list(self.tokenizer.encode(prompt))

    def _check_constraints(self, params_list: list[SamplingParams]) -> None:
        """Compile every distinct output constraint before anything is queued; GrammarError names the field."""
        for constraint in {sp.structured_outputs for sp in params_list if sp.structured_outputs is not None}:
            if self.tokenizer is None:
                raise GrammarError("structured_outputs", f"{self.model_dir} has no tokenizer to compile with")
            check_constraint(constraint.kind, constraint.spec, TOKENIZERS.for_hf(self.tokenizer, self._vocab_size))

    def _run_in_process(
        self,
        outputs: list[RequestOutput],
        params_list: list[SamplingParams],
        loras: Sequence[LoRARequest | None] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> None:
        """Submit every choice to the engine loop and fold its deltas in as each step hands them over."""
        sink = _QueueSink()
        choices: dict[int, tuple[str, RequestOutput, ChoiceState]] = {}
        loras = loras or [None] * len(outputs)
        priorities = priorities or [0] * len(outputs)
        for output, sp, lora, priority in zip(outputs, params_list, loras, priorities, strict=True):
            # Only stop strings need the output as it grows; otherwise it is read once, at the end.
            prompt = output.prompt_token_ids
            children = fan_out(output.request_id, prompt, sp, stream=bool(sp.stop), lora=lora, priority=priority)
            for index, request in enumerate(children):
                state = ChoiceState(self.tokenizer, output.prompt_token_ids, sp, index, incremental=False)
                key = len(choices)
                choices[key] = (request.request_id, output, state)
                self._engine_loop.submit(request, sink, key)
        # Until the engine sent every request's last delta: a request ended here on a stop string is aborted
        # there, and its blocks are free once that answer comes.
        open_requests = set(choices)
        engine_loop = self._engine_loop
        try:
            while open_requests:
                if engine_loop.started:
                    batch = sink.batches.get()
                else:
                    engine_loop.run_once()
                    if sink.batches.empty():
                        continue
                    batch = sink.batches.get_nowait()
                for key, error in batch.errors:
                    open_requests.discard(key)
                    raise error
                for key, delta in batch.deltas:
                    if delta.finished:
                        open_requests.discard(key)
                    request_id, output, state = choices[key]
                    if state.finished:
                        continue
                    append_choice(output, state.process(delta))
                    if state.stopped:
                        self._engine_loop.abort(request_id, sink, key, stopped=True)
        except BaseException:
            for key in open_requests:
                engine_loop.abort(choices[key][0], sink, key)
            if not engine_loop.started:
                engine_loop.run_once()  # the aborts take effect now: their blocks are free when this returns
            raise


class _QueueSink:
    """Where the engine loop hands this caller's outputs: one batch per loop iteration, read by generate()."""

    def __init__(self) -> None:
        self.batches: queue.SimpleQueue[OutputBatch] = queue.SimpleQueue()

    def deliver(self, batch: OutputBatch) -> None:
        self.batches.put(batch)


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


def _as_priority_list(priority: int | Sequence[int] | None, count: int) -> list[int]:
    if priority is None:
        return [0] * count
    priorities = [priority] * count if isinstance(priority, int) and not isinstance(priority, bool) else list(priority)
    if len(priorities) != count:
        raise ValueError(f"priority must be one int or one per prompt ({count}), got {len(priorities)}")
    for value in priorities:
        if type(value) is not int or not MIN_PRIORITY <= value <= MAX_PRIORITY:
            raise ValueError(f"priority must be integers in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {value!r}")
    return priorities


def _as_lora_list(lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    loras = list(lora)
    if len(loras) != count:
        raise ValueError(f"lora_request must be one LoRARequest or one per prompt ({count}), got {len(loras)}")
    bad = next((x for x in loras if x is not None and not isinstance(x, LoRARequest)), None)
    if bad is not None:
        raise ValueError(f"lora_request entries must be LoRARequest or None, got {type(bad).__name__}")
    return loras
