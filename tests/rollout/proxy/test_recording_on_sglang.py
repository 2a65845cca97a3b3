"""The proxy's recording through real SGLang: the same tests as against the embedded engine, each Sample
checked token by token against what SGLang's own request log says it received and produced, and its
log-probs against ``transformers``. Chat Completions (sync, async, streamed), Responses (whole input and
``previous_response_id``, streamed) and Anthropic Messages (streamed), each through its official SDK; and
under top-p, each token's kept set (SGLang's sampling mask) against ``transformers``'."""

from __future__ import annotations

import pytest

from tests.rollout.proxy.conftest import Stack, start_stack
from tests.rollout.proxy.test_agent_apis import (  # noqa: F401  (collected here, against this module's stack)
    test_anthropic_messages_conversation_is_recorded_token_for_token,
    test_responses_api_conversation_is_recorded_token_for_token,
    test_the_same_conversation_gives_the_same_sample_through_all_three_apis,
)
from tests.rollout.proxy.test_recording import (  # noqa: F401
    test_a_cut_distribution_records_each_tokens_kept_set,
    test_four_turn_tool_conversation_is_recorded_token_for_token,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # a real SGLang server: left out of make test-fast


@pytest.fixture(scope="module")
def stack(module_procs, taught_model) -> Stack:
    """The taught model in real SGLang behind the router, and the proxy in front: once for this module."""
    return start_stack(module_procs, taught_model, "sglang")
