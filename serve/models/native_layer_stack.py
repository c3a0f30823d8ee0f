"""Llama-, Gemma- and GPT-2-style decoder layers run as one native call on CPU.

A layer is ~10 ops from Python, each through a module, the kernel interface and the
dispatcher. At a step of one or two tokens (every linear a pass over its weights through
the few-row native kernel) those calls were 3-5 ms of the default model's 14-21 ms step;
at a decode step of 64 rows, ~7% of it. `serve_cpu::decoder_layers`
(kernels/cpu/csrc/decoder.cpp) runs the same kernels in the same order from C++ (the
linears on the packed weights from NATIVE_MAX_ROWS + 1 rows, as `serve.kernels.cpu.linear`
runs them), so a step's output is the Python loop's bit for bit.

It takes only what it computes exactly as the loop does: the dense Llama layer (Llama,
Qwen2, Mistral, SmolLM, Qwen3's q/k norms, Granite's residual multiplier, Phi-3 with plain
RoPE or LongRoPE, ...) and Gemma 2/3's (a norm on each block's output, GeGLU, Gemma 2's
soft-capped scores, Gemma 3's q/k norms and rope per layer type), with RMSNorm and a SiLU-
or GeLU-gated MLP; GPT-2's block (GPT-2, GPT-BigCode), OPT's pre-norm layer and GPT-NeoX's
(LayerNorm, a plain MLP with a GeLU or ReLU; no rotation, or NeoX's partial one; OPT's q
scaled before attention; NeoX's attention and MLP side by side or in turn); and StableLM
2's sequential layer (LayerNorm, partial rotation, a SiLU-gated MLP). No ALiBi, no
attention sinks, one rank, float32 or bfloat16, and the native kernels built. Everything
else runs the loop. `SERVE_CPU_LAYER_STACK=0` turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.kernels import cpu
from serve.kernels.backend import ops_for
from serve.kernels.cpu import NATIVE_MAX_ROWS, native
from serve.models.forward_context import get_forward_context
from serve.models.layers.activation import ActAndMul, Activation
from serve.models.layers.layernorm import LayerNorm, RMSNorm
from serve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from serve.models.layers.lora import current_lora_batch
from serve.models.layers.rotary import LongRopeRotaryEmbedding, RotaryEmbedding

ENV_VAR = "SERVE_CPU_LAYER_STACK"
_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class NativeLayerStack:
    """The layers' weights and options, gathered once; the KV caches are read at each call
    (the model runner binds them after the model is built, and unbinds them around its
    profiling forward)."""

    attentions: list[nn.Module]  # each layer's `Attention`, which holds its KV cache
    weights: list[torch.Tensor | None]
    linear_weights: list[torch.Tensor]  # qkv, o, up, down a layer: what gets packed
    qk_norm_weights: list[torch.Tensor]  # q norm, k norm a layer (Qwen3, Gemma 3), or none
    # The norms of attention's and the MLP's outputs a layer (Gemma's sandwich), or none.
    block_norm_weights: list[torch.Tensor]
    cos_sin_caches: list[torch.Tensor]  # empty: no rotation (GPT-2's learned positions)
    is_neox_style: bool
    scales: list[float]
    query_scales: list[float]  # q scaled by it after the projection where not 1.0 (OPT)
    sliding_windows: list[int]
    logit_softcaps: list[float]  # 0.0: none
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    residual_multiplier: float  # each block's output scaled by it (Granite; 1.0 elsewhere)
    activation: str  # the MLP's (its gate's, where gated): as the native call names them
    gated_mlp: bool  # act(gate) * up (Llama, Gemma), or act(x) (GPT-2)
    # Attention and the MLP each off their own norm of the layer's input, the layer adding
    # both to it (GPT-NeoX); the call's residual is then no part of its output.
    parallel_residual: bool
    norm: str  # "rms" (RMSNorm) or "layer" (torch's layer_norm)
    dtype: torch.dtype
    # LongRoPE (Phi-3), every layer's alike: the first layer's, which turns the step's
    # positions into rows of the cache (its long half for sequences past the original
    # context). None: the positions are the rows.
    long_rope: LongRopeRotaryEmbedding | None = None

    def takes(self, x: torch.Tensor) -> bool:
        """Whether this step's hidden states [T, hidden] go through the stack."""
        return (
            x.dim() == 2
            and x.shape[0] >= 1
            # the loop's linears run the few-row kernel, or on packed weights
            and (x.shape[0] <= NATIVE_MAX_ROWS or cpu.weights_packed(self.dtype))
            and x.dtype == self.dtype
            and x.device.type == "cpu"
            and all(attention.kv_cache is not None for attention in self.attentions)
            and current_lora_batch() is None  # adapters' updates are the Python layers'
        )

    def __call__(
        self, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) after the last layer, as the loop leaves them; where the step
        names its `output_rows` (and the linears run on the packed weights, whose rows do not
        depend on each other), those rows alone, in that order."""
        meta = get_forward_context()
        caches = [attention.kv_cache for attention in self.attentions]
        if self.long_rope is not None:
            positions = self.long_rope.cache_rows(positions)
        packed = []  # none: every linear runs the few-row kernel
        output_rows = None
        if x.shape[0] > NATIVE_MAX_ROWS:
            packed = [cpu.packed_weight(w) for w in self.linear_weights]
            output_rows = meta.output_rows
        x, residual = torch.ops.serve_cpu.decoder_layers(
            x.contiguous(),
            positions,
            self.weights,
            packed,
            self.qk_norm_weights,
            self.block_norm_weights,
            [k for k, _ in caches],
            [v for _, v in caches],
            self.cos_sin_caches,
            self.is_neox_style,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scales,
            self.query_scales,
            self.sliding_windows,
            self.logit_softcaps,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            self.residual_multiplier,
            self.activation,
            self.norm,
            self.gated_mlp,
            self.parallel_residual,
            output_rows,
        )
        return x, None if self.parallel_residual else residual


# The MLP gate's activation by its `ActAndMul` name, as the native call names it: the names
# whose function is torch's silu or gelu (exact, or its tanh approximation).
_GATED_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
}
# A plain MLP's by its `Activation` name: those, GPT-2's written-out tanh form and ReLU.
_PLAIN_ACTIVATIONS = {**_GATED_ACTIVATIONS, "gelu_new": "gelu_new", "relu": "relu"}


@dataclass
class _LayerParts:
    """One layer's modules in the stack's terms."""

    attention: nn.Module  # the layer's `Attention`
    linears: tuple[nn.Module, ...]  # qkv, o, up (gate_up where gated), down
    head_norms: tuple[nn.Module, ...]  # q's and k's norms per head (Qwen3, Gemma 3), or ()
    rotary: nn.Module | None  # None: the positions are the embeddings' (GPT-2)
    act: nn.Module  # ActAndMul (a gated MLP) or Activation
    attn_norm: nn.Module  # before attention, adding the residual
    mlp_norm: nn.Module  # before the MLP, adding the residual
    block_norms: tuple[nn.Module, ...]  # on attention's and the MLP's outputs (Gemma), or ()
    residual_multiplier: float
    query_scale: float = 1.0  # q times it before attention, which scales by its own (OPT)
    parallel_residual: bool = False  # GPT-NeoX's default

    @property
    def gated(self) -> bool:
        return type(self.act) is ActAndMul


def _layer_parts(layer: nn.Module) -> _LayerParts | None:
    """The layer's parts where it is one of the layers the stack computes, else None."""
    from serve.models.gemma import GemmaAttention, GemmaDecoderLayer
    from serve.models.gpt2 import GPT2MLP, GPT2Attention, GPT2Block
    from serve.models.gpt_neox import GPTNeoXAttention, GPTNeoXLayer, GPTNeoXMLP
    from serve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    from serve.models.opt import OPTAttention, OPTDecoderLayer
    from serve.models.stablelm import StableLmAttention, StableLmDecoderLayer

    if type(layer) is GPT2Block:
        attn, mlp = layer.attn, layer.mlp
        if type(attn) is not GPT2Attention or type(mlp) is not GPT2MLP:
            return None
        linears = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
        return _LayerParts(attn.attn, linears, (), None, mlp.act, layer.ln_1, layer.ln_2, (), 1.0)
    if type(layer) is GPTNeoXLayer:
        attn, mlp = layer.attention, layer.mlp
        if type(attn) is not GPTNeoXAttention or type(mlp) is not GPTNeoXMLP:
            return None
        linears = (attn.query_key_value, attn.dense, mlp.dense_h_to_4h, mlp.dense_4h_to_h)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        return _LayerParts(
            attn.attn,
            linears,
            (),
            attn.rotary_emb,
            mlp.act,
            *norms,
            (),
            1.0,
            parallel_residual=layer.use_parallel_residual,
        )
    if type(layer) is StableLmDecoderLayer:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not StableLmAttention or type(mlp) is not LlamaMLP:
            return None
        if layer.post_attention_layernorm is None or attn.q_layernorm is not None:
            return None  # StableLM 2 12B's parallel residual and per-head LayerNorms
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        return _LayerParts(attn.attn, linears, (), attn.rotary_emb, mlp.act, *norms, (), 1.0)
    if type(layer) is OPTDecoderLayer:
        attn = layer.self_attn
        if not layer.do_layer_norm_before or type(attn) is not OPTAttention:
            return None  # OPT-350m norms each block's output after its sum: not a stack layer
        linears = (attn.qkv_proj, attn.out_proj, layer.fc1, layer.fc2)
        norms = (layer.self_attn_layer_norm, layer.final_layer_norm)
        return _LayerParts(
            attn.attn, linears, (), None, layer.activation_fn, *norms, (), 1.0, float(attn.scale)
        )
    attention = {LlamaDecoderLayer: LlamaAttention, GemmaDecoderLayer: GemmaAttention}
    if type(layer) not in attention or type(layer.self_attn) is not attention[type(layer)]:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not LlamaMLP:
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    head_norms = tuple(norm for norm in (attn.q_norm, attn.k_norm) if norm is not None)
    parts = (attn.attn, linears, head_norms, attn.rotary_emb, mlp.act)
    if type(layer) is LlamaDecoderLayer:
        return _LayerParts(
            *parts,
            layer.input_layernorm,
            layer.post_attention_layernorm,
            (),
            float(layer.residual_multiplier),
        )
    return _LayerParts(
        *parts,
        layer.input_layernorm,
        layer.pre_feedforward_layernorm,
        (layer.post_attention_layernorm, layer.post_feedforward_layernorm),
        1.0,
    )


