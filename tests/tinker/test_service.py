"""``inverted tinker-serve`` driven by the unmodified ``tinker`` SDK (0.38.0), as its documentation writes it.

One server per module (a tiny Qwen2, one embedded engine behind the real sgl-router), started as a
user starts it: ``inverted tinker-serve``. Each test opens its own ``ServiceClient`` with its own
key, so no test sees another's models. What is checked:

- a supervised loop learns, its log-probs equal ``transformers`` (the untrained adapter is the base
  model) and its loss is the documented sum, recomputed;
- after ``save_weights_for_sampler`` the sampler's log-probs of the trained adapter equal the trainer's;
- the policy losses (``gspo`` with its ``sequence_ratio_mask``, ``ppo`` with its clips) read rl_loop's
  datums and return their documented sums;
- a ``forward_backward`` split into chunks (sent at once, the first last) trains exactly like one call;
- calls sent out of ``seq_id`` order run in it; a used ``seq_id`` is refused;
- a bad call fails its own future with the SDK's ``user`` category and a clear message, and the
  client goes on; malformed, oversized or foreign requests are refused before any work;
- two LoRA models train side by side without touching each other; one key never reads another's;
- a training run's REST reads (its metadata, LoRA shape and newest checkpoint) answer its owner only.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from inverted.processes import ManagedProcess, free_port
from inverted.view.index import RunIndex, SampleQuery

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK = 2  # datums per forward_backward request: the SDK splits larger calls
# How far the sampler's log-prob of a token may be from the trainer's after a few sharp steps (lr 3e-2 to
# 5e-2: the tiny model's logits end up ~30 apart, which magnifies fp32 rounding). Usually 2e-6 to 8e-6;
# once, on an Intel VM with AMX, 2.5e-4 and 4.3e-4. One optimizer step here moves every log-prob by at
# least 0.04, so this still tells the trained adapter from a step-old one (or the base) by 40x. The
# engine's own LoRA arithmetic is held to 1e-4 of peft's by tests/engine/test_lora.py.
SERVED_ATOL = 1e-3


def tinker_serve(checkpoint, out, *flags: str, start_s: float = 180):
    """``inverted tinker-serve`` on ``checkpoint`` as ``Qwen/Tiny`` with one server, as a user starts it;
    yields its URL while it runs."""
    url = f"http://127.0.0.1:{free_port()}"
    argv = [
        sys.executable,
        "-m",
        "inverted.cli",
        "tinker-serve",
        "--hf-checkpoint",
        str(checkpoint),
        "--base-model",
        "Qwen/Tiny",
        "--num-engines",
        "1",
        "--output-dir",
        str(out),
        "--tinker-port",
        url.rsplit(":", 1)[1],
        *flags,
    ]
    proc = ManagedProcess.spawn("tinker-serve", argv, out / "serve.log", url)
    try:
        proc.wait_healthy(start_s, path="/api/v1/healthz")
        os.environ["TINKER_TELEMETRY"] = "0"
        yield url
    finally:
        proc.terminate()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    checkpoint, out = tiny_model("qwen2"), tmp_path_factory.mktemp("tinker")
    for url in tinker_serve(
        checkpoint,
        out,
        "--tinker-chunk-datums",
        str(CHUNK),
        "--tinker-max-batch-tokens",
        "4096",
        "--tinker-max-models",
        "4",
    ):
        yield url, checkpoint, out


def client(url: str, key: str) -> "tinker.ServiceClient":
    return tinker.ServiceClient(base_url=url, api_key=key)


def sft_datum(prompt: list[int], completion: list[int]) -> types.Datum:
    """The cookbook's layout: the input shifted by one, the prompt's positions weighted 0."""
    tokens = prompt + completion
    weights = np.array([0.0] * (len(prompt) - 1) + [1.0] * len(completion), np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], np.int64), "weights": weights},
    )


def sequence_datum(tokens: list[int]) -> types.Datum:
    """Every next token of ``tokens`` as a target."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], np.int64)},
    )


