"""An openai-agents quick-start agent at the SDK's defaults: no model, no ``ModelSettings``.

As the SDK's documentation sets it up for another endpoint: ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` in the environment, ``OPENAI_DEFAULT_MODEL`` naming the model (the SDK then
picks that model's default settings: ``reasoning.effort`` ``low`` for ``gpt-5``, ``none`` for
``gpt-5.x``, and ``verbosity: low``). ``chat`` as the first argument switches the SDK to its Chat
Completions model (``set_default_openai_api``). Prints the final output.
"""

import json
import sys

import agents

RESULTS = {"Paris": "sunny, 24C", "Rome": "rain, 18C"}


async def get_weather(context, arguments: str) -> str:
    return RESULTS[json.loads(arguments)["city"]]


weather = agents.FunctionTool(
    name="get_weather",
    description="Current weather of a city",
    on_invoke_tool=get_weather,
    strict_json_schema=False,
    params_json_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)

if __name__ == "__main__":
    if sys.argv[1:] == ["chat"]:
        agents.set_default_openai_api("chat_completions")
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="weather", instructions="You are a weather bot.", tools=[weather])
    print(agents.Runner.run_sync(agent, "Weather in Paris and Rome?").final_output)
