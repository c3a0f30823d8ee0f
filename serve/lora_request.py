"""A request's LoRA adapter: plain data from the front end to the workers.

vLLM's shape, so that vLLM scripts run unchanged: `LoRARequest(name, int_id, path)`. The
int id names the adapter inside the engine (the workers' slots, the prefix cache's keys);
two adapters with different weights must never share one.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """An adapter in PEFT's format (a folder with adapter_config.json and
    adapter_model.safetensors) to apply to a request's forward passes."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}.")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}.")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path.")

    @property
    def cache_key(self) -> str:
        """What the prefix cache keys this adapter's K/V by (a block computed under it
        matches only blocks computed under it)."""
        return f"lora:{self.lora_int_id}"
