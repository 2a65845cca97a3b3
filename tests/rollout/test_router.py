"""Embedded engines behind the real sgl-router, started and registered by ``RolloutServers``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from inverted.errors import UnknownWorker
from inverted.rollout.config import ServersConfig
from inverted.rollout.servers import ROUTER_DEFAULTS, RolloutServers
from inverted.rollout.sglang_client import RouterClient, SGLangClient

pytestmark = pytest.mark.anyio


def requests_served(url: str) -> int:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("sglang:num_requests_total "):
            return int(line.split()[1])
    raise AssertionError("no request counter")


def body(i: int, prefix: list[int] | None = None) -> dict:
    ids = (prefix or []) + [100 + i, 7, 8, 9]
    return {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}


@pytest.mark.slow  # three engines behind four routers: left out of make test-fast
async def test_round_robin_cache_aware_and_worker_registration(tiny_model, tmp_path, module_procs):
    cfg = ServersConfig(hf_checkpoint=str(tiny_model("qwen2")), num_engines=2, engine_threads=1, log_dir=str(tmp_path))
    async with RolloutServers(cfg, ["--policy", "round_robin"]) as servers:
        a, b = servers.engine_urls
        async with SGLangClient(servers.router_url) as client, RouterClient(servers.router_url) as router:
            outs = await asyncio.gather(*(client.generate(body(i)) for i in range(10)))
            for out in outs:
                assert len(out["output_ids"]) == 6 and len(out["meta_info"]["output_token_logprobs"]) == 6
                assert out["meta_info"]["weight_version"] == "default"
            assert requests_served(a) == 5 and requests_served(b) == 5

            # A third engine registered with POST /workers receives its share.
            c = await servers.add_engine()
            assert {w["url"] for w in await router.list_workers()} == {a, b, c}
            for i in range(9):
                await client.generate(body(i))
            assert requests_served(c) == 3

            # Removed by URL (the router removes by id): it gets nothing more.
            assert await router.remove_worker(c)
            for _ in range(100):
                if c not in {w["url"] for w in await router.list_workers()}:
                    break
                await asyncio.sleep(0.1)
            before = requests_served(c)
            await asyncio.gather(*(client.generate(body(i)) for i in range(6)))
            assert requests_served(c) == before

        # A second router with the cache-aware policy over the same engines: a shared prefix sticks.
        cache_router = module_procs.router("--policy", "cache_aware")
        async with RouterClient(cache_router.url) as router2, SGLangClient(cache_router.url) as client2:
            for url in (a, b):
                await router2.add_worker(url)
            while len(await router2.healthy_urls()) < 2:
                await asyncio.sleep(0.1)
            counts = {u: requests_served(u) for u in (a, b)}
            prefix = list(range(300, 364))
            for i in range(8):
                out = await client2.generate(body(i, prefix))
                assert len(out["output_ids"]) == 6
            served = {u: requests_served(u) - counts[u] for u in (a, b)}
            assert sorted(served.values()) == [0, 8], served

            # A batch sent at once with one shared prefix (an RL rollout): cache-aware routing alone puts it
            # all on one engine; with the job's balance defaults both engines share it.
            balance = [
                x for flag, value in ROUTER_DEFAULTS.items() if flag.startswith("--balance") for x in (flag, value)
            ]
            assert balance, "the job's router defaults must bound the load imbalance"
            for args, spread in (((), False), (balance, True)):
                batch_router = module_procs.router("--policy", "cache_aware", "--worker-urls", a, b, *args)
                async with RouterClient(batch_router.url) as router3, SGLangClient(batch_router.url) as client3:
                    while len(await router3.healthy_urls()) < 2:
                        await asyncio.sleep(0.1)
                    counts = {u: requests_served(u) for u in (a, b)}
                    await asyncio.gather(
                        *(
                            client3.generate(
                                {**body(i, prefix), "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
                            )
                            for i in range(16)
                        )
                    )
                served = {u: requests_served(u) - counts[u] for u in (a, b)}
                assert (min(served.values()) >= 4) if spread else (sorted(served.values()) == [0, 16]), (args, served)


async def test_each_server_holds_the_kv_cache_the_job_gives_it(tiny_model, tmp_path):
    """``--max-total-tokens`` (SGLang's flag, a job flag too) bounds every server's KV cache, as its
    ``/server_info`` says; without it each backend keeps its own default."""
    cfg = ServersConfig(
        hf_checkpoint=str(tiny_model("qwen2")),
        num_engines=1,
        engine_threads=1,
        log_dir=str(tmp_path),
        context_length=1024,
        max_total_tokens=3000,
    )
    async with RolloutServers(cfg) as servers:
        (url,) = servers.engine_urls
        async with SGLangClient(url) as client:
            assert (await client.server_info())["max_total_num_tokens"] == 3000


async def test_servers_report_a_dead_engine_with_its_log(tmp_path, tiny_model):
    # A checkpoint whose weights are unreadable: the engine exits, and startup says why.
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model("qwen2").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    cfg = ServersConfig(
        hf_checkpoint=str(broken), num_engines=1, engine_threads=1, log_dir=str(tmp_path / "logs"), startup_timeout=60
    )
    from inverted.errors import ModelError, ServiceUnavailable

    with pytest.raises(ServiceUnavailable, match=r"(?s)engine-0 exited with code [1-9].*safetensors"):
        async with RolloutServers(cfg):
            pass
    # One whose config is unreadable is refused before anything starts (the context length is read there).
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"cannot read .*config.json"):
        RolloutServers(cfg)


async def test_the_router_drops_return_routed_experts_so_the_workers_client_calls_the_workers(tiny_model, tmp_path):
    """sgl-router 0.3.2's typed /generate request has no return_routed_experts and no return_sampling_mask:
    through it no server is asked for either. ``generate_client`` then sends such calls to one of the
    router's workers (``WorkersClient``; every call, with routed experts), the same prompt to the same
    one, and the others through the router (``SplitClient``)."""
    from inverted.rollout.servers import ROUTED_EXPERTS_ARGV
    from inverted.rollout.sglang_client import (
        SplitClient,
        WorkersClient,
        generate_client,
        read_routed_experts,
        read_sampling_mask,
    )

    cfg = ServersConfig(
        hf_checkpoint=str(tiny_model("qwen3_moe")), num_engines=2, engine_threads=1, log_dir=str(tmp_path)
    )
    async with RolloutServers(cfg, flags=ROUTED_EXPERTS_ARGV) as servers:
        asked = {**body(0), "return_routed_experts": True}
        masked = {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 3, "top_k": 4},
            "return_sampling_mask": True,
        }
        async with (
            SGLangClient(servers.router_url) as router,
            generate_client(servers.router_url) as split,
            generate_client(servers.router_url, routed_experts=True) as direct,
        ):
            assert isinstance(split, SplitClient) and isinstance(direct, WorkersClient)
            assert read_routed_experts(await router.generate(asked)) is None
            assert read_sampling_mask(await router.generate(masked)) is None
            masks, _ = read_sampling_mask(await split.generate(masked))
            assert len(masks) == 3 and all(len(m) <= 4 for m in masks)
            served = [[requests_served(url) for url in servers.engine_urls]]
            for _ in range(2):  # the same 8 prompts twice: each goes where it went the first time
                outs = await asyncio.gather(
                    *(direct.generate({**body(i), "return_routed_experts": True}) for i in range(8))
                )
                assert all(read_routed_experts(out) for out in outs)
                served.append([requests_served(url) for url in servers.engine_urls])
            first, second = ([b - a for a, b in zip(*pair)] for pair in zip(served, served[1:]))
            assert first == second and sum(first) == 8 and min(first) > 0, served


async def test_with_keys_only_the_job_changes_the_routers_workers_or_generates_through_it(
    tiny_model, tmp_path, module_procs
):
    """The audit's attack: anyone on the machine POSTed a worker of their own to the job's router
    and 2,525 of 3,072 stored Samples came from it. Now sgl-router's own authentication refuses it."""
    cfg = ServersConfig(
        hf_checkpoint=str(tiny_model("qwen2")),
        num_engines=1,
        engine_threads=1,
        log_dir=str(tmp_path),
        admin_api_key="admin-key",
        router_api_key="router-key",
    )
    async with RolloutServers(cfg) as servers:
        (ours,) = servers.engine_urls
        async with httpx.AsyncClient(timeout=10) as http:
            for key in (None, "router-key", "wrong"):  # the control plane takes the admin key alone
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                added = await http.post(
                    servers.router_url + "/workers", json={"url": "http://127.0.0.1:9"}, headers=headers
                )
                removed = await http.delete(servers.router_url + "/workers/anything", headers=headers)
                assert added.status_code == removed.status_code == 401
            for url in (servers.router_url, ours):  # nor can anyone generate through the router or at the server
                refused = await http.post(url + "/generate", json=body(0))
                assert refused.status_code == 401
            assert (await http.get(ours + "/health")).status_code == 200
        async with SGLangClient(servers.router_url, api_key="router-key") as client:
            assert len((await client.generate(body(0)))["output_ids"]) == 6
        await servers.verify_workers()  # only ours
        # and no key is on any command line the job started (anyone on the machine may read those)
        commands = [
            (Path(f"/proc/{p.popen.pid}/cmdline").read_bytes(), p.name) for p in [*servers.engines, servers.router]
        ]
        assert all(b"admin-key" not in c and b"router-key" not in c for c, _ in commands), commands
        async with servers.control() as router:
            assert await router.urls() == {ours}
            # A worker the job did not start (added with the key, as an insider could): found, taken out.
            stranger = module_procs.engine(tiny_model("qwen2")).url
            await router.add_worker(stranger)
            for _ in range(100):
                if stranger in await router.urls():
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(UnknownWorker, match=f"served \\['{stranger}'\\], which this job did not start"):
                await servers.verify_workers()
            for _ in range(50):
                if await router.urls() == {ours}:
                    break
                await asyncio.sleep(0.1)
            assert await router.urls() == {ours}
