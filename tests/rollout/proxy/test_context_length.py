"""One context length for the servers and the proxy: a call without ``max_tokens`` gets the room its
prompt leaves, as OpenAI's API gives it (less SGLang's 2-token margin)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from inverted.errors import ModelError
from inverted.hf_checkpoint import context_length


def test_with_default_flags_the_context_is_the_models_own_and_a_call_gets_the_room_its_prompt_leaves(
    module_procs, tiny_model, tmp_path
):
    """As in SGLang, ``--context-length 0`` is the model's own (12,288 here): Claude Code's 29k-token
    first request was refused behind default flags while it was capped at 4,096. A call without
    max_tokens gets the room its prompt leaves."""
    model = tmp_path / "long-model"
    shutil.copytree(tiny_model("qwen2"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 12288}))
    assert context_length(model) == 12288 and context_length(model, 300) == 300
    engine = module_procs.engine(model)  # no --context-length on either side
    proxy = module_procs.proxy(module_procs.routed(engine).url, model)
    session = httpx.post(proxy.url + "/sessions", json={}).json()
    info = httpx.get(engine.url + "/server_info").json()
    assert info["context_length"] == 12288 and info["max_total_num_tokens"] >= 12288
    words = 12200  # the tiny tokenizer writes " a" as one token
    reply = httpx.post(
        session["base_url"] + "/chat/completions",
        timeout=300,
        json={"model": "m", "messages": [{"role": "user", "content": "a" + " a" * words}]},
    )
    assert reply.status_code == 200, reply.text
    usage, finish = reply.json()["usage"], reply.json()["choices"][0]["finish_reason"]
    # the servers sample at most 2 short of the context (SGLang's rule: hf_checkpoint.room_after)
    assert usage["prompt_tokens"] > 12200 and usage["prompt_tokens"] + usage["completion_tokens"] <= 12286
    assert finish == "stop" or usage["prompt_tokens"] + usage["completion_tokens"] == 12286  # cut off there


def test_a_checkpoint_that_states_no_context_needs_the_flag(tiny_model, tmp_path):
    model = tmp_path / "no-context"
    shutil.copytree(tiny_model("qwen2"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "max_position_embeddings"}))
    with pytest.raises(ModelError, match="--context-length"):
        context_length(model)
    assert context_length(model, 2048) == 2048
