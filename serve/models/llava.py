"""LLaVA: a vision tower (CLIP or SigLIP), a two-layer projector, and any language model
serve runs natively (Llama, Mistral, Qwen2, Gemma, ...), as transformers'
`LlavaForConditionalGeneration` composes them.

An image becomes `tokens_per_image` embeddings: the tower's hidden states at
`vision_feature_layer` (CLIP's class token dropped under the "default" strategy),
projected to the language model's width. The prompt holds a run of placeholder tokens of
that length per image (`engine/multimodal.py` widens them); in a forward, the rows of
those tokens take the image's embeddings in place of the placeholder's own
(`forward(..., image_embeddings=(rows, values))`), right where the language model embeds
its tokens, so everything after (Gemma's scaling, the layers) is what transformers runs.

The tower and projector are replicated on every tensor-parallel rank; the language model
is split as it is alone. The tower is transformers' own module (its weights loaded here):
it runs once per image, not per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from serve.models.arch_config import ArchConfig, hf_with
from serve.models.layers.activation import get_activation
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.linear import default_weight_loader
from serve.models.lazy_tensor import LazyTensor, as_lazy
from serve.models.weights import WeightSpec, load_checkpoint

# Checkpoint prefixes as transformers (5.x: `model.language_model.`) and the hub's llava-hf
# checkpoints (`language_model.model.`) write them -> ours.
_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def _text_architecture(text_config: Any) -> str:
    names = getattr(text_config, "architectures", None)
    if names:
        return names[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(text_config, "model_type", "")
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if architecture is None:
        raise ValueError(f"LLaVA's language model ({model_type!r}) is not a causal LM.")
    return architecture


def _text_model(hf: Any) -> tuple[type[nn.Module], ArchConfig]:
    """The language model's class and shape, as serve would run it alone."""
    from serve.models.registry import get_arch_config, get_model_class

    architecture = _text_architecture(hf.text_config)
    text_hf = hf_with(hf.text_config, architectures=[architecture])
    try:
        model_class = get_model_class([architecture], "native")
    except ValueError:
        raise ValueError(
            f"LLaVA's language model {architecture} has no native serve class; serve runs "
            "LLaVA on the natively supported families."
        ) from None
    return model_class, get_arch_config(text_hf, "native")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.act = get_activation(act)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        """The language model's shape (what the engine sizes the KV cache and the context
        by), named for LLaVA, with LLaVA's whole config."""
        _, text = _text_model(hf)
        return dataclasses.replace(text, architecture=architecture, hf=hf)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        from transformers import AutoModel

        hf = config.hf
        text_class, text_arch = _text_model(hf)
        self.language_model = text_class(text_arch)
        self.text_spec: WeightSpec = self.language_model.weight_spec
        self.weight_spec = self.text_spec  # what LoRA reads (refused for LLaVA today)
        self.vision_tower = AutoModel.from_config(hf.vision_config, attn_implementation="sdpa")
        self.multi_modal_projector = LlavaMultiModalProjector(
            hf.vision_config.hidden_size,
            text_arch.hidden_size,
            hf.projector_hidden_act,
            bool(getattr(hf, "multimodal_projector_bias", True)),
        )
        self.feature_layer = int(hf.vision_feature_layer)
        self.drop_first = hf.vision_feature_select_strategy == "default"
        # The rows a forward's image embeddings replace, set around the language model's call.
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        embedding = next(
            m
            for m in self.language_model.modules()
            if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
        )
        embedding.register_forward_hook(self._replace_image_rows)

    def _replace_image_rows(self, module: nn.Module, args: Any, output: torch.Tensor) -> Any:
        if self._pending is None:
            return None
        rows, values = self._pending
        return output.index_copy(0, rows, values.to(output.dtype))

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, channels, height, width] -> [n, tokens_per_image, hidden]."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True)
        features = out.hidden_states[self.feature_layer]
        if self.drop_first:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        image_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`image_embeddings`: (rows of the token stream, [len(rows), hidden]) that replace
        those rows' token embeddings."""
        self._pending = image_embeddings
        try:
            return self.language_model(input_ids, positions)
        finally:
            self._pending = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor | torch.Tensor]]) -> None:
        """The language model's tensors by its own spec (split per rank); the tower's and
        the projector's whole."""
        own = dict(self.vision_tower.named_parameters(prefix="vision_tower"))
        own.update(self.multi_modal_projector.named_parameters(prefix="multi_modal_projector"))
        loaded: set[str] = set()

        def text_weights() -> Iterable[tuple[str, LazyTensor | torch.Tensor]]:
            for name, tensor in weights:
                for old, new in _PREFIXES:
                    if name.startswith(old):
                        name = new + name[len(old) :]
                        break
                if name.startswith("language_model."):
                    yield name[len("language_model.") :], tensor
                    continue
                if name.startswith("vision_tower.vision_model."):  # the hub's layout
                    name = "vision_tower." + name[len("vision_tower.vision_model.") :]
                if name not in own:
                    if name.startswith("vision_tower.") and not name.endswith(
                        (".weight", ".bias", "_embedding")
                    ):
                        continue  # a buffer (position ids)
                    raise ValueError(f"checkpoint tensor {name!r} has no place in LLaVA")
                default_weight_loader(own[name], as_lazy(tensor))
                loaded.add(name)

        load_checkpoint(self.language_model, text_weights(), self.text_spec)
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}")
