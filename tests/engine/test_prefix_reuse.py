"""Prefix reuse: a later request that extends an earlier one prefills only what is new, and gets
exactly what an engine without reuse computes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch


@pytest.fixture(scope="module")
def engines(module_procs, tiny_model):
    model = tiny_model("qwen3")
    return (
        module_procs.engine(model, name="reuse").url,
        module_procs.engine(model, "--disable-radix-cache", name="plain").url,
    )


def generate(url: str, ids: list[int], n: int = 16) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def assert_same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    diffs = [
        abs(x[0] - y[0])
        for x, y in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
    ]
    assert max(diffs) < 1e-4


def test_multi_turn_reuses_the_history_and_computes_the_same(engines):
    reuse, plain = engines
    history = list(range(40, 100))
    previous = 0  # tokens the previous turn's request held (prompt + output)
    for turn in range(3):
        got, want = generate(reuse, history), generate(plain, history)
        assert_same(got, want)
        assert want["meta_info"]["cached_tokens"] == 0
        if turn:  # the previous turn's prompt + output (but its last token, never fed back) is reused
            assert got["meta_info"]["cached_tokens"] == previous - 1
        history = history + got["output_ids"] + [7, 8, 9]  # the environment appends its reply
        previous = len(history) - 3


def test_agents_taking_turns_each_find_their_own_history(engines):
    """Eight sessions take turns (each turn a new request that resends the session's history): every
    later turn finds its whole history cached, though the others' requests ran in between."""
    reuse, plain = engines
    histories = [list(range(700 + 60 * i, 740 + 60 * i)) for i in range(8)]
    held = [0] * 8
    for turn in range(3):
        for i, history in enumerate(histories):
            got = generate(reuse, history, 4)
            assert got["meta_info"]["cached_tokens"] == (held[i] - 1 if turn else 0), (turn, i)
            histories[i] = history + got["output_ids"] + [5, 6]
            held[i] = len(histories[i]) - 2
    assert_same(generate(reuse, histories[3], 4), generate(plain, histories[3], 4))


def test_a_shared_prompt_is_reused_and_weights_or_flush_clear_it(procs, tiny_model):
    reuse = procs.engine(tiny_model("qwen3")).url  # its own engine: this test loads other weights
    prompt = list(range(200, 260))
    first = generate(reuse, prompt)
    second = generate(reuse, prompt)
    assert second["meta_info"]["cached_tokens"] == len(prompt) - 1 and second["output_ids"] == first["output_ids"]
    assert "sglang:cached_tokens_total" in httpx.get(reuse + "/metrics").text
    assert httpx.post(reuse + "/flush_cache").status_code == 200
    assert generate(reuse, prompt)["meta_info"]["cached_tokens"] == 0
    update = httpx.post(
        reuse + "/update_weights_from_disk",
        timeout=60,
        json={"model_path": str(tiny_model("qwen3", seed=1)), "flush_cache": False},
    )
    assert update.status_code == 200, update.text
    after = generate(reuse, prompt)
    assert after["meta_info"]["cached_tokens"] == 0  # KV from the old weights is never reused
    assert after["output_ids"] != first["output_ids"]


def test_reuse_under_concurrency_matches(engines):
    reuse, plain = engines
    base = list(range(500, 540))
    generate(reuse, base)

    async def many(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            bodies = [
                {
                    "input_ids": base + [i, i + 1],
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 12 + i, "temperature": 0, "ignore_eos": True},
                }
                for i in range(12)
            ]
            return [r.json() for r in await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))]

    got, want = asyncio.run(many(reuse)), asyncio.run(many(plain))
    for a, b in zip(got, want):
        assert_same(a, b)
    assert sum(g["meta_info"]["cached_tokens"] for g in got) >= len(base)


def test_the_samples_of_one_prompt_share_its_prefill(engines):
    """GRPO's n samples of a prompt arrive together: the prompt is computed once, then copied."""
    reuse, plain = engines
    prompt = list(range(600, 660))
    body = {
        "input_ids": [prompt] * 6,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    got = httpx.post(reuse + "/generate", json=body, timeout=60).json()
    want = generate(plain, prompt, 8)
    for out in got:
        assert_same(out, want)
    assert sorted(out["meta_info"]["cached_tokens"] for out in got) == [0] + [len(prompt) - 1] * 5


@pytest.mark.anyio
async def test_kv_computed_before_an_in_place_weight_load_is_never_lent(procs, tiny_model):
    from tests.engine.test_control import started

    engine = procs.engine(tiny_model("qwen3")).url  # its own engine: this test loads other weights
    prompt = list(range(300, 340))
    long = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        running = await started(client, long)
        await client.post("/pause_generation", json={"mode": "in_place"})
        update = await client.post(
            "/update_weights_from_disk",
            json={"model_path": str(tiny_model("qwen3", seed=1)), "flush_cache": False, "abort_all_requests": False},
        )
        assert update.status_code == 200, update.text
        await client.post("/continue_generation", json={})
        # The running request's KV came from the old weights: no new request may copy it, neither
        # while it runs nor once it has finished.
        short = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert (await client.post("/generate", json=short)).json()["meta_info"]["cached_tokens"] == 0
        old_tokens = (await asyncio.wait_for(running, 60))["output_ids"]
        assert len(old_tokens) == 400
        # Its row would share the prompt and 5 more tokens; the short request's row (new weights) at most one more.
        follow = {"input_ids": prompt + old_tokens[:5], "sampling_params": {"max_new_tokens": 2}}
        cached = (await client.post("/generate", json=follow)).json()["meta_info"]["cached_tokens"]
    assert len(prompt) <= cached <= len(prompt) + 1


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))


