"""Rollout routing replay's record: a multi-turn session through the proxy keeps each token's experts.

A MoE engine started with ``--enable-return-routed-experts`` behind the real sgl-router, and a proxy
with ``--return-routed-experts``. The router would drop the request field, so the proxy calls the
router's workers itself; each turn asks only for the tokens the earlier turns did not cover
(``routed_experts_start_len``), and the Sample joins the turns' parts into one record that equals
the engine's routing of the whole sequence.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai

from inverted.hf_checkpoint import ModelSpec
from inverted.types import Sample

ADMIN = {"Authorization": "Bearer admin-key"}


def experts(record: str, spec: ModelSpec) -> np.ndarray:
    return np.frombuffer(base64.b64decode(record), dtype="<i4").reshape(-1, spec.num_layers, spec.moe_top_k)


def test_a_three_turn_session_records_every_tokens_experts(module_procs, tiny_model):
    model = tiny_model("qwen3_moe")
    engine = module_procs.engine(model, "--enable-return-routed-experts")
    proxy = module_procs.proxy(
        module_procs.routed(engine).url, model, "--proxy-api-key", "admin-key", "--return-routed-experts"
    )
    session = httpx.post(proxy.url + "/sessions", json={}, headers=ADMIN).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="anything")
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    for question in ("And tomorrow?", "And the day after?", None):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if question:
            messages.append({"role": "user", "content": question})
    finished = httpx.post(f"{proxy.url}/sessions/{session['session_id']}/finish", headers=ADMIN).json()
    (sample,) = [Sample.from_json(s) for s in finished["samples"]]
    assert len(sample.metadata["turns"]) == 3
    spec = ModelSpec.from_checkpoint(model)
    got = experts(sample.rollout_routed_experts, spec)
    assert got.shape == (len(sample.tokens) - 1, spec.num_layers, spec.moe_top_k)
    whole = httpx.post(
        engine.url + "/generate",
        timeout=60,
        json={"input_ids": sample.tokens, "return_routed_experts": True, "sampling_params": {"max_new_tokens": 1}},
    ).json()
    assert np.array_equal(got, experts(whole["meta_info"]["routed_experts"], spec)[: len(sample.tokens) - 1])
