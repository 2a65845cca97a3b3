"""The reasoning-gym environment: rows any task can be graded from, graded by the library itself.

Its episode runs through the real proxy and SmolLM2 in ``tests/real_model/test_smollm2.py``."""

from __future__ import annotations

import json

import pytest
import reasoning_gym

from envs import reasoning_gym as env

CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def test_rows_carry_the_task_its_config_and_the_entry_to_grade():
    rows = env.rows("chain_sum", CONFIG, count=5, seed=3)
    library = reasoning_gym.create_dataset("chain_sum", size=5, seed=3, **CONFIG)
    for row, entry in zip(rows, library):
        assert row["input"] == entry["question"] and row["label"] == entry["answer"]
        assert row["metadata"]["task"] == "chain_sum" and row["metadata"]["config"] == CONFIG
        assert json.loads(json.dumps(row))["metadata"]["entry"]["answer"] == entry["answer"]
    assert env.rows("leg_counting", {}, count=1, seed=0)[0]["metadata"]["config"] == {}


def test_the_library_grades_right_wrong_and_partial_answers():
    (row,) = env.rows("chain_sum", CONFIG, count=1, seed=11)
    answer, meta = row["label"], row["metadata"]
    wrong = str(int(answer) + 1)
    assert env.score(answer, meta) == 1.0 and env.score(f" <answer>{answer}</answer> ", meta) == 1.0
    assert env.score(wrong, meta) == 0.0 and env.score(f"The answer is <answer>{wrong}</answer>", meta) == 0.0
    assert env.score("", meta) == 0.0
    # A plain reply that contains the answer gets the answer's share of its characters (the library's rule).
    reply = f"It is {answer}."
    assert env.score(reply, meta) == pytest.approx(len(answer) / len(reply))
    # Another task, with a grader of its own: the metadata alone says how to grade.
    (legs,) = env.rows("leg_counting", {}, count=1, seed=0)
    assert env.score(legs["label"], legs["metadata"]) == 1.0 and env.score("0.5", legs["metadata"]) == 0.0


def test_bad_task_names_and_configs_get_clear_errors(tmp_path, capsys):
    with pytest.raises(env.TaskError, match=r"unknown reasoning-gym task 'chain_summ'; did you mean \['chain_sum'"):
        env.rows("chain_summ", {}, 1, 0)
    with pytest.raises(env.TaskError, match="refuses config .*unexpected keyword argument 'digits'"):
        env.rows("chain_sum", {"digits": 3}, 1, 0)
    with pytest.raises(env.TaskError, match="refuses config .*max_terms must be >= min_terms"):
        env.rows("chain_sum", {"min_terms": 5, "max_terms": 2}, 1, 0)
    with pytest.raises(SystemExit):
        env.main(["--task", "chain_sum", "--config", "[1]", "--out", str(tmp_path / "x.jsonl")])
    assert "argument --config: must be a JSON object" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


def test_the_command_writes_a_held_out_set_that_repeats_no_training_question(tmp_path):
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    env.main(["--task", "chain_sum", "--config", json.dumps(CONFIG), "--out", str(train), "--count", "200"])
    # reasoning-gym seeds entry i with seed + i: seed 1 repeats rows 1-50 of seed 0, and all are dropped.
    env.main(
        [
            "--task",
            "chain_sum",
            "--config",
            json.dumps(CONFIG),
            "--out",
            str(held_out),
            "--count",
            "50",
            "--seed",
            "1",
            "--exclude",
            str(train),
        ]
    )
    assert held_out.read_text() == ""
    env.main(
        [
            "--task",
            "chain_sum",
            "--config",
            json.dumps(CONFIG),
            "--out",
            str(held_out),
            "--count",
            "50",
            "--seed",
            "1000000",
            "--exclude",
            str(train),
        ]
    )
    seen = {json.loads(line)["input"] for line in train.read_text().splitlines()}
    kept = [json.loads(line)["input"] for line in held_out.read_text().splitlines()]
    assert len(kept) > 25 and not set(kept) & seen
