"""What the service samples, kept as a job keeps it: one run directory per model, for ``inverted view``.

A model's directory (``OUTPUT_DIR/tinker/models/MODEL``) holds what a job's output directory
holds for the viewer:

- ``buffer.db`` (``buffer.store``): each sample request a group, consumed at once (its batch is the
  sampler weights it drew from), each sequence a Sample with its prompt and response ids, the
  server's log-prob of each sampled token and the weight version it came from (the model's save
  number, ``save_weights_for_sampler`` 1, 2, ...);
- ``metrics.jsonl`` (and TensorBoard events): one row per optimizer step, written by the service;
- ``config.yaml``: the served checkpoint, where the viewer finds the tokenizer.

The base model's samples go to ``OUTPUT_DIR/tinker/models/base`` (version 0). Rewards stay unknown:
the caller scores its samples and never says so. Writes run on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import yaml

from inverted.buffer.datasets import PromptRecord
from inverted.buffer.store import SQLiteStore
from inverted.types import Sample

BASE = "base"  # the run directory of the base model's samples


class SampleRecord:
    """Every model's ``buffer.db``, opened on first use, with the ``config.yaml`` the viewer reads."""

    def __init__(self, root: Path, hf_checkpoint: str) -> None:
        self.root, self.hf_checkpoint = root, hf_checkpoint
        self._stores: dict[str, SQLiteStore] = {}
        self._lock = threading.Lock()  # one store per file, whichever worker thread opens it first

    def run_dir(self, model_id: str) -> Path:
        return self.root / model_id.replace(":", "_")

    def _store(self, model_id: str) -> SQLiteStore:
        with self._lock:
            return self._stores.get(model_id) or self._open(model_id)

    def _open(self, model_id: str) -> SQLiteStore:
        run_dir = self.run_dir(model_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run_dir / "config.yaml"
        if not config.exists():
            config.write_text(yaml.safe_dump({"train": {"hf_checkpoint": self.hf_checkpoint}}))
        store = self._stores[model_id] = SQLiteStore(str(run_dir / "buffer.db"), n_samples_per_prompt=1)
        return store

    async def add(
        self,
        model_id: str,
        version: int,
        prompt: list[int],
        sequences: list[tuple[list[int], list[float], bool]],
        sampler: str,
    ) -> int:
        """One sample request's sequences (ids, log-probs, stopped) drawn from ``model_id``'s ``version``."""
        samples = [
            Sample(
                prompt="",
                tokens=prompt + list(ids),
                response_length=len(ids),
                loss_mask=[1] * len(ids),
                rollout_log_probs=[float(lp) for lp in logprobs],
                weight_versions=[str(version)] * len(ids),
                status=Sample.Status.COMPLETED if stopped else Sample.Status.TRUNCATED,
                metadata={"sampler": sampler},
            )
            for ids, logprobs, stopped in sequences
        ]
        record = PromptRecord(prompt="", metadata={"prompt_tokens": len(prompt)})
        return await asyncio.to_thread(lambda: self._store(model_id).record(record, samples, f"{model_id}:{version}"))

    def close(self, model_id: str | None = None) -> None:
        """Close ``model_id``'s file (an unloaded model samples no more), or every file. A sample still in
        flight opens it again."""
        with self._lock:
            for name in [model_id] if model_id is not None else list(self._stores):
                store = self._stores.pop(name, None)
                if store is not None:
                    store.close()
