"""slime's plug-in API on inverted: its ``Sample``, its ``args``, its router helpers.

A slime plug-in (a custom generate function, reward model, filter, loss, ...) is written against
four things, and this module is each of them (``compat.modules`` puts them under slime's paths):

- ``Sample`` (``slime.utils.types``): slime's field names and meanings. ``to_inverted`` and
  ``from_inverted`` convert it exactly to and from our ``Sample``, purely (no side effects): both
  have ``remove_sample`` and ``teacher_log_probs``, and ``rollout_log_probs`` may be None on both
  sides; slime's ``response`` is the decoded response, its ``rollout_id`` a fan-out's own.
  ``rollout_routed_experts`` (R3) goes to slime as our base64 string and comes back from either
  that or slime's int32 array.
  slime's ``weight_versions`` holds one version per generate call, ours one per response token:
  ``to_inverted`` spreads the calls' versions over the tokens each call sampled (``post`` records
  the router's answers), so every token keeps the version that sampled it; where a plug-in
  recorded none, the version serving when its rollout started (``Serving``).
- ``args``: ``SlimeArgs``, slime's namespace: the job's flags under slime's attribute names, the
  slime flags given, slime's default for every other (``compat.slime_flags``).
- ``post(url, payload, max_retries=60, headers=None)`` and ``get(url)`` (``slime.utils.http_utils``):
  slime's behaviour (every failure retried once a second, the JSON answer returned). In a LoRA
  run a ``/generate`` that names no adapter is sent with the policy's, and every call to the job's
  router carries its key (``generating_with``).
- ``GenerateState(args)`` (``slime.rollout.sglang_rollout``): the tokenizer, the sampling
  parameters and the concurrency limit of the default rollout.
- ``DynamicFilterOutput`` and the nonzero-std filters (``slime.rollout.filter_hub``), the rollout
  output types (``slime.rollout.base_types``) and ``slime.utils.misc``'s helpers.

Where slime *is* installed, the plug-in gets slime's own classes, and the conversions work on them
by field name (``from_inverted(..., cls=...)``, ``to_inverted`` reads attributes).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import logging
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from inverted.compat import slime_flags
from inverted.errors import SampleError
from inverted.types import Sample as _Sample
from inverted.types import encode_routed_experts

logger = logging.getLogger(__name__)


@dataclass
class SpecInfo:
    """slime's ``Sample.SpecInfo``: speculative-decoding counts (none here: no speculative decoding)."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

    @property
    def spec_accept_length(self) -> float:
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

    def add(self, meta_info: dict) -> None:
        self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        self.completion_token_num += meta_info.get("completion_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    @staticmethod
    def from_dict(data: dict) -> "SpecInfo":
        return SpecInfo(**{k: data.get(k, 0) for k in SpecInfo.__dataclass_fields__})


@dataclass
class PrefixCacheInfo:
    """slime's ``Sample.PrefixCacheInfo``: the prompt tokens the server found cached."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

    def add(self, meta_info: dict) -> None:
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    @staticmethod
    def from_dict(data: dict) -> "PrefixCacheInfo":
        return PrefixCacheInfo(data.get("cached_tokens", 0), data.get("total_prompt_tokens", 0))


# SGLang's finish reasons as a Sample's status (slime's ``update_from_meta_info``)
_FINISHED: dict[str | None, _Sample.Status] = {
    "length": _Sample.Status.TRUNCATED,
    "abort": _Sample.Status.ABORTED,
    "stop": _Sample.Status.COMPLETED,
}

# the fields' types, under names the class's own aliases (slime's ``Sample.SpecInfo``, ...) do not hide
_SpecInfo = SpecInfo
_PrefixCacheInfo = PrefixCacheInfo


@dataclass
class Sample:
    """slime's ``Sample`` (``slime.utils.types``), the fields both frameworks have, with slime's meanings.

    ``tokens`` is prompt + response ids; ``loss_mask``, ``rollout_log_probs`` have one entry per
    response token (None: all trainable / not recorded); ``weight_versions`` one per generate call;
    ``rollout_id`` ties the samples one rollout fanned out into; ``remove_sample`` keeps a sample
    out of the loss.
    """

    Status = _Sample.Status
    SpecInfo = SpecInfo
    PrefixCacheInfo = PrefixCacheInfo

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    status: _Sample.Status = _Sample.Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    remove_sample: bool = False
    session_id: str | None = None
    rollout_routed_experts: Any = None  # slime: int32 ndarray [tokens - 1, layers, top_k]; ours: its base64
    # slime's top-p replay: each response token's kept set, ragged (ours: the same lists)
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    # slime's other fields (August 2026), with its defaults: carried for plug-ins that read or set
    # them; the multimodal ones have no effect here (text models)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    teacher_log_probs: list[float] | None = None
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    non_generation_time: float = 0.0
    spec_info: _SpecInfo = field(default_factory=lambda: _SpecInfo())
    prefix_cache_info: _PrefixCacheInfo = field(default_factory=lambda: _PrefixCacheInfo())

    def get_reward_value(self, args: Any) -> Any:
        """slime's: the reward, or its ``args.reward_key`` entry."""
        key = getattr(args, "reward_key", None)
        reward: Any = self.reward  # a dict where the reward is keyed
        return reward if not key else reward[key]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Any = None,
        log_probs: Any = None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """slime's: append response tokens with their mask and logprobs aligned. The policy's tokens come
        with their logprobs (and SGLang's ``meta_info``: the status from its finish reason, the weight
        version, the prefix-cache counts); a tool's or the environment's with ``trainable=False``
        (mask 0, logprob 0.0)."""
        tokens = [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens or [])]
        log_probs = (
            None
            if log_probs is None
            else [float(v) for v in (log_probs.tolist() if hasattr(log_probs, "tolist") else log_probs)]
        )
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        # in place, as slime's: plug-ins keep references to these lists (retool's loss_masks)
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError(
                        "Cannot append trainable rollout log probabilities to a sample with existing "
                        "response tokens but no existing rollout_log_probs."
                    )
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs
        if meta_info and update_terminal_info and "finish_reason" in meta_info:
            self.prefix_cache_info.add(meta_info)
            if "weight_version" in meta_info:
                self.weight_versions.append(meta_info["weight_version"])
            status = _FINISHED.get((meta_info["finish_reason"] or {}).get("type"))
            self.status = status or self.status
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")

    def to_dict(self) -> dict[str, Any]:
        value = dict(self.__dict__)
        value |= {
            "status": self.status.value,
            "spec_info": self.spec_info.to_dict(),
            "prefix_cache_info": self.prefix_cache_info.to_dict(),
        }
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Sample":
        data = dict(data)
        data["status"] = _Sample.Status(data["status"])
        data["spec_info"] = SpecInfo.from_dict(data.get("spec_info", {}))
        data["prefix_cache_info"] = PrefixCacheInfo.from_dict(data.get("prefix_cache_info", {}))
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():  # slime keeps unknown keys as attributes
            if key not in names:
                setattr(sample, key, value)
        return sample