def sampled_as_asked(sequence: types.SampledSequence, max_tokens: int, checkpoint) -> bool:
    """A sequence runs to ``max_tokens`` ("length"), or ends early on an end-of-sequence token, which a
    random tiny model draws now and then ("stop"), with one log-prob a token either way. The end tokens
    are the checkpoint's, as the servers read them: ``config.json``'s and ``generation_config.json``'s."""
    eos: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((Path(checkpoint) / name).read_text()).get("eos_token_id", [])
        eos |= set(ids if isinstance(ids, list) else [ids])
    if len(sequence.tokens) != len(sequence.logprobs or []):
        return False
    if sequence.stop_reason == "length":
        return len(sequence.tokens) == max_tokens
    return sequence.stop_reason == "stop" and 0 < len(sequence.tokens) <= max_tokens and sequence.tokens[-1] in eos


def reference_logprobs(checkpoint, datum: types.Datum) -> np.ndarray:
    """The base model's log-prob of each target, by ``transformers`` at fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    tokens = torch.tensor([datum.model_input.to_ints()])
    targets = torch.as_tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
    with torch.no_grad():
        logits = model(tokens).logits[0].float()
    return logits.log_softmax(-1).gather(1, targets[:, None])[:, 0].numpy()


def test_a_supervised_loop_learns_with_exact_logprobs_and_its_sampler_agrees(server):
    url, checkpoint, out = server

    async def run():
        service = client(url, "tml-sft")
        training = await service.create_lora_training_client(base_model="Qwen/Tiny", rank=8)
        data = [sft_datum([3, 14, 15, 92], [65, 35, 89, 79, 32]), sft_datum([3, 14, 7], [26, 53, 58, 97])]
        losses, outputs = [], []
        for _ in range(6):
            forward = training.forward_backward(data, "cross_entropy")
            step = training.optim_step(types.AdamParams(learning_rate=3e-2))
            result, stepped = await forward, await step
            losses.append(result.metrics["loss:sum"])
            outputs.append(result.loss_fn_outputs)
            assert stepped.metrics["grad_norm:mean"] > 0
        # the untrained adapter (B = 0) is the base model: the first call's log-probs are transformers'
        for datum, output in zip(data, outputs[0]):
            np.testing.assert_allclose(output["logprobs"].to_numpy(), reference_logprobs(checkpoint, datum), atol=2e-5)
        # the loss is the documented sum over the weighted targets, recomputed from the returned log-probs
        for loss, output in zip(losses, outputs):
            recomputed = -sum(
                float((o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum())
                for o, d in zip(output, data)
            )
            assert loss == pytest.approx(recomputed, rel=1e-5)
        assert losses[-1] < 0.5 * losses[0], losses

        # the trained adapter, pushed to the rollout servers, scores as the trainer does
        evaluated = await training.forward(data, "cross_entropy")
        sampler = await training.save_weights_and_get_sampling_client()
        for datum, output in zip(data, evaluated.loss_fn_outputs):
            full = datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
            served = await sampler.compute_logprobs(types.ModelInput.from_ints(full))
            np.testing.assert_allclose(
                np.array(served[1:], np.float32), output["logprobs"].to_numpy(), atol=SERVED_ATOL
            )

        # and it samples from it: each sequence with its log-probs, as many as asked
        answer = await sampler.sample(
            prompt=types.ModelInput.from_ints([3, 14, 15, 92]),
            num_samples=3,
            sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0),
        )
        assert len(answer.sequences) == 3
        for sequence in answer.sequences:
            assert sampled_as_asked(sequence, 5, checkpoint), sequence
        # each sampled token's log-prob is the trained policy's, as the trainer computes it
        prompt = [3, 14, 15, 92]
        for sequence in answer.sequences:
            tokens = prompt + list(sequence.tokens)
            scored = await training.forward([sequence_datum(tokens)], "cross_entropy")
            np.testing.assert_allclose(
                np.array(sequence.logprobs, np.float32),
                scored.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :],
                atol=SERVED_ATOL,
            )
        await service.close("success")
        return training.model_id, answer

    model_id, answer = asyncio.run(run())
    # inverted view reads the model's directory as a job's: its steps, and every sampled sequence with
    # its ids, log-probs and weight version (the model's first save)
    index = RunIndex(out / "tinker" / "models" / model_id.replace(":", "_"))
    index.refresh()
    assert [row["step"] for row in index.metrics() if "train/loss_sum" in row] == [1, 2, 3, 4, 5, 6]
    rows = index.page(SampleQuery(page_size=100))["rows"]
    sampled = [row for row in rows if row["response_length"] == 5]
    assert len(sampled) == 3 and {(r["version_min"], r["version_max"], r["status"]) for r in sampled} == {
        (1, 1, "truncated")
    }
    stored = [index.trajectory(r["group_index"], r["sample_index"], 0) for r in sampled]
    assert sorted(t["tokens"][4:] for t in stored) == sorted(list(s.tokens) for s in answer.sequences)
    for trajectory in stored:
        sequence = next(s for s in answer.sequences if list(s.tokens) == trajectory["tokens"][4:])
        assert trajectory["tokens"][:4] == [3, 14, 15, 92]
        np.testing.assert_allclose(trajectory["rollout_log_probs"], sequence.logprobs, rtol=1e-6)  # the wire's float32


def test_policy_losses_read_their_inputs_as_the_cookbook_sends_them(server):
    """rl_loop's datums (a zero-padded prompt, the sampler's log-probs, one advantage per sequence and,
    for gspo, its sequence_ratio_mask), through the SDK: each loss is its documented sum of the
    returned log-probs, recomputed here."""
    url, *_ = server
    prompt, sampled = [3, 14, 15, 92], [65, 35, 89, 79, 32]
    ob = len(prompt) - 1
    rng = np.random.default_rng(1)
    sampler_logprobs = np.array([0.0] * ob + list(rng.normal(-4.6, 0.3, len(sampled))), np.float32)
    advantage = np.array([0.0] * ob + [0.7] * len(sampled), np.float32)
    mask = np.array([0.0] * ob + [1.0] * len(sampled), np.float32)

    def datum(**extra) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
            loss_fn_inputs={
                "target_tokens": np.array([0] * ob + sampled, np.int64),
                "logprobs": sampler_logprobs,
                "advantages": advantage,
                **extra,
            },
        )

    async def run():
        service = client(url, "tml-policy")
        training = await service.create_lora_training_client(base_model="Qwen/Tiny", rank=4)
        for loss, extra, config in [
            ("gspo", {"sequence_ratio_mask": mask}, None),
            ("gspo", {"sequence_ratio_mask": mask}, {"clip_low_threshold": 0.999, "clip_high_threshold": 1.001}),
            ("ppo", {}, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ]:
            result = await training.forward([datum(**extra)], loss, loss_fn_config=config)
            logp = result.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
            low, high = (config or {}).get("clip_low_threshold", 0.8), (config or {}).get("clip_high_threshold", 1.2)
            if loss == "gspo":
                ratio = np.full_like(logp, np.exp((logp - sampler_logprobs)[mask != 0].mean()))
            else:
                ratio = np.exp(logp - sampler_logprobs)
            expected = -np.minimum(ratio * advantage, np.clip(ratio, low, high) * advantage).sum()
            assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4), (loss, config)
        failed = training.forward([datum(sequence_ratio_mask=np.zeros_like(mask))], "gspo")
        with pytest.raises(tinker.RequestFailedError, match="sequence_ratio_mask marks no token"):
            await failed
        await service.close("success")

    asyncio.run(run())


def test_a_groups_datums_share_their_prompt_and_train_exactly_as_alone(server):
    """rl_loop's group: one observation, four sampled continuations. Sent in one call, the datums
    share the observation (run once); each datum's log-probs are still transformers', and the step
    they make is the step the same datums make sent one per call (nothing shared), to fp32."""
    url, checkpoint, _ = server
    observation = [3, 14, 15, 92, 65, 35, 89]
    group = [[79, 32, 38], [79, 50], [28, 84, 19, 71], [16]]  # two share a first action token too
    rng = np.random.default_rng(2)

    def datum(sampled: list[int]) -> types.Datum:
        ob = len(observation) - 1
        tokens = observation + sampled
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": np.array([0] * ob + sampled, np.int64),
                "logprobs": np.array([0.0] * ob + list(rng.normal(-5.0, 0.5, len(sampled))), np.float32),
                "advantages": np.array([0.0] * ob + [float(rng.normal())] * len(sampled), np.float32),
            },
        )

    data = [datum(sampled) for sampled in group]
    probe = [sequence_datum(observation + [79, 32, 38, 11])]

    async def run():
        service = client(url, "tml-shared")
        shared = await service.create_lora_training_client(base_model="Qwen/Tiny", rank=4, seed=11)
        alone = await service.create_lora_training_client(base_model="Qwen/Tiny", rank=4, seed=11)
        together = await shared.forward_backward(data, "importance_sampling")
        for one in data:
            await alone.forward_backward([one], "importance_sampling")
        for training in (shared, alone):
            await training.optim_step(types.AdamParams(learning_rate=5e-2))
        after = [await training.forward(probe, "cross_entropy") for training in (shared, alone)]
        await service.close("success")
        return together, after

    together, (shared_after, alone_after) = asyncio.run(run())
    # the untrained adapter is the base model: every datum's log-probs (the prompt's positions too) are transformers'
    for one, output in zip(data, together.loss_fn_outputs):
        np.testing.assert_allclose(output["logprobs"].to_numpy(), reference_logprobs(checkpoint, one), atol=2e-5)
    moved = shared_after.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.allclose(moved, reference_logprobs(checkpoint, probe[0]), atol=1e-3)  # the step moved the policy
    np.testing.assert_allclose(moved, alone_after.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=2e-5)


def test_a_chunked_call_trains_as_one_call_and_calls_run_in_seq_id_order(server):
    url, *_ = server

    async def run():
        data = [sft_datum([3, 10 + i], [20 + i, 30 + i, 40 + i]) for i in range(5)]  # 3 chunks of CHUNK datums
        service = client(url, "tml-chunks")
        chunked = await service.create_lora_training_client(base_model="Qwen/Tiny", rank=4, seed=7)
        first = await chunked.forward(data, "cross_entropy")
        forward = chunked.forward_backward(data, "cross_entropy")
        step = chunked.optim_step(types.AdamParams(learning_rate=1e-2))
        result = await forward
        await step
        after = await chunked.forward(data, "cross_entropy")
        # every datum's log-probs came back in order, and the chunks' losses add up
        assert len(result.loss_fn_outputs) == len(data)
        for a, b in zip(first.loss_fn_outputs, result.loss_fn_outputs):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
        assert result.metrics["loss:sum"] == pytest.approx(first.metrics["loss:sum"], rel=1e-6)
        # one model trained the same data in one request per datum, accumulated, then one step: the same weights
        single = await service.create_lora_training_client(base_model="Qwen/Tiny", rank=4, seed=7)
        futures = [single.forward_backward([d], "cross_entropy") for d in data]
        step = single.optim_step(types.AdamParams(learning_rate=1e-2))
        for f in futures:
            await f
        await step
        again = await single.forward(data, "cross_entropy")
        for a, b in zip(after.loss_fn_outputs, again.loss_fn_outputs):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
        assert after.metrics["loss:sum"] < first.metrics["loss:sum"]
        await service.close("success")

    asyncio.run(run())


def post(url: str, path: str, key: str, body, proto: bool = False):
    import httpx

    headers = {"X-API-Key": key}
    if proto:
        return httpx.post(
            f"{url}/api/v1/{path}",
            content=body,
            headers=headers | {"Content-Type": "application/x-protobuf"},
            timeout=60,
        )
    return httpx.post(f"{url}/api/v1/{path}", json=body, headers=headers, timeout=60)


def retrieve(url: str, key: str, request_id: str):
    while True:
        answer = post(url, "retrieve_future", key, {"request_id": request_id})
        if (
            answer.status_code != 200
            or answer.headers["content-type"].startswith("application/x-protobuf")
            or answer.json().get("type") != "try_again"
        ):
            return answer


def proto_request(model_id: str, seq_id: int, data: list[types.Datum], loss: str = "cross_entropy") -> bytes:
    """A forward_backward body exactly as the SDK encodes it (its own converter)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss), model_id=model_id, seq_id=seq_id
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def finish(url: str, key: str, model_id: str) -> None:
    """End the model's session, as the SDK's ``close`` does: its models are unloaded."""
    assert (
        post(url, f"sessions/{model_id.split(':')[0]}/finish", key, {"reason": {"type": "success"}}).status_code == 200
    )


