"""The data contract: ``Sample``, one trajectory (or one branch of one) from proxy to trainer.

Field names follow slime's where the meaning is the same, so slime rollout functions port easily.
A Sample crosses process boundaries only as the JSON made by ``to_json`` and read by
``from_json``; ``validate`` checks every invariant and is called wherever Samples enter a
service. ``Task`` is the unit of work the buffer leases out and a rollout function turns into
one Sample. It imports only ``errors`` (a leaf), so that ``validate`` raises the tree's SampleError.
"""

from __future__ import annotations

import base64
import enum
import math
import sys
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

import msgspec

from inverted.errors import SampleError

# A number, or a dict of any JSON values (slime's reward models return flags and parsed answers beside
# the score): the number trained on is ``--reward-key``'s entry, or else the sum of the dict's numbers.
Reward = float | dict[str, Any]

# How an SGLang server pauses generation (``/pause_generation``'s ``mode``): abort in-flight
# requests, retract them to the queue (KV dropped, tokens kept), or stop stepping and keep everything.
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = typing.get_args(PauseMode)
# The LoRA adapter a LoRA run trains, by the name the rollout servers hold it under: the weight
# sync loads it, and every policy call of the rollout side names it (SGLang's lora_path).
POLICY_ADAPTER = "policy"


# Per-response-token lists a Sample may leave out (None): log-probs not every sampler records.
OPTIONAL_PER_TOKEN = ("rollout_log_probs", "teacher_log_probs")


def version_number(version: str) -> int:
    """A weight version as a number: the trainer's step; SGLang's initial ``"default"`` (or anything
    else that is not an integer) counts as 0."""
    try:
        return int(version)
    except ValueError:
        return 0


