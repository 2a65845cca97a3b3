"""OpenEnv environments played through the real proxy and engine: the environment's server runs
as OpenEnv serves it, each episode holds its own environment session, and replaying the recorded
replies against the environment gives back the recorded feedback and the reward."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import tempfile
from pathlib import Path

import pytest
from openenv.core.env_server import create_app
from transformers import AutoTokenizer

from envs import guess_number, openenv
from inverted.types import Sample
from tests.envs import play
from tests.job.test_train_job import ONE_ENGINE_RUN, check, inverted

APP = "envs.guess_number:app"
observe = guess_number.observe  # this module is also a driver: every reply is a guess
# The game as OpenEnv's own servers are by default: one session at a time.
ONE_SESSION = create_app(
    guess_number.GuessNumberEnvironment,
    guess_number.GuessAction,
    guess_number.GuessObservation,
    env_name="guess_number",
    max_concurrent_envs=1,
)


def episode(**env_args):
    """The episode as ``--env-args`` binds it."""
    return functools.partial(openenv.episode, **{"driver": __name__, "app": APP, "max_sessions": 8, **env_args})


def act(reply: str) -> dict:
    return {"guess": len(reply) % guess_number.HIGH + 1}


def replay(sample: Sample, seed: int, tokenizer, driver_act=act) -> tuple[list[str], float, bool]:
    """The feedback and reward the environment gives the recorded replies, played again in-process,
    and whether the last reply was no action."""
    game = guess_number.GuessNumberEnvironment()
    observation, said, total = game.reset(seed=seed), [], 0.0
    for turn in sample.metadata["turns"]:
        said.append(observe(observation.model_dump()))
        reply = tokenizer.decode(sample.tokens[turn["start"] : turn["end"]], skip_special_tokens=True)
        try:
            action = driver_act(reply)
        except ValueError:
            assert turn is sample.metadata["turns"][-1]  # no action ends the episode
            return said, total, True
        observation = game.step(guess_number.GuessAction(**action))
        total += observation.reward
    return said, total, False


def test_episodes_are_played_on_the_environment_server_and_recorded_as_one_branch(agent_stack):
    rows = openenv.rows(count=6, seed=40)
    samples = play(agent_stack, rows, episode(max_turns=guess_number.GUESSES), max_tokens=4)
    tokenizer = AutoTokenizer.from_pretrained(agent_stack[0])
    played = []
    for row, sample in zip(rows, samples):
        said, reward, _ = replay(sample, row["metadata"]["openenv"]["reset"]["seed"], tokenizer)
        assert sample.reward == reward and sample.metadata["branches"] == 1
        text = tokenizer.decode(sample.tokens)
        assert all(message in text for message in said)  # the environment's feedback, as the policy saw it
        assert sum(sample.loss_mask) == sum(t["end"] - t["start"] for t in sample.metadata["turns"])
        played.append(len(said))
    assert max(played) > 1  # multi-turn: some episodes needed several guesses
    # The same server again, by URL this time: no second one is started.
    url = asyncio.run(openenv.serve(APP))
    (again,) = play(agent_stack, rows[:1], episode(app=None, url=url, max_turns=guess_number.GUESSES), max_tokens=4)
    assert again.metadata["turns"] and len(openenv._servers) == 1


def test_an_environment_without_a_driver_is_played_by_its_own_action_schema(agent_stack):
    """No driver module: the policy sees each observation as JSON and writes each action as JSON,
    constrained by the server's own action schema (OpenEnv's /schema); every action is valid, the
    replay gives back the reward, and the constrained tokens carry the policy's own logprobs."""
    rows = openenv.rows(count=4, seed=70)
    samples = play(
        agent_stack,
        rows,
        functools.partial(openenv.episode, app=APP, max_sessions=8, max_turns=guess_number.GUESSES),
        max_tokens=48,
    )
    tokenizer = AutoTokenizer.from_pretrained(agent_stack[0])
    complete = 0
    for row, sample in zip(rows, samples):
        turns = sample.metadata["turns"]
        actions = []
        for t in turns:  # every reply is an action, but one the token budget cut off (the episode's end)
            reply = tokenizer.decode(sample.tokens[t["start"] : t["end"]], skip_special_tokens=True)
            if t["finish_reason"] == "length":
                assert t is turns[-1]
                break
            actions.append(json.loads(reply))
        complete += len(actions)
        assert all(set(a) == {"guess"} and 1 <= a["guess"] <= guess_number.HIGH for a in actions), actions
        assert all(t["constrained"] == "policy" for t in turns)
        game, total = guess_number.GuessNumberEnvironment(), 0.0
        observation = game.reset(seed=row["metadata"]["openenv"]["reset"]["seed"])
        for action in actions:
            assert openenv.SchemaDriver.observe(observation.model_dump()) in tokenizer.decode(sample.tokens)
            observation = game.step(guess_number.GuessAction(**action))
            total += observation.reward
        assert sample.reward == total
    assert complete >= 4  # most replies are whole actions
    assert '"guess"' in tokenizer.decode(samples[0].tokens[: samples[0].prompt_length])  # the schema, told


