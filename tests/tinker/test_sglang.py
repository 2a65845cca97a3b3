"""``inverted tinker-serve`` on real SGLang (0.5.23 on this CPU, ``make sglang``) behind the real sgl-router.

One server per module, started as a user starts it (``--rollout-backend sglang``). Checked against
``transformers`` at fp32:

- the base model samples through the unmodified SDK: each sampled token's log-prob and the prompt's
  are the model's own, and the sequences are kept in the viewer's record; a seed, which SGLang
  ignores outside its deterministic mode, is warned of;
- a LoRA model is refused before any work, with the reason (SGLang's LoRA layers need CUDA);
- a full fine-tuning model trains, its weights reach SGLang by the weight sync, SGLang scores them
  as the trainer does, and once the model is gone SGLang serves the base weights again.
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np
import pytest

from inverted.processes import ManagedProcess, free_port
from inverted.view.index import RunIndex, SampleQuery
from tests.conftest import SGLANG_PYTHON

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.tinker.test_service import client, finish, post, proto_request, reference_logprobs, retrieve, sft_datum  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [3, 14, 15, 92]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"real SGLang is not installed ({SGLANG_PYTHON}): make sglang")
    checkpoint = tiny_model("qwen2")
    out = tmp_path_factory.mktemp("tinker-sglang")
    url = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "inverted.cli", "tinker-serve", "--hf-checkpoint", str(checkpoint),
            "--base-model", "Qwen/Tiny", "--num-engines", "1", "--output-dir", str(out),
            "--tinker-port", url.rsplit(":", 1)[1], "--rollout-backend", "sglang",
            "--rollout-sglang-python", str(SGLANG_PYTHON)]
    proc = ManagedProcess.spawn("tinker-serve", argv, out / "serve.log", url)
    try:
        proc.wait_healthy(300, path="/api/v1/healthz")
        os.environ["TINKER_TELEMETRY"] = "0"
        yield url, checkpoint, out
    finally:
        proc.terminate()
    assert "sglang servers" in (out / "serve.log").read_text()  # it was SGLang that served


def sequence_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], np.int64)})


async def base_sample(url: str, key: str, seed: int | None = None) -> types.SampleResponse:
    service = client(url, key)
    sampler = await service.create_sampling_client(base_model="Qwen/Tiny")
    answer = await sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=2,
                                  sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed),
                                  include_prompt_logprobs=True)
    await service.close("success")
    return answer


def test_the_base_model_samples_through_real_sglang_with_its_own_logprobs(server):
    url, checkpoint, out = server
    answer = asyncio.run(base_sample(url, "tml-sglang-base"))
    assert len(answer.sequences) == 2
    for sequence in answer.sequences:
        tokens = PROMPT + list(sequence.tokens)
        expected = reference_logprobs(checkpoint, sequence_datum(tokens))
        assert len(sequence.tokens) == 6 and sequence.stop_reason == "length"
        np.testing.assert_allclose(sequence.logprobs, expected[len(PROMPT) - 1:], atol=1e-4)
    assert answer.prompt_logprobs[0] is None
    np.testing.assert_allclose(answer.prompt_logprobs[1:], reference_logprobs(checkpoint, sequence_datum(PROMPT)),
                               atol=1e-4)
    # kept for inverted view, token for token
    index = RunIndex(out / "tinker" / "models" / "base")
    index.refresh()
    kept = [index.trajectory(r["group_index"], r["sample_index"], 0) for r in index.page(SampleQuery())["rows"]]
    assert sorted(t["tokens"] for t in kept) == sorted(PROMPT + list(s.tokens) for s in answer.sequences)
    # SGLang reads a seed only in deterministic mode (a GPU's): a seeded draw says so in the log
    asyncio.run(base_sample(url, "tml-sglang-seed", seed=3))
    assert "seeded draws here are not reproducible" in (out / "serve.log").read_text()


def test_a_lora_model_is_refused_before_any_work_with_the_reason(server):
    url, *_ = server

    async def run():
        service = client(url, "tml-sglang-lora")
        with pytest.raises(tinker.BadRequestError, match="real SGLang on a CPU has none.*--rollout-backend embedded"):
            await service.create_lora_training_client(base_model="Qwen/Tiny", rank=4)
        await service.close("success")

    asyncio.run(run())


def test_a_full_model_trains_and_real_sglang_serves_its_weights_then_the_base_again(server):
    url, checkpoint, _ = server
    key = "tml-sglang-full"
    session = post(url, "create_session", key, {"tags": [], "user_metadata": None, "sdk_version": "raw"}).json()
    created = post(url, "create_model", key, {"session_id": session["session_id"], "model_seq_id": 0,
                                              "base_model": "Qwen/Tiny"}).json()
    model = created["model_id"]
    assert retrieve(url, key, created["request_id"]).status_code == 200
    datum = sft_datum([3, 40, 41], [42, 43, 44])
    for seq_id in (1, 3):
        post(url, "forward_backward", key, proto_request(model, seq_id, [datum]), proto=True)
        step = post(url, "optim_step", key, {"model_id": model, "seq_id": seq_id + 1,
                                             "adam_params": {"learning_rate": 1e-2}}).json()
        assert retrieve(url, key, step["request_id"]).json()["metrics"]["grad_norm:mean"] > 0
    saved = post(url, "save_weights_for_sampler", key, {"model_id": model, "seq_id": 5, "path": "full-1"}).json()
    path = retrieve(url, key, saved["request_id"]).json()["path"]
    scored = post(url, "forward_backward", key, proto_request(model, 6, [datum]), proto=True).json()
    from tinker.proto.response_conv import deserialize_forward_backward_output

    trained = deserialize_forward_backward_output(retrieve(url, key, scored["request_id"]).content)
    trained_logprobs = trained.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.allclose(trained_logprobs, reference_logprobs(checkpoint, datum), atol=1e-2)  # it did train

    async def served() -> np.ndarray:
        service = client(url, key)
        sampler = await service.create_sampling_client(model_path=path)
        logprobs = await sampler.compute_logprobs(types.ModelInput.from_ints(datum.model_input.to_ints() + [44]))
        await service.close("success")
        return np.array(logprobs[1:], np.float32)

    np.testing.assert_allclose(asyncio.run(served()), trained_logprobs, atol=1e-4)
    finish(url, key, model)
    # the model is gone: SGLang holds the base weights again, and samples from them
    answer = asyncio.run(base_sample(url, "tml-sglang-after"))
    for sequence in answer.sequences:
        expected = reference_logprobs(checkpoint, sequence_datum(PROMPT + list(sequence.tokens)))
        np.testing.assert_allclose(sequence.logprobs, expected[len(PROMPT) - 1:], atol=1e-4)
