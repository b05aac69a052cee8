"""Runs one step on this rank: flat batch in, forward pass over the paged cache, sampled token ids out."""

from __future__ import annotations

import logging
import time

import torch

from pagerail.common.telemetry import get_tracer, traced
from pagerail.proto import step_pb2
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.constraints import ConstraintMatchers
from pagerail.worker.cuda_graphs import (
    DEFAULT_MAX_CAPTURE_SIZE,
    CapturePlan,
    CudaGraphBackend,
    DecodeGraphs,
    GraphBackend,
    StaticDecodeInputs,
)
from pagerail.worker.host_readback import HostReadback, to_host
from pagerail.worker.input_batch import FlatBatch
from pagerail.worker.input_buffers import InputBuffers
from pagerail.worker.layers.attention import decode_path
from pagerail.worker.layers.moe import moe_comm_bytes
from pagerail.worker.lora import LoRASlots
from pagerail.worker.parallel_state import TensorParallelGroup
from pagerail.worker.penalty_state import PenaltyState
from pagerail.worker.pooling import pool_prompt_rows
from pagerail.worker.prompt_logprobs import prompt_spans, span_rows, write_prompt_logprobs
from pagerail.worker.request_state import RequestState, RequestStates, sampling_row
from pagerail.worker.sampler import Sampler, row_argmax
from pagerail.worker.spec_decode.rows import row_offsets, row_states, speculating_history, split_runs, write_result
from pagerail.worker.step_inputs import prepare_step
from pagerail.worker.warmup import warmup_steps

logger = logging.getLogger(__name__)
_tracer = get_tracer("pagerail.worker")
# How long a step with nothing to run waits for an adapter read to end before answering: the head, waiting on the
# read only, sends the next such step at once.
LORA_POLL_WAIT_S = 0.05


