"""strands-agents' ``Agent`` with its OpenAI model."""

import os

from strands import Agent, tool
from strands.models.openai import OpenAIModel
from weather import INSTRUCTIONS, QUESTION, get_weather

model = OpenAIModel(
    client_args={"api_key": os.environ["OPENAI_API_KEY"], "base_url": os.environ["OPENAI_BASE_URL"]},
    model_id="gpt-5-mini",
)
agent = Agent(model=model, tools=[tool(get_weather)], system_prompt=INSTRUCTIONS, callback_handler=None)
print(agent(QUESTION))
