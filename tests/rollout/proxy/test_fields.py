"""Fields agents send by default, through the real stack: each one takes effect, or is accepted with
its reason on the turn's record and changes nothing that is sampled (the same request without it
gives the same Sample, token for token and logprob for logprob)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from inverted.rollout.proxy.apis import openai_responses
from tests.rollout.proxy.scripted import TOOLS
from tests.rollout.proxy.test_agent_apis import ANTHROPIC_TOOLS, RESPONSES_TOOLS, SYSTEM
from tests.rollout.proxy.test_recording import ADMIN, finish, new_session

ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]


def greedy(stack, **limit) -> dict:
    return new_session(stack, sampling_params={"temperature": 0, **(limit or {"max_tokens": 8})})


def recorded(stack, send, **limit) -> tuple[list[int], list[float], dict]:
    """One call in a fresh greedy session: the Sample's tokens, logprobs, and the turn's accepted fields."""
    session = greedy(stack, **limit)
    send(session)
    (sample,) = finish(stack, session)
    (turn,) = sample.metadata["turns"]
    return sample.tokens, sample.rollout_log_probs, turn.get("accepted", {})


def same_sample_with_reasons(
    stack, send, extra: dict, expected: set[str], headers: dict | None = None, **limit
) -> dict:
    plain = recorded(stack, lambda s: send(s, {}, {}), **limit)
    loaded = recorded(stack, lambda s: send(s, extra, headers or {}), **limit)
    # fp32 noise only: the second call's prompt may be served from the first's cached prefix
    assert loaded[0] == plain[0] and loaded[1] == pytest.approx(plain[1], abs=1e-5)
    assert set(loaded[2]) == expected, loaded[2]
    assert all(isinstance(reason, str) and len(reason) > 20 for reason in loaded[2].values())
    assert plain[2] == {}
    return loaded[2]


def test_chat_fields_sdks_send_by_default_are_accepted_with_reasons(stack):
    def send(session, extra, headers):
        client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
        client.chat.completions.create(
            model="gpt-5.2", messages=ASK, tools=TOOLS, extra_body=extra, extra_headers=headers
        )

    extra = {
        "reasoning_effort": "none",
        "verbosity": "low",
        "store": False,
        "user": "u1",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "parallel_tool_calls": False,
        "safety_identifier": "s",
        "metadata": {"a": "b"},
    }
    reasons = same_sample_with_reasons(stack, send, extra, set(extra))
    assert "no thinking mode" in reasons["reasoning_effort"]


def test_responses_fields_codex_and_agents_send_are_accepted_with_reasons(stack):
    def send(session, extra, headers):
        client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
        client.responses.create(
            model="gpt-6.1-sol",
            input=ASK,
            instructions=SYSTEM,
            tools=RESPONSES_TOOLS,
            extra_body=extra,
            extra_headers=headers,
        )

    extra = {
        "reasoning": {"effort": "low", "summary": "auto", "context": "all_turns"},
        "text": {"verbosity": "low"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "prompt_cache_key": "k",
        "client_metadata": {"x-codex-turn-metadata": "{}"},
        "parallel_tool_calls": False,
        "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    }
    same_sample_with_reasons(
        stack,
        send,
        extra,
        {
            "reasoning.effort",
            "reasoning.summary",
            "reasoning.context",
            "text.verbosity",
            "prompt_cache_key",
            "client_metadata",
            "parallel_tool_calls",
            "context_management",
        },
        headers={"x-codex-beta-features": "remote_compaction_v2"},
    )


def test_messages_fields_claude_code_sends_are_accepted_with_reasons(stack):
    deferred = {
        "name": "Later",
        "description": "loaded by a tool search",
        "input_schema": {"type": "object"},
        "defer_loading": True,
    }

    def send(session, extra, headers):
        client = anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="x", max_retries=0)
        system = [{"type": "text", "text": SYSTEM, **({"cache_control": {"type": "ephemeral"}} if extra else {})}]
        tools = ANTHROPIC_TOOLS + ([deferred] if extra else [])
        # the taught model ends its reply well within 64 tokens: the same reply under either limit
        client.messages.create(
            model="claude-opus-5-5",
            max_tokens=128000 if extra else 64,
            system=system,
            messages=ASK,
            tools=tools,
            extra_body=extra,
            extra_headers=headers,
            timeout=60,
        )

    extra = {
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": '{"session_id": "x"}'},
    }
    reasons = same_sample_with_reasons(
        stack,
        send,
        extra,
        {
            "thinking",
            "thinking.display",
            "output_config.effort",
            "context_management",
            "metadata",
            "cache_control",
            "defer_loading",
            "max_tokens",
        },
        headers={"anthropic-beta": "claude-code-20250219,effort-2025-11-24"},
        seed=0,
    )  # no session max_tokens: the request's own is what gets cut
    assert "of the 128000 tokens asked)" in reasons["max_tokens"]  # the limit it was cut to


@pytest.mark.parametrize(
    "api, field",
    [
        ("chat", "max_tokens"),
        ("chat", "max_completion_tokens"),
        ("responses", "max_output_tokens"),
        ("completions", "max_tokens"),
    ],
)
def test_a_reply_limit_past_the_context_is_cut_to_what_is_left_in_every_api(stack, api, field):
    """Qwen Code and opencode ask for 32,000 tokens, Kimi CLI for its whole window: the same Sample
    as a call without a limit (which gets the room its prompt leaves), with the cut on the turn."""

    def send(session, extra, headers):
        client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
        if api == "chat":
            client.chat.completions.create(model="qwen3-coder-plus", messages=ASK, extra_body=extra)
        elif api == "responses":
            client.responses.create(model="my-policy", input=ASK, extra_body=extra)
        else:
            client.completions.create(model="my-policy", prompt="Weather in Paris", extra_body=extra)

    reasons = same_sample_with_reasons(stack, send, {field: 10**6}, {field}, seed=0)
    assert "of the 1000000 tokens asked" in reasons[field]
    session = greedy(stack, seed=0)
    with pytest.raises(openai.BadRequestError) as info:  # a prompt that leaves no room is still refused
        openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "word " * 5000}], max_tokens=10
        )
    assert info.value.body["code"] == "context_length_exceeded"


def test_what_cannot_be_honoured_is_still_refused_by_name(stack):
    session = greedy(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    for extra, param in [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"verbosity": "loud"}, "verbosity"),
        ({"logit_bias": {"5": 3}}, "logit_bias"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=ASK, extra_body=extra)
        assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", include=["nonsense.field"])
    assert info.value.body["param"] == "include[0]"
    messages = anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        messages.messages.create(model="m", max_tokens=8, messages=ASK, extra_body={"thinking": {"type": "deep"}})
    assert "thinking" in info.value.body["error"]["message"]


def test_a_mid_conversation_system_message_is_rendered_where_it_stands(stack):
    """Claude Code sends ``role: system`` messages among the others (per-turn instructions)."""
    session = greedy(stack)
    client = anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="x")
    client.messages.create(
        model="m",
        max_tokens=8,
        messages=[*ASK, {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]}],
    )
    (sample,) = finish(stack, session)
    tokenizer = stack_tokenizer(stack)
    text = tokenizer.decode(sample.tokens[: sample.prompt_length])
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>system\nAnswer "
        "briefly.<|im_end|>\n<|im_start|>assistant\n"
    )


def stack_tokenizer(stack):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stack.model)


def test_count_tokens_answers_the_templates_count_and_records_nothing(stack):
    session = greedy(stack)
    client = anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="x")
    kwargs = dict(model="claude-haiku-5", system=SYSTEM, messages=ASK, tools=ANTHROPIC_TOOLS)
    counted = client.messages.count_tokens(**kwargs).input_tokens
    state = httpx.get(session["base_url"].removesuffix("/v1"), headers=ADMIN).json()
    assert state["turns"] == 0 and state["branches"] == 0
    client.messages.create(max_tokens=8, **kwargs)
    (sample,) = finish(stack, session)
    assert counted == sample.prompt_length
    # with the session's token as the key, as Claude Code sends it
    other = new_session(stack)
    by_token = httpx.post(
        stack.proxy.url + "/v1/messages/count_tokens",
        json={"model": "m", "messages": ASK},
        headers={"x-api-key": other["token"]},
    )
    assert by_token.status_code == 200 and by_token.json()["input_tokens"] > 0
    refused = httpx.post(
        stack.proxy.url + "/v1/messages/count_tokens",
        json={"model": "m", "messages": ASK, "max_tokens": 3},
        headers={"x-api-key": other["token"]},
    )
    assert refused.status_code == 400 and refused.json()["type"] == "error"


def test_codex_tools_in_input_items_render_as_the_same_functions(stack):
    """Codex's "responses lite" declares its tools in an ``additional_tools`` input item, in namespaces,
    with freeform ``custom`` tools: the model is shown functions (a custom tool's one string ``input``),
    and a custom call it makes is answered, and echoed back, as a ``custom_tool_call``."""
    custom = {
        "type": "custom",
        "name": "exec",
        "description": "Run code",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
    }
    lite = [
        {
            "type": "additional_tools",
            "role": "developer",
            "id": "at_1",
            "tools": [
                {"type": "namespace", "name": "functions", "description": "", "tools": [custom, RESPONSES_TOOLS[0]]}
            ],
        }
    ]
    flat = [
        {
            "type": "function",
            "name": "exec",
            "description": "Run code",
            "parameters": openai_responses.CUSTOM_PARAMETERS,
        },
        RESPONSES_TOOLS[0],
    ]

    def client(session: dict) -> openai.OpenAI:
        return openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)

    one = greedy(stack)
    client(one).responses.create(model="m", input=lite + ASK)
    two = greedy(stack)
    client(two).responses.create(model="m", input=ASK, tools=flat)
    (a,), (b,) = finish(stack, one), finish(stack, two)
    assert a.tokens[: a.prompt_length] == b.tokens[: b.prompt_length]
    assert set(a.metadata["turns"][0]["accepted"]) == {"tools[].format", "tools[].namespace"}
    # a custom call the model made comes back as custom_tool_call and its output: the branch continues
    req = openai_responses.parse(
        {
            "model": "m",
            "input": lite
            + ASK
            + [
                {"type": "custom_tool_call", "call_id": "call_1", "name": "exec", "input": "text(1)"},
                {"type": "custom_tool_call_output", "call_id": "call_1", "output": "1"},
            ],
        },
        None,
    )
    call = req.messages[-2].tool_calls[0]
    assert (call.name, json.loads(call.arguments)) == ("exec", {"input": "text(1)"})
    assert req.messages[-1].role == "tool" and req.messages[-1].content == "1"
    item = openai_responses._call_output("fc_1", call, req.echo, {})
    assert item == {
        "id": "fc_1",
        "type": "custom_tool_call",
        "status": "completed",
        "call_id": "call_1",
        "name": "exec",
        "input": "text(1)",
    }


THINKING_TEMPLATE_TAIL = (
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)


def thinking_template(model: Path, out: Path) -> Path:
    """Our template with Qwen3's switch: ``enable_thinking=False`` writes an empty think block."""
    template = (model / "chat_template.jinja").read_text()
    plain_tail = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    assert plain_tail in template
    out.write_text(template.replace(plain_tail, THINKING_TEMPLATE_TAIL))
    return out


def test_effort_sets_a_templates_thinking_switch(stack, module_procs, tmp_path):
    proxy = module_procs.proxy(
        stack.router.url,
        stack.model,
        "--chat-template",
        str(thinking_template(stack.model, tmp_path / "thinking.jinja")),
    )
    prompts = {}
    for effort in ("none", "high", None):
        session = httpx.post(proxy.url + "/sessions", json={"sampling_params": {"max_tokens": 4}}).json()
        extra = {"reasoning": {"effort": effort}} if effort else {}
        openai.OpenAI(base_url=session["base_url"], api_key="x").responses.create(
            model="m", input=ASK, extra_body=extra
        )
        (sample,) = [s for s in httpx.post(f"{proxy.url}/sessions/{session['session_id']}/finish").json()["samples"]]
        prompts[effort] = stack_tokenizer(stack).decode(
            sample["tokens"][: len(sample["tokens"]) - sample["response_length"]]
        )
        assert "reasoning.effort" not in sample["metadata"]["turns"][0].get("accepted", {})
    assert prompts["none"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompts["high"].endswith("<|im_start|>assistant\n") and prompts["high"] == prompts[None]


OFF_SWITCHES = [
    {"thinking": {"type": "disabled"}},
    {"enable_thinking": False},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"reasoning": {"effort": "none"}},
    {"reasoning_effort": "none", "thinking": {"type": "disabled"}},
]
ON_SWITCHES = [
    {"thinking": {"type": "enabled", "budget_tokens": 2048}},
    {"enable_thinking": True},
    {"chat_template_kwargs": {"thinking": True}},
    {"reasoning": {"enabled": True, "exclude": False}},
]


def test_every_vendors_thinking_switch_sets_the_templates_in_chat(stack, module_procs, tmp_path):
    """Kimi CLI sends Moonshot's ``thinking: {type: disabled}`` by default; DashScope's, vLLM's and
    OpenRouter's spellings mean the same switch."""
    proxy = module_procs.proxy(
        stack.router.url,
        stack.model,
        "--chat-template",
        str(thinking_template(stack.model, tmp_path / "thinking.jinja")),
    )
    tokenizer = stack_tokenizer(stack)

    def prompt(extra: dict) -> tuple[str, dict]:
        session = httpx.post(proxy.url + "/sessions", json={"sampling_params": {"max_tokens": 2}}).json()
        openai.OpenAI(base_url=session["base_url"], api_key="x").chat.completions.create(
            model="kimi-for-coding", messages=ASK, extra_body=extra
        )
        (sample,) = httpx.post(f"{proxy.url}/sessions/{session['session_id']}/finish").json()["samples"]
        return (
            tokenizer.decode(sample["tokens"][: len(sample["tokens"]) - sample["response_length"]]),
            sample["metadata"]["turns"][0].get("accepted", {}),
        )

    plain, _ = prompt({})
    for extra in OFF_SWITCHES:
        text, accepted = prompt(extra)
        assert text == plain + "<think>\n\n</think>\n\n", extra
        assert not set(accepted) & {"thinking", "enable_thinking", "chat_template_kwargs", "reasoning_effort"}
    for extra in ON_SWITCHES:
        text, accepted = prompt(extra)
        assert text == plain, extra
    assert set(prompt(ON_SWITCHES[0])[1]) == {"thinking.budget_tokens"}
    assert set(prompt(ON_SWITCHES[3])[1]) == {"reasoning.exclude"}
    session = httpx.post(proxy.url + "/sessions", json={}).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    for extra, param in [
        ({"enable_thinking": False, "thinking": {"type": "enabled"}}, "thinking"),
        ({"chat_template_kwargs": {"tools_in_user_message": True}}, "chat_template_kwargs.tools_in_user_message"),
        ({"thinking": {"type": "deep"}}, "thinking"),
        ({"enable_thinking": "no"}, "enable_thinking"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=ASK, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body


def test_a_thinking_switch_on_a_template_without_one_is_accepted_with_its_reason(stack):
    """Kimi CLI's default request, on a model whose template has no thinking mode: each field says why."""

    def send(session, extra, headers):
        openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0).chat.completions.create(
            model="kimi-for-coding", messages=ASK, extra_body=extra
        )

    reasons = same_sample_with_reasons(
        stack, send, {"thinking": {"type": "disabled"}, "enable_thinking": False}, {"thinking", "enable_thinking"}
    )
    assert all("no thinking mode" in reason for reason in reasons.values())


def test_side_calls_are_their_own_branches_and_not_the_episode(stack):
    """A harness's call to another model (a title, a quota probe) in the same session is recorded as its
    own branch with the model it named; the episode's Sample is the main model's last branch."""

    def session_with_a_side_call() -> dict:
        session = greedy(stack)
        client = openai.OpenAI(base_url=session["base_url"], api_key="x")
        first = client.chat.completions.create(model="main-model", messages=ASK, tools=TOOLS)
        client.chat.completions.create(model="small-model", messages=[{"role": "user", "content": "Title?"}])
        reply = first.choices[0].message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"})
        client.chat.completions.create(
            model="main-model", tools=TOOLS, messages=ASK + [reply, {"role": "user", "content": "Thanks!"}]
        )
        return session

    session = session_with_a_side_call()
    everything = finish(stack, session)
    assert [(s.metadata["model"], s.metadata["side_call"], len(s.metadata["turns"])) for s in everything] == [
        ("main-model", False, 2),
        ("small-model", True, 1),
    ]
    for only_last, side_calls, expected in [(True, False, "main-model"), (True, True, "small-model")]:
        session = session_with_a_side_call()
        answer = httpx.post(
            f"{stack.proxy.url}/sessions/{session['session_id']}/finish",
            headers=ADMIN,
            json={"only_last": only_last, "side_calls": side_calls},
        ).json()
        assert [s["metadata"]["model"] for s in answer["samples"]] == [expected]
    assert [(s.metadata["lineage"], s.metadata["parent"]) for s in everything] == [("main", None), ("side", 0)]


def test_a_title_written_first_by_the_same_model_is_not_the_episode(stack):
    """opencode asks its own model for the thread's title (a system prompt of its own, no tools) before
    the agent's first call: the main lineage is the one offered tools, the title a subagent of it."""
    session = greedy(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key="x")
    client.chat.completions.create(
        model="my-policy",
        messages=[{"role": "system", "content": "You are a title generator. You output ONLY a thread title."}, *ASK],
    )
    agent = [{"role": "system", "content": SYSTEM}, *ASK]
    first = client.chat.completions.create(model="my-policy", messages=agent, tools=TOOLS)
    reply = first.choices[0].message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"})
    client.chat.completions.create(
        model="my-policy", messages=agent + [reply, {"role": "user", "content": "Thanks!"}], tools=TOOLS
    )
    everything = finish(stack, session)
    assert [(s.metadata["lineage"], s.metadata["side_call"], len(s.metadata["turns"])) for s in everything] == [
        ("subagent", True, 1),
        ("main", False, 2),
    ]


def test_a_subagent_of_the_main_model_is_its_own_lineage_and_not_the_episode(stack):
    """Qwen Code, after its main turn, calls the same model as a memory-extraction subagent with its own
    system prompt and the whole transcript: that branch is a subagent with its parent named, and the
    episode's Sample stays the agent's own trajectory. A main branch forked by an edited history stays
    main."""
    session = greedy(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key="x")
    main = [{"role": "system", "content": SYSTEM}, *ASK]
    first = client.chat.completions.create(model="qwen3-coder-plus", messages=main, tools=TOOLS)
    reply = first.choices[0].message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"})
    client.chat.completions.create(
        model="qwen3-coder-plus", messages=main[:1] + [{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS
    )  # an edited history: a main branch
    client.chat.completions.create(
        model="qwen3-coder-plus",
        messages=[
            {"role": "system", "content": "You are a memory extraction agent. Save durable facts."},
            {"role": "user", "content": json.dumps(main + [reply])},
        ],
    )
    everything = finish(stack, session)
    assert [(s.metadata["lineage"], s.metadata["parent"], s.metadata["side_call"]) for s in everything] == [
        ("main", None, False),
        ("main", None, False),
        ("subagent", 1, True),
    ]
    again = greedy(stack)
    client = openai.OpenAI(base_url=again["base_url"], api_key="x")
    client.chat.completions.create(model="qwen3-coder-plus", messages=main, tools=TOOLS)
    client.chat.completions.create(
        model="qwen3-coder-plus",
        messages=[
            {"role": "system", "content": "You are a memory extraction agent. Save durable facts."},
            {"role": "user", "content": "Summarize."},
        ],
    )
    episode = httpx.post(
        f"{stack.proxy.url}/sessions/{again['session_id']}/finish", headers=ADMIN, json={"only_last": True}
    ).json()["samples"]
    assert [(s["metadata"]["lineage"], s["metadata"]["branch"]) for s in episode] == [("main", 0)]
