"""The families whose transformers code ships with the checkpoint (InternLM, Aquila,
Baichuan, Qwen v1), each from a tiny checkpoint in its own format (remote_formats.py),
through test_families' workload at one rank and at two: greedy token for token against the
transformers model the checkpoint was written from, or, for Baichuan's ALiBi models, against
the reference forward below. The checkpoint's own code never runs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_share import TWO_RANK_DEVICE
from models.test_families import ENGINE, MAX_TOKENS, _assert_matches_hf, _run_staggered, _workload
from remote_formats import (
    QWEN_SEQ_LENGTH,
    REMOTE_CODE_MARKER,
    REMOTE_FAMILIES,
    REMOTE_FAMILIES_BY_KEY,
)
from safetensors.torch import load_file
from tiny_models import hf_greedy, random_prompts
from transformers import PretrainedConfig

from serve import LLM
from serve.engine.validation import fit_max_model_len
from serve.models.baichuan import is_baichuan2, uses_alibi
from serve.models.loader import load_hf_config, model_max_len
from serve.models.registry import get_arch_config

# -- the reference forward of Baichuan's ALiBi models ---------------------------------


def _baichuan_slopes(num_heads: int) -> list[float]:
    """Baichuan's `_get_interleave`, in Python floats: for a power of two n, the series
    2^(-8/n), 2^(-16/n), ...; otherwise that series for the power of two below, then every
    other term of the series for twice it."""

    def series(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    return series(closest) + series(2 * closest)[0::2][: num_heads - closest]


def baichuan_alibi_greedy(checkpoint: Path, prompt: list[int], norm_head: bool) -> list[int]:
    """Baichuan 13B / Baichuan 2 13B as their modeling_baichuan.py computes them, in float32,
    the whole context recomputed for every new token: x = embed(ids); per layer
    x += o_proj(attention(rms(x))), x += down(silu(gate(h)) * up(h)) with h = rms(x);
    logits = head(rms(x)), Baichuan 2's head rows divided by their L2 norms (NormHead)."""
    config = json.loads((checkpoint / "config.json").read_text())
    w = load_file(checkpoint / "model.safetensors")
    num_heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim, eps = hidden // num_heads, config["rms_norm_eps"]
    slopes = torch.tensor(_baichuan_slopes(num_heads))  # [H]
    head = F.normalize(w["lm_head.weight"], dim=-1) if norm_head else w["lm_head.weight"]

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    ids = list(prompt)
    for _ in range(MAX_TOKENS):
        n = len(ids)
        distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()  # key - query
        # ALiBi: slope * (key - query) for past keys; future keys masked out.
        bias = (slopes[:, None, None] * distance).masked_fill(distance > 0, float("-inf"))
        x = w["model.embed_tokens.weight"][ids]  # [n, hidden]
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"])
            qkv = (h @ w[p + "self_attn.W_pack.weight"].T).view(n, 3, num_heads, head_dim)
            q, k, v = qkv.unbind(1)  # W_pack's rows: [q; k; v], each [n, H, head_dim]
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim) + bias
            attention = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hidden)
            x = x + attention @ w[p + "self_attn.o_proj.weight"].T
            h = rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        logits = rms(x[-1], w["model.norm.weight"]) @ head.T  # [vocab]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


# -- the checkpoints ------------------------------------------------------------------


@pytest.fixture(scope="module")
def remote_checkpoint(tmp_path_factory):
    """`family -> (checkpoint dir, greedy oracle)`, each built once."""
    built = {}

    def build(family):
        if family.key not in built:
            root = tmp_path_factory.mktemp(family.key)
            checkpoint = root / "checkpoint"
            oracle_dir = family.build(checkpoint, root / "oracle")
            if oracle_dir is not None:

                def greedy(prompt, oracle_dir=oracle_dir):
                    return hf_greedy(oracle_dir, prompt, MAX_TOKENS, ignore_eos=True)

            else:
                norm_head = family.key.startswith("baichuan2")

                def greedy(prompt, checkpoint=checkpoint, norm_head=norm_head):
                    return baichuan_alibi_greedy(checkpoint, prompt, norm_head)

                probe = greedy(random_prompts(512, 1, 8, 8, seed=0)[0])
                assert len(set(probe)) > 3, f"tiny {family.key} is degenerate: {probe}"
            built[family.key] = checkpoint, greedy
        return built[family.key]

    return build


def _check_no_code_ran(checkpoint: Path) -> None:
    assert any(checkpoint.glob("modeling_*.py"))  # the code its auto_map names
    assert not (checkpoint / REMOTE_CODE_MARKER).exists(), "the checkpoint's code ran"


