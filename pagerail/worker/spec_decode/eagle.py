"""EAGLE / EAGLE-3 proposals: a one-layer head drafts greedily from the target's hidden states.

The head runs on rank 0, whole, and every rank receives its drafts by one broadcast (as a draft model's). Its KV
shares the target's slot space: position i of a request holds the head's KV for (t[i+1], f_i) in the same block
as the target's KV for t[i]. After each step rank 0 keeps the target features of the positions the step kept; the
next proposal first feeds them to the head (writing its KV), and the head's output at the last position gives the
first draft, its chained outputs the rest. Positions the head drafted over are rewritten with the target's own
features once verified, so stale head KV only makes drafts worse, never outputs wrong.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from pagerail.common.model_source import resolve_model_dir
from pagerail.common.speculative_config import SpeculativeConfig
from pagerail.worker.layers.cpu_matmul import attach_cpu_weights
from pagerail.worker.model_loader import checkpoint_tensor_names, iter_lazy_safetensors, load_hf_config
from pagerail.worker.parallel_state import TensorParallelGroup
from pagerail.worker.request_state import RequestState
from pagerail.worker.spec_decode.eagle_head import EagleHead, check_head_config, eagle3_layers, head_checkpoint_name
from pagerail.worker.spec_decode.shared_drafts import RankZeroDrafter, append_drafts, share_drafts
from pagerail.worker.step_inputs import prepare_step

logger = logging.getLogger(__name__)


def load_eagle_head(
    head_dir: Path,
    eagle3: bool,
    target: nn.Module,
    tp: TensorParallelGroup,
    dtype: torch.dtype,
    device: torch.device,
    target_dir: Path | None,
) -> EagleHead:
    """The head of `head_dir`, checked against the target; tensors it lacks (embeddings, EAGLE-1's LM head) are the
    target's: shared at one rank, read whole from the target's checkpoint where the target is split."""
    config = load_hf_config(head_dir)
    names = {head_checkpoint_name(name) for name in checkpoint_tensor_names(head_dir)}
    check_head_config(config, target.config, eagle3, names)
    with device:
        head = EagleHead(config, eagle3, dtype, target.config.hidden_size, "fc.bias" in names)
    borrowed = {"embed_tokens": "embed_tokens.weight" not in names}
    if not eagle3:
        borrowed["lm_head"] = "lm_head.weight" not in names
    borrowed = [name for name, wanted in borrowed.items() if wanted]
    head.loaded_elsewhere = frozenset(f"{name}.weight" for name in borrowed)
    head.load_weights(iter_lazy_safetensors(head_dir))
    if borrowed and tp.size > 1:
        _read_target_tensors(head, borrowed, target, target_dir)
    if device.type == "cpu":
        attach_cpu_weights(head)
    if borrowed and tp.size == 1:
        embed = getattr(getattr(target, "model", None), "embed_tokens", None)
        if embed is None:
            raise ValueError(
                f"speculative_config.model has no embed_tokens and {type(target).__name__} has none to share"
            )
        head.embed_tokens = embed if "embed_tokens" in borrowed else head.embed_tokens
        if "lm_head" in borrowed:
            head.lm_head = target.lm_head
    return head.eval()


def _read_target_tensors(head: EagleHead, borrowed: list[str], target: nn.Module, target_dir: Path | None) -> None:
    """Whole copies of the target's embeddings / LM head for a head on rank 0 of a split target."""
    if target_dir is None or not list(Path(target_dir).glob("*.safetensors")):
        raise ValueError(
            "speculative_config.model lacks embed_tokens / lm_head, and the target's are split across ranks and "
            "not in a safetensors checkpoint to read whole"
        )
    tied = bool(getattr(target, "tie_word_embeddings", False))
    wanted = {"model.embed_tokens.weight": [name for name in borrowed if name == "embed_tokens"]}
    wanted["model.embed_tokens.weight"] += ["lm_head"] if tied and "lm_head" in borrowed else []
    if not tied and "lm_head" in borrowed:
        wanted["lm_head.weight"] = ["lm_head"]
    for name, tensor in iter_lazy_safetensors(target_dir):
        for module_name in wanted.pop(name, ()):
            param = getattr(head, module_name).weight
            param.weight_loader(param, tensor)
    if any(wanted.values()):
        raise ValueError(f"the target checkpoint lacks {sorted(wanted)} for the EAGLE head")


class EagleProposer(RankZeroDrafter):
    """Drafts from an EAGLE or EAGLE-3 head; `propose` runs on every rank (rank 0 drafts, the others receive)."""

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
        # EAGLE-3 reads states inside the target's forward (hooks), which a replayed graph would skip.
        self.reads_layer_states = config.method == "eagle3"
        # Rank 0, per request: the target features of kept positions the head has not read yet, as (first
        # position, features) pieces. The head's own state holds its tokens shifted by one.
        self._pending: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._step: tuple | None = None
        self._layer_states: dict[int, torch.Tensor] = {}
        if tp.rank != 0:
            return
        head_dir = resolve_model_dir(config.model)
        self.bind(
            load_eagle_head(head_dir, self.reads_layer_states, target, tp, dtype, device, target_dir), dtype, block_size
        )
        if self.reads_layer_states:
            layers = target.model.layers
            self._layer_ids = eagle3_layers(len(layers), self.model.config)
            for index in set(self._layer_ids):
                layers[index].register_forward_pre_hook(self._layer_hook(index))
        logger.info("rank 0: %s head %s loaded for speculative decoding", config.method, head_dir)

    def _layer_hook(self, index: int):
        def keep_input(module, args):
            # (rope, hidden, residual, meta): the residual stream entering the layer is hidden + residual.
            hidden, residual = args[1], args[2]
            self._layer_states[index] = hidden if residual is None else hidden + residual

        return keep_input

    def observe(self, ordered: list[RequestState], hidden: torch.Tensor) -> None:
        """After the target's forward (rank 0): remember where each request's rows are and how far it had computed."""
        if self.model is None:
            return
        layer_states = None
        if self.reads_layer_states:
            layer_states = [self._layer_states.get(index) for index in self._layer_ids]
            self._layer_states.clear()
            if any(s is None or s.shape[0] != hidden.shape[0] for s in layer_states):
                layer_states = None  # a replayed graph ran no hooks: this step's features are lost
        before = [(state, state.num_computed_tokens, state.num_scheduled_tokens) for state in ordered]
        self._step = (before, hidden, layer_states)

    def advanced(self) -> None:
        """After the step moved its requests on (rank 0): keep the features of the positions each request kept."""
        if self._step is None:
            return
        before, hidden, layer_states = self._step
        self._step = None
        if self.reads_layer_states and layer_states is None:
            return
        rows, pieces, row = [], [], 0
        for state, computed, scheduled in before:
            kept = state.num_computed_tokens - computed
            if 0 < kept <= scheduled:
                rows.extend(range(row, row + kept))
                pieces.append((state.handle, computed, kept))
            row += scheduled
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        if layer_states is None:
            features = hidden.index_select(0, index)
        else:
            features = self.model.combine(torch.cat([s.index_select(0, index) for s in layer_states], dim=-1))
        at = 0
        for handle, computed, kept in pieces:
            self._pending.setdefault(handle, []).append((computed, features[at : at + kept]))
            at += kept

    @torch.inference_mode()
    def propose(self, scheduled: list[RequestState]) -> list[RequestState]:
        """Feed every scheduled request's new features to the head; drafts for those with lookahead room."""
        wanted = [s for s in scheduled if s.num_lookahead and s.num_scheduled_tokens == 1]
        drafts = self._draft(scheduled, wanted) if self.model is not None else None
        if not wanted:
            return []
        return append_drafts(wanted, share_drafts(self.tp, self.device, self.k, len(wanted), drafts))

    def _draft(self, scheduled: list[RequestState], wanted: list[RequestState]) -> list[list[int]]:
        wanted_ids = {id(state) for state in wanted}
        drafts: dict[int, list[int]] = {id(state): [] for state in wanted}
        fed, features = [], {}
        for state in scheduled:
            head, piece = self._catch_up(state)
            if piece is None:
                continue
            head.skip_sampling = id(state) not in wanted_ids
            fed.append((state, head))
            features[id(head)] = piece
        # Feed: the head's KV through the last computed position; its last row's output is the first draft.
        active = []
        if fed:
            active = self._head_step([head for _, head in fed], features)
            for state, head in fed:
                head.num_computed_tokens = state.num_computed_tokens
        by_head = {id(head): state for state, head in fed}
        while active:
            still, features = [], {}
            for head, token, feature in active:
                state = by_head[id(head)]
                drafts[id(state)].append(token)
                if len(drafts[id(state)]) < min(state.num_lookahead, self.k):
                    head.token_ids.append(token)
                    head.num_scheduled_tokens = 1
                    features[id(head)] = feature
                    still.append(head)
            if not still:
                break
            active = self._head_step(still, features)
            for head in still:
                head.num_computed_tokens += 1
        for state, head in fed:
            # Positions from the next token on were drafted over; they are fed again once verified.
            head.num_computed_tokens = state.num_computed_tokens
            del head.token_ids[state.num_computed_tokens :]
        return [drafts[id(state)] for state in wanted]

    def _head_step(self, heads: list[RequestState], features: dict[int, torch.Tensor]) -> list[tuple]:
        """One head forward over `heads`' scheduled rows; (head, greedy token, next feature) for each sampling one."""
        flat = prepare_step(self.buffers, self.settings, heads)
        rows = torch.cat([features[id(head)] for head in flat.ordered], dim=0)
        out, chained = self.model(flat.input_ids, flat.positions, flat.attention, rows)
        if not flat.sample_states:
            return []
        tokens = self.model.greedy_tokens(out[flat.sample_rows])
        following = chained[flat.sample_rows]
        pairs = enumerate(zip(flat.sample_states, tokens, strict=True))
        return [(head, token, following[i : i + 1]) for i, (head, token) in pairs]

    def _catch_up(self, state: RequestState) -> tuple[RequestState, torch.Tensor | None]:
        """The head's state for `state`, scheduled over the positions whose features it has not read (ending at
        the last computed position), and those features; None when it cannot end there (features lost)."""
        head = self._states.get(state.handle)
        position = state.num_computed_tokens
        if head is None or head.block_epoch != state.block_epoch:
            # New, or its blocks were replaced (preempted and resumed): whatever head KV they hold stands.
            if head is not None:
                self.buffers.release(head)
            head = RequestState(state.handle, [], state.num_prompt_tokens, state.sampling, [], position, None)
            head.block_epoch = state.block_epoch
            self._states[state.handle] = head
            self._pending.pop(state.handle, None)
        if len(head.block_ids) != len(state.block_ids):
            head.block_ids.extend(state.block_ids[len(head.block_ids) :])
            head.table_row = -1
        pieces = self._pending.pop(state.handle, None)
        if not pieces or pieces[-1][0] + pieces[-1][1].shape[0] != position:
            return head, None
        # The contiguous run of pieces ending at the last computed position.
        start = pieces[-1][0]
        run = [pieces[-1][1]]
        for first, rows in reversed(pieces[:-1]):
            if first + rows.shape[0] != start:
                break
            start = first
            run.insert(0, rows)
        written = head.num_computed_tokens = max(min(head.num_computed_tokens, position), start)
        if written == position:
            return head, None
        features = torch.cat(run, dim=0)[written - start :]
        # The head's token at position i is t[i+1].
        del head.token_ids[written:]
        if len(head.token_ids) < written:
            head.token_ids.extend(state.token_ids[len(head.token_ids) + 1 : written + 1])
        head.token_ids.extend(state.token_ids[written + 1 : position + 1])
        head.num_scheduled_tokens = position - written
        return head, features

    def kept(self, state: RequestState) -> None:
        """Nothing to do: the verified positions' features arrive with the step (advanced)."""

    def forget(self, state: RequestState) -> None:
        self._pending.pop(state.handle, None)
        super().forget(state)
