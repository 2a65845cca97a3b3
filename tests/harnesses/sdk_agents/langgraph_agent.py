"""LangGraph's prebuilt ReAct agent with ``ChatOpenAI``."""

import os

from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from weather import INSTRUCTIONS, QUESTION, get_weather

model = ChatOpenAI(model="gpt-5-mini", base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
agent = create_react_agent(model, tools=[get_weather], prompt=INSTRUCTIONS)
result = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]})
print(result["messages"][-1].content)
