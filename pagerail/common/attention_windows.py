"""Which decoder layers attend over a sliding window, read from a Hugging Face config (object or dict)."""

from __future__ import annotations

from typing import Any


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Per decoder layer, the number of keys a query sees (itself included), or None for full attention.

    `layer_types` names each layer's kind where the config has it (Gemma 2/3, gpt-oss, Qwen2/3); otherwise a
    `sliding_window` covers every layer (Mistral, Mixtral, Phi-3) unless `use_sliding_window` is false (Qwen).
    """
    num_layers = int(_field(config, "num_hidden_layers"))
    window = _field(config, "sliding_window")
    window = int(window) if window else None
    layer_types = _field(config, "layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
        if window is None:
            return [None] * num_layers
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if window is None or _field(config, "use_sliding_window") is False:
        return [None] * num_layers
    return [window] * num_layers


def uniform_sliding_window(config: Any) -> int | None:
    """The window when every layer slides by the same one, else None: only then can a sequence's blocks that
    left the window be freed, since one block table serves every layer."""
    windows = set(layer_sliding_windows(config))
    if len(windows) == 1:
        return windows.pop()
    return None
