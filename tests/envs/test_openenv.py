"""OpenEnv environments played through the real proxy and engine: the environment's server runs
as OpenEnv serves it, each episode holds its own environment session, and replaying the recorded
replies against the environment gives back the recorded feedback and the reward."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from envs import guess_number, openenv
from inverted.types import Sample
from tests.envs import play
from tests.job.test_train_job import ONE_ENGINE_RUN, check, inverted

APP = "envs.guess_number:app"
observe = guess_number.observe  # this module is also a driver: every reply is a guess


def act(reply: str) -> dict:
    return {"guess": len(reply) % guess_number.HIGH + 1}


def replay(sample: Sample, seed: int, tokenizer, driver_act=act) -> tuple[list[str], float, bool]:
    """The feedback and reward the environment gives the recorded replies, played again in-process,
    and whether the last reply was no action."""
    game = guess_number.GuessNumberEnvironment()
    observation, said, total = game.reset(seed=seed), [], 0.0
    for turn in sample.metadata["turns"]:
        said.append(observe(observation.model_dump()))
        reply = tokenizer.decode(sample.tokens[turn["start"]:turn["end"]], skip_special_tokens=True)
        try:
            action = driver_act(reply)
        except ValueError:
            assert turn is sample.metadata["turns"][-1]  # no action ends the episode
            return said, total, True
        observation = game.step(guess_number.GuessAction(**action))
        total += observation.reward
    return said, total, False


def test_episodes_are_played_on_the_environment_server_and_recorded_as_one_branch(stack):
    rows = openenv.rows(__name__, {"app": APP}, count=6, seed=40, max_turns=guess_number.GUESSES)
    samples = play(stack, rows, openenv.episode, max_tokens=4)
    tokenizer = AutoTokenizer.from_pretrained(stack[0])
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
    by_url = openenv.rows(__name__, {"url": url}, count=1, seed=40, max_turns=guess_number.GUESSES)
    (again,) = play(stack, by_url, openenv.episode, max_tokens=4)
    assert again.metadata["turns"] and len(openenv._servers) == 1


def test_a_reply_that_is_no_action_ends_the_episode_and_is_trained_on(stack):
    assert guess_number.act("I guess 7, no: 12") == {"guess": 12}
    for reply in ("no idea", "99"):
        with pytest.raises(ValueError):
            guess_number.act(reply)
    rows = openenv.rows("envs.guess_number", {"app": APP}, count=4, seed=0, max_turns=3)
    tokenizer = AutoTokenizer.from_pretrained(stack[0])
    ended = []
    for row, sample in zip(rows, play(stack, rows, openenv.episode, max_tokens=4)):
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


def test_a_debug_rollout_only_job_plays_an_openenv_environment(tiny_model, tmp_path):
    prompts, data = tmp_path / "p.jsonl", tmp_path / "rollout.jsonl"
    openenv.main(["--driver", "tests.envs.test_openenv", "--app", APP, "--out", str(prompts), "--count", "2"])
    check(inverted("train", "--debug-rollout-only", "--hf-checkpoint", str(tiny_model()), "--prompt-data", str(prompts),
                   "--env-path", "envs.openenv:episode", "--save-debug-rollout-data", str(data),
                   "--output-dir", str(tmp_path / "run"), "--num-rollout", "1", *ONE_ENGINE_RUN))
    saved = [Sample.from_json(json.loads(line)) for line in data.read_text().splitlines()]
    assert len(saved) == 4 and all(s.status != Sample.Status.FAILED and s.reward in (0.0, 1.0) for s in saved)
    assert max(len(s.metadata["turns"]) for s in saved) > 1
