"""Any ``verifiers`` environment (prime-rl's library), run unchanged through the proxy.

A verifiers environment owns its whole rollout: its prompt, its turns, its tools, its parser and
its rubric. ``episode`` hands it the session's client, wrapped in the library's own
``OpenAIChatCompletionsClient``, and lets ``Environment.run_rollout`` play and score the task;
every token the environment's model calls produce is recorded by the proxy as usual.

The environment is chosen on the command line, never by a dataset row (datasets come from the
internet, and a row that named code would run it): ``--env-args '{"env": ..., "args": {...}}'``
beside ``--env-path envs.verifiers:episode``. ``env`` is named as verifiers names them, or by a path:

- an environment id (``vf-eval``'s): ``verifiers.load_environment(id, **args)`` imports the
  installed module ``id`` (dashes as underscores) and calls its ``load_environment(**args)``;
- ``module:attr``: a callable that returns an environment, called with ``args``. The library's
  reasoning-gym environment is one, and runs offline:
  ``verifiers.envs.integrations.reasoninggym_env:ReasoningGymEnv`` with ``{"gym": "chain_sum"}``.

Rows are the environment's own dataset: ``input`` is its prompt (chat messages), ``label`` its
answer, and ``metadata.verifiers.input`` the dataset row, data only: it is checked against
verifiers' own ``RolloutInput`` before the environment sees it, and a row that carries anything
else is refused. Environments are built once per process and reused.

The reward is the rubric's. With more than one weighted reward function it is a dict of their
weighted scores (they sum to the rubric's reward, so ``--reward-key`` picks one); functions of
weight 0 are the environment's metrics, not reward, and are left out. A rollout that verifiers
marks as errored (a refused model call, a tool that raised) fails the episode, rather than being
trained on as a reward of 0, with one exception: when the error is the model's own output (an empty
or unparseable reply, verifiers' ``InvalidModelResponseError``), that reply is the policy's action
and the rubric's score of it is the reward, so the model learns not to give it. Environments scored
by group-level reward functions are refused when loaded: inverted scores each episode on its own.

    python -m envs.verifiers --env ID_OR_PATH [--args JSON] --out FILE --count N [--seed S] [--eval]
    inverted train ... --env-path envs.verifiers:episode --env-args '{"env": ID_OR_PATH, "args": {...}}'
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
from typing import Any

import pydantic
import verifiers as vf
from verifiers import errors as vf_errors
from verifiers.types import RolloutInput

from envs.datasets import json_object, write_rows

MODEL = "policy"  # the proxy serves the one policy whatever the name
_ROLLOUT_INPUT = pydantic.TypeAdapter(RolloutInput)


class EnvError(ValueError):
    """An environment that cannot be loaded, or that inverted cannot run episode by episode."""


@functools.lru_cache(maxsize=16)
def _load(env: str, args_json: str) -> vf.Environment:
    args = json.loads(args_json)
    try:
        if ":" in env:
            module, _, attr = env.partition(":")
            loaded = getattr(importlib.import_module(module), attr)(**args)
        else:
            loaded = vf.load_environment(env, **args)
    except (ImportError, AttributeError, TypeError, ValueError, RuntimeError) as exc:
        raise EnvError(f"cannot load the verifiers environment {env!r} with {args}: {exc}") from exc
    if not isinstance(loaded, vf.Environment):
        raise EnvError(f"{env!r} gave a {type(loaded).__name__}, not a verifiers Environment")
    if loaded.requires_group_rollouts or loaded.rubric._get_group_reward_funcs():
        raise EnvError(f"{env!r} scores rollouts in groups; inverted scores each episode on its own")
    return loaded


def load(env: str, args: dict[str, Any] | None = None) -> vf.Environment:
    """The environment ``env`` built with ``args``, once per process."""
    return _load(env, json.dumps(args or {}, sort_keys=True))


def rows(env: str, args: dict[str, Any], count: int, seed: int, evaluation: bool = False) -> list[dict[str, Any]]:
    loaded = load(env, args)
    dataset = (loaded.get_eval_dataset if evaluation else loaded.get_dataset)(n=count, seed=seed)
    return [
        {"input": row["prompt"], "label": row.get("answer"), "metadata": {"verifiers": {"input": row}}}
        for row in dataset
    ]


def row_input(metadata: dict[str, Any]) -> dict[str, Any]:
    """The row's verifiers input, checked against the library's ``RolloutInput``; a row naming code is refused."""
    spec = metadata.get("verifiers")
    if not isinstance(spec, dict) or set(spec) != {"input"}:
        named = sorted(set(spec) - {"input"}) if isinstance(spec, dict) else type(spec).__name__
        raise EnvError(
            f"a row's metadata.verifiers holds its dataset row as 'input' and nothing else (got {named}): "
            "the environment is chosen by --env-args, never by a row"
        )
    try:
        _ROLLOUT_INPUT.validate_python(spec["input"])
    except pydantic.ValidationError as exc:
        raise EnvError(f"a row's metadata.verifiers.input is not a verifiers RolloutInput: {exc}") from None
    return spec["input"]


def _weighted_parts(rubric: Any, metrics: dict[str, float]) -> dict[str, float]:
    """Each reward function's weighted score, as the rubric sums them (a RubricGroup sums its rubrics)."""
    if isinstance(rubric, vf.RubricGroup):
        return {name: part for member in rubric.rubrics for name, part in _weighted_parts(member, metrics).items()}
    return {f.__name__: weight * metrics[f.__name__] for f, weight in zip(rubric.funcs, rubric.weights) if weight}


def reward(loaded: vf.Environment, output: dict[str, Any]) -> float | dict[str, float]:
    total = float(output["reward"])
    try:
        parts = _weighted_parts(loaded.rubric, output.get("metrics") or {})
    except KeyError:  # a rubric that reports its functions under other names: its reward alone
        return total
    if len(parts) > 1 and math.isclose(sum(parts.values()), total, rel_tol=1e-9, abs_tol=1e-9):
        return parts
    return total


def _model_fault(error: dict[str, Any]) -> bool:
    """Whether verifiers stopped the rollout because of what the model said, not of anything failing."""
    cls = getattr(vf_errors, str(error.get("error")), None)
    return isinstance(cls, type) and issubclass(cls, vf_errors.InvalidModelResponseError)


async def episode(task, client, *, env: str, args: dict[str, Any] | None = None) -> float | dict[str, float]:
    """One row played by the environment ``env`` built with ``args`` (both from ``--env-args``)."""
    loaded = load(env, args)
    output = await loaded.run_rollout(
        row_input(task.metadata), vf.OpenAIChatCompletionsClient(client), MODEL, sampling_args={}
    )
    if output.get("error") and not _model_fault(output["error"]):
        raise RuntimeError(f"the verifiers rollout failed: {output['error']}")
    return reward(loaded, output)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--env", required=True, help="a verifiers environment id, or module:attr")
    parser.add_argument("--args", type=json_object, default={}, help="the environment's arguments as a JSON object")
    parser.add_argument("--out", required=True, help="jsonl file to write")
    parser.add_argument("--count", type=int, default=-1, help="prompts to write (-1: all)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed")
    parser.add_argument("--eval", action="store_true", help="write the environment's evaluation set")
    args = parser.parse_args(argv)
    try:
        written = rows(args.env, args.args, args.count, args.seed, args.eval)
    except EnvError as exc:
        parser.error(str(exc))
    print(write_rows(written, args.out))
    env_args = json.dumps({"env": args.env, "args": args.args})
    print(f"train on it with: --env-path envs.verifiers:episode --env-args '{env_args}'")


if __name__ == "__main__":
    main()
