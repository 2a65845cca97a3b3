"""What a request may ask for, checked without a server: stop strings and the legacy logprobs count."""

from __future__ import annotations

import pytest

from inverted.errors import InvalidRequest
from inverted.rollout.proxy import openai_api as api


def test_the_cut_is_at_the_first_stop_string_in_the_text_not_in_the_list():
    # One sampled token can complete several stop strings; SGLang names the first in the list.
    assert api.before_stop("The answer is 5", ["5", "answer"]) == "The "
    assert api.before_stop("The answer is 5", ["answer", "5"]) == "The "
    assert api.before_stop("no stop here", ["5"]) == "no stop here"


def test_legacy_completions_take_logprobs_as_a_count():
    assert api.parse_completion({"prompt": "p", "logprobs": 3}).top_logprobs == 3
    plain = api.parse_completion({"prompt": "p", "logprobs": 0})
    assert plain.logprobs and plain.top_logprobs == 0
    assert not api.parse_completion({"prompt": "p", "logprobs": None}).logprobs
    assert not api.parse_chat({"messages": [{"role": "user", "content": "u"}], "logprobs": False}).logprobs
    for bad in (6, -1, True, "2", 1.5):
        with pytest.raises(InvalidRequest, match="between 0 and 5") as info:
            api.parse_completion({"prompt": "p", "logprobs": bad})
        assert info.value.param == "logprobs"
    with pytest.raises(InvalidRequest, match="expected a boolean"):
        api.parse_chat({"messages": [{"role": "user", "content": "u"}], "logprobs": 3})
