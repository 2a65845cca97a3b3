"""Any reasoning-gym task as an environment, graded by the library's own ``score_answer``.

reasoning-gym (``pip install reasoning-gym``) generates ~100 procedural reasoning tasks locally,
each with its grader and difficulty knobs. ``rows`` writes a task's entries as prompts: ``input``
is the library's question, ``label`` its answer, and ``metadata`` carries ``task`` (the dataset
name), ``config`` (the knobs it was made with, ``{}`` for the defaults) and ``entry`` (what the
grader reads), so any row can be graded later without the file it came from.

The answer is taken as reasoning-gym documents it: the text of the last ``<answer>...</answer>``
(``reasoning_gym.utils.extract_answer``). A reply without those tags is graded whole, so a model
that answers plainly is graded too: the graders give 1.0 for exactly the right answer and, for
a reply that merely contains it, the right answer's share of the reply's characters. A wrong
answer scores 0 however it is written, and so does a reply the token limit cut off: the model
never finished it (and, measured, a policy allowed to be graded on cut-off replies learns to fill
them with digits that happen to contain the answer).

    python -m envs.reasoning_gym --task chain_sum --config '{"max_terms": 2}' --out FILE --count N --seed S \
        [--exclude TRAIN_FILE]
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
from pathlib import Path
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer

from envs.datasets import json_object, write_rows

# Replaces the chat template's default system prompt and asks for what the grader scores; of five
# phrasings measured on SmolLM2-135M, the one whose replies most often finish within a few tokens.
SYSTEM_PROMPT = "You are a calculator. Output only the result."


class TaskError(ValueError):
    """An unknown reasoning-gym task, or a config its dataset refuses."""


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str, size: int = 1, seed: int = 0):
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        raise TaskError(
            f"unknown reasoning-gym task {task!r}"
            + (f"; did you mean {close}?" if close else f"; {len(DATASETS)} tasks exist, e.g. {sorted(DATASETS)[:5]}")
        )
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(config_json))
    except (TypeError, AssertionError, ValueError) as exc:  # unknown knob, or the config's own validate()
        raise TaskError(
            f"reasoning-gym task {task!r} refuses config {config_json}: {exc or type(exc).__name__}"
        ) from None


def dataset(task: str, config: dict[str, Any] | None = None, size: int = 1, seed: int = 0):
    """reasoning-gym's dataset for ``task`` with ``config``; a bad name or config raises ``TaskError``."""
    return _dataset(task, json.dumps(config or {}, sort_keys=True), size, seed)


def rows(task: str, config: dict[str, Any], count: int, seed: int) -> list[dict[str, Any]]:
    entries = dataset(task, config, size=count, seed=seed)
    return [
        {
            "input": e["question"],
            "label": e["answer"],
            "metadata": {
                "task": task,
                "config": config,
                "entry": {"question": e["question"], "answer": e["answer"], "metadata": e["metadata"]},
            },
        }
        for e in entries
    ]


def score(reply: str, metadata: dict[str, Any]) -> float:
    """The library's grade of ``reply`` for the row whose ``metadata`` is given."""
    answer = extract_answer(reply)
    graded = dataset(metadata["task"], metadata.get("config") or {})
    return float(graded.score_answer(reply.strip() if answer is None else answer, metadata["entry"]))


async def episode(task, client) -> float:
    reply = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}],
    )
    choice = reply.choices[0]
    if choice.finish_reason == "length":  # cut off by the token limit: the model never gave its answer
        return 0.0
    return score(choice.message.content or "", task.metadata)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--task", required=True, help="reasoning-gym dataset name, e.g. chain_sum")
    parser.add_argument("--config", type=json_object, default={}, help="the dataset's knobs as a JSON object")
    parser.add_argument("--out", required=True, help="jsonl file to write")
    parser.add_argument("--count", type=int, default=256, help="prompts to write")
    parser.add_argument("--seed", type=int, default=0, help="seed (the same seed writes the same file)")
    parser.add_argument(
        "--exclude",
        default=None,
        help="a jsonl file whose questions this one must not repeat "
        "(a held-out evaluation set beside its training set)",
    )
    parser.add_argument("--unique", action="store_true", help="write each question once")
    args = parser.parse_args(argv)
    try:
        written = rows(args.task, args.config, args.count, args.seed)
        if args.exclude:
            seen = {json.loads(line)["input"] for line in Path(args.exclude).read_text().splitlines() if line}
            written = [row for row in written if row["input"] not in seen]
        if args.unique:
            written = list({row["input"]: row for row in reversed(written)}.values())[::-1]
    except TaskError as exc:
        parser.error(str(exc))
    print(write_rows(written, args.out))


if __name__ == "__main__":
    main()
