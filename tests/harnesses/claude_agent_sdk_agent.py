"""The Claude Agent SDK's quick start (``query`` with ``ClaudeAgentOptions``), as its documentation writes
it: the Claude Code it bundles runs underneath, pointed at the endpoint by ``ANTHROPIC_BASE_URL`` and
``ANTHROPIC_API_KEY`` in the environment. Prints the result."""

import sys

import anyio
from claude_agent_sdk import ClaudeAgentOptions, ResultMessage, query


async def main(prompt: str) -> None:
    async for message in query(prompt=prompt, options=ClaudeAgentOptions()):
        if isinstance(message, ResultMessage):
            print(message.result)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