def new_model(url: str, key: str) -> str:
    session = post(url, "create_session", key, {"tags": [], "user_metadata": None, "sdk_version": "raw"}).json()
    created = post(
        url,
        "create_model",
        key,
        {"session_id": session["session_id"], "model_seq_id": 0, "base_model": "Qwen/Tiny", "lora_config": {"rank": 2}},
    ).json()
    assert retrieve(url, key, created["request_id"]).json()["model_id"] == created["model_id"]
    return created["model_id"]


def test_calls_sent_out_of_order_run_in_seq_id_order(server):
    url, *_ = server
    key = "tml-order"
    model = new_model(url, key)
    data = [sft_datum([3, 4], [5, 6, 7])]
    # the step (seq 2) arrives before the gradients it applies (seq 1): it waits for them
    step = post(url, "optim_step", key, {"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}).json()
    forward = post(url, "forward_backward", key, proto_request(model, 1, data), proto=True).json()
    assert retrieve(url, key, forward["request_id"]).headers["content-type"].startswith("application/x-protobuf")
    assert retrieve(url, key, step["request_id"]).json()["metrics"]["grad_norm:mean"] > 0
    # a seq_id already used fails its own future, with the SDK's user category
    again = post(url, "forward_backward", key, proto_request(model, 2, data), proto=True).json()
    failed = retrieve(url, key, again["request_id"]).json()
    assert failed["category"] == "user" and "already used" in failed["error"]
    finish(url, key, model)


def test_bad_input_is_refused_clearly_and_cheaply(server):
    url, *_ = server
    key = "tml-bad"
    model = new_model(url, key)
    datum = sft_datum([3, 4], [5, 6])

    def refused(answer, status: int, words: str) -> None:
        assert answer.status_code == status, answer.text
        assert answer.json()["category"] == "user" and words in answer.json()["error"], answer.text

    refused(post(url, "forward_backward", key, b"\xff\xff\x00garbage", proto=True), 400, "protobuf")
    refused(
        post(url, "forward_backward", key, proto_request("nobody:train:0", 1, [datum]), proto=True),
        400,
        "unknown model",
    )
    # a call that names its model and turn but cannot run fails in its turn (the SDK has reserved it), at once
    outside = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4]), loss_fn_inputs={"target_tokens": np.array([4, 10**6], np.int64)}
    )
    missing = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4]), loss_fn_inputs={"target_tokens": np.array([4, 5], np.int64)}
    )
    for seq_id, (data, loss, words) in enumerate(
        [
            ([datum] * 1500, "cross_entropy", "--tinker-max-batch-tokens"),
            ([datum], "stable_reinforce", "not published"),
            ([outside], "cross_entropy", "token ids"),
            ([missing], "ppo", "'logprobs' is missing"),
        ],
        start=1,
    ):
        answer = post(url, "forward_backward", key, proto_request(model, seq_id, data, loss), proto=True).json()
        failed = retrieve(url, key, answer["request_id"]).json()
        assert failed["category"] == "user" and words in failed["error"], failed
    refused(post(url, "get_info", "not-a-tinker-key", {"model_id": model}), 401, "API key")
    # the model's next call runs
    ok = post(url, "forward_backward", key, proto_request(model, 5, [datum]), proto=True).json()
    assert retrieve(url, key, ok["request_id"]).status_code == 200
    # a request id this server never issued (or lost in a restart): 410, which the SDK resubmits on
    assert retrieve(url, key, "0" * 24).status_code == 410
    finish(url, key, model)
    # a finished session's models are gone
    assert post(url, "get_info", key, {"model_id": model}).status_code == 400


