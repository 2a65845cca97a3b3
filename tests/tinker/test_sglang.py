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

import numpy as np
import pytest

from inverted.view.index import RunIndex, SampleQuery
from tests.conftest import SGLANG_PYTHON

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.tinker.test_service import (  # noqa: E402
    client,
    finish,
    reference_logprobs,
    sampled_as_asked,
    sequence_datum,
    tinker_serve,
    train_full_model,
)

pytestmark = pytest.mark.slow

PROMPT = [3, 14, 15, 92]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"real SGLang is not installed ({SGLANG_PYTHON}): make sglang")
    checkpoint, out = tiny_model("qwen2"), tmp_path_factory.mktemp("tinker-sglang")
    for url in tinker_serve(
        checkpoint, out, "--rollout-backend", "sglang", "--rollout-sglang-python", str(SGLANG_PYTHON), start_s=300
    ):
        yield url, checkpoint, out
    assert "sglang servers" in (out / "serve.log").read_text()  # it was SGLang that served


async def base_sample(url: str, key: str, seed: int | None = None) -> types.SampleResponse:
    service = client(url, key)
    sampler = await service.create_sampling_client(base_model="Qwen/Tiny")
    answer = await sampler.sample(
        prompt=types.ModelInput.from_ints(PROMPT),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed),
        include_prompt_logprobs=True,
    )
    await service.close("success")
    return answer


def test_the_base_model_samples_through_real_sglang_with_its_own_logprobs(server):
    url, checkpoint, out = server
    answer = asyncio.run(base_sample(url, "tml-sglang-base"))
    assert len(answer.sequences) == 2
    for sequence in answer.sequences:
        tokens = PROMPT + list(sequence.tokens)
        expected = reference_logprobs(checkpoint, sequence_datum(tokens))
        assert sampled_as_asked(sequence, 6, checkpoint), sequence
        np.testing.assert_allclose(sequence.logprobs, expected[len(PROMPT) - 1 :], atol=1e-4)
    assert answer.prompt_logprobs[0] is None
    np.testing.assert_allclose(
        answer.prompt_logprobs[1:], reference_logprobs(checkpoint, sequence_datum(PROMPT)), atol=1e-4
    )
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
    model, path, datum, trained_logprobs = train_full_model(url, key)
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
        np.testing.assert_allclose(sequence.logprobs, expected[len(PROMPT) - 1 :], atol=1e-4)
