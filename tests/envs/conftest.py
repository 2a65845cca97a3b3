"""The stack the library adapters play through: the tiny model in the embedded engine, and the proxy."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stack(tiny_model, module_procs):
    model = tiny_model()
    engine = module_procs.engine(model)
    return model, engine, module_procs.proxy(engine.url, model, "--proxy-api-key", "k")
