"""The supervisor heals a part of a running job that a step finds dead: here the real sgl-router
in front of an embedded engine, killed just before the step asks it which workers it served."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from inverted.controller.supervisor import Supervisor
from inverted.errors import ServiceUnavailable
from inverted.rollout.config import ServersConfig
from inverted.rollout.servers import RolloutServers
from inverted.rollout.sglang_client import SGLangClient

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # a router killed and started again: left out of make test-fast


def kill(servers: RolloutServers) -> None:
    router = servers.router
    assert router is not None
    router.popen.kill()
    router.popen.wait()


async def test_a_step_that_finds_the_router_dead_heals_it_and_trains(tiny_model, tmp_path):
    """A chaos run's router kill stopped the job once: the step's check of the router's workers came
    before the supervisor's next round, and failed. With the supervisor's ``heal`` the step waits
    out a restart under way, or makes it, and asks the new router."""
    cfg = ServersConfig(
        hf_checkpoint=str(tiny_model("qwen2")),
        num_engines=1,
        engine_threads=1,
        log_dir=str(tmp_path),
        admin_api_key="admin-key",
    )
    async with RolloutServers(cfg) as servers:
        job = SimpleNamespace(cfg=None, run_dir=tmp_path, processes=[], servers=servers, trainer=None, version=0)
        supervisor = Supervisor(job)
        kill(servers)
        with pytest.raises(ServiceUnavailable):  # alone, the check cannot tell a dead router from a broken one
            await servers.verify_workers()
        dead = servers.router
        await servers.verify_workers(heal=supervisor.heal)  # the step makes the restart
        assert servers.router is not dead and not servers.router_exited
        kill(servers)  # the supervisor's own round already restarting it as the step asks
        await asyncio.gather(supervisor.heal(), servers.verify_workers(heal=supervisor.heal))
        assert supervisor.metrics()["faults/service_restarts"] == 2
        async with servers.control() as router:  # every live server is served again
            assert await router.healthy_urls() == set(servers.engine_urls)
        async with SGLangClient(servers.router_url) as client:
            reply = await client.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
        assert len(reply["output_ids"]) == 3
