"""Training checkpoints: model shards, optimizer state, RNG states and counters, per rank.

Layout: ``SAVE/iter_{rollout:07d}/rank_{tp}_{pp}_{dp}.pt`` (one file per rank: each holds its own
shards and optimizer state; with Megatron's distributed optimizer, its own shard of the main
weights and moments), ``SAVE/iter_{rollout:07d}/meta.json`` (the architecture, the
parallel layout, the counters), ``SAVE/hf_config/`` (the HF config and tokenizer) and
``SAVE/latest`` (the last complete iteration, written after every rank has finished, so a crash
mid-save leaves the previous one in force). Resuming
restores everything the next step depends on, so it reproduces the uninterrupted run; it
requires the same parallel layout (``export-hf`` turns any checkpoint into HF tensors). A LoRA run
saves its adapter only (the base weights are the ``--hf-checkpoint``'s, frozen) and its PEFT
config in ``meta.json``; resuming needs the same adapter config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch

from inverted.errors import ModelError
from inverted.train.lora import is_adapter

logger = logging.getLogger(__name__)

HF_FILES_DIR = "hf_config"  # the HF config and tokenizer the run started from, for export-hf


def rank_file(tp: int, pp: int, dp: int) -> str:
    return f"rank_{tp}_{pp}_{dp}.pt"


def _rank_name() -> str:
    from megatron.core import parallel_state as ps

    return rank_file(
        ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    )


def _distributed_optimizers(trainer) -> list:
    """Megatron's distributed optimizers, whose ``state_dict()`` leaves out this rank's shard of the
    main weights and moments. (Megatron saves those through a gather whose loader expects apex's or
    TE's Adam state: with torch's AdamW, the fallback without them, it fails on ``step``.)"""
    if not trainer.distributed_optimizer:
        return []
    return list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))


def _shard_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.optimizer.param_groups for p in group["params"]]


def _shard_states(trainer) -> list[dict]:
    return [
        {"main": [p.detach().clone() for p in _shard_params(o)], "inner": o.optimizer.state_dict()}
        for o in _distributed_optimizers(trainer)
    ]


def _load_shard_states(trainer, states: list[dict]) -> None:
    with torch.no_grad():  # the main weights are leaves that require grad
        for optimizer, state in zip(_distributed_optimizers(trainer), states, strict=True):
            for param, saved in zip(_shard_params(optimizer), state["main"], strict=True):
                param.copy_(saved)
            optimizer.optimizer.load_state_dict(state["inner"])


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def latest_iteration(root: str | Path) -> Path | None:
    marker = Path(root) / "latest"
    return Path(root) / marker.read_text().strip() if marker.exists() else None


def latest_step(root: str | Path | None) -> int:
    """The step ``root``'s latest iteration resumes at (its ``iter_`` number); -1 without one."""
    directory = latest_iteration(root) if root else None
    return int(directory.name.removeprefix("iter_")) if directory is not None else -1


