"""``inverted make-tiny-model``: random-initialized checkpoints in Hugging Face format, made locally.

Tests and demos must never download weights. This module writes what a real checkpoint directory
holds: ``config.json``, ``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` and a Jinja chat template (ChatML with Qwen/Hermes ``<tool_call>``
tools). ``transformers`` loads the result with ``from_pretrained``.

Everything is a pure function of (arch, preset, seed): the tokenizer is a byte-level BPE trained
on a corpus built here, and weights are drawn from one seeded generator in sorted-name order, so
the same seed gives byte-identical files. Norm weights and biases are drawn around their usual
values rather than left at 1 and 0, so that a forward pass that forgets a norm or a bias
disagrees with ``transformers``. ``qwen3_moe`` and ``qwen2_moe`` are sparse (every layer: 8 experts,
2 per token; Qwen2-MoE adds a gated shared expert), saved in Hugging Face's per-expert names.
"""

from __future__ import annotations

import itertools
import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from inverted.config import TinyModelConfig

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Single tokens so the proxy can find tool calls in sampled ids; not "special", so decoding keeps them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOKENIZER_VOCAB = 2048

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=160,
        max_position_embeddings=4096,
    ),
    "small": dict(
        hidden_size=384,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=1024,
        max_position_embeddings=4096,
    ),
    # ~0.5B: Qwen2.5-0.5B's depth with a wider body (our vocabulary is small), for GPU benchmarks.
    "base": dict(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=2,
        intermediate_size=5504,
        max_position_embeddings=4096,
    ),
    # ~1.3B: Qwen2-1.5B's body (its vocabulary would add the rest), for GPU weight-sync benchmarks.
    "large": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        max_position_embeddings=4096,
    ),
}

_WORDS = (
    "the a an and or not of to in on at for with by from is are was be it this that you I we they he "
    "she what which who how why when where answer question number sum product difference total "
    "plus minus times divided equals result step first then next finally so therefore because if "
    "else true false yes no hello world assistant user system tool call function name arguments "
    "content role message file read write list directory path search query value key count "
    "calculator expression compute add subtract multiply divide target use each once reach "
    "countdown solve puzzle think reason check correct wrong please thank help can will would should "
    "one two three four five six seven eight nine ten hundred thousand quick brown fox jumps over lazy dog"
).split()


def _training_corpus() -> list[str]:
    """A deterministic corpus: words, arithmetic, JSON tool calls and chat-template glue."""
    lines = [" ".join(_WORDS[i : i + 12]) for i in range(0, len(_WORDS), 5)]
    lines += [w.capitalize() + "." for w in _WORDS]
    for a, b in itertools.product(range(0, 120, 3), range(0, 60, 7)):
        lines.append(f"What is {a} + {b}? The answer is {a + b}. {a} * {b} = {a * b}, {a} - {b} = {a - b}.")
    for name, arg in itertools.product(
        ["calculator", "read_file", "list_dir", "search"], ["1 + 2", "notes.txt", "/tmp"]
    ):
        lines.append(f'<tool_call>\n{{"name": "{name}", "arguments": {{"input": "{arg}"}}}}\n</tool_call>')
        lines.append(f"<tool_response>\n{arg}\n</tool_response>")
    lines += ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"] * 20
    lines += ['<answer>42</answer> \\boxed{7} {"type": "function"} [1, 2, 3] (x) #Tools'] * 10
    return lines


def build_tokenizer(chat_template: str, max_length: int = PRESETS["tiny"]["max_position_embeddings"]):
    """A byte-level BPE fast tokenizer with ChatML special tokens and the given chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(_training_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=chat_template,
        model_max_length=max_length,
    )
    tokenizer.add_tokens(TOOL_TOKENS)
    return tokenizer


def _hf_config(arch: str, preset: str, vocab_size: int, eos_id: int, pad_id: int, max_positions: int = 0):
    import transformers

    shape: dict[str, Any] = dict(PRESETS[preset])
    if max_positions:
        shape["max_position_embeddings"] = max_positions
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        torch_dtype="float32",
        **shape,
    )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common
        )
    if arch == "qwen3":
        head_dim = 2 * shape["hidden_size"] // shape["num_attention_heads"]  # Qwen3 decouples head_dim from hidden
        return transformers.Qwen3Config(
            tie_word_embeddings=True,
            head_dim=head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            **common,
        )
    if arch == "qwen3_moe":  # every layer sparse: 8 experts, 2 per token, each half the dense MLP
        head_dim = 2 * shape["hidden_size"] // shape["num_attention_heads"]
        return transformers.Qwen3MoeConfig(
            tie_word_embeddings=True,
            head_dim=head_dim,  # type: ignore[call-arg]  # not in its signature; PretrainedConfig keeps it
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=shape["intermediate_size"] // 2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    if arch == "qwen2_moe":  # Qwen1.5-MoE's layout: top-k weights left unnormalised, a shared expert beside them
        return transformers.Qwen2MoeConfig(
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            qkv_bias=True,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=shape["intermediate_size"] // 2,
            shared_expert_intermediate_size=shape["intermediate_size"],
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    rope = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    return transformers.LlamaConfig(
        tie_word_embeddings=False, rope_parameters=rope, mlp_bias=False, attention_bias=False, **common
    )


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter from one seeded generator, in sorted-name order (deterministic)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                # Wider than the usual 0.02 so that the random model's distributions are peaked:
                # greedy decoding then has clear argmaxes, which makes token-for-token tests meaningful.
                param.copy_(noise / param.shape[-1] ** 0.5)


def make_tiny_model(config: TinyModelConfig) -> Path:
    """Write the checkpoint to ``config.out`` and return its path."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    template = resources.files("inverted").joinpath("chat_template.jinja").read_text()
    hf_positions = config.max_positions or PRESETS[config.preset]["max_position_embeddings"]
    tokenizer = build_tokenizer(template, hf_positions)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab_size = -(-len(tokenizer) // 128) * 128  # padded like real checkpoints; TP-divisible

    hf_config = _hf_config(config.arch, config.preset, vocab_size, eos_id, pad_id, config.max_positions)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    _init_weights(model, config.seed)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=True, temperature=1.0, top_p=1.0
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    logger.info(
        "wrote %s %s model (%.2fM params, vocab %d) to %s", config.preset, config.arch, params / 1e6, vocab_size, out
    )
    (out / "inverted_tiny_model.json").write_text(
        json.dumps({"arch": config.arch, "preset": config.preset, "seed": config.seed, "params": params}, indent=2)
        + "\n"
    )
    return out


def perturb_routers(checkpoint: Path, out: Path, scale: float, seed: int = 0) -> Path:
    """A copy of a MoE ``checkpoint`` whose routers (``mlp.gate.weight``) carry Gaussian noise of
    ``scale`` x their spread: a server of it routes some tokens to other experts than the original
    does, the rest of the model unchanged (routing replay's tests and ``bench/routing_replay.py``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    weights = load_file(out / "model.safetensors")
    noise = torch.Generator().manual_seed(seed)
    for name, tensor in weights.items():
        if name.endswith("mlp.gate.weight"):
            weights[name] = tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=noise)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
