"""Claude Code, unchanged, through the proxy to real SGLang: the same episode as against the embedded
engine (taught stage by stage, the weights loaded into SGLang from disk), recorded token for token
against what SGLang's own request log says it received and produced."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.harnesses.conftest import HarnessStack, start_harness_stack
from tests.harnesses.test_claude_code import (  # noqa: F401  (collected here, against this module's stack)
    test_claude_code_runs_an_episode_unchanged_recorded_exactly,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def harness_stack(request, long_model, tmp_path_factory) -> Iterator[HarnessStack]:
    yield from start_harness_stack(request, long_model, tmp_path_factory, "sglang")