@pytest.mark.anyio
async def test_a_prompt_sampled_again_is_forked_from_the_state_its_first_sample_kept(engines):
    """GRPO's samples of a prompt arrive one by one, as their episodes call: while the first runs and
    after it has finished. Each later one copies the whole prompt's KV and samples its first token from
    the hidden state the first kept at the prompt's last position: the prompt is computed once (not
    once plus a token per sample), and every sample is what an engine without reuse computes."""
    from tests.engine.test_control import started

    reuse, plain = engines
    finished, running = list(range(800, 850)), list(range(900, 930))
    counters = ("inverted:prefill_tokens_total", "sglang:prompt_tokens_total", "sglang:cached_tokens_total")
    before = [metric(reuse, name) for name in counters]
    async with httpx.AsyncClient(base_url=reuse, timeout=120) as client:

        async def sample(prompt: list[int], n: int = 8) -> dict:
            body = {
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            }
            return (await client.post("/generate", json=body)).json()

        after_it = [await sample(finished) for _ in range(3)]  # each after the one before finished
        # greedy and past EOS: a sampled stop token once ended it before the samples beside it had forked
        long = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
        first = await started(client, {"input_ids": running, "sampling_params": long})
        beside_it = await asyncio.gather(*(sample(running) for _ in range(3)))
        assert not first.done()  # they forked from a running request's row
        await first
    computed, sent, cached = (metric(reuse, name) - b for name, b in zip(counters, before))
    assert computed == len(finished) + len(running)  # each prompt once
    # SGLang's counters: every prompt token sent, and what its cache serves of them (nothing of a prompt's
    # first request; all but the last token of each later one)
    assert sent == 3 * len(finished) + 4 * len(running)
    assert cached == 2 * (len(finished) - 1) + 3 * (len(running) - 1)
    for prompt, outs in ((finished, after_it), (running, beside_it)):
        want = generate(plain, prompt, 8)
        for out in outs:
            assert_same(out, want)
        assert [out["meta_info"]["cached_tokens"] for out in outs][-2:] == [len(prompt) - 1] * 2  # SGLang's count


def test_a_fork_whose_holder_is_taken_in_its_own_step_is_prefilled_and_exact(tiny_model):
    """A fork is decided when it is admitted and placed after the step's prefills; if the kept row holding
    its prompt was given to a request admitted after it (two rows, both kept), it copies what is left and is
    prefilled: the same tokens and log-probs as when its prompt was first computed."""
    import threading
    import time

    from inverted.engine.model import load_model
    from inverted.engine.sampling import SamplingParams
    from inverted.engine.scheduler import Request, Scheduler

    model = load_model(tiny_model("qwen2"), torch.float32, torch.device("cpu"))
    scheduler = Scheduler(
        model,
        max_running=2,
        context_length=256,
        max_prefill_tokens=2048,
        weight_version="0",
        stop_checker=lambda req: None,
        random_seed=0,
    )
    threading.Thread(target=scheduler.run, daemon=True).start()

    def run(*prompts: list[int]) -> list[Request]:
        """Submit while paused, so that the requests are admitted in one step, in this order."""
        done = threading.Semaphore(0)
        scheduler.call(lambda: scheduler.pause("in_place")).result()
        reqs = [
            Request(
                rid=f"r{i}",
                input_ids=p,
                params=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True),
                notify=lambda req, n: done.release() if req.finished else None,
                return_logprob=True,
            )
            for i, p in enumerate(prompts)
        ]
        for req in reqs:
            scheduler.submit(req)
        scheduler.call(scheduler.resume).result()
        deadline = time.monotonic() + 60
        for _ in reqs:
            while not done.acquire(timeout=0.1):
                assert scheduler.alive and time.monotonic() < deadline, f"stopped: {scheduler.error!r}"
        return reqs

    held, other, new = list(range(40, 70)), list(range(100, 130)), list(range(200, 230))
    try:
        (first,) = run(held)  # its row is kept, with the prompt's state
        run(other)  # takes row 0; the held prompt's row moves to row 1, the least recently used
        computed = scheduler.stats["prefill_tokens"]
        fork, _ = run(held, new)  # a fork when admitted; then `new` takes row 0 and the held prompt's row goes
        assert (
            scheduler.error is None
            and fork.cached_tokens == 0
            and fork.finish_reason == {"type": "length", "length": 6}
        )
        assert scheduler.stats["prefill_tokens"] - computed == len(held) + len(new)
        assert fork.output_ids == first.output_ids
        assert max(abs(a - b) for a, b in zip(fork.output_logprobs, first.output_logprobs)) < 1e-5
    finally:
        scheduler.stop()
