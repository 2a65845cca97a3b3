"""Loading user plug-ins by path: ``module:function`` (slime's dotted ``module.function`` too).

Each plug-in point has a flag ending in ``-path`` and an expected signature. ``load_plugin``
imports once at startup and checks the callable's parameters against the expected names, so a
wrong path or signature fails before any process starts, with the flag, the path and the
signature in the message. Defaults are loaded the same way, through their path strings.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from inverted.errors import PluginError


def load_plugin(path: str, *, flag: str, params: list[str]) -> Callable[..., Any]:
    """Import ``path`` and check that it accepts ``params`` positionally (extra defaults are fine)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    expected = f"def {attr or 'fn'}({', '.join(params)})"
    if not module_name or not attr:
        raise PluginError(f"{flag}={path!r}: expected 'module:function' with signature {expected}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"{flag}={path!r}: cannot load it ({exc}); expected {expected}") from None
    if not callable(fn):
        raise PluginError(f"{flag}={path!r}: not callable; expected {expected}")
    try:
        signature = inspect.signature(fn)
        signature.bind(*params)
    except ValueError:  # builtins and some extension types publish no signature
        raise PluginError(f"{flag}={path!r}: its signature cannot be read; expected {expected}") from None
    except TypeError as exc:
        raise PluginError(f"{flag}={path!r}: signature {signature} does not match {expected} ({exc})") from None
    return fn
