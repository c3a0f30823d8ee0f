"""Llama-style decoder layers run as one native call on CPU.

A layer is ~10 ops from Python, each through a module, the kernel interface and the
dispatcher. At a step of one or two tokens (every linear a pass over its weights through
the few-row native kernel) those calls were 3-5 ms of the default model's 14-21 ms step;
at a decode step of 64 rows, ~7% of it. `serve_cpu::decoder_layers`
(kernels/cpu/csrc/decoder.cpp) runs the same kernels in the same order from C++ (the
linears on oneDNN's packed weights from NATIVE_MAX_ROWS + 1 rows, as
`serve.kernels.cpu.linear` runs them), so a step's output is the Python loop's bit for bit.

It takes only what it computes exactly as the loop does: the dense Llama layer (Llama,
Qwen2, Mistral, SmolLM, Qwen3's q/k norms, Granite's residual multiplier, Phi-3 with plain
RoPE or LongRoPE, ...) with RMSNorm, SiLU-gated MLP, no ALiBi, no soft-cap, no attention
sinks, one rank, float32 or bfloat16, and the native kernels built. Everything else runs
the loop. `SERVE_CPU_LAYER_STACK=0` turns it off (to compare, or to rule it out).
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
from serve.models.layers.activation import ActAndMul
from serve.models.layers.layernorm import RMSNorm
from serve.models.layers.linear import (
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

    layers: list[nn.Module]  # LlamaDecoderLayer
    weights: list[torch.Tensor | None]
    linear_weights: list[torch.Tensor]  # qkv, o, gate_up, down a layer: what oneDNN packs
    qk_norm_weights: list[torch.Tensor]  # q norm, k norm a layer (Qwen3), or none
    cos_sin_caches: list[torch.Tensor]
    is_neox_style: bool
    scales: list[float]
    sliding_windows: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    residual_multiplier: float  # each block's output scaled by it (Granite; 1.0 elsewhere)
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
            # the loop's linears run the few-row kernel, or oneDNN on packed weights
            and (x.shape[0] <= NATIVE_MAX_ROWS or cpu.weights_packed(self.dtype))
            and x.dtype == self.dtype
            and x.device.type == "cpu"
            and all(layer.self_attn.attn.kv_cache is not None for layer in self.layers)
            and current_lora_batch() is None  # adapters' updates are the Python layers'
        )

    def __call__(
        self, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after the last layer, as the loop leaves them; where the step
        names its `output_rows` (and the linears run on oneDNN, whose rows do not depend
        on each other), those rows alone, in that order."""
        meta = get_forward_context()
        caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
        if self.long_rope is not None:
            positions = self.long_rope.cache_rows(positions)
        packed = []  # none: every linear runs the few-row kernel
        output_rows = None
        if x.shape[0] > NATIVE_MAX_ROWS:
            packed = [cpu.onednn_weight(w) for w in self.linear_weights]
            output_rows = meta.output_rows
        return torch.ops.serve_cpu.decoder_layers(
            x.contiguous(),
            positions,
            self.weights,
            packed,
            self.qk_norm_weights,
            [k for k, _ in caches],
            [v for _, v in caches],
            self.cos_sin_caches,
            self.is_neox_style,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scales,
            self.sliding_windows,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            self.residual_multiplier,
            output_rows,
        )


def build_layer_stack(layers: nn.ModuleList) -> NativeLayerStack | None:
    """The stack for these layers, or None where any of them computes something the native
    call does not (or the native kernels are off or missing)."""
    from serve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if os.environ.get(ENV_VAR, "1") == "0" or not layers or get_tp_group().world_size != 1:
        return None
    if next(layers.parameters()).device.type != "cpu":  # a CPU kernel: not for CUDA weights
        return None
    if ops_for(torch.device("cpu")) is not cpu:  # SERVE_KERNEL_BACKEND=reference: its ops
        return None
    weights: list[torch.Tensor | None] = []
    linear_weights: list[torch.Tensor] = []
    qk_norm_weights: list[torch.Tensor] = []
    eps: set[float] = set()
    attention_shapes: set[tuple[int, int, int]] = set()
    neox: set[bool] = set()
    cos_sin, scales, windows = [], [], []
    multipliers: set[float] = set()
    long_ropes: set[tuple[int, int] | None] = set()
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer:
            return None
        multipliers.add(float(layer.residual_multiplier))
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return None
        if any(type(norm) is not RMSNorm for norm in norms):
            return None
        head_norms = [norm for norm in (attn.q_norm, attn.k_norm) if norm is not None]
        if head_norms and (len(head_norms) != 2 or any(type(n) is not RMSNorm for n in head_norms)):
            return None
        rotary = attn.rotary_emb
        if type(rotary) is LongRopeRotaryEmbedding:
            long_ropes.add((rotary.original_max_position, rotary.max_position))
            neox.add(True)  # as its forward calls the kernel
        elif type(rotary) is RotaryEmbedding:
            long_ropes.add(None)
            neox.add(rotary.is_neox_style)
        else:
            return None
        table = rotary.cos_sin_cache  # the native rotary's: float32, contiguous
        if table.dtype != torch.float32 or not table.is_contiguous():
            return None
        inner = attn.attn
        if (
            inner.alibi_slopes is not None
            or inner.logit_softcap is not None
            or inner.sinks is not None
        ):
            return None
        if type(mlp.act) is not ActAndMul or mlp.act.name not in ("silu", "swish"):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        kinds = (
            QKVParallelLinear,
            RowParallelLinear,
            MergedColumnParallelLinear,
            RowParallelLinear,
        )
        if any(type(lin) is not kind for lin, kind in zip(linears, kinds, strict=True)):
            return None
        if any(lin.packed_weight is not None for lin in linears):  # a quantized checkpoint
            return None
        linear_weights.extend(lin.weight for lin in linears)
        for norm, linear_pair in zip(norms, (linears[:2], linears[2:]), strict=True):
            weights.append(norm.weight)
            for lin in linear_pair:
                weights.extend((lin.weight, lin.bias))
        qk_norm_weights.extend(norm.weight for norm in head_norms)
        eps.update(norm.eps for norm in (*norms, *head_norms))
        attention_shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim))
        cos_sin.append(table)
        scales.append(float(inner.scale))
        windows.append(int(inner.sliding_window or 0))
    if len(eps) != 1 or len(attention_shapes) != 1 or len(neox) != 1 or len(multipliers) != 1:
        return None
    if len(long_ropes) != 1:
        return None
    if qk_norm_weights and len(qk_norm_weights) != 2 * len(layers):  # some layers without
        return None
    dtype = weights[0].dtype
    tensors = [w for w in weights if w is not None] + qk_norm_weights
    if dtype not in _DTYPES or any(w.dtype != dtype or not w.is_contiguous() for w in tensors):
        return None
    if any(w.device.type != "cpu" for w in tensors) or not native.available():
        return None
    ((num_heads, num_kv_heads, head_dim),) = attention_shapes
    return NativeLayerStack(
        list(layers),
        weights,
        linear_weights,
        qk_norm_weights,
        cos_sin,
        neox.pop(),
        scales,
        windows,
        num_heads,
        num_kv_heads,
        head_dim,
        eps.pop(),
        multipliers.pop(),
        dtype,
        layers[0].self_attn.rotary_emb if long_ropes.pop() is not None else None,
    )