def from_inverted(sample: _Sample, cls: Any = None, args: Any = None) -> Any:
    """Our Sample as slime's: the class plug-ins import (the installed slime's, else ours), unless
    ``cls`` is given. Pure: it reads the Sample and, with ``args``, the tokenizer.

    With the job's ``args``, as slime's rollout would have it: ``index`` counts across the dataset
    (slime numbers every sample it hands out; ours is the place in the group, kept for the way
    back), ``response`` is the response tokens' text (the job's tokenizer decodes them), and with
    ``--apply-chat-template`` a chat prompt is the template's text (slime renders it when it reads
    the dataset).
    """
    types_module = sys.modules.get("slime.utils.types")
    cls = cls or (types_module.Sample if types_module is not None else Sample)
    metadata = dict(sample.metadata)
    index, prompt, response = sample.index, sample.prompt, ""
    if args is not None:
        index = sample.group_index * args.n_samples_per_prompt + sample.index
        if sample.response_length and getattr(args, "hf_checkpoint", None):
            response = _tokenizer_of(args).decode(sample.tokens[-sample.response_length :])
        if args.apply_chat_template and isinstance(prompt, list):
            prompt = _tokenizer_of(args).apply_chat_template(
                prompt,
                tools=metadata.get("tools"),
                tokenize=False,
                add_generation_prompt=True,
                **(args.apply_chat_template_kwargs or {}),
            )
    extra = {
        "response": response,
        "remove_sample": sample.remove_sample,
        "teacher_log_probs": None if sample.teacher_log_probs is None else list(sample.teacher_log_probs),
        **{name: None if getattr(sample, name) is None else list(getattr(sample, name)) for name in KEPT_SETS},
    }
    known = getattr(cls, "__dataclass_fields__", extra)  # an older slime's Sample lacks the newer fields
    view = cls(
        group_index=sample.group_index,
        index=index,
        prompt=prompt,
        tokens=list(sample.tokens),
        response_length=sample.response_length,
        label=sample.label,
        reward=sample.reward,
        loss_mask=list(sample.loss_mask) if sample.response_length else None,  # slime's: None until a response
        rollout_log_probs=None if sample.rollout_log_probs is None else list(sample.rollout_log_probs),
        weight_versions=_calls_of(sample.weight_versions),
        status=cls.Status(sample.status.value),
        metadata=metadata,
        session_id=sample.session_id,
        **{k: v for k, v in extra.items() if k in known},
    )
    for name in extra.keys() - known:
        setattr(view, name, extra[name])
    view.rollout_routed_experts = sample.rollout_routed_experts  # slime's newer field; an attribute on older ones
    view._token_versions = list(sample.weight_versions)  # exact per-token versions, for the way back
    view._index = sample.index  # our index (the place in the group), for the way back
    return view


