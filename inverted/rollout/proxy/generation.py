"""One turn's sampling on the rollout servers: token ids in, ids + logprobs + weight versions out.

``sample_turn`` calls ``/generate`` on the router with ``input_ids`` and ``return_logprob`` and
yields the turn's growing state (once per engine call without streaming, once per chunk with it).
A weight update may pause the servers: new calls then queue at the engine and simply wait (up
to the generate timeout); a running call may come back aborted (``finish_reason.type ==
"abort"``). Then:
- with ``partial_rollout`` (or once streamed tokens have reached the client, who cannot un-see
  them) the call is **resumed**: the prompt plus the tokens sampled so far go back in, and the new
  tokens are appended; every token keeps the weight version it was sampled under;
- otherwise the tokens are dropped and the call is **retried** from its prompt.
More than ``max_resumes`` aborts in one call raise ``ServiceUnavailable``.

A call whose server died under it (or that found no live server: the router's 503 while the job
replaces them) is handled the same way, resumed or sampled again, on whichever server is live,
for up to ``server_loss_wait`` seconds with a short backoff: a node lost mid-rollout costs the
episodes on it the time until a server answers again, not the episodes themselves.

Per-token versions come from the engine (``sglang_client.read_output``); so do, for a call
constrained by a ``json_schema`` or ``regex``, the tokens' logprobs before the grammar's mask
where the server reports them (the embedded engine does; ``engine/grammar.py``). In a LoRA run every call
names the policy's adapter (``lora_path``). With ``routes_from`` (a MoE policy trained with rollout
routing replay) each call asks for ``return_routed_experts`` from that position on
(``routed_experts_start_len``: what earlier turns recorded is not sent again); the last call's
answer covers the rest of the prompt and every token sampled so far, resumed calls included, and
is kept as ``routes``. That record of earlier turns holds only while the weights are those it was
made under (``routes_version``): after an update the server runs the whole prompt again on the new
weights, so a turn sampled under other weights asks, once done, for the routes of its whole sequence
as the server holds them (a prefill-only call that its prefix cache answers), and the earlier turns'
parts are replaced (``Sampled.routes_from`` 0).

With ``mask_top_k`` a call whose sampling truncates (top-p, top-k, min-p) asks for each token's
sampling mask (``sglang_client.with_sampling_mask``): every sampled token then keeps the set it was
drawn from (``kept``) and, as its logprob, the one renormalised over that set.

``scripted_turn`` answers a scripted session's call (``Session.script``) with its given reply
instead: the same state, as a server would have ended it, with no server involved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator

from inverted.errors import ServiceUnavailable
from inverted.rollout.sglang_client import (
    GenerateClient,
    read_cached_tokens,
    read_output,
    read_routed_experts,
    read_sampling_mask,
    read_unconstrained_logprobs,
    with_sampling_mask,
)

logger = logging.getLogger(__name__)

LOST_SERVER_BACKOFF_S = (0.25, 2.0)  # first and longest wait between tries after a lost server
SCRIPT_VERSION = "script"  # the weight version of a scripted reply's tokens: none sampled them (counts as 0)


@dataclass(slots=True)
class Sampled:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    tops: list[list[tuple[float, int]]] = field(default_factory=list)  # per token, when top logprobs were asked for
    finish: dict[str, Any] | None = None  # SGLang's finish_reason once the turn is done
    routes: str | None = None  # the routed experts of prompt[routes_from:] + ids (read_routed_experts), when asked for
    routes_from: int | None = None  # where ``routes`` begins: the call's routes_from, or 0 when it covers everything
    routes_version: str | None = None  # the one weight version the whole record was computed under (None: mixed)
    # per token: its logprob before a grammar's mask, where the server reports one (constrained calls), else None
    unconstrained: list[float | None] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)  # per token: the set it was sampled from ([]: whole vocabulary)
    cached_tokens: int = 0  # prompt tokens the server reused from its prefix cache (the call's first try)
    resumes: int = 0
    retries: int = 0
    lost: int = 0  # tries that lost their server

    @property
    def reason(self) -> str:
        return (self.finish or {}).get("type", "")


async def sample_turn(
    client: GenerateClient,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    *,
    stream: bool,
    partial_rollout: bool,
    max_resumes: int,
    top_logprobs: int = 0,
    lora_path: str | None = None,
    routes_from: int | None = None,
    routes_version: str | None = None,
    server_loss_wait: float = 0.0,
    mask_top_k: int = 0,
    prompt_limit: int | None = None,
) -> AsyncGenerator[Sampled, None]:
    """Yield the turn's state as it grows; the last state yielded has ``finish`` set. ``lora_path``: the
    LoRA adapter to sample from (None: the base model); ``routes_from``: ask for the routed experts of
    the tokens from this position on (None: not at all), earlier turns' record of the rest having been made
    under weights ``routes_version`` (None: unknown or mixed); ``server_loss_wait``: seconds to go on trying
    after the servers fail the call; ``mask_top_k``: ask for sampling masks (0: never); ``prompt_limit``: the
    longest prompt the servers take (``hf_checkpoint.longest_prompt``), past which a resume cannot be sent
    and the turn ends at the length it has."""
    state = Sampled()
    budget = sampling["max_new_tokens"]
    aborts = 0
    lost_since: float | None = None
    while True:
        params = {**sampling, "max_new_tokens": budget - len(state.ids)}
        if "min_new_tokens" in params:  # a resumed call owes only what is still missing
            params["min_new_tokens"] = max(0, params["min_new_tokens"] - len(state.ids))
        payload = {"input_ids": prompt_ids + state.ids, "sampling_params": params, "return_logprob": True}
        if top_logprobs:
            payload["top_logprobs_num"] = top_logprobs
        if lora_path:
            payload["lora_path"] = lora_path
        if routes_from is not None:
            payload |= {"return_routed_experts": True, "routed_experts_start_len": routes_from}
        payload = with_sampling_mask(payload, mask_top_k)
        kept = len(state.ids)
        if stream:
            chunks = client.generate_stream(payload)
        else:
            chunks = _single(client.generate(payload))
        try:
            async for body in chunks:
                ids, logprobs, versions, tops, finish = read_output(body, client.base_url)
                masks = read_sampling_mask(body, client.base_url) if payload.get("return_sampling_mask") else None
                if masks is not None:  # each token's probability within the set it was drawn from
                    logprobs = masks[1]
                del state.ids[kept:], state.logprobs[kept:], state.versions[kept:], state.tops[kept:], state.kept[kept:]
                state.kept += masks[0] if masks is not None else [[] for _ in ids]
                state.ids += ids
                state.logprobs += logprobs
                state.versions += versions
                state.tops += tops
                state.finish = finish
                if not kept:  # the first try's: a resumed one finds its own sampled tokens cached too
                    state.cached_tokens = read_cached_tokens(body)
                state.routes = read_routed_experts(body)  # the last chunk (or answer) of a call carries them
                unconstrained = read_unconstrained_logprobs(body)
                del state.unconstrained[kept:]
                fresh: list[float | None] = [None] * len(ids)
                if unconstrained and len(unconstrained) == len(ids):
                    fresh = list(unconstrained)
                state.unconstrained += fresh
                if routes_from is not None and finish is not None and finish.get("type") != "abort":
                    await _settle_routes(client, state, prompt_ids, routes_from, routes_version, versions, lora_path)
                if finish is None or finish.get("type") != "abort":
                    yield state
        except ServiceUnavailable as error:
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since >= server_loss_wait:
                raise
            state.lost += 1
            delay = min(LOST_SERVER_BACKOFF_S[0] * 2 ** (state.lost - 1), LOST_SERVER_BACKOFF_S[1])
            logger.warning("a call lost its server (%s); trying again in %.2fs", error, delay)
            await asyncio.sleep(delay)
            if len(state.ids) == kept:
                continue  # nothing of this try reached anyone: send it again as it was
            state.finish = {"type": "abort"}  # what it had streamed is kept, as an abort's
        else:
            lost_since = None
            if state.reason != "abort":
                return
            aborts += 1
            if aborts > max_resumes:
                raise ServiceUnavailable(
                    f"generation was aborted {aborts} times (weight updates or aborts); giving up",
                    url=client.base_url + "/generate",
                )
        if partial_rollout or (stream and state.ids):
            state.resumes += 1
            past_limit = prompt_limit is not None and len(prompt_ids) + len(state.ids) > prompt_limit
            if len(state.ids) >= budget or past_limit:
                state.finish = {"type": "length", "length": min(len(state.ids), budget)}
                yield state
                return
        else:
            state.retries += 1
            del state.ids[:], state.logprobs[:], state.versions[:], state.tops[:], state.unconstrained[:], state.kept[:]
        state.finish = None


async def _settle_routes(
    client: GenerateClient,
    state: Sampled,
    prompt_ids: list[int],
    routes_from: int,
    routes_version: str | None,
    versions: list[str],
    lora_path: str | None,
) -> None:
    """Make ``state``'s routes a record the earlier turns' parts can be joined to, or a whole one.

    The last call ran under ``versions`` (its tokens'); if it ran under the very weights the earlier
    record was made under, the server routed the shared prefix as recorded. Otherwise (an update since:
    its prefix cache was flushed and the prompt run again, or the call spanned an update) the server's
    cache now holds the routes it used, and one prefill-only call reads them for the whole sequence. A
    stale token is then replayed by the latest run's routing, which its fresh successors were computed
    over. (Where the server did not keep the sequence, a call paused in place across an update, it
    computes the routes again on its current weights.)
    """
    ran = set(versions)
    state.routes_version = versions[0] if len(ran) == 1 else None
    state.routes_from = routes_from
    if routes_from == 0 or (routes_version is not None and ran == {routes_version}):
        return
    payload: dict[str, Any] = {
        "input_ids": (prompt_ids + state.ids)[:-1],
        "sampling_params": {"max_new_tokens": 0},
        "return_routed_experts": True,
        "routed_experts_start_len": 0,
    }
    if lora_path:
        payload["lora_path"] = lora_path
    state.routes, state.routes_from = read_routed_experts(await client.generate(payload)), 0


async def scripted_turn(ids: list[int], budget: int) -> AsyncGenerator[Sampled, None]:
    """A given reply as a finished turn: its ids cut at ``budget`` (``max_new_tokens``), as a server cuts
    a reply, and log-probs of 0.0 that the session's Samples leave out."""
    kept = ids[:budget]
    finish = {"type": "stop", "matched": kept[-1]} if len(ids) <= budget else {"type": "length", "length": budget}
    yield Sampled(
        ids=list(kept),
        logprobs=[0.0] * len(kept),
        versions=[SCRIPT_VERSION] * len(kept),
        finish=finish,
        unconstrained=[None] * len(kept),
        kept=[[] for _ in kept],
    )


async def _single(call) -> AsyncGenerator[Any, None]:
    yield await call
