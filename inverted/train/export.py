"""``inverted export-hf --checkpoint CKPT --out DIR``: a training checkpoint as a Hugging Face model.

Reads the tensor-parallel shards of the checkpoint's latest iteration straight from disk (no
processes, no GPU), merges them with the name table of ``convert.py``, and writes
``model.safetensors`` next to the config and tokenizer the checkpoint was trained from, so
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads the trained policy.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from inverted.errors import ModelError
from inverted.hf_checkpoint import ModelSpec
from inverted.train.checkpoint import HF_FILES_DIR, latest_iteration, rank_file, read_meta
from inverted.train.convert import assembled_hf

logger = logging.getLogger(__name__)


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    root = Path(checkpoint)
    directory = latest_iteration(root) or root
    meta = read_meta(directory)
    if meta["parallel"]["pipeline"] != 1:
        raise ModelError(f"{directory}: pipeline-parallel checkpoints are not supported by export-hf yet")
    spec = ModelSpec(**{**meta["spec"], "eos_token_ids": tuple(meta["spec"]["eos_token_ids"])})
    shards = [torch.load(directory / rank_file(tp, 0, 0), weights_only=True)["model"]
              for tp in range(meta["parallel"]["tensor"])]
    names = [name for name in shards[0] if not name.endswith("_extra_state")]
    tensors = dict(assembled_hf(spec, names, lambda name, row: [shard[name] for shard in shards]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for item in (root / HF_FILES_DIR).iterdir():
        shutil.copy(item, out / item.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("exported %s (%d tensors) to %s", directory, len(tensors), out)
    return out
