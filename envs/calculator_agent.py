"""An existing agent, unchanged: an **openai-agents** ``Agent`` with a calculator tool, on reasoning-gym arithmetic.

The agent below is written as the SDK's documentation writes one: a ``function_tool``, an
``Agent`` with instructions, and ``Runner.run``. Nothing in it knows it is being trained. The
episode only points the SDK's own model provider at the session's ``base_url`` (``RunConfig``), so
every model call goes through the proxy, which records it token for token: the sampled tokens are
trained, and the tool results and the template around them are prompt tokens (mask 0).

The questions are reasoning-gym's (``basic_arithmetic`` with 2-3 digit operands in ``make agent``),
written by ``envs.reasoning_gym`` with its metadata, and the reward is reasoning-gym's grader on
the agent's final answer (``envs.reasoning_gym.score``), as for the main job.

Two choices are the agent author's, and ordinary SDK usage:
- ``tool_choice="required"``: the agent asks for a tool call on its first turn; the SDK resets it
  to ``auto`` once a tool has run (``Agent.reset_tool_choice``, its default), so the model then
  answers in words. Measured on SmolLM2-135M-Instruct without it: 0 of 64 replies held a
  well-formed call (docs/performance-history.md), and a group with no success has nothing to learn.
- the instructions show the call's format with one example (a 135M model copies a format it is
  shown more readily than one it is told).

The calculator parses the expression (``envs.arithmetic.calculate``, an ``ast`` allowlist); it
never ``eval``s model output.
"""

from __future__ import annotations

import logging

from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, ModelSettings, RunConfig, Runner, RunResult,
                    function_tool)
from agents.models.openai_provider import OpenAIProvider

from envs.arithmetic import calculate
from envs.reasoning_gym import score

# The SDK logs every reply cut off by max_tokens as an error before raising it; the episode grades
# that as 0, so at 64 episodes a step the log line is noise.
logging.getLogger("openai.agents").setLevel(logging.CRITICAL)
MAX_TURNS = 4  # model calls per episode: the call, the answer, and room for a retried call
INSTRUCTIONS = """You are a calculator assistant. Always use the calculator tool. Example:
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


agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[calculator],
              model_settings=ModelSettings(tool_choice="required"))


async def run(question: str, client) -> RunResult | None:
    """The agent on ``question``, its model calls sent to ``client``'s endpoint; None when it gave no
    answer (cut off by max_tokens, out of turns, or a call of a tool it does not have)."""
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    try:
        return await Runner.run(agent, question, max_turns=MAX_TURNS, run_config=config)
    except (MaxTurnsExceeded, ModelBehaviorError):
        return None


def grade(result: RunResult | None, metadata: dict) -> float:
    """reasoning-gym's grade of the agent's final answer (0 without one)."""
    return 0.0 if result is None else score(str(result.final_output or ""), metadata)


async def episode(task, client) -> float:
    return grade(await run(task.prompt, client), task.metadata)
