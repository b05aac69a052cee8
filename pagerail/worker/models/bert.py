"""BERT-family encoders (BertModel, XLMRobertaModel: BGE, E5, GTE) and their cross-encoder rerankers
(*ForSequenceClassification), served as pooling models: every request's prompt runs whole in one step, each token
attending to every other (no causal mask), and nothing is kept in a KV cache.

The engine schedules an encoder's requests like any prompt, so each attention layer still binds the KV cache the
worker sizes (its memory is mapped lazily and never touched here). A pair of texts (query and document for a
reranker) comes as one prompt, `[CLS] a [SEP] b [SEP]`: BERT's segment ids are 1 after the first separator, as its
tokenizer would set them; RoBERTa-family models have a single segment.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagerail.worker.layers.attention import Attention, AttentionMetadata
from pagerail.worker.layers.lazy_tensor import materialize
from pagerail.worker.layers.linear import ReplicatedLinear
from pagerail.worker.models.causal_lm import CausalLM
from pagerail.worker.parallel_state import TensorParallelGroup

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def weight_with_loader(initial: torch.Tensor) -> nn.Parameter:
    """A parameter every rank holds whole, loaded by copying the checkpoint's tensor of the same shape."""
    param = nn.Parameter(initial, requires_grad=False)
    param.weight_loader = _copy_whole
    return param


def _copy_whole(param: nn.Parameter, full, shard_id: object = None) -> None:
    tensor = materialize(full)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


