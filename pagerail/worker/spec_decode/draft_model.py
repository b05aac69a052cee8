"""Draft-model proposals: a small model sharing the target's tokenizer proposes k tokens by greedy decoding.

The draft runs on rank 0 only, whole (no tensor parallelism), and every rank receives its drafts by one broadcast,
so all ranks verify the same tokens. Its KV cache is its own tensor per layer but shares the target's slot space:
a request's draft KV lives in the same blocks at the same positions, so blocks, preemption and the prefix cache
need no second table. Draft KV can only make drafts worse, never outputs wrong: verification decides every token.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch import nn

from pagerail.common.model_source import resolve_model_dir
from pagerail.common.speculative_config import SpeculativeConfig
from pagerail.worker.model_loader import load_hf_config, load_model
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup
from pagerail.worker.request_state import RequestState
from pagerail.worker.sampler import row_argmax
from pagerail.worker.spec_decode.shared_drafts import RankZeroDrafter, append_drafts, share_drafts
from pagerail.worker.step_inputs import prepare_step

logger = logging.getLogger(__name__)


def check_draft_config(draft_dir: Path, target_config, target_dir: Path | None) -> None:
    """Refuse a draft whose vocabulary or tokenizer differs from the target's, naming the field."""
    draft_config = load_hf_config(draft_dir)
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"speculative_config.model has vocab_size={draft_config.vocab_size}, the target model "
            f"{target_config.vocab_size}: a draft must share the target's vocabulary"
        )
    if target_dir is not None:
        ours, theirs = _tokenizer_digest(draft_dir), _tokenizer_digest(target_dir)
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError(
                "speculative_config.model has another tokenizer than the target model (tokenizer.json differs): "
                "a draft must share the target's tokenizer"
            )


def _tokenizer_digest(model_dir: Path) -> str | None:
    path = Path(model_dir) / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


class DraftModelProposer(RankZeroDrafter):
    """Greedy drafts from a small model; `propose` runs on every rank (rank 0 drafts, the others receive)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        tp: TensorParallelGroup,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        target: nn.Module,
        target_dir: Path | None = None,
    ) -> None:
        super().__init__(tp, device, config.num_speculative_tokens)
        if tp.rank != 0:
            return
        draft_dir = resolve_model_dir(config.model)
        check_draft_config(draft_dir, target.config, target_dir)
        self.bind(load_model(draft_dir, SINGLE_RANK, dtype, device), dtype, block_size)
        logger.info("rank 0: draft model %s loaded for speculative decoding", draft_dir)

    @torch.inference_mode()
    def propose(self, scheduled: list[RequestState]) -> list[RequestState]:
        """Drafts for every scheduled request with lookahead room, appended as NgramProposer appends them."""
        wanted = [s for s in scheduled if s.num_lookahead and s.num_scheduled_tokens == 1]
        if not wanted:
            return []
        drafts = self._draft(wanted) if self.model is not None else None
        return append_drafts(wanted, share_drafts(self.tp, self.device, self.k, len(wanted), drafts))

    def _draft(self, wanted: list[RequestState]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in wanted]
        active = []
        for index, state in enumerate(wanted):
            draft = self._sync(state)
            active.append((index, draft, state.num_lookahead))
        while active:
            states = [draft for _, draft, _ in active]
            flat = prepare_step(self.buffers, self.settings, states)
            hidden = self.model(flat.input_ids, flat.positions, flat.attention)
            tokens = row_argmax(self.model.compute_logits(hidden[flat.sample_rows]))
            still = []
            for (index, draft, room), token in zip(active, tokens, strict=True):
                drafts[index].append(token)
                draft.num_computed_tokens += draft.num_scheduled_tokens
                draft.token_ids.append(token)
                draft.num_scheduled_tokens = 1
                if len(drafts[index]) < room:
                    still.append((index, draft, room))
            active = still
        return drafts

    def _sync(self, state: RequestState) -> RequestState:
        """The draft's state for `state`, caught up with its tokens and blocks: the first draft step recomputes
        whatever the draft's KV lacks, then samples after the last token."""
        draft = self._states.get(state.handle)
        if draft is None or draft.block_epoch != state.block_epoch:
            # New, or its blocks were replaced (preempted and resumed): the draft's KV starts over.
            if draft is not None:
                self.buffers.release(draft)
            draft = RequestState(state.handle, [], state.num_prompt_tokens, state.sampling, [], 0, None)
            draft.block_epoch = state.block_epoch
            self._states[state.handle] = draft
        if len(draft.block_ids) != len(state.block_ids):
            draft.block_ids.extend(state.block_ids[len(draft.block_ids) :])
            draft.table_row = -1  # its table row is rewritten with the new blocks
        # Tokens through the draft's written KV are the request's own (kept() keeps it so): only the rest is copied.
        position = state.num_computed_tokens
        written = draft.num_computed_tokens = min(draft.num_computed_tokens, position)
        del draft.token_ids[written:]
        draft.token_ids.extend(state.token_ids[written : position + 1])
        draft.num_scheduled_tokens = position + 1 - draft.num_computed_tokens
        draft.skip_sampling = False
        return draft

    def observe(self, ordered: list[RequestState], hidden: torch.Tensor) -> None:
        """The draft reads tokens only, not the target's hidden states."""

    def advanced(self) -> None:
        """Nothing kept from the step: the next proposal copies the new tokens."""

    def kept(self, state: RequestState) -> None:
        """After verification: the draft's KV holds the request's tokens through the last kept draft."""
        draft = self._states.get(state.handle)
        if draft is not None:
            draft.num_computed_tokens = min(draft.num_computed_tokens, state.num_computed_tokens)
