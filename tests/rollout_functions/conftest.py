"""The stack the rollout functions play through: the tiny model in the embedded engine, and the proxy
(admin key ``admin-key``), started once per module; each test opens sessions of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stack(tiny_model, module_procs):
    model = tiny_model()
    engine = module_procs.engine(model)
    return model, engine, module_procs.proxy(engine.url, model, "--proxy-api-key", "admin-key")
