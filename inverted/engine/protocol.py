"""The SGLang wire format, field for field: request models, ``/generate`` normalisation, responses.

``parse_generate`` turns one ``/generate`` body (single, batch, or ``n > 1``) into a flat list of
``GenerateItem`` s in SGLang's output order (prompt-major), raising ``SchemaError`` for contract
violations and ``InvalidRequest`` for bad values. ``generate_response`` renders one request's state as
SGLang does (``text``, ``output_ids`` including the stop token, ``meta_info``). The control
request models keep SGLang's field names and defaults; unknown fields are ignored, as there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from inverted.engine.sampling import SamplingParams
from inverted.engine.scheduler import Request, new_rid
from inverted.errors import FieldError, InvalidRequest
from inverted.types import encode_routed_experts

UNSUPPORTED_GENERATE_FIELDS = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "session_params",
    "custom_logit_processor",
    "return_hidden_states",
)


class ControlModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseGenerationRequest(ControlModel):
    mode: str = "abort"  # any string parses: the scheduler names the modes it knows


class ContinueGenerationRequest(ControlModel):
    torch_empty_cache: bool = True


class AbortRequestRequest(ControlModel):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionRequest(ControlModel):
    new_version: str
    abort_all_requests: bool = True


class BeginWeightUpdateRequest(ControlModel):
    selector: str = "all"


class WeightLoadOptions(ControlModel):
    """What every weight-loading route accepts besides its payload."""

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


class UpdateWeightsFromDiskRequest(WeightLoadOptions):
    model_path: str
    is_async: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class UpdateWeightsFromTensorRequest(WeightLoadOptions):
    serialized_named_tensors: list[str]


class InitWeightsUpdateGroupRequest(ControlModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(WeightLoadOptions):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class DestroyWeightsUpdateGroupRequest(ControlModel):
    group_name: str = "weight_update_group"


class GetWeightsByNameRequest(ControlModel):
    name: str
    truncate_size: int = 100


class MemoryOccupationRequest(ControlModel):
    tags: list[str] | None = None


class LoadLoRAAdapterRequest(ControlModel):
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterRequest(ControlModel):
    lora_name: str


class LoadLoRAAdapterFromTensorsRequest(ControlModel):
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str] | None = None  # one payload per server TP rank
    serialized_tensors: str | None = None  # older SGLang builds: one payload
    load_format: str | None = None
    pinned: bool = False

    def payloads(self) -> list[str]:
        if self.serialized_named_tensors is not None and self.serialized_tensors is None:
            return self.serialized_named_tensors
        if self.serialized_tensors is not None and self.serialized_named_tensors is None:
            return [self.serialized_tensors]
        raise InvalidRequest("give serialized_named_tensors (one payload per TP rank), or serialized_tensors")


@dataclass(slots=True)
class GenerateItem:
    """One sequence to generate, after batch and ``n`` expansion."""

    rid: str
    input_ids: list[int] | None
    text: str | None
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    return_text_in_logprobs: bool
    index: int
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # with return_logprob: these ids' log-probs at each position
    lora: str | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # the routes returned cover [this, prompt + completion - 1)
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str | None = None  # with a mask: "selected" (the default) or "support"


def _per_item(body: dict, key: str, default: Any, size: int, batched: bool) -> list[Any]:
    value = body.get(key)
    if value is None:
        return [default] * size
    if batched and isinstance(value, list) and key != "stop_token_ids":
        if len(value) != size:
            raise InvalidRequest(f"{key}: expected {size} entries (one per prompt), got {len(value)}")
        return value
    return [value] * size


MAX_TOP_LOGPROBS_NUM = 100  # alternatives per token: each costs a row of the answer for every token
MAX_TOKEN_IDS_LOGPROB = 100  # likewise the ids of token_ids_logprob


SAMPLING_LOGPROBS_MODES = ("selected", "support")
TOP_K_ALL = 1 << 30


def parse_generate(
    body: dict, max_items: int, max_prompt_tokens: int, mask_cap: int = 4096
) -> tuple[list[GenerateItem], bool, bool]:
    """Normalise a ``/generate`` body; return (items, is_single, stream).

    What the request would cost is bounded before it is paid for: more than ``max_items``
    sequences (prompts x n), a prompt of more than ``max_prompt_tokens`` ids, or more than
    ``MAX_TOP_LOGPROBS_NUM`` alternatives per token is refused, each checked before anything is
    looked at element by element. ``mask_cap``: the server's ``--sampling-mask-max-tokens``, which
    bounds the kept set a ``return_sampling_mask`` request may ask for (by its ``top_k``, as SGLang does).
    """
    for key in UNSUPPORTED_GENERATE_FIELDS:
        if body.get(key) not in (None, False):
            raise InvalidRequest(f"{key} is not supported by the embedded engine")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise InvalidRequest("Either text, input_ids or input_embeds should be provided.")
    if input_ids is not None:  # SGLang's precedence: input_ids over text
        text = None
    prompts: Any  # checked below: a list of prompts, each text or ids
    if text is not None:
        prompts = [text] if isinstance(text, str) else text
        batched = not isinstance(text, str)
    else:
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
    if not isinstance(prompts, list):
        raise FieldError("invalid type: text or input_ids must be a prompt or a list of them")
    size = len(prompts)
    if size == 0:
        raise InvalidRequest("The input is empty: give at least one prompt.")
    n = _n_of(body)
    if size * n > max_items:
        raise InvalidRequest(
            f"This request asks for {size * n} sequences ({size} prompts x n={n}); this server runs "
            f"and queues at most {max_items} (--max-running-requests + --max-queued-requests)."
        )
    if text is not None:
        if not all(isinstance(t, str) for t in prompts):
            raise FieldError("invalid type: text must be a string or a list of strings")
    else:
        for ids in prompts:
            if isinstance(ids, list) and len(ids) >= max_prompt_tokens:  # by its length, before any id is read
                raise InvalidRequest(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({max_prompt_tokens} tokens)."
                )
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise FieldError("invalid type: input_ids must be a list of ints or a list of lists of ints")
    params = [SamplingParams.parse(p) for p in _per_item(body, "sampling_params", {}, size, batched)]
    if len({p.n for p in params}) > 1:
        raise InvalidRequest("The parallel_sample_num should be the same for all samples in sample params.")
    rids = body.get("rid")
    if isinstance(rids, list):
        if len(rids) != size:
            raise InvalidRequest(f"rid: expected {size} entries (one per prompt), got {len(rids)}")
    elif rids is None:
        rids = [new_rid() for _ in range(size)]
    elif isinstance(rids, str):
        rids = [f"{rids}_{i}" for i in range(size)] if batched else [rids]
    else:
        raise FieldError("invalid type: rid must be a string or a list of strings")
    logprob = _per_item(body, "return_logprob", False, size, batched)
    start = _per_item(body, "logprob_start_len", -1, size, batched)
    if not all(isinstance(k, int) and not isinstance(k, bool) for k in start):
        raise FieldError("invalid type: logprob_start_len must be an integer, or a list of them per prompt")
    if any(k < -1 for k in start):  # real SGLang's server dies on one
        raise InvalidRequest(f"logprob_start_len must be -1 (no prompt log-probs) or at least 0, got {min(start)}.")
    top = _per_item(body, "top_logprobs_num", 0, size, batched)
    if not all(isinstance(k, int) and not isinstance(k, bool) and k <= MAX_TOP_LOGPROBS_NUM for k in top):
        raise InvalidRequest(f"top_logprobs_num must be an integer of at most {MAX_TOP_LOGPROBS_NUM}")
    top = [max(k, 0) for k in top]  # SGLang returns no alternatives for a negative count
    token_ids = _token_ids_logprob(body.get("token_ids_logprob"), size, n)
    routed = _per_item(body, "return_routed_experts", False, size, batched)
    routed_from = _per_item(body, "routed_experts_start_len", 0, size, batched)
    for i, first in enumerate(routed_from):
        bound = len(prompts[i]) if text is None else None  # a text prompt's length is known once tokenized
        if not isinstance(first, int) or isinstance(first, bool) or first < 0 or (bound is not None and first > bound):
            raise InvalidRequest(
                f"routed_experts_start_len must be an integer in [0, prompt tokens"
                f"{f' = {bound}' if bound is not None else ''}], got {first!r}"
            )
    masks = _per_item(body, "return_sampling_mask", False, size, batched)
    modes = _per_item(body, "sampling_logprobs_mode", None, size, batched)
    for mask, mode, sampling in zip(masks, modes, params):
        if mode is not None and mode not in SAMPLING_LOGPROBS_MODES:
            raise FieldError(f"sampling_logprobs_mode: expected one of {list(SAMPLING_LOGPROBS_MODES)}, got {mode!r}")
        if mode is not None and not mask:
            raise InvalidRequest("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
        # SGLang's normalised top_k: 1 for a greedy request, 1 << 30 (its "whole vocabulary") for -1
        top_k = 1 if sampling.greedy else TOP_K_ALL if sampling.top_k == -1 else sampling.top_k
        if mask and top_k != 1 and not 1 < top_k <= mask_cap:
            raise InvalidRequest(
                f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
                f"{mask_cap}; got top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens."
            )
    loras = _per_item(body, "lora_path", None, size, batched)
    if not all(lora is None or isinstance(lora, str) for lora in loras):
        raise FieldError("invalid type: lora_path must be an adapter name, or a list of them (null: the base model)")
    items: list[GenerateItem] = []
    for i in range(size):
        for _ in range(n):
            # Like SGLang, each of n > 1 samples gets a fresh rid (abort them with abort_all).
            rid = rids[i] if n == 1 else new_rid()
            items.append(
                GenerateItem(
                    rid=str(rid),
                    text=prompts[i] if text is not None else None,
                    input_ids=None if text is not None else list(prompts[i]),
                    params=params[i],
                    return_logprob=bool(logprob[i]),
                    logprob_start_len=int(start[i]),
                    top_logprobs_num=int(top[i]),
                    token_ids_logprob=token_ids[i],
                    return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                    index=len(items),
                    lora=loras[i],
                    return_routed_experts=bool(routed[i]),
                    routed_experts_start_len=routed_from[i],
                    return_sampling_mask=bool(masks[i]),
                    sampling_logprobs_mode=modes[i],
                )
            )
    return items, not batched and n == 1, bool(body.get("stream", False))


def _token_ids_logprob(value: Any, size: int, n: int) -> list[list[int] | None]:
    """Each prompt's ``token_ids_logprob``, normalised as SGLang does: one id or one list of them for
    every prompt, or a list per prompt (not with ``n > 1``); empty is none."""
    if not value:
        return [None] * size
    if not isinstance(value, list):
        value = [value]
    if isinstance(value[0], list):
        if n > 1:
            raise InvalidRequest("Cannot use list token_ids_logprob with parallel_sample_num > 1")
        if len(value) != size:
            raise InvalidRequest(f"token_ids_logprob: expected {size} entries (one per prompt), got {len(value)}")
    else:
        value = [value] * size
    for ids in value:
        if ids is not None and not (
            isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise FieldError("invalid type: token_ids_logprob must be token ids, or a list of them per prompt")
        if ids is not None and len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise InvalidRequest(f"token_ids_logprob must name at most {MAX_TOKEN_IDS_LOGPROB} ids, got {len(ids)}")
    return [list(ids) if ids else None for ids in value]


def _n_of(body: dict) -> int:
    """The ``n`` a request asks for, read before its sampling parameters are parsed (a batch has one n)."""
    params = body.get("sampling_params")
    first = params[0] if isinstance(params, list) and params else params
    n = first.get("n", 1) if isinstance(first, dict) else 1
    if not isinstance(n, int) or isinstance(n, bool):
        raise InvalidRequest(f"n must be an integer, got {n!r}")
    return max(n, 1)


def _triples(logprobs: list, ids: list[int], texts: list[str | None]) -> list[list]:
    return [[lp, tid, text] for lp, tid, text in zip(logprobs, ids, texts)]


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """``[{version, start, end}]`` output-token ranges per weight version."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def generate_response(req: Request, item: GenerateItem, n: int, tokenizer, current_version: str) -> dict[str, Any]:
    """SGLang's response object for the first ``n`` output tokens of ``req``."""
    ids = req.output_ids[:n]
    done = req.finished and n == len(req.output_ids)
    reason = req.finish_reason if done else None
    keep_stop = item.params.no_stop_trim
    shown = (
        ids[:-1]
        if reason and reason["type"] == "stop" and isinstance(reason["matched"], int) and not keep_stop
        else ids
    )
    text = tokenizer.decode(shown, skip_special_tokens=item.params.skip_special_tokens)
    if reason and reason["type"] == "stop" and isinstance(reason["matched"], str) and not keep_stop:
        text = text[: text.find(reason["matched"])] if reason["matched"] in text else text
    versions = req.output_versions[:n]
    # SGLang's count: its radix cache always leaves a prompt's last token to compute; a fork (the
    # engine held that token's state too) reports the same (inverted:prefill_tokens_total shows the difference)
    cached = min(req.cached_tokens, len(req.input_ids) - 1)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(ids),
        "cached_tokens": cached,
        "cached_tokens_details": {"device": cached, "host": 0} if cached else None,
        "weight_version": versions[-1] if versions else current_version,
        "num_retractions": req.retractions,
        "reasoning_tokens": 0,  # SGLang counts them only behind a server-side reasoning parser
        "dp_rank": None,
    }
    # SGLang reports the spans once a request is done; mid-stream too where they differ (our addition)
    if done or len(set(versions)) > 1:
        meta["weight_versions"] = version_spans(versions) or [{"version": current_version, "start": 0, "end": 0}]
    if item.return_logprob:
        out_texts = [tokenizer.decode([t]) if item.return_text_in_logprobs else None for t in ids]
        meta["output_token_logprobs"] = _triples(req.output_logprobs[:n], ids, out_texts)
        meta["output_token_logprobs_length"] = len(ids)
        if req.matcher is not None:  # our addition to SGLang's answer (engine/grammar.py)
            meta["output_token_unconstrained_logprobs"] = req.output_unconstrained_logprobs[:n]
        start = max(item.logprob_start_len, 0)
        in_ids = req.input_ids[start:] if item.logprob_start_len >= 0 else []
        in_texts = [tokenizer.decode([t]) if item.return_text_in_logprobs else None for t in in_ids]
        meta["input_token_logprobs"] = _triples(req.input_logprobs, in_ids, in_texts)

        def rows_of(rows: list) -> list:
            return [
                None
                if row is None
                else [[lp, tid, tokenizer.decode([tid]) if item.return_text_in_logprobs else None] for lp, tid in row]
                for row in rows
            ]

        if item.top_logprobs_num:
            meta["output_top_logprobs"] = rows_of(req.output_top_logprobs[:n])
            meta["input_top_logprobs"] = rows_of(req.input_top_logprobs)
        if item.token_ids_logprob is not None:
            meta["output_token_ids_logprobs"] = rows_of(req.output_token_ids_logprobs[:n])
            meta["input_token_ids_logprobs"] = rows_of(req.input_token_ids_logprobs)
    if item.return_sampling_mask:  # SGLang's: each output token's kept set, and its renormalised log-prob(s)
        kept = req.output_kept[:n]
        meta["output_token_sampling_mask"] = [row.ids for row in kept]
        meta["output_token_sampling_logprobs"] = [
            row.logprobs if item.sampling_logprobs_mode == "support" else row.selected for row in kept
        ]
        meta["output_token_sampling_mask_length"] = len(kept)
    if done and item.return_routed_experts and req.routed_experts is not None:
        # [start, prompt + completion - 1): every token the model ran (the last sampled one never ran)
        meta["routed_experts"] = encode_routed_experts(req.routed_experts[item.routed_experts_start_len :])
    if done and req.finished_at is not None:
        meta["e2e_latency"] = req.finished_at - req.created
        meta["response_sent_to_client_ts"] = time.time()
    return {"text": text, "output_ids": ids, "meta_info": meta}


