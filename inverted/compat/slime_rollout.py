"""slime's rollout-side modules on inverted: its default generate and reward path, its rule-based
reward models, its SFT rollout, loss masks and tokenizer helpers, under its own module paths.

What slime's own plug-ins and examples import from these pure-Python modules, with slime's
signatures and behaviour, written here (``compat.modules`` puts them under slime's paths):

- ``slime.rollout.sglang_rollout``: ``generate`` (one ``/generate`` call through the job's router,
  the answer appended with ``Sample.append_response_tokens``), ``generate_and_rm`` (the custom
  generate function if one is set, then the reward) and ``generate_and_rm_group``.
- ``slime.rollout.rm_hub``: ``async_rm`` (``--custom-rm-path``, else ``--rm-type``: ``math``,
  ``deepscaler``, ``dapo``, ``f1``, ``gpqa``, ``random``, ``remote_rm`` at ``--rm-url``, each with a
  ``boxed_`` form), ``batched_async_rm``, and the graders by their names. The math graders decide
  equality with ``math-verify`` rather than slime's own normaliser, so a few exotic answers may
  grade differently; ``ifbench`` needs IFBench's instruction registry and is refused.
- ``slime.utils.mask_utils``: ``MultiTurnLossMaskGenerator`` and ``get_response_lengths``: a
  conversation's chat-template tokens, with 1 on what each assistant message says.
- ``slime.rollout.sft_rollout``: ``generate_rollout`` fills Samples from conversations, which
  ``--loss-type sft_loss`` trains on (``compat.slime.to_inverted`` takes them without logprobs).
- ``slime.utils.processing_utils``: ``load_tokenizer``, ``load_processor`` (None: text models
  only), ``build_processor_kwargs``.
- ``slime.utils.async_utils.run``, ``slime.utils.http_utils.get_rollout_num_engines``, and
  ``slime.observability.trace_utils``'s tracing, which has no effect here (the proxy and the Data
  Buffer record every call and Sample).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import random
import re
import string
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from inverted.compat import slime

logger = logging.getLogger(__name__)


# -- slime.rollout.sglang_rollout -------------------------------------------------------------------


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """slime's default generate: the prompt's tokens (its chat template's, for a message list) to the
    router's ``/generate``, the answer appended with its logprobs and ``meta_info``."""
    state = slime.GenerateState(args)
    params = dict(sampling_params)
    params["max_new_tokens"] -= sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = sample.Status.TRUNCATED
        return sample
    if isinstance(sample.prompt, str):
        prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = state.tokenizer.apply_chat_template(
            sample.prompt,
            tools=sample.metadata.get("tools"),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    payload = {"input_ids": list(sample.tokens), "sampling_params": params, "return_logprob": True}
    output = await slime.post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate", payload)
    pairs = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(
        args,
        tokens=[token for _, token, *_ in pairs],
        log_probs=[lp for lp, *_ in pairs],
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return sample


async def generate_and_rm(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime's: generate (with ``--custom-generate-function-path`` if set), then the reward unless
    ``--group-rm`` leaves it to the group."""
    if sample.status in (sample.Status.COMPLETED, sample.Status.TRUNCATED):
        return sample
    state = slime.GenerateState(args)
    async with state.semaphore:
        path = getattr(sample, "generate_function_path", None) or args.custom_generate_function_path
        if path:
            fn = slime.load_function(path.replace(":", "."))
            extra = {"evaluation": evaluation} if "evaluation" in inspect.signature(fn).parameters else {}
            sample = await fn(args, sample, sampling_params, **extra)
        else:
            sample = await generate(args, sample, sampling_params)
    if args.group_rm:
        return sample
    samples = sample if isinstance(sample, list) else [sample]
    todo = [s for s in samples if s.reward is None and s.status != s.Status.ABORTED]
    for item, reward in zip(todo, await batched_async_rm(args, todo)):
        item.reward = reward
    return sample


async def generate_and_rm_group(
    args: Any, group: list[Any], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    """slime's: every Sample of the group at once (each with a session id), then ``--group-rm``'s reward."""
    for sample in group:
        sample.session_id = sample.session_id or str(uuid.uuid4())
    group = list(await asyncio.gather(*(generate_and_rm(args, s, dict(sampling_params), evaluation) for s in group)))
    if args.group_rm:
        for sample, reward in zip(group, await batched_async_rm(args, group)):
            sample.reward = reward
    return group


# -- slime.rollout.rm_hub ---------------------------------------------------------------------------


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """slime's reward dispatch: the Sample's or the job's ``--custom-rm-path``, else ``--rm-type``
    (the Sample's ``metadata["rm_type"]`` first)."""
    path = getattr(sample, "custom_rm_path", None) or args.custom_rm_path
    custom = slime.load_function(path.replace(":", ".")) if path else None
    if custom is not None and custom is not async_rm:  # --rm-type makes async_rm itself the job's reward model
        return await custom(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    response, label = sample.response, sample.label
    if rm_type.startswith("boxed_"):
        response, rm_type = extract_boxed_answer(response) or "", rm_type[len("boxed_") :]
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    graders = {
        "deepscaler": lambda: get_deepscaler_rule_based_reward(response, label),
        "dapo": lambda: compute_score_dapo(response, label),
        "math": lambda: 1 if grade_answer_verl(response, label) else 0,
        "f1": lambda: f1_score(response, label)[0],
        "gpqa": lambda: compute_gpqa_reward(response, label, metadata=metadata),
        "random": lambda: random.randint(0, 1),
    }
    if rm_type == "ifbench":
        raise NotImplementedError(
            "rm_type ifbench needs IFBench's instruction registry, which inverted does not "
            "ship: grade it in --custom-rm-path"
        )
    if rm_type not in graders:
        raise NotImplementedError(
            f"Rule-based RM for {rm_type!r} is not implemented." if rm_type else "Rule-based RM type is not specified."
        )
    return graders[rm_type]()


async def batched_async_rm(args: Any, samples: list[Any], **kwargs: Any) -> list[Any]:
    """slime's: ``--custom-rm-path`` on the whole list (a group reward model), else ``async_rm`` each."""
    if args.custom_rm_path and args.group_rm:
        return await slime.load_function(args.custom_rm_path.replace(":", "."))(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))


async def remote_rm(args: Any, sample: Any, max_retries: int = 10) -> Any:
    """slime's: POST ``{prompt, response, label}`` to ``--rm-url``, the JSON answer is the reward."""
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await slime.post(args.rm_url, payload, max_retries=max_retries)


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):  # \boxed 5
        return text[start + len("\\boxed ") :].split("$")[0].strip()
    opening = text.find("{", start)
    if opening < 0:
        return None
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[opening + 1 : i]
    return None


def _equal(answer: str, truth: str) -> bool:
    """Whether two final answers are the same mathematical object (math-verify, in LaTeX or plain)."""
    from math_verify import parse, verify

    if answer.strip() == truth.strip():
        return True
    wrap = lambda text: text if "$" in text or "\\boxed" in text else f"${text}$"  # noqa: E731
    try:
        return bool(verify(parse(wrap(truth)), parse(wrap(answer))))
    except Exception:  # noqa: BLE001 - an answer that does not parse is not equal
        return False


def grade_answer_verl(solution: str, ground_truth: Any) -> bool:
    """slime's ``math`` grader: the solution's last boxed answer equals the label (its boxed answer, if any)."""
    answer = extract_boxed_answer(solution or "")
    truth = str(ground_truth)
    truth = extract_boxed_answer(truth) or truth if "\\boxed" in truth else truth
    return answer is not None and bool(truth) and _equal(answer, truth)


def get_deepscaler_rule_based_reward(response: str, label: Any) -> int:
    """slime's ``deepscaler`` grader: the boxed answer after ``</think>`` (or ``###Response``) equals the label."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    return 1 if label != "" and grade_answer_verl(solution, label) else 0


def compute_score_dapo(
    solution_str: str, ground_truth: str, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> dict[str, Any]:
    """slime's ``dapo`` grader: the answer after the last ``Answer:`` in the last 300 characters (or the
    last boxed one with ``strict_box_verify``); ``{"score": 1.0 or -1.0, "acc", "pred"}``."""
    tail = solution_str[-300:]
    if strict_box_verify:
        pred = extract_boxed_answer(tail) or ""
    else:
        found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", tail)
        pred = found[-1].strip().rstrip(".") if found else ""
    correct = bool(pred) and _equal(pred, str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    """slime's ``f1`` grader (SQuAD's): token F1 after normalising; ``(f1, precision, recall)``."""
    if prediction is None:
        return (0, 0, 0)
    pred, truth = normalize(prediction), normalize(ground_truth)
    if {pred, truth} & {"yes", "no", "noanswer"} and pred != truth:
        return (0, 0, 0)
    common = sum((Counter(pred.split()) & Counter(truth.split())).values())
    if not common:
        return (0, 0, 0)
    precision, recall = common / len(pred.split()), common / len(truth.split())
    return (2 * precision * recall / (precision + recall), precision, recall)


def compute_gpqa_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """slime's ``gpqa`` grader: the choice letter the response ends on (after any ``</think>``) is the
    label's (a letter, or the text of one of ``metadata["choices"]``)."""
    response = response.rsplit("</think>", 1)[-1] if "</think>" in response else response
    choices = list((metadata or {}).get("choices") or [])
    letters = [chr(ord("A") + i) for i in range(max(len(choices), 4))]
    found = re.findall(r"(?:answer\s*(?:is|:)?\s*\(?|\(|\b)([A-Z])\b\)?", response, flags=re.IGNORECASE)
    letter = next((f.upper() for f in reversed(found) if f.upper() in letters), None)
    truth = str(label).strip()
    if truth.upper() in letters:
        return 1.0 if letter == truth.upper() else 0.0
    texts = [normalize(str(c)) for c in choices]
    return (
        1.0
        if letter is not None and normalize(truth) in texts and letters[texts.index(normalize(truth))] == letter
        else 0.0
    )


# -- slime.utils.mask_utils -------------------------------------------------------------------------


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """slime's: each mask's length from its first 1 to its end (0 for a mask of no 1)."""
    return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]


class MultiTurnLossMaskGenerator:
    """slime's loss masks for a conversation: its chat-template tokens, 1 on what each assistant message
    says (its end token included, its role header not), 0 elsewhere and where ``step_loss_mask`` is 0.

    Each message's tokens are what rendering the conversation up to it adds to rendering it up to the
    one before, so any template that renders conversations as growing prefixes works (slime's
    ``qwen`` / ``qwen3`` / ``qwen3_5`` types; a template that rewrites earlier turns is refused).
    ``distill_qwen`` is slime's prompt-then-answer form.
    """

    TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")

    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen") -> None:
        if tokenizer_type not in self.TYPES:
            raise ValueError(f"Unsupported tokenizer type: {tokenizer_type}")
        self.tokenizer, self.tokenizer_type = tokenizer, tokenizer_type

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    def _ids(self, messages: list[dict], tools: list[dict] | None, generation: bool = False) -> list[int]:
        if not messages:
            return []
        return list(
            self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=generation
            )
        )

    def get_loss_mask(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        if self.tokenizer_type == "distill_qwen":
            return self._distill(messages, tools)
        ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            upto = self._ids(messages[: i + 1], tools)
            if upto[: len(ids)] != ids:
                raise ValueError(
                    f"the chat template renders messages[:{i + 1}] with different tokens before message "
                    f"{i} than messages[:{i}]: per-message loss masks need a prefix-preserving template"
                )
            added = upto[len(ids) :]
            if message["role"] == "assistant" and message.get("step_loss_mask", 1) == 1:
                header = len(self._ids(messages[:i], tools, generation=True)) - len(ids) if i else 0
                mask += [0] * header + [1] * (len(added) - header)
            else:
                mask += [0] * len(added)
            ids = upto
        return ids, mask

    def _distill(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        prompt = self.tokenizer.apply_chat_template(
            messages[:1], tokenize=False, add_generation_prompt=True, tools=tools
        )
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        trained = 1 if messages[-1].get("step_loss_mask", 1) == 1 else 0
        return prompt_ids + answer_ids, [0] * len(prompt_ids) + [trained] * len(answer_ids)

    def get_text_from_loss_mask(self, token_ids: list[int], loss_masks: list[int]) -> list[str]:
        """The text of each run of trained tokens."""
        runs, current = [], []
        for token, trained in zip(token_ids, loss_masks):
            if trained:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        return [self.tokenizer.decode(run) for run in runs + ([current] if current else [])]


# -- slime.rollout.sft_rollout and slime.utils.processing_utils ------------------------------------


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs: Any) -> None:
    """slime's: the model's multimodal processor; None here, where models are text only."""
    return None


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """slime's processor keyword arguments: token ids as lists, each modality's as tensors."""
    result = dict(multimodal_inputs or {})
    result["text_kwargs"] = {**result.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": False}
    for key in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        result[key] = {**result.get(key, {}), "return_tensors": "pt"}
    return result


def sft_generate_rollout(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> list[list[Any]]:
    """slime's ``sft_rollout.generate_rollout``: each prompt (a conversation) becomes its chat-template
    tokens with ``MultiTurnLossMaskGenerator``'s mask, reward 0."""
    assert not evaluation
    masks = MultiTurnLossMaskGenerator(slime.GenerateState(args).tokenizer, tokenizer_type=args.loss_mask_type)
    groups = data_buffer.get_samples(args.rollout_batch_size)
    for group in groups:
        (sample,) = group
        token_ids, loss_mask = masks.get_loss_mask(sample.prompt, tools=sample.metadata.get("tools"))
        sample.response_length = masks.get_response_lengths([loss_mask])[0]
        sample.tokens, sample.reward = token_ids, 0
        sample.loss_mask = loss_mask[len(loss_mask) - sample.response_length :]
    return groups


def encode_image_for_rollout_engine(image: Any) -> str:
    raise NotImplementedError("images: inverted trains text models only")


def prepare_prompt_ids(sample: Any, tokenizer: Any, processor: Any) -> list[int]:
    """slime's: the tokens a Sample already has, else its (text) prompt's."""
    return list(sample.tokens) if sample.tokens else tokenizer.encode(sample.prompt, add_special_tokens=False)


# -- slime.utils.async_utils, slime.utils.http_utils' engine count, slime.observability.trace_utils ----


class _LoopThread:
    """One event loop on a daemon thread, for synchronous code that runs coroutines (slime's ``run``)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="slime-async-loop").start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


@functools.cache
def get_async_loop() -> _LoopThread:
    return _LoopThread()


def run(coro: Any) -> Any:
    """slime's ``async_utils.run``: run a coroutine on the background loop and wait for it."""
    return get_async_loop().run(coro)


def get_rollout_num_engines(args: Any) -> int:
    """slime's: the rollout servers behind the router (``--num-engines`` here, where servers need no GPU)."""
    if getattr(args, "rollout_num_engines", None) is not None:
        return int(args.rollout_num_engines)
    gpus = getattr(args, "rollout_num_gpus", 0) or 0
    if gpus > 0:
        return max(1, gpus // (getattr(args, "rollout_num_gpus_per_engine", 1) or 1))
    return int(getattr(args, "num_engines", 0) or 0)


class _Span:
    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextlib.contextmanager
def trace_span(*args: Any, **kwargs: Any) -> Iterator[_Span]:
    """slime's rollout tracing: no effect here (the proxy and the Data Buffer record each call)."""
    yield _Span()


def trace_function(*args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return lambda fn: fn


def trace_event(*args: Any, **kwargs: Any) -> None:
    pass


def build_sglang_meta_trace_attrs(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason") if k in meta}