@pytest.mark.parametrize("family", REMOTE_FAMILIES, ids=[f.key for f in REMOTE_FAMILIES])
def test_greedy_matches_the_oracle(remote_checkpoint, family):
    checkpoint, greedy = remote_checkpoint(family)
    llm = LLM(model=str(checkpoint), **ENGINE)
    prompts = _workload(family)
    _assert_matches_hf(checkpoint, prompts, _run_staggered(llm, prompts), greedy)
    stats = llm.stats()
    assert stats.prefix_cache_hits >= 16, "the shared prefix was not found cached"
    assert stats.num_preemptions >= 1, "the cache was meant to run out"
    assert stats.num_blocks_used == 0
    _check_no_code_ran(checkpoint)


TP2_FAMILIES = [f for f in REMOTE_FAMILIES if f.tp2]


@pytest.mark.parametrize("family", TP2_FAMILIES, ids=[f.key for f in TP2_FAMILIES])
def test_greedy_at_two_ranks_matches_the_oracle(remote_checkpoint, family):
    checkpoint, greedy = remote_checkpoint(family)
    prompts = _workload(family)
    with LLM(
        model=str(checkpoint), tensor_parallel_size=2, device=TWO_RANK_DEVICE, **ENGINE
    ) as llm:
        got = _run_staggered(llm, prompts)
    _assert_matches_hf(checkpoint, prompts, got, greedy)
    _check_no_code_ran(checkpoint)


# -- configs read as data -------------------------------------------------------------


@pytest.mark.parametrize("family", REMOTE_FAMILIES, ids=[f.key for f in REMOTE_FAMILIES])
def test_the_config_is_read_as_data(remote_checkpoint, family):
    checkpoint, _ = remote_checkpoint(family)
    hf = load_hf_config(checkpoint)
    assert type(hf) is PretrainedConfig
    assert get_arch_config(hf).architecture == hf.architectures[0]
    _check_no_code_ran(checkpoint)


def test_the_checkpoints_code_would_run_if_trusted(tmp_path):
    """The control: transformers, trusting remote code, imports the checkpoint's .py files,
    which leave the marker _check_no_code_ran looks for."""
    checkpoint = tmp_path / "checkpoint"
    REMOTE_FAMILIES_BY_KEY["baichuan-13b"].build(checkpoint, tmp_path / "oracle")
    trusting = (
        "import sys\n"
        "from transformers import AutoConfig\n"
        "AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    cmd = [sys.executable, "-c", trusting, str(checkpoint)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert "remote code must never run" in done.stderr
    assert (checkpoint / REMOTE_CODE_MARKER).exists()


def test_qwen_serves_seq_length_exactly(remote_checkpoint):
    """Qwen's dynamic NTK and logn scaling start past seq_length: longer is refused."""
    checkpoint, _ = remote_checkpoint(REMOTE_FAMILIES_BY_KEY["qwen"])
    arch = get_arch_config(load_hf_config(checkpoint))
    assert model_max_len(arch) == QWEN_SEQ_LENGTH
    assert fit_max_model_len(None, model_max_len(arch), 10**6) == QWEN_SEQ_LENGTH
    with pytest.raises(ValueError, match="longer than this model supports"):
        fit_max_model_len(QWEN_SEQ_LENGTH + 1, model_max_len(arch), 10**6)


# The released configs' deciding fields, as they ship (sizes trimmed).
BAICHUAN_CONFIGS = {
    "Baichuan-13B": ({"vocab_size": 64000, "model_max_length": 4096}, True, False),
    "Baichuan2-7B": (
        {
            "vocab_size": 125696,
            "max_position_embeddings": 4096,
            "model_max_length": 4096,
            "z_loss_weight": 0,
        },
        False,
        True,
    ),
    "Baichuan2-13B": (
        {"vocab_size": 125696, "model_max_length": 4096, "z_loss_weight": 0},
        True,
        True,
    ),
}


@pytest.mark.parametrize("name", BAICHUAN_CONFIGS)
def test_baichuan_variants_are_told_apart_by_their_configs(name):
    fields, alibi, baichuan2 = BAICHUAN_CONFIGS[name]
    hf = PretrainedConfig(architectures=["BaichuanForCausalLM"], **fields)
    assert (uses_alibi(hf), is_baichuan2(hf)) == (alibi, baichuan2)


def test_an_unknown_remote_format_is_refused_by_name(tmp_path):
    config = {
        "model_type": "mystery",
        "architectures": ["MysteryForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_mystery.Config"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"MysteryForCausalLM.*Supported architectures: .*QWenLMHeadModel"
    ):
        load_hf_config(tmp_path)
