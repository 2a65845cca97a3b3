"""Token recording through the real stack: openai SDK → proxy → sgl-router → embedded engine.

Every Sample is checked token by token against the engine's own request log, and its logprobs
against a ``transformers`` forward pass over the Sample's tokens.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inverted.types import Sample
from tests.kept_sets import assert_kept
from tests.rollout.proxy.scripted import CONVERSATION, TOOLS

pytestmark = pytest.mark.anyio
ADMIN = {"Authorization": "Bearer admin-key"}


def new_session(stack, **body) -> dict:
    response = httpx.post(stack.proxy.url + "/sessions", json=body, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def finish(stack, session) -> list[Sample]:
    response = httpx.post(f"{stack.proxy.url}/sessions/{session['session_id']}/finish", headers=ADMIN)
    assert response.status_code == 200, response.text
    return [Sample.from_json(s) for s in response.json()["samples"]]


def check_exact(sample: Sample, engine_log: list[dict]) -> None:
    """Each turn's prompt and output are what the engine received and produced; masks line up."""
    outputs: dict[tuple, list] = {}  # several requests share an input when n > 1
    for r in engine_log:
        outputs.setdefault(tuple(r["input_ids"]), []).append(r["output_ids"])
    turns = sample.metadata["turns"]
    start = turns[0]["start"]
    assert sample.response_length == len(sample.tokens) - start
    expected_mask = [0] * len(sample.tokens)
    for turn in turns:
        assert sample.tokens[turn["start"] : turn["end"]] in outputs[tuple(sample.tokens[: turn["start"]])]
        expected_mask[turn["start"] : turn["end"]] = [1] * (turn["end"] - turn["start"])
    assert sample.loss_mask == expected_mask[start:]
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)
    assert len(sample.weight_versions) == sample.response_length


def reference_logprobs(model_dir, sample: Sample) -> list[float]:
    """log_softmax at temperature 1 of every response token, by ``transformers``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(sample.tokens[1:])[:, None])[:, 0]
    return logprobs[sample.prompt_length - 1 :].tolist()


def metric(stack, name: str) -> float:
    for line in httpx.get(stack.proxy.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def reply_as_message(message) -> dict:
    return message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"})


def collect_stream(stream) -> tuple[dict, str, dict]:
    """Reassemble a streamed reply the way agent frameworks do; return (message, finish_reason, usage)."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(
                    call.index, {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, usage


async def acollect_stream(stream) -> tuple[dict, str, dict]:
    chunks = [chunk async for chunk in stream]
    return collect_stream(chunks)


EXPECTED = [
    ("tool_calls", "Paris"),
    ("tool_calls", "Rome"),
    ("stop", "Paris is sunny; Rome is rainy."),
    ("stop", "You are welcome."),
]


def check_reply(turn: int, message: dict, finish: str) -> None:
    reason, text = EXPECTED[turn]
    assert finish == reason
    if reason == "tool_calls":
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert call["function"]["arguments"] == f'{{"city": "{text}"}}'
        assert call["id"].startswith("call_") and not message.get("content")
    else:
        assert message["content"] == text and "tool_calls" not in message


def scripted_history(turn: int, replies: list[dict]) -> list[dict]:
    """The conversation up to assistant turn ``turn``, with the proxy's own replies echoed back."""
    history, k = [], 0
    for message in CONVERSATION:
        if message["role"] == "assistant":
            if k == turn:
                return history
            history.append(replies[k])
            k += 1
            continue
        message = copy.deepcopy(message)
        if message["role"] == "tool":  # answer the call id the proxy minted
            message["tool_call_id"] = replies[k - 1]["tool_calls"][0]["id"]
        history.append(message)
    raise AssertionError("no such turn")


@pytest.mark.parametrize("mode", ["sync", "sync-stream", "async", "async-stream"])
async def test_four_turn_tool_conversation_is_recorded_token_for_token(stack, mode):
    session = new_session(stack, sample={"group_index": 7, "index": 1, "label": "sunny"})
    logged_before = len(stack.engine_requests())
    kwargs = dict(model="policy", tools=TOOLS, temperature=0, max_tokens=64, logprobs=True)
    replies, usages = [], []
    sync_client = openai.OpenAI(base_url=session["base_url"], api_key="anything")
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="anything") as async_client:
        for turn in range(4):
            messages = scripted_history(turn, replies)
            if mode == "sync-stream":
                message, reason, usage = collect_stream(
                    sync_client.chat.completions.create(
                        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
                    )
                )
            elif mode == "async-stream":
                message, reason, usage = await acollect_stream(
                    await async_client.chat.completions.create(
                        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
                    )
                )
            else:
                create = sync_client.chat.completions.create if mode == "sync" else async_client.chat.completions.create
                reply = create(messages=messages, **kwargs)
                reply = await reply if mode == "async" else reply
                message, reason, usage = (
                    reply_as_message(reply.choices[0].message),
                    reply.choices[0].finish_reason,
                    reply.usage,
                )
            check_reply(turn, message, reason)
            replies.append(message)
            usages.append(usage)
    sync_client.close()

    (sample,) = finish(stack, session)
    engine_log = stack.engine_requests()[logged_before:]
    assert len(engine_log) == 4
    # The Sample is exactly the engine's last input + output, and every turn's input extends the
    # previous input + output unchanged: earlier turns were never re-encoded.
    assert sample.tokens == engine_log[-1]["input_ids"] + engine_log[-1]["output_ids"]
    for before, after in zip(engine_log, engine_log[1:]):
        prefix = before["input_ids"] + before["output_ids"]
        assert after["input_ids"][: len(prefix)] == prefix
    check_exact(sample, engine_log)
    turns = sample.metadata["turns"]
    for turn, usage in zip(turns, usages):
        assert usage.prompt_tokens == turn["start"] and usage.completion_tokens == turn["end"] - turn["start"]
    assert [t["finish_reason"] for t in turns] == [reason for reason, _ in EXPECTED]
    assert sample.weight_versions == ["default"] * sample.response_length
    assert (sample.group_index, sample.index, sample.label, sample.status) == (7, 1, "sunny", Sample.Status.COMPLETED)
    assert sample.prompt[0] == {"role": "system", "content": "You are a weather bot."}
    expected = reference_logprobs(stack.model, sample)
    got = [(lp, ref) for lp, ref, m in zip(sample.rollout_log_probs, expected, sample.loss_mask) if m]
    assert max(abs(a - b) for a, b in got) <= 1e-4


