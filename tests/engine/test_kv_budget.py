"""The KV cache within its budget (``--max-total-tokens``): a long request runs with fewer rows beside
it, requests wait for room instead of growing the cache past the budget, and every answer is the one
the request gets alone."""

from __future__ import annotations

import concurrent.futures

import httpx
import torch

from inverted.engine.model import KVCache
from inverted.hf_checkpoint import ModelSpec
from tests.engine.test_batching import generate


def test_the_cache_holds_fewer_rows_as_it_grows_and_gets_them_back_when_reset(tiny_model):
    spec = ModelSpec.from_checkpoint(tiny_model("qwen2"))
    cache = KVCache(spec, rows=8, max_len=1024, dtype=torch.float32, device=torch.device("cpu"), budget=1024)
    assert (cache.rows, cache.capacity) == (8, 64)
    cache.k[:, 0, :, :10] = 1.0
    cache.reserve(100, in_use=2)  # doubled to 128: the budget holds 8 rows of it
    assert (cache.rows, cache.capacity) == (8, 128)
    cache.reserve(300, in_use=2)  # 512 would leave 2 rows: capacity and rows within 1,024 positions
    assert cache.capacity >= 300 and cache.rows * cache.capacity <= 1024 and cache.rows >= 2
    assert bool((cache.k[:, 0, :, :10] == 1.0).all()) and bool((cache.k[:, 0, :, 10:] == 0).all())
    cache.reserve(1000, in_use=1)  # one whole-context request: one row
    assert (cache.rows, cache.capacity) == (1, 1000) and bool((cache.k[:, 0, :, :10] == 1.0).all())
    cache.reset()
    assert (cache.rows, cache.capacity) == (8, 64)


def test_long_requests_wait_for_room_and_each_answer_is_the_one_it_gets_alone(module_procs, tiny_model):
    # room for one request of 1,024 tokens, or eight of 128
    engine = module_procs.engine(
        tiny_model("qwen2"), "--context-length", "1024", "--max-total-tokens", "1024", "--max-running-requests", "8"
    )
    assert httpx.get(engine.url + "/server_info").json()["max_total_num_tokens"] == 1024
    params = {"temperature": 0, "ignore_eos": True}
    prompts = [[5 + i, 17, 300, 42 + i] for i in range(4)]
    alone = [
        generate(engine.url, input_ids=p, sampling_params={**params, "max_new_tokens": 600})["output_ids"]
        for p in prompts
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        long = [
            pool.submit(generate, engine.url, input_ids=p, sampling_params={**params, "max_new_tokens": 600})
            for p in prompts
        ]
        short = [
            pool.submit(generate, engine.url, input_ids=p, sampling_params={**params, "max_new_tokens": 20})
            for p in prompts
        ]
        assert [f.result()["output_ids"] for f in long] == alone
        assert [f.result()["output_ids"] for f in short] == [a[:20] for a in alone]
