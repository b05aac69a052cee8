"""gpt-oss's MoE layer: its router and experts (biases, interleaved gate/up, clamped SwiGLU) against transformers'
GptOssMLP, loaded from its stacked checkpoint layout, split by columns or by experts over simulated ranks."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from pagerail.worker.layers.lazy_tensor import LazyTensor
from pagerail.worker.layers.linear import ColumnParallelLinear
from pagerail.worker.layers.moe import FusedMoE
from pagerail.worker.layers.moe_activation import SILU, ExpertActivation
from pagerail.worker.layers.moe_grouped import grouped_experts
from pagerail.worker.layers.moe_routing import select_experts
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 8, 4
SWIGLU = ExpertActivation("swiglu_clamped", 1.702, 7.0)


class LocalPart(TensorParallelGroup):
    """One rank of a simulated group whose all-reduce returns this rank's own part, for the test to sum."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.fixture(scope="module")
def reference() -> GptOssMLP:
    """transformers' gpt-oss MLP with weights wide enough that the SwiGLU's clamps bind on many entries."""
    config = GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    mlp = GptOssMLP(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.6)
    return mlp


def checkpoint(mlp: GptOssMLP) -> dict[str, torch.Tensor]:
    return {name: param.detach() for name, param in mlp.named_parameters()}


def build(tensors: dict, tp: TensorParallelGroup, ep: bool) -> tuple[ColumnParallelLinear, FusedMoE]:
    """Our router and experts on `tp`, loaded from gpt-oss's stacked tensors as a checkpoint holds them."""
    router = ColumnParallelLinear(HIDDEN, EXPERTS, True, SINGLE_RANK, torch.float32)
    router.weight.weight_loader(router.weight, tensors["router.weight"])
    router.bias.weight_loader(router.bias, tensors["router.bias"])
    experts = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, tp, torch.float32, False, ep, True, True, SWIGLU, True)
    loads = {
        "w13_weight": ("experts.gate_up_proj", "interleaved_transposed"),
        "w13_bias": ("experts.gate_up_proj_bias", "interleaved"),
        "w2_weight": ("experts.down_proj", "transposed"),
        "w2_bias": ("experts.down_proj_bias", None),
    }
    for param_name, (name, layout) in loads.items():
        param = getattr(experts, param_name)
        param.weight_loader(param, tensors[name], layout)
    assert experts.missing_parts() == []
    return router, experts


def tokens(count: int = 30) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(5))


def test_router_softmax_over_the_top_k_logits_matches_transformers(reference):
    hidden = tokens()
    _, want_weights, want_ids = reference.router(hidden)
    weights, ids = select_experts(
        torch.nn.functional.linear(hidden, *reference.router.parameters()), TOP_K, False, True
    )
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-7, rtol=1e-6)


def test_experts_match_transformers_gpt_oss_mlp(reference):
    hidden = tokens()
    router, experts = build(checkpoint(reference), SINGLE_RANK, False)
    got = experts(hidden, router(hidden))
    with torch.no_grad():
        want, _ = reference(hidden[None])
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    # The clamps bind: without them the answer moves.
    unclamped = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, SINGLE_RANK, torch.float32, False, False, True, True,
                         ExpertActivation("swiglu_clamped", 1.702, 1e9), True)  # fmt: skip
    unclamped.load_state_dict(experts.state_dict())
    assert (unclamped(hidden, router(hidden)) - got).abs().max() > 1e-2