@pytest.mark.parametrize("stream", [False, True])
async def test_a_named_or_required_tool_choice_opens_the_call_for_the_model(stack, stream):
    """smolagents sends tool_choice "required". The proxy writes the call's opening after the
    generation prompt (masked out: the model did not sample it) and the model completes it. With one
    tool offered, "required" is that tool named: the opening holds its name too. (This taught model
    completes a call only where it learned one; a real model completes it anywhere.)"""
    session = new_session(stack)
    logged_before = len(stack.engine_requests())
    history = copy.deepcopy(CONVERSATION[:2])
    forced = {"type": "function", "function": {"name": "get_weather"}}
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x") as client:
        for choice in (forced, "required"):
            kwargs = dict(model="m", messages=history, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=40)
            if stream:
                message, reason, _ = await acollect_stream(await client.chat.completions.create(stream=True, **kwargs))
            else:
                reply = await client.chat.completions.create(**kwargs)
                message, reason = reply_as_message(reply.choices[0].message), reply.choices[0].finish_reason
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "get_weather" and reason == "tool_calls"
            assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} and not message.get("content")
    samples = finish(stack, session)
    tokenizer = AutoTokenizer.from_pretrained(stack.model)
    for sample in samples:
        opening = '<tool_call>\n{"name": "get_weather", "arguments":'
        check_exact(sample, stack.engine_requests()[logged_before:])
        start = sample.metadata["turns"][0]["start"]
        forced_ids = tokenizer.encode(opening, add_special_tokens=False)
        assert sample.tokens[start - len(forced_ids) : start] == forced_ids  # the prompt's end, mask 0
        assert "<tool_call>" not in tokenizer.decode(sample.tokens[start:])  # the model sampled the rest


