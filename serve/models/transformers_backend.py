"""The transformers backend: causal LMs serve has no class of its own for, run by
transformers' modeling code with serve's paged attention as their attention function.

transformers' attention modules call attention through `ALL_ATTENTION_FUNCTIONS`, by the
name in `config._attn_implementation`; a class whose modules all do says so with
`_supports_attention_backend`. We register `serve_paged` there. Each HF attention module
gets one serve `Attention` (as its child `serve_attention`), which the model runner finds
and binds a KV cache to as for any model; the function hands it the module's q, k, v, so
it writes them into the paged cache and attends with `kernels.paged_attention` over the
forward context's sequences. The HF model runs the flat token stream of the whole batch as
one [1, T] sequence with serve's positions and no HF cache, and builds no masks
(transformers makes none for an attention function without a mask function).

What each layer's attention asks for is read from the model, not from config fields that
every family spells its own way: once, at build, a forward pass over a few tokens runs with
a recording function (`serve_probe`). It records each module's heads, head size, scale
(`scaling`) and soft-cap (`softcap`); its mask function reads each layer's sliding window
from transformers' own mask function, which is what transformers' sdpa and eager attention
apply. Attention sinks (`s_aux` or `sinks`, one learned logit per head: GPT-OSS) are the
module's own parameter, passed to paged attention with every call. What paged attention
cannot do is refused there, by name: other attention inputs (per-token sinks among them),
non-causal or chunked attention, layers without attention (recurrent or convolutional
state), different KV shapes per layer.

Logits are the HF causal LM's own forward with its body swapped for a stand-in that hands
back the hidden states: its LM head and whatever follows it (Gemma's final soft-cap,
Cohere's logit scale, Granite's divisor) run as they do in transformers.

Parameters keep the HF names (the causal LM's top modules are this module's own), so a
checkpoint loads by name. Checkpoints that transformers converts as it loads them (fused
MoE experts, renamed tensors) are refused. One rank only: check_tensor_parallel refuses
more. Only classes shipped in transformers run: never a checkpoint's remote code.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from serve.models.arch_config import ArchConfig
from serve.models.layers.attention import Attention
from serve.models.weights import WeightSpec

PAGED = "serve_paged"  # the attention function the model runs with
PROBE = "serve_probe"  # the recording one, for the build-time forward pass

# Attention-function arguments the probe reads (the window comes from the mask function,
# which is what transformers' sdpa and eager attention apply), that paged attention takes
# at every call (the sinks), or that change nothing at inference (dropout is 0 in eval; the
# rest is bookkeeping). Any other, set, is refused.
_SINK_ARGUMENTS = ("s_aux", "sinks")  # [num_heads] sink logits, by the names models use
_KNOWN_ARGUMENTS = {
    *_SINK_ARGUMENTS,
    "scaling",
    "softcap",
    "is_causal",
    "sliding_window",
    "dropout",
    "position_ids",
    "use_cache",
    "output_attentions",
}
_PROBE_TOKENS = 4


def unsupported_reason(architecture: str) -> str | None:
    """None when the transformers backend can run `architecture`, else why not. Checks
    what the class declares; the build-time probe checks what its layers do."""
    try:
        hf_class = getattr(transformers, architecture, None)  # shipped classes only
    except (ImportError, RuntimeError) as e:  # a class whose optional dependency is missing
        return f"{architecture} could not be imported from transformers ({e})"
    if not (isinstance(hf_class, type) and issubclass(hf_class, PreTrainedModel)):
        return f"{architecture} is not a model class transformers ships"
    if architecture not in _causal_lm_classes():
        return f"{architecture} is not a causal language model"
    if not hf_class._supports_attention_backend:
        return f"{architecture} does not take custom attention functions"
    model_type = hf_class.config_class.model_type
    if get_checkpoint_conversion_mapping(architecture) or get_checkpoint_conversion_mapping(
        model_type
    ):
        return (
            f"{architecture} checkpoints are converted by transformers as they load "
            "(renamed or fused tensors), which the transformers backend does not do"
        )
    return None


def _causal_lm_classes() -> set[str]:
    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM on serve's paged attention, by the registry's contract."""

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        arch = ArchConfig.from_hf(hf.get_text_config(), architecture, model_impl="transformers")
        return dataclasses.replace(arch, hf=hf)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        _register_attention_functions()
        hf_class = getattr(transformers, config.architecture)
        # _from_config writes the dtype and the attention function into the config it gets.
        causal_lm = hf_class._from_config(
            copy.deepcopy(config.hf), attn_implementation=PROBE, dtype=torch.get_default_dtype()
        ).eval()
        refusal = f"{config.architecture} cannot run through the transformers backend"
        try:
            self._body_name = _body_name(causal_lm)
            layers, hidden = _probe(causal_lm, self._body_name, config.num_layers)
        except ValueError as e:
            raise ValueError(f"{refusal}: {e}.") from None
        for layer in layers:
            layer.module.serve_attention = layer.attention()
        causal_lm.set_attn_implementation(PAGED)
        if causal_lm.config._attn_implementation != PAGED:
            raise ValueError(f"{refusal}: it would not take serve's attention function.")
        # The causal LM's modules become ours, under the names its checkpoints use ...
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        for name, param in causal_lm.named_parameters(recurse=False):
            self.register_parameter(name, param)
        # ... and what is left of it computes logits from hidden states: its head, unregistered.
        setattr(causal_lm, self._body_name, _HiddenStates())
        self.__dict__["_head"] = causal_lm
        self.weight_spec = WeightSpec(ignored=_ignored_checkpoint_names(causal_lm, self))
        with torch.no_grad():
            logits = self.compute_logits(hidden[0])  # the head alone, as serve runs it
        if logits.shape != (_PROBE_TOKENS, config.vocab_size):
            raise ValueError(
                f"{refusal}: its head gave logits of shape {tuple(logits.shape)} for "
                f"{_PROBE_TOKENS} tokens and a vocabulary of {config.vocab_size}."
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        body = getattr(self, self._body_name)
        out = body(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab], through the HF causal LM's own head."""
        return self._head(inputs_embeds=hidden[None], use_cache=False).logits[0]


def _ignored_checkpoint_names(causal_lm: PreTrainedModel, model: nn.Module) -> tuple[str, ...]:
    """What transformers skips in its checkpoints, and persistent buffers: they hold what
    the config makes them (XIELU's constants, BERT's position ids), as the constructor did."""
    buffers = model.state_dict(keep_vars=True).keys() - dict(model.named_parameters()).keys()
    return (
        *WeightSpec().ignored,
        *(causal_lm._keys_to_ignore_on_load_unexpected or ()),
        *(f"^{re.escape(name)}$" for name in sorted(buffers)),
    )


class _HiddenStates(nn.Module):
    """The body's stand-in inside the HF causal LM: hands back the hidden states it is
    given as `inputs_embeds`, so the causal LM's forward runs only its head on them. The MoE
    output's fields are the plain one's and `router_logits` (None), which an MoE causal LM
    (GPT-OSS) reads from its body's output."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any) -> Any:
        return MoeModelOutputWithPast(last_hidden_state=inputs_embeds)


def _body_name(causal_lm: PreTrainedModel) -> str:
    """The attribute holding the causal LM's body (its base model)."""
    if isinstance(getattr(causal_lm, causal_lm.base_model_prefix, None), PreTrainedModel):
        return causal_lm.base_model_prefix
    bodies = [n for n, m in causal_lm.named_children() if isinstance(m, PreTrainedModel)]
    if len(bodies) != 1:
        raise ValueError(f"{type(causal_lm).__name__}: cannot tell its base model from its head.")
    return bodies[0]


def _paged_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: Any,  # None: transformers builds no mask for this function
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # [1, T, num_heads, head_dim], no weights
    attention: Attention = module.serve_attention
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, heads, D]
    out = attention(q, k, v, sinks=_sinks(kwargs))  # [T, num_heads * head_dim]
    return out.view(1, -1, attention.num_heads, attention.head_dim), None


