"""Continuous batching: the loop that turns queued requests into tokens, one step at a time.

The scheduler runs in its own thread (torch releases the GIL in its kernels, so the HTTP event
loop stays responsive): ``run`` is the loop, on the thread that calls it. Each step it (1) admits
waiting requests into free KV-cache rows and prefills them, up to ``max_prefill_tokens`` prompt
tokens, sampling each one's first token, then (2) decodes one token for every running request in
a single batch. Requests therefore join and leave between decode steps: a short request submitted
after a long one finishes first.

Everything that changes engine state (pause, continue, abort, weight updates, flush) is a
*command*: a function queued by ``call`` and run by this thread between steps, so no step ever
sees half an update. A *barrier* command (a weight update while not paused) waits until no
request is running and holds back admissions meanwhile, like SGLang's model-update writer lock.

A weight-update session (``begin_update`` ... ``end_update``, SGLang's begin/end weight update)
is opened by a barrier command and holds all stepping until it ends, so the buckets of one update
land between two steps and no token is ever sampled from half-new weights. A session left idle for
``update_timeout`` seconds (its trainer died) is ended by the scheduler itself.

Pause modes follow SGLang: ``abort`` finishes every queued and running request with
``finish_reason.type == "abort"``; ``retract`` returns running requests to the front of the queue
(their KV is dropped and recomputed on continue, their tokens kept); ``in_place`` stops stepping
and keeps everything. While paused, new requests queue and wait for ``/continue_generation``.

Prefix reuse: a finished request's cache row is kept (above the running rows) with the tokens it
holds, and a new request whose prompt starts with some of them copies that much KV and prefills
only the rest (``cached_tokens``). Multi-turn agents resend their whole history each turn, so
this is most of their prompt. A running request's prompt is offered the same way, and requests
admitted in one step that share a prompt's beginning are prefilled in two passes, so the second
copies what the first computed. A request whose whole prompt is held, with the hidden state of its
last position, is a *fork* (GRPO's n samples of one prompt, arriving together or one by one): it
copies the KV and samples its first token from that state, with no forward of its own. Running
requests take the lowest rows; a kept row that a
new request needs moves to a free row, and once every row is taken the least recently used kept
row goes first (so 8 agents taking turns each find their own history, not 4 of them). Kept rows
are dropped on a flush and on every weight load (their KV came from the old weights).

Routed experts (MoE, ``keep_routes``): the cache keeps every position's experts beside its KV, so
a finished request takes its whole sequence's routing (cached prefixes included) as it leaves.

LoRA: a request may name an adapter (``Request.lora``); each step groups its rows by adapter
(``engine.lora.LoRABatch``), at most ``--max-loras-per-batch`` adapters run at once, and cached
prefixes are reused only under the same adapter. Adapters are added and removed by commands.

Every output token records the weight version that produced it; this module knows nothing of HTTP.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from inverted.engine import grammar
from inverted.engine.lora import Adapter, Adapters, LoRABatch
from inverted.engine.model import CausalLM, KVCache
from inverted.engine.sampling import Kept, SamplingParams, named_logprobs, sample, top_logprobs
from inverted.errors import EngineError, FieldError, InvalidRequest
from inverted.types import PAUSE_MODES

logger = logging.getLogger(__name__)

SHARED_PREFIX_MIN = 16  # prompt tokens two requests of one step must share to prefill them once


@dataclass(eq=False)
class Request:
    """One sequence being generated. Lists only grow; ``notify(req, n)`` says the first n are final."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    notify: Callable[["Request", int], object]  # what it returns is ignored
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0  # with return_logprob: the k most likely tokens at each position
    token_ids_logprob: list[int] | None = None  # with return_logprob: these ids' logprobs at each position
    stream: bool = False
    generator: torch.Generator | None = None  # only for requests with a sampling_seed
    matcher: Any = None  # only for constrained requests (json_schema, regex): see engine.grammar
    lora: str | None = None  # the LoRA adapter it runs with (SGLang's lora_path); None: the base model
    return_routed_experts: bool = False
    routed_experts: torch.Tensor | None = None  # set when it finishes: [positions run, layers, top_k]
    return_sampling_mask: bool = False
    output_kept: list[Kept] = field(default_factory=list)  # with return_sampling_mask: each token's kept set
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # constrained requests only: each sampled token's logprob under the policy's own distribution,
    # before the grammar masked it (``output_logprobs`` are the masked distribution's, as SGLang's)
    output_unconstrained_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    retractions: int = 0  # times a retract pause sent it back to the queue (SGLang's num_retractions)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    computed: int = 0  # positions whose keys/values are in this request's cache row
    lends_kv: bool = True  # whether later requests may copy its prompt's KV (not once the weights changed under it)
    prompt_state: torch.Tensor | None = None  # the final hidden state at its prompt's last position, once computed
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class WeightLoad:
    """The outcome of ``Scheduler.load_weights``: the weights changed; ``flushed`` is False when a
    flush was asked for and refused (requests were running)."""

    message: str
    flushed: bool
    paused_requests: int


