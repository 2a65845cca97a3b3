"""Constrained decoding: SGLang's ``json_schema`` and ``regex`` sampling parameters, with llguidance.

SGLang serves ``response_format`` this way (one of its grammar backends is llguidance). Each
constrained request owns a matcher; before every sampling step the matcher says which tokens may
come next, and the others get logit ``-inf`` (as stop tokens do before ``min_new_tokens``). The
logprob returned is therefore the constrained distribution's, as SGLang returns it. Once the
grammar is complete only the end-of-sequence token is allowed, so the request ends as usual.

A constrained request that is resumed after an abort (partial rollout) would restart its grammar
mid-answer; the proxy samples such calls again instead (``rollout/proxy/generation.py``).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from inverted.errors import InvalidRequest


class Grammars:
    """Compiles the constraints of requests against one tokenizer and vocabulary (the server's part;
    the scheduler applies the matchers with ``mask`` and ``advance``)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        import llguidance.hf

        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def matcher(self, json_schema: str | None, regex: str | None) -> Any | None:
        """A fresh matcher for a request's constraint (None without one); a bad one is an ``InvalidRequest``."""
        import llguidance

        if json_schema is None and regex is None:
            return None
        if json_schema is not None and regex is not None:
            raise InvalidRequest("only one of json_schema and regex may constrain a request")
        if json_schema is not None:
            try:
                schema = json.loads(json_schema)
            except ValueError as exc:
                raise InvalidRequest(f"json_schema is not JSON: {exc}") from None
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(regex)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidRequest(f"the {'json_schema' if json_schema is not None else 'regex'} cannot be compiled: "
                                 f"{error.strip()[:500]}")
        return llguidance.LLMatcher(self.info, grammar)


def mask(logits_BV: torch.Tensor, matchers: list[Any | None]) -> None:
    """Set the logits of the tokens each row's matcher forbids to ``-inf``, in place (rows without one: as they are)."""
    import llguidance.torch

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), logits_BV.shape[-1])
    for j, i in enumerate(rows):
        llguidance.torch.fill_next_token_bitmask(matchers[i], bitmask, j)
    constrained = logits_BV[rows]
    llguidance.torch.apply_token_bitmask_inplace(constrained, bitmask)
    logits_BV[rows] = constrained


def advance(matcher: Any, token: int) -> None:
    """The sampled token, into its request's matcher."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused token {token} it allowed: {matcher.get_error()}")
