"""Sampling masks (``return_sampling_mask``): the set each token was drawn from under top-p, top-k and
min-p, and its log-prob renormalised over that set, as real SGLang 0.5.23 returns them.

Both engines are held to an independent recomputation from ``transformers``' logits (the set by
SGLang's rules, the log-probs in fp32), and to each other: on the same model and prompts they keep
the same ids in the same order, with the same renormalised log-probs, and refuse the same requests
with the same words.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import BACKENDS
from tests.kept_sets import TIE, assert_kept, renormalised

PROMPTS = [[1, 2, 3], [5, 17, 300, 42, 999], [64, 128, 256, 11, 7, 7, 7]]
SETTINGS = [  # sampling params the sets are checked under: each cut alone, and together
    {"temperature": 0.8, "top_p": 0.9, "top_k": 50},
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 1.3, "top_k": 400, "min_p": 0.2},
    {"temperature": 0.7, "top_k": 4096, "top_p": 0.5},
]


class Servers(dict):
    """One server per backend on the tiny model, started on first use and kept for the module."""

    def __init__(self, procs, model):
        super().__init__()
        self.procs, self.model = procs, model

    def __missing__(self, backend: str) -> str:
        self[backend] = self.procs.server(backend, self.model).url
        return self[backend]


@pytest.fixture(scope="module")
def servers(module_procs, tiny_model):
    return Servers(module_procs, tiny_model("qwen2"))


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, servers):
    return servers[request.param]


@pytest.fixture(scope="module")
def reference(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32).eval()

    def probs(tokens: list[int], params: dict) -> torch.Tensor:
        """The distribution SGLang samples the token after ``tokens`` from, before any cut."""
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        return torch.softmax(logits / params["temperature"], dim=-1)

    return probs


def generate(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


@pytest.mark.parametrize("params", SETTINGS, ids=["top_p", "top_k", "min_p", "top_p_wide_k"])
def test_each_token_carries_the_set_it_was_drawn_from(server, reference, params):
    for prompt in PROMPTS:
        body = {
            "input_ids": prompt,
            "sampling_params": {**params, "max_new_tokens": 6, "ignore_eos": True},
            "return_sampling_mask": True,
            "sampling_logprobs_mode": "support",
        }
        reply = generate(server, **body)
        assert reply.status_code == 200, reply.text
        out = reply.json()
        meta = out["meta_info"]
        masks, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
        assert meta["output_token_sampling_mask_length"] == len(masks) == len(logprobs) == len(out["output_ids"]) == 6
        for i, (token, mask, support) in enumerate(zip(out["output_ids"], masks, logprobs)):
            probs = reference(prompt + out["output_ids"][:i], params)
            assert token in mask, (i, token, mask)
            assert_kept(mask, probs, params)
            expected = renormalised(mask, probs)
            assert torch.allclose(torch.tensor(support), expected, atol=2e-5), (i, support, expected)
        # the default (selected) mode: the sampled token's entry of its row
        out = generate(server, **{**body, "sampling_logprobs_mode": None}).json()
        meta = out["meta_info"]
        for i, (token, mask, value) in enumerate(
            zip(out["output_ids"], meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"])
        ):
            expected = renormalised(mask, reference(prompt + out["output_ids"][:i], params))
            assert abs(value - float(expected[mask.index(token)])) <= 2e-5, (i, value)


def test_a_greedy_token_is_its_own_set(server):
    out = generate(
        server, input_ids=PROMPTS[1], sampling_params={"temperature": 0, "max_new_tokens": 4}, return_sampling_mask=True
    ).json()
    assert out["meta_info"]["output_token_sampling_mask"] == [[t] for t in out["output_ids"]]
    assert out["meta_info"]["output_token_sampling_logprobs"] == [0.0] * 4


def test_streamed_chunks_carry_every_mask_so_far(server):
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"top_k": 5, "max_new_tokens": 5, "ignore_eos": True},
        "return_sampling_mask": True,
        "stream": True,
    }
    chunks = []
    with httpx.stream("POST", server + "/generate", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert (
            len(meta["output_token_sampling_mask"])
            == len(chunk["output_ids"])
            == meta["output_token_sampling_mask_length"]
        )
    assert len(chunks[-1]["output_ids"]) == 5


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"sampling_params": {"top_p": 0.9}, "return_sampling_mask": True},
            "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; "
            "got top_k=1073741824. Lower top_k or increase --sampling-mask-max-tokens.",
        ),
        (
            {"sampling_params": {"top_k": 5000}, "return_sampling_mask": True},
            "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; got top_k=5000. "
            "Lower top_k or increase --sampling-mask-max-tokens.",
        ),
        (
            {"sampling_params": {"top_k": 5}, "sampling_logprobs_mode": "support"},
            "sampling_logprobs_mode can only be set when return_sampling_mask=true.",
        ),
    ],
    ids=["no_top_k", "top_k_over_the_bound", "mode_without_mask"],
)
def test_a_mask_the_server_cannot_bound_is_refused_before_it_runs(server, body, message):
    reply = generate(server, input_ids=PROMPTS[0], **body)
    assert reply.status_code == 400
    assert reply.json() == {"error": {"message": message}}


@pytest.mark.slow
def test_the_embedded_engine_keeps_what_real_sglang_keeps(servers, reference):
    """The same model, prompt and settings on both: the same ids in the same order, the same log-probs.

    Up to near-ties: each is the set SGLang's rules keep from ``transformers``' distribution, and
    where their orders differ, the tokens swapped are within ``TIE`` of each other.
    """
    urls = [servers[backend] for backend in ("embedded", "sglang")]
    for params in SETTINGS:
        for prompt in PROMPTS:
            body = {
                "input_ids": prompt,
                "sampling_params": {**params, "max_new_tokens": 1},
                "return_sampling_mask": True,
                "sampling_logprobs_mode": "support",
            }
            embedded, sglang = (generate(url, **body).json()["meta_info"] for url in urls)
            probs = reference(prompt, params)
            masks = [meta["output_token_sampling_mask"][0] for meta in (embedded, sglang)]
            logprobs = [meta["output_token_sampling_logprobs"][0] for meta in (embedded, sglang)]
            for mask, values in zip(masks, logprobs):
                assert_kept(mask, probs, params)
                assert torch.allclose(torch.tensor(values), renormalised(mask, probs), atol=2e-5), (params, prompt)
            ours, theirs = masks
            swapped = [(a, b) for a, b in zip(ours, theirs) if a != b]
            assert all(abs(float(probs[a] - probs[b])) < TIE for a, b in swapped), (params, prompt, swapped)
            if set(ours) == set(theirs):
                by_token = [dict(zip(mask, values)) for mask, values in zip(masks, logprobs)]
                assert all(abs(by_token[0][t] - by_token[1][t]) <= 1e-5 for t in ours), (params, prompt)
