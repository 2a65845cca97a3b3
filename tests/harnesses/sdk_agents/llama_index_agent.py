"""llama-index's ``FunctionAgent`` with its ``OpenAI`` LLM."""

import asyncio
import os

from llama_index.core.agent.workflow import FunctionAgent
from llama_index.llms.openai import OpenAI
from weather import INSTRUCTIONS, QUESTION, get_weather

llm = OpenAI(model="gpt-4o-mini", api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
agent = FunctionAgent(tools=[get_weather], llm=llm, system_prompt=INSTRUCTIONS)


async def main() -> None:
    print(await agent.run(QUESTION))


asyncio.run(main())