# Rollouts side by side (--async-mode) run slime's rollout functions on threads at once; the first
# tokenizer load imports transformers, whose lazy modules fail when two threads import them together.
_tokenizer_lock = threading.Lock()


def _tokenizer_of(args: Any) -> Any:
    with _tokenizer_lock:
        return _tokenizer(args.hf_checkpoint, getattr(args, "chat_template", None))


@functools.cache
def _tokenizer(path: str, chat_template: str | None) -> Any:
    from inverted.hf_checkpoint import load_tokenizer

    return load_tokenizer(path, chat_template)


@dataclass(frozen=True, slots=True)
class Serving:
    """The weight version serving when a rollout started, for Samples whose generate function recorded
    none: exact when training waits for rollouts, ``inferred`` (marked in the Sample) under ``--async-mode``."""

    version: str
    inferred: bool = False


def to_inverted(view: Any, calls: list[GenerateCall] | None = None, serving: Serving | None = None) -> _Sample:
    """A slime Sample (ours or the installed slime's) as ours. ``calls``: the router answers its
    generate function received (``post`` records them), which give each token its version; where
    it recorded none, each token has ``serving``'s. Rollout log-probs are optional, as in slime:
    without them the trainer's own old log-probs stand in."""
    n = view.response_length
    logprobs = (
        None
        if view.rollout_log_probs is None
        else [
            float(v)
            for v in (
                view.rollout_log_probs.tolist() if hasattr(view.rollout_log_probs, "tolist") else view.rollout_log_probs
            )
        ]
    )
    if logprobs is not None and not logprobs and n:  # slime's empty list: none recorded
        logprobs = None
    mask = list(view.loss_mask) if view.loss_mask is not None else [1] * n
    status = _Sample.Status(getattr(view.status, "value", view.status))
    if status == _Sample.Status.PENDING and n:  # slime trains what its plug-ins return: a response left pending
        status = _Sample.Status.COMPLETED  # (SFT data, never generated) is complete as it is
    metadata = dict(view.metadata or {})
    try:
        versions = token_versions(view, mask, calls or [])
    except SampleError:
        if serving is None:
            raise
        versions = [serving.version] * n
        if serving.inferred:
            metadata["weight_versions_inferred"] = True
    teacher = getattr(view, "teacher_log_probs", None)
    return _Sample(
        group_index=view.group_index,
        index=getattr(view, "_index", view.index),
        prompt=view.prompt,
        tokens=list(view.tokens),
        response_length=n,
        loss_mask=mask,
        rollout_log_probs=logprobs,
        weight_versions=versions,
        reward=view.reward,
        status=status,
        label=view.label,
        metadata=metadata,
        session_id=getattr(view, "session_id", None),
        rollout_routed_experts=_routes_of(getattr(view, "rollout_routed_experts", None)),
        remove_sample=bool(getattr(view, "remove_sample", False)),
        teacher_log_probs=None
        if teacher is None
        else [float(v) for v in (teacher.tolist() if hasattr(teacher, "tolist") else teacher)],
        **{name: _ints_of(getattr(view, name, None)) for name in KEPT_SETS},
    )


