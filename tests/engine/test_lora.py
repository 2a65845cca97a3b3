"""LoRA in the embedded engine against ``transformers`` + ``peft`` with the same adapters.

Adapters are made by ``peft`` itself (random A and B, so every delta counts) and saved with
``save_pretrained``; the engine loads them by SGLang's routes, and each request's log-probs must
equal PEFT's for its own adapter, in a batch that mixes adapters and the base model.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from inverted.peft_adapter import HEAD_BASE, read_adapter
from inverted.weight_wire import bucket_layout, bucket_payload, serialize

KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ([5, 17, 300, 42, 999, 7, 64, 128], [1, 2, 3, 4, 5, 6], [700, 12, 33, 8, 81])


def make_adapter(base, out, rank: int, modules, seed: int, alpha: float = 16.0):
    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, init_lora_weights=False),
    )
    with torch.no_grad():  # peft's random init leaves B small: make each adapter move the logits visibly
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    base, root = tiny_model("qwen2"), tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(base, root / "a", 4, "all-linear", seed=1),
        # the output layer too (tied to the embedding): its delta is in every logit, prompt and sampled
        "b": make_adapter(base, root / "b", 8, ["q_proj", "v_proj", "down_proj", "lm_head"], seed=2, alpha=8.0),
        "big": make_adapter(base, root / "big", 16, ["q_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def engine(module_procs, tiny_model, adapters):
    return module_procs.engine(
        tiny_model("qwen2"),
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "all",  # as SGLang reads it: the output layer included
        "--lora-paths",
        f"a={adapters['a']}",
        "--admin-api-key",
        KEY,
        name="lora",
    ).url


def reference_logprobs(base, adapter, tokens: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits under ``transformers`` (+ ``peft`` with ``adapter``), fp32."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return torch.log_softmax(model.eval()(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check(base, adapter, prompt: list[int], out: dict) -> float:
    """The largest gap between the engine's prompt and sampled log-probs and the reference's."""
    meta = out["meta_info"]
    tokens = prompt + out["output_ids"]
    ref = reference_logprobs(base, adapter, tokens)
    got = [lp for lp, _, _ in meta["input_token_logprobs"][1:]] + [lp for lp, _, _ in meta["output_token_logprobs"]]
    want = [ref[i - 1, tokens[i]].item() for i in range(1, len(tokens))]
    return (torch.tensor(got) - torch.tensor(want)).abs().max().item()


def test_a_batch_mixing_adapters_and_the_base_gives_each_its_own_logprobs(engine, tiny_model, adapters):
    base = tiny_model("qwen2")
    loaded = httpx.post(
        engine + "/load_lora_adapter",
        headers=ADMIN,
        timeout=60,
        json={"lora_name": "b", "lora_path": str(adapters["b"])},
    )
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"a": str(adapters["a"]), "b": str(adapters["b"])},
    }
    loras = ["a", None, "b"]
    body = {
        "input_ids": list(PROMPTS),
        "lora_path": loras,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5},
    }
    outs = httpx.post(engine + "/generate", json=body, timeout=60).json()
    for prompt, lora, out in zip(PROMPTS, loras, outs):
        assert check(base, adapters[lora] if lora else None, prompt, out) <= 1e-4, lora
    # The adapters do change the numbers: adapter a's prompt log-probs are not the base model's.
    plain = reference_logprobs(base, None, PROMPTS[0])
    with_a = reference_logprobs(base, adapters["a"], PROMPTS[0])
    assert (plain - with_a).abs().max() > 1e-2
    # Greedy with an adapter equals peft's generate.
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters["b"])
    with torch.no_grad():
        ref = model.eval().generate(torch.tensor([PROMPTS[1]]), do_sample=False, max_new_tokens=16)[
            0, len(PROMPTS[1]) :
        ]
    greedy = httpx.post(
        engine + "/generate",
        json={"input_ids": PROMPTS[1], "lora_path": "b", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
        timeout=60,
    ).json()
    assert greedy["output_ids"] == ref.tolist()
    assert httpx.post(engine + "/unload_lora_adapter", headers=ADMIN, json={"lora_name": "b"}).json()[
        "loaded_adapters"
    ] == {"a": str(adapters["a"])}


def test_an_adapter_from_tensors_in_a_flattened_bucket_or_a_legacy_payload(engine, tiny_model, adapters):
    torch.multiprocessing.set_sharing_strategy("file_system")  # as the trainer's tensor transport sends
    config, tensors = read_adapter(adapters["b"])
    layout = bucket_layout([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
    bucket = {
        "lora_name": "bucket",
        "config_dict": config,
        "load_format": "flattened_bucket",
        "serialized_named_tensors": [bucket_payload(flat, layout)],
    }
    legacy = {"lora_name": "legacy", "config_dict": config, "serialized_tensors": serialize(dict(tensors))}
    for body in (bucket, legacy):
        out = httpx.post(engine + "/load_lora_adapter_from_tensors", headers=ADMIN, json=body, timeout=60)
        assert out.status_code == 200 and out.json()["loaded_adapters"][body["lora_name"]] is None, out.text
        gen = httpx.post(
            engine + "/generate",
            timeout=60,
            json={
                "input_ids": PROMPTS[0],
                "lora_path": body["lora_name"],
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            },
        ).json()
        assert check(tiny_model("qwen2"), adapters["b"], PROMPTS[0], gen) <= 1e-4
        httpx.post(engine + "/unload_lora_adapter", headers=ADMIN, json={"lora_name": body["lora_name"]})


def test_a_repeated_adapter_payload_loads_what_its_shared_memory_holds_now(engine, tiny_model, adapters):
    """A LoRA trainer refills one shared buffer for every update and sends the same payload string: the
    engine may reuse what it decoded, but loads the bytes the memory holds now, and copies them (the
    sender's next refill, here NaN, does not reach a loaded adapter)."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    config, tensors = read_adapter(adapters["b"])
    layout = bucket_layout([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).share_memory_()
    body = {
        "lora_name": "refilled",
        "config_dict": config,
        "load_format": "flattened_bucket",
        "serialized_named_tensors": [bucket_payload(flat, layout)],
    }
    trained, base = flat.clone(), flat.clone()
    for meta in layout:
        if "lora_B" in meta.name:
            base[meta.start_idx : meta.end_idx] = 0  # B = 0: the adapter is the base model
    for contents, reference in ((trained, adapters["b"]), (base, None), (trained, adapters["b"])):
        flat.copy_(contents)
        out = httpx.post(engine + "/load_lora_adapter_from_tensors", headers=ADMIN, json=body, timeout=60)
        assert out.status_code == 200, out.text
        flat.view(torch.float32).fill_(float("nan"))
        gen = httpx.post(
            engine + "/generate",
            timeout=60,
            json={
                "input_ids": PROMPTS[0],
                "lora_path": "refilled",
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            },
        ).json()
        assert check(tiny_model("qwen2"), reference, PROMPTS[0], gen) <= 1e-4
        httpx.post(engine + "/unload_lora_adapter", headers=ADMIN, json={"lora_name": "refilled"})


def test_bad_adapters_get_400_and_change_nothing(engine, adapters, tmp_path):
    torch.multiprocessing.set_sharing_strategy("file_system")  # as a trainer sends: each case fails on its own flaw
    config, tensors = read_adapter(adapters["b"])
    name = next(n for n in tensors if "q_proj.lora_A" in n)
    payload = lambda named: [serialize(named)]  # noqa: E731

    def load(named, cfg=config, lora_name="x"):
        return httpx.post(
            engine + "/load_lora_adapter_from_tensors",
            headers=ADMIN,
            timeout=60,
            json={"lora_name": lora_name, "config_dict": cfg, "serialized_named_tensors": payload(named)},
        )

    before = {"a": str(adapters["a"])}
    cases = {
        "above --max-lora-rank": httpx.post(
            engine + "/load_lora_adapter", headers=ADMIN, json={"lora_name": "x", "lora_path": str(adapters["big"])}
        ),
        "unknown module": load({name.replace("q_proj", "z_proj"): tensors[name], **tensors}),
        "shape mismatch": load({**tensors, name: tensors[name][:, :-1]}),
        "wrong rank": load(tensors, {**config, "r": 4}),
        "not targeted": load(tensors, {**config, "target_modules": ["q_proj"]}),
        "unpaired": load({k: v for k, v in tensors.items() if "lora_B" not in k}),
        "NaN or inf values": load({**tensors, name: tensors[name].clone().fill_(float("nan"))}),
        # peft saves the output layer's own weight beside its adapter: one of another vocabulary is refused
        "resized vocabulary": load({**tensors, HEAD_BASE: tensors[HEAD_BASE][:-1]}),
        "duplicate name": httpx.post(
            engine + "/load_lora_adapter", headers=ADMIN, json={"lora_name": "a", "lora_path": str(adapters["b"])}
        ),
        "not a directory": httpx.post(
            engine + "/load_lora_adapter", headers=ADMIN, json={"lora_name": "x", "lora_path": str(tmp_path)}
        ),
        "unload unknown": httpx.post(engine + "/unload_lora_adapter", headers=ADMIN, json={"lora_name": "nope"}),
    }
    for what, response in cases.items():
        assert response.status_code == 400, (what, response.text)
        body = response.json()
        assert body["success"] is False and body["error_message"] and body["loaded_adapters"] == before, (what, body)
        assert "shares CPU memory by file descriptor" not in body["error_message"], (what, body)
        assert what not in ("NaN or inf values", "resized vocabulary") or what in body["error_message"], body
    for route, body in (
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["b"])}),
        ("/unload_lora_adapter", {"lora_name": "a"}),
    ):
        assert httpx.post(engine + route, json=body).status_code == 401
        assert httpx.post(engine + route, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    unknown = httpx.post(engine + "/generate", json={"input_ids": [1, 2], "lora_path": "nope"})
    assert unknown.status_code == 400 and "not loaded" in unknown.text
    info = httpx.get(engine + "/server_info").json()
    assert info["enable_lora"] and info["max_lora_rank"] == 8 and info["loaded_lora_adapters"] == before


def test_the_proxy_names_its_adapter_in_every_call_or_the_one_a_model_names(engine, module_procs, tiny_model, adapters):
    """``--lora-name`` (what a LoRA job sets) puts the adapter on every call; an OpenAI ``model`` of
    SGLang's form ``served:adapter`` picks one; any other model name leaves the proxy's default."""
    base = tiny_model("qwen2")
    admin = {"Authorization": "Bearer proxy-key"}

    def sampled_gap(proxy, model: str, adapter) -> float:
        session = httpx.post(proxy.url + "/sessions", json={}, headers=admin).json()
        reply = httpx.post(
            f"{proxy.url}/sessions/{session['session_id']}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        (sample,) = httpx.post(f"{proxy.url}/sessions/{session['session_id']}/finish", headers=admin).json()["samples"]
        tokens, n = sample["tokens"], sample["response_length"]
        ref = reference_logprobs(base, adapter, tokens)
        want = [ref[i - 1, tokens[i]].item() for i in range(len(tokens) - n, len(tokens))]
        return (torch.tensor(sample["rollout_log_probs"]) - torch.tensor(want)).abs().max().item()

    named = module_procs.proxy(engine, base, "--proxy-api-key", "proxy-key", "--lora-name", "a")
    plain = module_procs.proxy(engine, base, "--proxy-api-key", "proxy-key", "--served-model-name", "tiny")
    assert sampled_gap(named, "policy", adapters["a"]) < 1e-4
    assert sampled_gap(plain, "tiny:a", adapters["a"]) < 1e-4
    assert sampled_gap(plain, "other:a", None) < 1e-4  # not the served model's name: the base, as without LoRA


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_a_request_runs_on_across_an_adapter_replaced_while_paused(procs, tiny_model, adapters, mode):
    """A LoRA run's weight sync unloads and loads the policy's adapter while generation is paused:
    a request running on it is neither deadlocked nor aborted, and its tokens carry both versions."""
    import asyncio

    from inverted.train.weight_sync import TensorTransport, WeightSync
    from tests.engine.test_control import LONG, started

    url = procs.engine(
        tiny_model("qwen2"), "--enable-lora", "--max-lora-rank", "8", "--lora-paths", f"policy={adapters['a']}"
    ).url
    config, tensors = read_adapter(adapters["a"])
    newer = [(name, t * 2 if "lora_B" in name else t) for name, t in tensors.items()]
    sync = WeightSync(TensorTransport(torch.device("cpu")), [url], buffer_size=1 << 20, pause_mode=mode, adapter=config)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 300}, "lora_path": "policy"}
        inflight = await started(client, body, min_tokens=20)
        report = await sync.update(newer, "step-1")
        out = await asyncio.wait_for(inflight, 120)
    assert report.bytes == sum(t.numel() for t in tensors.values()) * 4  # the adapter alone, in float32
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 300
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "step-1"] and spans[0]["end"] >= 20