_NORMS = {RMSNorm: "rms", LayerNorm: "layer"}


def build_layer_stack(layers: nn.ModuleList) -> NativeLayerStack | None:
    """The stack for these layers, or None where any of them computes something the native
    call does not (or the native kernels are off or missing)."""
    if os.environ.get(ENV_VAR, "1") == "0" or not layers or get_tp_group().world_size != 1:
        return None
    if next(layers.parameters()).device.type != "cpu":  # a CPU kernel: not for CUDA weights
        return None
    if ops_for(torch.device("cpu")) is not cpu:  # SERVE_KERNEL_BACKEND=reference: its ops
        return None
    weights: list[torch.Tensor | None] = []
    linear_weights: list[torch.Tensor] = []
    qk_norm_weights: list[torch.Tensor] = []
    block_norm_weights: list[torch.Tensor] = []
    eps: set[float] = set()
    attention_shapes: set[tuple[int, int, int]] = set()
    neox: set[bool] = set()
    attentions, cos_sin, scales, query_scales, windows, softcaps = [], [], [], [], [], []
    multipliers: set[float] = set()
    activations: set[tuple[str, bool]] = set()  # (name, gated)
    norm_kinds: set[str] = set()
    parallel: set[bool] = set()
    long_ropes: set[tuple[int, int] | None] = set()
    long_rope: LongRopeRotaryEmbedding | None = None  # the first layer's, where LongRoPE
    for layer in layers:
        parts = _layer_parts(layer)
        if parts is None:
            return None
        multipliers.add(parts.residual_multiplier)
        parallel.add(parts.parallel_residual)
        norms = (parts.attn_norm, parts.mlp_norm)
        if any(type(norm) not in _NORMS for norm in norms):
            return None
        norm_kinds.update(_NORMS[type(norm)] for norm in norms)
        if any(type(norm) is not RMSNorm for norm in parts.block_norms):
            return None
        head_norms = parts.head_norms
        if head_norms and (len(head_norms) != 2 or any(type(n) is not RMSNorm for n in head_norms)):
            return None
        rotary = parts.rotary
        if rotary is None:
            long_ropes.add(None)
            neox.add(False)  # nothing rotates
        elif type(rotary) is LongRopeRotaryEmbedding:
            long_ropes.add((rotary.original_max_position, rotary.max_position))
            if long_rope is None:
                long_rope = rotary
            neox.add(True)  # as its forward calls the kernel
        elif type(rotary) is RotaryEmbedding:
            long_ropes.add(None)
            neox.add(rotary.is_neox_style)
        else:
            return None
        if rotary is not None:
            table = rotary.cos_sin_cache  # the native rotary's: float32, contiguous
            if table.dtype != torch.float32 or not table.is_contiguous():
                return None
            cos_sin.append(table)
        inner = parts.attention
        if inner.alibi_slopes is not None or inner.sinks is not None or inner.shared_kv:
            return None
        act = parts.act
        names = _GATED_ACTIVATIONS if parts.gated else _PLAIN_ACTIVATIONS
        if type(act) not in (ActAndMul, Activation) or act.name not in names:
            return None
        activations.add((names[act.name], parts.gated))
        kinds = (
            QKVParallelLinear,
            RowParallelLinear,
            MergedColumnParallelLinear if parts.gated else ColumnParallelLinear,
            RowParallelLinear,
        )
        linears = parts.linears
        if any(type(lin) is not kind for lin, kind in zip(linears, kinds, strict=True)):
            return None
        if any(lin.packed_weight is not None for lin in linears):  # a quantized checkpoint
            return None
        linear_weights.extend(lin.weight for lin in linears)
        for norm, linear_pair in zip(norms, (linears[:2], linears[2:]), strict=True):
            weights.extend((norm.weight, norm.bias if type(norm) is LayerNorm else None))
            for lin in linear_pair:
                weights.extend((lin.weight, lin.bias))
        qk_norm_weights.extend(norm.weight for norm in head_norms)
        block_norm_weights.extend(norm.weight for norm in parts.block_norms)
        eps.update(norm.eps for norm in (*norms, *head_norms, *parts.block_norms))
        attention_shapes.add((inner.num_heads, inner.num_kv_heads, inner.head_dim))
        attentions.append(inner)
        scales.append(float(inner.scale))
        query_scales.append(parts.query_scale)
        windows.append(int(inner.sliding_window or 0))
        softcaps.append(float(inner.logit_softcap or 0.0))
    if len(eps) != 1 or len(attention_shapes) != 1 or len(neox) != 1 or len(multipliers) != 1:
        return None
    if len(long_ropes) != 1 or len(activations) != 1 or len(norm_kinds) != 1 or len(parallel) != 1:
        return None
    # Every layer with them, or none.
    if cos_sin and len(cos_sin) != len(layers):
        return None
    if qk_norm_weights and len(qk_norm_weights) != 2 * len(layers):
        return None
    if block_norm_weights and len(block_norm_weights) != 2 * len(layers):
        return None
    dtype = linear_weights[0].dtype
    tensors = [w for w in weights if w is not None] + qk_norm_weights + block_norm_weights
    if dtype not in _DTYPES or any(w.dtype != dtype or not w.is_contiguous() for w in tensors):
        return None
    if any(w.device.type != "cpu" for w in tensors) or not native.available():
        return None
    ((num_heads, num_kv_heads, head_dim),) = attention_shapes
    ((activation, gated),) = activations
    return NativeLayerStack(
        attentions,
        weights,
        linear_weights,
        qk_norm_weights,
        block_norm_weights,
        cos_sin,
        neox.pop(),
        scales,
        query_scales,
        windows,
        softcaps,
        num_heads,
        num_kv_heads,
        head_dim,
        eps.pop(),
        multipliers.pop(),
        activation,
        gated,
        parallel.pop(),
        norm_kinds.pop(),
        dtype,
        long_rope,
    )


class LayerRunner:
    """How a model runs its decoder layers at a step: as one native call where the stack
    takes the step, else one by one. The stack is built at the first step, once the weights
    are loaded and placed; `use_stack = False` runs the loop (benchmarks' A/B)."""

    def __init__(self) -> None:
        self.use_stack = True
        self._stack: NativeLayerStack | None = None
        self._built = False

    def stack(self, layers: nn.ModuleList) -> NativeLayerStack | None:
        if not self._built:
            self._stack = build_layer_stack(layers)
            self._built = True
        return self._stack

    def __call__(
        self, layers: nn.ModuleList, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) after the layers, from the embeddings x [T, hidden]; residual None
        where the layers add their input to their output themselves (a parallel residual)."""
        stack = self.stack(layers) if self.use_stack else None
        if stack is not None and stack.takes(x):
            return stack(positions, x)
        residual = None
        for layer in layers:
            x, residual = layer(positions, x, residual)
        return x, residual
