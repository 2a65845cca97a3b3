"""One context length for the servers and the proxy: a call without ``max_tokens`` gets the room its
prompt leaves, as OpenAI's API gives it."""

from __future__ import annotations

import json
import shutil

import httpx

from inverted.hf_checkpoint import DEFAULT_CONTEXT_CAP, context_length


def test_with_default_flags_a_call_without_max_tokens_gets_the_room_its_prompt_leaves(module_procs, tiny_model,
                                                                                      tmp_path):
    """The audit: SmolLM2 (max_position_embeddings 8192) behind default flags refused every call
    without max_tokens, since the engine held 4096 tokens and the proxy asked for 8192."""
    model = tmp_path / "long-model"
    shutil.copytree(tiny_model("qwen2"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    assert context_length(model) == DEFAULT_CONTEXT_CAP == 4096 and context_length(model, 300) == 300
    engine = module_procs.engine(model)  # no --context-length on either side
    proxy = module_procs.proxy(module_procs.routed(engine).url, model)
    session = httpx.post(proxy.url + "/sessions", json={}).json()
    assert httpx.get(engine.url + "/server_info").json()["context_length"] == 4096
    words = 4070  # the tiny tokenizer writes " a" as one token
    reply = httpx.post(session["base_url"] + "/chat/completions", timeout=120, json={
        "model": "m", "messages": [{"role": "user", "content": "a" + " a" * words}]})
    assert reply.status_code == 200, reply.text
    usage, finish = reply.json()["usage"], reply.json()["choices"][0]["finish_reason"]
    assert usage["prompt_tokens"] > 4000 and usage["prompt_tokens"] + usage["completion_tokens"] <= 4096
    assert finish == "stop" or usage["prompt_tokens"] + usage["completion_tokens"] == 4096  # cut off at the context
