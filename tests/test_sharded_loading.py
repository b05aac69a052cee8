"""Tensor-parallel checkpoint loading reads only each rank's slice, and lands the same weights as full reads."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagerail.worker.layers.lazy_tensor import LazyTensor
from pagerail.worker.model_loader import checkpoint_files, iter_lazy_safetensors, load_hf_config, load_model
from pagerail.worker.models.llama import LlamaForCausalLM
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup
from tests.tiny_models import make_tiny_model

TP = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("sharded")
    # "llama": untied head; "llama_tied": tied embeddings plus attention and MLP biases.
    return {kind: make_tiny_model(kind, root / kind) for kind in ("llama", "llama_tied")}


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """Bytes of every read a LazyTensor makes from the checkpoint, in order."""
    counted: list[int] = []
    original = LazyTensor._read

    def counting(self, index):
        out = original(self, index)
        counted.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(LazyTensor, "_read", counting)
    return counted


def file_tensors(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def loaded_names(model_dir, tensors: dict[str, torch.Tensor]) -> list[str]:
    # A tied head is skipped by name (the embedding serves it), so it is never read.
    tied = load_hf_config(model_dir).tie_word_embeddings
    return [name for name in tensors if not (tied and name == "lm_head.weight")]


def is_replicated(name: str) -> bool:
    # Norm weights and row-parallel biases live whole on every rank; everything else is split across ranks.
    return name.endswith("norm.weight") or name.endswith(("o_proj.bias", "down_proj.bias"))


def full_read_model(model_dir, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaForCausalLM:
    """The reference: every full tensor handed to the weight loaders, which slice it afterwards."""
    model = LlamaForCausalLM(load_hf_config(model_dir), tp, dtype)
    model.load_weights((name, lazy.full()) for name, lazy in iter_lazy_safetensors(model_dir))
    return model


def assert_same_parameters(model, reference) -> None:
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == expected[name].dtype, name
        assert torch.equal(param, expected[name]), name


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_each_rank_holds_the_slices_of_the_full_tensors(checkpoints, kind):
    model_dir = checkpoints[kind]
    full = file_tensors(model_dir)
    hidden = full["model.norm.weight"].shape[0]
    for rank in range(TP):
        tp = TensorParallelGroup(rank=rank, size=TP)
        model = load_model(model_dir, tp=tp)
        assert_same_parameters(model, full_read_model(model_dir, tp, torch.float32))
        params = dict(model.named_parameters())
        # Spot checks against the file itself: vocab rows, row-parallel columns, q rows, replicated norms.
        rows = params["model.embed_tokens.weight"].shape[0]
        assert torch.equal(params["model.embed_tokens.weight"], full["model.embed_tokens.weight"][rank * rows :][:rows])
        o_proj = params["model.layers.1.self_attn.o_proj.weight"]
        cols = o_proj.shape[1]
        assert cols == hidden // TP
        assert torch.equal(o_proj, full["model.layers.1.self_attn.o_proj.weight"][:, rank * cols : (rank + 1) * cols])
        q_rows = hidden // TP
        q_file = full["model.layers.0.self_attn.q_proj.weight"][rank * q_rows : (rank + 1) * q_rows]
        assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"][:q_rows], q_file)
        norm = "model.layers.0.input_layernorm.weight"
        assert torch.equal(params[norm], full[norm])
        if kind == "llama_tied":
            assert model.lm_head.weight is model.model.embed_tokens.weight
            gate = params["model.layers.0.mlp.gate_up_proj.bias"][: 128 // TP]
            assert torch.equal(gate, full["model.layers.0.mlp.gate_proj.bias"][rank * 64 : (rank + 1) * 64])


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_each_rank_reads_about_its_share_of_the_bytes(checkpoints, kind, reads):
    model_dir = checkpoints[kind]
    full = file_tensors(model_dir)
    names = loaded_names(model_dir, full)
    sharded = sum(full[name].nbytes for name in names if not is_replicated(name))
    replicated = sum(full[name].nbytes for name in names if is_replicated(name))
    bound = sharded // TP + replicated
    # The old path read every full tensor on every rank; the bound must be one that path breaks.
    assert sharded + replicated > bound * 1.5
    for rank in range(TP):
        reads.clear()
        load_model(model_dir, tp=TensorParallelGroup(rank=rank, size=TP))
        assert sum(reads) <= bound, f"rank {rank} read {sum(reads)} bytes, at most {bound} expected"
        # Every tensor but the tied head is read (in one or more slices): nothing is silently left out.
        assert sum(reads) >= bound * 0.95


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_single_rank_reads_each_tensor_once(checkpoints, kind, reads):
    model_dir = checkpoints[kind]
    full = file_tensors(model_dir)
    names = loaded_names(model_dir, full)
    model = load_model(model_dir, tp=SINGLE_RANK)
    assert len(reads) == len(names)
    assert sum(reads) == sum(full[name].nbytes for name in names)
    assert_same_parameters(model, full_read_model(model_dir, SINGLE_RANK, torch.float32))


def test_checkpoint_dtype_is_cast_after_reading_the_slice(checkpoints, tmp_path, reads):
    # Rewrite the checkpoint in bfloat16 and load it into a float32 model: reads are half the float32 bytes.
    source = checkpoints["llama_tied"]
    half = {name: tensor.to(torch.bfloat16) for name, tensor in file_tensors(source).items()}
    for path in source.iterdir():
        if path.suffix == ".json":
            (tmp_path / path.name).write_text(path.read_text())
    save_file(half, str(tmp_path / "model.safetensors"))
    names = loaded_names(tmp_path, half)
    bound = sum(half[n].nbytes for n in names if not is_replicated(n)) // TP
    bound += sum(half[n].nbytes for n in names if is_replicated(n))
    for rank in range(TP):
        tp = TensorParallelGroup(rank=rank, size=TP)
        reads.clear()
        model = load_model(tmp_path, tp=tp, dtype=torch.float32)
        assert sum(reads) <= bound
        assert_same_parameters(model, full_read_model(tmp_path, tp, torch.float32))
        model16 = load_model(source, tp=tp, dtype=torch.bfloat16)
        assert_same_parameters(model16, full_read_model(source, tp, torch.bfloat16))


def test_lazy_tensor_views_read_only_their_window(reads):
    base = torch.arange(60.0).reshape(6, 10)
    lazy = LazyTensor(base, base.shape, base.dtype)
    top, bottom = lazy.split([2, 4], dim=0)
    assert reads == []  # splitting reads nothing
    assert torch.equal(bottom.narrow(1, 3, 5), base[2:, 3:8])
    assert reads == [4 * 5 * 4]
    assert torch.equal(top.full(), base[:2])
    target = torch.zeros(2, 10, dtype=torch.float64)
    target.copy_(top)  # a plain torch op reads the whole window
    assert torch.equal(target, base[:2].double())
    with pytest.raises(ValueError, match="exceeds size 4 of dimension 0"):
        bottom.window(0, 3, 2)
    with pytest.raises(ValueError, match="add up to 5, expected 6"):
        lazy.split([2, 3])