class LayerNorm(nn.Module):
    """torch's layer norm with checkpoint loaders on its weight and bias."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = weight_with_loader(torch.ones(size, dtype=dtype))
        self.bias = weight_with_loader(torch.zeros(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class EncoderAttention(Attention):
    """Bidirectional attention within each request's rows of the step; the bound KV cache is neither read nor
    written (an encoder's request is computed whole in one step)."""

    def forward(self, q, k, v, meta: AttentionMetadata, sinks=None) -> torch.Tensor:
        if meta.num_decodes:
            raise RuntimeError("an encoder computes whole prompts only; a step brought it decode rows")
        out = torch.empty_like(q)
        heads, dim = self.num_heads, self.head_dim
        for span in meta.prefills:
            rows = slice(span.start, span.end)
            length = span.end - span.start
            shaped = [t[rows].view(length, heads, dim).transpose(0, 1) for t in (q, k, v)]
            attended = F.scaled_dot_product_attention(*shaped, scale=self.scale)
            out[rows] = attended.transpose(0, 1).reshape(length, heads * dim)
        return out


class BertLayer(nn.Module):
    """Post-norm block: h = norm(x + attn(x)), then norm(h + mlp(h)); parameter names follow the checkpoints'."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        self.query = ReplicatedLinear(hidden, hidden, True, dtype)
        self.key = ReplicatedLinear(hidden, hidden, True, dtype)
        self.value = ReplicatedLinear(hidden, hidden, True, dtype)
        self.attn = EncoderAttention(heads, heads, self.head_dim, self.head_dim**-0.5)
        self.attention_output = ReplicatedLinear(hidden, hidden, True, dtype)
        self.attention_norm = LayerNorm(hidden, config.layer_norm_eps, dtype)
        self.intermediate = ReplicatedLinear(hidden, config.intermediate_size, True, dtype)
        act = config.hidden_act
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        self.activation = _ACTIVATIONS[act]
        self.output = ReplicatedLinear(config.intermediate_size, hidden, True, dtype)
        self.output_norm = LayerNorm(hidden, config.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.attn(self.query(x), self.key(x), self.value(x), meta)
        h = self.attention_norm(x + self.attention_output(attended))
        return self.output_norm(h + self.output(self.activation(self.intermediate(h))))


class BertEncoder(CausalLM):
    """Final hidden states of every prompt row; `classify` (a cross-encoder's head) maps a request's first row to its
    label logits. Generation is not served: compute_logits gives one constant logit per row, for the one token the
    engine samples (and never shows) when a pooling request's prompt ends."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        if tp.size != 1:
            raise ValueError(f"encoder models run on one rank; tensor_parallel_size must be 1, got {tp.size}")
        if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not supported")
        self.config, self.tp = config, tp
        self.roberta = config.model_type in ("roberta", "xlm-roberta")
        hidden = config.hidden_size
        self.word_embeddings = weight_with_loader(torch.empty(config.vocab_size, hidden, dtype=dtype))
        self.position_embeddings = weight_with_loader(torch.empty(config.max_position_embeddings, hidden, dtype=dtype))
        self.token_type_embeddings = weight_with_loader(torch.empty(config.type_vocab_size, hidden, dtype=dtype))
        self.embedding_norm = LayerNorm(hidden, config.layer_norm_eps, dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))
        # RoBERTa counts positions from after its padding id.
        self.position_offset = config.pad_token_id + 1 if self.roberta else 0
        self.sep_token_id = getattr(config, "sep_token_id", None)
        self.num_labels = 0
        architecture = (getattr(config, "architectures", None) or [""])[0]
        if architecture.endswith("ForSequenceClassification"):
            self.num_labels = config.num_labels
            if self.roberta:  # dense + tanh + projection on the first token
                self.classifier_dense = ReplicatedLinear(hidden, hidden, True, dtype)
            else:  # BERT's pooler (dense + tanh on the first token), then the classifier
                self.pooler = ReplicatedLinear(hidden, hidden, True, dtype)
            self.classifier = ReplicatedLinear(hidden, self.num_labels, True, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.word_embeddings)
        hidden = hidden + F.embedding(positions + self.position_offset, self.position_embeddings)
        hidden = hidden + F.embedding(self._segments(input_ids, meta), self.token_type_embeddings)
        hidden = self.embedding_norm(hidden)
        for layer in self.layers:
            hidden = layer(hidden, meta)
        return hidden

    def _segments(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each row's segment id: 1 after its prompt's first separator for a BERT with two segments, else 0."""
        segments = torch.zeros_like(input_ids)
        if self.roberta or self.sep_token_id is None or self.config.type_vocab_size < 2:
            return segments
        seps = (input_ids == self.sep_token_id).long()
        for span in meta.prefills:
            rows = slice(span.start, span.end)
            before = seps[rows].cumsum(0) - seps[rows]  # separators strictly before each row
            segments[rows] = (before > 0).long()
        return segments

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token states → [N, num_labels] logits (a cross-encoder's or classifier's head)."""
        if self.roberta:
            return self.classifier(torch.tanh(self.classifier_dense(first_rows)))
        return self.classifier(torch.tanh(self.pooler(first_rows)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device)

    def checkpoint_name(self, hf_name: str) -> tuple[str, object] | None:
        name = hf_name
        for prefix in ("bert.", "roberta.", "model."):
            name = name.removeprefix(prefix)
        if name.startswith("pooler.") and not self.num_labels:
            return None  # an embedder pools its own way; BERT's pooler is for classification
        if name == "embeddings.position_ids" or name == "embeddings.token_type_ids":
            return None  # buffers some checkpoints carry
        renamed = _RENAMES.get(name)
        if renamed is not None:
            return renamed, None
        parts = name.split(".")
        if parts[:2] == ["encoder", "layer"]:
            rest = ".".join(parts[3:])
            for hf, ours in _LAYER_RENAMES.items():
                if rest.startswith(hf):
                    return f"layers.{parts[2]}.{ours}{rest[len(hf) :]}", None
        if name.startswith("classifier.dense."):
            return "classifier_dense." + name.removeprefix("classifier.dense."), None
        if name.startswith("classifier.out_proj."):
            return "classifier." + name.removeprefix("classifier.out_proj."), None
        if name.startswith("pooler.dense."):
            return "pooler." + name.removeprefix("pooler.dense."), None
        return name, None


_RENAMES = {
    "embeddings.word_embeddings.weight": "word_embeddings",
    "embeddings.position_embeddings.weight": "position_embeddings",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings",
    "embeddings.LayerNorm.weight": "embedding_norm.weight",
    "embeddings.LayerNorm.bias": "embedding_norm.bias",
}
_LAYER_RENAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attention_output",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