def test_a_failed_call_fails_only_its_own_future(server):
    url, *_ = server

    async def run():
        service = client(url, "tml-poison")
        training = await service.create_lora_training_client(base_model="Qwen/Tiny", rank=2)
        good = sft_datum([3, 4], [5, 6])
        # not a loss input the SDK's cross_entropy takes: refused, naming it; the client goes on
        odd = types.Datum(
            model_input=good.model_input, loss_fn_inputs={**good.loss_fn_inputs, "advantages": np.ones(3, np.float32)}
        )
        with pytest.raises(Exception, match="takes no input 'advantages'"):
            await training.forward_backward([odd], "cross_entropy")
        result = await training.forward_backward([good], "cross_entropy")
        assert len(result.loss_fn_outputs) == 1
        await service.close("success")

    asyncio.run(run())


def test_two_lora_models_train_side_by_side_and_keys_keep_them_apart(server):
    url, *_ = server

    async def run():
        alice, bob = client(url, "tml-alice"), client(url, "tml-bob")
        a = await alice.create_lora_training_client(base_model="Qwen/Tiny", rank=4)
        b = await bob.create_lora_training_client(base_model="Qwen/Tiny", rank=4)
        data = [sft_datum([3, 8, 9], [11, 12, 13])]
        b_before = (await b.forward(data, "cross_entropy")).loss_fn_outputs[0]["logprobs"].to_numpy()
        for _ in range(3):
            await a.forward_backward(data, "cross_entropy")
            await a.optim_step(types.AdamParams(learning_rate=3e-2))
        a_after = (await a.forward(data, "cross_entropy")).loss_fn_outputs[0]["logprobs"].to_numpy()
        b_after = (await b.forward(data, "cross_entropy")).loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_array_equal(b_after, b_before)
        assert a_after.sum() > b_after.sum() + 0.5
        # each model's sampler serves its own adapter
        a_sampler = await a.save_weights_and_get_sampling_client()
        b_sampler = await b.save_weights_and_get_sampling_client()
        full = data[0].model_input.to_ints() + [13]
        a_served = np.array((await a_sampler.compute_logprobs(types.ModelInput.from_ints(full)))[1:], np.float32)
        b_served = np.array((await b_sampler.compute_logprobs(types.ModelInput.from_ints(full)))[1:], np.float32)
        np.testing.assert_allclose(a_served, a_after, atol=1e-4)
        np.testing.assert_allclose(b_served, b_after, atol=1e-4)
        # bob's key cannot read or train alice's model, nor sample her weights
        assert post(url, "get_info", "tml-bob", {"model_id": a.model_id}).status_code == 400
        answer = post(
            url, "forward_backward", "tml-bob", proto_request(a.model_id, 99, [sft_datum([3], [4])]), proto=True
        )
        assert answer.status_code == 400 and "unknown model" in answer.json()["error"]
        saved = await a.save_weights_for_sampler("alice-final")
        assert (await alice.create_sampling_client(model_path=saved.path)) is not None
        with pytest.raises(Exception, match="unknown model_path"):
            await bob.create_sampling_client(model_path=saved.path)
        await alice.close("success")
        await bob.close("success")

    asyncio.run(run())