@dataclass(frozen=True, slots=True)
class Prefix:
    """What a kept cache row holds: ``tokens``' keys and values under adapter ``lora``, and the final
    hidden state at the last position of the first ``prompt`` of them (the prompt of the request that
    left the row), from which a request with that very prompt samples without a forward."""

    lora: str | None
    tokens: list[int]
    prompt: int
    state: torch.Tensor | None


class Scheduler:
    """Owns the model, the KV cache and the queues; all mutation happens on its thread."""

    def __init__(
        self,
        model: CausalLM,
        *,
        max_running: int,
        context_length: int,
        max_prefill_tokens: int,
        weight_version: str,
        stop_checker: Callable[[Request], str | None],
        random_seed: int | None = None,
        reuse_prefixes: bool = True,
        update_timeout: float = 300.0,
        adapters: Adapters | None = None,
        keep_routes: bool = False,
        max_total_tokens: int | None = None,
    ):
        self.model = model
        self.max_running = max_running
        self.context_length = context_length
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.stop_checker = stop_checker
        self.cache = KVCache(
            model.spec,
            max_running,
            context_length,
            model.act_dtype,
            model.device,
            keep_routes=keep_routes,
            budget=max_total_tokens,
        )
        self.waiting: collections.deque[Request] = collections.deque()  # touched by the scheduler thread only
        self._incoming: collections.deque[Request] = collections.deque()  # submissions, under _cond
        self.running: list[Request] = []  # running[i] owns cache row i
        self.reuse_prefixes = reuse_prefixes
        self.prefixes: dict[int, Prefix] = {}  # kept row (>= len(running)) -> what it holds
        self.adapters = adapters  # with --enable-lora
        self.paused: str | None = None
        self.updating = False  # inside /begin_weight_update ... /end_weight_update: nothing steps
        self.update_timeout = update_timeout
        self._update_expires = 0.0
        self.memory_released = False
        self.stats: collections.defaultdict[str, float] = collections.defaultdict(int)  # counts, and seconds
        self._seeds = torch.Generator(device=model.device)  # shared by requests without a sampling_seed
        self._seeds.manual_seed(
            random_seed if random_seed is not None else int.from_bytes(os.urandom(8), "little") >> 2
        )
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future, bool]] = (
            collections.deque()
        )
        self._cond = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None  # the thread in ``run``

    # ---- thread-safe API -----------------------------------------------------------------

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        """Not crashed and not stopped (a scheduler about to ``run`` is alive)."""
        return self.error is None and (self._thread is None or self._thread.is_alive())

    def submit(self, req: Request) -> None:
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator(device=self.model.device).manual_seed(req.params.sampling_seed)
        with self._cond:
            self._incoming.append(req)
            self.stats["requests_total"] += 1
            self._cond.notify()

    def call(self, fn: Callable[[], Any], *, barrier: bool = False) -> concurrent.futures.Future:
        """Run ``fn`` on the scheduler thread between steps; a barrier waits for running requests to end."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._commands.append((fn, future, barrier))
            self._cond.notify()
        return future

    def load(self) -> dict[str, int]:
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting) + len(self._incoming),
            "num_tokens": sum(r.computed for r in self.running),
        }

    # ---- commands (run on the scheduler thread via ``call``) -------------------------------

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Finish matching queued and running requests with an abort. As in SGLang, ``rid`` must be a request's
        own id (its tokenizer manager drops any other), and then every request whose id it begins is aborted."""
        known = bool(rid) and any(r.rid == rid for r in [*self.waiting, *self.running])

        def matches(req: Request) -> bool:
            return abort_all or (known and req.rid.startswith(rid))

        doomed = [r for r in self.waiting if matches(r)]
        for req in doomed:
            self.waiting.remove(req)
        doomed_rows = [i for i, r in enumerate(self.running) if matches(r)]
        for req in doomed + [self.running[i] for i in doomed_rows]:
            self._finish(req, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
        self._release_rows(doomed_rows)
        self.stats["requests_aborted"] += len(doomed) + len(doomed_rows)
        return len(doomed) + len(doomed_rows)

    def pause(self, mode: str) -> None:
        """SGLang's three pause modes (any other is refused: the route takes any string, as SGLang's does)."""
        if mode not in PAUSE_MODES:
            raise FieldError(f"mode: Input should be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.paused = mode
        if mode == "abort":
            self.abort(abort_all=True)
        elif mode == "retract":
            retracted = list(self.running)
            self._release_rows(list(range(len(self.running))), keep=False)  # SGLang: KV freed, recomputed later
            for req in reversed(retracted):
                req.computed, req.prompt_state = 0, None
                req.retractions += 1
                self.waiting.appendleft(req)
            self.stats["requests_retracted"] += len(retracted)

    def resume(self) -> None:
        self.paused = None

    def begin_update(self) -> None:
        """Open a weight-update session (a barrier command: no request runs on half-updated weights)."""
        if self.updating:
            raise EngineError("a weight update session is already open: call end_weight_update first")
        self.updating = True
        self.touch_update()

    def touch_update(self) -> None:
        """The session's trainer is alive: a session idle for ``update_timeout`` seconds is ended for it."""
        self._update_expires = time.monotonic() + self.update_timeout

    def end_update(self) -> None:
        if not self.updating:
            raise EngineError("no weight update session is open: call begin_weight_update first")
        self.updating = False

    def _expire_update(self) -> None:
        """A trainer that died inside a session must not stop generation for good."""
        if self.updating and time.monotonic() >= self._update_expires:
            logger.warning(
                "weight update session idle for %.0fs: ending it (the trainer is gone?)", self.update_timeout
            )
            self.updating = False
            self.stats["weight_update_sessions_expired"] += 1

    def busy(self) -> bool:
        """Whether a cache flush must be refused: requests run, or queue while not paused (SGLang's rule)."""
        return bool(self.running) or (bool(self.waiting) and self.paused not in ("retract", "in_place"))

    def forget_prefixes(self) -> None:
        """Offer no cached KV to later requests: the kept rows go, and requests still running (paused in
        place across a weight load) keep theirs to themselves."""
        self.prefixes.clear()
        for req in self.running:
            req.lends_kv = False

    def flush(self) -> None:
        """Forget every cached prefix. The storage stays allocated, as SGLang keeps its KV pool: freeing
        it cost each weight update ~0.1 s, and the next rollout as much again to grow it back."""
        if self.busy():
            raise EngineError("Cache not flushed: there are running or queued requests.")
        self.forget_prefixes()

    def load_weights(
        self,
        tensors: Callable[[], dict[str, torch.Tensor]],
        *,
        complete: bool,
        strict_dtype: bool,
        abort_all: bool,
        weight_version: str | None,
        flush_cache: bool,
    ) -> WeightLoad:
        """Copy in the checked tensors that ``tensors()`` gives; then version and flush, as SGLang does.

        Run as a command: inside an update session nothing is stepping; outside one the caller makes
        it a barrier (running requests finish first) unless it aborts them. ``tensors`` runs here, so
        that decoding a payload and copying it cost one thread hop, not two. ``strict_dtype``: updates
        over the wire must come in the served dtype; a checkpoint on disk is cast by the copy.
        """
        if self.updating:
            self.touch_update()
        if abort_all:
            self.abort(abort_all=True)
        started = time.perf_counter()
        named = tensors()
        decoded = time.perf_counter()
        self.model.load_weights(named, complete=complete, strict_dtype=strict_dtype)
        # On /metrics, so that a sender can tell this engine's share of an update from the wire's.
        self.stats["weight_loads"] += 1
        self.stats["weight_decode_seconds"] += decoded - started
        self.stats["weight_copy_seconds"] += time.perf_counter() - decoded
        self.forget_prefixes()  # their KV came from the old weights
        message = "Succeeded to update model weights."
        if weight_version is not None:
            self.weight_version = weight_version
            message += f" Weight version updated to {weight_version}."
        paused = len(self.waiting) if self.paused else 0
        if flush_cache and self.busy():
            return WeightLoad(
                "Weights were updated, but the cache was not flushed: requests are running.", False, paused
            )
        return WeightLoad(message, True, paused)

    def release_memory(self, tags: list[str]) -> None:
        if self.running:
            raise EngineError("release_memory_occupation needs an idle engine: pause generation first.")
        if "kv_cache" in tags:
            self.forget_prefixes()
            self.cache.release()
        # Weights stay in host memory (like SGLang's --enable-weights-cpu-backup); nothing to free on CPU.
        self.memory_released = True

    def resume_memory(self, tags: list[str]) -> None:
        if "kv_cache" in tags:
            self.cache.reset()
        self.memory_released = False

    def add_adapter(self, adapter: Adapter) -> None:
        """Load a checked LoRA adapter (a command: between steps, so no step sees half of it). The
        server checks that LoRA is enabled, and that a request's adapter is loaded, before either
        reaches the scheduler."""
        self.lora_registry().add(adapter)
        self.forget_prefixes()  # a prefix cached under an earlier adapter of this name must not be reused
        self.stats["lora_loads"] += 1

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter. Never waits on its requests (an engine paused in place would deadlock):
        a request that would step without its adapter is aborted then, unless one of its name is loaded
        again first, as a weight sync does (unload, load, continue)."""
        self.lora_registry().remove(name)
        self.forget_prefixes()

    def _adapter(self, req: Request) -> Adapter | None:
        return None if req.lora is None else self.lora_registry().loaded[req.lora]

    def lora_registry(self) -> Adapters:
        """The LoRA registry; ``InvalidRequest`` on a server started without ``--enable-lora``."""
        if self.adapters is None:
            raise InvalidRequest("LoRA is not enabled on this server: start it with --enable-lora")
        return self.adapters

    def _abort_orphans(self) -> None:
        """Finish the running requests whose adapter has been unloaded."""
        if self.adapters is None:
            return
        orphans = [i for i, r in enumerate(self.running) if r.lora is not None and r.lora not in self.adapters.loaded]
        for i in orphans:
            self._finish(self.running[i], _unloaded(self.running[i].lora))
        self._release_rows(orphans, keep=False)

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        """The loop, on the calling thread, until ``stop``."""
        self._thread = threading.current_thread()
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._ready_commands() and not self._has_work():
                        self._cond.wait(
                            timeout=max(0.0, self._update_expires - time.monotonic()) if self.updating else None
                        )
                        self._expire_update()
                    self.waiting.extend(self._incoming)
                    self._incoming.clear()
                    if self._stopping:
                        break
                    commands = self._ready_commands()
                    for command in commands:
                        self._commands.remove(command)
                for fn, future, _ in commands:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except Exception as exc:  # the caller's future carries it back to the HTTP layer
                            future.set_exception(exc)
                if self._has_work():
                    self._step()
        except BaseException as exc:  # the thread's top loop: record it so /health turns 503
            logger.exception("scheduler crashed")
            self.error = exc
            raise

    def _barrier_pending(self) -> bool:
        return any(barrier for _, _, barrier in self._commands)

    def _ready_commands(self) -> list:
        idle = not self.running or self.paused is not None
        return [c for c in self._commands if not c[2] or idle]

    def _has_work(self) -> bool:
        if self.paused is not None or self.memory_released or self.updating:
            return False
        queued = bool(self.waiting) or bool(self._incoming)
        return bool(self.running) or (queued and not self._barrier_pending())

    def _step(self) -> None:
        self._abort_orphans()
        if not self._barrier_pending():
            started = time.perf_counter()
            self._admit()
            self.stats["prefill_seconds"] += time.perf_counter() - started
        if self.running:
            started = time.perf_counter()
            self._decode()
            self.stats["decode_seconds"] += time.perf_counter() - started
            self.stats["decode_steps"] += 1
            self.stats["decode_batch_total"] += len(self.running)

    def _admit(self) -> None:
        """Move waiting requests into free rows, up to the prefill budget, and prefill them together.

        A request that shares at least ``SHARED_PREFIX_MIN`` prompt tokens with one admitted before it
        in the same step (prompts that open alike) waits for a second pass, after the first has computed
        that prefix, and copies its KV: a shared beginning is prefilled once. A request whose whole prompt
        is held, or is the prompt of one admitted before it (GRPO's n samples), is a fork: placed after
        both passes, it computes nothing.
        """
        budget = self.max_prefill_tokens
        first: list[Request] = []
        second: list[Request] = []
        forks: list[Request] = []
        loras = {r.lora for r in self.running} - {None}
        while (
            self.waiting
            and len(self.running) + len(second) + len(forks) < self.max_running
            and (budget > 0 or not first)
        ):
            req = self.waiting[0]
            if not self._room_for(req, second + forks):
                break  # it waits (first in line) for running requests to finish and give their KV room back
            if req.lora is not None:
                adapters = self.lora_registry()
                if req.lora not in adapters.loaded:
                    self._finish(self.waiting.popleft(), _unloaded(req.lora))
                    continue
                if req.lora not in loras and len(loras) >= adapters.max_per_batch:
                    break  # --max-loras-per-batch: it waits (first in line) for a running adapter to finish
                loras.add(req.lora)
            self.waiting.popleft()
            if self._reuses(req) and (
                any(a.input_ids == req.input_ids and a.lora == req.lora and not a.output_ids for a in first + second)
                or self._holds_whole(req)
            ):
                forks.append(req)
                continue
            shared = (
                max((common_prefix(f.input_ids, req.input_ids) for f in first if f.lora == req.lora), default=0)
                if self._reuses(req)
                else 0
            )
            if shared >= SHARED_PREFIX_MIN:
                second.append(req)
                budget -= len(req.input_ids) - shared
            else:
                self._place(req)
                first.append(req)
                budget -= len(req.input_ids) + len(req.output_ids) - req.cached_tokens
        if first:
            self._prefill(first)
        for req in second:
            self._place(req)  # the first pass has computed what it copies
        if second:
            self._prefill(second)
        for req in forks:
            self._place(req)  # after both passes: a fork's prompt may be any one's
        if forks:
            self._fork(forks)
        self._release_rows([i for i, r in enumerate(self.running) if r.finished])

    def _room_for(self, req: Request, admitted: list[Request]) -> bool:
        """Whether ``req`` fits in the KV budget beside the running requests (and those ``admitted`` this
        step), each at its whole length (prompt + max_new_tokens): then no decode step can outgrow the
        cache. A request alone always fits (the budget holds one whole context)."""
        others = self.running + admitted
        if not others:
            return True
        longest = max(len(r.input_ids) + r.params.max_new_tokens for r in [*others, req])
        return (len(others) + 1) * longest <= self.cache.budget

    def _forget_lost_rows(self) -> None:
        """Kept prefixes in rows the cache no longer holds (it grew for a long request) are gone."""
        if any(row >= self.cache.rows for row in self.prefixes):
            self.prefixes = {row: kept for row, kept in self.prefixes.items() if row < self.cache.rows}

    def _prefill(self, batch: list[Request]) -> None:
        """Compute each request's KV; fresh requests also sample their first token.

        A request coming back after a retract recomputes prompt + output but the last token, which
        the next decode step feeds, and samples nothing here.
        """
        tokens = [(r.input_ids + r.output_ids)[:-1] if r.output_ids else r.input_ids for r in batch]
        rows = [self.running.index(r) for r in batch]
        starts = [r.cached_tokens for r in batch]
        fresh_ids = [ids[start:] for ids, start in zip(tokens, starts)]
        lora = LoRABatch.of([self._adapter(r) for r in batch], [len(t) for t in fresh_ids], self.model.device)
        hidden = self.model.prefill(self.cache, rows, fresh_ids, starts, lora)
        self._forget_lost_rows()
        fresh: list[Request] = []
        for req, ids, states in zip(batch, tokens, hidden):
            req.computed = len(ids)
            self.stats["prefill_tokens"] += len(ids) - req.cached_tokens
            if req.output_ids:
                continue
            req.prompt_state = states[-1].clone()  # a view would keep the whole step's activations
            if req.return_logprob and req.logprob_start_len >= 0:
                self._input_logprobs(req, states)
            fresh.append(req)
        self._start(fresh)

    def _fork(self, forks: list[Request]) -> None:
        """Start placed forks: each copied its whole prompt and samples from the held state. One whose
        holder went before it was placed (a kept row another request took) copied less and is prefilled."""
        for req in forks:
            if req.prompt_state is not None:
                req.computed = len(req.input_ids)
        if unheld := [r for r in forks if r.prompt_state is None]:
            self._prefill(unheld)
        self._start([r for r in forks if r not in unheld])

    def _start(self, reqs: list[Request]) -> None:
        """Sample the first token of requests whose prompt is computed, from its last position's state;
        a request that asks for no tokens (a prefill) is finished."""
        for req in reqs:
            # SGLang's counters: every prompt token, and of them what its cache served (never the last)
            self.stats["prompt_tokens"] += len(req.input_ids)
            self.stats["cached_tokens"] += min(req.cached_tokens, len(req.input_ids) - 1)
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
        going = [r for r in reqs if not r.finished]
        states = [r.prompt_state for r in going if r.prompt_state is not None]
        assert len(states) == len(going), "a request starts once its prompt is computed"
        if going:
            lora = LoRABatch.of([self._adapter(r) for r in going], None, self.model.device)
            self._sample_and_check(going, self.model.logits(torch.stack(states), lora))

    def _input_logprobs(self, req: Request, hidden_TH: torch.Tensor) -> None:
        """Prompt logprobs from ``logprob_start_len``, their top-k and the named ids' logprobs. As in SGLang,
        the first position returned has none: the prompt's first token has none to have, and SGLang
        reports none for that position at a later start too."""
        start = req.logprob_start_len
        ids = req.input_ids
        first = start + 1
        values: list[float | None] = [None] if start < len(ids) else []
        tops: list = list(values)
        named: list = list(values)
        if first < len(ids):
            lora = LoRABatch.of([self._adapter(req)], None, self.model.device)
            logprobs = torch.log_softmax(self.model.logits(hidden_TH[first - 1 : len(ids) - 1], lora), dim=-1)
            target = torch.tensor(ids[first:], device=logprobs.device)[:, None]
            values += logprobs.gather(1, target)[:, 0].tolist()
            tops += top_logprobs(logprobs, [req.top_logprobs_num] * len(target))
            named += named_logprobs(logprobs, [req.token_ids_logprob] * len(target))
        req.input_logprobs = values
        req.input_top_logprobs = tops if req.top_logprobs_num else []
        req.input_token_ids_logprobs = named if req.token_ids_logprob is not None else []

    def _decode(self) -> None:
        tokens = [r.output_ids[-1] for r in self.running]
        positions = [r.computed for r in self.running]
        lora = LoRABatch.of([self._adapter(r) for r in self.running], None, self.model.device)
        hidden = self.model.decode(self.cache, tokens, positions, lora)
        self._forget_lost_rows()
        for req in self.running:
            req.computed += 1
        self._sample_and_check(self.running, self.model.logits(hidden, lora))
        self._release_rows([i for i, r in enumerate(self.running) if r.finished])

    def _stop_ids(self, req: Request) -> set[int]:
        if req.params.ignore_eos:
            return set()
        return set(self.model.spec.eos_token_ids) | set(req.params.stop_token_ids or [])

    def _sample_and_check(self, reqs: list[Request], logits_BV: torch.Tensor) -> None:
        banned = [sorted(self._stop_ids(r)) if len(r.output_ids) < r.params.min_new_tokens else [] for r in reqs]
        top_k = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
        named = [r.token_ids_logprob if r.return_logprob else None for r in reqs]
        matchers = [r.matcher for r in reqs]
        constrained = [i for i, m in enumerate(matchers) if m is not None]
        if constrained:
            unmasked = logits_BV[constrained].float()  # a copy: the policy's own distribution, for the record
            grammar.mask(logits_BV, matchers)
        draw = sample(
            logits_BV,
            [r.params for r in reqs],
            [r.generator for r in reqs],
            banned,
            self._seeds,
            top_k,
            [r.return_sampling_mask for r in reqs],
            named,
        )
        if constrained:
            policy = grammar.unconstrained_logprobs(
                unmasked, [draw.tokens[i] for i in constrained], [reqs[i].params for i in constrained]
            )
            for i, logprob in zip(constrained, policy):
                reqs[i].output_unconstrained_logprobs.append(logprob)
        self.stats["generated_tokens"] += len(reqs)
        rows = zip(reqs, draw.tokens, draw.logprobs, draw.tops, draw.named, draw.kept)
        for req, token, logprob, top, ids, row in rows:
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            if row is not None:
                req.output_kept.append(row)
            if req.matcher is not None:
                grammar.advance(req.matcher, token)
            if top is not None:
                req.output_top_logprobs.append(top)
            if ids is not None:
                req.output_token_ids_logprobs.append(ids)
            req.output_versions.append(self.weight_version)
            reason = self._finish_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
            elif req.stream:
                req.notify(req, len(req.output_ids))

    def _finish_reason(self, req: Request, token: int) -> dict[str, Any] | None:
        if token in self._stop_ids(req):  # stop ids are banned until min_new_tokens, so this is past it
            return {"type": "stop", "matched": token}
        if req.params.stops:
            matched = self.stop_checker(req)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if len(req.output_ids) >= req.params.max_new_tokens:
            return {"type": "length", "length": req.params.max_new_tokens}
        if len(req.input_ids) + len(req.output_ids) >= self.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        if req.return_routed_experts and self.cache.routes is not None and req in self.running:
            req.routed_experts = self.cache.routes[self.running.index(req), : req.computed].clone()
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        req.notify(req, len(req.output_ids))

    def _reuses(self, req: Request) -> bool:
        """Whether ``req`` may start from cached KV: not when resuming after a retract, nor when it
        wants prompt logprobs (those need every position's hidden state)."""
        return self.reuse_prefixes and not req.output_ids and not (req.return_logprob and req.logprob_start_len >= 0)

    def _place(self, req: Request) -> None:
        """Give ``req`` the next running row, with the longest cached prefix of its prompt copied in:
        from a kept row, or from a running request's prompt.

        The prompt's last token is computed again (its logits give the first sample) unless a holder
        of the whole prompt kept that position's hidden state: then ``req`` copies it all and takes the
        state (a fork).
        """
        row = len(self.running)
        self.cache.reserve(len(req.input_ids), row + 1)
        self._forget_lost_rows()
        source, length, state = None, 0, None
        if self._reuses(req):
            for held, tokens, valid, prompt, held_state in self._holders(req.lora):
                shared = min(common_prefix(tokens, req.input_ids), valid)
                whole = holds_prompt(req.input_ids, tokens, valid, prompt, held_state)
                usable = len(req.input_ids) if whole else min(shared, len(req.input_ids) - 1)
                if usable > length:
                    source, length, state = held, usable, held_state if whole else None
        if row in self.prefixes and not (source == row and length > 0):
            self._move_kept(row, source)  # the row this request takes holds another prefix
        if source is not None and length > 0 and source != row:
            self.cache.move_row(source, row, length)
            if source in self.prefixes:
                self.prefixes[source] = self.prefixes.pop(source)  # most recently used last
        else:
            self.prefixes.pop(row, None)
        req.cached_tokens = length if source is not None and length > 0 else 0
        req.prompt_state = state
        self.running.append(req)

    def _holders(self, lora: str | None) -> Iterator[tuple[int, list[int], int, int, torch.Tensor | None]]:
        """Rows whose KV a request under ``lora`` may copy: each one's row, tokens, positions computed,
        prompt length and the hidden state at that prompt's last position (None where not kept)."""
        for row, kept in self.prefixes.items():
            if kept.lora == lora:
                yield row, kept.tokens, len(kept.tokens), kept.prompt, kept.state
        for i, r in enumerate(self.running):
            if r.lends_kv and r.lora == lora:
                yield i, r.input_ids, r.computed, len(r.input_ids), r.prompt_state

    def _holds_whole(self, req: Request) -> bool:
        """Whether a row holds ``req``'s whole prompt with its last hidden state."""
        return any(holds_prompt(req.input_ids, *held[1:]) for held in self._holders(req.lora))

    def _move_kept(self, row: int, source: int | None) -> None:
        """Make ``row`` free for a running request. Its kept prefix moves to a free row; with none
        free, it takes the place of the least recently used kept prefix (never ``source``, the one
        this request copies from), or is dropped if it is the least recently used itself."""
        taken = set(self.prefixes) | set(range(row + 1))
        free = next((r for r in range(self.cache.rows - 1, row, -1) if r not in taken), None)
        if free is None:
            free = next((kept for kept in self.prefixes if kept != source), row)
            if free == row:
                del self.prefixes[row]
                return
            del self.prefixes[free]
        self.cache.move_row(row, free, len(self.prefixes[row].tokens))
        self.prefixes = {(free if kept == row else kept): value for kept, value in self.prefixes.items()}

    def _release_rows(self, rows: list[int], keep: bool = True) -> None:
        """Drop the given rows, moving the last running request into each hole (rows stay compact).

        With ``keep``, each dropped row's KV stays in the cache (just above the running rows) as a
        prefix for later requests.
        """
        keep = keep and self.reuse_prefixes
        for row in sorted(rows, reverse=True):
            last = len(self.running) - 1
            done = self.running[row]
            if row != last:
                moved = self.running[last]
                if keep:
                    self.cache.swap_rows(row, last, done.computed, moved.computed)
                else:
                    self.cache.move_row(last, row, moved.computed)
                self.running[row] = moved
            self.running.pop()
            if keep and done.computed and done.lends_kv:
                tokens = (done.input_ids + done.output_ids)[: done.computed]
                self.prefixes[last] = Prefix(done.lora, tokens, len(done.input_ids), done.prompt_state)
        if not self.running and self.cache.rows < self.cache.rows_for(KVCache.GROW):
            self.forget_prefixes()  # idle after a long request: every row back
            self.cache.reset()


def _unloaded(name: str | None) -> dict[str, Any]:
    return {"type": "abort", "message": f"LoRA adapter {name!r} was unloaded", "status_code": None, "err_type": None}


def holds_prompt(ids: list[int], tokens: list[int], valid: int, prompt: int, state: torch.Tensor | None) -> bool:
    """Whether a row holding ``tokens`` (``valid`` of them computed) whose prompt was their first ``prompt``,
    with ``state`` at its last position, holds the whole of ``ids`` as that prompt: a fork of it needs nothing."""
    return state is not None and prompt == len(ids) <= valid and tokens[: len(ids)] == ids


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (compared in slices: C speed for long shared runs)."""
    n, i = min(len(a), len(b)), 0
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


def new_rid() -> str:
    return uuid.uuid4().hex
