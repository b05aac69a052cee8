"""The LoRA adapters a frontend serves by name (vLLM's --lora-modules, load_lora_adapter, unload_lora_adapter): a
request picks one with its `model`, and /v1/models lists them with the base model as their parent.

Each loaded adapter gets an id never used before, even when a name is loaded again with another path, so no rank
ever mistakes a new adapter for the one it cached under the same name; requests already running with an unloaded
adapter keep their own reference and finish with it.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass

from pagerail.common.lora import LoRARequest, read_adapter_config


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry: `name=path`, or the JSON form {"name", "path", "base_model_name"}."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """ValueError naming the flag for a malformed entry."""
        text = text.strip()
        if text.startswith("{"):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"--lora-modules: {text!r} is not JSON: {error}") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry.get("path"):
                raise ValueError(f"--lora-modules: {text!r} needs string fields name and path")
            return cls(entry["name"], str(entry["path"]), entry.get("base_model_name"))
        name, separator, path = text.partition("=")
        if not separator or not name or not path:
            raise ValueError(f"--lora-modules: {text!r} is neither name=path nor a JSON object")
        return cls(name, path)


class LoRAModules:
    """Adapters by name. `max_rank` is the engine's --max-lora-rank, checked when an adapter is loaded."""

    def __init__(self, served: str, max_rank: int, modules: tuple[LoRAModule, ...] = ()) -> None:
        self.served = served
        self.max_rank = max_rank
        self._ids = itertools.count(1)
        self._adapters: dict[str, tuple[LoRARequest, float]] = {}
        for module in modules:
            self.load(module.name, module.path, module.base_model_name)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def get(self, name: str) -> LoRARequest | None:
        entry = self._adapters.get(name)
        return entry[0] if entry is not None else None

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the PEFT adapter at `path` as `name`; ValueError whose message starts with the field's name (as
        "lora_path: ...") when it cannot be."""
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name: must be a non-empty string")
        if name == self.served:
            raise ValueError(f"lora_name: {name!r} is the base model's name")
        if name in self._adapters:
            raise ValueError(f"lora_name: {name!r} is already loaded; unload it first")
        if base_model_name is not None and base_model_name != self.served:
            raise ValueError(f"base_model_name: {base_model_name!r} is not the served model {self.served!r}")
        if not isinstance(path, str) or not path:
            raise ValueError("lora_path: must be the directory of a PEFT adapter")
        try:
            read_adapter_config(path, self.max_rank)
        except ValueError as error:
            raise ValueError(f"lora_path: {error}") from None
        request = LoRARequest(name, next(self._ids), path, base_model_name)
        self._adapters[name] = (request, time.time())
        return request

    def unload(self, name: str) -> LoRARequest:
        """Stop serving `name` (KeyError when it is not loaded); its running requests finish."""
        return self._adapters.pop(name)[0]

    def cards(self, owned_by: str) -> list[dict]:
        """/v1/models entries: each adapter with the base model as its parent."""
        return [
            {
                "id": request.lora_name,
                "object": "model",
                "created": int(loaded),
                "owned_by": owned_by,
                "root": request.lora_path,
                "parent": self.served,
            }
            for request, loaded in self._adapters.values()
        ]
