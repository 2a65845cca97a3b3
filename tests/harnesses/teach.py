"""Teach a tiny checkpoint to answer a long prompt with a chosen reply, in seconds on a CPU.

A harness's first prompt runs to 30,000 tokens. Fine-tuning every weight on it would cost a full
forward and backward over all of them per step. Instead, only what reads the prompt's last
position is trained: the last layer's query and output projections, its MLP and norms, and the
final norm. Every key and value of the prompt is then fixed, so the prompt is run once, its cache
kept (across calls too: a harness's later stages are taught with its earlier prompts), and each step
runs the reply's few tokens against it. Teaching stops when every reply token is its position's most
likely by a wide margin (``MARGIN``), so greedy decoding yields the reply exactly.

Test scaffolding, like ``tests/rollout/proxy/scripted.py``: the harness runs unchanged, and the
model it talks to has been shown what to say.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TRAINED = ("self_attn.q_proj", "self_attn.o_proj", "mlp.", "post_attention_layernorm")
MARGIN = 0.9  # each reply token's probability when teaching stops: far above any other's, past fp32 rounding
_PROMPTS: dict[tuple[str, tuple[int, ...]], Any] = {}  # (base, prompt ids) -> its cache, which teaching never changes


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters no key or value of the prompt depends on (see the module docstring)."""
    last = len(model.model.layers) - 1
    chosen = []
    for name, param in model.named_parameters():
        take = name.startswith("model.norm.") or (
            name.startswith(f"model.layers.{last}.") and any(part in name for part in TRAINED)
        )
        param.requires_grad_(take)
        if take:
            chosen.append(param)
    return chosen


def prompt_cache(model: torch.nn.Module, base: Path, prompt: list[int]) -> Any:
    """The cache of ``prompt`` but its last id, computed once per base model (no trained weight reaches it)."""
    key = (str(base), tuple(prompt))
    if key not in _PROMPTS:
        with torch.no_grad():
            _PROMPTS[key] = model(torch.tensor([prompt[:-1]]), use_cache=True).past_key_values
    return _PROMPTS[key]


def teach(base: Path, out: Path, examples: list[tuple[list[int], list[int]]], steps: int = 400) -> Path:
    """Fine-tune ``base`` so that each ``(prompt_ids, reply_ids)`` greedy-decodes its reply; save to ``out``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    params = trainable(model)
    caches = [prompt_cache(model, base, prompt) for prompt, _ in examples]
    optimizer = torch.optim.Adam(params, lr=3e-2)
    for _ in range(steps):
        loss, least = torch.zeros(()), 1.0
        for (prompt, reply), cache in zip(examples, caches):
            ids = torch.tensor([prompt[-1:] + reply[:-1]])
            logits = model(ids, cache=copy.deepcopy(cache), use_cache=True).logits[0]
            logprobs = logits.log_softmax(-1).gather(1, torch.tensor(reply)[:, None])
            loss = loss - logprobs.mean()
            least = min(least, logprobs.min().exp().item())
        if least >= MARGIN:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"{steps} steps taught a reply token only to probability {least:.3f} < {MARGIN}")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out