# Routes whose refusals SGLang answers as ``{"success": false, "message"}`` (with these extra fields),
# and those it answers in plain text; every other route answers ``{"error": {"message"}}``.
SUCCESS_FLAG_ROUTES: dict[str, dict[str, Any]] = {
    "/update_weights_from_disk": {"num_paused_requests": 0},
    "/update_weights_from_tensor": {},
    "/update_weights_from_distributed": {},
    "/init_weights_update_group": {},
    "/destroy_weights_update_group": {},
    "/begin_weight_update": {},
    "/end_weight_update": {},
}
PLAIN_TEXT_ROUTES = ("/flush_cache",)
LORA_ROUTES = ("/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_tensors")


def refusal(path: str, message: str) -> dict[str, Any] | str:
    """The body SGLang answers a refused request on ``path`` with (status 400)."""
    if path in SUCCESS_FLAG_ROUTES:
        return {"success": False, "message": message, **SUCCESS_FLAG_ROUTES[path]}
    if path in PLAIN_TEXT_ROUTES:
        return f"{message}\n"
    if path in LORA_ROUTES:  # SGLang's LoRAUpdateOutput; the server adds loaded_adapters
        return {"success": False, "error_message": message}
    return {"error": {"message": message}}


def error_body(message: str, code: int = 400) -> dict[str, Any]:
    """SGLang's validation/HTTPException shape (also used for 401 and 404)."""
    kind = "Bad Request" if code == 400 else str(code)
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}
