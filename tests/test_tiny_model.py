"""``make-tiny-model``: loadable by transformers, deterministic, with a real chat template."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from inverted.config import TinyModelConfig
from inverted.tiny_model import _hf_config, make_tiny_model
from tests.conftest import ARCHS, MOE_ARCHS


def digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_model_and_tokenizer(tiny_model, arch):
    path = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert {f.name for f in path.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert model.config.vocab_size >= len(tokenizer) and model.config.vocab_size % 128 == 0
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, model.config.vocab_size)
    config = AutoConfig.from_pretrained(path)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    if arch == "qwen3":
        assert config.head_dim != config.hidden_size // config.num_attention_heads
    if arch == "llama":
        assert config.rope_parameters["rope_type"] == "llama3" and not config.tie_word_embeddings


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    paths = [
        make_tiny_model(TinyModelConfig(out=str(tmp_path / f"m{i}"), arch="qwen3", seed=s))
        for i, s in enumerate((5, 5, 6))
    ]
    first, again, other = map(digest, paths)
    assert first == again
    assert first["model.safetensors"] != other["model.safetensors"]
    assert first["tokenizer.json"] == other["tokenizer.json"]


@pytest.mark.parametrize(("preset", "low", "high"), [("tiny", 1e5, 1e6), ("small", 10e6, 30e6), ("base", 0.4e9, 0.6e9)])
def test_preset_sizes(preset, low, high):
    for arch in ARCHS:
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = AutoModelForCausalLM.from_config(_hf_config(arch, preset, 1280, 2, 0))
        params = sum(p.numel() for p in model.parameters())
        assert low <= params <= high, (arch, preset, params)


def test_chat_template_renders_roles_tools_and_tool_calls(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"x": "2+3"}'}},
                {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": {"x": "1"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "1"},
        {"role": "assistant", "content": [{"type": "text", "text": "5"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert (
        '\n{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}\n</tools>' in text
    )
    assert text.endswith(
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"x": "2+3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"x": "1"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n1\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"):
        assert len(tokenizer.encode(token)) == 1, token
    # Byte-level: any text round-trips, including text the corpus never saw.
    sample = "Zürich 🚀 — ∑ x_i"
    assert tokenizer.decode(tokenizer.encode(sample)) == sample


def test_tokenizer_training_is_deterministic_across_processes():
    """Hash randomisation differs per process, so only separate processes can show an order that leaks in."""
    code = (
        "import hashlib; from inverted.tiny_model import build_tokenizer; "
        "print(hashlib.sha256(build_tokenizer('{{ x }}').backend_tokenizer.to_str().encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1 and len(digests.pop()) == 64


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_tiny_moe_has_hf_expert_names_and_routes_tokens_to_every_expert(tiny_model, arch, tmp_path):
    """A sparse checkpoint in Hugging Face's per-expert names, whose random router spreads tokens over
    all experts; ``ModelSpec`` reads its sparse shape and refuses a mix of dense and sparse layers."""
    from safetensors import safe_open

    from inverted.errors import ModelError
    from inverted.hf_checkpoint import ModelSpec

    path = tiny_model(arch)
    config = AutoConfig.from_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for layer in range(config.num_hidden_layers):
        assert f"model.layers.{layer}.mlp.gate.weight" in names
        assert {
            f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"
            for e in range(config.num_experts)
            for p in ("gate", "up", "down")
        } <= names
    model = AutoModelForCausalLM.from_pretrained(path)
    tokens = torch.randint(3, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routers = model(tokens, output_router_logits=True).router_logits
    for logits in routers:  # per layer: how many tokens each expert receives
        counts = torch.bincount(
            logits.topk(config.num_experts_per_tok, dim=-1).indices.flatten(), minlength=config.num_experts
        )
        assert (counts > 0).all() and counts.max() < counts.sum() / 2, counts
    spec = ModelSpec.from_checkpoint(path)
    assert (spec.arch, spec.num_experts, spec.moe_top_k) == (arch, 8, 2)
    assert spec.moe_intermediate_size == config.moe_intermediate_size and spec.norm_topk_prob == config.norm_topk_prob
    assert spec.shared_expert_intermediate_size == (
        config.shared_expert_intermediate_size if arch == "qwen2_moe" else 0
    )
    assert spec.qkv_bias == (arch == "qwen2_moe") and spec.qk_norm == (arch == "qwen3_moe")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.json").write_text(json.dumps({**config.to_dict(), "mlp_only_layers": [0]}))
    with pytest.raises(ModelError, match="mixes dense and sparse layers"):
        ModelSpec.from_checkpoint(mixed)
