"""Router softmax and top-k expert selection, with each architecture's renormalisation, as transformers computes it."""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, softmax_after_topk: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] → (weights [T, top_k] float32, expert ids [T, top_k] int64).

    Softmax over all experts in float32, then the top_k probabilities. `renormalize` divides them by their sum,
    which equals a softmax over the top_k logits alone (Mixtral always; Qwen2/3-MoE when norm_topk_prob).
    `softmax_after_topk` computes that softmax directly, top_k of the logits first (gpt-oss, as transformers
    computes it there). The weights stay float32: rounding them to the model dtype is left to the expert kernels'
    accumulation.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
    if softmax_after_topk:
        logits, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(logits, dim=-1, dtype=torch.float32), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def localize_expert_ids(ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Global expert ids → ids into this rank's slice [first_expert, first_expert + num_local), -1 elsewhere.

    An expert-parallel rank computes only its own experts; a -1 slot contributes nothing here and is summed in
    by the rank that holds the expert.
    """
    local = ids - first_expert
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))