def reward_number(reward: Reward | None, key: str | None = None) -> float | None:
    """The number a reward trains on: a number as is; of a dict, ``key``'s value (a number or a bool,
    as slime reads it) or else the sum of its numbers. None where it holds none (absent, or a raw
    reward that slime's reward post-process turns into a number: on-policy distillation's)."""
    if reward is None or not isinstance(reward, dict):
        return None if reward is None else float(reward)
    if key is None:
        numbers = [v for v in reward.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return float(sum(numbers)) if numbers else None
    value = reward.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


@dataclass(kw_only=True, slots=True)
class Sample:
    """One trajectory: prompt + response tokens, with what the policy sampled and under which weights.

    ``tokens`` holds prompt and response ids; the last ``response_length`` of them are the response.
    ``loss_mask``, ``rollout_log_probs`` and ``weight_versions`` have one entry per response token:
    the mask is 1 exactly where the policy sampled the token (0 on tool output and template glue,
    whose logprob is 0.0 and whose version is the one of the surrounding turn).
    ``rollout_log_probs`` may be None: the sampler recorded none (a plug-in that calls its server
    its own way, SFT data). The trainer then trains on its own old log-probs, and what compares the
    two (importance weights, the mismatch metric, KL-as-reward) leaves the Sample out and counts it.
    ``remove_sample``: no token of it is in the loss (a sample filter's verdict; it still counts in
    its group). ``teacher_log_probs``: a teacher's log-prob of each response token, for on-policy
    distillation (a reward post-process sets them). One ``metadata`` key is the buffer's: ``siblings``,
    the other Samples of a task that fanned out, stored with its first (``fold_siblings``) and served
    as Samples of their own (``unfold_siblings``).
    ``rollout_routed_experts`` (MoE, for rollout routing replay): the experts the engine routed each
    token to, in SGLang's ``meta_info.routed_experts`` form (``encode_routed_experts``), over the
    whole sequence: ``[len(tokens) - 1, layers, top_k]`` (the last token is never run).
    ``rollout_top_p_token_ids`` / ``rollout_top_p_token_offsets`` (slime's names and layout): the set
    each response token was sampled from under top-p, top-k or min-p (SGLang's sampling mask), ragged:
    response token i's kept ids are ``ids[offsets[i]:offsets[i + 1]]``; an empty range means the whole
    vocabulary (a token the policy did not sample, or sampled untruncated). Where a token has a set,
    its ``rollout_log_probs`` entry is its log-prob renormalised over that set, the probability it was
    sampled with, and the trainer computes its own the same way (``kept_sets``).
    """

    class Status(str, enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    reward: Reward | None = None
    status: Status = Status.PENDING
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None
    rollout_routed_experts: str | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def scalar_reward(self, key: str | None = None) -> float:
        """The reward as one number (``reward_number``), or a ``SampleError`` saying why there is none."""
        reward, number = self.reward, reward_number(self.reward, key)
        if number is not None:
            return number
        if not isinstance(reward, dict):  # (a number is always one: reward_number read it)
            raise SampleError(f"sample {self.index}: reward is missing")
        if key is None:
            raise SampleError(
                f"sample {self.index}: reward {sorted(reward)} holds no number to train on; "
                "name the entry with --reward-key"
            )
        if key not in reward:
            raise SampleError(f"sample {self.index}: reward has no key {key!r} (--reward-key); has {sorted(reward)}")
        raise SampleError(f"sample {self.index}: reward[{key!r}] (--reward-key) is {reward[key]!r}, not a number")

    def validate(self, *, elements_checked: bool = False) -> None:
        """Raise ``SampleError`` naming the first broken invariant.

        Element checks run through ``map``/``set``/``min`` so that validating a 1,024-token Sample
        costs microseconds, not a Python loop per token (the buffer ingests thousands per second).
        ``elements_checked``: the Sample comes from ``from_json``, whose decoder already enforced
        every element's type and range (in C, while parsing); only the lengths, the reward and the
        status are left to check.
        """
        full = not elements_checked
        if full and (
            not isinstance(self.tokens, list)
            or not set(map(type, self.tokens)) <= {int}
            or (self.tokens and min(self.tokens) < 0)
        ):
            raise SampleError("tokens: expected a list of non-negative ints")
        if type(self.response_length) is not int or not 0 <= self.response_length <= len(self.tokens):
            raise SampleError(
                f"response_length: expected 0 <= response_length <= len(tokens)={len(self.tokens)}, "
                f"got {self.response_length!r}"
            )
        for name in ("loss_mask", "rollout_log_probs", "weight_versions", "teacher_log_probs"):
            value = getattr(self, name)
            if value is None and name in OPTIONAL_PER_TOKEN:
                continue
            if not isinstance(value, list) or len(value) != self.response_length:
                raise SampleError(
                    f"{name}: expected a list of {self.response_length} entries (response_length), "
                    f"got {len(value) if isinstance(value, list) else type(value).__name__}"
                )
        if full and (not set(map(type, self.loss_mask)) <= {int} or not set(self.loss_mask) <= {0, 1}):
            raise SampleError("loss_mask: expected only 0 and 1")
        for name in OPTIONAL_PER_TOKEN:
            logprobs = getattr(self, name) or []
            # A NaN or an infinity makes the sum non-finite; one sum is far cheaper than a check per value.
            if full and (
                not set(map(type, logprobs)) <= {float, int}
                or not math.isfinite(sum(logprobs))
                or (logprobs and max(logprobs) > 0)
            ):
                raise SampleError(f"{name}: expected finite floats <= 0")
        if full and type(self.remove_sample) is not bool:
            raise SampleError(f"remove_sample: expected true or false, got {self.remove_sample!r}")
        if full and not set(map(type, self.weight_versions)) <= {str}:
            raise SampleError("weight_versions: expected strings")
        check_reward(self.reward)
        self._check_kept_sets(full)
        if not isinstance(self.status, Sample.Status):
            raise SampleError(f"status: expected one of {[s.value for s in Sample.Status]}, got {self.status!r}")

    def _check_kept_sets(self, full: bool) -> None:
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if ids is None and offsets is None:
            return
        if ids is None or offsets is None:
            raise SampleError("rollout_top_p_token_ids and rollout_top_p_token_offsets: give both or neither")
        if len(offsets) != self.response_length + 1 or (offsets and (offsets[0] != 0 or offsets[-1] != len(ids))):
            raise SampleError(
                f"rollout_top_p_token_offsets: expected {self.response_length + 1} offsets "
                f"(response_length + 1) from 0 to {len(ids)} (len(rollout_top_p_token_ids))"
            )
        if full and (
            not set(map(type, ids)) <= {int} or (ids and min(ids) < 0) or not set(map(type, offsets)) <= {int}
        ):
            raise SampleError("rollout_top_p_token_ids and rollout_top_p_token_offsets: expected non-negative ints")
        if any(b < a for a, b in zip(offsets, offsets[1:])):
            raise SampleError("rollout_top_p_token_offsets: expected a non-decreasing list")

    def kept_sets(self) -> list[list[int]] | None:
        """Each response token's kept set (an empty list: the whole vocabulary); None where none was recorded."""
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if ids is None or offsets is None:
            return None
        return [ids[a:b] for a, b in zip(offsets, offsets[1:])]

    def to_json(self) -> dict[str, Any]:
        """The JSON form (shallow: lists are shared with the Sample, not copied)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any] | bytes) -> "Sample":
        """A Sample from its JSON form: a parsed dict, or the raw JSON bytes (decoded straight into it).

        Field names, element types and element ranges are checked here (in C, by msgspec, while
        parsing), unknown fields included; the cross-field invariants are left to
        ``validate(elements_checked=True)``.
        """
        try:
            wire = msgspec.convert(data, _JSON_FORM) if isinstance(data, dict) else _JSON_DECODER.decode(data)
        except msgspec.ValidationError as exc:
            problem, _, path = str(exc).rpartition(" - at `$")
            raise SampleError(f"{path.strip('.`') or 'sample'}: {problem or exc}") from None
        except msgspec.DecodeError as exc:
            raise SampleError(f"sample: malformed JSON: {exc}") from None
        except RecursionError:
            raise SampleError("sample: malformed JSON: nested too deeply") from None
        return cls(**msgspec.structs.asdict(wire))


def encode_routed_experts(ids: Any) -> str:
    """Expert ids (any integer array: numpy, a CPU tensor) as SGLang's ``routed_experts``: base64 of
    little-endian int32, flattened (``[tokens, layers, top_k]`` in C order)."""
    import numpy as np

    return base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(text: str) -> Any:
    """The flat int32 numpy array of SGLang's ``routed_experts``; ``ValueError`` if it is not that."""
    import numpy as np

    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes is not a whole number of int32")
    return np.frombuffer(raw, dtype="<i4")


def fold_siblings(samples: list[Sample]) -> Sample:
    """One task's fan-out (several Samples of one ``(group_index, index)``, its own first) as the buffer
    stores a task: the first, carrying the others in ``metadata["siblings"]`` (a copy; the given
    Samples are unchanged). One Sample is itself."""
    first, *others = samples
    if not others:
        return first
    folded = Sample(**{f.name: getattr(first, f.name) for f in fields(first)})
    folded.metadata = {**first.metadata, "siblings": [s.to_json() for s in others]}
    return folded


def unfold_siblings(samples: list[Sample]) -> list[Sample]:
    """Each Sample followed by the siblings it carries (``fold_siblings``), each checked, as Samples of
    their own."""
    out = []
    for sample in samples:
        siblings = sample.metadata.get("siblings") or []
        if siblings:
            sample = Sample(**{f.name: getattr(sample, f.name) for f in fields(sample)})
            sample.metadata = {k: v for k, v in sample.metadata.items() if k != "siblings"}
        out.append(sample)
        for position, data in enumerate(siblings):
            try:
                sibling = Sample.from_json(data)
                sibling.validate(elements_checked=True)
            except SampleError as exc:
                raise SampleError(f"sample {sample.index}: metadata.siblings[{position}]: {exc}") from None
            out.append(sibling)
    return out


@dataclass(slots=True)
class Task:
    """A leased task: produce sample ``index`` of group ``group_index`` for this prompt."""

    lease_id: str
    group_index: int
    index: int
    prompt_index: int
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    expires_at: float = 0.0
    attempt: int = 1
    partial: Sample | None = None  # an aborted sample to resume from (with --partial-rollout)

    def to_json(self) -> dict[str, Any]:
        """The JSON form (shallow, like ``Sample.to_json``)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["partial"] = self.partial.to_json() if self.partial is not None else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Task":
        partial = data.get("partial")
        return cls(**{**data, "partial": Sample.from_json(partial) if partial else None})

    def new_sample(self) -> Sample:
        """A Sample that belongs to this task, to fill in and submit."""
        return Sample(
            group_index=self.group_index,
            index=self.index,
            prompt=self.prompt,
            label=self.label,
            metadata=dict(self.metadata),
        )


# The element rules of ``Sample.validate``, as msgspec constraints that the JSON decoder enforces.
# The lower bound of a log-prob refuses -inf and NaN (no comparison holds for it): finite and <= 0.
_LOGPROB = typing.Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=0.0)]
_ELEMENT_RULES: dict[str, Any] = {
    "tokens": list[typing.Annotated[int, msgspec.Meta(ge=0)]],
    "loss_mask": list[typing.Annotated[int, msgspec.Meta(ge=0, le=1)]],
    "rollout_log_probs": list[_LOGPROB] | None,
    "teacher_log_probs": list[_LOGPROB] | None,
    "rollout_top_p_token_ids": list[typing.Annotated[int, msgspec.Meta(ge=0)]] | None,
    "rollout_top_p_token_offsets": list[typing.Annotated[int, msgspec.Meta(ge=0)]] | None,
}


def _json_form() -> type:
    """A msgspec struct with exactly ``Sample``'s fields, types and defaults, generated from the
    dataclass, its lists' elements constrained by ``_ELEMENT_RULES``."""
    hints = typing.get_type_hints(Sample) | _ELEMENT_RULES
    spec = [
        (
            f.name,
            hints[f.name],
            f.default if f.default is not MISSING else msgspec.field(default_factory=f.default_factory),  # type: ignore[arg-type]
        )
        for f in fields(Sample)
    ]
    return msgspec.defstruct("SampleJSON", spec, forbid_unknown_fields=True)


_JSON_FORM = _json_form()
_JSON_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_JSON_FORM)


def check_reward(reward: Reward | None) -> None:
    """Raise ``SampleError`` unless the reward is None, a finite number, or a dict whose numbers are
    finite (its other values are any JSON: a flag, a parsed answer)."""
    if reward is None:
        return
    if not isinstance(reward, dict):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise SampleError(f"reward: expected a finite number or a dict, got {reward!r}")
        return
    for name, value in reward.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SampleError(f"reward[{name!r}]: expected a finite number, got {value!r}")
