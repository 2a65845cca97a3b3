"""Writing an environment's prompt dataset: one jsonl row per prompt (``input``, ``label``, ``tools``).

Each environment defines ``rows(count, rng) -> list[dict]``; ``write_dataset`` saves them
(``write_rows`` saves rows made otherwise) and ``main`` is the
``python -m envs.NAME --out FILE.jsonl [--count N] [--seed S]`` command line. ``json_object`` is the
type of a flag that takes a JSON object (``--config``, ``--args``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Callable

Rows = Callable[[int, random.Random], list[dict[str, Any]]]


def json_object(text: str) -> dict[str, Any]:
    """An argparse ``type``: a JSON object given on the command line."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def write_rows(rows: list[dict[str, Any]], out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_dataset(rows: Rows, out: str | Path, count: int, seed: int = 0) -> Path:
    return write_rows(rows(count, random.Random(seed)), out)


def main(rows: Rows, description: str, count: int) -> None:
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    parser.add_argument("--out", required=True, help="jsonl file to write")
    parser.add_argument("--count", type=int, default=count, help="prompts to write")
    parser.add_argument("--seed", type=int, default=0, help="seed (the same seed writes the same file)")
    args = parser.parse_args()
    print(write_dataset(rows, args.out, args.count, args.seed))
