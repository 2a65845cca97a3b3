"""What a PEFT LoRA adapter is: its config, its tensor names, and the directory that holds it.

A LoRA adapter adds ``scaling * B @ A`` to a linear layer's weight ``W [out, in]``, with
``A [r, in]`` and ``B [out, r]``. PEFT stores one per adapted module of a Hugging Face model as
``base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight`` (and ``lora_B``), beside an
``adapter_config.json`` that says the rank ``r``, ``lora_alpha`` and the target modules;
``scaling`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

The trainer writes adapters in this form (export, disk weight sync), the embedded engine reads
them (``/load_lora_adapter``, ``/load_lora_adapter_from_tensors``), and ``peft`` itself loads
them, so the format is defined once, here. Only what our decoders have is accepted: the seven
projections of a layer and the output layer (``lm_head``, the unembedding: PEFT's
``base_model.model.lm_head.lora_A.weight``), no biases, no DoRA, no per-module ranks. As in PEFT,
``all`` (``all-linear``) is the projections: the output layer is adapted when named. It imports ``errors`` and
``hf_checkpoint`` (the shapes of the model an adapter adapts).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from inverted.errors import ConfigError, ModelError
from inverted.hf_checkpoint import ModelSpec
from inverted.weight_wire import non_finite

# module -> the block it sits in; in a decoder layer's order
MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
HEAD = "lm_head"  # the output layer; outside the layers, so its tensors name no layer (``layer`` None)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
# PEFT saves the output layer's own weight beside an adapter of it (``save_embedding_layers``, in case
# the vocabulary was resized): the base model's, which an adapter of ours never changes, so it is
# checked for shape and otherwise left out.
HEAD_BASE = "base_model.model.lm_head.base_layer.weight"
_HEAD_NAME = re.compile(r"^base_model\.model\.lm_head\.lora_([AB])(?:\.\w+)?\.weight$")
TARGETS = (*MODULES, HEAD)


def target_modules(names: list[str] | str) -> tuple[str, ...]:
    """The modules a ``target_modules`` value names, as PEFT reads it: names match a module by their
    last part (``model.layers.0.mlp.down_proj`` is ``down_proj``), one string is a regex over full
    module names, and ``all`` (or ``all-linear``) is every projection (with ``lm_head`` only if named too)."""
    if isinstance(names, str) and names not in TARGETS and names not in ("all", "all-linear"):
        full = {**{m: f"model.layers.0.{block}.{m}" for m, block in MODULES.items()}, HEAD: HEAD}
        found = tuple(m for m, path in full.items() if re.fullmatch(names, path))
        if not found:
            raise ModelError(f"target_modules {names!r} matches none of {list(TARGETS)}")
        return found
    names = [names] if isinstance(names, str) else [str(n).rsplit(".", 1)[-1] for n in names]
    if any(n in ("all", "all-linear") for n in names):
        names = [*MODULES, *names]
    unknown = sorted(set(names) - set(TARGETS) - {"all", "all-linear"})
    if unknown or not names:
        raise ModelError(
            f"target modules {unknown or names} are not LoRA targets of this model; "
            f"choose from {list(TARGETS)} or 'all'"
        )
    return tuple(m for m in TARGETS if m in names)


def tensor_name(layer: int | None, module: str, which: str) -> str:
    """PEFT's name of ``lora_A`` / ``lora_B`` (``which``: "A" or "B") of one module of one layer (of the
    output layer: ``module`` ``lm_head``, no layer)."""
    if module == HEAD:
        return f"base_model.model.lm_head.lora_{which}.weight"
    return f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}.lora_{which}.weight"


def parse_name(name: str) -> tuple[int | None, str, str]:
    """``(layer, module, "A" | "B")`` of a PEFT tensor name (layer None: the output layer's);
    ``ModelError`` for anything else."""
    if head := _HEAD_NAME.match(name):
        return None, HEAD, head.group(1)
    match = _NAME.match(name)
    if match is None or match.group(3) not in MODULES or MODULES[match.group(3)] != match.group(2):
        raise ModelError(
            f"{name!r} is not a LoRA tensor of a decoder projection or of the output layer "
            "(base_model.model.model.layers.L.self_attn|mlp.MODULE.lora_A|lora_B.weight, "
            "base_model.model.lm_head.lora_A|lora_B.weight)"
        )
    return int(match.group(1)), match.group(3), match.group(4)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """The parts of a PEFT ``adapter_config.json`` that change the numbers."""

    rank: int
    alpha: float
    modules: tuple[str, ...]
    dropout: float = 0.0
    rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def from_peft(cls, config: dict) -> LoRAConfig:
        """Read a PEFT config dict; refuse what would change the numbers and is not supported."""
        if not isinstance(config, dict):
            raise ModelError("the adapter config must be a JSON object (PEFT's adapter_config.json)")
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise ModelError(f"peft_type {config.get('peft_type')!r} is not supported: only LORA")
        for key, off in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
            if config.get(key, off) not in (off, None):
                raise ModelError(f"adapter config {key}={config[key]!r} is not supported")
        for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
            if config.get(key):
                raise ModelError(f"adapter config {key} is not supported")
        rank = config.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ModelError(f"adapter config r must be a positive integer, got {rank!r}")
        alpha = config.get("lora_alpha", 8)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ModelError(f"adapter config lora_alpha must be a number, got {alpha!r}")
        return cls(
            rank=rank,
            alpha=float(alpha),
            modules=target_modules(config.get("target_modules") or []),
            dropout=float(config.get("lora_dropout") or 0.0),
            rslora=bool(config.get("use_rslora", False)),
        )

    def to_peft(self, base_model: str = "") -> dict:
        """An ``adapter_config.json`` that ``peft.PeftModel.from_pretrained`` reads."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.modules),
            "bias": "none",
            "use_rslora": self.rslora,
            "use_dora": False,
            "fan_in_fan_out": False,
            "inference_mode": True,
            "base_model_name_or_path": base_model,
        }


