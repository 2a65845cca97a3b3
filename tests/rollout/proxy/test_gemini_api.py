"""The Gemini API through the real stack, with raw HTTP in Google's documented shapes (Gemini CLI and
ADK's Gemini model run it unchanged in ``tests/harnesses``): the scripted conversation gives the same
Sample as through Chat Completions, token for token; streamed as Google streams; errors, keys and
token counts in Google's shapes."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.rollout.proxy.scripted import TOOLS
from tests.rollout.proxy.test_agent_apis import (
    EXPECTED,
    RESULTS,
    SYSTEM,
    chat_conversation,
    check_sample,
    recorded,
    user_turns,
)
from tests.rollout.proxy.test_recording import ADMIN, finish, new_session

FUNCTION = TOOLS[0]["function"]
# the declaration in Gemini's own schema subset (upper-case types), as older clients send it
GEMINI_TOOLS = [
    {
        "functionDeclarations": [
            {
                "name": FUNCTION["name"],
                "description": FUNCTION["description"],
                "parameters": {"type": "OBJECT", "properties": {"city": {"type": "STRING"}}, "required": ["city"]},
            }
        ]
    }
]


def generate(base: str, body: dict, *, stream: bool, model: str = "gemini-2.5-pro", **headers: str) -> dict:
    """One call; a stream's chunks joined into the response a whole call gives (texts appended)."""
    if not stream:
        answer = httpx.post(f"{base}/v1beta/models/{model}:generateContent", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()
    chunks = []
    with httpx.stream(
        "POST",
        f"{base}/v1beta/models/{model}:streamGenerateContent",
        params={"alt": "sse"},
        json=body,
        headers=headers,
        timeout=60,
    ) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert (
        all("finishReason" not in c["candidates"][0] for c in chunks[:-1])
        and "finishReason" in chunks[-1]["candidates"][0]
    )
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    text = "".join(p.get("text", "") for p in parts)
    whole = chunks[-1]
    whole["candidates"][0]["content"]["parts"] = ([{"text": text}] if text else []) + [
        p for p in parts if "functionCall" in p
    ]
    return whole


def gemini_conversation(session: dict, *, stream: bool = False, snake_case: bool = False) -> None:
    base = session["base_url"].removesuffix("/v1")
    contents: list = [{"role": "user", "parts": [{"text": user_turns()[0]}]}]
    for turn in range(4):
        body = {
            "contents": contents,
            "systemInstruction": {"parts": [{"text": SYSTEM}]},
            "tools": GEMINI_TOOLS,
            "generationConfig": {"temperature": 0, "maxOutputTokens": 64},
        }
        if snake_case:  # the proto field names, which Google's JSON takes too (the Python SDK sends some)
            body = {
                "contents": contents,
                "system_instruction": body["systemInstruction"],
                "tools": [{"function_declarations": GEMINI_TOOLS[0]["functionDeclarations"]}],
                "generation_config": {"temperature": 0, "max_output_tokens": 64},
            }
        answer = generate(base, body, stream=stream)
        (candidate,) = answer["candidates"]
        reason, text = EXPECTED[turn]
        parts = candidate["content"]["parts"]
        assert candidate["finishReason"] == "STOP" and answer["usageMetadata"]["candidatesTokenCount"] > 0
        if reason == "tool_calls":
            (part,) = parts
            assert part["functionCall"] == {"name": "get_weather", "args": {"city": text}}
            contents += [
                {"role": "model", "parts": parts},
                {
                    "role": "user",
                    "parts": [{"functionResponse": {"name": "get_weather", "response": {"output": RESULTS[text]}}}],
                },
            ]
        else:
            assert parts == [{"text": text}]
            contents += [{"role": "model", "parts": parts}, {"role": "user", "parts": [{"text": user_turns()[1]}]}]


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_conversation_is_recorded_token_for_token_and_equals_chats(stack, stream):
    chat, _ = recorded(stack, chat_conversation)
    sample, log = recorded(stack, gemini_conversation, stream=stream, snake_case=stream)
    check_sample(stack, sample, log)
    assert sample.tokens == chat.tokens and sample.loss_mask == chat.loss_mask
    assert sample.rollout_log_probs == chat.rollout_log_probs


def test_gemini_keys_errors_and_counts_have_googles_shapes(stack):
    session = new_session(stack)
    body = {
        "contents": [{"role": "user", "parts": [{"text": "Weather in Paris?"}]}],
        "generationConfig": {"maxOutputTokens": 4},
    }
    url = stack.proxy.url
    for auth in ({"headers": {"x-goog-api-key": session["token"]}}, {"params": {"key": session["token"]}}):
        answer = httpx.post(f"{url}/v1beta/models/gemini-2.5-flash:generateContent", json=body, **auth)
        assert answer.status_code == 200 and answer.json()["modelVersion"] == "gemini-2.5-flash", answer.text
    refused = httpx.post(f"{url}/v1beta/models/m:generateContent", json=body, headers={"x-goog-api-key": "nope"})
    assert refused.status_code == 401 and refused.json()["error"]["status"] == "UNAUTHENTICATED"
    base = session["base_url"].removesuffix("/v1")
    for bad, where in [
        ({**body, "nonsense": 1}, "nonsense"),
        ({**body, "generationConfig": {"frequencyPenalty": 1.5}}, "frequencyPenalty"),
        ({"contents": [{"role": "user", "parts": [{"inlineData": {"data": "x"}}]}]}, "inlineData"),
        ({**body, "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}, "tool"),
    ]:
        answer = httpx.post(f"{base}/v1beta/models/m:generateContent", json=bad)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["status"] == "INVALID_ARGUMENT" and error["code"] == 400
        assert where in error["message"], error
    not_sse = httpx.post(f"{base}/v1beta/models/m:streamGenerateContent", json=body)
    assert not_sse.status_code == 400 and "alt=sse" in not_sse.json()["error"]["message"]
    count = httpx.post(f"{base}/v1beta/models/m:countTokens", json={"contents": body["contents"]}).json()
    whole = httpx.post(f"{base}/v1beta/models/m:generateContent", json=body).json()
    assert count == {"totalTokens": whole["usageMetadata"]["promptTokenCount"]}
    samples = finish(stack, session)
    assert sum(len(s.metadata["turns"]) for s in samples) == 3  # the three answered; refusals and counts: nothing
    thinking = {
        **body,
        "generationConfig": {"maxOutputTokens": 4, "thinkingConfig": {"includeThoughts": True, "thinkingBudget": -1}},
    }
    other = new_session(stack)
    httpx.post(f"{other['base_url'].removesuffix('/v1')}/v1beta/models/m:generateContent", json=thinking)
    (sample,) = finish(stack, other)
    accepted = sample.metadata["turns"][0]["accepted"]  # includeThoughts takes effect (no reasoning to show here)
    assert "generationConfig.thinkingConfig.thinkingBudget" in accepted and not any(
        "includeThoughts" in k for k in accepted
    )
    assert httpx.get(f"{url}/sessions/{other['session_id']}", headers=ADMIN).status_code == 200
