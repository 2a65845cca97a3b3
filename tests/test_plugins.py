"""Plug-in loading, and the contract of each plug-in point, loaded through its path string."""

from __future__ import annotations

import pytest

from inverted.buffer.service import build_store
from inverted.config import BufferConfig
from inverted.errors import PluginError
from inverted.plugins import load_plugin
from inverted.types import Sample

FILTER = "inverted.buffer.filters:drop_all_equal_rewards"


def group(*rewards: float) -> list[Sample]:
    return [Sample(group_index=0, index=i, reward=r) for i, r in enumerate(rewards)]


def test_the_default_group_filter_loads_by_path_in_both_spellings():
    for path in (FILTER, FILTER.replace(":", ".")):  # slime writes module.function
        keep = load_plugin(path, flag="--dynamic-sampling-filter-path", params=["samples"])
        assert keep(group(1.0, 0.0)) is True and keep(group(1.0, 1.0)) is False
        assert keep([Sample(reward={"acc": 1.0}), Sample(reward={"acc": 0.0})]) is True


@pytest.mark.parametrize(("path", "problem"), [
    ("no.such.module:fn", "cannot load it"),
    ("inverted.buffer.filters:nope", "cannot load it"),
    ("inverted.buffer.filters", "not callable"),  # read as module.function: the submodule itself
    ("filters", "expected 'module:function'"),
    ("inverted.types:SampleError", "signature"),  # callable, but not with (samples)
    ("inverted.buffer.filters:__doc__", "not callable"),
])
def test_bad_plugins_name_the_flag_the_path_and_the_signature(path, problem):
    with pytest.raises(PluginError) as info:
        load_plugin(path, flag="--dynamic-sampling-filter-path", params=["samples", "extra"])
    message = str(info.value)
    assert message.startswith(f"--dynamic-sampling-filter-path={path!r}") and problem in message
    assert "(samples, extra)" in message


def test_the_buffer_applies_the_filter_named_by_its_flag(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "a"}\n{"input": "b"}\n')
    store = build_store(BufferConfig(db=str(tmp_path / "b.db"), prompt_data=str(data), n_samples_per_prompt=2,
                                     dynamic_sampling_filter_path=FILTER))
    tasks = store.lease(4, "w", 60)
    for task, reward in zip(tasks, (1.0, 1.0, 1.0, 0.0)):
        sample = Sample(group_index=task["group_index"], index=task["index"], reward=reward, status=Sample.Status.COMPLETED)
        store.submit([(task["lease_id"], sample)])
    assert store.next_batch(2, None, None, allow_partial=True) is not None
    assert store.stats()["groups"] == {"open": 0, "complete": 0, "consumed": 1, "dropped_stale": 0, "filtered": 1, "failed": 0}
    with pytest.raises(PluginError):
        build_store(BufferConfig(db=str(tmp_path / "c.db"), dynamic_sampling_filter_path="nope:nope"))
