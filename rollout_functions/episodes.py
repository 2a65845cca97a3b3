"""One episode in one proxy session: the mechanism the agent and subprocess rollouts share.

``run_session`` lets ``play(session, proxy)`` drive a task's session (an environment with an OpenAI
client, or an agent process), and finishes the session with the reward ``play`` returns (one call)
into the task's Sample. Whatever goes wrong in ``play`` (an exception, the episode timeout, an episode
that never called the model or gave no reward) becomes a ``failed`` Sample that says why: the
environment's faults never crash the run, and a failed Sample is never trained on. It also carries
the calls the proxy refused in that session (``metadata.proxy_refused``): an agent that was sent a
4xx and gave up says so.

Each session is opened with the Sample its task made (``Task.new_sample``), and the proxy returns
it whole. A session that branched (the agent rewrote its history) holds several Samples; the
episode's Sample is the last branch, the one whose final turn the reward judged (the proxy sends
that one alone), and its ``metadata.branches`` counts them. Calls that named another model than
the session's main one (a harness's title or quota probe, a second model) are side branches,
left out of the episode's Sample unless ``--rollout-side-calls train``.

An episode whose session the proxy no longer knows (the proxy died and the job started it again,
``inverted.controller.supervisor``) comes back **aborted**, not failed: the buffer queues its task again
and it is played from the start, and nothing of the lost session is trained. The proxy's client
waits out such a restart (``PROXY_OUTAGE_S``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Awaitable, Callable

from inverted.errors import ProtocolError
from inverted.plugins import RolloutContext
from inverted.rollout.proxy.client import ProxyClient, SessionHandle
from inverted.types import Reward, Sample, Task, check_reward

logger = logging.getLogger(__name__)

SESSION_CONNECTIONS = (
    8  # to the proxy, for opening, rewarding and finishing sessions (the model calls have their own pool)
)
PROXY_OUTAGE_S = 60.0  # how long calls to the proxy retry a refused connection: a restart takes seconds
Play = Callable[[SessionHandle, ProxyClient], Awaitable[Reward | None]]  # (session, proxy) -> reward


def failed_sample(task: Task, reason: str, refused: list[dict] | None = None) -> Sample:
    sample = task.new_sample()
    sample.status = Sample.Status.FAILED
    sample.metadata["error"] = reason
    if refused:  # what the proxy refused the agent: often why it gave up
        sample.metadata["proxy_refused"] = refused
        last = refused[-1]
        sample.metadata["error"] += (
            f" (the proxy refused {len(refused)} call(s); the last: {last['route']} "
            f"answered {last['status']}: {last['message']})"
        )
    return sample


def lost_sample(task: Task, reason: str) -> Sample:
    """An aborted Sample: its session died with the proxy, so the buffer queues the task again."""
    sample = task.new_sample()
    sample.status = Sample.Status.ABORTED
    sample.metadata["error"] = f"{reason} (its proxy session was lost: the task is played again)"
    return sample


async def fail(proxy: ProxyClient, session: SessionHandle, task: Task, reason: str) -> Sample:
    """A failed Sample with the calls the proxy refused; the session is freed now, or, with a call
    still running, left to expire (``--proxy-session-timeout``). A session the proxy does not know
    (a restarted proxy forgot it) makes an aborted Sample instead (``lost_sample``)."""
    try:
        refused = await proxy.refused(session.session_id)
    except ProtocolError as error:
        if error.status == 404:
            return lost_sample(task, reason)
        refused = []
    try:
        await proxy.finish(session.session_id)
    except ProtocolError:
        pass
    return failed_sample(task, reason, refused)


def _episode_sample(ctx: RolloutContext, task: Task) -> Sample:
    """The Sample a task's session records into."""
    sample = task.new_sample()
    sample.metadata["rollout_id"] = ctx.rollout_id
    return sample


async def run_session(
    ctx: RolloutContext, proxy: ProxyClient, task: Task, play: Play, session: SessionHandle
) -> Sample:
    reward = None
    try:
        async with asyncio.timeout(ctx.config.rollout_episode_timeout):  # unlike 3.11's wait_for, never eats a cancel
            reward = await play(session, proxy)
        check_reward(reward)  # a NaN or a string is the environment's fault too
    except TimeoutError:
        reason = f"episode timed out after {ctx.config.rollout_episode_timeout:g}s (--rollout-episode-timeout)"
    except Exception as exc:  # the environment's fault, whatever it is, fails this episode only
        logger.warning("episode %d/%d failed: %s: %s", task.group_index, task.index, type(exc).__name__, exc)
        reason = f"{type(exc).__name__}: {exc}"
    else:
        reason = ""
    if reason:
        return await fail(proxy, session, task, reason)
    try:
        samples = await proxy.finish(
            session.session_id, reward, only_last=True, side_calls=ctx.config.rollout_side_calls == "train"
        )
    except ProtocolError as exc:  # e.g. the session expired (--proxy-session-timeout) while the episode ran
        return await fail(proxy, session, task, f"the proxy refused to finish the session: {exc}")
    if not samples:
        return await fail(proxy, session, task, "the episode never called the model")
    (sample,) = samples
    if sample.reward is None:
        return await fail(proxy, session, task, "the episode gave no reward")
    return sample


async def run_all(
    ctx: RolloutContext,
    tasks: list[Task],
    play_for: Callable[[Task], Play],
    scripts: list[list[list[int]]] | None = None,
) -> list[Sample]:
    """Every task's episode, at most ``--rollout-concurrency`` at a time (``scripts``: each task's
    session answers from its script instead of sampling, ``Session.script``).

    The first ``--rollout-concurrency`` sessions are opened in one request, so that those episodes
    start, and their first calls reach the servers, together: opened one by one, 32 sessions took
    ~0.1 s on 2 cores, and the servers decoded that long for the early episodes alone. Each later
    episode opens its own session when a slot frees.
    """
    concurrency = ctx.config.rollout_concurrency
    limit = asyncio.Semaphore(concurrency)

    script = (lambda i: None) if scripts is None else scripts.__getitem__

    async def one(proxy: ProxyClient, i: int, task: Task, session: SessionHandle | None) -> Sample:
        async with limit:
            session = session or await proxy.create_session(_episode_sample(ctx, task), ctx.sampling, script(i))
            return await run_session(ctx, proxy, task, play_for(task), session)

    async with ProxyClient(
        ctx.proxy_url, api_key=ctx.proxy_api_key, max_connections=SESSION_CONNECTIONS, outage_s=PROXY_OUTAGE_S
    ) as proxy:
        first = tasks[:concurrency]
        opened = (
            await proxy.create_sessions(
                [_episode_sample(ctx, t) for t in first],
                ctx.sampling,
                None if scripts is None else scripts[:concurrency],
            )
            if first
            else []
        )
        return list(
            await asyncio.gather(
                *(
                    one(proxy, i, task, session)
                    for i, (task, session) in enumerate(itertools.zip_longest(tasks, opened))
                )
            )
        )