def _sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The attention sinks a module passed its attention function ([num_heads]), if any."""
    for name in _SINK_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


# -- the build-time probe ---------------------------------------------------------------------


@dataclass(frozen=True)
class _LayerAttention:
    """What one HF attention module asked of the attention function."""

    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    logit_softcap: float | None

    def attention(self) -> Attention:
        return Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )


@dataclass
class _Recording:
    layers: list[_LayerAttention] = field(default_factory=list)
    masks: list[tuple[torch.Tensor, int | None]] = field(default_factory=list)  # (mask, window)


_recording: _Recording | None = None


@contextmanager
def _recording_attention() -> Iterator[_Recording]:
    global _recording
    if _recording is not None:
        raise RuntimeError("transformers backend: probes do not nest.")
    _recording = _Recording()
    try:
        yield _recording
    finally:
        _recording = None


def _probe(
    causal_lm: PreTrainedModel, body_name: str, num_layers: int
) -> tuple[list[_LayerAttention], torch.Tensor]:
    """Run the body once over a few tokens with the recording attention function and check
    what its layers asked for. Returns them, and the hidden states [1, T, hidden]."""
    device = next(causal_lm.parameters()).device
    input_ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device=device)
    positions = torch.arange(_PROBE_TOKENS, device=device)[None]
    with torch.no_grad(), _recording_attention() as recording:
        body = getattr(causal_lm, body_name)
        hidden = body(input_ids=input_ids, position_ids=positions, use_cache=False)[0]
    layers = recording.layers
    if len(layers) != num_layers or len({id(layer.module) for layer in layers}) != num_layers:
        raise ValueError(
            f"its {num_layers} layers made {len(layers)} attention calls: layers without "
            "attention (recurrent or convolutional state) or with several are not supported"
        )
    if len({(layer.num_kv_heads, layer.head_dim) for layer in layers}) > 1:
        raise ValueError(
            "its layers differ in KV heads or head size, which one KV cache cannot hold"
        )
    if hidden.shape[:2] != (1, _PROBE_TOKENS):
        raise ValueError(f"its base model returned {tuple(hidden.shape)}, not hidden states")
    return layers, hidden


def _probe_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if _recording is None:
        raise RuntimeError("serve_probe runs only inside the transformers backend's probe.")
    others = sorted(k for k, v in kwargs.items() if v is not None and k not in _KNOWN_ARGUMENTS)
    if others:
        raise ValueError(
            f"its attention takes attention inputs ({', '.join(others)}) paged attention lacks"
        )
    sinks = _sinks(kwargs)
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(
            f"its attention sinks have shape {tuple(sinks.shape)}, not one logit per query "
            f"head ({query.shape[1]},) as paged attention takes them"
        )
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError("its attention is not causal")
    if key.shape[2] != query.shape[2]:
        raise ValueError("its attention keeps a cache of its own")
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim:
        raise ValueError("its queries, keys and values differ in head size")
    scaling, softcap = kwargs.get("scaling"), kwargs.get("softcap")
    _recording.layers.append(
        _LayerAttention(
            module,
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=head_dim,
            scale=float(head_dim**-0.5 if scaling is None else scaling),
            sliding_window=_recorded_window(_recording, attention_mask),
            logit_softcap=float(softcap) if softcap else None,
        )
    )
    num_tokens, num_heads = query.shape[2], query.shape[1]
    return query.new_zeros(1, num_tokens, num_heads, head_dim), None


def _recorded_window(recording: _Recording, attention_mask: Any) -> int | None:
    """The window of a mask our mask function made (None: a model that makes no mask)."""
    if attention_mask is None:
        return None
    for mask, window in recording.masks:
        if mask is attention_mask:
            return window
    raise ValueError("its attention gets a mask of its own making")


def _probe_mask(
    *, batch_size: int, q_length: int, kv_length: int, mask_function: Callable, **kwargs: Any
) -> torch.Tensor:
    """transformers' mask-interface contract; returns a stand-in mask whose window the
    attention calls that receive it look up."""
    if _recording is None:
        raise RuntimeError("serve_probe runs only inside the transformers backend's probe.")
    mask = torch.ones(
        batch_size, 1, q_length, kv_length, dtype=torch.bool, device=kwargs.get("device")
    )
    _recording.masks.append((mask, _window(mask_function)))
    return mask


_FAR = 1 << 40  # a query position past any context, where every window is whole


def _window(mask_function: Callable) -> int | None:
    """The sliding window of a transformers mask function, `(batch, head, q, kv) -> bool`:
    query q sees keys q - w < kv <= q (None: every kv <= q). ValueError for any other
    pattern: bidirectional, or chunked (seen as a window that differs between queries)."""
    zero = torch.tensor(0)

    def sees(q: int, kv: int) -> bool:
        return bool(mask_function(zero, zero, torch.tensor(q), torch.tensor(kv)))

    windows = set()
    for q in (_FAR, _FAR + 12345):
        if not sees(q, q) or sees(q, q + 1):
            raise ValueError("its attention is not causal")
        if sees(q, 0):
            windows.add(None)
            continue
        unseen, seen = 0, q  # binary search for the first key q sees
        while seen - unseen > 1:
            middle = (unseen + seen) // 2
            if sees(q, middle):
                seen = middle
            else:
                unseen = middle
        windows.add(q - seen + 1)
    if len(windows) != 1:
        raise ValueError("its attention is neither causal nor a sliding window (chunked?)")
    return windows.pop()


def _register_attention_functions() -> None:
    """Idempotent. `serve_paged` has no mask function, so transformers builds no masks."""
    AttentionInterface.register(PAGED, _paged_attention)
    AttentionInterface.register(PROBE, _probe_attention)
    AttentionMaskInterface.register(PROBE, _probe_mask)