async def test_response_format_is_served_by_constrained_decoding(stack):
    """The SDK's structured outputs (a pydantic model as a strict json_schema) and json_object."""

    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Rome"]
        sunny: bool

    session = new_session(stack)
    logged_before = len(stack.engine_requests())
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x") as client:
        reply = await client.chat.completions.parse(
            model="m", messages=[{"role": "user", "content": "Paris?"}], response_format=Weather, max_tokens=60, seed=3
        )
        assert isinstance(reply.choices[0].message.parsed, Weather)
        loose = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Rome?"}],
            response_format={"type": "json_object"},
            max_tokens=8,
            seed=3,
        )
        assert loose.choices[0].message.content.startswith("{")
    for sample in finish(stack, session):
        check_exact(sample, stack.engine_requests()[logged_before:])


async def test_constrained_tokens_are_recorded_with_the_policys_own_logprobs(stack, module_procs):
    """Under a grammar the servers' logprobs are the masked distribution's: a token the grammar forces
    scores ~0 where the policy may give it -10, an importance ratio of e^10 against the trainer. The
    proxy records the policy's own (the engine reports them), as ``transformers`` computes them;
    ``--proxy-constrained-tokens mask`` keeps such tokens out of the loss; ``constrained`` records what
    the servers return. The same seed samples the same tokens through each proxy."""

    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Rome"]
        sunny: bool

    proxies = {"policy": stack.proxy}
    for mode in ("mask", "constrained"):
        proxies[mode] = module_procs.proxy(
            stack.router.url, stack.model, "--proxy-api-key", "admin-key", "--proxy-constrained-tokens", mode
        )
    samples = {}
    for mode, proxy in proxies.items():
        session = httpx.post(proxy.url + "/sessions", json={}, headers=ADMIN).json()
        async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x") as client:
            reply = await client.chat.completions.parse(
                model="m",
                messages=[{"role": "user", "content": "Paris?"}],
                response_format=Weather,
                max_tokens=60,
                seed=5,
                temperature=1.0,
            )
            assert isinstance(reply.choices[0].message.parsed, Weather)
        answer = httpx.post(f"{proxy.url}/sessions/{session['session_id']}/finish", headers=ADMIN).json()
        (samples[mode],) = [Sample.from_json(s) for s in answer["samples"]]
    policy, masked, constrained = samples["policy"], samples["mask"], samples["constrained"]
    assert policy.tokens == masked.tokens == constrained.tokens
    assert [t["constrained"] for t in policy.metadata["turns"]] == ["policy"]
    reference = reference_logprobs(stack.model, policy)
    assert policy.loss_mask == [1] * policy.response_length
    # what the trainer's mismatch metric (train/train_rollout_logprob_abs_diff) sees, before and after
    after = sum(abs(a - b) for a, b in zip(policy.rollout_log_probs, reference)) / len(reference)
    before = sum(abs(a - b) for a, b in zip(constrained.rollout_log_probs, reference)) / len(reference)
    print(f"constrained tokens: mismatch {before:.4f} recording the servers' logprobs, {after:.2e} the policy's")
    assert max(abs(a - b) for a, b in zip(policy.rollout_log_probs, reference)) < 1e-4
    assert before > 0.1 and max(a - b for a, b in zip(constrained.rollout_log_probs, reference)) > 1.0
    assert all(a >= b - 1e-4 for a, b in zip(constrained.rollout_log_probs, reference))  # the mask only adds mass
    assert [t["constrained"] for t in masked.metadata["turns"]] == ["masked"]
    assert masked.loss_mask == [0] * masked.response_length and set(masked.rollout_log_probs) == {0.0}


def test_constrained_tokens_without_the_policys_logprobs_stay_out_of_the_loss():
    """Real SGLang reports only the masked distribution's logprobs (the field is the embedded engine's):
    read from such an answer, a constrained turn is recorded out of the loss rather than with them."""
    from inverted.rollout.proxy.generation import Sampled
    from inverted.rollout.proxy.recorder import recorded_logprobs
    from inverted.rollout.sglang_client import read_unconstrained_logprobs

    sglang_answer = {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-0.01, 5, None], [0.0, 6, None]]}}
    assert read_unconstrained_logprobs(sglang_answer) is None
    state = Sampled(ids=[5, 6], logprobs=[-0.01, 0.0], versions=["0", "0"], unconstrained=[None, None])
    assert recorded_logprobs(state, True, "policy") == ([0.0, 0.0], [0, 0], "masked")
    assert recorded_logprobs(state, True, "constrained") == ([-0.01, 0.0], [1, 1], "constrained")
    assert recorded_logprobs(state, False, "policy") == ([-0.01, 0.0], [1, 1], None)


