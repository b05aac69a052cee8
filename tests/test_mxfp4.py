"""gpt-oss with MXFP4 experts: decoding every code and scale, loading split by columns or experts, greedy parity."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagerail import LLM
from pagerail.cluster.bench.random_checkpoints import save_random_weights
from pagerail.worker.layers.lazy_tensor import LazyTensor
from pagerail.worker.layers.moe import FusedMoE
from pagerail.worker.layers.moe_activation import ExpertActivation
from pagerail.worker.layers.moe_mxfp4 import Mxfp4FusedMoE
from pagerail.worker.layers.quantization.mxfp4 import dequantize_mxfp4
from pagerail.worker.model_loader import load_model
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup
from tests.model_harness import prefill_logits, run_ranks
from tests.mxfp4_checkpoints import quantize_mxfp4, write_mxfp4_checkpoint
from tests.parity import compare, engine_greedy, reference_greedy
from tests.test_gpt_oss import NEW_TOKENS, PROMPTS, gpt_oss_config


def spec_e2m1(code: int) -> float:
    """e2m1 by the OCP MX specification: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is
    subnormal."""
    sign, exponent, mantissa = (-1) ** (code >> 3), (code >> 1) & 3, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))


SPEC_E2M1 = [spec_e2m1(code) for code in range(16)]
EXPERTS, INTER, HIDDEN = 8, 64, 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, the same model with those experts dequantized to fp32) of test_gpt_oss's config."""
    root = tmp_path_factory.mktemp("mxfp4")
    dense = save_random_weights(gpt_oss_config(), root / "dense", 0, scale=0.08)
    write_mxfp4_checkpoint(dense, root / "mxfp4", root / "dequantized")
    return root / "mxfp4", root / "dequantized"


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_every_code_of_every_byte_decodes_exactly():
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16)  # 16 blocks of 16 bytes: every byte once
    got = dequantize_mxfp4(blocks, torch.full((16,), 127, dtype=torch.uint8), torch.float64).view(256, 2)
    want = torch.tensor([[SPEC_E2M1[b & 15], SPEC_E2M1[b >> 4]] for b in range(256)], dtype=torch.float64)
    assert torch.equal(got, want)
    assert sorted(set(SPEC_E2M1)) == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    # Codes 0 and 8 are +0 and -0.
    assert torch.equal(torch.signbit(got[:2, 0]), torch.tensor([False, False])) and torch.signbit(got[8, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scales_are_exact_powers_of_two_to_the_extremes(dtype):
    scales = torch.tensor([0, 1, 100, 126, 127, 128, 200, 254], dtype=torch.uint8)
    blocks = torch.arange(16 * 8, dtype=torch.uint8).view(8, 16)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == (8 * 32,) and got.dtype == dtype
    for group, scale in enumerate(scales.tolist()):
        for j, byte in enumerate(blocks[group].tolist()):
            for nibble, code in enumerate((byte & 15, byte >> 4)):
                want = torch.tensor(SPEC_E2M1[code] * 2.0 ** (scale - 127), dtype=torch.float64)
                # fp32 and bf16 have the same exponent range: their largest scale overflows exactly where fp32 does.
                want = want if dtype == torch.float64 else want.float().to(dtype)
                assert got[group * 32 + 2 * j + nibble].item() == want.item(), (scale, code)
    if dtype != torch.float64:
        assert got[0] == 0 and got[2] == 2.0**-128, "the smallest scale leaves subnormals, not zeros"
        assert torch.isinf(got[-32:]).sum() > 0 and torch.isfinite(got[:-32]).all()


def test_any_leading_dimensions():
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (3, 5, 4), dtype=torch.uint8, generator=generator)
    got = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert got.shape == (3, 5, 128)
    for index in [(0, 0), (2, 4), (1, 3)]:
        assert torch.equal(got[index], dequantize_mxfp4(blocks[index], scales[index], torch.bfloat16))
    # bf16 holds every MXFP4 value of this range exactly.
    assert torch.equal(got.float(), dequantize_mxfp4(blocks, scales, torch.float32))
    with pytest.raises(ValueError, match=r"scales must be uint8 \(3, 5, 4\)"):
        dequantize_mxfp4(blocks, scales[..., :3])


def test_the_writer_round_trips_values_that_are_mxfp4_already():
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (4, 6, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 150, (4, 6, 2), dtype=torch.uint8, generator=generator)
    exact = dequantize_mxfp4(blocks, scales, torch.float64)
    again = dequantize_mxfp4(*quantize_mxfp4(exact), torch.float64)
    assert torch.equal(again, exact)


def expected_experts(tensors: dict, layer: int, rank: int, size: int, ep: bool) -> dict[str, torch.Tensor]:
    """A rank's w13 (gate rows, then up rows) and w2, dequantized from the checkpoint's blocks by hand."""
    prefix = f"model.layers.{layer}.mlp.experts."
    w13 = dequantize_mxfp4(tensors[prefix + "gate_up_proj_blocks"], tensors[prefix + "gate_up_proj_scales"])
    w2 = dequantize_mxfp4(tensors[prefix + "down_proj_blocks"], tensors[prefix + "down_proj_scales"])
    gate, up = w13[:, 0::2], w13[:, 1::2]
    if ep:
        experts = slice(rank * EXPERTS // size, (rank + 1) * EXPERTS // size)
        return {"w13": torch.cat([gate, up], 1)[experts], "w2": w2[experts]}
    cols = slice(rank * INTER // size, (rank + 1) * INTER // size)
    return {"w13": torch.cat([gate[:, cols], up[:, cols]], 1), "w2": w2[:, :, cols]}


@pytest.mark.parametrize(("size", "ep"), [(1, False), (2, False), (2, True), (4, True)])
def test_each_rank_holds_its_dequantized_slice_exactly(checkpoints, size, ep):
    tensors = checkpoint_tensors(checkpoints[0])
    for rank in range(size):
        model = load_model(checkpoints[0], TensorParallelGroup(rank, size), enable_expert_parallel=ep)
        for layer in range(4):
            experts = model.model.layers[layer].mlp.experts
            assert isinstance(experts, Mxfp4FusedMoE) and not experts.packed, "the CPU path holds dense weights"
            want = expected_experts(tensors, layer, rank, size, ep)
            assert torch.equal(experts.w13_weight, want["w13"]) and torch.equal(experts.w2_weight, want["w2"])
            assert (
                experts.w13_views is not None
                and experts.w13_views[0].weight.data_ptr() == experts.w13_weight.data_ptr()
            )
            assert not any(name.endswith(("_blocks", "_scales")) for name, _ in model.named_parameters())


def test_logits_equal_the_dequantized_checkpoint_and_ranks_match(checkpoints):
    ids = torch.arange(5, 45)
    mxfp4, dequantized = (prefill_logits(load_model(path), ids) for path in checkpoints)
    assert torch.equal(mxfp4, dequantized), "the same fp32 weights give the same logits, bit for bit"
    for ep in (False, True):
        logits = run_ranks(checkpoints[0], 2, ids, enable_expert_parallel=ep)
        torch.testing.assert_close(logits[0], mxfp4, atol=1e-4, rtol=1e-4)


def test_bf16_model_dequantizes_to_bf16(checkpoints):
    model = load_model(checkpoints[0], dtype=torch.bfloat16)
    experts = model.model.layers[2].mlp.experts
    assert experts.w13_weight.dtype == experts.w13_bias.dtype == torch.bfloat16
    want = expected_experts(checkpoint_tensors(checkpoints[0]), 2, 0, 1, False)
    assert torch.equal(experts.w13_weight.float(), want["w13"]), "MXFP4 values are exact in bf16"


def test_a_rank_reads_only_its_groups_of_down_proj():
    reads = []

    class Source:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def __getitem__(self, index):
            reads.append(index)
            return self.tensor[index]

    blocks = torch.randint(0, 256, (EXPERTS, HIDDEN, INTER // 32, 16), dtype=torch.uint8)
    moe = layer(TensorParallelGroup(1, 2))
    moe.w2_blocks.weight_loader(moe.w2_blocks, LazyTensor(Source(blocks), blocks.shape, torch.uint8))
    # Rank 1's columns 32..63 of each expert's down_proj: block group 1 of 2.
    assert reads == [(slice(0, EXPERTS), slice(0, HIDDEN), slice(1, 2), slice(0, 16))]
    assert torch.equal(moe.w2_blocks, blocks[:, :, 1:2])


def layer(tp: TensorParallelGroup, ep: bool = False, inter: int = INTER) -> Mxfp4FusedMoE:
    activation = ExpertActivation("swiglu_clamped", 1.702, 7.0)
    return Mxfp4FusedMoE(EXPERTS, 2, HIDDEN, inter, tp, torch.float32, False, ep, True, True, activation, True)


def test_splits_that_cut_mxfp4_blocks_are_refused_naming_the_sizes(checkpoints):
    pattern = r"intermediate_size=64 split over tensor_parallel_size=4 gives 16 columns per rank, not a multiple of 32"
    with pytest.raises(ValueError, match=pattern):
        load_model(checkpoints[0], TensorParallelGroup(0, 4))
    with pytest.raises(ValueError, match=r"intermediate_size=2880 split over tensor_parallel_size=4 gives 720 "):
        Mxfp4FusedMoE(32, 4, 2880, 2880, TensorParallelGroup(0, 4), torch.float32, False, has_bias=True)
    with pytest.raises(ValueError, match="hidden_size=48 is not a multiple of 32, the MXFP4 block size"):
        Mxfp4FusedMoE(8, 2, 48, 64, SINGLE_RANK, torch.float32, False, has_bias=True)
    # Whole experts per rank need no column split: the same sizes load with expert parallelism.
    assert layer(TensorParallelGroup(1, 4), ep=True).w2_blocks.shape == (2, HIDDEN, 2, 16)
    assert type(FusedMoE(8, 2, 48, 40, SINGLE_RANK, torch.float32, False)) is FusedMoE


def rewrite(source: Path, target: Path, edit) -> Path:
    target.mkdir()
    shutil.copy(source / "config.json", target)
    save_file(edit(checkpoint_tensors(source)), str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("tensor", ["down_proj_scales", "gate_up_proj_blocks"])
def test_a_missing_blocks_or_scales_tensor_is_named(checkpoints, tmp_path, tensor):
    name = f"model.layers.1.mlp.experts.{tensor}"
    bad = rewrite(checkpoints[0], tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    ours = {"down_proj_scales": "w2_scales", "gate_up_proj_blocks": "w13_blocks"}[tensor]
    with pytest.raises(ValueError, match=rf"checkpoint is missing 1 tensors: model\.layers\.1\.mlp\.experts\.{ours}"):
        load_model(bad)


def test_wrong_block_shape_and_dtype_name_the_tensor(checkpoints, tmp_path):
    name = "model.layers.2.mlp.experts.gate_up_proj_scales"

    def widen(tensors: dict) -> dict:
        return {**tensors, name: torch.zeros(EXPERTS, 2 * INTER, 3, dtype=torch.uint8)}

    with pytest.raises(
        ValueError, match=rf"'{name}': stacked gate_up_proj_scales of all experts has shape \(8, 128, 3\)"
    ):
        load_model(rewrite(checkpoints[0], tmp_path / "shape", widen))

    def as_int32(tensors: dict) -> dict:
        return {**tensors, name: tensors[name].to(torch.int32)}

    with pytest.raises(ValueError, match=rf"'{name}': gate_up_proj_scales must be uint8, got torch.int32"):
        load_model(rewrite(checkpoints[0], tmp_path / "dtype", as_int32))


@pytest.mark.slow  # two greedy runs of 8 prompts: about 30 s on two cores
def test_greedy_tokens_match_transformers_on_the_dequantized_checkpoint(checkpoints):
    reference = reference_greedy(checkpoints[1], PROMPTS, NEW_TOKENS)
    llm = LLM(str(checkpoints[0]), block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16)
    report = compare(engine_greedy(llm, PROMPTS, NEW_TOKENS), reference)
    assert report.identical == report.total == len(PROMPTS), report.divergences
