"""Adapters checked before any request uses them: each new `LoRARequest` is read against
the model's layers (built on the meta device, no weights) exactly as a worker will read
it, so that a bad adapter is a ValueError for the request or the load that names it, not
a worker failure mid-step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from serve.config import EngineConfig
from serve.lora_request import LoRARequest


class AdapterChecker:
    def __init__(self, config: EngineConfig, hf_config: Callable[[], Any]) -> None:
        self.config = config
        self._hf_config = hf_config
        self._skeleton: Any = None
        self._known: dict[int, LoRARequest] = {}  # adapters checked, by id
        self._lock = threading.Lock()  # the API checks from worker threads

    def check(self, lora: LoRARequest | None) -> None:
        """ValueError unless `lora` is None or loads onto this model: LoRA enabled, an id
        not taken by another adapter, a PEFT folder whose modules and ranks fit."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}.")
        settings = self.config.lora
        if not settings.enable_lora:
            raise ValueError(
                "This engine serves no LoRA adapters: start it with --enable-lora "
                "(LLM(..., enable_lora=True)) to use lora_request."
            )
        with self._lock:
            known = self._known.get(lora.lora_int_id)
            if known == lora:
                return
            if known is not None:
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} "
                    f"({known.lora_path}); give each adapter an id of its own."
                )
            from serve.models.lora import read_adapter  # torch, only once LoRA is used

            read_adapter(lora, self._model(), settings.max_lora_rank)
            self._known[lora.lora_int_id] = lora

    def _model(self) -> Any:
        if self._skeleton is None:
            from serve.models.loader import model_skeleton

            self._skeleton = model_skeleton(self.config.model, self._hf_config())
        return self._skeleton