def test_the_unembedding_is_adapted_as_asked(server):
    """``train_unembed`` (the SDK's default: True) puts an adapter on the output layer: one alone learns,
    its saved adapter holds it (PEFT's ``lm_head`` names; weights info says so), and the sampler, given
    it by the weight sync, scores as the trainer does. A model adapting nothing is refused."""
    url, *_ = server

    async def run():
        service = client(url, "tml-unembed")
        training = await service.create_lora_training_client(
            base_model="Qwen/Tiny", rank=4, train_attn=False, train_mlp=False
        )
        data = [sft_datum([3, 14, 15], [65, 35, 89])]
        losses = []
        for _ in range(4):
            losses.append((await training.forward_backward(data, "cross_entropy")).metrics["loss:sum"])
            await training.optim_step(types.AdamParams(learning_rate=5e-2))
        assert losses[-1] < 0.7 * losses[0], losses
        saved = await training.save_state("head")
        info = await tinker.RestClient(base_url=url, api_key="tml-unembed").get_weights_info_by_tinker_path(saved.path)
        assert (info.train_unembed, info.train_attn, info.train_mlp) == (True, False, False)
        evaluated = (await training.forward(data, "cross_entropy")).loss_fn_outputs[0]["logprobs"].to_numpy()
        sampler = await training.save_weights_and_get_sampling_client()
        served = await sampler.compute_logprobs(types.ModelInput.from_ints([3, 14, 15, 65, 35, 89]))
        np.testing.assert_allclose(np.array(served[1:], np.float32), evaluated, atol=SERVED_ATOL)
        with pytest.raises(Exception, match="train_unembed"):
            await service.create_lora_training_client(
                base_model="Qwen/Tiny", rank=4, train_attn=False, train_mlp=False, train_unembed=False
            )
        await service.close("success")
        return saved.path

    path = asyncio.run(run())
    directory = next(server[2].glob(f"tinker/weights/*/{path.rsplit('/', 1)[-1]}"))
    tensors = {name for f in directory.rglob("*.pt") for name in torch.load(f, weights_only=True)["model"]}
    assert tensors == {"output_layer.lora.A.lm_head", "output_layer.lora.B.lm_head"}, tensors


