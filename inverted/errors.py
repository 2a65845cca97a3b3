"""The exception tree. Callers catch categories, not individual classes.

    InvertedError
    ├── ConfigError          a flag or config value is wrong (names the flag and the value)
    ├── PluginError          a ``module:function`` path cannot be loaded or has the wrong signature
    │   └── PluginFailed         a plug-in raised while it ran (names it, holds its traceback)
    ├── SampleError          a Sample breaks an invariant (names the field)
    ├── ModelError           a checkpoint cannot be read or does not fit the model it is loaded into
    ├── InvalidRequest       a request breaks the contract (carries the status, OpenAI's ``param`` and ``code``)
    │   ├── SchemaError          its JSON has the wrong shape or types (SGLang answers these in serde's words)
    │   │   └── FieldError           a request-level field has the wrong type (SGLang's pydantic body)
    │   └── Unauthorized         it lacks the key the route needs (401)
    ├── EngineError          an engine command cannot run in the engine's state (400, the route's SGLang body)
    │   └── UpdateGroupError     a weight-update process group could not be joined, or a broadcast failed
    ├── LeaseConflict        a buffer submission names a lease that is not the task's current one (409)
    └── ServiceError         a remote service failed (carries URL, status and the body's start)
        ├── ServiceUnavailable   could not be reached, or kept answering 502/503/504
        └── ProtocolError        answered, but with a 4xx or a body of the wrong shape

Each service maps these to status codes in one exception handler per app. Anything else that
escapes a route (``ValueError``, torch's ``RuntimeError``) is a bug of ours, answered 500 with the
traceback in the log, never blamed on the client.

This module imports nothing from inverted.
"""

from __future__ import annotations


class InvertedError(Exception):
    """Root of every error inverted raises on purpose."""


class ConfigError(InvertedError):
    """A configuration value is invalid; the message names the flag and the value."""


class PluginError(InvertedError):
    """A plug-in path could not be loaded or does not match its expected signature."""


class PluginFailed(PluginError):
    """A user plug-in raised while it ran. The message names its flag and path and holds its
    traceback, wherever it ran (the buffer service passes it on to the job's console)."""


class SampleError(InvertedError):
    """A Sample breaks an invariant; the message names the field."""


class ModelError(InvertedError):
    """A checkpoint is missing, unreadable, or does not match the model it is loaded into."""


class InvalidRequest(InvertedError):
    """A request to one of our OpenAI-compatible routes is invalid; answered 4xx with OpenAI's error body.

    ``param`` names the offending field as OpenAI does (``messages.[2].role``), ``code`` is a short
    machine-readable reason (``context_length_exceeded``), ``status`` the HTTP status to answer.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


class SchemaError(InvalidRequest):
    """A request body has the wrong JSON shape: an unknown key, a wrong type."""


class FieldError(SchemaError):
    """A request-level field (``input_ids``, ``rid``, a pause ``mode``) has the wrong type or value: real
    SGLang validates these with pydantic and answers ``{"object": "error", "message": ...}``, where a
    sampling parameter's wrong type gets serde's ``{"error": "..."}``."""


class Unauthorized(InvalidRequest):
    """The request lacks the key its route needs (``inverted.auth`` decides)."""

    def __init__(self, message: str):
        super().__init__(message, code="invalid_api_key", status=401)


class EngineError(InvertedError):
    """An engine command cannot run now: outside a weight-update session, with requests running, ...

    Not the client's malformed input (that is ``InvalidRequest``) and not our bug: the engine is in a
    state where SGLang also refuses the command, and says so with a 400.
    """


class UpdateGroupError(EngineError):
    """Joining a weight-update process group, or one of its broadcasts, failed: a peer is gone or late."""


class Overloaded(InvertedError):
    """A service has no room for the request now (503): it was refused before any work, try again later."""


class LeaseConflict(InvertedError):
    """A buffer request contradicts what the buffer holds: a submission names a lease that is not (or no
    longer) the task's current lease, or a batch trained in one step is said to be trained in another."""


class ServiceError(InvertedError):
    """A call to a service failed. ``url``, ``status`` and ``body`` say where and how."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None, body: str = ""):
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body

    def __str__(self) -> str:
        parts = [super().__str__()]
        if self.url:
            parts.append(f"url={self.url}")
        if self.status is not None:
            parts.append(f"status={self.status}")
        if self.body:
            parts.append(f"body={self.body[:300]!r}")
        return " ".join(parts)


class ServiceUnavailable(ServiceError):
    """The service could not be reached, or kept answering 502/503/504 after retries."""


class ProtocolError(ServiceError):
    """The service answered with a client error (4xx) or a body of an unexpected shape."""


class UnknownWorker(ServiceError):
    """The router served a worker the job did not start: what it generated must not be trained on."""
