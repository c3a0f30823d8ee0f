"""Baichuan and Baichuan 2: Llama blocks with q, k, v fused in one `W_pack` tensor, in
checkpoints whose transformers code is their own (`model_type` baichuan). The config is read
as data (loader.load_hf_config).

| architecture           | checkpoints                  | positions | LM head  |
|------------------------|------------------------------|-----------|----------|
| `BaiChuanForCausalLM`  | Baichuan 7B                  | rotary    | plain    |
| `BaichuanForCausalLM`  | Baichuan 13B                 | ALiBi     | plain    |
| `BaichuanForCausalLM`  | Baichuan 2 7B                | rotary    | NormHead |
| `BaichuanForCausalLM`  | Baichuan 2 13B               | ALiBi     | NormHead |

The two `BaichuanForCausalLM` splits are read from the config, as each model's own config
class writes it:
- rotary iff the config has `max_position_embeddings`: Baichuan 2 7B's config class has
  it (beside `model_max_length`); the 13B config classes, whose code uses ALiBi, have only
  `model_max_length`. (vLLM tells them apart by `hidden_size == 4096`, which fits only the
  released sizes.)
- Baichuan 2 iff the config has `z_loss_weight` (a field of Baichuan 2's config classes
  only) or the Baichuan 2 vocabulary, 125,696 tokens (vLLM's rule).

Rotary: GPT-NeoX style over the whole head, base 10,000 (fixed in Baichuan's code).
ALiBi: BLOOM's slopes; no context limit (Baichuan's code grows its bias table as needed).
NormHead (Baichuan 2): logits are computed with each vocabulary row of the head divided by
its L2 norm, which the remote code does once, on its first forward; here it is done once
as the rows load.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from serve.models.arch_config import UNLIMITED_POSITIONS, ArchConfig, hf_with
from serve.models.llama import LLAMA_PACKED, LlamaForCausalLM
from serve.models.weights import FusedRows, WeightSpec

BAICHUAN2_VOCAB_SIZE = 125696


def _llama_names(hf: Any, **fields: Any) -> Any:
    """The config with the names Llama's layers read, as Baichuan's code defaults them."""
    return hf_with(
        hf,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
        **fields,
    )


def uses_alibi(hf: Any) -> bool:
    return getattr(hf, "max_position_embeddings", None) is None


def is_baichuan2(hf: Any) -> bool:
    return hasattr(hf, "z_loss_weight") or int(hf.vocab_size) == BAICHUAN2_VOCAB_SIZE


class BaiChuanForCausalLM(LlamaForCausalLM):
    """Baichuan 7B, and the W_pack layout both classes share."""

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        return ArchConfig.from_hf(_llama_names(hf), architecture)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config)
        # W_pack: [q; k; v] rows, num_heads * head_dim each (Baichuan has no GQA).
        rows = config.num_heads * config.head_dim
        w_pack = FusedRows((("q", rows), ("k", rows), ("v", rows)))
        self.weight_spec = WeightSpec(
            packed=LLAMA_PACKED,
            fused={"qkv_proj": w_pack},
            renames=((".self_attn.W_pack.", ".self_attn.qkv_proj."),),
        )


class BaichuanForCausalLM(BaiChuanForCausalLM):
    """Baichuan 13B, Baichuan 2 7B and 13B (the table above)."""

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        if not uses_alibi(hf):
            return super().arch_config(hf, architecture)
        return ArchConfig.from_hf(
            _llama_names(hf, alibi=True), architecture, max_position=UNLIMITED_POSITIONS
        )

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config)
        if is_baichuan2(config.hf):
            load_rows = self.lm_head.weight.weight_loader

            def load_normalised_rows(param, loaded, shard_name=None) -> None:
                load_rows(param, loaded, shard_name)  # this rank's vocabulary rows
                param.data.copy_(F.normalize(param.data.float(), dim=-1).to(param.dtype))

            self.lm_head.weight.weight_loader = load_normalised_rows