@pytest.mark.parametrize(("size", "ep"), [(2, False), (4, False), (2, True), (4, True)])
def test_parallel_parts_sum_to_single_rank(reference, size, ep):
    hidden = tokens()
    router, single = build(checkpoint(reference), SINGLE_RANK, False)
    logits = router(hidden)
    ranks = [build(checkpoint(reference), LocalPart(rank=r, size=size), ep)[1] for r in range(size)]
    for rank, moe in enumerate(ranks):
        assert moe.w13_bias.shape == ((EXPERTS // size, 2 * INTER) if ep else (EXPERTS, 2 * INTER // size))
        if not ep and rank:
            assert not moe.w2_bias.any(), "under the column split only rank 0 adds the down bias"
    torch.testing.assert_close(sum(moe(hidden, logits) for moe in ranks), single(hidden, logits), atol=1e-5, rtol=1e-5)


def test_a_rank_reads_only_its_slice_of_the_stacked_tensors(reference):
    reads = []

    class Source:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def __getitem__(self, index):
            reads.append(index)
            return self.tensor[index]

    full = checkpoint(reference)["experts.gate_up_proj"]
    lazy = LazyTensor(Source(full), full.shape, full.dtype)
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, LocalPart(rank=1, size=2), torch.float32, False, has_bias=True)
    moe.w13_weight.weight_loader(moe.w13_weight, lazy, "interleaved_transposed")
    # Columns 2 * 12 .. 2 * 24 of every expert: rank 1's gate/up columns 12..23, interleaved.
    assert reads == [(slice(0, EXPERTS), slice(0, HIDDEN), slice(INTER, 2 * INTER))]
    torch.testing.assert_close(moe.w13_weight[:, :12], full[:, :, INTER::2].transpose(1, 2))
    torch.testing.assert_close(moe.w13_weight[:, 12:], full[:, :, INTER + 1 :: 2].transpose(1, 2))


def test_dummy_weights_in_our_layout_split_like_the_checkpoint_layout():
    generator = torch.Generator().manual_seed(1)
    w13_bias, w2_bias = torch.randn(EXPERTS, 2 * INTER, generator=generator), torch.randn(EXPERTS, HIDDEN)
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, LocalPart(rank=1, size=2), torch.float32, False, has_bias=True)
    moe.w13_bias.weight_loader(moe.w13_bias, w13_bias)
    moe.w2_bias.weight_loader(moe.w2_bias, w2_bias)
    assert torch.equal(moe.w13_bias, torch.cat([w13_bias[:, 12:INTER], w13_bias[:, INTER + 12 :]], dim=1))
    assert not moe.w2_bias.any()


def test_grouped_path_adds_biases_and_clamps_as_the_per_expert_definition():
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, HIDDEN, generator=generator)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) * 0.2
    b13, b2 = torch.randn(EXPERTS, 2 * INTER, generator=generator), torch.randn(EXPERTS, HIDDEN, generator=generator)
    weights, ids = select_experts(torch.randn(9, EXPERTS, generator=generator), TOP_K, True)
    ids[0, 1] = -1  # an expert on another rank
    got = grouped_experts(hidden, w13, w2, weights, ids, b13, b2, SWIGLU)
    want = torch.zeros(9, HIDDEN, dtype=torch.float64)
    for token, slot in ids.ge(0).nonzero().tolist():
        e = int(ids[token, slot])
        gate_up = w13[e].double() @ hidden[token].double() + b13[e].double()
        act = SWIGLU(gate_up[:INTER], gate_up[INTER:])
        want[token] += float(weights[token, slot]) * (w2[e].double() @ act + b2[e].double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert (grouped_experts(hidden, w13, w2, weights, ids, b13, b2, SILU) - got).abs().max() > 1e-2


def test_bad_layouts_and_settings_are_refused_naming_them():
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, SINGLE_RANK, torch.float32, False, has_bias=True)
    with pytest.raises(ValueError, match=r"stacked gate_up_proj of all experts has shape \(8, 32, 40\), expected"):
        moe.w13_weight.weight_loader(moe.w13_weight, torch.zeros(EXPERTS, HIDDEN, 40), "interleaved_transposed")
    with pytest.raises(ValueError, match="a transposed tensor cannot load into w13"):
        moe.w13_weight.weight_loader(moe.w13_weight, torch.zeros(EXPERTS, INTER, HIDDEN), "transposed")
    with pytest.raises(ValueError, match=r"stacked down bias of all experts has shape \(8, 31\), expected \(8, 32\)"):
        moe.w2_bias.weight_loader(moe.w2_bias, torch.zeros(EXPERTS, 31))
    with pytest.raises(ValueError, match="expert activation 'gelu' is not supported"):
        ExpertActivation("gelu")
    with pytest.raises(ValueError, match="swiglu_limit must be > 0, got 0"):
        ExpertActivation("swiglu_clamped", 1.702, 0)