async def test_logprobs_in_the_answer_are_the_recorded_ones_and_top_logprobs_are_transformers_top_k(stack):
    session = new_session(stack)
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x") as client:
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=12,
            logprobs=True,
            top_logprobs=3,
            seed=3,
            temperature=1.0,
        )
        (sample,) = finish(stack, session)
        content = reply.choices[0].logprobs.content
        answer = [t.logprob for t in content]
        assert answer == sample.rollout_log_probs[-len(answer) :] and len(answer) == reply.usage.completion_tokens
    model = AutoModelForCausalLM.from_pretrained(stack.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(stack.model)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([sample.tokens])).logits[0].float(), dim=-1)
    start = len(sample.tokens) - len(content) - 1  # the row that predicts the first answer token
    for i, entry in enumerate(content):
        values, ids = ref[start + i].topk(3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in ids.tolist()]
        assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, values.tolist())) <= 1e-4


async def test_an_agent_that_drops_a_middle_message_gets_a_second_exact_branch(stack):
    session = new_session(stack)
    logged_before = len(stack.engine_requests())
    branches_before = metric(stack, "inverted_proxy_branches_total")
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x") as client:
        replies = []
        for turn in range(3):
            reply = await client.chat.completions.create(
                model="m", messages=scripted_history(turn, replies), tools=TOOLS, temperature=0, max_tokens=64
            )
            replies.append(reply_as_message(reply.choices[0].message))
        # The agent compacts its history: the first tool result is gone.
        edited = [m for m in scripted_history(3, replies) if m.get("content") != "sunny, 24C"]
        await client.chat.completions.create(model="m", messages=edited, tools=TOOLS, temperature=0, max_tokens=16)

        first, second = finish(stack, session)
        engine_log = stack.engine_requests()[logged_before:]
        check_exact(first, engine_log)
        check_exact(second, engine_log)
        assert len(first.metadata["turns"]) == 3 and len(second.metadata["turns"]) == 2
        # The branch shares turn 1 (the Paris call), then continues from the edited history.
        shared = first.metadata["turns"][0]["end"]
        assert second.tokens[:shared] == first.tokens[:shared] and second.tokens[shared:] != first.tokens[shared:]
        assert metric(stack, "inverted_proxy_branches_total") == branches_before + 1


async def test_64_concurrent_sessions_are_each_exact(stack):
    logged_before = len(stack.engine_requests())

    async def episode(i: int) -> list[Sample]:
        session = await asyncio.to_thread(new_session, stack, sample={"index": i})
        async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x") as client:
            messages = [{"role": "user", "content": f"episode {i}: say something"}]
            for turn in range(2):
                reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=6, seed=i)
                messages += [reply_as_message(reply.choices[0].message), {"role": "user", "content": f"more {turn}"}]
            return await asyncio.to_thread(finish, stack, session)

    results = await asyncio.gather(*(episode(i) for i in range(64)))
    engine_log = stack.engine_requests()[logged_before:]
    assert len(engine_log) == 128
    for i, samples in enumerate(results):
        (sample,) = samples
        assert sample.index == i and len(sample.metadata["turns"]) == 2
        check_exact(sample, engine_log)


async def test_a_retried_call_is_answered_from_the_record(stack):
    session = new_session(stack)
    body = {"model": "m", "messages": [{"role": "user", "content": "retry me"}], "max_tokens": 5}
    url = session["base_url"] + "/chat/completions"
    first = httpx.post(url, json=body).json()
    logged = len(stack.engine_requests())
    replay = httpx.post(url, json=body, headers={"x-stainless-retry-count": "1"}).json()
    assert replay == first and len(stack.engine_requests()) == logged
    fresh = httpx.post(url, json=body).json()  # not marked a retry: sampled again, on a new branch
    assert fresh["id"] != first["id"] and len(stack.engine_requests()) == logged + 1
    assert len(finish(stack, session)) == 2


