"""Sampling parameters (SGLang's ``/generate`` contract) and the batched sampler.

``SamplingParams`` mirrors SGLang 0.5.23: unknown keys and JSON floats for integer fields are
schema errors (``SchemaError``, answered ``400 {"error": "<text>"}``); values out of range are
``InvalidRequest`` (answered ``400 {"error": {"message"}}``), as SGLang's ``verify`` does.

``sample`` draws one token per row. The logprob it returns is the one SGLang returns by default:
``log_softmax(logits / temperature)`` at the sampled token, before top-k/top-p/min-p filtering
(greedy rows use temperature 1). A request with a ``sampling_seed`` owns a ``torch.Generator``,
so it samples the same tokens whatever else shares its batch; the others draw from the engine's
shared generator in one call.

A row that asks for its **sampling mask** (SGLang's ``return_sampling_mask``) also gets the set the
token was drawn from (``Kept``), as SGLang 0.5.23's PyTorch sampler builds it: the probabilities at
the temperature sorted most likely first, a token kept while its rank is below ``top_k``, the mass
before it is at most ``top_p`` and it reaches ``min_p`` times the top one (with a positive
probability); the kept ids in that order, and each one's log-probability renormalised over the set
(a greedy row: its one token, at 0.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from inverted.errors import FieldError, InvalidRequest, SchemaError

GREEDY_EPS = 1e-6
MAX_STOPS = 32


class SamplingParams(BaseModel):
    """SGLang's sampling parameters, with its defaults. Floats accept JSON ints; ints reject floats."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: StrictInt = 128
    min_new_tokens: StrictInt = 0
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    top_k: StrictInt = -1
    min_p: StrictFloat | StrictInt = 0.0
    frequency_penalty: StrictFloat | StrictInt = 0.0
    presence_penalty: StrictFloat | StrictInt = 0.0
    repetition_penalty: StrictFloat | StrictInt = 1.0
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    sampling_seed: StrictInt | None = None
    json_schema: StrictStr | None = None  # constrained decoding (engine.grammar)
    regex: StrictStr | None = None
    # Accepted so the contract matches SGLang's, but not implemented by the embedded engine:
    # ``verify`` rejects any non-default value rather than silently ignoring it.
    stop_regex: StrictStr | list[StrictStr] | None = None
    ebnf: StrictStr | None = None
    structural_tag: StrictStr | None = None
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: StrictInt | None = None

    @classmethod
    def parse(cls, data: Any) -> "SamplingParams":
        """Validate a JSON object against the contract, raising SchemaError (shape) or InvalidRequest (values)."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise FieldError(f"sampling_params: Input should be a valid dictionary, got {type(data).__name__}")
        try:
            params = cls.model_validate(data)
        except ValidationError as exc:
            raise SchemaError(_serde_message(exc)) from None
        params.verify()
        return params

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def max_new_tokens_given(self) -> bool:
        """Whether the request set ``max_new_tokens``: SGLang checks only a given one against the context,
        and stops a request without one where the context ends."""
        return "max_new_tokens" in self.model_fields_set

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def verify(self) -> None:
        """Range checks, with SGLang's wording where it has one."""
        checks = [
            (self.max_new_tokens >= 0, f"max_new_tokens must be at least 0, got {self.max_new_tokens}."),
            (
                0 <= self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got {self.min_new_tokens}.",
            ),
            (
                math.isfinite(self.temperature) and self.temperature >= 0.0,
                f"temperature must be a non-negative finite number, got {self.temperature}.",
            ),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}."),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}."),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (disable) or at least 1, got {self.top_k}."),
            (self.n >= 1, f"n must be at least 1, got {self.n}."),
            (len(self.stops) <= MAX_STOPS, f"stop must have at most {MAX_STOPS} strings, got {len(self.stops)}."),
            (all(self.stops), "stop strings must not be empty."),
            (all(t >= 0 for t in self.stop_token_ids or []), "stop_token_ids must be non-negative."),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)
        unsupported = {
            "frequency_penalty": self.frequency_penalty != 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "stop_regex": bool(self.stop_regex),
            "ebnf": self.ebnf is not None,
            "structural_tag": self.structural_tag is not None,
            "logit_bias": bool(self.logit_bias),
        }
        named = [name for name, used in unsupported.items() if used]
        if named:
            raise InvalidRequest(
                f"the embedded engine does not support sampling parameters {named}; use real SGLang for them."
            )