def test_a_checkpoint_resumes_exactly_and_only_for_its_owner(server):
    url, *_ = server

    async def run():
        data = [sft_datum([3, 21, 22], [23, 24, 25]), sft_datum([3, 31], [32, 33])]
        adam = types.AdamParams(learning_rate=2e-2, weight_decay=0.01, grad_clip_norm=1.0)
        service = client(url, "tml-resume")
        first = await service.create_lora_training_client(base_model="Qwen/Tiny", rank=4, train_mlp=False)
        for _ in range(2):
            await first.forward_backward(data, "cross_entropy")
            await first.optim_step(adam)
        saved = await first.save_state("after-two")
        await first.forward_backward(data, "cross_entropy")
        await first.optim_step(adam)
        expected = (await first.forward(data, "cross_entropy")).loss_fn_outputs

        # a new model from the checkpoint, its optimizer state too, takes the same third step
        resumed = await service.create_training_client_from_state_with_optimizer(saved.path)
        assert resumed.get_info().lora_rank == 4
        await resumed.forward_backward(data, "cross_entropy")
        await resumed.optim_step(adam)
        for a, b in zip(expected, (await resumed.forward(data, "cross_entropy")).loss_fn_outputs):
            np.testing.assert_allclose(b["logprobs"].to_numpy(), a["logprobs"].to_numpy(), atol=1e-6)

        # another key cannot load it
        other = client(url, "tml-thief")
        with pytest.raises(Exception, match="unknown checkpoint"):
            await other.create_training_client_from_state(saved.path)
        await service.close("success")
        await other.close("success")

    asyncio.run(run())


