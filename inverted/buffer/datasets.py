"""Prompt datasets: rows from jsonl or parquet, and the per-epoch order in which they are served.

A row becomes a ``PromptRecord``: the prompt (plain text or a list of chat messages), its label,
metadata and tools, read through the ``--input-key``/``--label-key``/``--metadata-key``/
``--tool-key`` names (slime's flags). ``epoch_order`` is a pure function of (size, seed, epoch),
so a restarted buffer serves exactly the order it would have served.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inverted.errors import ConfigError


@dataclass(slots=True)
class PromptRecord:
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open() as handle:
        for line_no, line in enumerate(handle, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise ConfigError(f"--prompt-data {path}: line {line_no} is not JSON: {exc}") from None
    return rows


def load_prompts(
    path: str, *, input_key: str, label_key: str | None, metadata_key: str | None, tool_key: str | None
) -> list[PromptRecord]:
    """Read every row; a row without ``input_key``, or with a prompt of the wrong type, is an error."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"--prompt-data {path}: no such file")
    records = []
    for i, row in enumerate(_rows(file)):
        prompt = row.get(input_key)
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ConfigError(f"--prompt-data {path}: row {i} has no text or messages under --input-key {input_key!r}")
        if isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise ConfigError(f"--prompt-data {path}: row {i}: messages must be objects with a 'role'")
        metadata = row.get(metadata_key) if metadata_key else None
        records.append(
            PromptRecord(
                prompt=prompt,
                label=row.get(label_key) if label_key else None,
                metadata=metadata if isinstance(metadata, dict) else {},
                tools=row.get(tool_key) if tool_key else None,
            )
        )
    if not records:
        raise ConfigError(f"--prompt-data {path}: the file holds no rows")
    return records


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The dataset order of one epoch: identity, or a permutation seeded by (seed, epoch)."""
    order = list(range(size))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