def _serde_message(exc: ValidationError) -> str:
    """One serde-style line for the first error, as SGLang's contract check reports it."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown field `{where}`, expected one of {', '.join(f'`{f}`' for f in SamplingParams.model_fields)}"
    return f"invalid value for `{where}`: {err['msg']} (got {err.get('input')!r})"


TopLogprobs = list[tuple[float, int]]


def top_logprobs(logprobs_TV: torch.Tensor, ks: list[int]) -> list[TopLogprobs | None]:
    """Each row's ``ks[i]`` most likely tokens as ``(logprob, id)``, best first (None where k is 0)."""
    k_max = max(ks, default=0)
    if k_max == 0:
        return [None] * len(ks)
    values_TK, ids_TK = logprobs_TV.topk(min(k_max, logprobs_TV.shape[-1]), dim=-1)
    values, ids = values_TK.tolist(), ids_TK.tolist()
    return [list(zip(values[i][:k], ids[i][:k])) if k else None for i, k in enumerate(ks)]


def named_logprobs(logprobs_TV: torch.Tensor, ids: list[list[int] | None]) -> list[TopLogprobs | None]:
    """Each row's ``(logprob, id)`` of the ids ``ids[i]`` names, in their order (SGLang's
    ``token_ids_logprob``); None where it names none."""
    return [None if row is None else list(zip(logprobs_TV[i, row].tolist(), row)) for i, row in enumerate(ids)]


def temperatures(params: list[SamplingParams], device: torch.device | str) -> torch.Tensor:
    """Each row's temperature, as its logprobs are scaled: a greedy row's at 1."""
    return torch.tensor([1.0 if p.greedy else float(p.temperature) for p in params], device=device)


@dataclass(frozen=True, slots=True)
class Kept:
    """The set one token was sampled from: its ids, most likely first, and each one's log-probability
    renormalised over the set (one row of SGLang's ``output_token_sampling_mask`` and, in its
    ``support`` mode, of ``output_token_sampling_logprobs``); ``selected``: the sampled token's."""

    ids: list[int]
    logprobs: list[float]
    selected: float


@dataclass(frozen=True, slots=True)
class Draw:
    """One token per row, with its (temperature-scaled) logprob, and what each row asked to see of the
    same distribution: its most likely tokens, the ids it named, the set the token was drawn from."""

    tokens: list[int]
    logprobs: list[float]
    tops: list[TopLogprobs | None]
    named: list[TopLogprobs | None]
    kept: list[Kept | None]