def test_a_training_run_tells_its_owner_what_it_was_made_with_and_saved(server):
    """The REST reads the cookbook makes of a checkpoint path (``get_training_run_by_tinker_path``, for the
    renderer it recorded in ``user_metadata``; ``get_weights_info_by_tinker_path``), through the SDK's
    own RestClient (the cookbook's way to it, ``create_rest_client``, runs in ``test_cookbook.py``): the
    run's base, LoRA shape, metadata and newest checkpoint, after its session too; to another key it is
    unknown, and metadata not of the SDK's type is refused."""
    url, *_ = server

    async def run():
        service = client(url, "tml-runs")
        training = await service.create_lora_training_client(
            base_model="Qwen/Tiny", rank=3, train_mlp=False, user_metadata={"renderer_name": "qwen3_instruct"}
        )
        await training.save_state("first")
        saved = await training.save_state("second")
        sampler = await training.save_weights_for_sampler("s")
        await service.close("success")  # its model unloaded: what was saved still answers

        rest = tinker.RestClient(base_url=url, api_key="tml-runs")
        for path in (saved.path, sampler.path):
            run = await rest.get_training_run_by_tinker_path(path)
            assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (
                training.model_id,
                "Qwen/Tiny",
                True,
                3,
            )
            assert run.user_metadata == {"renderer_name": "qwen3_instruct"}
            assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == saved.path
            assert run.last_checkpoint.size_bytes > 0
        info = await rest.get_weights_info_by_tinker_path(saved.path)
        assert (info.base_model, info.is_lora, info.lora_rank, info.train_attn, info.train_mlp) == (
            "Qwen/Tiny",
            True,
            3,
            True,
            False,
        )
        thief = tinker.RestClient(base_url=url, api_key="tml-runs-thief")
        with pytest.raises(tinker.BadRequestError, match="unknown training run"):
            await thief.get_training_run_by_tinker_path(saved.path)
        with pytest.raises(tinker.BadRequestError, match="unknown checkpoint"):
            await thief.get_weights_info_by_tinker_path(saved.path)

    asyncio.run(run())
    session = post(url, "create_session", "tml-runs", {"tags": [], "user_metadata": None, "sdk_version": "raw"}).json()
    for metadata in ({"renderer_name": 3}, ["renderer_name"], {"k": "v" * 20_000}):
        answer = post(
            url,
            "create_model",
            "tml-runs",
            {"session_id": session["session_id"], "base_model": "Qwen/Tiny", "user_metadata": metadata},
        )
        assert answer.status_code == 400 and "user_metadata" in answer.json()["error"], answer.text


