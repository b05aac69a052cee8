"""The LoRA adapters requests name, checked once each where the head admits them: a bad adapter is refused with
its request (naming the setting), before any rank tries to load it."""

from __future__ import annotations

from collections.abc import Mapping

from pagerail.common.engine_config import LoRAConfig
from pagerail.common.lora import LoRARequest, read_adapter, read_adapter_config


class LoRAAdapters:
    """Which adapter each id names; `shapes` (projection_shapes) and `num_layers` check its weights' shapes."""

    def __init__(
        self, config: LoRAConfig, shapes: Mapping[str, tuple[int, int]] | None = None, num_layers: int = 0
    ) -> None:
        self.config = config
        self.shapes = shapes
        self.num_layers = num_layers
        self._paths: dict[int, str] = {}

    def check(self, lora: LoRARequest) -> None:
        """ValueError naming the field when `lora` cannot run here."""
        if not self.config.enable_lora:
            raise ValueError(f"lora_request {lora.lora_name!r}: this server was started without --enable-lora")
        known = self._paths.get(lora.lora_int_id)
        if known == lora.lora_path:
            return
        if known is not None:
            raise ValueError(
                f"lora_int_id {lora.lora_int_id} already names the adapter at {known!r}, not {lora.lora_path!r}"
            )
        max_rank = self.config.max_lora_rank
        if self.shapes is not None:
            read_adapter(lora.lora_path, max_rank, self.shapes, self.num_layers)
        else:
            read_adapter_config(lora.lora_path, max_rank)
        self._paths[lora.lora_int_id] = lora.lora_path
