"""``inverted export-hf --checkpoint CKPT --out DIR``: a training checkpoint as a Hugging Face model.

Reads the shards of the checkpoint's latest iteration straight from disk (no processes, no GPU):
per pipeline stage, its tensor-parallel shards are merged with the name table of ``convert.py``
(a stage's local layer numbers shifted by the layers of the stages before it; with expert
parallelism each expert-parallel rank's experts shifted to their global numbers). It writes
``model.safetensors`` next to the config and tokenizer the checkpoint was trained from, so
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads the trained policy.

A LoRA checkpoint exports as a PEFT adapter directory (``adapter_config.json``,
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(base, DIR)`` loads; with
``--merge-lora`` the adapter is folded into the base weights it was trained on, as a full model
(whose output layer, if adapted, is no longer its embedding: the config unties them).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from inverted.errors import ModelError
from inverted.hf_checkpoint import ModelSpec, checkpoint_tensors
from inverted.peft_adapter import LoRAConfig, write_adapter
from inverted.train.checkpoint import HF_FILES_DIR, latest_iteration, rank_file, read_meta
from inverted.train.convert import assembled_hf, expert_offset, is_expert_param, layer_param
from inverted.train.lora import adapter_from_shards, merged

logger = logging.getLogger(__name__)


def export_hf(checkpoint: str | Path, out: str | Path, merge_lora: bool = False) -> Path:
    root = Path(checkpoint)
    directory = latest_iteration(root) or root
    meta = read_meta(directory)
    spec = ModelSpec(**{**meta["spec"], "eos_token_ids": tuple(meta["spec"]["eos_token_ids"])})
    lora = meta.get("lora")
    # Expert parallelism: data-parallel ranks 0..EP-1 form the first expert-parallel group, each
    # holding its share of the experts (numbered locally) beside the same dense weights.
    ep = meta["parallel"].get("expert", 1)
    tensors: dict[str, torch.Tensor] = {}
    layers_before = 0
    for stage in range(meta["parallel"]["pipeline"]):
        # Mapped, not read: a rank's file also holds Adam's two moments, twice the model's bytes, which
        # an export never touches (read whole, they made the job's trainer peak as it exported).
        by_ep_rank = [
            [
                torch.load(directory / rank_file(tp, stage, dp), weights_only=True, map_location="cpu", mmap=True)[
                    "model"
                ]
                for tp in range(meta["parallel"]["tensor"])
            ]
            for dp in range(ep)
        ]
        shards = by_ep_rank[0]
        names = [name for name in shards[0] if not name.endswith("_extra_state")]
        if lora:
            tensors.update(adapter_from_shards(shards, layers_before))
        else:
            for rank, rank_shards in enumerate(by_ep_rank):  # the dense weights once, from the first
                wanted = [name for name in names if rank == 0 or is_expert_param(name)]
                tensors.update(
                    assembled_hf(
                        spec,
                        wanted,
                        lambda name, row, of=rank_shards: [shard[name] for shard in of],
                        layers_before,
                        expert_offset(spec, rank, ep),
                    )
                )
        layers_before += len({layer[0] for layer in map(layer_param, names) if layer is not None})
    if layers_before != spec.num_layers:
        raise ModelError(f"{directory}: its stages hold {layers_before} layers, the model has {spec.num_layers}")
    out = Path(out)
    if lora and not merge_lora:
        write_adapter(out, LoRAConfig.from_peft(lora), tensors, lora["base_model_name_or_path"])
        logger.info("exported the LoRA adapter of %s (%d tensors) to %s", directory, len(tensors), out)
        return out
    if lora:
        tensors = merged(checkpoint_tensors(lora["base_model_name_or_path"]), LoRAConfig.from_peft(lora), tensors)
    elif merge_lora:
        raise ModelError(f"--merge-lora: {directory} was not trained with LoRA")
    out.mkdir(parents=True, exist_ok=True)
    for item in (root / HF_FILES_DIR).iterdir():
        shutil.copy(item, out / item.name)
    if spec.tie_word_embeddings and "lm_head.weight" in tensors:  # an adapted output layer, merged
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("exported %s (%d tensors) to %s", directory, len(tensors), out)
    return out
