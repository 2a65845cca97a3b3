"""``inverted tinker-serve``: the Tinker training API on inverted's trainer, rollout servers and weight sync.

The user's script owns the loop (the official ``tinker`` SDK, pointed here by ``base_url`` or
``TINKER_BASE_URL``): it samples, scores, and calls ``forward_backward`` and ``optim_step``.
Behind the routes:

- **Models.** ``create_model`` builds a ``Learner`` (``train/learner.py``: the jobs' Megatron
  trainer, LoRA at the rank and on the modules asked, or full fine-tuning) on the served
  checkpoint. Each belongs to the API key that created it; another key gets "unknown model".
- **Order.** Training calls of one model carry ``seq_id`` 1, 2, 3, ...; the SDK sends them
  concurrently (a large ``forward_backward`` in chunks, the first last) and ``optim_step`` before
  reading its results. Each waits here for its turn (``Model.turn``) and then runs on the one
  training thread, so gradients accumulate in ``seq_id`` order until ``optim_step``.
- **Sampling.** ``save_weights_for_sampler`` pushes the model's weights into the rollout servers
  by the jobs' weight sync (a LoRA model: its adapter alone, under its own name) and versions
  them; a sampling session samples through the real sgl-router from the servers
  (``/generate`` by ids, with log-probs, prompt log-probs and top-k), each sequence with the
  weight version it came from.
- **Record.** Every sampled sequence is kept in its model's run directory (``record.py``), beside the
  model's metrics (one row per optimizer step), so ``inverted view`` opens it as it opens a job's.
- **Checkpoints.** ``save_weights`` writes the trainer's state under the model's folder, beside
  the run's ``training_run.json`` (owner, base, LoRA rank, the caller's ``user_metadata``), which the
  SDK's REST reads (``training_runs/{id}``, ``weights_info``) answer from, after a restart too.
- **Futures.** Every call answers a request id at once (``futures.py``); results are fetched
  by long-polling ``retrieve_future``, as protobuf where the SDK asks for it (``wire.py``).
- **Errors.** A caller's mistake is a failed future of category ``user`` (or a 4xx before any
  work: a body too large, an unknown model), with a message that names it; the cost of a
  ``forward_backward`` is bounded by ``--tinker-max-batch-tokens`` before it is queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from inverted.devices import cuda_available
from inverted.errors import InvertedError, SampleError
from inverted.metrics import build_metrics_sink
from inverted.rollout.servers import RolloutServers, lora_argv, resolve_backend
from inverted.rollout.sglang_client import ServerKeys, SGLangClient, read_output
from inverted.tinker import wire
from inverted.tinker.config import TinkerServeConfig
from inverted.tinker.futures import Failure, Futures
from inverted.tinker.record import BASE, SampleRecord
from inverted.train import datum_losses

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
KEPT_SAVES = 4  # a LoRA model's sampler weights kept on the servers at once (its newest saves)
TURN_WAIT_S = 900.0  # how long a call waits for the calls before it (one the client never sent)
MAX_SEQ_AHEAD = 4096  # a seq_id further ahead than this is a caller's error, not a call to wait for
OWNER_FILE = "tinker_owner.json"  # beside a saved checkpoint: whose it is (a digest of the key), what it holds
RUN_FILE = "training_run.json"  # in a model's weights folder: whose it is, its base, LoRA rank, the caller's metadata
MAX_METADATA_BYTES = 16_384  # a training run's user_metadata, as JSON
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")  # a checkpoint's name: one segment, no ".."


class UserError(InvertedError):
    """The caller's mistake: a failed future of category ``user``, or a 400 before any work."""


# The caller's mistakes, whichever layer finds them: a failed future of category "user".
CALLERS_ERRORS = (UserError, wire.WireError, datum_losses.LossInputError, SampleError)


class Refused(Exception):
    """A request refused before any work (its key, its size, its encoding), with its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message


@dataclass
class Model:
    """One trained model: its learner (built on the training thread), owner, and the turn of its calls."""

    model_id: str
    owner: str
    base_model: str
    lora_rank: int  # 0: full fine-tuning
    user_metadata: dict[str, str] = field(default_factory=dict)
    last_request: float = field(default_factory=time.time)  # wall clock, for the SDK's TrainingRun
    learner: Any = None
    next_seq: int = 1
    turn_changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    saved: int = 0  # weights pushed to the servers so far (their versions)
    sink: Any = None  # its metrics.jsonl and TensorBoard events, one row per optimizer step
    pending: dict[str, float] = field(default_factory=lambda: {"loss_sum": 0.0, "tokens": 0.0, "datums": 0.0})

    def adapter(self, save: int) -> str | None:
        """The name on the servers of this LoRA model's ``save``-th sampler weights (None: full weights)."""
        return f"tinker-{self.model_id.replace(':', '-')}-{save}" if self.lora_rank else None

    async def turn(self, seq_id: int) -> None:
        """Wait until every call before ``seq_id`` has run."""
        if seq_id < self.next_seq:
            raise UserError(f"seq_id {seq_id} of model {self.model_id} was already used (next: {self.next_seq})")
        if seq_id > self.next_seq + MAX_SEQ_AHEAD:
            raise UserError(
                f"seq_id {seq_id} is {seq_id - self.next_seq} calls ahead of model {self.model_id}'s "
                f"next ({self.next_seq})"
            )
        async with self.turn_changed:
            try:
                await asyncio.wait_for(self.turn_changed.wait_for(lambda: self.next_seq == seq_id), TURN_WAIT_S)
            except TimeoutError:
                raise UserError(
                    f"seq_id {seq_id} of model {self.model_id} waited {TURN_WAIT_S:.0f} s for call "
                    f"{self.next_seq}, which never came"
                ) from None

    def live(self):
        """The model's learner, or a user error once the model is unloaded (its calls still queued fail)."""
        if self.learner is None:
            raise UserError(f"model {self.model_id} was unloaded")
        return self.learner

    async def done(self) -> None:
        async with self.turn_changed:
            self.next_seq += 1
            self.turn_changed.notify_all()


