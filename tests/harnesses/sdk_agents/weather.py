"""The one tool every quick-start agent gets (plain Python, importable by each SDK's program)."""

RESULTS = {"Paris": "sunny, 24C", "Rome": "rain, 18C"}
QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "You are a weather bot."


def get_weather(city: str) -> str:
    """Current weather of a city.

    Args:
        city: the city's name
    """
    return RESULTS.get(city, "unknown")
