"""The engine's numbers against an independent reference: Hugging Face ``transformers``."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ARCHS


@pytest.fixture(scope="module")
def engines(module_procs, tiny_model):
    return {arch: module_procs.engine(tiny_model(arch), name=arch).url for arch in ARCHS}


def hf_logprobs(model_dir, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at every position, from transformers in fp32: row i predicts token i+1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_and_prompt_logprobs_equal_transformers(engines, tiny_model, arch, temperature):
    prompt = [5, 17, 300, 42, 999, 7, 64, 128, 256, 11]
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 40, "temperature": temperature, "ignore_eos": True, "sampling_seed": 3}}
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


def test_top_logprobs_are_transformers_top_k(engines, tiny_model):
    prompt = [5, 17, 300, 42, 999, 7]
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.7, "ignore_eos": True, "sampling_seed": 4}}
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
    bad = httpx.post(engines["qwen2"] + "/generate", json={**body, "top_logprobs_num": -1}, timeout=60)
    assert bad.status_code == 400 and "top_logprobs_num" in bad.text


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_generate(engines, tiny_model, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32).eval()
    for prompt in ([1, 2, 3, 4, 5], [700, 12, 33], list(range(100, 160))):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48)[0, len(prompt):].tolist()
        out = httpx.post(engines[arch] + "/generate", timeout=60, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 0}}).json()
        assert out["output_ids"] == ref, f"prompt {prompt}"
        eos = set(model.generation_config.eos_token_id)
        if ref[-1] in eos:  # stopped on EOS: the stop token is in output_ids, as SGLang returns it
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[-1]}
        else:
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 48}
