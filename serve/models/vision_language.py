"""What a vision-language model shares, whatever its tower: a native language model built
from the config's `text_config`, image embeddings written over the placeholder tokens'
own where that model embeds its tokens, and a checkpoint read in parts (the language
model's tensors by its own `WeightSpec`, split per rank; the tower's and projector's
whole, on every rank).

A family (llava.py, qwen2_vl.py) builds its tower in `__init__`, names its checkpoint
prefixes, and writes `embed_images`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from serve.models.arch_config import ArchConfig, hf_with
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.linear import default_weight_loader
from serve.models.lazy_tensor import LazyTensor, as_lazy
from serve.models.quantization import QuantFormat, quantize_layers
from serve.models.weights import WeightSpec, load_checkpoint


def causal_lm_architecture(text_config: Any) -> str:
    """The causal LM class transformers would run `text_config` with."""
    names = getattr(text_config, "architectures", None)
    if names:
        return names[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(text_config, "model_type", "")
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if architecture is None:
        raise ValueError(f"The language model ({model_type!r}) is not a causal LM.")
    return architecture


def text_model(hf: Any, architecture: str) -> tuple[type[nn.Module], ArchConfig]:
    """The language model's class and shape, as serve would run it alone: `hf`'s
    `text_config`, its LM head tied to the embedding as the whole model's config says
    (transformers ties a composite model's by the outer `tie_word_embeddings`)."""
    from serve.models.registry import get_arch_config, get_model_class

    tied = bool(getattr(hf, "tie_word_embeddings", False))
    text_hf = hf_with(hf.text_config, architectures=[architecture], tie_word_embeddings=tied)
    try:
        model_class = get_model_class([architecture], "native")
    except ValueError:
        raise ValueError(
            f"The language model {architecture} has no native serve class; serve runs "
            "vision-language models on the natively supported families."
        ) from None
    return model_class, get_arch_config(text_hf, "native")


# Checkpoint prefixes as transformers 5 writes a tower, a projector and a language model
# (`model.language_model.`, `model.vision_tower.`, ...) -> ours.
COMPOSITE_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


class VisionLanguageModel(nn.Module):
    """A language model (`self.language_model`) that takes image embeddings in place of
    its placeholder tokens'. Subclasses set `own_prefixes` (their tower's and projector's
    module names) and `renames` (checkpoint prefix -> ours), and build those modules."""

    own_prefixes: tuple[str, ...] = ("vision_tower.", "multi_modal_projector.")
    renames: tuple[tuple[str, str], ...] = COMPOSITE_RENAMES
    # Checkpoint tensors of modules the model dropped (tower layers past its feature layer).
    unused_prefixes: tuple[str, ...] = ()

    @classmethod
    def text_architecture(cls, hf: Any) -> str:
        """The language model's class name: the one transformers runs `text_config` with."""
        return causal_lm_architecture(hf.text_config)

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        """The language model's shape (what the engine sizes the KV cache and the context
        by), named for the whole model, with its whole config."""
        _, text = text_model(hf, cls.text_architecture(hf))
        return dataclasses.replace(text, architecture=architecture, hf=hf)

    def __init__(self, hf: Any) -> None:
        super().__init__()
        text_class, self.text_arch = text_model(hf, self.text_architecture(hf))
        self.language_model = text_class(self.text_arch)
        self.text_spec: WeightSpec = self.language_model.weight_spec
        self.weight_spec = self.text_spec  # what LoRA would read (refused for these models)
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

    def _renamed(self, name: str) -> str:
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def language_model_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in the language model, or None for the tower's."""
        name = self._renamed(name)
        return name[len("language_model.") :] if name.startswith("language_model.") else None

    def quantize_layers(self, fmt: QuantFormat, names: Iterable[str]) -> list[str]:
        """A quantized checkpoint's language model layers made packed, as alone; a tower
        or projector the checkpoint holds quantized is refused (serve runs them by
        transformers' modules, with float weights)."""
        text_names = []
        for name in names:
            text_name = self.language_model_name(name)
            if text_name is not None:
                text_names.append(text_name)
            elif name.rpartition(".")[2] == fmt.marker:
                raise ValueError(
                    f"the checkpoint holds {name.rpartition('.')[0]} quantized "
                    f"({fmt.describe()}); serve reads quantized language models, with the "
                    "vision tower and projector in float"
                )
        return quantize_layers(self.language_model, fmt, text_names, self.text_spec)

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor | torch.Tensor]]) -> None:
        """The language model's tensors (`language_model.` once renamed) by its spec; every
        other tensor whole into this model's own modules."""
        own = {
            name: param
            for name, param in self.named_parameters()
            if name.startswith(self.own_prefixes)
        }
        buffers = {name for name, _ in self.named_buffers()}
        loaded: set[str] = set()

        def text_weights() -> Iterable[tuple[str, LazyTensor | torch.Tensor]]:
            for name, tensor in weights:
                text_name = self.language_model_name(name)
                if text_name is not None:
                    yield text_name, tensor
                    continue
                name = self._renamed(name)
                if name in buffers or name.startswith(self.unused_prefixes):
                    continue  # one the module makes itself (CLIP's position ids), or unused
                if name not in own:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                    )
                default_weight_loader(own[name], as_lazy(tensor))
                loaded.add(name)

        load_checkpoint(self.language_model, text_weights(), self.text_spec)
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}")
