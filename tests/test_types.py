"""The ``Sample`` contract: JSON round trip and every invariant ``validate`` guards."""

from __future__ import annotations

import json
import math

import pytest

from inverted.errors import SampleError
from inverted.types import Sample


def good() -> Sample:
    return Sample(
        group_index=0,
        index=1,
        prompt=[{"role": "user", "content": "hi"}],
        tokens=[1, 2, 3, 4, 5],
        response_length=3,
        loss_mask=[1, 0, 1],
        rollout_log_probs=[-0.5, 0.0, -1.25],
        weight_versions=["3", "3", "4"],
        reward={"acc": 1.0},
        status=Sample.Status.COMPLETED,
        label="5",
        metadata={"k": "v"},
        session_id="s",
    )


def test_json_round_trip_is_exact():
    sample = good()
    sample.validate()
    data = json.loads(json.dumps(sample.to_json()))
    assert data["status"] == "completed"
    back = Sample.from_json(data)
    assert back == sample and back.response_tokens == [3, 4, 5] and back.prompt_length == 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"loss_mask": [1, 0]}, "loss_mask"),
        ({"rollout_log_probs": [-1.0]}, "rollout_log_probs"),
        ({"weight_versions": ["1", "1", "1", "1"]}, "weight_versions"),
        ({"response_length": 9}, "response_length"),
        ({"tokens": [1, 2, -3, 4, 5]}, "tokens"),
        ({"loss_mask": [1, 2, 0]}, "loss_mask"),
        ({"rollout_log_probs": [-1.0, math.nan, 0.0]}, "rollout_log_probs"),
        ({"rollout_log_probs": [-1.0, 0.5, 0.0]}, "rollout_log_probs"),
        ({"reward": math.inf}, "reward"),
        ({"reward": {"acc": math.nan, "parsed": "7"}}, "reward"),
        ({"reward": "high"}, "reward"),
        ({"weight_versions": [1, 2, 3]}, "weight_versions"),
    ],
)
def test_each_broken_invariant_is_named(change, field):
    sample = good()
    for key, value in change.items():
        setattr(sample, key, value)
    with pytest.raises(SampleError, match=field):
        sample.validate()
    # The same rules hold on the buffer's fast path: element rules in the decoder, the rest after it.
    with pytest.raises(SampleError, match=f"^{field}"):
        Sample.from_json(sample.to_json()).validate(elements_checked=True)


def test_from_json_checks_names_and_types_from_dicts_and_bytes():
    data = good().to_json()
    with pytest.raises(SampleError, match="unknown field `advantage`"):
        Sample.from_json({**data, "advantage": 1.0})
    with pytest.raises(SampleError, match="^status: Invalid enum value 'exploded'"):
        Sample.from_json({**data, "status": "exploded"})
    with pytest.raises(SampleError, match=r"^loss_mask\[1\]: Expected `int`, got `bool`"):
        Sample.from_json({**data, "loss_mask": [1, True, 0]})
    assert Sample.from_json(json.dumps(data).encode()) == Sample.from_json(data)  # raw bytes decode alike
