"""google-adk's ``LlmAgent`` with its own default kind of model, a Gemini name (google-genai reads
``GOOGLE_GEMINI_BASE_URL`` and ``GOOGLE_API_KEY``): the Gemini API."""

import asyncio

from adk_agent import main

asyncio.run(main("gemini-2.5-flash"))
