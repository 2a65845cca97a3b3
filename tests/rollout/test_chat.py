"""Chat rendering and tool parsing: the bridge equals a full render, junctions are exact, a
template that is not append-only is refused instead of spliced, and the bridge renders a window
of the history that is exact for the templates models ship with."""

from __future__ import annotations

import random
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from inverted.errors import InvalidRequest, ModelError
from inverted.hf_checkpoint import load_tokenizer
from inverted.rollout.chat import (
    ChatRenderer,
    HermesToolParser,
    Message,
    ParsedMessages,
    TemplateBreak,
    parse_messages,
    window,
)
from inverted.rollout.proxy.apis.call import forced_call
from tests.rollout.proxy.scripted import CONVERSATION, TOOLS


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def renderer(request, tiny_model) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model(request.param)))


def test_bridging_turn_by_turn_equals_one_full_render(renderer):
    """With assistant ids equal to their own encoding, the bridged sequence is the full render."""
    messages = parse_messages(CONVERSATION)
    ids: list[int] = []
    last_assistant = None
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        if last_assistant is None:
            ids = renderer.prompt_ids(messages[:i], TOOLS)
        else:
            sampled = ids[last_assistant[1] :]
            ids += renderer.bridge(
                messages[: last_assistant[0] + 1], messages[last_assistant[0] + 1 : i], TOOLS, sampled
            )
        start = len(ids)
        full = renderer.encode(renderer.render(messages[: i + 1], TOOLS, generation_prompt=False))
        assert full[:start] == ids  # the prompt the engine would get equals the full render's prefix
        im_end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids += full[start : full.index(im_end, start) + 1]  # "sampled": the content and <|im_end|>
        last_assistant = (i, start)
    assert ids + renderer.encode("\n") == renderer.encode(renderer.render(messages, TOOLS, generation_prompt=False))


def test_junction_after_a_stop_token_and_after_a_cut_turn(renderer):
    history = parse_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    new = [Message(role="user", content="c")]
    decode = renderer.tokenizer.decode
    stopped = renderer.bridge(history, new, None, renderer.encode("b<|im_end|>"))
    cut = renderer.bridge(history, new, None, renderer.encode("b"))  # max_tokens hit before <|im_end|>
    assert decode(stopped) == "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
    assert decode(cut) == "<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_history_is_refused(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    # Like Qwen3's stock template dropping earlier reasoning: the render of a turn changes later.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last or m.role != 'assistant' %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(tokenizer)
    history = parse_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(TemplateBreak):
        renderer.bridge(history, [Message(role="user", content="c")], None, renderer.encode("b<|im_end|>"))