@dataclass
class Session:
    owner: str
    seen: float = field(default_factory=time.monotonic)  # its last heartbeat


@dataclass
class Sampler:
    owner: str
    base_model: str
    model_path: str | None
    adapter: str | None  # the LoRA adapter's name on the servers; None: the servers' base weights
    version: str  # "MODEL_ID:SAVE", or "base"

    def source(self) -> tuple[str, int]:
        """The model its weights come from and their save number (the base model's: ``record.BASE``, 0)."""
        if self.version == BASE:
            return BASE, 0
        model_id, _, saved = self.version.rpartition(":")
        return model_id, int(saved)


@dataclass(frozen=True)
class ServersCan:
    """What the rollout servers do that the API relies on, known from how they were started."""

    lora: bool  # serve LoRA adapters: the embedded engine, SGLang on a GPU (not SGLang on a CPU)
    seed: bool  # reproduce a seeded draw: the embedded engine, SGLang with --enable-deterministic-inference

    @classmethod
    def of(cls, backend: str, sglang_args: list[str]) -> "ServersCan":
        embedded = backend == "embedded"
        return cls(
            lora=embedded or cuda_available(), seed=embedded or "--enable-deterministic-inference" in sglang_args
        )


class Service:
    """The domain of the API: sessions, models, samplers, futures; no HTTP (the routes are in ``create_app``)."""

    def __init__(
        self, cfg: TinkerServeConfig, router_url: str, engine_urls: list[str], keys: ServerKeys, can: ServersCan
    ) -> None:
        self.cfg, self.router_url, self.engine_urls, self.keys, self.can = cfg, router_url, engine_urls, keys, can
        checkpoint = Path(cfg.train.hf_checkpoint)
        self.names = {str(checkpoint), checkpoint.name, *cfg.tinker.base_model}
        self.model_name = cfg.tinker.base_model[0] if cfg.tinker.base_model else checkpoint.name
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self.paths: dict[str, Sampler] = {}  # saved sampler weights by tinker:// path
        self.live: set[str] = set()  # the weight versions the servers hold now
        self.futures = Futures()
        self.training = ThreadPoolExecutor(1, thread_name_prefix="train")  # one model's step at a time
        self.full_weights_on_servers: str | None = None  # a full model whose weights the servers hold
        self.client = SGLangClient(router_url, api_key=keys.api)
        self.record = SampleRecord(Path(cfg.train.output_dir) / "tinker" / "models", cfg.train.hf_checkpoint)
        self.warned_seed = False

    # -- sessions and models -------------------------------------------------------------

    def session(self, owner: str) -> str:
        session_id = f"{uuid.uuid4()}"
        self.sessions[session_id] = Session(owner)
        return session_id

    def owned_session(self, session_id: str, owner: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise UserError(f"unknown session {session_id!r}")
        return session

    async def finish(self, session_id: str) -> None:
        """The session is over (the SDK's close, or its heartbeats stopped): its models and samplers go."""
        self.sessions.pop(session_id, None)
        for model in [m for m in self.models.values() if m.model_id.startswith(f"{session_id}:")]:
            await self.unload(model)
        for sampler_id in [s for s in self.samplers if s.startswith(f"{session_id}:")]:
            del self.samplers[sampler_id]

    async def unload(self, model: Model) -> dict:
        """Let go of ``model``: its trainer's memory, and its adapter on the servers."""
        if self.models.pop(model.model_id, None) is None:
            return {"type": "unload_model", "model_id": model.model_id}
        learner, model.learner = model.learner, None
        await self.on_training_thread(_release, learner)
        if model.sink is not None:
            model.sink.close()
        await asyncio.to_thread(self.record.close, model.model_id)
        for save in range(max(1, model.saved - KEPT_SAVES + 1), model.saved + 1) if model.lora_rank else ():
            await self.unload_adapter(model.adapter(save))
        if self.full_weights_on_servers == model.model_id:  # the servers serve the base model again
            for url in self.engine_urls:
                async with SGLangClient.keyed(url, self.keys) as server:
                    await server.update_weights_from_disk(self.cfg.train.hf_checkpoint, weight_version="base")
            self.full_weights_on_servers = None
        self.paths = {p: v for p, v in self.paths.items() if not p.startswith(f"tinker://{model.model_id}/")}
        self.live = {v for v in self.live if not v.startswith(f"{model.model_id}:")}
        return {"type": "unload_model", "model_id": model.model_id}

    async def unload_adapter(self, name: str | None) -> None:
        """Unload a LoRA save's adapter from every server (None, a full-weights save: there is none)."""
        if name is None:
            return
        for url in self.engine_urls:
            async with SGLangClient.keyed(url, self.keys) as server:
                await server.unload_lora_adapter(name, missing_ok=True)

    async def reap(self, timeout: float, every: float = 10.0) -> None:
        """Finish the sessions whose heartbeats stopped ``timeout`` seconds ago (the SDK beats every 10 s)."""
        while True:
            await asyncio.sleep(every)
            silent = [s for s, session in self.sessions.items() if time.monotonic() - session.seen > timeout]
            for session_id in silent:
                logger.info(
                    "session %s sent no heartbeat for %.0f s: finished, its models unloaded", session_id, timeout
                )
                await self.finish(session_id)

    def model(self, model_id: str, owner: str) -> Model:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise UserError(f"unknown model {model_id!r}")
        return model

    def check_base(self, name: str) -> None:
        if name not in self.names:
            raise UserError(f"base model {name!r} is not served here; this server serves {sorted(self.names)}")

    def new_model(
        self, owner: str, session_id: str, seq: int, base: str, lora: dict | None, user_metadata: object = None
    ) -> Model:
        self.owned_session(session_id, owner)
        self.check_base(base)
        metadata = checked_metadata(user_metadata)
        if len(self.models) >= self.cfg.tinker.tinker_max_models:
            raise UserError(
                f"this server holds at most {self.cfg.tinker.tinker_max_models} models "
                "(--tinker-max-models); unload one first"
            )
        if lora and not self.can.lora:
            raise UserError(
                "LoRA models need LoRA on the rollout servers, and real SGLang on a CPU has none (its LoRA "
                "layers pin memory, a CUDA call): create a full fine-tuning model, or serve with "
                "--rollout-backend embedded"
            )
        rank = int(lora["rank"]) if lora else 0
        if lora and not 1 <= rank <= self.cfg.tinker.tinker_max_lora_rank:
            raise UserError(
                f"LoRA rank {rank} is outside 1..{self.cfg.tinker.tinker_max_lora_rank} (--tinker-max-lora-rank)"
            )
        if not lora and any(not m.lora_rank for m in self.models.values()):
            raise UserError(
                "one full fine-tuning model at a time: the servers hold one set of full weights; "
                "train LoRA models beside it"
            )
        model = Model(f"{session_id}:train:{seq}", owner, base, rank, metadata)
        if model.model_id in self.models:
            raise UserError(f"model {model.model_id} exists (model_seq_id {seq} of this session was used)")
        self.models[model.model_id] = model
        return model

    async def build(self, model: Model, lora: dict | None) -> dict:
        from inverted.train.learner import Learner, LoraShape

        shape = LoraShape.of(lora) if lora else None
        try:
            model.learner = await self.on_training_thread(Learner, self.cfg.train, shape)
        except BaseException:
            del self.models[model.model_id]
            raise
        model.sink = build_metrics_sink(self.model_dir(model))
        run = {
            "owner": _digest(model.owner),
            "model_id": model.model_id,
            "base_model": model.base_model,
            "lora_rank": model.lora_rank,
            "user_metadata": model.user_metadata,
        }
        folder = self.weights_root(model.model_id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RUN_FILE).write_text(json.dumps(run) + "\n")
        return {"model_id": model.model_id, "type": "create_model"}

    def model_dir(self, model: Model) -> Path:
        """The model's run directory (``record.py``): its samples, and its metrics, one row per optimizer step."""
        return self.record.run_dir(model.model_id)

    def info(self, model: Model) -> dict:
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "is_lora": bool(model.lora_rank),
            "lora_rank": model.lora_rank or None,
            "model_data": {
                "model_name": model.base_model,
                "tokenizer_id": self.cfg.train.hf_checkpoint,
                "arch": model.learner.spec.arch if model.learner else None,
            },
        }

    async def on_training_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.training, fn, *args)

    # -- training calls, in seq_id order ----------------------------------------------------------

    def start(self, owner: str, model: Model | None, seq_id: int | None, work) -> str:
        """A future for ``work`` (a coroutine function), run after ``model``'s earlier calls when
        ``seq_id`` is given."""
        request_id = self.futures.create(owner)
        if model is not None:
            model.last_request = time.time()

        async def run() -> None:
            try:
                if model is not None and seq_id is not None:
                    await model.turn(seq_id)
                try:
                    value = await work()
                finally:
                    if model is not None and seq_id is not None and model.next_seq == seq_id:
                        await model.done()
            except CALLERS_ERRORS as exc:
                value = Failure(str(exc), "user")
            except Exception as exc:  # ours: a server that failed, a bug
                logger.exception("request %s failed", request_id)
                value = Failure(f"{type(exc).__name__}: {exc}", "server")
            self.futures.resolve(request_id, value)

        asyncio.get_running_loop().create_task(run())
        return request_id

    def check_batch(self, request: wire.FwdBwdRequest, model: Model) -> None:
        """Bound the request's cost before it waits for its turn: its size, its token ids, its targets."""
        datum_losses.resolve(request.loss_fn, request.config)
        tokens = sum(len(d.tokens) for d in request.data)
        if tokens > self.cfg.tinker.tinker_max_batch_tokens:
            raise UserError(
                f"forward_backward carries {tokens} tokens; this server takes at most "
                f"{self.cfg.tinker.tinker_max_batch_tokens} per call (--tinker-max-batch-tokens)"
            )
        if not request.data:
            raise UserError("forward_backward carries no datums")
        spec = model.live().spec
        for i, datum in enumerate(request.data):
            where = f"datum {i}"
            datum_losses.check_inputs(request.loss_fn, datum.inputs, len(datum.tokens), where)
            if not len(datum.tokens):
                raise UserError(f"{where}: no input tokens")
            if len(datum.tokens) > spec.max_position_embeddings:
                raise UserError(
                    f"{where}: {len(datum.tokens)} tokens exceed the model's {spec.max_position_embeddings}"
                )
            for name, ids in (("model_input", datum.tokens), ("target_tokens", datum.inputs["target_tokens"])):
                if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= spec.vocab_size:
                    raise UserError(f"{where}: {name} must be token ids in 0..{spec.vocab_size - 1}")

    async def forward_backward(self, request: wire.FwdBwdRequest, model: Model) -> bytes:
        loss, config = datum_losses.resolve(request.loss_fn, request.config)
        data = [(d.tokens, d.inputs["target_tokens"]) for d in request.data]
        inputs = [
            {k: torch.tensor(v, dtype=torch.float32) for k, v in d.inputs.items() if k != "target_tokens"}
            for d in request.data
        ]
        logps, metrics = await self.on_training_thread(
            model.live().forward_backward, data, loss, inputs, config, request.forward_only
        )
        if not request.forward_only:
            model.pending["loss_sum"] += metrics["loss:sum"]
            model.pending["tokens"] += metrics["num_tokens:sum"]
            model.pending["datums"] += len(data)
        return wire.forward_backward_output([{"logprobs": lp} for lp in logps], metrics)

    async def optim_step(self, model: Model, params: dict) -> dict:
        from inverted.train.learner import AdamStep

        try:
            step = AdamStep(**params)
        except TypeError as exc:
            raise UserError(f"adam_params: {exc}") from None
        if step.learning_rate < 0 or not 0 <= step.beta1 < 1 or not 0 <= step.beta2 < 1 or step.eps <= 0:
            raise UserError(f"adam_params out of range: {params}")
        metrics = await self.on_training_thread(model.live().optim_step, step)
        done, model.pending = model.pending, {"loss_sum": 0.0, "tokens": 0.0, "datums": 0.0}
        model.sink.log(
            {
                "train/loss_sum": done["loss_sum"],
                "train/tokens": done["tokens"],
                "train/datums": done["datums"],
                "train/grad_norm": metrics["grad_norm:mean"],
                "train/lr": step.learning_rate,
            },
            model.learner.steps,
        )
        logger.info(
            "%s step %d: loss %.4g over %d tokens, grad norm %.3g, lr %.3g",
            model.model_id,
            model.learner.steps,
            done["loss_sum"],
            done["tokens"],
            metrics["grad_norm:mean"],
            step.learning_rate,
        )
        return {"type": "optim_step", "metrics": metrics}

    async def save_for_sampler(self, model: Model, path: str | None, sampling_seq: int | None, session_id: str) -> dict:
        """The model's weights into the servers now, as their next version, named by a path or a sampling session.

        A LoRA model's saves are adapters of their own names, its last ``KEPT_SAVES`` kept on the servers,
        so an earlier sampler still samples the weights it was made from (an older one is refused); a
        full model's weights replace the servers' (one at a time, its newest only)."""
        model.saved += 1
        version = f"{model.model_id}:{model.saved}"
        out = str(Path(self.cfg.train.output_dir) / "tinker")
        adapter = model.adapter(model.saved)
        await self.on_training_thread(model.live().push, self.engine_urls, self.keys, adapter or "", version, out)
        if adapter is not None:
            evicted = model.saved - KEPT_SAVES
            if evicted >= 1:
                await self.unload_adapter(model.adapter(evicted))
                self.live.discard(f"{model.model_id}:{evicted}")
        else:
            self.full_weights_on_servers = model.model_id
            self.live = {v for v in self.live if not v.startswith(f"{model.model_id}:")}
        self.live.add(version)
        tinker_path = f"tinker://{model.model_id}/sampler_weights/{path or f'ephemeral-{model.saved}'}"
        self.paths[tinker_path] = Sampler(model.owner, model.base_model, tinker_path, adapter, version)
        if path is not None:
            return {"type": "save_weights_for_sampler", "path": tinker_path}
        sampler = self.new_sampler(model.owner, session_id, sampling_seq or 0, None, tinker_path)
        return {"type": "save_weights_for_sampler", "sampling_session_id": sampler}

    # -- checkpoints ----------------------------------------------------------------------

    def weights_root(self, model_id: str) -> Path:
        """A model's folder of checkpoints (and its ``RUN_FILE``); the id must make one safe path segment."""
        if not SAFE_NAME.fullmatch(model_id.replace(":", "_")):
            raise UserError(f"not a model id of this server: {model_id!r}")
        return Path(self.cfg.train.output_dir) / "tinker" / "weights" / model_id.replace(":", "_")

    def _weights_dir(self, tinker_path: str) -> tuple[str, Path]:
        """The model id and the folder of ``tinker://MODEL/weights/NAME`` (a name is one safe path segment)."""
        model_id, sep, name = tinker_path.removeprefix("tinker://").partition("/weights/")
        if not (tinker_path.startswith("tinker://") and sep and SAFE_NAME.fullmatch(name)):
            raise UserError(f"not a checkpoint path of this server: {tinker_path!r} (tinker://MODEL_ID/weights/NAME)")
        return model_id, self.weights_root(model_id) / name

    async def save(self, model: Model, name: str | None) -> dict:
        """The model's weights and optimizer state on disk (durable: a restarted server loads them)."""
        name = name or f"state-{secrets.token_hex(4)}"
        tinker_path = f"tinker://{model.model_id}/weights/{name}"
        _, directory = self._weights_dir(tinker_path)
        await self.on_training_thread(model.live().save, str(directory))
        saved = {
            "owner": _digest(model.owner),
            "model_id": model.model_id,
            "base_model": model.base_model,
            "lora_rank": model.lora_rank,
        }
        (directory / OWNER_FILE).write_text(json.dumps(saved) + "\n")
        return {"type": "save_weights", "path": tinker_path}

    def checkpoint(self, tinker_path: str, owner: str) -> tuple[Path, dict]:
        """A saved checkpoint ``owner`` may load: its folder and what it was saved from."""
        _, directory = self._weights_dir(tinker_path)
        return directory, _owned(directory / OWNER_FILE, owner, f"checkpoint {tinker_path!r}")

    async def load(self, model: Model, tinker_path: str, optimizer: bool) -> dict:
        directory, saved = self.checkpoint(tinker_path, model.owner)
        if bool(saved["lora_rank"]) != bool(model.lora_rank):
            raise UserError(
                f"{tinker_path} holds {'a LoRA adapter' if saved['lora_rank'] else 'full weights'}; "
                f"model {model.model_id} is {'LoRA' if model.lora_rank else 'full fine-tuning'}"
            )
        await self.on_training_thread(model.live().load, str(directory), optimizer)
        return {"type": "load_weights", "path": tinker_path, "model_id": model.model_id}

    def lora_of(self, tinker_path: str, owner: str) -> dict | None:
        """The LoRA shape a checkpoint was saved with, for a model created from it (None: full weights)."""
        from inverted.train.learner import saved_lora

        directory, _ = self.checkpoint(tinker_path, owner)
        shape = saved_lora(str(directory))
        return None if shape is None else shape.config()

    def training_run(self, model_id: str, owner: str) -> dict:
        """The SDK's ``TrainingRun`` of one of the caller's models, live or unloaded (what a restart keeps):
        its base, LoRA rank, the metadata it was created with, and its newest checkpoint."""
        folder = self.weights_root(model_id)
        run = _owned(folder / RUN_FILE, owner, f"training run {model_id!r}")
        saved = sorted((d for d in folder.iterdir() if (d / OWNER_FILE).exists()), key=lambda d: d.stat().st_mtime)
        checkpoint = saved[-1] if saved else None
        model = self.models.get(model_id)
        last = model.last_request if model is not None else (folder / RUN_FILE).stat().st_mtime
        return {
            "training_run_id": model_id,
            "base_model": run["base_model"],
            "model_owner": run["owner"][:16],
            "is_lora": bool(run["lora_rank"]),
            "lora_rank": run["lora_rank"] or None,
            "corrupted": False,
            "last_request_time": _iso(max([last, *(d.stat().st_mtime for d in saved)])),
            "last_checkpoint": None
            if checkpoint is None
            else {
                "checkpoint_id": f"weights/{checkpoint.name}",
                "checkpoint_type": "training",
                "time": _iso(checkpoint.stat().st_mtime),
                "tinker_path": f"tinker://{model_id}/weights/{checkpoint.name}",
                "size_bytes": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()),
            },
            "user_metadata": run["user_metadata"] or None,
        }

    def weights_info(self, tinker_path: str, owner: str) -> dict:
        """The SDK's ``WeightsInfoResponse``: what a saved checkpoint holds, for a model made from it."""
        _, saved = self.checkpoint(tinker_path, owner)
        lora = self.lora_of(tinker_path, owner)
        return {
            "base_model": saved.get("base_model", self.model_name),  # a checkpoint saved before it was recorded
            "is_lora": lora is not None,
            "lora_rank": lora["rank"] if lora else None,
            "train_unembed": lora["train_unembed"] if lora else None,
            "train_mlp": lora["train_mlp"] if lora else None,
            "train_attn": lora["train_attn"] if lora else None,
        }

    # -- sampling -------------------------------------------------------------------------

    def new_sampler(self, owner: str, session_id: str, seq: int, base: str | None, model_path: str | None) -> str:
        self.owned_session(session_id, owner)
        if model_path is not None:
            sampler = self.paths.get(model_path)
            if sampler is None or sampler.owner != owner:
                raise UserError(f"unknown model_path {model_path!r}")
        else:
            if base is None:
                raise UserError("a sampling session needs base_model or model_path")
            self.check_base(base)
            if self.full_weights_on_servers is not None:
                raise UserError(f"the servers hold {self.full_weights_on_servers}'s full weights, not the base model's")
            sampler = Sampler(owner, base, None, None, BASE)
        sampler_id = f"{session_id}:sample:{seq}:{secrets.token_hex(4)}"
        self.samplers[sampler_id] = sampler
        return sampler_id

    def sampler(self, sampler_id: str | None, owner: str, base: str | None, model_path: str | None) -> Sampler:
        if sampler_id is not None:
            sampler = self.samplers.get(sampler_id)
            if sampler is None or sampler.owner != owner:
                raise UserError(f"unknown sampling session {sampler_id!r}")
            return sampler
        return self.samplers[self.new_sampler(owner, next(iter(self.sessions_of(owner)), ""), 0, base, model_path)]

    def sessions_of(self, owner: str) -> list[str]:
        return [s for s, session in self.sessions.items() if session.owner == owner]

    async def sample(self, sampler: Sampler, body: dict) -> bytes:
        if sampler.version == BASE and self.full_weights_on_servers is not None:
            raise UserError(f"the servers hold {self.full_weights_on_servers}'s full weights, not the base model's")
        if sampler.version != BASE and sampler.version not in self.live:
            raise UserError(
                f"the sampler weights of {sampler.model_path} were let go (a model's last {KEPT_SAVES} "
                "saves stay on the servers, a full model's newest): save them again"
            )
        tokens = [t for chunk in body["prompt"]["chunks"] for t in chunk.get("tokens", [])]
        if not tokens:
            raise UserError("the prompt has no tokens")
        params = body.get("sampling_params", {})
        n = int(body.get("num_samples", 1))
        if not 1 <= n <= 256:
            raise UserError(f"num_samples {n} is outside 1..256")
        sampling = {
            "max_new_tokens": params.get("max_tokens") or 16,
            "temperature": params.get("temperature", 1.0),
            "top_p": params.get("top_p", 1.0),
            "top_k": params.get("top_k", -1),
        }
        stop = params.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop and isinstance(stop[0], int):
            sampling["stop_token_ids"] = stop
        elif stop:
            sampling["stop"] = stop
        top_k = int(body.get("topk_sample_logprobs") or 0)
        prompt_logprobs = bool(body.get("prompt_logprobs"))
        top_prompt = int(body.get("topk_prompt_logprobs") or 0)
        payload = {
            "input_ids": tokens,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": 0 if prompt_logprobs or top_prompt else -1,
            **({"top_logprobs_num": max(top_k, top_prompt)} if top_k or top_prompt else {}),
            **({"lora_path": sampler.adapter} if sampler.adapter else {}),
        }
        seed = params.get("seed")  # sample i draws from seed + i: reproducible, and not n copies of one
        if seed is not None and not self.can.seed and not self.warned_seed:
            self.warned_seed = True
            logger.warning(
                "a sample asks for seed %s: real SGLang reads sampling_seed only with "
                "--sglang-enable-deterministic-inference (a GPU's attention backends), so seeded "
                "draws here are not reproducible",
                seed,
            )
        answers = await asyncio.gather(
            *(
                self.client.generate(
                    payload
                    if seed is None
                    else {**payload, "sampling_params": {**sampling, "sampling_seed": int(seed) + i}}
                )
                for i in range(n)
            )
        )
        sequences = []
        for answer in answers:
            ids, logprobs, _, tops, finish = read_output(answer, self.router_url)
            top = _top(tops, top_k) if top_k else None
            sequences.append(wire.Sequence(ids, logprobs, (finish or {}).get("type") != "length", top))
        await self.record.add(
            *sampler.source(),
            tokens,
            [(s.tokens, s.logprobs, s.stopped) for s in sequences],
            sampler.model_path or BASE,
        )
        first = answers[0]
        assert isinstance(first, dict)  # one prompt a call: one object
        meta = first["meta_info"]
        prompt = None
        top_rows = None
        if prompt_logprobs or top_prompt:
            prompt = [None if lp is None else float(lp) for lp, *_ in meta["input_token_logprobs"]]
            if top_prompt:
                rows = meta.get("input_top_logprobs") or []
                top_rows = _top(
                    [[] if row is None else [(float(lp), int(t)) for lp, t, *_ in row] for row in rows], top_prompt
                )
        return wire.sample_response(
            sequences, prompt if prompt_logprobs else None, top_rows, int(meta.get("cached_tokens", 0))
        )