async def test_text_completions_extend_their_own_tokens(stack):
    session = new_session(stack)
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x") as client:
        logged_before = len(stack.engine_requests())
        first = await client.completions.create(
            model="m", prompt="Once upon a time", max_tokens=5, seed=1, logprobs=2
        )  # the legacy API's type: a count of top tokens
        prompt = "Once upon a time" + first.choices[0].text + " and then"
        await client.completions.create(model="m", prompt=prompt, max_tokens=5, seed=2)
        (sample,) = finish(stack, session)
        logprobs = first.choices[0].logprobs
        n = len(logprobs.tokens)
        assert logprobs.token_logprobs == sample.rollout_log_probs[:n]
        assert all(
            1 <= len(top) <= 2 and max(top.values()) >= lp
            for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs)
        )
        assert logprobs.text_offset[0] == len("Once upon a time")
        assert [b - a for a, b in zip(logprobs.text_offset, logprobs.text_offset[1:])] == [
            len(t) for t in logprobs.tokens[:-1]
        ]
        engine_log = stack.engine_requests()[logged_before:]
        assert (
            engine_log[1]["input_ids"][: len(engine_log[0]["input_ids"] + engine_log[0]["output_ids"])]
            == engine_log[0]["input_ids"] + engine_log[0]["output_ids"]
        )
        check_exact(sample, engine_log)


async def test_n_choices_become_branches(stack):
    session = new_session(stack)
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key="x") as client:
        logged_before = len(stack.engine_requests())
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "pick"}], n=3, max_tokens=4
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert reply.usage.completion_tokens == sum(
            len(r["output_ids"]) for r in stack.engine_requests()[logged_before:]
        )
        # The agent continues with choice 1: that branch grows, the others stay one turn long.
        messages = [
            {"role": "user", "content": "pick"},
            reply_as_message(reply.choices[1].message),
            {"role": "user", "content": "go on"},
        ]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        samples = finish(stack, session)
        assert sorted(len(s.metadata["turns"]) for s in samples) == [1, 1, 2]
        for sample in samples:
            check_exact(sample, stack.engine_requests()[logged_before:])


async def test_a_stream_the_client_abandons_records_nothing(stack):
    session = new_session(stack)
    url = session["base_url"] + "/chat/completions"
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "min_tokens": 400, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                if '"content"' in line and '"content": ""' not in line:
                    break  # tokens are flowing: hang up mid-turn
    info = f"{stack.proxy.url}/sessions/{session['session_id']}"
    for _ in range(100):
        state = httpx.get(info, headers=ADMIN).json()
        if state["inflight"] == 0:
            break
        await asyncio.sleep(0.05)
    assert (state["inflight"], state["turns"], state["branches"]) == (0, 0, 0)
    assert finish(stack, session) == []


async def test_a_cut_distribution_records_each_tokens_kept_set(stack):
    """An agent's ``top_p`` 0.9 over two calls: the proxy asks for sampling masks (with ``top_k`` 512, the
    finite bound SGLang needs for them), and every Sample keeps, for each sampled token, the set it was
    drawn from and its log-prob renormalised over that set, each equal to ``transformers``'
    recomputation; the tokens between the calls (the user's message) have none."""
    session = new_session(stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key="anything")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="policy", messages=messages, top_p=0.9, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And tomorrow?"},
    ]
    client.chat.completions.create(model="policy", messages=messages, top_p=0.9, max_tokens=8)
    client.close()
    samples = finish(stack, session)
    model = AutoModelForCausalLM.from_pretrained(stack.model, dtype=torch.float32)
    for sample in samples:
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([sample.tokens])).logits[0, sample.prompt_length - 1 : -1], dim=-1)
        kept = sample.kept_sets()
        assert kept is not None and len(kept) == sample.response_length
        for i, (token, mask, row, recorded) in enumerate(
            zip(sample.response_tokens, sample.loss_mask, probs, sample.rollout_log_probs)
        ):
            if not mask:
                assert kept[i] == [] and recorded == 0.0
                continue
            assert token in kept[i], i
            assert_kept(kept[i], row, {"top_p": 0.9, "top_k": 512})
            assert abs(recorded - float((row[token] / row[kept[i]].sum()).log())) <= 1e-4, i
    assert any(sample.loss_mask.count(0) for sample in samples)  # the user's message between the calls
