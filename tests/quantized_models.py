"""Quantized checkpoints of the tiny test models, written as the quantizers write them.

`quantize_checkpoint` rounds a float model's decoder linears to GPTQ's, AWQ's or FP8's
codes and packs them in the checkpoint's own layout (the packing written here from each
format's description, not from serve's reader); it also saves a float twin holding the
dequantized weights, which transformers runs as the oracle: greedy output of serve on the
quantized checkpoint must equal transformers' on the twin, token for token.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# How the quantized-model tests run an engine: prompts chunked, a small cache (a test
# module holds several engines at once), greedy past EOS.
MAX_TOKENS = 12
ENGINE = {
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "max_model_len": 64,
    "kv_cache_memory": "16MiB",
}

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEARS += ("w1", "w2", "w3")  # Mixtral's experts' gate, down, up
LINEARS += ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's MLA
AUTOAWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field k of a word holds column ORDER[k]


def _is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in LINEARS and parts[-1] == "weight"


def _round_to_grid(
    w: torch.Tensor, groups: torch.Tensor, num_groups: int, bits: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric (or symmetric) round-to-nearest per (output, group): codes [out, in],
    zero points [out, G] (integers), scales [out, G] as fp16."""
    top = 2**bits - 1
    out = w.shape[0]
    low = torch.full((out, num_groups), float("inf"))
    high = torch.full((out, num_groups), float("-inf"))
    for g in range(num_groups):
        cols = w[:, groups == g]
        low[:, g], high[:, g] = cols.min(dim=1).values, cols.max(dim=1).values
    if sym:
        amax = torch.maximum(low.abs(), high.abs())
        scales = (2 * amax / top).clamp(min=1e-6).half()
        zeros = torch.full_like(scales, float((top + 1) // 2), dtype=torch.float32)
    else:
        low, high = low.clamp(max=0), high.clamp(min=0)
        scales = ((high - low) / top).clamp(min=1e-6).half()
        zeros = torch.round(-low / scales.float()).clamp(0, top)
    codes = torch.round(w / scales.float()[:, groups]) + zeros[:, groups]
    return codes.clamp(0, top).to(torch.int32), zeros.to(torch.int32), scales


def _pack_along(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int values packed into int32 words along `dim`, field k (bits k*b ..) holding the
    word's value `order[k]` (in order by default)."""
    per_word = 32 // bits
    values = values.movedim(dim, -1).to(torch.int64)
    words = values.reshape(*values.shape[:-1], -1, per_word)
    order = order or tuple(range(per_word))
    packed = torch.zeros(words.shape[:-1], dtype=torch.int64)
    for field, source in enumerate(order):
        packed |= words[..., source] << (bits * field)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim)


def _input_of(module: str) -> str:
    """Modules that read the same input (q, k, v; gate, up) share a key: GPTQ's act order
    sorts a layer's inputs by their statistics, so such modules get the same order."""
    for shared, names in (
        ("qkv", ("q_proj", "k_proj", "v_proj")),
        ("gate_up", ("gate_proj", "up_proj")),
        ("w13", ("w1", "w3")),
    ):
        for name in names:
            if module.endswith(name):
                return module.removesuffix(name) + shared
    return module


def _gptq(w, bits, group_size, act_order, sym, seed, v2):
    out, n_in = w.shape
    if act_order:  # groups over a shuffled order of the inputs, as act order makes them
        perm = torch.randperm(n_in, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(n_in, dtype=torch.int32)
        g_idx[perm] = (torch.arange(n_in) // group_size).to(torch.int32)
    else:
        g_idx = (torch.arange(n_in) // group_size).to(torch.int32)
    num_groups = n_in // group_size
    codes, zeros, scales = _round_to_grid(w, g_idx, num_groups, bits, sym)
    dequant = (codes.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]
    assert v2 or bool((zeros > 0).all()), "v1 stores zero - 1: a zero of 0 would wrap"
    stored_zeros = zeros if v2 else zeros - 1
    tensors = {
        "qweight": _pack_along(codes.t(), bits, dim=0),  # [in / p, out]
        "qzeros": _pack_along(stored_zeros.t() & (2**bits - 1), bits, dim=1),  # [G, out / p]
        "scales": scales.t().contiguous(),  # [G, out]
        "g_idx": g_idx,
    }
    return tensors, dequant


def _awq(w, group_size):
    n_in = w.shape[1]
    groups = torch.arange(n_in) // group_size
    codes, zeros, scales = _round_to_grid(w, groups, n_in // group_size, 4, sym=False)
    dequant = (codes.float() - zeros.float()[:, groups]) * scales.float()[:, groups]
    tensors = {
        "qweight": _pack_along(codes.t(), 4, dim=1, order=AUTOAWQ_PACK_ORDER),  # [in, out / 8]
        "qzeros": _pack_along(zeros.t(), 4, dim=1, order=AUTOAWQ_PACK_ORDER),  # [G, out / 8]
        "scales": scales.t().contiguous(),  # [G, out]
    }
    return tensors, dequant


def _fp8(w, block):
    out, n_in = w.shape
    if block is None:
        scale = (w.abs().max() / 448.0).clamp(min=1e-12).float()
        q = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale
    bo, bi = block
    rows, cols = -(-out // bo), -(-n_in // bi)
    scales = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi]
            scales[r, c] = (tile.abs().max() / 448.0).clamp(min=1e-12)
    full = scales.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :n_in]
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scales}, q.float() * full


def quantize_checkpoint(
    model_dir: Path,
    out_dir: Path,
    method: str,
    *,
    bits: int = 4,
    group_size: int = 16,
    act_order: bool = False,
    sym: bool = False,
    gptq_v2: bool = False,
    block: tuple[int, int] | None = (16, 16),
    seed: int = 0,
    only: str = "",
) -> tuple[Path, Path]:
    """(the quantized checkpoint, its dequantized float twin) of `model_dir`'s model;
    `only`: quantize just the linears whose names hold it (a VLM's `language_model.`)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    quantized, twin = out_dir / method, out_dir / f"{method}-dequantized"
    for directory in (quantized, twin):
        shutil.copytree(model_dir, directory, dirs_exist_ok=True)
        for file in directory.glob("*.safetensors"):
            file.unlink()
    state = load_file(str(model_dir / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, tensor in state.items():
        if not _is_linear(name) or only not in name:
            packed[name] = dequantized[name] = tensor
            continue
        module = name.removesuffix(".weight")
        w = tensor.float()
        if method == "gptq":
            order_seed = seed + zlib.crc32(_input_of(module).encode())
            parts, dq = _gptq(w, bits, group_size, act_order, sym, order_seed, gptq_v2)
        elif method == "awq":
            parts, dq = _awq(w, group_size)
        elif method == "fp8":
            parts, dq = _fp8(w, block)
        else:
            raise ValueError(method)
        packed.update({f"{module}.{suffix}": t.contiguous() for suffix, t in parts.items()})
        dequantized[name] = dq.to(tensor.dtype)
    save_file(packed, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(twin / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "gptq": {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": "gptq_v2" if gptq_v2 else "gptq",
        },
        "awq": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        },
        "fp8": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            **({"weight_block_size": list(block)} if block else {}),
        },
    }[method]
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, twin


def fp8_rows_twin(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir`'s model with each decoder linear rounded through FP8 by rows (one scale a
    row: its largest magnitude over 448), saved as float: what `--quantization fp8` serves."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    state = load_file(str(model_dir / "model.safetensors"))
    for name, w in state.items():
        if _is_linear(name):
            scale = (w.abs().max(dim=1, keepdim=True).values / 448.0).clamp(min=1e-12)
            state[name] = (w / scale).to(torch.float8_e4m3fn).float() * scale
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# OCP MXFP4's E2M1 values for codes 0..7 (8..15: the same, negative).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out,
    in / 32], dequantized [..., out, in]): each 32 inputs share 2^e, the smallest power of
    two their largest magnitude fits under 6 with, stored e + 127; each value rounds to the
    nearest E2M1 value, two codes a byte with the even input in the low nibble."""
    groups = w.float().unflatten(-1, (-1, 32))  # [..., out, in / 32, 32]
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    grid = torch.tensor(E2M1)
    magnitude = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)  # [..., 32]: 0..7
    codes = magnitude + 8 * (scaled < 0).to(torch.int64) * (magnitude > 0).to(torch.int64)
    values = grid[magnitude] * torch.where(codes >= 8, -1.0, 1.0)
    dequantized = (values * torch.exp2(exponent)).flatten(-2)
    pairs = codes.to(torch.uint8).unflatten(-1, (16, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return blocks, scales, dequantized


def mxfp4_gpt_oss(model_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """(GPT-OSS's `model_dir` with its experts in OpenAI's MXFP4 layout, the float twin of
    the dequantized experts). transformers' float experts are [experts, in, out]; the
    MXFP4 tensors are output-major, [experts, out, in / 32, 16] and [experts, out, in / 32],
    gate/up's rows interleaved as the float columns were."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    quantized, twin = out_dir / "mxfp4", out_dir / "mxfp4-dequantized"
    state = load_file(str(model_dir / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, tensor in state.items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            packed[name] = dequantized[name] = tensor
            continue
        blocks, scales, values = _mxfp4(tensor.transpose(1, 2))
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dequantized[name] = values.transpose(1, 2).to(tensor.dtype).contiguous()
    for directory, tensors in ((quantized, packed), (twin, dequantized)):
        shutil.copytree(model_dir, directory, dirs_exist_ok=True)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, twin