def lora_config(
    rank: int, alpha: float, dropout: float, modules: list[str], adapter_path: str | None
) -> LoRAConfig | None:
    """The adapter a run trains: from the flags, or from ``--lora-adapter-path``'s own config."""
    if adapter_path:
        from_file = LoRAConfig.from_peft(read_adapter(adapter_path)[0])
        if rank and rank != from_file.rank:
            raise ConfigError(
                f"--lora-rank {rank} differs from the rank {from_file.rank} of --lora-adapter-path {adapter_path}"
            )
        return from_file
    if not rank:
        return None
    return LoRAConfig(rank=rank, alpha=alpha, modules=target_modules(modules), dropout=dropout)


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config dict and tensors of a PEFT adapter directory (safetensors only: no pickles from disk)."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a PEFT adapter directory ({CONFIG_FILE}: {exc})") from None
    if not (path / WEIGHTS_FILE).is_file():
        raise ModelError(f"{path}: no {WEIGHTS_FILE}")
    return config, load_file(str(path / WEIGHTS_FILE))


def write_adapter(path: str | Path, config: LoRAConfig, tensors: dict[str, torch.Tensor], base_model: str = "") -> Path:
    """Write ``tensors`` (PEFT names, full) and their config as a PEFT adapter directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(path / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    (path / CONFIG_FILE).write_text(json.dumps(config.to_peft(base_model), indent=2) + "\n")
    return path


def check_tensors(
    config: LoRAConfig, tensors: dict[str, torch.Tensor], spec: ModelSpec
) -> dict[tuple[int | None, str], tuple[torch.Tensor, torch.Tensor]]:
    """Every ``(layer, module) -> (A, B)`` pair of an adapter (the output layer's: ``(None, "lm_head")``),
    checked against the model it adapts.

    Every tensor must be an A or B of a targeted module of an
    existing layer, with the rank of the config, and come in pairs: anything else is a ``ModelError``.
    """
    shapes, num_layers = {**module_shapes(spec), HEAD: head_shape(spec)}, spec.num_layers
    halves: dict[tuple[int | None, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name == HEAD_BASE:
            if tuple(tensor.shape) != head_shape(spec):
                raise ModelError(f"{name}: expected shape {head_shape(spec)} (a resized vocabulary is not supported)")
            continue
        layer, module, which = parse_name(name)
        if layer is not None and layer >= num_layers:
            raise ModelError(f"{name}: the model has {num_layers} layers")
        if module not in config.modules:
            raise ModelError(f"{name}: module {module} is not in the adapter's target_modules {list(config.modules)}")
        out, inp = shapes[module]
        want = (config.rank, inp) if which == "A" else (out, config.rank)
        if tuple(tensor.shape) != want:
            raise ModelError(f"{name}: expected shape {want} (rank {config.rank}), got {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise ModelError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
        halves.setdefault((layer, module), {})[which] = tensor
    if bad := non_finite(tensors):
        raise ModelError(f"LoRA tensors with NaN or inf values: {bad[:5]}{' ...' if len(bad) > 5 else ''}")
    unpaired = sorted(f"layer {k[0]} {k[1]}" if k[0] is not None else k[1] for k, v in halves.items() if len(v) != 2)
    if unpaired:
        raise ModelError(f"lora_A and lora_B must come in pairs; unpaired: {unpaired[:5]}")
    if not halves:
        raise ModelError("the adapter holds no LoRA tensors")
    return {key: (v["A"], v["B"]) for key, v in halves.items()}


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each projection of one of ``spec``'s decoder layers."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def head_shape(spec: ModelSpec) -> tuple[int, int]:
    """``(out, in)`` of the output layer: the vocabulary by the hidden size."""
    return spec.vocab_size, spec.hidden_size