def decode_path_of(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """Which decode attention this model runs on `device` (see attention.decode_path)."""
    heads, kv_heads = model.num_heads_per_rank, model.num_kv_heads_per_rank
    return decode_path(device, heads, kv_heads, model.head_dim, dtype)


class ModelRunner:
    """Owns the model shard and its KV cache; executes StepBatch messages.

    The input buffers start sized for `max_num_tokens` tokens and `max_num_seqs` requests of up to
    `max_blocks_per_seq` blocks, and grow when a step needs more.

    Unless `enforce_eager`, decode-only steps on CUDA (or on any device, given a `graph_backend`) replay a graph
    captured here for up to `max_capture_size` sequences; `num_replayed_steps` and `num_eager_steps` count how
    the forward passes ran.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int,
        device: torch.device,
        tp: TensorParallelGroup,
        *,
        max_num_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_blocks_per_seq: int = 64,
        tokenizer_dir: str | None = None,
        enforce_eager: bool = True,
        scratch_block: int | None = None,
        max_capture_size: int | None = DEFAULT_MAX_CAPTURE_SIZE,
        graph_backend: GraphBackend | None = None,
        warm_up: bool | None = None,
        proposer=None,
        host_kv=None,
        lora: LoRASlots | None = None,
    ) -> None:
        self.model = model
        # A classifier (cross-encoder) answers its head's logits over the first row in place of a pooled vector.
        self.classify_head = model.classify if getattr(model, "num_labels", 0) else None
        self.block_size = block_size
        self.device = device
        self.tp = tp
        # Decode-only steps on CUDA may replay captured graphs unless eager execution is enforced; padded rows of
        # a captured batch write their K/V into `scratch_block`, a cache block the head never hands out.
        self.enforce_eager = enforce_eager
        self.scratch_block = scratch_block
        # Collectives run where the process group's backend lives: NCCL on the GPU, gloo on the CPU.
        self.tp_device = device
        self.states = RequestStates(device, on_drop=self._forget)
        # On CUDA a step's tokens come back through pinned buffers and one event: the step's only host wait.
        self.readback = HostReadback(device) if device.type == "cuda" else None
        self.sampler = Sampler(readback=self.readback)
        # The forward is timed on the device there, so timing it needs no wait of its own.
        self._forward_events = None
        if device.type == "cuda":
            self._forward_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        # Created on rank 0 when the first request with penalties samples.
        self.penalties: PenaltyState | None = None
        # Output constraints are enforced where tokens are sampled; the tokenizer they compile against is read
        # from `tokenizer_dir` on first use.
        self.constraints = ConstraintMatchers(tokenizer_dir, model.config.vocab_size) if tp.rank == 0 else None
        dtype = next(model.parameters()).dtype
        # What the MoE layers' all-reduces move per token of a step, from the shapes (CUDA-graph replays too).
        self.moe_bytes_per_token = moe_comm_bytes(model, 1)
        # Which attention runs here is fixed now; each step picks its backend from it (worker/attention_backends/).
        self.attention = AttentionSettings.for_model(model, device, dtype, block_size)
        self.inputs = InputBuffers(
            block_size,
            device,
            max_num_tokens=max_num_tokens,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
        )
        # The host KV tier's slots (worker/kv_offload.py): each step's copies run before its forward.
        self.host_kv = host_kv
        # LoRA adapters' device slots (worker/lora.py); None without --enable-lora.
        self.lora = lora
        self._lora_step = False  # whether this step's forward runs rows with adapters
        # Speculative decoding: proposes the drafts the head made room for; the requests that got some this step.
        self.proposer = proposer
        self._drafted: list[RequestState] = []
        self.num_replayed_steps = 0
        self.num_eager_steps = 0
        self.graphs: DecodeGraphs | None = None
        # On a GPU the first steps compile kernels and choose cuBLAS algorithms: run their shapes now (None: on
        # CUDA only, where that costs seconds; the CPU has nothing to compile).
        if device.type == "cuda" if warm_up is None else warm_up:
            self.warm_up(max_num_tokens, max_blocks_per_seq * block_size)
        if getattr(proposer, "reads_layer_states", False) and not enforce_eager:
            # EAGLE-3 reads states inside the forward, which a replayed graph would not hand over.
            logger.info("rank %d: EAGLE-3 speculation reads the target's layers, decode steps run eagerly", tp.rank)
            enforce_eager = True
        if not enforce_eager:
            # The scheduler never runs more decodes in a step than it has tokens for.
            plan = CapturePlan.for_limits(max(1, min(max_num_seqs, max_num_tokens)), max_capture_size)
            self.graphs = self._capture_graphs(graph_backend, plan, max_blocks_per_seq, dtype)

    def _capture_graphs(
        self, backend: GraphBackend | None, plan: CapturePlan, max_blocks_per_seq: int, dtype: torch.dtype
    ) -> DecodeGraphs | None:
        """Capture the decode graphs, or None (every step eager) where capturing is not possible or not safe."""
        if backend is None:
            if self.device.type != "cuda":
                return None  # nothing to gain on the CPU: kernel launches cost little next to the kernels
            if self.tp.size > 1:
                # A captured NCCL all-reduce needs every rank to replay the same graph in lockstep and a
                # registered buffer; not worth the risk of a hang while eager decode works.
                logger.info("rank %d: tensor-parallel size %d, decode steps run eagerly", self.tp.rank, self.tp.size)
                return None
            backend = CudaGraphBackend(self.device)
        if self.scratch_block is None:
            logger.warning("no scratch KV block for padded rows: decode steps run eagerly")
            return None
        with torch.inference_mode():
            inputs = StaticDecodeInputs(
                plan.max_size,
                max_blocks_per_seq,
                self.model.config.hidden_size,
                dtype,
                self.device,
                self.block_size,
                self.scratch_block,
            )
            graphs = DecodeGraphs(self.model, plan, inputs, backend)
            try:
                graphs.capture()
            except Exception:
                # A kernel that cannot be captured costs speed, not correctness: serve eagerly and say why.
                logger.exception("rank %d: capturing decode graphs failed; decode steps run eagerly", self.tp.rank)
                return None
        return graphs

    def warm_up(self, max_num_tokens: int, max_context: int) -> None:
        """Run the warm-up steps (worker/warmup.py) through the scratch block, then forget them and their counts."""
        if self.scratch_block is None:
            logger.info("rank %d: no scratch KV block, no warm-up", self.tp.rank)
            return
        started = time.perf_counter()
        for batch in warmup_steps(self.block_size, self.scratch_block, max_num_tokens, max_context):
            self.execute(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.num_replayed_steps = self.num_eager_steps = 0
        logger.info("rank %d: warm-up steps ran in %.2f s", self.tp.rank, time.perf_counter() - started)

    def close(self) -> None:
        """Drop the captured graphs (and their memory pool) and stop the constraint compiler's and the LoRA
        reader's threads."""
        self.graphs = None
        if self.constraints is not None:
            self.constraints.close()
        if self.lora is not None:
            self.lora.close()

    def prepare(self, batch: step_pb2.StepBatch) -> FlatBatch | None:
        """Apply the step's deltas to the request states and the input buffers; the model's inputs, if any."""
        scheduled = self.states.apply(batch)
        if self.lora is not None:
            for new in batch.new_requests:
                if new.lora_id:
                    self.lora.register(new.lora_id, new.lora_path)
        if self.proposer is not None:
            self._drafted = self.proposer.propose(scheduled)
            if self._drafted and self.constraints is not None and self.tp.size == 1:
                # Drafts a grammar refuses cannot be kept: cut them before the forward computes their rows.
                self.constraints.cut_drafts(self._drafted)
                self._drafted = [state for state in self._drafted if state.drafts]
        flat = prepare_step(self.inputs, self.attention, scheduled)
        if self.lora is not None and flat is not None:
            # No request held here has an adapter (the common case with --enable-lora): no look at the rows.
            self._lora_step = self.lora.prepare(flat.ordered) if self.states.any_lora else self.lora.clear()
        return flat

    @torch.inference_mode()
    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        started = time.perf_counter()
        result = step_pb2.StepResult(step_id=batch.step_id)
        if self.host_kv is not None:  # every step: it also orders this step after the last one's copies
            result.kv_transfer_seconds = self.host_kv.transfer(batch)
            result.kv_transfer_bytes = self.host_kv.bytes_per_block * (
                len(batch.offload_blocks) + len(batch.load_slots)
            )
        if self.lora is not None:
            for adapter in batch.lora_prefetch:
                self.lora.prefetch(adapter.lora_id, adapter.lora_path)
            if not (batch.new_requests or batch.cached_requests or batch.decode_handles):
                # The head has nothing to run but waits on adapters being read: answer when one is (or soon).
                self.lora.wait_for_reads(LORA_POLL_WAIT_S)
        with traced(_tracer, "prepare_inputs"):
            flat = self.prepare(batch)
        if self.lora is not None:
            self.lora.report(result if self.tp.rank == 0 else None)
        if self.constraints is not None and batch.new_requests:
            # Compiled on a background thread while the forward pass runs.
            states = self.states.states
            arrived = [states[new.handle] for new in batch.new_requests]
            self.constraints.start([state for state in arrived if state.sampling.structured_outputs is not None])
        if flat is not None:
            events = self._forward_events
            if events is None:
                forward_started = time.perf_counter()
            else:
                events[0].record()
            with traced(_tracer, "forward"):
                hidden = self._forward(flat)
                if self.proposer is not None:
                    self.proposer.observe(flat.ordered, hidden)  # an EAGLE head reads the target's states
                logits = None
                if flat.sample_states:
                    # Every rank sends its vocabulary slice; only rank 0 receives the logits, samples and answers.
                    logits = self.model.compute_logits(hidden[flat.sample_rows])
                spans = prompt_spans(flat.ordered) if self.states.any_prompt_logprobs else None
                prompt_logits = self.model.compute_logits(hidden[span_rows(spans, hidden.device)]) if spans else None
            if events is not None:
                events[1].record()
            else:
                result.forward_seconds = time.perf_counter() - forward_started
            if spans and self.tp.rank == 0:
                write_prompt_logprobs(result, spans, prompt_logits, self.readback)
            if self.states.any_pooling and self.tp.rank == 0:
                pool_prompt_rows(flat.ordered, hidden, result, self.classify_head)
            token_ids = None
            if flat.sample_states and self.tp.rank == 0:
                with traced(_tracer, "sample"):
                    token_ids = self._sample(logits, flat.sample_states, result)
            self._advance(flat, token_ids)
            if self.proposer is not None:
                self.proposer.advanced()
            if events is not None:
                # The device's own time for the forward. Where the step sampled, the tokens' wait already covered
                # this event; otherwise it is the step's one wait, so no step returns with work still queued.
                events[1].synchronize()
                result.forward_seconds = events[0].elapsed_time(events[1]) / 1000.0
        result.compute_seconds = time.perf_counter() - started
        if self.moe_bytes_per_token and flat is not None:
            result.moe_collective_bytes = self.moe_bytes_per_token * flat.input_ids.shape[0]
        return result

    def _forward(self, flat: FlatBatch) -> torch.Tensor:
        """Final hidden states of the step's rows: a graph replay for a decode-only step that fits one, else eager."""
        if self.graphs is not None and not self._lora_step:  # a captured graph runs the base model only
            hidden = self.graphs.run(flat)
            if hidden is not None:
                self.num_replayed_steps += 1
                return hidden
        self.num_eager_steps += 1
        return self.model(flat.input_ids, flat.positions, flat.attention)

    def _advance(self, flat: FlatBatch, token_ids: list[int] | None) -> None:
        """Move the step's requests past the tokens it computed, and append the tokens it sampled: the next step's
        inputs, which the head therefore never sends back (and may schedule before it has seen them). Every rank
        does this; rank 0 sampled and tells the others."""
        ordered, states = flat.ordered, flat.sample_states
        if self._drafted:
            self._advance_speculating(flat, token_ids)
            return
        if states and self.tp.size > 1:
            shared = torch.empty(len(states), dtype=torch.long)
            if token_ids is not None:
                shared.copy_(torch.tensor(token_ids, dtype=torch.long))
            received = self.tp.broadcast(shared.to(self.tp_device))
            if token_ids is None:
                # Rank 0 already holds the tokens: only the other ranks wait for them.
                token_ids = to_host(self.readback, received)[0]
        if len(states) == len(ordered):
            # Every request sampled (the common step): one pass does both.
            for state, token_id in zip(ordered, token_ids, strict=True):
                state.token_ids.append(token_id)
                state.num_computed_tokens += state.num_scheduled_tokens
            return
        for state, token_id in zip(states, token_ids or (), strict=True):
            state.token_ids.append(token_id)
        for state in ordered:
            state.num_computed_tokens += state.num_scheduled_tokens

    def _advance_speculating(self, flat: FlatBatch, row_tokens: list[int] | None) -> None:
        """_advance for a step with drafts: every rank gets every row's token from rank 0 and keeps, for each
        speculating request, the agreeing drafts and the token after them (the same on every rank)."""
        states = flat.sample_states
        if self.tp.size > 1:
            shared = torch.empty(len(flat.sample_rows), dtype=torch.long)
            if row_tokens is not None:
                shared.copy_(torch.tensor(row_tokens, dtype=torch.long))
            received = self.tp.broadcast(shared.to(self.tp_device))
            if row_tokens is None:
                row_tokens = to_host(self.readback, received)[0]
        for state, run in zip(states, split_runs(states, row_tokens), strict=True):
            if state.drafts:
                del state.token_ids[-len(state.drafts) :]
                # KV is valid for the next token's row and every kept draft: as many positions as tokens emitted.
                state.num_computed_tokens += len(run)
                state.drafts = None
                self.proposer.kept(state)
            else:
                state.num_computed_tokens += state.num_scheduled_tokens
            state.token_ids.extend(run)
        sampled = set(map(id, states))
        for state in flat.ordered:
            if id(state) not in sampled:
                state.num_computed_tokens += state.num_scheduled_tokens
        self._drafted = []

    def _forget(self, state: RequestState) -> None:
        """A request left this worker: free its block-table row and its penalty row."""
        self.inputs.release(state)
        if self.proposer is not None:
            self.proposer.forget(state)
        if self.penalties is not None:
            self.penalties.release(state)
        if self.constraints is not None:
            self.constraints.release(state)

    def _sample(self, logits: torch.Tensor, states: list[RequestState], result: step_pb2.StepResult) -> list[int]:
        """One token per sampled row (a speculating request has a row per draft and one more); the answer."""
        constraints = self.constraints
        constraints.seconds = 0.0
        drafting = bool(self._drafted)
        per_row = row_states(states) if drafting else states
        sampled = None
        rows = None
        # A speculating request's rows are masked as its grammar stands after the drafts before each.
        mask = constraints.mask_speculating if drafting else constraints.mask
        if self.states.all_argmax_only or all(state.argmax_only for state in states):
            # The common greedy step: no per-row settings to build, one argmax after the constraint masks.
            mask(logits, states)
            token_ids = row_argmax(logits, self.readback)
        else:
            if drafting:
                rows = [sampling_row(state, ahead) for state, ahead in zip(per_row, row_offsets(states), strict=True)]
            else:
                rows = [sampling_row(state) for state in states]
            history = None
            penalized = [row for row in rows if row.has_penalties]
            if penalized:
                if self.penalties is None:
                    self.penalties = PenaltyState(logits.shape[1], logits.device)
                penalized_states = [state for state, row in zip(per_row, rows, strict=True) if row.has_penalties]
                seen = any(row.penalizes_repetition for row in penalized)
                counts = any(row.penalizes_outputs for row in penalized)
                if drafting:
                    offsets = [at for at, row in zip(row_offsets(states), rows, strict=True) if row.has_penalties]
                    history = speculating_history(self.penalties, penalized_states, offsets, seen, counts)
                else:
                    history = self.penalties.history(penalized_states, seen=seen, output_counts=counts)
            mask(logits, states)
            sampled = self.sampler(logits, rows, history)
            token_ids = sampled.token_ids
        with_logprobs = sampled is not None and any(row.num_logprobs is not None for row in rows)
        if drafting:
            # A run is cut after the token that completes its constraint.
            done, runs = constraints.advance_runs(states, split_runs(states, token_ids))
            result.constraint_done.extend(done)
            result.constraint_seconds = constraints.seconds
            write_result(result, states, runs, sampled, with_logprobs)
            return token_ids
        result.constraint_done.extend(constraints.advance(states, token_ids))
        result.constraint_seconds = constraints.seconds
        result.handles.extend([state.handle for state in states])  # a list extends faster than a generator
        result.token_ids.extend(token_ids)
        if with_logprobs:
            result.logprobs.extend(lp if lp is not None else 0.0 for lp in sampled.logprobs)
            for ids, lps in zip(sampled.top_ids, sampled.top_logprobs, strict=True):
                result.top_logprobs.add(token_ids=ids, logprobs=lps)
        return token_ids
