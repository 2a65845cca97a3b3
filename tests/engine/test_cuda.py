"""The engine on a CUDA GPU against transformers on the same GPU (skipped without one)."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ARCHS, MOE_ARCHS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"),
]


@pytest.mark.parametrize("arch", [*ARCHS, *MOE_ARCHS])
def test_cuda_engine_logprobs_match_transformers(procs, tiny_model, arch):
    url = procs.engine(tiny_model(arch), "--device", "cuda", "--dtype", "float32").url
    prompt = [5, 17, 300, 42, 999, 7]
    out = httpx.post(
        url + "/generate",
        timeout=120,
        json={
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 32, "ignore_eos": True, "sampling_seed": 1},
        },
    ).json()
    ids = out["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + ids], device="cuda")).logits[0].float(), -1)
    expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-4
