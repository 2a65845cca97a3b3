"""google-adk's ``LlmAgent`` with ``LiteLlm`` (litellm reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``)."""

import asyncio

from google.adk.agents import LlmAgent
from google.adk.models.lite_llm import LiteLlm
from google.adk.runners import InMemoryRunner
from google.genai import types
from weather import INSTRUCTIONS, QUESTION, get_weather


async def main(model) -> None:
    agent = LlmAgent(name="weather", model=model, instruction=INSTRUCTIONS, tools=[get_weather])
    runner = InMemoryRunner(agent=agent, app_name="weather")
    session = await runner.session_service.create_session(app_name="weather", user_id="user")
    message = types.Content(role="user", parts=[types.Part(text=QUESTION)])
    async for event in runner.run_async(user_id="user", session_id=session.id, new_message=message):
        if event.is_final_response() and event.content and event.content.parts:
            print(event.content.parts[0].text)


if __name__ == "__main__":
    asyncio.run(main(LiteLlm(model="openai/gpt-5-mini")))
