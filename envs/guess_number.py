"""Guess the number: a multi-turn environment written in OpenEnv's own API, and its driver.

The server side is what ``openenv init`` generates: an ``Action`` and an ``Observation`` (pydantic
models), an ``Environment`` with ``reset`` / ``step`` / ``state``, and ``app``, the FastAPI app of
``openenv.core.env_server.create_app``, served as OpenEnv documents it
(``uvicorn envs.guess_number:app``). ``reset(seed)`` draws a secret number in ``[1, high]``; each
``step`` takes a guess and answers ``higher``, ``lower`` or ``correct``. The episode ends at the
right guess (reward 1) or when the guesses run out (reward 0). A guess outside the range is
refused by the action model.

The driver side is what ``envs.openenv`` needs to let a language model play it: ``observe`` writes
an observation as the user's message, and ``act`` reads the model's reply as an action (its last
integer; a reply without one in range is not an action).
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

HIGH = 20
GUESSES = 5


class GuessAction(Action):
    guess: int = Field(ge=1, le=HIGH)


class GuessObservation(Observation):
    feedback: str = ""  # "", "higher", "lower" or "correct"
    guesses_left: int = GUESSES


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self._secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, HIGH)
        return GuessObservation(guesses_left=GUESSES, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        left = GUESSES - self._state.step_count
        if action.guess == self._secret:
            return GuessObservation(feedback="correct", guesses_left=left, done=True, reward=1.0)
        feedback = "higher" if action.guess < self._secret else "lower"
        return GuessObservation(feedback=feedback, guesses_left=left, done=left == 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    GuessNumberEnvironment, GuessAction, GuessObservation, env_name="guess_number", max_concurrent_envs=256
)

INTEGER = re.compile(r"-?\d+")


def observe(observation: dict[str, Any]) -> str:
    """The user's message for an observation."""
    if not observation["feedback"]:
        return (
            f"I am thinking of a number from 1 to {HIGH}. You have {observation['guesses_left']} guesses. "
            "Reply with one number."
        )
    return f"{observation['feedback'].capitalize()}. {observation['guesses_left']} guesses left."


def act(reply: str) -> dict[str, Any]:
    """The action for the model's reply: its last integer."""
    found = INTEGER.findall(reply)
    if not found or not 1 <= int(found[-1]) <= HIGH:
        raise ValueError(f"the reply holds no number from 1 to {HIGH}")
    return {"guess": int(found[-1])}
