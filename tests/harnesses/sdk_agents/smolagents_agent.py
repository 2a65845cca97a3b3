"""smolagents' ``ToolCallingAgent`` with ``OpenAIServerModel``."""

import os

from smolagents import OpenAIServerModel, ToolCallingAgent, tool
from weather import QUESTION, get_weather

model = OpenAIServerModel(
    model_id="gpt-5-mini", api_base=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]
)
agent = ToolCallingAgent(tools=[tool(get_weather)], model=model, verbosity_level=0)
print(agent.run(QUESTION))