KEPT_SETS = ("rollout_top_p_token_ids", "rollout_top_p_token_offsets")


def _ints_of(value: Any) -> list[int] | None:
    """A list, tensor or array of ints (slime keeps the kept sets either way) as a list."""
    return None if value is None else [int(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]


def _routes_of(value: Any) -> str | None:
    """slime's routed experts (an int32 array, as its rollout decodes SGLang's answer) as SGLang's base64."""
    return value if value is None or isinstance(value, str) else encode_routed_experts(value)


def _calls_of(per_token: list[str]) -> list[str]:
    """Per-token versions as slime's per-call list: one entry per run of equal versions."""
    return [v for i, v in enumerate(per_token) if i == 0 or per_token[i - 1] != v]


def token_versions(view: Any, mask: list[int], calls: list[GenerateCall]) -> list[str]:
    """One weight version per response token of a slime Sample.

    In order of trust: the exact list it came from (a Sample that went out through
    ``from_inverted``, unchanged in length); the router answers its generate function received,
    whose sampled tokens are the trainable ones, in order; one trainable run of tokens per entry of
    slime's per-call ``weight_versions``; a single version for all. Tokens the policy did not
    sample (tool output) take the version of the call before them.
    """
    n = view.response_length
    exact = getattr(view, "_token_versions", None)
    if exact is not None and len(exact) == n:
        return list(exact)
    versions = [str(v) for v in view.weight_versions]
    if len(versions) == n:  # already one per token (a common slime shortcut)
        return versions
    trainable = [i for i, m in enumerate(mask) if m]
    runs = [i for i in trainable if i == 0 or not mask[i - 1]]  # first token of each trainable run
    if calls and sum(len(c.output_ids) for c in calls) == len(trainable):
        sampled = [c.weight_version for c in calls for _ in c.output_ids]
    elif len(versions) == len(runs) and versions:
        run_of = {start: k for k, start in enumerate(runs)}
        sampled, k = [], -1
        for i in trainable:
            k = run_of.get(i, k)
            sampled.append(versions[k])
    elif len(set(versions)) == 1 or (not versions and calls and len({c.weight_version for c in calls}) == 1):
        return [versions[0] if versions else calls[0].weight_version] * n
    elif not n:
        return []
    else:
        raise SampleError(
            f"slime Sample (group {view.group_index}, index {view.index}): cannot tell which of its "
            f"{n} response tokens each of weight_versions {versions} sampled; call the router through "
            "slime.utils.http_utils.post (it records each answer's version)"
        )
    out, current, taken = [], sampled[0] if sampled else "default", iter(sampled)
    for m in mask:  # tokens before the first sampled one belong to the first call
        if m:
            current = next(taken)
        out.append(current)
    return out


# -- args ------------------------------------------------------------------------------------------


class SlimeArgs:
    """slime's ``args``: the job's flags under slime's names (``args.rollout_max_response_len``), the slime
    flags given beyond inverted's, and slime's default for every other flag of its ``train.py``
    (``compat.slime_flags``). A plug-in may set attributes on its copy, as slime's do."""

    def __init__(self, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    @classmethod
    def of(cls, flags: dict[str, Any], router_url: str | None = None, router_api_key: str | None = None) -> "SlimeArgs":
        """From the job's flags by name (``config.plugin_flags``). ``router_url``, ``router_api_key``: the
        job's router and the key it takes on /generate, as ``args.sglang_router_ip``/``_port`` and
        ``args.router_api_key`` (``post`` sends it; a plug-in with an HTTP client of its own sends it
        as a bearer token)."""
        values = dict(flags)
        if router_url:
            host, _, port = router_url.split("//")[-1].rpartition(":")
            values.update(sglang_router_ip=host, sglang_router_port=int(port))
        if router_api_key:
            values["router_api_key"] = router_api_key
        return cls(values)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        flag = slime_flags.table().get(name)
        if flag is not None:
            return flag.default
        raise AttributeError(
            f"args.{name}: not a flag of slime's train.py nor of inverted; see docs/migrating-from-slime.md"
        ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._values or name in slime_flags.table()

    def is_set(self, name: str) -> bool:
        """Whether the job set ``name`` (a flag of inverted's, or a slime flag given), not slime's default."""
        return name in self._values

    def __repr__(self) -> str:
        return f"SlimeArgs({len(self._values)} flags given, slime's defaults for the rest)"


# -- the router helpers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """One ``/generate`` answer a generate function received: what it sampled, under which weights."""

    output_ids: tuple[int, ...]
    weight_version: str


_calls: contextvars.ContextVar[list[GenerateCall] | None] = contextvars.ContextVar("slime_generate_calls", default=None)
_httpx_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class _Generating:
    """What ``post`` adds to the calls of a rollout: the LoRA adapter, and the router's address and key."""

    lora_path: str | None
    router: tuple[str, str] | None


_generating: contextvars.ContextVar[_Generating | None] = contextvars.ContextVar("slime_generating", default=None)
# The same for threads a plug-in starts itself (slime's fully-async worker): a new thread begins with
# an empty context, so there ``post`` takes what the rollouts running in this process set.
_in_process: list[_Generating] = []


def _current() -> _Generating:
    return _generating.get() or (_in_process[-1] if _in_process else _Generating(None, None))


def record_calls() -> list[GenerateCall]:
    """Start recording the ``/generate`` answers ``post`` receives in this task (and tasks it starts)."""
    calls: list[GenerateCall] = []
    _calls.set(calls)
    return calls


@contextlib.contextmanager
def generating_with(
    lora_path: str | None, router_url: str | None = None, router_api_key: str | None = None
) -> Iterator[None]:
    """Within it, ``post`` names this LoRA adapter in every ``/generate`` that names none (a LoRA
    run's policy is its adapter, and a slime plug-in written for full fine-tuning would sample the
    base), and sends the router's key with every call to ``router_url`` (slime's router takes none)."""
    setting = _Generating(
        lora_path, (router_url.rstrip("/") + "/", router_api_key) if router_url and router_api_key else None
    )
    token = _generating.set(setting)
    _in_process.append(setting)
    try:
        yield
    finally:
        _generating.reset(token)
        _in_process.remove(setting)


def _session():
    """A session for one call, no timeout (slime's client). Not pooled: slime's plug-ins run their
    calls under ``asyncio.run`` in threads of their own, whose loops end with no chance to close a
    pooled one (aiohttp then logs unclosed sessions); a loopback connection costs little."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), trust_env=False)


def _with_router_key(url: str, headers: dict[str, str] | None) -> dict[str, str] | None:
    router = _current().router
    if router and url.startswith(router[0]) and "Authorization" not in (headers or {}):
        return {**(headers or {}), "Authorization": f"Bearer {router[1]}"}
    return headers


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict[str, str] | None = None) -> Any:
    """POST JSON and return the JSON answer; like slime, any failure is retried once a second,
    ``max_retries`` times, then raised."""
    lora_path = _current().lora_path
    if lora_path and url.endswith("/generate") and isinstance(payload, dict) and not payload.get("lora_path"):
        payload = {**payload, "lora_path": lora_path}
    headers = _with_router_key(url, headers)
    for attempt in range(1, max_retries + 1):
        try:
            async with _session() as session, session.post(url, json=payload, headers=headers) as response:
                response.raise_for_status()
                output = await response.json(content_type=None)
            break
        except Exception as exc:  # noqa: BLE001 (slime retries whatever went wrong)
            if attempt >= max_retries:
                raise
            logger.info("post %s failed (%s), retrying (attempt %d/%d)", url, exc, attempt, max_retries)
            await asyncio.sleep(1)
    calls = _calls.get()
    if calls is not None and isinstance(output, dict) and "output_ids" in output and "meta_info" in output:
        calls.append(
            GenerateCall(tuple(output["output_ids"]), str(output["meta_info"].get("weight_version", "default")))
        )
    return output


def http_utils_attr(name: str) -> Any:
    """``slime.utils.http_utils._http_client``: slime's shared httpx client (plug-ins that stream use it),
    one per event loop, sending the router's key like ``post``."""
    if name != "_http_client":
        raise AttributeError(f"module 'slime.utils.http_utils' has no attribute {name!r}")
    import httpx

    loop = asyncio.get_running_loop()
    if loop not in _httpx_clients:

        async def add_router_key(request: httpx.Request) -> None:
            for key, value in (_with_router_key(str(request.url), dict(request.headers)) or {}).items():
                request.headers[key] = value

        _httpx_clients[loop] = httpx.AsyncClient(
            timeout=None, trust_env=False, event_hooks={"request": [add_router_key]}
        )
    return _httpx_clients[loop]


async def get(url: str) -> Any:
    async with _session() as session, session.get(url, headers=_with_router_key(url, None)) as response:
        response.raise_for_status()
        return await response.json(content_type=None)


class GenerateState:
    """The default rollout's state (``slime.rollout.sglang_rollout``): tokenizer, sampling, concurrency
    (``aborted``, ``dp_rank`` and ``dp_rank_context`` as slime's, with nothing to abort or balance).

    One per process, as in slime (``GenerateState(args)`` returns the same object every time).
    """

    _instance: GenerateState | None = None
    args: Any
    tokenizer: Any
    processor: Any
    semaphore: asyncio.Semaphore
    aborted: bool
    dp_rank: int
    group_sampling_seeds: list[int]
    sampling_params: dict[str, Any]

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        yield 0

    def __new__(cls, args: Any) -> "GenerateState":
        if cls._instance is None or cls._instance.args is not args:
            state = super().__new__(cls)
            state.args = args
            # slime's own args have no --chat-template (nor has an args built from a few sections)
            state.tokenizer = _tokenizer_of(args)
            state.processor = None
            # slime's --sglang-server-concurrency is per server; without it, our --rollout-concurrency
            concurrency = args.rollout_concurrency
            if isinstance(args, SlimeArgs) and args.is_set("sglang_server_concurrency"):
                concurrency = args.sglang_server_concurrency * max(
                    1, args.rollout_num_gpus // args.rollout_num_gpus_per_engine
                )
            state.semaphore = asyncio.Semaphore(concurrency)
            state.aborted = False  # slime aborts a rollout's leftovers; here the buffer's leases do
            state.dp_rank = 0
            state.group_sampling_seeds = [args.rollout_seed + i for i in range(args.n_samples_per_prompt)]
            state.sampling_params = {
                "temperature": args.rollout_temperature,
                "top_p": args.rollout_top_p,
                "top_k": -1,
                "max_new_tokens": args.rollout_max_response_len,
                "skip_special_tokens": False,
                "no_stop_trim": True,
                "spaces_between_special_tokens": False,
            }
            cls._instance = state
        return cls._instance


@dataclass
class DynamicFilterOutput:
    """What slime's dynamic-sampling filters return (``slime.rollout.filter_hub.base_types``)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False  # slime: kept when dropping it would leave the batch short


def check_reward_nonzero_std(args: Any, samples: list[Any], **kwargs: Any) -> DynamicFilterOutput:
    """slime's ``dynamic_sampling_filters.check_reward_nonzero_std``: keep a group whose rewards differ."""
    rewards = [float(s.get_reward_value(args)) for s in samples]
    mean = sum(rewards) / len(rewards)
    # slime's torch.std: the sample standard deviation (n - 1), 0 for one sample's NaN
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5 if len(rewards) > 1 else float("nan")
    keep = std > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Any], **kwargs: Any) -> DynamicFilterOutput:
    """slime's: the same, but a rejected group is kept when the batch would fall short without it."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output


# -- slime.rollout.base_types and slime.utils.misc ------------------------------------------------


@dataclass
class RolloutFnTrainOutput:
    """What slime's rollout functions return for training: the groups, and metrics to log."""

    samples: list[list[Any]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """What slime's rollout functions return for evaluation: per dataset name, its results."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> Any:
    """slime's: call a rollout function and wrap a legacy return value in its output type."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output


@functools.cache
def load_function(path: str) -> Any:
    """slime's ``load_function("module.sub.name")``."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


class SingletonMeta(type):
    """slime's metaclass of a class with one instance."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances = {}


def group_by(iterable: Any, key: Any = None) -> dict[Any, list[Any]]:
    """slime's: items by ``key`` (no sorting needed, unlike itertools.groupby)."""
    groups: dict[Any, list[Any]] = {}
    for item in iterable:
        groups.setdefault(key(item) if key is not None else item, []).append(item)
    return groups
