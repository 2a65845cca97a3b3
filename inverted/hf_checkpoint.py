"""What a Hugging Face checkpoint directory holds: its decoder's shape and numerics, and its tensors.

``ModelSpec`` reads ``config.json`` (and ``generation_config.json`` for end-of-sequence ids) for the
families we serve and train: Qwen2, Qwen3 and Llama, and the sparse Qwen3-MoE and Qwen2-MoE (whose MLPs
are ``num_experts`` experts, ``moe_top_k`` per token, plus a gated shared expert in Qwen2-MoE).
``rope_inv_freq`` turns its RoPE settings into inverse frequencies exactly as ``transformers`` does, and
``rope_angles`` lays them out for any positions (the engine's tables, the trainer's packed rows);
``checkpoint_tensors`` reads the safetensors files; ``context_length`` is the one rule of how long a
request may be, which the servers and the proxy share, and ``longest_prompt`` and ``room_after`` what
SGLang serves of it; ``load_tokenizer`` gives its tokenizer, with the
chat template of ``--chat-template`` in place of its own where one is given (SGLang's flag), so the
proxy, the rollouts and slime's plug-ins render chats one way. The embedded engine and the trainer both
build their models from these, so an architecture is understood in one place. It imports only
``errors``, and torch only where a function makes tensors: the processes that only read a
``config.json`` (the driver, each server's Ray actor) do not load it (about 150 MB of private memory a
process: ``devices``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inverted.errors import ModelError

if TYPE_CHECKING:
    import torch

ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape and numerics of a decoder, read from a Hugging Face ``config.json``."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: dict
    eos_token_ids: tuple[int, ...]
    # Mixture-of-Experts (0 experts: a dense model). Every layer is sparse; the router's softmax
    # picks ``moe_top_k`` experts, renormalised to sum to 1 when ``norm_topk_prob``.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, scaled by a sigmoid gate

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"{path}/config.json: cannot read: {exc}") from None
        arch = ARCHITECTURES.get((cfg.get("architectures") or [""])[0]) or cfg.get("model_type")
        if arch not in ARCHITECTURES.values():
            raise ModelError(
                f"{path}: unsupported architecture {cfg.get('architectures')}; expected one of {list(ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        moe = _moe_fields(path, arch, cfg)
        # transformers>=5 writes rope_parameters; 4.x and most published checkpoints write rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            qkv_bias=arch == "qwen2"
            or bool(cfg.get("qkv_bias" if arch == "qwen2_moe" else "attention_bias", arch == "qwen2_moe")),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope=rope,
            eos_token_ids=_eos_ids(path, cfg),
            **moe,
        )


def _moe_fields(path: Path, arch: str, cfg: dict) -> dict:
    """The sparse MLP's shape; a model that mixes dense and sparse layers is refused, not served wrong."""
    if not arch.endswith("_moe"):
        return {}
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ModelError(
            f"{path}: mixes dense and sparse layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
            f"decoder_sparse_step={cfg.get('decoder_sparse_step')}); only all-sparse MoE models are supported"
        )
    # Published checkpoints write num_experts; transformers 5 saves it as num_local_experts.
    return {
        "num_experts": cfg.get("num_experts") or cfg["num_local_experts"],
        "moe_top_k": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0,
    }


def _eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: list[int] = []
    sources = [cfg]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return tuple(ids)


def rope_angles(spec: ModelSpec, positions: torch.Tensor) -> torch.Tensor:
    """RoPE's angle of every position and channel, ``[len(positions), head_dim]`` in fp32, as ``transformers``
    lays them out (the frequencies twice over: halves are rotated, not interleaved pairs)."""
    import torch

    freqs = torch.outer(positions.to(torch.float32), rope_inv_freq(spec).to(positions.device))
    return torch.cat((freqs, freqs), dim=-1)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies, with the ``linear`` and ``llama3`` scalings Hugging Face defines."""
    import torch

    rope = spec.rope
    dim = spec.head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


# config.json keys that state a model's context, in the order SGLang's model config reads them
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def context_length(path: str | Path, requested: int = 0) -> int:
    """The longest prompt + completion a request may have, decided once for the rollout servers and
    the proxy: ``requested`` (``--context-length``), else the model's own, as SGLang's default is
    (``max_position_embeddings``, or the checkpoint's other statement of it). How much of it the KV
    cache holds at once is each server's own concern (the embedded engine's ``--max-total-tokens``)."""
    if requested:
        return requested
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {Path(path) / 'config.json'}: {exc}") from None
    stated = next((config[key] for key in CONTEXT_KEYS if isinstance(config.get(key), int) and config[key] > 0), None)
    if stated is None:
        raise ModelError(
            f"{Path(path) / 'config.json'} states no context length ({', '.join(CONTEXT_KEYS)}): set --context-length"
        )
    return stated


# SGLang's scheduler (managers/tp_worker.py) serves a request of at most context - 1 tokens (max_req_len),
# refuses a prompt of max_req_len - 5 tokens or more, and cuts max_new_tokens to max_req_len - prompt - 1.
def longest_prompt(context: int) -> int:
    """The longest prompt a server of this context serves (SGLang's rule, which the embedded engine keeps)."""
    return context - 7


def room_after(prompt_tokens: int, context: int) -> int:
    """The most tokens a server of this context samples after a prompt of this length (SGLang's rule)."""
    return context - 2 - prompt_tokens


def checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor in a checkpoint directory's ``*.safetensors`` files, by Hugging Face name."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors files")
    for file in files:  # a FIFO or a device would block its reader until someone writes it: never opened
        if not file.is_file():
            raise ModelError(f"{file}: not a regular file")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError for bad files
        raise ModelError(f"{path}: cannot read safetensors: {exc}") from None
    return tensors


def load_tokenizer(path: str | Path, chat_template: str | Path | None = None) -> Any:
    """The checkpoint's tokenizer; ``chat_template`` (a Jinja file) replaces the template it ships.

    A model whose own template cannot render tools (SmolLM2's) is served with one that can this way,
    without editing the checkpoint.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template:
        try:
            tokenizer.chat_template = Path(chat_template).read_text()
        except OSError as exc:
            raise ModelError(f"--chat-template {chat_template}: cannot read it ({exc.strerror})") from None
    return tokenizer
