"""serve: an OpenAI-compatible LLM serving engine.

`from serve import LLM, SamplingParams, PoolingParams` — imported lazily, so `import serve` stays
cheap. `BeamSearchParams`, `BeamSearchOutput` and `BeamSearchSequence` are vLLM's beam search
call and result shapes.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "serve.engine.llm",
    "SamplingParams": "serve.sampling_params",
    "BeamSearchParams": "serve.sampling_params",
    "PoolingParams": "serve.pooling_params",
    "RequestOutput": "serve.outputs",
    "CompletionOutput": "serve.outputs",
    "Logprob": "serve.outputs",
    "RequestsFailedError": "serve.outputs",
    "BeamSearchOutput": "serve.outputs",
    "BeamSearchSequence": "serve.outputs",
    "LoRARequest": "serve.lora_request",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'serve' has no attribute {name!r}")
