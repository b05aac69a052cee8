"""Mixture-of-experts models: logits parity with transformers, tensor and expert parallelism (ranks simulated by
threads) against one rank, dummy weights, and checkpoints or settings that must be refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from pagerail.worker.layers.moe import FusedMoE, moe_comm_bytes
from pagerail.worker.layers.moe_block import SparseMoeBlock
from pagerail.worker.model_loader import load_hf_config, load_model
from pagerail.worker.models.registry import model_class, supported_architectures
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup
from tests.model_harness import prefill_logits, run_ranks
from tests.tiny_models import MOE_KINDS, make_tiny_model

PROMPT_LEN = 40  # longer than Mixtral's tiny sliding window of 24


def random_ids(length: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 250, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_moe")
    return {kind: make_tiny_model(kind, root / kind) for kind in (*MOE_KINDS, "llama")}


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_logits_match_transformers(moe_dirs, kind):
    ids = random_ids()
    model = load_model(moe_dirs[kind], SINGLE_RANK, torch.float32, "cpu")
    ours = prefill_logits(model, ids)
    reference = AutoModelForCausalLM.from_pretrained(str(moe_dirs[kind]), dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(ids[None]).logits[0].float()
    assert ours.shape == (PROMPT_LEN, 250)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_models_are_registered_and_built_as_their_configs_say(moe_dirs):
    assert {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"} <= set(supported_architectures())
    models = {kind: load_model(moe_dirs[kind]) for kind in MOE_KINDS}
    for kind, model in models.items():
        assert type(model) is model_class(load_hf_config(moe_dirs[kind]))
    # mlp_only_layers=[0]: a dense layer 0 and a sparse layer 1.
    dense = models["qwen3_moe_dense"].model.layers
    assert not isinstance(dense[0].mlp, SparseMoeBlock) and isinstance(dense[1].mlp, SparseMoeBlock)
    assert dense[1].mlp.experts.top_k == 1 and not dense[1].mlp.experts.renormalize
    assert models["qwen3_moe"].model.layers[0].mlp.experts.renormalize
    assert models["qwen3_moe"].model.layers[0].self_attn.has_qk_norm
    assert models["qwen2_moe"].model.layers[0].mlp.has_shared_expert
    assert models["qwen2_moe"].model.layers[0].self_attn.qkv_proj.bias is not None
    assert models["qwen2_moe"].model.layers[0].self_attn.o_proj.bias is None
    assert [layer.sliding_window for layer in models["mixtral"].attention_layers()] == [24, 24]


@pytest.mark.parametrize(
    ("kind", "size", "ep"),
    [
        ("qwen3_moe", 2, False),
        ("qwen3_moe", 2, True),
        ("qwen3_moe", 4, True),
        ("qwen3_moe_dense", 2, True),
        ("mixtral", 2, False),
        ("mixtral", 2, True),
        ("qwen2_moe", 2, False),
        ("qwen2_moe", 4, True),
    ],
)
def test_parallel_logits_match_single_rank(moe_dirs, kind, size, ep):
    ids = random_ids()
    single = prefill_logits(load_model(moe_dirs[kind]), ids)
    logits = run_ranks(moe_dirs[kind], size, ids, enable_expert_parallel=ep)
    torch.testing.assert_close(logits[0], single, atol=1e-4, rtol=1e-4)
    assert logits[1:] == [None] * (size - 1)


def test_expert_parallel_ranks_hold_disjoint_experts(moe_dirs):
    ranks = [
        load_model(moe_dirs["qwen3_moe"], TensorParallelGroup(r, 2), enable_expert_parallel=True) for r in range(2)
    ]
    single = load_model(moe_dirs["qwen3_moe"])
    experts = [model.model.layers[1].mlp.experts for model in ranks]
    assert [list(moe.local_experts) for moe in experts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    stacked = torch.cat([moe.w13_weight for moe in experts])
    assert torch.equal(stacked, single.model.layers[1].mlp.experts.w13_weight)
    # One [T, H] float32 all-reduce per MoE layer, both layers sparse here.
    assert moe_comm_bytes(ranks[0], 10) == 2 * 10 * 64 * 4 and moe_comm_bytes(single, 10) == 0


def test_dummy_weights_load_and_do_not_depend_on_the_split(moe_dirs):
    ids = random_ids()
    model_dir = moe_dirs["qwen2_moe"]
    first = prefill_logits(load_model(model_dir, load_format="dummy", seed=3), ids)
    other = prefill_logits(load_model(model_dir, load_format="dummy", seed=4), ids)
    assert torch.isfinite(first).all() and not torch.equal(first, other)
    for ep in (False, True):
        logits = run_ranks(model_dir, 2, ids, load_format="dummy", seed=3, enable_expert_parallel=ep)
        torch.testing.assert_close(logits[0], first, atol=1e-5, rtol=1e-5)


def rewrite_checkpoint(src, dst, edit) -> None:
    """Copy a tiny model directory, passing its tensors through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_checkpoint_in_transformers_stacked_layout_loads_the_same(moe_dirs, tmp_path):
    def stack(tensors: dict) -> dict:
        for layer in range(2):
            prefix = f"model.layers.{layer}.mlp.experts"
            names = [[f"{prefix}.{e}.{proj}.weight" for e in range(8)] for proj in ("gate_proj", "up_proj")]
            gate_up = torch.stack([torch.cat([tensors[g], tensors[u]]) for g, u in zip(*names, strict=True)])
            down = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(8)])
            for name in names[0] + names[1]:
                del tensors[name]
            tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"] = gate_up, down
        return tensors

    rewrite_checkpoint(moe_dirs["qwen3_moe"], tmp_path / "stacked", stack)
    ids = random_ids()
    expected = prefill_logits(load_model(moe_dirs["qwen3_moe"]), ids)
    assert torch.equal(prefill_logits(load_model(tmp_path / "stacked"), ids), expected)