def test_hermes_tool_calls_are_parsed_and_malformed_ones_stay_text():
    parser = HermesToolParser()
    reply = parser.parse(
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    assert reply.content == "Let me check." and [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("f", '{"x": 1}'),
        ("g", "{}"),
    ]
    assert len({c.id for c in reply.tool_calls}) == 2
    assert parser.parse("<tool_call>\n{not json}\n</tool_call>").tool_calls == []
    assert parser.parse("plain").content == "plain"


def test_a_required_tool_choice_with_one_tool_names_it():
    """ "required" with one tool offered can only mean that tool: its name is forced too (the model
    samples the arguments alone); with several, only the call's opening is."""
    two = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    assert forced_call("required", None, TOOLS) == "get_weather" == forced_call("named", "get_weather", two)
    assert forced_call("required", None, two) == ""
    assert forced_call("auto", None, TOOLS) is None


def test_a_chat_template_file_replaces_the_checkpoints_own(tiny_model, tmp_path):
    """--chat-template: a model whose own template renders no tools (SmolLM2's) gets one that does."""
    plain = tmp_path / "plain.jinja"
    plain.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert ChatRenderer(AutoTokenizer.from_pretrained(tiny_model())).renders_tools
    assert not ChatRenderer(load_tokenizer(tiny_model(), plain)).renders_tools
    with pytest.raises(ModelError, match="--chat-template .*missing.jinja: cannot read it"):
        load_tokenizer(tiny_model(), tmp_path / "missing.jinja")


def test_messages_are_checked_where_they_enter():
    messages = parse_messages(
        [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "ok"},
        ]
    )
    assert messages[0].role == "system" and messages[0].content == "be brief"
    echoed = parse_messages(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "other", "type": "function", "function": {"name": "f", "arguments": '{"a":2,"b":1}'}}
                ],
            }
        ]
    )
    assert echoed[0].key == messages[1].key  # ids and JSON formatting do not break the match
    for bad, param in [
        ([{"role": "user"}], "messages.[0].content"),
        ([{"role": "assistant", "tool_calls": [{"id": 1}]}], "messages.[0].tool_calls[0]"),
        ("hi", "messages"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            parse_messages(bad)
        assert info.value.param == param


# ---- the bridge's window ----------------------------------------------------------------

TEMPLATES = Path(__file__).parent / "templates"  # as their authors ship them (templates/README.md)
COUNTING = (
    "{% if tools %}{{ tools | tojson }}{% endif %}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'tool' %}{% set ns.n = ns.n + 1 %}result {{ ns.n }}: {% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def random_conversation(rng: random.Random, turns: int) -> list[Message]:
    """A system prompt or not, then assistant turns: single or parallel tool calls answered by tool
    messages, or text (with reasoning, sometimes) answered by a new query; one tool, ``get_weather``."""
    messages = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.7 else []
    messages.append({"role": "user", "content": "Weather?"})
    for k in range(turns):
        if rng.random() < 0.6:
            calls = [
                {
                    "id": f"c{k}_{j}",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": f'{{"city": "c{k}"}}'},
                }
                for j in range(rng.choice((1, 1, 2)))
            ]
            messages.append(
                {
                    "role": "assistant",
                    "content": rng.choice(("", "Checking.", "<think>\nhm\n</think>\n\nOne sec.")),
                    "tool_calls": calls,
                }
            )
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": f"{k} degrees"} for c in calls]
        else:
            messages.append({"role": "assistant", "content": rng.choice(("Sunny.", "<think>\nok\n</think>\n\nRain."))})
            messages.append({"role": "user", "content": f"And on day {k}?"})
    return parse_messages(messages + [{"role": "assistant", "content": "Done."}])


def whole_history_bridge(renderer: ChatRenderer, history, new, sampled):
    try:
        return renderer._bridge(history, new, TOOLS, sampled, None)
    except TemplateBreak:
        return TemplateBreak


@pytest.fixture(params=["checkpoint", "qwen3", "llama3.1_json", "deepseek_v3", "counting"])
def template(request, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model())
    if request.param == "counting":
        tokenizer.chat_template = COUNTING
    elif request.param != "checkpoint":
        tokenizer.chat_template = (TEMPLATES / f"{request.param}.jinja").read_text()
    return request.param, ChatRenderer(tokenizer)


def test_the_bridge_over_a_window_equals_the_one_over_the_whole_history(template):
    """On random tool-using conversations, every bridge is what the whole history's renders give
    (ids, or a break). The shipped templates bridge over the window; one that numbers tool results
    across the conversation is found out by the probes and renders the whole history."""
    name, renderer = template
    assert renderer.windowed == (name != "counting")
    rng, compared = random.Random(0), 0
    for _ in range(12):
        messages = random_conversation(rng, 14)
        turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
        for i, j in zip(turns, turns[1:]):
            history, new = messages[: i + 1], messages[i + 1 : j]
            sampled = renderer.encode(messages[i].content + renderer.turn_end)
            try:
                whole = whole_history_bridge(renderer, history, new, sampled)
            except jinja2.TemplateError:
                continue  # Llama 3.1 refuses parallel calls: no bridge either way
            try:
                got = renderer.bridge(history, new, TOOLS, sampled)
            except TemplateBreak:
                got = TemplateBreak
            assert got == whole, (name, [m.role for m in history], [m.role for m in new])
            compared += 1
    assert compared >= 40


def test_a_bridge_renders_as_much_at_turn_200_as_at_turn_2(tiny_model):
    """The cost of a turn does not grow with the session: the bridge renders a window of the
    history (counted in messages handed to the template), not the history."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model())
    renderer = ChatRenderer(tokenizer)
    rendered: list[int] = []
    apply = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda messages, **kw: rendered.append(len(messages)) or apply(messages, **kw)
    messages = parse_messages(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
        + [
            m
            for k in range(200)
            for m in (
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": f"c{k}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": f"c{k}", "content": "ok"},
            )
        ]
    )
    per_turn = []
    for turn in (2, 200):
        last = 2 * turn  # the turn's assistant message
        rendered.clear()
        renderer.bridge(
            messages[: last + 1],
            messages[last + 1 : last + 2],
            TOOLS,
            renderer.encode(messages[last].content + renderer.turn_end),
        )
        per_turn.append(sum(rendered))
    assert per_turn[0] == per_turn[1] <= 2 * len(window(messages[:5])) + 1


def test_a_session_parses_only_what_its_next_request_appends():
    """Each request resends the whole history; what the last one sent is reused as parsed, and an
    edited history is parsed (and checked) whole."""
    last = ParsedMessages()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    sent = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    first = parse_messages(sent, last)
    resent = [dict(m) for m in sent] + [
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    ]  # new dicts, same values
    second = parse_messages(resent, last)
    assert (
        all(a is b for a, b in zip(first, second)) and second[2].tool_call_id == "c1"
    )  # its call was among the reused
    with pytest.raises(InvalidRequest) as info:
        parse_messages([{"role": "wizard", "content": "hi"}] + resent[1:], last)
    assert info.value.param == "messages.[0].role" and last.raw is resent  # kept as it was
    with pytest.raises(InvalidRequest):  # a tool message whose call an edited history no longer holds
        parse_messages([sent[0], {"role": "assistant", "content": "no call"}, resent[2]], last)