def save_checkpoint(trainer, root: str | Path) -> Path:
    """Write this rank's part of the checkpoint; rank 0 marks it latest once all ranks are done."""
    directory = Path(root) / f"iter_{trainer.step:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    model = trainer.model.module.state_dict()
    if trainer.lora is not None:  # the base weights are the --hf-checkpoint's, unchanged: only the adapter is saved
        model = {name: value for name, value in model.items() if is_adapter(name)}
    torch.save(
        {
            "model": model,
            "optimizer": trainer.optimizer.state_dict(),
            "optimizer_shards": _shard_states(trainer),
            "rng": _rng_state(),
        },
        directory / _rank_name(),
    )
    rank = torch.distributed.get_rank()
    if rank == 0:
        _copy_hf_files(trainer.cfg.hf_checkpoint, Path(root) / HF_FILES_DIR, trainer.cfg.chat_template)
        meta = {
            "spec": dataclasses.asdict(trainer.spec),
            "parallel": dataclasses.asdict(trainer.parallel),
            "world_size": torch.distributed.get_world_size(),
            "rollout_id": trainer.step,
            "optimizer_steps": trainer.optimizer_steps,
            "lora": trainer.lora.to_peft(str(Path(trainer.cfg.hf_checkpoint).resolve())) if trainer.lora else None,
        }
        (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    torch.distributed.barrier()
    if rank == 0:
        staged = Path(root) / "latest.tmp"
        staged.write_text(directory.name + "\n")
        staged.replace(Path(root) / "latest")  # whole: no reader, and no crash, meets it half-written
        logger.info("saved checkpoint %s", directory)
    return directory


def _copy_hf_files(source: str, target: Path, chat_template: str | None) -> None:
    """Everything of the HF checkpoint but its weights (config, generation config, tokenizer), with
    the run's ``--chat-template`` as its chat template: the policy learned that format, so the
    exported model is served with it."""
    target.mkdir(parents=True, exist_ok=True)
    for item in Path(source).iterdir():
        if (
            item.is_file()
            and not item.name.endswith((".safetensors", ".bin"))
            and item.name != "model.safetensors.index.json"
        ):
            shutil.copy(item, target / item.name)
    if chat_template:  # transformers reads chat_template.jinja before a template in tokenizer_config.json
        shutil.copy(chat_template, target / "chat_template.jinja")


def read_meta(directory: Path) -> dict:
    try:
        return json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{directory}: not a checkpoint ({exc})") from None


def resume(trainer, root: str | Path) -> Path | None:
    """``--load``: restore ``root``'s latest save into ``trainer``; or, where no save has finished there
    yet (a job killed before its first save, started again by the same command), nothing: the trainer
    stays at step 0 on ``--hf-checkpoint``, as slime's ``--load`` does, and the job trains again every
    batch its killed run was served."""
    if latest_iteration(root) is None:
        logger.warning("--load %s: no save has finished there; the trainer starts from --hf-checkpoint at step 0", root)
        return None
    return load_checkpoint(trainer, root)


def load_checkpoint(trainer, root: str | Path, *, optimizer: bool = True) -> Path:
    """Restore model, optimizer, RNG and counters from ``root``'s latest iteration into ``trainer``
    (without ``optimizer``: the weights alone, the trainer's optimizer and counters kept)."""
    directory = latest_iteration(root)
    if directory is None:
        raise ModelError(f"--load {root}: no 'latest' marker (not a checkpoint directory, or no save finished)")
    meta = read_meta(directory)
    spec = dataclasses.asdict(trainer.spec)
    differing = sorted(
        k for k in spec if k != "eos_token_ids" and json.loads(json.dumps(spec[k])) != meta["spec"].get(k)
    )
    if differing:
        raise ModelError(
            f"--load {directory}: checkpoint of another model than --hf-checkpoint: "
            + ", ".join(f"{k} {meta['spec'].get(k)!r} != {spec[k]!r}" for k in differing)
        )
    if (
        meta["parallel"] != dataclasses.asdict(trainer.parallel)
        or meta["world_size"] != torch.distributed.get_world_size()
    ):
        raise ModelError(
            f"--load {directory}: saved with parallel layout {meta['parallel']} on {meta['world_size']} "
            f"ranks; this run has {dataclasses.asdict(trainer.parallel)} on {torch.distributed.get_world_size()}"
        )
    saved, ours = meta.get("lora"), trainer.lora.to_peft() if trainer.lora else None
    if (saved and {**saved, "base_model_name_or_path": ""}) != ours:
        raise ModelError(f"--load {directory}: saved with LoRA {saved}; this run has LoRA {ours}")
    state = torch.load(directory / _rank_name(), weights_only=True)
    missing, unexpected = trainer.model.module.load_state_dict(state["model"], strict=ours is None)
    if unexpected or any(is_adapter(name) for name in missing):
        raise ModelError(f"--load {directory}: its adapter does not fit this model ({(unexpected or missing)[:3]})")
    if not optimizer:
        logger.info("loaded the weights of %s", directory)
        return directory
    trainer.optimizer.load_state_dict(state["optimizer"])
    _load_shard_states(trainer, state.get("optimizer_shards", []))
    _set_rng_state(state["rng"])
    trainer.step, trainer.optimizer_steps = meta["rollout_id"], meta["optimizer_steps"]
    logger.info("resumed from %s (step %d)", directory, trainer.step)
    return directory
