"""Chat rendering and tool parsing: the bridge equals a full render, junctions are exact, and a
template that is not append-only is refused instead of spliced."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inverted.errors import InvalidRequest, ModelError
from inverted.hf_checkpoint import load_tokenizer
from inverted.rollout.proxy.apis.call import forced_call
from inverted.rollout.chat import ChatRenderer, HermesToolParser, Message, TemplateBreak, parse_messages
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
            sampled = ids[last_assistant[1]:]
            ids += renderer.bridge(messages[: last_assistant[0] + 1], messages[last_assistant[0] + 1: i], TOOLS, sampled)
        start = len(ids)
        full = renderer.encode(renderer.render(messages[: i + 1], TOOLS, generation_prompt=False))
        assert full[:start] == ids  # the prompt the engine would get equals the full render's prefix
        im_end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids += full[start: full.index(im_end, start) + 1]  # "sampled": the content and <|im_end|>
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
    tokenizer.chat_template = ("{% for m in messages %}{% if loop.last or m.role != 'assistant' %}"
                               "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    renderer = ChatRenderer(tokenizer)
    history = parse_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(TemplateBreak):
        renderer.bridge(history, [Message(role="user", content="c")], None, renderer.encode("b<|im_end|>"))


def test_hermes_tool_calls_are_parsed_and_malformed_ones_stay_text():
    parser = HermesToolParser()
    reply = parser.parse('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
                         '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert reply.content == "Let me check." and [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("f", '{"x": 1}'), ("g", "{}")]
    assert len({c.id for c in reply.tool_calls}) == 2
    assert parser.parse("<tool_call>\n{not json}\n</tool_call>").tool_calls == []
    assert parser.parse("plain").content == "plain"


def test_a_required_tool_choice_with_one_tool_names_it():
    """"required" with one tool offered can only mean that tool: its name is forced too (the model
    samples the arguments alone); with several, only the call's opening is."""
    two = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    assert forced_call("required", None, TOOLS) == "get_weather" == forced_call("named", "get_weather", two)
    assert forced_call("required", None, two) == ""
    assert forced_call("auto", None, TOOLS) is None


def test_a_chat_template_file_replaces_the_checkpoints_own(tiny_model, tmp_path):
    """--chat-template: a model whose own template renders no tools (SmolLM2's) gets one that does."""
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert ChatRenderer(AutoTokenizer.from_pretrained(tiny_model())).renders_tools
    assert not ChatRenderer(load_tokenizer(tiny_model(), plain)).renders_tools
    with pytest.raises(ModelError, match="--chat-template .*missing.jinja: cannot read it"):
        load_tokenizer(tiny_model(), tmp_path / "missing.jinja")


def test_messages_are_checked_where_they_enter():
    messages = parse_messages([{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]},
                               {"role": "tool", "tool_call_id": "1", "content": "ok"}])
    assert messages[0].role == "system" and messages[0].content == "be brief"
    echoed = parse_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "f", "arguments": '{"a":2,"b":1}'}}]}])
    assert echoed[0].key == messages[1].key  # ids and JSON formatting do not break the match
    for bad, param in [([{"role": "user"}], "messages.[0].content"),
                       ([{"role": "assistant", "tool_calls": [{"id": 1}]}], "messages.[0].tool_calls[0]"),
                       ("hi", "messages")]:
        with pytest.raises(InvalidRequest) as info:
            parse_messages(bad)
        assert info.value.param == param