def test_missing_expert_tensor_is_named(moe_dirs, tmp_path):
    missing = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite_checkpoint(
        moe_dirs["mixtral"], tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != missing}
    )
    with pytest.raises(ValueError, match=rf"missing 1 expert tensors: {missing}"):
        load_model(tmp_path / "missing")
    # Under expert parallelism only the rank that holds expert 2 (of 4, 2 per rank) misses it.
    load_model(tmp_path / "missing", TensorParallelGroup(0, 2), enable_expert_parallel=True)
    with pytest.raises(ValueError, match=rf"missing 1 expert tensors: {missing}"):
        load_model(tmp_path / "missing", TensorParallelGroup(1, 2), enable_expert_parallel=True)


def test_wrong_expert_shape_names_the_tensor_and_both_shapes(moe_dirs, tmp_path):
    name = "model.layers.0.mlp.experts.5.down_proj.weight"

    def shrink(tensors: dict) -> dict:
        tensors[name] = tensors[name][:, :31].contiguous()
        return tensors

    rewrite_checkpoint(moe_dirs["qwen2_moe"], tmp_path / "shape", shrink)
    pattern = rf"checkpoint tensor '{name}': expert 5 down weight has shape \(64, 31\), expected \(64, 32\)"
    with pytest.raises(ValueError, match=pattern):
        load_model(tmp_path / "shape")
    # A rank that does not hold expert 5 still checks its shape (known without reading it).
    with pytest.raises(ValueError, match=pattern):
        load_model(tmp_path / "shape", TensorParallelGroup(0, 2), enable_expert_parallel=True)


def test_expert_parallel_refused_where_it_cannot_apply(moe_dirs):
    with pytest.raises(ValueError, match=r"needs a mixture-of-experts model; model_type='llama' has no routed experts"):
        load_model(moe_dirs["llama"], enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 ranks for num_experts=4"):
        load_model(moe_dirs["mixtral"], TensorParallelGroup(0, 8), enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"num_experts=8 divisible by tensor_parallel_size=3"):
        load_model(moe_dirs["qwen2_moe"], TensorParallelGroup(0, 3), enable_expert_parallel=True)
    # Without expert parallelism the same split is refused by the experts' intermediate size instead.
    with pytest.raises(ValueError, match=r"moe_intermediate_size=32 is not divisible by tensor_parallel_size=3"):
        FusedMoE(8, 2, 64, 32, TensorParallelGroup(0, 3), None, True)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_experts_on_the_packed_cpu_kernel_match_transformers(moe_dirs, kind, monkeypatch, tmp_path):
    from pagerail.worker.layers.packed_linear import packed_linear_kernel

    if packed_linear_kernel() is None:
        pytest.skip("the packed CPU kernel cannot be built here")
    # Every fp32 weight, each expert's included, runs on the packed kernel (tiny weights are left to MKL otherwise).
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "packed")
    monkeypatch.setenv("PAGERAIL_CACHE_DIR", str(tmp_path))
    model = load_model(moe_dirs[kind], SINGLE_RANK, torch.float32, "cpu")
    experts = model.model.layers[0].mlp.experts
    assert all(view.cpu_weights is not None for view in [*experts.w13_views, *experts.w2_views])
    from pagerail.worker.layers import moe_grouped

    libraries = []
    chosen = moe_grouped.linear

    def counting(x, weight, cpu):
        libraries.append(cpu.library(x.shape[0]))
        return chosen(x, weight, cpu)

    monkeypatch.setattr(moe_grouped, "linear", counting)
    ids = random_ids()
    reference = AutoModelForCausalLM.from_pretrained(str(moe_dirs[kind]), dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
    assert libraries and set(libraries) == {"packed"}
