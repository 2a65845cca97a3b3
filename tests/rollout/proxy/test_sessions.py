"""Sessions as a user meets them: isolation, bad input, rewards, finishing, expiry, metrics."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from inverted.types import Sample
from tests.rollout.proxy.scripted import TOOLS
from tests.rollout.proxy.test_recording import ADMIN, finish, new_session

USER = [{"role": "user", "content": "hi"}]


def chat(url: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(
            url + "/chat/completions", content=body, headers={"content-type": "application/json"}, **kwargs
        )
    return httpx.post(url + "/chat/completions", json=body, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def turns_of(stack, session) -> int:
    return httpx.get(f"{stack.proxy.url}/sessions/{session['session_id']}", headers=ADMIN).json()["turns"]


def test_one_session_cannot_read_or_write_another(stack):
    a, b = new_session(stack), new_session(stack)
    as_a = {"Authorization": f"Bearer {a['token']}"}
    proxy = stack.proxy.url
    assert chat(a["base_url"], {"messages": USER, "max_tokens": 2}).status_code == 200
    for method, path, body in [
        ("GET", "/samples", None),
        ("POST", "/reward", {"reward": 1.0}),
        ("POST", "/finish", None),
        ("GET", "", None),
    ]:
        response = httpx.request(method, f"{proxy}/sessions/{b['session_id']}{path}", json=body, headers=as_a)
        assert error_of(response, 403)["code"] == "wrong_session"
    error_of(chat(b["base_url"], {"messages": USER}, headers=as_a), 403)
    # A's refused calls on B's routes are kept on neither (the session records only its own caller's).
    for session in (a, b):
        assert httpx.get(f"{proxy}/sessions/{session['session_id']}", headers=ADMIN).json()["refused"] == []
    # The token route writes only to its own session.
    assert (
        httpx.post(proxy + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers=as_a).status_code
        == 200
    )
    assert (turns_of(stack, a), turns_of(stack, b)) == (2, 0)
    # Unknown sessions and tokens, and session creation without the API key.
    error_of(chat(f"{proxy}/sessions/sess_nope/v1", {"messages": USER}), 404)
    error_of(
        httpx.post(
            proxy + "/v1/chat/completions", json={"messages": USER}, headers={"Authorization": "Bearer sk-guess"}
        ),
        401,
    )
    error_of(httpx.post(proxy + "/sessions", json={}), 401)
    error_of(httpx.get(f"{proxy}/sessions/{b['session_id']}/samples"), 401)  # an API key is configured
    assert a["session_id"] != b["session_id"] and len(a["token"]) > 40


def test_the_openai_sdk_works_with_only_the_token(stack):
    session = new_session(stack)
    client = openai.OpenAI(base_url=stack.proxy.url + "/v1", api_key=session["token"])
    assert [m.id for m in client.models.list()] == ["taught-qwen2"]
    reply = client.chat.completions.create(model="x", messages=USER, max_tokens=3)
    assert reply.usage.completion_tokens == 3 and turns_of(stack, session) == 1
    # The next turn resends the history: the engine's prefix cache serves it, and usage says how much.
    history = USER + [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    again = client.chat.completions.create(model="x", messages=history, max_tokens=3)
    assert reply.usage.prompt_tokens <= again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    turns = finish(stack, session)[0].metadata["turns"]
    assert [t["cached_tokens"] for t in turns] == [r.usage.prompt_tokens_details.cached_tokens for r in (reply, again)]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.proxy.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        (b"{not json", 400, None, "invalid_json"),
        ({"model": "m"}, 400, "messages", "missing_required_parameter"),
        ({"messages": []}, 400, "messages", None),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.[0].role", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages.[0].content[0]",
            None,
        ),
        (
            {"messages": USER + [{"role": "tool", "tool_call_id": "call_x", "content": "42"}]},
            400,
            "messages.[1].tool_call_id",
            None,
        ),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages", "context_length_exceeded"),
        ({"messages": USER, "temperature": "hot"}, 400, "temperature", "invalid_type"),
        ({"messages": USER, "top_p": 1.5}, 400, "top_p", "invalid_value"),
        ({"messages": USER, "logit_bias": {"5": 10}}, 400, "logit_bias", "unsupported_parameter"),
        ({"messages": USER, "frequency_penalty": 0.5}, 400, "frequency_penalty", "unsupported_parameter"),
        ({"messages": USER, "tool_choice": "required", "tools": []}, 400, "tool_choice", "invalid_value"),
        (
            {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
            400,
            "tool_choice",
            "invalid_value",
        ),
        ({"messages": USER, "best_of_luck": 1}, 400, "best_of_luck", "unrecognized_argument"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_records_nothing(stack, body, status, param, code):
    session = new_session(stack)
    logged = len(stack.engine_requests())
    error = error_of(chat(session["base_url"], body), status)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert turns_of(stack, session) == 0 and len(stack.engine_requests()) == logged
    assert finish(stack, session) == []


def test_neutral_and_ignored_parameters_of_agent_sdks_are_accepted(stack):
    session = new_session(stack)
    body = {
        "messages": USER,
        "max_completion_tokens": 2,
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "parallel_tool_calls": True,
        "service_tier": "auto",
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "stream_options": None,
        "model": "gpt-4o",
    }
    response = chat(session["base_url"], body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "gpt-4o" and response.json()["usage"]["completion_tokens"] == 2


def test_rewards_finish_and_session_overrides(stack):
    session = new_session(stack, sample={"group_index": 2, "label": 4}, sampling_params={"max_tokens": 3})
    url = f"{stack.proxy.url}/sessions/{session['session_id']}"
    as_owner = {"Authorization": f"Bearer {session['token']}"}
    assert chat(session["base_url"], {"messages": USER, "max_tokens": 50}).json()["usage"]["completion_tokens"] == 3
    error_of(httpx.post(url + "/reward", content=b'{"reward": NaN}', headers=as_owner), 400)
    error_of(httpx.post(url + "/reward", json={"reward": "high"}, headers=as_owner), 400)  # a dict may hold any JSON
    assert (
        httpx.post(
            url + "/reward", json={"reward": {"acc": 1.0, "fmt": 0.5}, "finished": False}, headers=as_owner
        ).status_code
        == 200
    )
    preview = httpx.get(url + "/samples", headers=as_owner).json()
    assert preview["finished"] is False and len(preview["samples"]) == 1
    (sample,) = [Sample.from_json(s) for s in httpx.post(url + "/finish", headers=as_owner).json()["samples"]]
    assert sample.reward == {"acc": 1.0, "fmt": 0.5} and sample.status == Sample.Status.TRUNCATED
    assert (sample.group_index, sample.label) == (2, 4)
    again = httpx.post(url + "/finish", headers=as_owner).json()["samples"]
    assert [Sample.from_json(s) for s in again] == [sample]  # idempotent
    assert error_of(chat(session["base_url"], {"messages": USER}), 409)["code"] == "session_finished"
    error_of(httpx.post(url + "/reward", json={"reward": 0.0}, headers=as_owner), 409)
    error_of(
        httpx.post(stack.proxy.url + "/sessions", json={"sampling_params": {"temperature": -1}}, headers=ADMIN), 400
    )


def created(stack) -> float:
    for line in httpx.get(stack.proxy.url + "/metrics").text.splitlines():
        if line.startswith("inverted_proxy_sessions_created_total "):
            return float(line.split()[1])
    raise AssertionError("the proxy has no inverted_proxy_sessions_created_total")


def test_a_batch_of_sessions_opens_all_or_none(stack):
    batch = stack.proxy.url + "/sessions/batch"
    before = created(stack)
    body = {
        "sessions": [
            {"sample": {"group_index": i, "label": f"l{i}"}, "sampling_params": {"max_tokens": i + 1}} for i in range(3)
        ]
    }
    response = httpx.post(batch, json=body, headers=ADMIN)
    assert response.status_code == 200, response.text
    sessions = response.json()["sessions"]
    assert (
        created(stack) == before + 3 and len({s["session_id"] for s in sessions} | {s["token"] for s in sessions}) == 6
    )
    for i, session in enumerate(sessions):  # in order: each answer is its own entry's session
        assert (
            chat(session["base_url"], {"messages": USER, "max_tokens": 50}).json()["usage"]["completion_tokens"]
            == i + 1
        )
        (sample,) = finish(stack, session)
        assert (sample.group_index, sample.label) == (i, f"l{i}")
    # One bad entry opens none of them, and the error names it.
    body["sessions"][1]["sampling_params"] = {"temperature": -1}
    error = error_of(httpx.post(batch, json=body, headers=ADMIN), 400)
    assert error["param"] == "sessions[1].sampling_params.temperature" and "sessions[1]" in error["message"]
    error_of(httpx.post(batch, json={"sessions": []}, headers=ADMIN), 400)
    error_of(httpx.post(batch, json={"sessions": [{"metadata": {}, "extra": 1}]}, headers=ADMIN), 400)
    error_of(httpx.post(batch, json={"sessions": [{}]}), 401)  # an API key is configured
    assert created(stack) == before + 3


def test_idle_sessions_expire_into_kept_samples(module_procs, stack):
    proxy = module_procs.proxy(stack.router.url, stack.model, "--proxy-session-timeout", "0.5")
    session = httpx.post(proxy.url + "/sessions", json={}).json()  # no API key on this proxy
    assert chat(session["base_url"], {"messages": USER, "max_tokens": 2}).status_code == 200
    url = f"{proxy.url}/sessions/{session['session_id']}"
    deadline = time.monotonic() + 30
    while not httpx.get(url).json()["finished"]:
        assert time.monotonic() < deadline, "the session never expired"
        time.sleep(0.2)
    (sample,) = httpx.get(url + "/samples").json()["samples"]
    assert sample["metadata"]["expired"] is True and sample["response_length"] == 2
    assert error_of(chat(session["base_url"], {"messages": USER}), 409)["code"] == "session_finished"
    metrics = httpx.get(proxy.url + "/metrics").text
    assert "inverted_proxy_sessions_expired_total 1.0" in metrics
    assert "inverted_proxy_turns_total 1.0" in metrics
    assert (
        'inverted_proxy_rejected_total{route="/sessions/{session_id}/v1/chat/completions",status="409"} 1.0' in metrics
    )


def test_a_session_returns_whole_samples_of_the_task_it_was_opened_for(stack):
    """The task's identity goes in when the session opens; what comes out is whole (no patching by
    the caller), and ``only_last`` answers with the episode's Sample: the last branch."""
    task = {"group_index": 3, "index": 1, "prompt": "the task's prompt", "label": "x", "metadata": {"task": "t"}}
    session = new_session(stack, sample=task, metadata={"episode": "e"})
    edited = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "an edited reply"},
        {"role": "user", "content": "hello"},
    ]
    for messages in ([{"role": "user", "content": "hi"}], edited):  # the second does not extend the first's
        body = {"messages": messages, "max_tokens": 2}  # reply: a second branch, of the same task
        assert chat(session["base_url"], body).status_code == 200
    response = httpx.post(
        f"{stack.proxy.url}/sessions/{session['session_id']}/finish",
        headers=ADMIN,
        json={"reward": 1.0, "only_last": True},
    )
    (sample,) = [Sample.from_json(s) for s in response.json()["samples"]]
    assert (sample.group_index, sample.index, sample.label, sample.reward) == (3, 1, "x", 1.0)
    assert sample.prompt == edited  # what the policy saw, not the task's text
    assert {k: sample.metadata[k] for k in ("task", "episode", "branch", "branches")} == {
        "task": "t",
        "episode": "e",
        "branch": 1,
        "branches": 2,
    }
    assert len(finish(stack, session)) == 2  # every branch is still kept
    bad = {"sessions": [{"sample": {"group_index": "three"}}]}
    assert (
        error_of(httpx.post(stack.proxy.url + "/sessions/batch", json=bad, headers=ADMIN), 400)["param"]
        == "sessions[0].sample"
    )
