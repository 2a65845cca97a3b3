"""The data contract: ``Sample``, one trajectory (or one branch of one) from proxy to trainer.

Field names follow slime's where the meaning is the same, so slime rollout functions port easily.
A Sample crosses process boundaries only as the JSON made by ``to_json`` and read by
``from_json``; ``validate`` checks every invariant and is called wherever Samples enter a
service. It imports only ``errors`` (a leaf), so that ``validate`` raises the tree's SampleError.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from inverted.errors import SampleError

Reward = float | dict[str, float]


@dataclass(kw_only=True, slots=True)
class Sample:
    """One trajectory: prompt + response tokens, with what the policy sampled and under which weights.

    ``tokens`` holds prompt and response ids; the last ``response_length`` of them are the response.
    ``loss_mask``, ``rollout_log_probs`` and ``weight_versions`` have one entry per response token:
    the mask is 1 exactly where the policy sampled the token (0 on tool output and template glue,
    whose logprob is 0.0 and whose version is the one of the surrounding turn).
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
    rollout_log_probs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    reward: Reward | None = None
    status: Status = Status.PENDING
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def validate(self) -> None:
        """Raise ``SampleError`` naming the first broken invariant."""
        if not isinstance(self.tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.tokens
        ):
            raise SampleError("tokens: expected a list of non-negative ints")
        if not isinstance(self.response_length, int) or not 0 <= self.response_length <= len(self.tokens):
            raise SampleError(
                f"response_length: expected 0 <= response_length <= len(tokens)={len(self.tokens)}, "
                f"got {self.response_length!r}"
            )
        for name in ("loss_mask", "rollout_log_probs", "weight_versions"):
            value = getattr(self, name)
            if len(value) != self.response_length:
                raise SampleError(
                    f"{name}: expected {self.response_length} entries (response_length), got {len(value)}"
                )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise SampleError("loss_mask: expected only 0 and 1")
        if any(not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 0 for lp in self.rollout_log_probs):
            raise SampleError("rollout_log_probs: expected finite floats <= 0")
        if any(not isinstance(v, str) for v in self.weight_versions):
            raise SampleError("weight_versions: expected strings")
        _check_reward(self.reward)
        if not isinstance(self.status, Sample.Status):
            raise SampleError(f"status: expected one of {[s.value for s in Sample.Status]}, got {self.status!r}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Sample":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SampleError(f"unknown Sample fields: {sorted(unknown)}")
        values = dict(data)
        try:
            values["status"] = Sample.Status(values.get("status", Sample.Status.PENDING.value))
        except ValueError as exc:
            raise SampleError(f"status: {exc}") from None
        return cls(**values)


def _check_reward(reward: Reward | None) -> None:
    if reward is None:
        return
    items = reward.items() if isinstance(reward, dict) else [("reward", reward)]
    for name, value in items:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SampleError(f"reward[{name!r}]: expected a finite number, got {value!r}")
