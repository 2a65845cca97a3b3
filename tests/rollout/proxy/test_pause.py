"""Weight updates under a running episode: calls wait while servers are paused; an aborted call is
resumed from its recorded tokens (``--partial-rollout``, each token keeping its version) or
sampled again."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from inverted.rollout.proxy.generation import Sampled, sample_turn
from inverted.rollout.sglang_client import SGLangClient
from inverted.types import Sample
from tests.rollout.proxy.conftest import Stack, start_stack
from tests.rollout.proxy.test_recording import check_exact

pytestmark = pytest.mark.anyio
N = 600  # long enough to be paused mid-way (the pause comes after 20 tokens)
LONG = {"messages": [{"role": "user", "content": "tell a long story"}], "max_tokens": N, "min_tokens": N}


@pytest.fixture(scope="module")
def stack(module_procs, taught_model) -> Stack:
    """This module's own: its tests pause the engine and change its weight version."""
    return start_stack(module_procs, taught_model)


async def run_through_a_weight_update(stack, proxy_url: str, version: str) -> tuple[Sample, list[dict]]:
    """Start a long call, abort it mid-way with a pause, bump the weight version, continue."""
    async with httpx.AsyncClient(timeout=120) as http, SGLangClient(stack.engine.url) as engine:
        session = (await http.post(proxy_url + "/sessions", json={})).json()
        logged = len(stack.engine_requests())
        call = asyncio.create_task(http.post(session["base_url"] + "/chat/completions", json=LONG))
        generated = stack.engine_metric("sglang:generation_tokens_total")
        while stack.engine_metric("sglang:generation_tokens_total") < generated + 20:
            assert not call.done(), (await call).text
            await asyncio.sleep(0.02)
        await engine.pause_generation("abort")
        await engine.update_weight_version(version, abort_all_requests=False)
        await engine.continue_generation()
        response = await call
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == N
        samples = (await http.post(f"{proxy_url}/sessions/{session['session_id']}/finish")).json()["samples"]
    return Sample.from_json(samples[0]), stack.engine_requests()[logged:]


async def test_partial_rollout_resumes_with_per_token_versions(module_procs, stack):
    proxy = module_procs.proxy(stack.router.url, stack.model, "--partial-rollout")
    sample, log = await run_through_a_weight_update(stack, proxy.url, "v-partial")
    first, second = log
    assert first["finish_reason"]["type"] == "abort" and 0 < len(first["output_ids"]) < N
    assert second["input_ids"] == first["input_ids"] + first["output_ids"]  # resumed from its own tokens
    assert sample.tokens == second["input_ids"] + second["output_ids"]
    assert sample.response_length == N and sample.loss_mask == [1] * N
    k = len(first["output_ids"])
    assert sample.weight_versions[:k] == [sample.weight_versions[0]] * k and sample.weight_versions[0] != "v-partial"
    assert sample.weight_versions[k:] == ["v-partial"] * (N - k)
    assert sample.metadata["turns"][0]["resumes"] == 1


async def test_without_partial_rollout_an_aborted_call_is_sampled_again(module_procs, stack):
    proxy = module_procs.proxy(stack.router.url, stack.model)
    sample, log = await run_through_a_weight_update(stack, proxy.url, "v-retry")
    first, second = log
    assert first["finish_reason"]["type"] == "abort"
    assert second["input_ids"] == first["input_ids"]  # the aborted tokens are dropped
    check_exact(sample, log)
    assert sample.weight_versions == ["v-retry"] * N


