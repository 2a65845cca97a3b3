"""pydantic-ai's ``Agent`` on an OpenAI model (the provider reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``)."""

from pydantic_ai import Agent
from weather import INSTRUCTIONS, QUESTION, get_weather

agent = Agent("openai:gpt-5-mini", instructions=INSTRUCTIONS, tools=[get_weather])
print(agent.run_sync(QUESTION).output)