def train_full_model(url: str, key: str) -> tuple[str, str, types.Datum, np.ndarray]:
    """A full fine-tuning model (raw HTTP: the SDK creates LoRA models only), two steps on one datum,
    its weights saved for a sampler: its id, the sampler's path, the datum and the trainer's log-probs of it."""
    session = post(url, "create_session", key, {"tags": [], "user_metadata": None, "sdk_version": "raw"}).json()
    created = post(
        url, "create_model", key, {"session_id": session["session_id"], "model_seq_id": 0, "base_model": "Qwen/Tiny"}
    ).json()
    model = created["model_id"]
    assert retrieve(url, key, created["request_id"]).status_code == 200
    assert post(url, "get_info", key, {"model_id": model}).json()["is_lora"] is False
    datum = sft_datum([3, 40, 41], [42, 43, 44])
    for seq_id in (1, 3):
        post(url, "forward_backward", key, proto_request(model, seq_id, [datum]), proto=True)
        step = post(
            url, "optim_step", key, {"model_id": model, "seq_id": seq_id + 1, "adam_params": {"learning_rate": 1e-2}}
        ).json()
        assert retrieve(url, key, step["request_id"]).json()["metrics"]["grad_norm:mean"] > 0
    saved = post(url, "save_weights_for_sampler", key, {"model_id": model, "seq_id": 5, "path": "full-1"}).json()
    path = retrieve(url, key, saved["request_id"]).json()["path"]
    scored = post(url, "forward_backward", key, proto_request(model, 6, [datum]), proto=True).json()
    from tinker.proto.response_conv import deserialize_forward_backward_output

    trained = deserialize_forward_backward_output(retrieve(url, key, scored["request_id"]).content)
    return model, path, datum, trained.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_full_fine_tuning_trains_every_weight_and_serves_them(server):
    url, *_ = server
    key = "tml-full"
    model, path, datum, trained = train_full_model(url, key)

    async def sample():
        service = client(url, key)
        sampler = await service.create_sampling_client(model_path=path)
        full = datum.model_input.to_ints() + [44]
        served = await sampler.compute_logprobs(types.ModelInput.from_ints(full))
        # the servers now hold the full model's weights: the base model is not theirs to serve
        with pytest.raises(Exception, match="full weights"):
            base = await service.create_sampling_client(base_model="Qwen/Tiny")
            await base.sample(
                prompt=types.ModelInput.from_ints([3]),
                num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=2),
            )
        await service.close("success")
        return np.array(served[1:], np.float32)

    np.testing.assert_allclose(asyncio.run(sample()), trained, atol=1e-4)
    finish(url, key, model)


def test_a_restarted_server_fails_the_client_loudly_never_with_a_wrong_answer(tiny_model, tmp_path):
    checkpoint = tiny_model("qwen2")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def start(name: str) -> ManagedProcess:
        proc = ManagedProcess.spawn(
            name,
            [
                sys.executable,
                "-m",
                "inverted.cli",
                "tinker-serve",
                "--hf-checkpoint",
                str(checkpoint),
                "--num-engines",
                "1",
                "--output-dir",
                str(tmp_path / name),
                "--tinker-port",
                str(port),
            ],
            tmp_path / f"{name}.log",
            url,
        )
        proc.wait_healthy(180, path="/api/v1/healthz")
        return proc

    async def run():
        service = client(url, "tml-restart")
        training = await service.create_lora_training_client(base_model=str(checkpoint), rank=2)
        data = [sft_datum([3, 50], [51, 52])]
        expected = (await training.forward(data, "cross_entropy")).loss_fn_outputs[0]["logprobs"].to_numpy()
        pending = training.forward_backward(data, "cross_entropy")  # in flight as the server dies
        first.popen.kill()
        first.popen.wait()
        second = start("second")
        try:
            try:
                answer = await pending
            except Exception as exc:  # loud: the model is not on the new server
                assert "unknown model" in str(exc) or "410" in str(exc) or "Promise" in str(exc), exc
            else:  # or it was answered before the kill: then by the first server, rightly
                np.testing.assert_allclose(answer.loss_fn_outputs[0]["logprobs"].to_numpy(), expected, atol=1e-6)
            with pytest.raises(Exception, match="unknown model"):
                await training.forward_backward(data, "cross_entropy")
        finally:
            second.terminate()

    first = start("first")
    try:
        asyncio.run(run())
    finally:
        first.terminate()


def test_what_the_servers_can_follows_the_backend_and_its_flags():
    """LoRA and seeds as each backend serves them: the embedded engine both; SGLang seeds only in its
    deterministic mode, LoRA only on a GPU (``tests/tinker/test_sglang.py`` runs the CPU case)."""
    from inverted.devices import cuda_available
    from inverted.tinker.service import ServersCan

    assert ServersCan.of("embedded", []) == ServersCan(lora=True, seed=True)
    assert ServersCan.of("sglang", []) == ServersCan(lora=cuda_available(), seed=False)
    assert ServersCan.of("sglang", ["--enable-deterministic-inference"]).seed
