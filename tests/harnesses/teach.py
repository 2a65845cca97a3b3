"""Teach a tiny checkpoint to answer a long prompt with a chosen reply, in seconds on a CPU.

A harness's first prompt runs to 30,000 tokens. Fine-tuning every weight on it would cost a full
forward and backward over all of them per step. Instead, only what reads the prompt's last
position is trained: the last layer's query and output projections, its MLP and norms, and the
final norm. Every key and value of the prompt is then fixed, so the prompt is run once, its cache
kept, and each step runs the reply's few tokens against it. The reply's tokens come out of greedy
decoding afterwards exactly (the loss is driven below 1e-3 per token).

Test scaffolding, like ``tests/rollout/proxy/scripted.py``: the harness runs unchanged, and the
model it talks to has been shown what to say.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TRAINED = ("self_attn.q_proj", "self_attn.o_proj", "mlp.", "post_attention_layernorm")


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters no key or value of the prompt depends on (see the module docstring)."""
    last = len(model.model.layers) - 1
    chosen = []
    for name, param in model.named_parameters():
        take = name.startswith("model.norm.") or (
            name.startswith(f"model.layers.{last}.") and any(part in name for part in TRAINED))
        param.requires_grad_(take)
        if take:
            chosen.append(param)
    return chosen


def teach(base: Path, out: Path, examples: list[tuple[list[int], list[int]]], steps: int = 400) -> Path:
    """Fine-tune ``base`` so that each ``(prompt_ids, reply_ids)`` greedy-decodes its reply; save to ``out``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    params = trainable(model)
    caches = []
    with torch.no_grad():
        for prompt, _ in examples:
            caches.append(model(torch.tensor([prompt[:-1]]), use_cache=True).past_key_values)
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        loss = torch.zeros(())
        for (prompt, reply), cache in zip(examples, caches):
            ids = torch.tensor([prompt[-1:] + reply[:-1]])
            logits = model(ids, cache=copy.deepcopy(cache), use_cache=True).logits[0]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(reply))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() / len(examples) < 1e-3:
            break
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out
