"""``examples/arithmetic_sl_data.py`` keeps its promise against the cookbook's own arithmetic dataset:
the problems it leaves out are exactly those ``ArithmeticDataset.get_batch`` poses, at every batch size
up to its bound, and none of the conversations it writes is one of them (the RL reward stays held out)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

arithmetic_env = pytest.importorskip("tinker_cookbook.recipes.math_rl.arithmetic_env")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_sl_data.py"


def posed_by_the_recipe(batches: int, batch_size: int) -> set[tuple[int, int]]:
    """The (x, y) of every group the cookbook's dataset builds for batches 0..batches-1 (its env factories' args)."""
    dataset = arithmetic_env.ArithmeticDataset(batch_size=batch_size, renderer=None, group_size=2)
    return {tuple(b.env_thunk.args) for i in range(batches) for b in dataset.get_batch(i)}


def test_the_problems_left_out_are_the_ones_the_rl_recipe_poses(tmp_path):
    spec = importlib.util.spec_from_file_location("arithmetic_sl_data", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    left_out = script.rl_problems(8, 32)
    assert posed_by_the_recipe(8, 32) == left_out
    for batch_size in (1, 4, 16):  # a smaller batch poses a prefix of a larger one's
        assert posed_by_the_recipe(8, batch_size) <= left_out
    assert not posed_by_the_recipe(9, 32) <= left_out  # a later batch is not covered: the set is not everything

    out = tmp_path / "sl.jsonl"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--count", "8000", "--rl-batches", "64"], check=True
    )
    written = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert len(written) == 8000
    posed = posed_by_the_recipe(64, 32)
    for messages in written:
        x, y = map(int, messages[-2]["content"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert (x, y) not in posed and messages[-1]["content"] == str(x + y)
        assert messages[:2] == arithmetic_env.ArithmeticEnv.standard_fewshot_prefix()