def sample(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]],
    shared: torch.Generator,
    top_k_logprobs: list[int] | None = None,
    masks: list[bool] | None = None,
    named_ids: list[list[int] | None] | None = None,
) -> Draw:
    """Draw one token per row.

    ``banned[i]`` lists ids row i may not emit yet (stop tokens before ``min_new_tokens``);
    ``top_k_logprobs[i]`` asks for row i's k most likely tokens, ``named_ids[i]`` for the logprobs of
    those ids, and ``masks[i]`` for its kept set, all from the distribution it was drawn from.
    """
    logits_BV = logits_BV.float()
    for row, ids in enumerate(banned):
        if ids:
            logits_BV[row, ids] = float("-inf")
    temps = temperatures(params, logits_BV.device)
    logprobs_BV = torch.log_softmax(logits_BV / temps[:, None], dim=-1)
    chosen = logprobs_BV.argmax(dim=-1)
    masks = masks or [False] * len(params)
    kept: list[Kept | None] = [
        Kept([t], [0.0], 0.0) if m and p.greedy else None for m, p, t in zip(masks, params, chosen.tolist())
    ]
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits_BV.device)
        truncated = _truncate(logprobs_BV[rows].exp(), [params[i] for i in sampled_rows])
        probs = truncated.filtered()
        # Inverse CDF: one uniform per row (CPU RNG is slow per element, so never draw a vocab's worth).
        uniform = torch.rand(len(sampled_rows), generator=shared, device=probs.device)
        for j, i in enumerate(sampled_rows):
            if generators[i] is not None:
                uniform[j] = torch.rand(1, generator=generators[i], device=probs.device)[0]
        cdf = probs.cumsum(dim=-1)
        picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]
        chosen[rows] = picked.clamp(max=probs.shape[-1] - 1)
        for j, i in enumerate(sampled_rows):
            if masks[i]:
                kept[i] = truncated.kept(j, int(chosen[i]))
    token_logprobs = logprobs_BV.gather(1, chosen[:, None])[:, 0]
    tops = top_logprobs(logprobs_BV, top_k_logprobs or [0] * len(params))
    named = named_logprobs(logprobs_BV, named_ids or [None] * len(params))
    return Draw(chosen.tolist(), token_logprobs.tolist(), tops, named, kept)


@dataclass(slots=True)
class _Truncated:
    """Rows of probabilities and what top_k, top_p and min_p keep of them: ``keep`` over the rows sorted
    most likely first (``sorted_probs``, ``order``), a prefix of each row; None where nothing is cut."""

    probs: torch.Tensor
    sorted_probs: torch.Tensor | None = None
    order: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    def filtered(self) -> torch.Tensor:
        """The rows with what is cut zeroed (left unnormalised: the inverse CDF scales by the sum)."""
        if self.keep is None or self.sorted_probs is None or self.order is None:  # nothing cut
            return self.probs
        kept = torch.where(self.keep, self.sorted_probs, torch.zeros_like(self.sorted_probs))
        return torch.zeros_like(self.probs).scatter(1, self.order, kept)

    def kept(self, row: int, token: int) -> Kept:
        if self.keep is None or self.sorted_probs is None or self.order is None:  # nothing cut: all with a probability
            self.sorted_probs, self.order = self.probs.sort(dim=-1, descending=True)
            self.keep = self.sorted_probs > 0
        size = int(self.keep[row].sum())
        weights = self.sorted_probs[row, :size]
        logprobs = (weights / weights.sum(dtype=torch.float32)).log()
        ids = self.order[row, :size].tolist()
        return Kept(ids, logprobs.tolist(), float(logprobs[ids.index(token)]))


def _truncate(probs_RV: torch.Tensor, params: list[SamplingParams]) -> _Truncated:
    """What top_k, top_p and min_p keep of each row, by SGLang's rules (its PyTorch sampler's)."""
    top_k = [p.top_k for p in params]
    top_p = [float(p.top_p) for p in params]
    min_p = [float(p.min_p) for p in params]
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0.0 for m in min_p):
        return _Truncated(probs_RV)
    vocab = probs_RV.shape[-1]
    sorted_probs, order = probs_RV.sort(dim=-1, descending=True)
    device = probs_RV.device
    k = torch.tensor([vocab if v == -1 else min(v, vocab) for v in top_k], device=device)
    rank = torch.arange(vocab, device=device)[None]
    keep = rank < k[:, None]
    # Keep a token while the mass before it is at most top_p (so the top token always stays).
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= before <= torch.tensor(top_p, device=device)[:, None]
    keep &= sorted_probs >= torch.tensor(min_p, device=device)[:, None] * sorted_probs[:, :1]
    keep &= sorted_probs > 0
    return _Truncated(probs_RV, sorted_probs, order, keep)
