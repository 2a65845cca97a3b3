"""Rollout routing replay's record: a multi-turn session through the proxy keeps each token's experts.

A MoE engine started with ``--enable-return-routed-experts`` behind the real sgl-router, and a proxy
with ``--return-routed-experts``. The router would drop the request field, so the proxy calls the
router's workers itself; each turn asks only for the tokens the earlier turns did not cover
(``routed_experts_start_len``), and the Sample joins the turns' parts into one record that equals
the engine's routing of the whole sequence.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import torch

from inverted.hf_checkpoint import ModelSpec, checkpoint_tensors
from inverted.train.weight_sync import TensorTransport, WeightSync
from inverted.types import Sample

ADMIN = {"Authorization": "Bearer admin-key"}


def experts(record: str, spec: ModelSpec) -> np.ndarray:
    return np.frombuffer(base64.b64decode(record), dtype="<i4").reshape(-1, spec.num_layers, spec.moe_top_k)


def three_turns(proxy_url: str, before_turn=lambda turn: None) -> Sample:
    """A three-turn chat through a proxy session (``before_turn(i)`` runs before turn i); its Sample."""
    session = httpx.post(proxy_url + "/sessions", json={}, headers=ADMIN).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="anything")
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    for turn, question in enumerate(("And tomorrow?", "And the day after?", None)):
        before_turn(turn)
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if question:
            messages.append({"role": "user", "content": question})
    finished = httpx.post(f"{proxy_url}/sessions/{session['session_id']}/finish", headers=ADMIN).json()
    (sample,) = [Sample.from_json(s) for s in finished["samples"]]
    assert len(sample.metadata["turns"]) == 3
    return sample


def served_routing(engine_url: str, sample: Sample, spec: ModelSpec) -> np.ndarray:
    """The engine's routing of the Sample's whole sequence now (every token but the last)."""
    whole = httpx.post(
        engine_url + "/generate",
        timeout=60,
        json={"input_ids": sample.tokens, "return_routed_experts": True, "sampling_params": {"max_new_tokens": 1}},
    ).json()
    return experts(whole["meta_info"]["routed_experts"], spec)[: len(sample.tokens) - 1]


def test_a_three_turn_session_records_every_tokens_experts(module_procs, tiny_model):
    model = tiny_model("qwen3_moe")
    engine = module_procs.engine(model, "--enable-return-routed-experts")
    proxy = module_procs.proxy(
        module_procs.routed(engine).url, model, "--proxy-api-key", "admin-key", "--return-routed-experts"
    )
    sample = three_turns(proxy.url)
    spec = ModelSpec.from_checkpoint(model)
    got = experts(sample.rollout_routed_experts, spec)
    assert got.shape == (len(sample.tokens) - 1, spec.num_layers, spec.moe_top_k)
    assert np.array_equal(got, served_routing(engine.url, sample, spec))


def test_a_turn_after_a_weight_update_reads_the_whole_record_again(procs, tiny_model):
    """An async job's session across an update: the server flushed its prefix cache and ran the earlier
    turns again on the new weights, so their recorded experts are no longer what it used; the turn after
    the update replaces them with the server's own (before: the Sample joined the old weights' part to the
    new, and the trainer replayed the old routing under the new turn's tokens)."""
    model = tiny_model("qwen3_moe")
    engine = procs.engine(model, "--enable-return-routed-experts")
    proxy = procs.proxy(procs.routed(engine).url, model, "--proxy-api-key", "admin-key", "--return-routed-experts")
    sync = WeightSync(TensorTransport(torch.device("cpu")), [engine.url], buffer_size=1 << 20, pause_mode="retract")

    def update_before_the_second(turn: int) -> None:
        if turn == 1:
            asyncio.run(sync.update(checkpoint_tensors(tiny_model("qwen3_moe", seed=5)).items(), "1"))

    sample = three_turns(proxy.url, update_before_the_second)
    assert {"default", "1"} <= set(sample.weight_versions)
    spec = ModelSpec.from_checkpoint(model)
    assert np.array_equal(experts(sample.rollout_routed_experts, spec), served_routing(engine.url, sample, spec))
