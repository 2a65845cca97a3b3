"""AutoGen AgentChat's ``AssistantAgent`` as its quick start writes it (reflecting on the tool's result,
streaming the model client)."""

import asyncio
import os

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient
from weather import INSTRUCTIONS, QUESTION, get_weather


async def main() -> None:
    client = OpenAIChatCompletionClient(
        model="gpt-4o-mini", base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]
    )
    agent = AssistantAgent(
        "weather",
        model_client=client,
        tools=[get_weather],
        system_message=INSTRUCTIONS,
        reflect_on_tool_use=True,
        model_client_stream=True,
    )
    result = await agent.run(task=QUESTION)
    print(result.messages[-1].content)
    await client.close()


asyncio.run(main())
