"""The example environments' verifiers and tools, exactly (the episodes run in tests/job)."""

from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest

from envs import calculator, countdown, letters, long_tail
from envs.arithmetic import BadExpression, calculate, evaluate, numbers_in
from envs.datasets import write_dataset


def test_arithmetic_is_exact_and_refuses_everything_else():
    assert evaluate("(1 + 2) * 3 - 4 / 8") == Fraction(17, 2)
    assert evaluate("-3 * -3") == 9 and sorted(numbers_in("(12 - 3) * 12")) == [3, 12, 12]
    for bad in ("__import__('os').system('true')", "2 ** 10", "1.5 + 1", "x + 1", "1 / 0", "9" * 300, "1 +"):
        with pytest.raises(BadExpression):
            evaluate(bad)


def test_letters_rewards_the_first_character_of_the_reply():
    assert letters.score("  Apple pie", "abcde") == 1.0 and letters.score("egg", "abcde") == 1.0
    assert letters.score("...apple", "abcde") == 0.0 and letters.score("", "abcde") == 0.0
    assert letters.score("orange", "abcde") == 0.0 and letters.score("orange", "nopqrs") == 1.0
    rows = letters.rows(8, random.Random(0))
    assert sorted(r["label"] for r in rows) == sorted(letters.GROUPS * 4)  # each group equally often
    assert all(" ".join(r["label"]) in r["input"] for r in rows)


def test_long_tail_latencies_are_long_tailed():
    rows = long_tail.rows(1000, random.Random(0))
    latencies = [r["metadata"]["latency_s"] for r in rows]
    assert set(latencies) == {long_tail.SHORT_S, long_tail.SHORT_S * long_tail.LONG_FACTOR}
    slow = latencies.count(long_tail.SHORT_S * long_tail.LONG_FACTOR) / len(rows)
    assert 0.07 < slow < 0.13  # about one prompt in ten, twenty times slower
    assert [r["label"] for r in rows] == [r["label"] for r in letters.rows(1000, random.Random(0))]  # letters' task


def test_the_calculator_parses_and_never_evals():
    """The agent's tool (envs.calculator_agent) and the calculator env answer with ``calculate``."""
    assert calculate("12 * (3 + 4)") == "84" and calculate("-701 * 202") == "-141602" and calculate("7 / 2") == "3.5"
    for hostile in ("__import__('os').system('touch /tmp/x')", "9 ** 9 ** 9", "open('/etc/passwd').read()", "1" * 300):
        assert calculate(hostile).startswith("error: ")


def test_calculator_tool_and_answer_check():
    assert calculator.run_tool("calculator", json.dumps({"expression": "17 * 3"})) == "51"
    assert calculator.run_tool("calculator", json.dumps({"expression": "7 / 2"})) == "3.5"
    assert calculator.run_tool("calculator", "{not json").startswith("error:")
    assert calculator.run_tool("shell", "{}") == "error: unknown tool 'shell'"
    assert calculator.is_correct("The answer is -48.", -48) and not calculator.is_correct("48", -48)
    row = calculator.rows(1, random.Random(1))[0]
    assert row["tools"] == calculator.TOOLS and evaluate(row["input"][8:-1]) == row["label"]


def test_countdown_verifier():
    numbers, target = [3, 5, 7, 2], 41
    assert countdown.verify("so <answer>5 * 7 + 3 * 2</answer>", numbers, target) == {"correct": 1.0, "format": 0.1}
    assert countdown.verify("<answer>5 * 7 + 3 * 2 + 0</answer>", numbers, target)["correct"] == 0.0  # 0 not given
    assert countdown.verify("<answer>7 * 7 - 5 - 3</answer>", numbers, target)["correct"] == 0.0  # 7 used twice
    assert countdown.verify("<answer>import os</answer>", numbers, target) == {"correct": 0.0, "format": 0.0}
    assert countdown.verify("41", numbers, target) == {"correct": 0.0, "format": 0.0}


def test_datasets_are_deterministic_for_a_seed(tmp_path):
    a = write_dataset(countdown.rows, tmp_path / "a.jsonl", 5, seed=3).read_text()
    assert a == write_dataset(countdown.rows, tmp_path / "b.jsonl", 5, seed=3).read_text()
    for line in a.splitlines():  # every generated puzzle is solvable by construction
        assert json.loads(line)["label"]["target"] > 0