async def test_a_resume_the_servers_would_refuse_ends_the_turn_at_the_length_it_has(stack):
    """An aborted call is resumed with its sampled tokens as prompt; past the longest prompt the servers take
    (SGLang refuses the last 6 tokens of the context: hf_checkpoint.longest_prompt) nothing is sent again,
    and the turn ends, ``length``, with every token it has."""
    prompt = [5, 6, 7]
    async with SGLangClient(stack.engine.url) as engine:

        async def last() -> Sampled:
            sampling = {"max_new_tokens": N, "min_new_tokens": N}
            turn = sample_turn(
                engine, prompt, sampling, stream=True, partial_rollout=True, max_resumes=4, prompt_limit=len(prompt) + 1
            )
            async for state in turn:
                pass
            return state

        logged = len(stack.engine_requests())
        call = asyncio.create_task(last())
        generated = stack.engine_metric("sglang:generation_tokens_total")
        while stack.engine_metric("sglang:generation_tokens_total") < generated + 20:
            await asyncio.sleep(0.02)
        await engine.pause_generation("abort")
        try:
            state = await asyncio.wait_for(call, 30)  # while paused: no resume waits on the server
        finally:
            await engine.continue_generation()
    assert 20 <= len(state.ids) < N and state.finish == {"type": "length", "length": len(state.ids)}
    assert state.resumes == 1 and len(stack.engine_requests()[logged:]) == 1


async def test_calls_wait_while_servers_are_paused(stack):
    async with httpx.AsyncClient(timeout=60) as http, SGLangClient(stack.engine.url) as engine:
        session = (
            await http.post(stack.proxy.url + "/sessions", json={}, headers={"Authorization": "Bearer admin-key"})
        ).json()
        await engine.pause_generation("retract")
        try:
            call = asyncio.create_task(
                http.post(
                    session["base_url"] + "/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                )
            )
            await asyncio.sleep(1.0)
            assert not call.done()
        finally:
            await engine.continue_generation()
        response = await call
        # It completes once the server continues (the sampled reply may end early at the stop token).
        assert response.status_code == 200 and 1 <= response.json()["usage"]["completion_tokens"] <= 4


@pytest.mark.slow  # a server killed mid-call and another started: left out of make test-fast
@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_whose_server_dies_is_finished_on_the_server_that_replaces_it(procs, taught_model, stream):
    """The server is killed mid-call and, as the job heals, another takes its place in the router: the
    call still answers 200 with every token, sampled again (or resumed, once streamed tokens reached
    the client), and the Sample is exact against what the servers produced."""
    import os
    import signal

    from inverted.rollout.sglang_client import RouterClient

    first = procs.engine(taught_model, "--log-requests", name="first")
    router = procs.routed(first)
    proxy = procs.proxy(router.url, taught_model, "--proxy-server-loss-wait", "60")
    async with httpx.AsyncClient(timeout=120) as http, RouterClient(router.url) as workers:
        session = (await http.post(proxy.url + "/sessions", json={})).json()
        call = asyncio.create_task(
            http.post(session["base_url"] + "/chat/completions", json={**LONG, "stream": stream})
        )
        while Stack(first, router, proxy, taught_model).engine_metric("sglang:generation_tokens_total") < 20:
            assert not call.done(), (await call).text
            await asyncio.sleep(0.02)
        os.kill(first.popen.pid, signal.SIGKILL)
        await workers.remove_worker(first.url)
        second = procs.engine(taught_model, "--log-requests", name="second")
        await workers.add_worker(second.url)
        response = await call
        assert response.status_code == 200, response.text
        samples = (await http.post(f"{proxy.url}/sessions/{session['session_id']}/finish")).json()["samples"]
    (sample,) = [Sample.from_json(s) for s in samples]
    assert sample.response_length == N and sample.metadata["turns"][0]["finish_reason"] == "length"
    replaced = Stack(second, router, proxy, taught_model).engine_requests()
    assert len(replaced) == 1
    if stream and replaced[0]["input_ids"] != sample.tokens[: len(sample.tokens) - N]:  # resumed after streamed tokens
        assert sample.tokens[-len(replaced[0]["output_ids"]) :] == replaced[0]["output_ids"]
        assert sample.metadata["turns"][0]["resumes"] == 1
    else:
        check_exact(sample, replaced)
