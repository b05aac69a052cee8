"""The MoE layer: routing against transformers' routers, the grouped CPU path against a per-token loop and the
Triton kernel, and the tensor- and expert-parallel splits (ranks simulated, their parts summed) against one rank."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagerail.common.expert_parallel import check_expert_parallel, num_routed_experts
from pagerail.worker.layers.lazy_tensor import LazyTensor
from pagerail.worker.layers.moe import FusedMoE, moe_comm_bytes
from pagerail.worker.layers.moe_block import SparseMoeBlock
from pagerail.worker.layers.moe_grouped import grouped_experts
from pagerail.worker.layers.moe_routing import localize_expert_ids, select_experts
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup
from tests.tiny_models import tiny_config

HIDDEN, INTER = 24, 16


class LocalPart(TensorParallelGroup):
    """One rank of a simulated group whose all-reduce returns this rank's own part, for the test to sum."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def naive_experts(hidden, w13, w2, weights, ids) -> torch.Tensor:
    """One token and one slot at a time, in float64: the definition the grouped path must reproduce."""
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(ids.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            if expert < 0:
                continue
            gate_up = w13[expert].double() @ hidden[token].double()
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[token] += float(weights[token, slot]) * (w2[expert].double() @ act)
    return out


def random_routing(tokens: int, experts: int, top_k: int, seed: int, skew: bool = False):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(tokens, top_k, generator=gen)
    weights = weights / weights.sum(-1, keepdim=True)
    if skew:
        # Expert 0 in every token, expert 1 once, the upper half of the experts never: 0, 1 and many tokens.
        ids = torch.zeros(tokens, top_k, dtype=torch.int64)
        ids[:, 1:] = torch.arange(2, 2 + top_k - 1) % max(experts // 2, 1)
        ids[0, -1] = 1
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return weights, ids


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "skew"),
    [(1, 8, 1, False), (7, 8, 2, False), (40, 8, 8, False), (33, 16, 2, True), (64, 32, 8, False), (5, 128, 8, False)],
)
def test_grouped_experts_match_per_token_loop(tokens, experts, top_k, skew):
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.2
    weights, ids = random_routing(tokens, experts, top_k, tokens, skew)
    if skew:
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
        assert counts[0] == tokens and counts[1] == 1 and not counts[experts // 2 :].any()
    got = grouped_experts(hidden, w13, w2, weights, ids)
    assert got.dtype == torch.float32 and got.shape == (tokens, HIDDEN)
    torch.testing.assert_close(got.double(), naive_experts(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_experts_in_half_precision(dtype):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(20, HIDDEN, generator=gen)
    w13 = torch.randn(8, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(8, HIDDEN, INTER, generator=gen) * 0.2
    weights, ids = random_routing(20, 8, 2, 3)
    got = grouped_experts(hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    assert got.dtype == dtype
    expected = naive_experts(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=3e-2)


def test_remote_slots_contribute_nothing_and_empty_batches_work():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, HIDDEN, generator=gen)
    w13, w2 = torch.randn(4, 2 * INTER, HIDDEN, generator=gen), torch.randn(4, HIDDEN, INTER, generator=gen)
    weights, ids = random_routing(9, 4, 2, 5)
    remote = ids.clone()
    remote[::2, 0] = -1  # half the tokens' first choice lives on another rank
    remote[3] = -1  # a token with no local expert at all
    kept = weights.clone()
    kept[remote < 0] = 0.0
    got = grouped_experts(hidden, w13, w2, weights, remote)
    torch.testing.assert_close(got, grouped_experts(hidden, w13, w2, kept, ids.clamp(min=0)), atol=1e-5, rtol=1e-5)
    assert not got[3].any()
    assert grouped_experts(hidden, w13, w2, weights, torch.full_like(ids, -1)).abs().sum() == 0
    assert grouped_experts(hidden[:0], w13, w2, weights[:0], ids[:0]).shape == (0, HIDDEN)


def test_local_expert_ids():
    ids = torch.tensor([[0, 3], [4, 7], [2, 5]])
    assert localize_expert_ids(ids, 4, 4).tolist() == [[-1, -1], [0, 3], [-1, 1]]
    assert localize_expert_ids(ids, 0, 4).tolist() == [[0, 3], [-1, -1], [2, -1]]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_dense", "mixtral", "qwen2_moe"])
def test_routing_matches_transformers_routers(kind):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = tiny_config(kind)
    router_class = {"mixtral": MixtralTopKRouter, "qwen2_moe": Qwen2MoeTopKRouter}.get(kind, Qwen3MoeTopKRouter)
    router = router_class(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        hidden = torch.randn(50, config.hidden_size, generator=gen)
        _, expected_weights, expected_ids = router(hidden)
        logits = F.linear(hidden, router.weight)
    renormalize = kind == "mixtral" or bool(config.norm_topk_prob)
    weights, ids = select_experts(logits, config.num_experts_per_tok, renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights.float(), atol=0, rtol=0)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(50))


def make_moe(tp: TensorParallelGroup, ep: bool, experts: int = 8, top_k: int = 2, stacked: bool = False):
    """A FusedMoE on `tp` loaded with the same seeded full weights, per expert or stacked."""
    gen = torch.Generator().manual_seed(11)
    gate = torch.randn(experts, INTER, HIDDEN, generator=gen) * 0.2
    up = torch.randn(experts, INTER, HIDDEN, generator=gen) * 0.2
    down = torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.2
    moe = FusedMoE(experts, top_k, HIDDEN, INTER, tp, torch.float32, True, enable_expert_parallel=ep)
    if stacked:
        moe.w13_weight.weight_loader(moe.w13_weight, torch.cat([gate, up], dim=1))
        moe.w2_weight.weight_loader(moe.w2_weight, down)
    else:
        for e in range(experts):
            moe.w13_weight.weight_loader(moe.w13_weight, gate[e], (e, "gate"))
            moe.w13_weight.weight_loader(moe.w13_weight, up[e], (e, "up"))
            moe.w2_weight.weight_loader(moe.w2_weight, down[e], (e, "down"))
    assert moe.missing_parts() == []
    return moe


@pytest.mark.parametrize(("size", "ep"), [(2, False), (4, False), (2, True), (4, True), (8, True)])
def test_parallel_parts_sum_to_single_rank(size, ep):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(13, HIDDEN, generator=gen)
    logits = torch.randn(13, 8, generator=gen)
    single = make_moe(SINGLE_RANK, False)(hidden, logits)
    ranks = [make_moe(LocalPart(rank=r, size=size), ep) for r in range(size)]
    for rank, moe in enumerate(ranks):
        if ep:
            assert moe.w13_weight.shape == (8 // size, 2 * INTER, HIDDEN) and moe.first_expert == rank * 8 // size
        else:
            assert moe.w13_weight.shape == (8, 2 * INTER // size, HIDDEN)
    torch.testing.assert_close(sum(moe(hidden, logits) for moe in ranks), single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ep", [False, True])
def test_stacked_weights_load_like_per_expert_ones(ep):
    tp = LocalPart(rank=1, size=2)
    per_expert, stacked = make_moe(tp, ep), make_moe(tp, ep, stacked=True)
    assert torch.equal(per_expert.w13_weight, stacked.w13_weight)
    assert torch.equal(per_expert.w2_weight, stacked.w2_weight)


def test_expert_parallel_rank_reads_only_its_experts():
    reads = []

    class Source:
        def __init__(self, expert: int, tensor: torch.Tensor) -> None:
            self.expert, self.tensor = expert, tensor

        def __getitem__(self, index):
            reads.append(self.expert)
            return self.tensor[index]

    moe = FusedMoE(8, 2, HIDDEN, INTER, LocalPart(rank=1, size=2), torch.float32, True, enable_expert_parallel=True)
    for e in range(8):
        lazy = LazyTensor(Source(e, torch.full((INTER, HIDDEN), float(e))), (INTER, HIDDEN), torch.float32)
        moe.w13_weight.weight_loader(moe.w13_weight, lazy, (e, "gate"))
    assert sorted(set(reads)) == [4, 5, 6, 7]
    assert moe.w13_weight[:, 0, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert moe.missing_parts()[:2] == [(4, "up"), (4, "down")] and len(moe.missing_parts()) == 8


def test_shared_expert_block_parts_sum_to_single_rank():
    def loaded(tp: TensorParallelGroup, ep: bool) -> SparseMoeBlock:
        block = SparseMoeBlock(HIDDEN, 8, 4, INTER, False, tp, torch.float32, ep, shared_expert_intermediate_size=32)
        for name, param in block.named_parameters():
            param.weight_loader(param, full[name])  # every rank gets the full tensors and keeps its slice
        return block

    gen = torch.Generator().manual_seed(4)
    reference = SparseMoeBlock(HIDDEN, 8, 4, INTER, False, SINGLE_RANK, None, shared_expert_intermediate_size=32)
    full = {name: torch.randn(p.shape, generator=gen) * 0.3 for name, p in reference.named_parameters()}
    hidden = torch.randn(9, HIDDEN, generator=gen)
    single = loaded(SINGLE_RANK, False)(hidden)
    for ep in (False, True):
        parts = [loaded(LocalPart(rank=r, size=2), ep)(hidden) for r in range(2)]
        torch.testing.assert_close(parts[0] + parts[1], single, atol=1e-5, rtol=1e-5)


def test_comm_bytes_count_one_all_reduce_per_moe_layer():
    one = make_moe(SINGLE_RANK, False)
    two = make_moe(LocalPart(rank=0, size=2), True)
    assert one.comm_bytes(100) == 0
    assert two.comm_bytes(100) == 100 * HIDDEN * 4
    model = torch.nn.ModuleList([two, torch.nn.Linear(2, 2), make_moe(LocalPart(rank=0, size=2), False)])
    assert moe_comm_bytes(model, 7) == 2 * 7 * HIDDEN * 4


def test_expert_parallel_refusals():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=16 ranks for num_experts=8"):
        FusedMoE(8, 2, HIDDEN, INTER, LocalPart(rank=0, size=16), None, True, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"num_experts=8 divisible by tensor_parallel_size=3"):
        FusedMoE(8, 2, HIDDEN, INTER, LocalPart(rank=0, size=3), None, True, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"moe_intermediate_size=16 is not divisible by tensor_parallel_size=3"):
        FusedMoE(8, 2, HIDDEN, INTER, LocalPart(rank=0, size=3), None, True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be between 1 and num_experts=8"):
        FusedMoE(8, 9, HIDDEN, INTER, SINGLE_RANK, None, True)
    with pytest.raises(ValueError, match=r"model_type='llama' has no routed experts"):
        check_expert_parallel(tiny_config("llama"), 2)
    assert num_routed_experts(tiny_config("mixtral")) == 4 and num_routed_experts({"n_routed_experts": 256}) == 256


def test_weight_loader_names_the_expert_and_both_shapes():
    moe = FusedMoE(8, 2, HIDDEN, INTER, SINGLE_RANK, torch.float32, True)
    with pytest.raises(ValueError, match=r"expert 3 up weight has shape \(15, 24\), expected \(16, 24\)"):
        moe.w13_weight.weight_loader(moe.w13_weight, torch.zeros(INTER - 1, HIDDEN), (3, "up"))
    with pytest.raises(ValueError, match=r"expert 8 is out of range for num_experts=8"):
        moe.w13_weight.weight_loader(moe.w13_weight, torch.zeros(INTER, HIDDEN), (8, "up"))
    with pytest.raises(ValueError, match=r"the down projection of expert 0 cannot load into w13"):
        moe.w13_weight.weight_loader(moe.w13_weight, torch.zeros(HIDDEN, INTER), (0, "down"))
    with pytest.raises(ValueError, match=r"stacked down weight of all experts has shape \(7, 24, 16\)"):
        moe.w2_weight.weight_loader(moe.w2_weight, torch.zeros(7, HIDDEN, INTER))


_KERNEL_CONTRACT = """
import json, torch
from pagerail.worker.layers.moe_grouped import grouped_experts
from pagerail.worker.layers.triton_moe import triton_fused_experts
errors = []
for tokens, experts, top_k in ((9, 8, 2), (3, 16, 8), (20, 4, 1)):
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 32, generator=gen)
    w13 = torch.randn(experts, 64, 32, generator=gen) * 0.2
    w2 = torch.randn(experts, 32, 32, generator=gen) * 0.2
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[::3, 0] = -1  # another rank's experts
    a = grouped_experts(hidden, w13, w2, weights, ids)
    b = triton_fused_experts(hidden, w13, w2, weights, ids)
    errors.append((a - b).abs().max().item())
print(json.dumps(errors))
"""


@pytest.mark.slow
def test_grouped_path_and_triton_kernel_share_one_contract():
    from tests.triton_interpreter import run_interpreted

    result = run_interpreted(["-c", _KERNEL_CONTRACT], timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(errors) == 3 and max(errors) < 1e-4, errors