def _top(rows: list[list[tuple[float, int]]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of (log-prob, id) as ``[N, k]`` arrays (a row with fewer, such as the prompt's first, padded with -inf)."""
    ids = np.zeros((len(rows), k), np.int32)
    logprobs = np.full((len(rows), k), -np.inf, np.float32)
    for i, row in enumerate(rows):
        for j, (lp, token) in enumerate(row[:k]):
            ids[i, j], logprobs[i, j] = token, lp
    return ids, logprobs


# -- HTTP -------------------------------------------------------------------------------------


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _owned(record: Path, owner: str, what: str) -> dict:
    """A record the service wrote beside what it describes, if ``owner``'s key made it; else ``what`` is unknown."""
    try:
        held = json.loads(record.read_text())
    except (OSError, ValueError):
        held = None
    if not isinstance(held, dict) or held.get("owner") != _digest(owner):
        raise UserError(f"unknown {what}")
    return held


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat()


def checked_metadata(metadata: object) -> dict[str, str]:
    """A training run's ``user_metadata`` as the SDK types it (string to string), bounded in size."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise UserError("user_metadata must map strings to strings")
    if len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        raise UserError(f"user_metadata is over {MAX_METADATA_BYTES} bytes as JSON")
    return metadata


def _raise(exc: Exception):
    """Work that fails with ``exc`` (a call refused before it ran, failed in its turn: later calls keep theirs)."""

    async def fail():
        raise exc

    return fail


def caller(request: Request, x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The caller's key (the SDK's ``X-API-Key``): one of ``--tinker-api-keys``, or any key of the SDK's form."""
    accepted = request.app.state.accepted
    if not x_api_key or (accepted and x_api_key not in accepted) or not x_api_key.startswith(("tml-", "eyJ")):
        raise Refused(401, "missing or unknown API key (X-API-Key)")
    return x_api_key


Caller = Annotated[str, Depends(caller)]


def create_app(cfg: TinkerServeConfig, service: Service) -> FastAPI:
    app = FastAPI(title="inverted tinker-serve")
    app.state.accepted = set(cfg.tinker.tinker_api_keys)
    limit = int(cfg.tinker.tinker_max_request_mb * 1e6)

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def malformed(request: Request, exc: Exception) -> JSONResponse:  # a field of the wrong type or form
        return JSONResponse({"error": f"malformed request: {exc}", "category": "user"}, status_code=400)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return JSONResponse({"error": exc.message, "category": "user"}, status_code=exc.status)

    @app.exception_handler(UserError)
    @app.exception_handler(wire.WireError)
    @app.exception_handler(datum_losses.LossInputError)
    async def user_error(request: Request, exc: InvertedError) -> JSONResponse:
        return JSONResponse({"error": str(exc), "category": "user"}, status_code=400)

    async def body_of(request: Request) -> bytes:
        size = int(request.headers.get("content-length") or 0)
        if size > limit:
            raise Refused(413, f"request body of {size} bytes exceeds {limit} (--tinker-max-request-mb)")
        body = await request.body()
        if len(body) > limit:
            raise Refused(413, f"request body exceeds {limit} bytes (--tinker-max-request-mb)")
        if request.headers.get("content-encoding") == "zstd":
            import zstandard

            try:
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
            except zstandard.ZstdError as exc:
                raise Refused(400, f"a zstd body that does not decompress within {limit} bytes: {exc}") from None
        return body

    async def json_of(request: Request) -> dict:
        import orjson

        try:
            body = orjson.loads(await body_of(request))
        except orjson.JSONDecodeError as exc:
            raise Refused(400, f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        return body

    def future(request_id: str, model_id: str | None = None, **more: Any) -> dict:
        return {"request_id": request_id, "model_id": model_id, **more}

    api = "/api/v1"

    @app.post(f"{api}/client/config")
    async def client_config(request: Request, owner: Caller) -> dict:
        # no token exchange; forward_backward chunks as the SDK's defaults say; plain httpx transport
        return {
            "pjwt_auth_enabled": False,
            "proto_compress_fwdbwd": True,
            "use_pyqwest_transport": False,
            "fwdbwd_max_chunk_len": cfg.tinker.tinker_chunk_datums,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
        }

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post(f"{api}/create_session")
    async def create_session(request: Request, owner: Caller) -> dict:
        await json_of(request)
        return {"type": "create_session", "session_id": service.session(owner)}

    @app.post(f"{api}/session_heartbeat")
    async def heartbeat(request: Request, owner: Caller) -> JSONResponse:
        body = await json_of(request)
        session = service.sessions.get(str(body.get("session_id")))
        if session is None or session.owner != owner:  # 410: the SDK stops beating
            return JSONResponse({"error": "the session is finished or unknown", "category": "user"}, status_code=410)
        session.seen = time.monotonic()
        return JSONResponse({"type": "session_heartbeat"})

    @app.post(f"{api}/telemetry")
    async def telemetry(request: Request, owner: Caller) -> dict:
        return {"status": "accepted"}

    @app.post(f"{api}/sessions/{{session_id}}/finish")
    async def finish(session_id: str, owner: Caller) -> dict:
        service.owned_session(session_id, owner)
        await service.finish(session_id)
        return {"type": "finish_session"}

    @app.post(f"{api}/unload_model")
    async def unload_model(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        model = service.model(str(body.get("model_id")), owner)
        return future(service.start(owner, None, None, lambda: service.unload(model)), model.model_id)

    @app.post(f"{api}/create_model")
    async def create_model(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        lora = body.get("lora_config")
        model = service.new_model(
            owner,
            str(body.get("session_id")),
            int(body.get("model_seq_id", 0)),
            str(body.get("base_model")),
            lora,
            body.get("user_metadata"),
        )
        return future(service.start(owner, None, None, lambda: service.build(model, lora)), model.model_id)

    @app.post(f"{api}/get_info")
    async def get_info(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        return service.info(service.model(str(body.get("model_id")), owner))

    @app.post(f"{api}/forward_backward")
    async def forward_backward(request: Request, owner: Caller) -> dict:
        parsed = wire.read_forward_backward(await body_of(request))
        model = service.model(parsed.model_id, owner)
        if model.learner is None:
            raise UserError(f"model {model.model_id} is still being created")
        try:  # before it queues: a call that cannot run costs its turn and nothing more
            service.check_batch(parsed, model)
        except (UserError, datum_losses.LossInputError) as exc:
            return future(service.start(owner, model, parsed.seq_id, _raise(exc)), model.model_id)
        return future(
            service.start(owner, model, parsed.seq_id, lambda: service.forward_backward(parsed, model)), model.model_id
        )

    @app.post(f"{api}/optim_step")
    async def optim_step(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        model = service.model(str(body.get("model_id")), owner)
        params = body.get("adam_params") or body.get("optim_params") or {}
        params = {k: v for k, v in params.items() if k != "type"}
        return future(
            service.start(owner, model, body.get("seq_id"), lambda: service.optim_step(model, params)), model.model_id
        )

    @app.post(f"{api}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        model = service.model(str(body.get("model_id")), owner)
        session_id = model.model_id.split(":", 1)[0]
        return future(
            service.start(
                owner,
                model,
                body.get("seq_id"),
                lambda: service.save_for_sampler(
                    model, body.get("path"), body.get("sampling_session_seq_id"), session_id
                ),
            ),
            model.model_id,
        )

    @app.post(f"{api}/save_weights")
    async def save_weights(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        model = service.model(str(body.get("model_id")), owner)
        return future(
            service.start(owner, model, body.get("seq_id"), lambda: service.save(model, body.get("path"))),
            model.model_id,
        )

    @app.post(f"{api}/load_weights")
    async def load_weights(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        path, optimizer = str(body.get("path")), bool(body.get("optimizer"))
        if body.get("model_id") is not None:  # into a model of the caller's, in its turn
            model = service.model(str(body["model_id"]), owner)
            return future(
                service.start(owner, model, body.get("seq_id"), lambda: service.load(model, path, optimizer)),
                model.model_id,
            )
        # a new model made from the checkpoint (the SDK's create_training_client_from_state)
        lora = service.lora_of(path, owner)
        model = service.new_model(
            owner,
            str(body.get("session_id")),
            int(body.get("model_seq_id", 0)),
            str(body.get("base_model") or service.model_name),
            lora,
            body.get("user_metadata"),
        )

        async def create_and_load() -> dict:
            await service.build(model, lora)
            return await service.load(model, path, optimizer)

        return future(service.start(owner, None, None, create_and_load), model.model_id)

    @app.get(f"{api}/training_runs/{{training_run_id}}")
    async def training_run(training_run_id: str, owner: Caller) -> dict:
        return await asyncio.to_thread(service.training_run, training_run_id, owner)

    @app.post(f"{api}/weights_info")
    async def weights_info(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        return await asyncio.to_thread(service.weights_info, str(body.get("tinker_path")), owner)

    @app.get(f"{api}/get_server_capabilities")
    async def capabilities(owner: Caller) -> dict:
        return {
            "supported_models": [
                {"model_name": service.model_name, "max_context_length": service.cfg.servers.context_length or None}
            ]
        }

    @app.post(f"{api}/create_sampling_session")
    async def create_sampling_session(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        sampler_id = service.new_sampler(
            owner,
            str(body.get("session_id")),
            int(body.get("sampling_session_seq_id", 0)),
            body.get("base_model"),
            body.get("model_path"),
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get(f"{api}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, owner: Caller) -> dict:
        sampler = service.sampler(sampler_id, owner, None, None)
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @app.post(f"{api}/asample")
    async def asample(request: Request, owner: Caller) -> dict:
        body = await json_of(request)
        sampler = service.sampler(
            body.get("sampling_session_id"), owner, body.get("base_model"), body.get("model_path")
        )
        n = int(body.get("num_samples", 1))
        request_id = service.start(owner, None, None, lambda: service.sample(sampler, body))
        return future(request_id, None, sample_sequence_ids=[f"{request_id}:{i}" for i in range(n)])

    @app.post(f"{api}/retrieve_future")
    async def retrieve_future(request: Request, owner: Caller) -> Response:
        body = await json_of(request)
        request_id = str(body.get("request_id"))
        try:
            result = await service.futures.retrieve(request_id, owner)
        except KeyError:
            return JSONResponse(
                {"error": f"unknown request {request_id} (the server may have restarted)", "category": "user"},
                status_code=410,
            )
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if isinstance(result.value, Failure):
            return JSONResponse({"error": result.value.message, "category": result.value.category})
        if isinstance(result.value, bytes):
            return Response(result.value, media_type=PROTOBUF)
        return JSONResponse(result.value)

    return app


def serve(cfg: TinkerServeConfig, router_args: Sequence[str] = (), sglang_args: Sequence[str] = ()) -> None:
    """Start the rollout servers behind the router, then the service in front of them, until interrupted.

    ``router_args`` / ``sglang_args``: the command line's ``--router-*`` / ``--sglang-*`` flags, for
    the router and every server (as ``inverted train`` passes them)."""
    import uvicorn

    from inverted.processes import UVICORN_OPTIONS

    async def main() -> None:
        keys = ServerKeys(api=secrets.token_urlsafe(24), admin=secrets.token_urlsafe(24))
        out = Path(cfg.train.output_dir)
        servers_cfg = dataclasses.replace(
            cfg.servers, log_dir=str(out / "servers"), router_api_key=keys.api, admin_api_key=keys.admin
        )
        # The trainer is this process alone (no rendezvous port), whatever an inherited WORLD_SIZE says.
        os.environ.update(RANK="0", WORLD_SIZE="1")
        can = ServersCan.of(resolve_backend(servers_cfg), list(sglang_args))
        flags = lora_argv(cfg.tinker.tinker_max_lora_rank, ["all"]) if can.lora else []
        async with RolloutServers(servers_cfg, list(router_args), list(sglang_args), flags=flags) as servers:
            service = Service(cfg, servers.router_url, servers.engine_urls, keys, can)
            await service.on_training_thread(_init_trainer_process, cfg)
            reaper = asyncio.get_running_loop().create_task(service.reap(cfg.tinker.tinker_session_timeout))
            app = create_app(cfg, service)
            server = uvicorn.Server(
                uvicorn.Config(app, host=cfg.tinker.tinker_host, port=cfg.tinker.tinker_port, **UVICORN_OPTIONS)
            )
            logger.info(
                "tinker-serve on http://%s:%d (base model %s; rollout servers behind %s)",
                cfg.tinker.tinker_host,
                cfg.tinker.tinker_port,
                service.model_name,
                servers.router_url,
            )
            try:
                await server.serve()
            finally:
                reaper.cancel()
                await service.client.close()
                service.training.shutdown(wait=False, cancel_futures=True)
                service.record.close()

    asyncio.run(main())


def _release(learner) -> None:
    """Drop a learner's last reference on the training thread, and return its memory to the system."""
    import gc

    del learner
    gc.collect()


def _init_trainer_process(cfg: TinkerServeConfig) -> None:
    """This process as the trainer's one rank (torch.distributed, Megatron's parallel state)."""
    from inverted.train.parallel import init_parallel

    init_parallel(cfg.train.parallel, cfg.train.seed)
