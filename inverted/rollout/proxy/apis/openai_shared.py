"""What OpenAI's three APIs share: how an unknown field is refused, the error body, token logprobs,
usage and the end of a stream.

Agents built with any SDK must work unchanged, and nothing may silently change what is sampled.
So every request field falls in one of four classes, declared by each API module:

- **implemented**: mapped onto SGLang sampling parameters or served by the proxy;
- **accepted with a reason** (``REASONS``): the field asks something of the hosted service that
  does not change what this policy samples (``user``, ``service_tier``, ``prompt_cache_key``,
  a verbosity hint, ...), or that this server cannot do and whose absence is what happens anyway;
  the reason is recorded on the turn (``metadata.turns[].accepted``), so nothing is silent;
- **neutral only**: accepted at their neutral value (``logit_bias: {}``, penalties 0, ...), else a
  400 naming the parameter: honouring them is impossible here and ignoring them would change what
  is sampled against what the client asked;
- anything else: 400 ``Unrecognized request argument supplied: X``, as OpenAI answers.

Any ``model`` name is served (the answer repeats it): harnesses name the hosted model they were
built for, and the proxy's session decides what samples.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

from inverted.errors import InvalidRequest
from inverted.limits import brief
from inverted.rollout.proxy.apis.call import Answer, Failure, TokenLogprob

# Fields every OpenAI API accepts without effect, and why; each one present is recorded on the turn.
REASONS = {
    "user": "names the end user for the hosted service's abuse checks; nothing is sampled from it",
    "safety_identifier": "names the end user for the hosted service's abuse checks; nothing is sampled from it",
    "metadata": "the caller's own tags for the hosted service to store; nothing is sampled from them",
    "client_metadata": "the client's own telemetry tags; nothing is sampled from them",
    "service_tier": "a hosted service's billing and latency tier; these servers have one",
    "prompt_cache_key": "prefix caching here is automatic (the servers' radix cache), whatever the key",
    "prompt_cache_retention": "prefix caching here is automatic (the servers' radix cache); entries live while "
    "memory allows",
    "parallel_tool_calls": "every call the model writes is returned; the sampled text is not constrained to one "
    "call or several",
}


def check_fields(
    body: Any, allowed: set[str], neutral: dict[str, tuple], reasons: dict[str, str] = REASONS
) -> dict[str, Any]:
    """``body`` itself, once it is an object whose every field is allowed, accepted with a reason, or neutral."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_body")
    for key, value in body.items():
        if key in allowed or key in reasons or key == "model":
            continue
        if key in neutral:
            if value not in neutral[key]:
                raise InvalidRequest(
                    f"'{key}' = {brief(value)} is not supported by this server: it would change what is "
                    f"sampled (accepted values: {list(neutral[key])})",
                    param=key,
                    code="unsupported_parameter",
                )
            continue
        raise InvalidRequest(
            f"Unrecognized request argument supplied: {brief(key)}", param=key[:200], code="unrecognized_argument"
        )
    if body.get("stream") not in (None, True, False):
        raise InvalidRequest("Invalid type for 'stream': expected a boolean", param="stream", code="invalid_type")
    return body


def include_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage``: a last chunk with the call's usage."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    return bool(options.get("include_usage"))


def model_name(body: dict[str, Any]) -> str | None:
    return body.get("model") if isinstance(body.get("model"), str) else None


def error_body(failure: Failure) -> dict[str, Any]:
    return {"error": {"message": failure.message, "type": failure.type, "param": failure.param, "code": failure.code}}


def stream_error(failure: Failure, sent: int) -> tuple[str | None, dict[str, Any]]:
    """The error a Chat Completions stream ends with, once its headers are sent."""
    return None, error_body(failure)


def token_logprobs(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Each sampled token's logprob and the most likely tokens at its position (Chat and Responses)."""
    return [
        {
            "token": t.token,
            "logprob": t.logprob,
            "bytes": list(t.token.encode()),
            "top_logprobs": [{"token": tt, "logprob": tlp, "bytes": list(tt.encode())} for tt, tlp in t.top],
        }
        for t in logprobs
    ]


def usage(answer: Answer) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the server's prefix cache served (``cached_tokens``)."""
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": answer.cached_tokens},
    }


DONE = b"data: [DONE]\n\n"  # how Chat Completions and Completions streams end
