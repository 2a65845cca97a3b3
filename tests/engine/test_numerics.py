"""The engine's numbers against an independent reference: Hugging Face ``transformers``; for MoE
models, also the experts its router picked for every token."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from inverted.engine.config import EngineConfig
from inverted.engine.server import Engine
from inverted.errors import ModelError
from tests.conftest import ARCHS, BACKENDS, MOE_ARCHS
from tests.engine.test_prefix_reuse import metric

ALL = ARCHS + MOE_ARCHS
# What real SGLang 0.5.23 answers on a CPU (docs/sglang-differences.md): the capturer's host buffer is pinned by CUDA.
SGLANG_MOE = {
    "qwen3_moe": "real SGLang's CPU path serves Qwen3-MoE with wrong numbers: every log-prob is -log(vocab) (uniform)",
    "qwen2_moe": "real SGLang's Qwen2-MoE shared-expert gate is a Triton kernel (fused_gate_sigmoid_mul_add): no CPU "
    "device",
}
SGLANG_ROUTED_EXPERTS = (
    "real SGLang cannot capture routed experts without CUDA: --enable-return-routed-experts dies at "
    "start-up in torch.cuda.cudart() (mem_cache/pool_host/common.py:147, _cuda_host_register)"
)


class Servers(dict):
    """One server of a backend per architecture, started on first use and kept for the module."""

    def __init__(self, backend: str, procs, tiny_model):
        super().__init__()
        self.backend, self.procs, self.tiny_model = backend, procs, tiny_model

    def __missing__(self, arch: str) -> str:
        if self.backend == "sglang" and arch in SGLANG_MOE:
            pytest.skip(SGLANG_MOE[arch])
        routes = ["--enable-return-routed-experts"] if arch in MOE_ARCHS and self.backend == "embedded" else []
        self[arch] = self.procs.server(self.backend, self.tiny_model(arch), *routes).url
        return self[arch]


@pytest.fixture(scope="module", params=BACKENDS)
def engines(request, module_procs, tiny_model):
    """The embedded engine's servers, then real SGLang's (the reference), by architecture."""
    return Servers(request.param, module_procs, tiny_model)


def hf_logprobs(model_dir, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at every position, from transformers in fp32: row i predicts token i+1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("arch", ALL)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_and_prompt_logprobs_equal_transformers(engines, tiny_model, arch, temperature):
    prompt = [5, 17, 300, 42, 999, 7, 64, 128, 256, 11]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 40, "temperature": temperature, "ignore_eos": True, "sampling_seed": 3},
    }
    out = httpx.post(engines[arch] + "/generate", json=body, timeout=60).json()
    output_ids = out["output_ids"]
    assert len(output_ids) == 40
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == output_ids
    ref = hf_logprobs(tiny_model(arch), prompt + output_ids, temperature)
    positions = range(len(prompt) - 1, len(prompt) + len(output_ids) - 1)
    expected = torch.tensor([ref[p, (prompt + output_ids)[p + 1]].item() for p in positions])
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert (got - expected).abs().max().item() <= 1e-4
    # Prompt logprobs (logprob_start_len=0): the first has no context and is null, as in SGLang.
    in_lps = meta["input_token_logprobs"]
    assert [t for _, t, _ in in_lps] == prompt and in_lps[0][0] is None
    raw = hf_logprobs(tiny_model(arch), prompt)
    expected_in = torch.tensor([raw[i - 1, prompt[i]].item() for i in range(1, len(prompt))])
    assert (torch.tensor([lp for lp, _, _ in in_lps[1:]]) - expected_in).abs().max().item() <= 1e-4
    # From a later start too, SGLang reports no log-prob for the first position it returns.
    later = httpx.post(engines[arch] + "/generate", json={**body, "logprob_start_len": 4}, timeout=60).json()
    in_lps = later["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in in_lps] == prompt[4:] and in_lps[0][0] is None
    assert (torch.tensor([lp for lp, _, _ in in_lps[1:]]) - expected_in[4:]).abs().max().item() <= 1e-4


def test_top_logprobs_are_transformers_top_k(engines, tiny_model):
    prompt = [5, 17, 300, 42, 999, 7]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 5,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.7, "ignore_eos": True, "sampling_seed": 4},
    }
    meta = httpx.post(engines["qwen2"] + "/generate", json=body, timeout=60).json()["meta_info"]
    output_ids = [t for _, t, _ in meta["output_token_logprobs"]]
    ref = hf_logprobs(tiny_model("qwen2"), prompt + output_ids, 0.7)
    assert len(meta["output_top_logprobs"]) == len(output_ids)
    for i, row in enumerate(meta["output_top_logprobs"]):
        values, ids = ref[len(prompt) - 1 + i].topk(5)
        assert [t for _, t, _ in row] == ids.tolist()
        assert max(abs(lp - v) for (lp, _, _), v in zip(row, values.tolist())) <= 1e-4
        assert all(isinstance(text, str) for _, _, text in row)
    raw = hf_logprobs(tiny_model("qwen2"), prompt)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(prompt)
    for i, row in enumerate(meta["input_top_logprobs"][1:], start=1):
        assert [t for _, t, _ in row] == raw[i - 1].topk(5).indices.tolist()
    none = httpx.post(engines["qwen2"] + "/generate", json={**body, "top_logprobs_num": -1}, timeout=60).json()
    assert "output_top_logprobs" not in none["meta_info"] or not any(none["meta_info"]["output_top_logprobs"])
    if engines.backend == "embedded":  # its cost bound (docs/sglang-differences.md)
        bad = httpx.post(engines["qwen2"] + "/generate", json={**body, "top_logprobs_num": 101}, timeout=60)
        assert bad.status_code == 400 and "top_logprobs_num" in bad.text


def test_token_ids_logprob_are_transformers_logprobs_of_those_ids(engines, tiny_model):
    """SGLang's ``token_ids_logprob``: the named ids' log-probs at every position, prompt and output,
    from the distribution the token was drawn from; a list for every prompt, or one list per prompt."""
    prompts, named = [[5, 17, 300, 42], [999, 7, 8]], [[5, 700, 3], [1, 2]]
    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": named,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True, "sampling_seed": 3},
    }
    answers = httpx.post(engines["qwen2"] + "/generate", json=body, timeout=60).json()
    for prompt, ids, answer in zip(prompts, named, answers):
        meta = answer["meta_info"]
        output_ids = answer["output_ids"]
        ref = hf_logprobs(tiny_model("qwen2"), prompt + output_ids, 0.7)
        assert len(meta["output_token_ids_logprobs"]) == len(output_ids)
        for i, row in enumerate(meta["output_token_ids_logprobs"]):
            assert [t for _, t, _ in row] == ids and all(isinstance(text, str) for _, _, text in row)
            assert max(abs(lp - ref[len(prompt) - 1 + i, t].item()) for lp, t, _ in row) <= 1e-4
        raw = hf_logprobs(tiny_model("qwen2"), prompt)
        assert meta["input_token_ids_logprobs"][0] is None and len(meta["input_token_ids_logprobs"]) == len(prompt)
        for i, row in enumerate(meta["input_token_ids_logprobs"][1:], start=1):
            assert max(abs(lp - raw[i - 1, t].item()) for lp, t, _ in row) <= 1e-4
    one = {**body, "input_ids": prompts[0], "token_ids_logprob": named[0]}
    single = httpx.post(engines["qwen2"] + "/generate", json=one, timeout=60).json()["meta_info"]
    assert [[t for _, t, _ in row] for row in single["output_token_ids_logprobs"]] == [named[0]] * 6
    unasked = httpx.post(engines["qwen2"] + "/generate", json={**one, "return_logprob": False}, timeout=60).json()
    assert "output_token_ids_logprobs" not in unasked["meta_info"]
    n2 = {**body, "sampling_params": {**body["sampling_params"], "n": 2}}
    refused = httpx.post(engines["qwen2"] + "/generate", json=n2, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "Cannot use list token_ids_logprob with parallel_sample_num > 1"


@pytest.mark.parametrize("arch", ALL)
def test_greedy_equals_transformers_generate(engines, tiny_model, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32).eval()
    for prompt in ([1, 2, 3, 4, 5], [700, 12, 33], list(range(100, 160))):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48)[0, len(prompt) :].tolist()
        out = httpx.post(
            engines[arch] + "/generate",
            timeout=60,
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 0}},
        ).json()
        assert out["output_ids"] == ref, f"prompt {prompt}"
        eos = set(model.generation_config.eos_token_id)
        if ref[-1] in eos:  # stopped on EOS: the stop token is in output_ids, as SGLang returns it
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[-1]}
        else:
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 48}


def routed(meta: dict, config) -> np.ndarray:
    """SGLang's ``routed_experts``: base64 of little-endian int32 ``[tokens - 1, layers, top_k]``."""
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    return raw.reshape(-1, config.num_hidden_layers, config.num_experts_per_tok)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routed_experts_are_the_experts_transformers_routes_each_token_to(engines, tiny_model, arch):
    if engines.backend == "sglang":
        pytest.skip(SGLANG_ROUTED_EXPERTS)
    config = AutoConfig.from_pretrained(tiny_model(arch))
    prompt = list(range(40, 90))
    body = {
        "input_ids": prompt,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5},
    }
    first = httpx.post(engines[arch] + "/generate", json=body, timeout=60).json()
    tokens = prompt + first["output_ids"]
    got = routed(first["meta_info"], config)
    assert got.shape == (len(tokens) - 1, config.num_hidden_layers, config.num_experts_per_tok)
    model = AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32).eval()
    with torch.no_grad():  # every token but the last sampled one went through the model
        routers = model(torch.tensor([tokens[:-1]]), output_router_logits=True).router_logits
    expected = torch.stack([r.topk(config.num_experts_per_tok, dim=-1).indices for r in routers], dim=1)
    assert np.array_equal(got, expected.numpy())
    # The same prompt again is a fork (it copies the whole prompt and samples from the state the first
    # kept, computing none of it): the same tokens under the same seed, and the same record, the prompt's
    # last position included.
    computed = metric(engines[arch], "inverted:prefill_tokens_total")
    fork = httpx.post(engines[arch] + "/generate", json=body, timeout=60).json()
    assert metric(engines[arch], "inverted:prefill_tokens_total") == computed
    assert fork["output_ids"] == first["output_ids"] and np.array_equal(routed(fork["meta_info"], config), got)
    # A second request continuing the first copies its cached prefix, routing included.
    again = httpx.post(engines[arch] + "/generate", timeout=60, json={**body, "input_ids": tokens}).json()
    assert again["meta_info"]["cached_tokens"] > 0
    assert np.array_equal(routed(again["meta_info"], config)[: len(tokens) - 1], got)
    # routed_experts_start_len: only [start, tokens - 1), what a later turn adds to an earlier one's record
    later = httpx.post(
        engines[arch] + "/generate",
        timeout=60,
        json={**body, "input_ids": tokens, "routed_experts_start_len": len(tokens) - 1},
    ).json()
    assert np.array_equal(routed(later["meta_info"], config), routed(again["meta_info"], config)[len(tokens) - 1 :])
    # Streaming returns them once, with the last chunk.
    with httpx.stream("POST", engines[arch] + "/generate", json={**body, "stream": True}, timeout=60) as response:
        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert ["routed_experts" in chunk for chunk in chunks] == [False] * (len(chunks) - 1) + [True]


def test_routed_experts_need_the_flag_and_a_moe_model(engines, tiny_model):
    body = {"input_ids": [1, 2, 3], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}}
    asked = httpx.post(engines["qwen2"] + "/generate", json=body, timeout=60)
    if engines.backend == "sglang":  # it leaves them out; the embedded engine refuses (docs/sglang-differences.md)
        assert asked.status_code == 200 and "routed_experts" not in asked.json()["meta_info"]
    else:
        assert asked.status_code == 400 and "--enable-return-routed-experts" in asked.text
    if engines.backend == "sglang":
        return
    plain = httpx.post(engines["qwen3_moe"] + "/generate", json={**body, "return_routed_experts": False}, timeout=60)
    assert "routed_experts" not in plain.json()["meta_info"]
    past = httpx.post(engines["qwen3_moe"] + "/generate", json={**body, "routed_experts_start_len": 4}, timeout=60)
    assert (
        past.status_code == 400 and "routed_experts_start_len must be an integer in [0, prompt tokens = 3]" in past.text
    )
    with pytest.raises(ModelError, match="needs a Mixture-of-Experts model"):
        Engine(EngineConfig(model=str(tiny_model("qwen2")), enable_return_routed_experts=True))
