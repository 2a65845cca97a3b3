"""Constrained decoding: SGLang's ``json_schema`` and ``regex`` sampling parameters, with llguidance.

SGLang serves ``response_format`` this way (one of its grammar backends is llguidance). Each
constrained request owns a matcher; before every sampling step the matcher says which tokens may
come next, and the others get logit ``-inf`` (as stop tokens do before ``min_new_tokens``). The
logprob returned is therefore the constrained distribution's, as SGLang returns it. Once the
grammar is complete only the end-of-sequence token is allowed, so the request ends as usual.

That logprob is not the policy's: a token the grammar forces has logprob ~0 under the mask where
the policy may give it -15, and a trainer comparing it with its own would see an importance ratio
of e^15. So the engine also reports, for a constrained request, each sampled token's logprob
under the unmasked distribution at the request's temperature (``unconstrained_logprobs``), as
``meta_info.output_token_unconstrained_logprobs`` beside SGLang's ``output_token_logprobs``; the
proxy records that one (``--proxy-constrained-tokens``). Real SGLang has no such field, so there
the proxy keeps constrained tokens out of the loss instead.

Compiling a grammar is CPU work that grows with the schema (seconds for a large one) and the
first needs the vocabulary's token trie (tens of seconds on a large vocabulary): both run on a
worker thread (``Grammars.matcher`` is called off the event loop), and each compiled grammar is
kept (``CACHE_SIZE``, least recently used first out): a request gets a copy of a fresh matcher,
so ``n`` samples of one schema, or an agent's every call with the same one, compile it once.

A constrained request that is resumed after an abort (partial rollout) would restart its grammar
mid-answer; the proxy samples such calls again instead (``rollout/proxy/generation.py``).
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

import torch

from inverted.engine.sampling import temperatures
from inverted.errors import InvalidRequest

CACHE_SIZE = 64  # compiled grammars kept per engine


class Grammars:
    """Compiles the constraints of requests against one tokenizer and vocabulary (the server's part;
    the scheduler applies the matchers with ``mask`` and ``advance``)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        import llguidance.hf

        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._compiled: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (not found in the cache)

    def matcher(self, json_schema: str | None, regex: str | None) -> Any | None:
        """A fresh matcher for a request's constraint (None without one); a bad one is an ``InvalidRequest``.
        CPU work: call it off the event loop."""
        if json_schema is not None and regex is not None:
            raise InvalidRequest("only one of json_schema and regex may constrain a request")
        if json_schema is not None:
            key = ("json_schema", json_schema)
        elif regex is not None:
            key = ("regex", regex)
        else:
            return None
        with self._lock:
            fresh = self._compiled.get(key)
            if fresh is not None:
                self._compiled.move_to_end(key)
        if fresh is None:
            fresh = self._compile(*key)
            with self._lock:
                self._compiled[key] = fresh
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return fresh.deep_copy()

    def _compile(self, kind: str, source: str) -> Any:
        import llguidance

        self.compiles += 1
        if kind == "json_schema":
            try:
                schema = json.loads(source)
            except ValueError as exc:
                raise InvalidRequest(f"Failed to compile json grammar: {exc}") from None  # SGLang's words
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidRequest(
                f"Failed to compile {'json' if kind == 'json_schema' else 'regex'} grammar: {error.strip()[:500]}"
            )
        return llguidance.LLMatcher(self.info, grammar)


def unconstrained_logprobs(logits_RV: torch.Tensor, tokens: list[int], params: list[Any]) -> list[float]:
    """Each row's token's logprob under its unmasked logits, at its temperature (as ``sampling.sample``
    scales them: greedy rows at 1)."""
    temps = temperatures(params, logits_RV.device)
    logprobs_RV = torch.log_softmax(logits_RV / temps[:, None], dim=-1)
    return logprobs_RV.gather(1, torch.tensor(tokens, device=logits_RV.device)[:, None])[:, 0].tolist()


def mask(logits_BV: torch.Tensor, matchers: list[Any | None]) -> None:
    """Set the logits of the tokens each row's matcher forbids to ``-inf``, in place (rows without one: as they are)."""
    import llguidance.torch

    live = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if not live:
        return
    rows = [i for i, _ in live]
    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), logits_BV.shape[-1])
    for j, (_, matcher) in enumerate(live):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, j)
    constrained = logits_BV[rows]
    llguidance.torch.apply_token_bitmask_inplace(constrained, bitmask)
    logits_BV[rows] = constrained


def advance(matcher: Any, token: int) -> None:
    """The sampled token, into its request's matcher."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused token {token} it allowed: {matcher.get_error()}")
