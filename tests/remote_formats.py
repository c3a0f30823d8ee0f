"""Tiny checkpoints in the formats whose transformers code ships with the checkpoint
(`trust_remote_code`): InternLM, Aquila, Baichuan (7B, 13B, 2), Qwen v1.

transformers has no code for these, so each checkpoint is written in its own format —
config.json with the family's model_type, architectures and field names, safetensors with
its tensor names and fused layouts — from a transformers model that computes the same
function, saved beside it as the oracle. Baichuan's ALiBi models have no transformers
equivalent: their weights come from a tiny Llama (only as a source of random tensors) and
their oracle is the reference forward in tests/models/test_remote_formats.py.

Every checkpoint's `auto_map` names .py files that mark the directory (`REMOTE_CODE_RAN`)
and raise if imported: serve must load the checkpoint without running them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from tiny_models import _generate, _perturb_, build_tokenizer, make_tiny_config, random_prompts

REMOTE_CODE_MARKER = "REMOTE_CODE_RAN"
# transformers runs a copy of the file from its modules cache: the marker's path is absolute.
REMOTE_CODE = """\
from pathlib import Path

Path({marker!r}).touch()
raise RuntimeError("remote code must never run")
"""


@dataclass(frozen=True)
class RemoteFamily:
    key: str  # test id
    # Writes the checkpoint into `checkpoint_dir`; returns the transformers oracle's
    # directory (written into `oracle_dir`), or None where the oracle is the reference forward.
    build: Callable[[Path, Path], Path | None]
    tp2: bool = True  # its heads and widths split over 2 ranks
    window: int | None = None  # none has a sliding window (test_families._workload reads it)


def _tiny_model(config: transformers.PretrainedConfig, seed: int) -> transformers.PreTrainedModel:
    """A perturbed tiny model (tiny_models.py's recipe) whose greedy output wanders."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _perturb_(model, std=config.initializer_range)
    return model


def _save_oracle(model: transformers.PreTrainedModel, oracle_dir: Path) -> Path:
    probe = random_prompts(len(build_tokenizer()), 1, 8, 8, seed=0)[0]
    new_token_ids = _generate(model, probe, 20, ignore_eos=True)
    if len(set(new_token_ids)) <= 3:
        raise RuntimeError(f"tiny oracle is degenerate: greedy gave {new_token_ids}")
    model.save_pretrained(oracle_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(oracle_dir)
    return oracle_dir


def _write_checkpoint(
    out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], code_module: str
) -> None:
    """config.json (with an `auto_map` onto `<code_module>.py` files that must never run),
    model.safetensors, the tiny tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model_class = config["architectures"][0]
    config = {
        **config,
        "auto_map": {
            "AutoConfig": f"configuration_{code_module}.Config",
            "AutoModelForCausalLM": f"modeling_{code_module}.{model_class}",
        },
        "torch_dtype": "float32",
        "transformers_version": "4.33.0",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for kind in ("configuration", "modeling"):
        code = REMOTE_CODE.format(marker=str(out_dir.resolve() / REMOTE_CODE_MARKER))
        (out_dir / f"{kind}_{code_module}.py").write_text(code)
    save_file(
        {k: v.detach().contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors"
    )
    build_tokenizer().save_pretrained(out_dir)


def _llama_like_fields(hf: transformers.PretrainedConfig) -> dict:
    """The config fields the Llama-shaped remote formats spell as Llama does."""
    return {
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_hidden_layers": hf.num_hidden_layers,
        "num_attention_heads": hf.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": hf.rms_norm_eps,
        "initializer_range": 0.02,
        "bos_token_id": hf.bos_token_id,
        "eos_token_id": hf.eos_token_id,
        "pad_token_id": hf.pad_token_id,
        "tie_word_embeddings": False,
        "use_cache": True,
    }


def _mha_llama(seed: int, **overrides) -> transformers.PreTrainedModel:
    """A tiny Llama with as many KV heads as heads (none of these formats has GQA)."""
    fields = {"num_key_value_heads": 4, "tie_word_embeddings": False, "rope_theta": 10000.0}
    return _tiny_model(make_tiny_config("llama", **(fields | overrides)), seed)


def _w_pack(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Llama's q/k/v projections as Baichuan's W_pack: their rows concatenated."""
    out = {}
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            prefix = name.split(".q_proj.")[0]
            parts = [state[f"{prefix}.{p}_proj.weight"] for p in "qkv"]
            out[f"{prefix}.W_pack.weight"] = torch.cat(parts)
        elif not any(f".self_attn.{p}_proj." in name for p in "kv"):
            out[name] = tensor
    return out


# -- the families --------------------------------------------------------------------


def build_internlm(checkpoint_dir: Path, oracle_dir: Path) -> Path:
    """InternLM = Llama with biases on q, k, v and o; the rotary base under `rotary`."""
    model = _mha_llama(seed=1, attention_bias=True, rope_theta=20000.0)
    config = {
        **_llama_like_fields(model.config),
        "model_type": "internlm",
        "architectures": ["InternLMForCausalLM"],
        "bias": True,
        "rotary": {"base": 20000, "type": "dynamic"},
        "max_position_embeddings": model.config.max_position_embeddings,
    }
    _write_checkpoint(checkpoint_dir, config, model.state_dict(), "internlm")
    return _save_oracle(model, oracle_dir)


def build_aquila(checkpoint_dir: Path, oracle_dir: Path) -> Path:
    """Aquila = Llama (Aquila 2's GQA included), under its own model_type."""
    config = make_tiny_config("llama", tie_word_embeddings=False, rope_theta=10000.0)
    model = _tiny_model(config, seed=2)
    fields = {
        **_llama_like_fields(config),
        "model_type": "aquila",
        "architectures": ["AquilaForCausalLM"],
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
    }
    _write_checkpoint(checkpoint_dir, fields, model.state_dict(), "aquila")
    return _save_oracle(model, oracle_dir)


def build_baichuan_7b(checkpoint_dir: Path, oracle_dir: Path) -> Path:
    """Baichuan 7B = Llama (rotary base 10,000) with q, k, v fused in W_pack."""
    model = _mha_llama(seed=3)
    config = {
        **_llama_like_fields(model.config),
        "model_type": "baichuan",
        "architectures": ["BaiChuanForCausalLM"],
        "max_position_embeddings": model.config.max_position_embeddings,
    }
    _write_checkpoint(checkpoint_dir, config, _w_pack(model.state_dict()), "baichuan")
    return _save_oracle(model, oracle_dir)


def build_baichuan2_7b(checkpoint_dir: Path, oracle_dir: Path) -> Path:
    """Baichuan 2 7B = Baichuan 7B's layout with a NormHead: the checkpoint's LM head rows
    are stored un-normalised (random lengths); the oracle's head holds them normalised."""
    model = _mha_llama(seed=4)
    head = model.lm_head.weight.detach()
    stored_head = head * torch.empty(head.shape[0], 1).uniform_(0.2, 5.0)  # [vocab, hidden]
    with torch.no_grad():
        model.lm_head.weight.copy_(F.normalize(stored_head, dim=-1))
    config = {
        **_llama_like_fields(model.config),
        "model_type": "baichuan",
        "architectures": ["BaichuanForCausalLM"],
        "max_position_embeddings": model.config.max_position_embeddings,
        "model_max_length": model.config.max_position_embeddings,
        "z_loss_weight": 0,
    }
    tensors = {**_w_pack(model.state_dict()), "lm_head.weight": stored_head}
    _write_checkpoint(checkpoint_dir, config, tensors, "baichuan")
    return _save_oracle(model, oracle_dir)


def _baichuan_alibi(checkpoint_dir: Path, num_heads: int, baichuan2: bool, seed: int) -> None:
    """Baichuan 13B / Baichuan 2 13B: W_pack, ALiBi, no `max_position_embeddings` (only
    `model_max_length`). The tiny Llama only supplies random tensors of the right shapes."""
    model = _mha_llama(
        seed=seed,
        hidden_size=16 * num_heads,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
    )
    config = {
        **_llama_like_fields(model.config),
        "model_type": "baichuan",
        "architectures": ["BaichuanForCausalLM"],
        "model_max_length": 4096,
        "gradient_checkpointing": [False],
    }
    tensors = _w_pack(model.state_dict())
    if baichuan2:
        config["z_loss_weight"] = 0
        head = tensors["lm_head.weight"]
        tensors["lm_head.weight"] = head * torch.empty(head.shape[0], 1).uniform_(0.2, 5.0)
    _write_checkpoint(checkpoint_dir, config, tensors, "baichuan")


def build_baichuan_13b(checkpoint_dir: Path, oracle_dir: Path) -> None:
    """6 heads: ALiBi's slopes for a head count that is not a power of two (13B has 40)."""
    _baichuan_alibi(checkpoint_dir, num_heads=6, baichuan2=False, seed=5)


def build_baichuan2_13b(checkpoint_dir: Path, oracle_dir: Path) -> None:
    _baichuan_alibi(checkpoint_dir, num_heads=4, baichuan2=True, seed=6)


QWEN_SEQ_LENGTH = 64  # test_families' max_model_len: served exactly


def _qwen_checkpoint(checkpoint_dir: Path, model, rotary_pct: float) -> None:
    """Qwen v1's names and layout: c_attn = [q; k; v] with its bias, w1 = up, w2 = gate."""
    hf = model.config
    state = model.state_dict()
    tensors = {
        "transformer.wte.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    inter = hf.intermediate_size
    for i in range(hf.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        if f"{src}self_attn.qkv_proj.weight" in state:  # Phi-3: fused already, no bias
            c_attn = state[f"{src}self_attn.qkv_proj.weight"]
            c_attn_bias = torch.zeros(c_attn.shape[0])
            gate_up = state[f"{src}mlp.gate_up_proj.weight"]
            gate, up = gate_up[:inter], gate_up[inter:]
        else:  # Qwen2
            c_attn = torch.cat([state[f"{src}self_attn.{p}_proj.weight"] for p in "qkv"])
            c_attn_bias = torch.cat([state[f"{src}self_attn.{p}_proj.bias"] for p in "qkv"])
            gate, up = state[f"{src}mlp.gate_proj.weight"], state[f"{src}mlp.up_proj.weight"]
        tensors |= {
            f"{dst}ln_1.weight": state[f"{src}input_layernorm.weight"],
            f"{dst}attn.c_attn.weight": c_attn,
            f"{dst}attn.c_attn.bias": c_attn_bias,
            f"{dst}attn.c_proj.weight": state[f"{src}self_attn.o_proj.weight"],
            f"{dst}ln_2.weight": state[f"{src}post_attention_layernorm.weight"],
            f"{dst}mlp.w1.weight": up,
            f"{dst}mlp.w2.weight": gate,
            f"{dst}mlp.c_proj.weight": state[f"{src}mlp.down_proj.weight"],
        }
    config = {
        "model_type": "qwen",
        "architectures": ["QWenLMHeadModel"],
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "intermediate_size": 2 * inter,  # Qwen's: twice the width of w1 and w2
        "num_hidden_layers": hf.num_hidden_layers,
        "num_attention_heads": hf.num_attention_heads,
        "kv_channels": hf.hidden_size // hf.num_attention_heads,
        "layer_norm_epsilon": hf.rms_norm_eps,
        "rotary_emb_base": hf.rope_parameters["rope_theta"],
        "rotary_pct": rotary_pct,
        "seq_length": QWEN_SEQ_LENGTH,
        "max_position_embeddings": 8192,
        "use_dynamic_ntk": True,
        "use_logn_attn": True,
        "no_bias": True,
        "scale_attn_weights": True,
        "emb_dropout_prob": 0.0,
        "attn_dropout_prob": 0.0,
        "bf16": False,
        "fp16": False,
        "fp32": False,
        "use_flash_attn": "auto",
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
    }  # no eos_token_id: Qwen's configs leave it to generation_config.json
    _write_checkpoint(checkpoint_dir, config, tensors, "qwen")


def build_qwen(checkpoint_dir: Path, oracle_dir: Path) -> Path:
    """Qwen v1 = Qwen2 (q/k/v biases, no o bias) without GQA, in Qwen v1's names."""
    # A large eps, so that Qwen's `layer_norm_epsilon` not being read would show.
    config = make_tiny_config("qwen2", num_key_value_heads=4, rope_theta=50000.0, rms_norm_eps=0.01)
    model = _tiny_model(config, seed=7)
    _qwen_checkpoint(checkpoint_dir, model, rotary_pct=1.0)
    return _save_oracle(model, oracle_dir)


def build_qwen_partial_rotary(checkpoint_dir: Path, oracle_dir: Path) -> Path:
    """rotary_pct 0.5 (every released Qwen v1 has 1.0): transformers' Qwen2 rotates whole
    heads, so the oracle is Phi-3 (the same block with a partial GPT-NeoX rotation and no
    q/k/v bias); the checkpoint's c_attn bias is zero."""
    tokenizer = build_tokenizer()
    config = transformers.Phi3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = _tiny_model(config, seed=8)
    _qwen_checkpoint(checkpoint_dir, model, rotary_pct=0.5)
    return _save_oracle(model, oracle_dir)


# tp2=False where two ranks would run no code and no split another entry does not: CI time.
REMOTE_FAMILIES = [
    RemoteFamily("internlm", build_internlm),
    RemoteFamily("aquila", build_aquila, tp2=False),  # the llama family's model and GQA split
    RemoteFamily("baichuan-7b", build_baichuan_7b),
    RemoteFamily("baichuan2-7b", build_baichuan2_7b),
    RemoteFamily("baichuan-13b", build_baichuan_13b),
    RemoteFamily("baichuan2-13b", build_baichuan2_13b),
    RemoteFamily("qwen", build_qwen),
    RemoteFamily("qwen-partial-rotary", build_qwen_partial_rotary, tp2=False),  # qwen's split
]
REMOTE_FAMILIES_BY_KEY = {f.key: f for f in REMOTE_FAMILIES}