def test_a_reply_that_is_no_action_ends_the_episode_and_is_trained_on(agent_stack):
    assert guess_number.act("I guess 7, no: 12") == {"guess": 12}
    for reply in ("no idea", "99"):
        with pytest.raises(ValueError):
            guess_number.act(reply)
    rows = openenv.rows(count=4, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(agent_stack[0])
    ended = []
    for row, sample in zip(
        rows, play(agent_stack, rows, episode(driver="envs.guess_number", max_turns=3), max_tokens=4)
    ):
        _, reward, no_action = replay(sample, row["metadata"]["openenv"]["reset"]["seed"], tokenizer, guess_number.act)
        assert sample.reward == reward
        ended.append(no_action)
    assert any(ended)  # the random tiny model seldom names a number


def test_a_server_that_cannot_start_and_a_driver_that_does_not_exist_get_clear_errors(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="the OpenEnv server 'envs.no_such_env:app' exited"):
        asyncio.run(openenv.serve("envs.no_such_env:app"))
    with pytest.raises(SystemExit):
        openenv.main(["--driver", "envs.no_such_driver", "--app", APP, "--out", str(tmp_path / "x.jsonl")])
    assert "--driver 'envs.no_such_driver'" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()
    task = type("Task", (), {"metadata": {"openenv": {}}})()
    with pytest.raises(ValueError, match="by 'app' or by 'url', one of them"):
        asyncio.run(openenv.episode(task, None, driver="envs.guess_number"))


@pytest.mark.slow  # a whole job: left out of make test-fast
def test_a_debug_rollout_only_job_plays_the_environment_the_command_line_names(tiny_model, tmp_path, capsys):
    prompts, data = tmp_path / "p.jsonl", tmp_path / "rollout.jsonl"
    openenv.main(
        [
            "--driver",
            "tests.envs.test_openenv",
            "--app",
            APP,
            "--out",
            str(prompts),
            "--count",
            "2",
            "--max-sessions",
            "4",
        ]
    )
    env_args = json.dumps({"driver": "tests.envs.test_openenv", "app": APP, "max_turns": 16, "max_sessions": 4})
    assert f"--env-path envs.openenv:episode --env-args '{env_args}'" in capsys.readouterr().out
    logs_before = set(Path(tempfile.gettempdir()).glob("openenv-*.log"))
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--env-path",
            "envs.openenv:episode",
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
    assert max(len(s.metadata["turns"]) for s in saved) > 1
    # the job's environment server went with the job, and its log with it
    assert set(Path(tempfile.gettempdir()).glob("openenv-*.log")) <= logs_before


@pytest.mark.parametrize("max_sessions", [1, 4])
def test_a_server_with_one_session_plays_every_episode_in_turn(agent_stack, max_sessions):
    """OpenEnv's default server takes one session: episodes queue (max_sessions 1), or a refused one is
    asked again (4, more than it takes), and no refusal counts as an episode (play fails on any)."""
    rows = openenv.rows(count=4, seed=7)
    one = episode(app="tests.envs.test_openenv:ONE_SESSION", max_turns=2, max_sessions=max_sessions)
    samples = play(agent_stack, rows, one, max_tokens=4)
    tokenizer = AutoTokenizer.from_pretrained(agent_stack[0])
    for row, sample in zip(rows, samples):
        assert sample.reward == replay(sample, row["metadata"]["openenv"]["reset"]["seed"], tokenizer)[1]


def test_a_row_that_names_code_imports_nothing_and_fails_its_episode_with_the_reason(agent_stack):
    """The audit's row: before, envs.openenv imported whatever module a row named as its driver."""
    assert "this" not in sys.modules  # the Zen of Python prints itself when imported
    hostile = {
        "input": "x",
        "metadata": {"openenv": {"driver": "this", "app": APP, "reset": {"seed": 1}, "max_turns": 1}},
    }
    with pytest.raises(AssertionError, match="chosen by --env-args, never by a row"):
        play(agent_stack, [hostile], episode(), max_tokens=1)
    malformed = {"input": "x", "metadata": {"openenv": {"reset": {"seed": -3}}}}
    with pytest.raises(AssertionError, match="not an OpenEnv ResetRequest"):
        play(agent_stack, [malformed], episode(), max_tokens=1)
    assert "this" not in sys.modules
