"""verifiers environments run unchanged through the real proxy and engine: the library plays and
scores each episode, and every turn it asked for is recorded token for token."""

from __future__ import annotations

import functools
import json

import pytest
import verifiers as vf
from datasets import Dataset
from transformers import AutoTokenizer

from envs import verifiers as env
from inverted.types import Sample
from tests.envs import play
from tests.job.test_train_job import ONE_ENGINE_RUN, check, inverted

REASONING_GYM = "verifiers.envs.integrations.reasoninggym_env:ReasoningGymEnv"
GYM_ARGS = {"gym": "chain_sum", "num_train_examples": 6, "num_eval_examples": 2, "seed": 3}
GYM_EPISODE = functools.partial(env.episode, env=REASONING_GYM, args=GYM_ARGS)  # what --env-args binds
FEEDBACK = "Once more, shorter."


class Retry(vf.MultiTurnEnv):
    """Two model turns: the environment answers the first with feedback."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": FEEDBACK}]


def chars(completion, **kwargs) -> float:
    return float(sum(len(m["content"] or "") for m in completion if m["role"] == "assistant"))


def turns(completion, **kwargs) -> float:
    return float(sum(m["role"] == "assistant" for m in completion))


def never(completion, **kwargs) -> float:  # a metric: weight 0
    return 7.0


def load_retry() -> vf.Environment:
    """A multi-turn environment written in the library's own API, scored by two weighted functions."""
    dataset = Dataset.from_list([{"question": f"Say {w}.", "answer": w} for w in ("hi", "yes", "no")])
    return Retry(dataset=dataset, rubric=vf.Rubric(funcs=[chars, turns, never], weights=[1.0, 0.5, 0.0]), max_turns=2)


def test_the_librarys_reasoning_gym_environment_plays_and_grades_each_row(agent_stack):
    rows = env.rows(REASONING_GYM, GYM_ARGS, count=4, seed=0)
    assert [m["role"] for m in rows[0]["input"]] == ["system", "user"]
    samples = play(agent_stack, rows, GYM_EPISODE, max_tokens=3)
    tokenizer = AutoTokenizer.from_pretrained(agent_stack[0])
    graded = env.load(REASONING_GYM, GYM_ARGS)
    for row, sample in zip(rows, samples):
        prompt = tokenizer.apply_chat_template(
            row["input"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert sample.tokens[: len(prompt)] == prompt and sample.loss_mask == [1] * sample.response_length
        assert len(sample.rollout_log_probs) == sample.response_length <= 3
        # The reward is reasoning-gym's own grade of what the model said, as the environment parses it.
        reply = tokenizer.decode(sample.tokens[len(prompt) :], skip_special_tokens=True)
        entry = graded.rg_dataset[int(row["label"])]
        answer = str(graded.parser.parse_answer([{"role": "assistant", "content": reply}])).strip()
        assert sample.reward == graded.rg_dataset.score_answer(answer=answer, entry=entry)


def test_an_empty_reply_is_the_models_action_and_is_scored_not_failed(agent_stack):
    """verifiers aborts a rollout whose reply has no content; that reply is still the policy's to learn from."""
    rows = env.rows(REASONING_GYM, GYM_ARGS, count=1, seed=0)
    greedy = {"max_tokens": 1, "top_k": 1}
    (first,) = play(agent_stack, rows, GYM_EPISODE, **greedy)
    token = first.tokens[-1:]
    # The same greedy token, stopped on at once: the reply's content is empty.
    stop = AutoTokenizer.from_pretrained(agent_stack[0]).decode(token)
    (empty,) = play(agent_stack, rows, GYM_EPISODE, **greedy, stop=[stop])
    assert empty.tokens == first.tokens and empty.loss_mask == [1] and empty.reward == 0.0


def test_a_multi_turn_environment_is_one_branch_and_its_weighted_parts_are_the_reward(agent_stack):
    rows = env.rows(f"{__name__}:load_retry", {}, count=-1, seed=0)
    # At least one token a turn: a reply that is only the end of turn has no content, and verifiers ends the
    # rollout there without counting it (the test above), which a random tiny model does now and then.
    samples = play(
        agent_stack, rows, functools.partial(env.episode, env=f"{__name__}:load_retry"), max_tokens=3, min_tokens=1
    )
    tokenizer = AutoTokenizer.from_pretrained(agent_stack[0])
    for sample in samples:
        turns_ = sample.metadata["turns"]
        assert len(turns_) == 2 and sample.metadata["branches"] == 1
        text = tokenizer.decode(sample.tokens)
        assert text.count(FEEDBACK) == 1  # the environment's feedback, not sampled: mask 0
        replies = [tokenizer.decode(sample.tokens[t["start"] : t["end"]], skip_special_tokens=True) for t in turns_]
        assert sum(sample.loss_mask) == sum(t["end"] - t["start"] for t in turns_)
        assert sample.reward == {"chars": float(sum(map(len, replies))), "turns": 1.0}  # never (weight 0) is left out


def test_environments_it_cannot_run_get_clear_errors(tmp_path, capsys):
    with pytest.raises(env.EnvError, match="cannot load the verifiers environment 'no-such-env'"):
        env.load("no-such-env")
    with pytest.raises(env.EnvError, match="gave a dict, not a verifiers Environment"):
        env.load("builtins:dict")
    with pytest.raises(SystemExit):
        env.main(["--env", REASONING_GYM, "--args", "[1]", "--out", str(tmp_path / "x.jsonl")])
    assert "argument --args: must be a JSON object" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow  # a whole job: left out of make test-fast
def test_a_debug_rollout_only_job_plays_the_environment_the_command_line_names(tiny_model, tmp_path, capsys):
    prompts, data = tmp_path / "p.jsonl", tmp_path / "rollout.jsonl"
    env.main(["--env", REASONING_GYM, "--args", json.dumps(GYM_ARGS), "--out", str(prompts), "--count", "2"])
    said = capsys.readouterr().out
    env_args = json.dumps({"env": REASONING_GYM, "args": GYM_ARGS})
    assert f"--env-path envs.verifiers:episode --env-args '{env_args}'" in said  # the command to train on it
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--env-path",
            "envs.verifiers:episode",
            "--env-args",
            env_args,
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(tmp_path / "run"),
            "--num-rollout",
            "1",
            *ONE_ENGINE_RUN,
        )
    )
    saved = [Sample.from_json(json.loads(line)) for line in data.read_text().splitlines()]
    assert len(saved) == 4 and all(s.status != Sample.Status.FAILED and s.reward in (0.0, 1.0) for s in saved)
    assert all(set(s.metadata["verifiers"]) == {"input"} for s in saved)


def test_a_row_that_names_code_runs_nothing_and_fails_its_episode_with_the_reason(agent_stack, tmp_path):
    """The audit's row: before, envs.verifiers called os.system with the row's command."""
    witness = tmp_path / "ran"
    hostile = {"input": "hi", "metadata": {"verifiers": {"env": "os:system", "args": {"command": f"touch {witness}"}}}}
    malformed = {"input": "hi", "metadata": {"verifiers": {"input": {"prompt": "not a list"}}}}
    with pytest.raises(AssertionError) as failed:
        play(agent_stack, [hostile], GYM_EPISODE, max_tokens=1)
    assert "chosen by --env-args, never by a row" in str(failed.value) and not witness.exists()
    with pytest.raises(AssertionError, match="not a verifiers RolloutInput"):
        play(agent_stack, [malformed], GYM_EPISODE, max_tokens=1)
    with pytest.raises(env.EnvError, match=r"got \['args', 'env'\]"):
        env.row_input(hostile["metadata"])
    assert not witness.exists()
