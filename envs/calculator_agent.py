"""An existing agent, unchanged: an **openai-agents** ``Agent`` with a calculator tool, on reasoning-gym arithmetic.

The agents below are written as the SDK's documentation writes one: a ``function_tool``, an
``Agent`` with instructions, and ``Runner.run``. Nothing in them knows they are being trained. The
episode only points the SDK's own model provider at the session's ``base_url`` (``RunConfig``), so
every model call goes through the proxy, which records it token for token: the sampled tokens are
trained, and the tool results and the template around them are prompt tokens (mask 0).

The questions are reasoning-gym's (``basic_arithmetic`` with 2-3 digit operands in ``make agent``),
written by ``envs.reasoning_gym`` with its metadata, and the reward is reasoning-gym's grader on
the agent's final answer (``envs.reasoning_gym.score``), as for the main job.

Two agents, chosen by the episode's ``coached`` keyword (``--env-args``):
- ``agent``, the default: the agent as its users write it. Instructions that name the tool, and
  ``ModelSettings`` left at the SDK's defaults, so ``tool_choice`` is ``auto``: whether to call
  the tool is the model's choice. SmolLM2-135M-Instruct never makes that call untrained (0 of 48
  held-out episodes; docs/performance-history.md), so RL on this agent alone has nothing to learn.
- ``coached_agent``: the same agent with two choices of an author who wants the call made.
  ``tool_choice="required"`` on its first turn (the proxy writes the call's opening and the tool's
  name; the SDK resets it to ``auto`` once a tool has run, ``Agent.reset_tool_choice``, so the
  model then answers in words), and instructions that show the call's format with one example (a
  135M model copies a format it is shown more readily than one it is told). It succeeds often
  enough for RL to learn from, and ``make agent`` bootstraps ``agent`` from its successes
  (``rollout_functions.bootstrap``).

The calculator parses the expression (``envs.arithmetic.calculate``, an ``ast`` allowlist); it
never ``eval``s model output.
"""

from __future__ import annotations

import logging

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    RunConfig,
    Runner,
    RunResult,
    function_tool,
)
from agents.models.openai_provider import OpenAIProvider

from envs.arithmetic import calculate
from envs.reasoning_gym import score

# The SDK logs every reply cut off by max_tokens as an error before raising it; the episode grades
# that as 0, so at 64 episodes a step the log line is noise.
logging.getLogger("openai.agents").setLevel(logging.CRITICAL)
MAX_TURNS = 4  # model calls per episode: the call, the answer, and room for a retried call
INSTRUCTIONS = "You are a calculator assistant. Use the calculator tool to compute the answer."
COACHED_INSTRUCTIONS = """You are a calculator assistant. Always use the calculator tool. Example:
user: What is 12 * 34?
assistant: <tool_call>
{"name": "calculator", "arguments": {"expression": "12 * 34"}}
</tool_call>"""


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: numbers, + - * /, parentheses.

    Args:
        expression: the expression, e.g. "12 * (3 + 4)".
    """
    return calculate(expression)


agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[calculator])
coached_agent = Agent(
    name="calculator",
    instructions=COACHED_INSTRUCTIONS,
    tools=[calculator],
    model_settings=ModelSettings(tool_choice="required"),
)


async def run(question: str, client, chosen: Agent = agent) -> RunResult | None:
    """``chosen`` on ``question``, its model calls sent to ``client``'s endpoint; None when it gave no
    answer (cut off by max_tokens, out of turns, or a call of a tool it does not have)."""
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    try:
        return await Runner.run(chosen, question, max_turns=MAX_TURNS, run_config=config)
    except (MaxTurnsExceeded, ModelBehaviorError):
        return None


def grade(result: RunResult | None, metadata: dict) -> float:
    """reasoning-gym's grade of the agent's final answer (0 without one)."""
    return 0.0 if result is None else score(str(result.final_output or ""), metadata)


async def episode(task, client, coached: bool = False) -> float:
    return grade(await run(task.prompt, client, coached_agent if coached else agent), task.metadata)
