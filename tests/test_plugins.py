"""Plug-in loading, and the contract of each plug-in point, loaded through its path string."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest

from inverted.buffer.config import BufferConfig
from inverted.buffer.service import build_store
from inverted.compat.slime_forms import SlimeDataBuffer
from inverted.errors import ConfigError, PluginError, PluginFailed
from inverted.plugins import in_daemon_thread, load_plugin, load_rollout_function, required_flags
from inverted.types import Sample, Task

FILTER = "inverted.buffer.filters:drop_all_equal_rewards"


def group(*rewards: float) -> list[Sample]:
    return [Sample(group_index=0, index=i, reward=r) for i, r in enumerate(rewards)]


def test_the_default_group_filter_loads_by_path_in_both_spellings():
    for path in (FILTER, FILTER.replace(":", ".")):  # slime writes module.function
        keep = load_plugin(path, flag="--dynamic-sampling-filter-path", params=["samples"])
        assert keep(group(1.0, 0.0)) is True and keep(group(1.0, 1.0)) is False
        assert keep([Sample(reward={"acc": 1.0}), Sample(reward={"acc": 0.0})]) is True


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("no.such.module:fn", "cannot load it"),
        ("inverted.buffer.filters:nope", "cannot load it"),
        ("inverted.buffer.filters", "not callable"),  # read as module.function: the submodule itself
        ("filters", "expected 'module:function'"),
        ("inverted.types:SampleError", "signature"),  # callable, but not with (samples)
        ("inverted.buffer.filters:__doc__", "not callable"),
    ],
)
def test_bad_plugins_name_the_flag_the_path_and_the_signature(path, problem):
    with pytest.raises(PluginError) as info:
        load_plugin(path, flag="--dynamic-sampling-filter-path", params=["samples", "extra"])
    message = str(info.value)
    assert message.startswith(f"--dynamic-sampling-filter-path={path!r}") and problem in message
    assert "(samples, extra)" in message


def test_the_buffer_applies_the_filter_named_by_its_flag(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "a"}\n{"input": "b"}\n')
    store = build_store(
        BufferConfig(
            db=str(tmp_path / "b.db"),
            prompt_data=str(data),
            n_samples_per_prompt=2,
            dynamic_sampling_filter_path=FILTER,
        )
    )
    tasks = store.lease(4, "w", 60)
    for task, reward in zip(tasks, (1.0, 1.0, 1.0, 0.0)):
        sample = Sample(
            group_index=task["group_index"], index=task["index"], reward=reward, status=Sample.Status.COMPLETED
        )
        store.submit([(task["lease_id"], sample)])
    assert store.next_batch(2, None, None, allow_partial=True) is not None
    assert store.stats()["groups"] == {
        "open": 0,
        "complete": 0,
        "consumed": 1,
        "dropped_stale": 0,
        "filtered": 1,
        "failed": 0,
    }
    with pytest.raises(PluginError):
        build_store(BufferConfig(db=str(tmp_path / "c.db"), dynamic_sampling_filter_path="nope:nope"))


ROLLOUT_FUNCTIONS = [
    "rollout_functions.agent:generate_rollout",
    "rollout_functions.single_turn:generate_rollout",
    "rollout_functions.subprocess_agent:generate_rollout",
]


@pytest.mark.parametrize(
    ("path", "needs"), zip(ROLLOUT_FUNCTIONS, [("env_path",), ("custom_rm_path",), ("agent_command",)])
)
def test_the_built_in_rollout_functions_load_through_their_paths(path, needs):
    import importlib

    module, _, name = path.partition(":")
    fn = load_rollout_function(path)
    assert fn.__wrapped__ is getattr(importlib.import_module(module), name)  # guarded: its errors name it
    assert required_flags(fn) == needs  # the job refuses to start without them


def test_a_plugins_exception_names_the_plugin_and_keeps_its_traceback():
    fn = load_plugin(
        "tests.compat.slime_plugins:broken_filter", flag="--dynamic-sampling-filter-path", params=["args", "samples"]
    )
    with pytest.raises(PluginFailed) as failed:
        fn(None, [types.SimpleNamespace(reward=None)])
    message = str(failed.value)
    assert message.startswith(
        "--dynamic-sampling-filter-path='tests.compat.slime_plugins:broken_filter' raised "
        "TypeError: 'NoneType' object is not subscriptable\nTraceback (most recent call last):"
    )
    assert 'slime_plugins.py", line' in message and "guarded" not in message  # its frames, not the wrapper's


def slime_rollout(args, rollout_id, data_buffer, evaluation=False):
    groups = data_buffer.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            sample.reward, sample.metadata["seen"] = float(rollout_id), (evaluation, sample.metadata["tools"])
    return groups


def sync_rollout(ctx, tasks):
    return []


def test_slime_rollout_functions_are_adapted_to_the_contract():
    import asyncio

    from inverted.plugins import RolloutContext
    from inverted.rollout.config import RolloutConfig
    from inverted.types import Task

    fn = load_rollout_function(f"{__name__}.slime_rollout")  # slime's dotted form, slime's signature
    tasks = [
        Task(lease_id="l", group_index=g, index=2 * g + i, prompt_index=g, prompt="p", tools=[{"t": g}])
        for g in range(3)
        for i in range(2)
    ]
    ctx = RolloutContext(
        rollout_id=7,
        config=RolloutConfig(),
        proxy_url="",
        proxy_api_key=None,
        router_url="",
        hf_checkpoint="",
        sampling={},
        evaluation=True,
        flags={"rollout_batch_size": 3, "n_samples_per_prompt": 2, "apply_chat_template": False},
    )
    samples = asyncio.run(fn(ctx, tasks))
    assert [(s.group_index, s.index, s.reward) for s in samples] == [(t.group_index, t.index, 7.0) for t in tasks]
    assert samples[2].metadata["seen"] == (True, [{"t": 1}])


def test_a_rollout_function_with_the_wrong_shape_is_refused_at_load():
    with pytest.raises(PluginError, match=r"expected 'async def sync_rollout\(ctx, tasks\) -> list\[Sample\]'"):
        load_rollout_function(f"{__name__}:sync_rollout")
    with pytest.raises(PluginError, match=r"does not match def first_character\(ctx, tasks\)"):
        load_rollout_function("envs.letters:first_character")


def test_env_args_are_bound_to_the_environment_and_checked_before_anything_starts():
    from inverted.plugins import Plugins
    from inverted.rollout.config import RolloutConfig

    args = '{"env": "verifiers.envs.integrations.reasoninggym_env:ReasoningGymEnv", "args": {"gym": "chain_sum"}}'
    env = Plugins.load(RolloutConfig(env_path="envs.verifiers:episode", env_args=args)).env
    assert env.keywords == {
        "env": "verifiers.envs.integrations.reasoninggym_env:ReasoningGymEnv",
        "args": {"gym": "chain_sum"},
    }
    with pytest.raises(PluginError, match="keyword-only arguments come from --env-args"):
        Plugins.load(RolloutConfig(env_path="envs.verifiers:episode"))
    with pytest.raises(PluginError, match="--env-args: --env-path='envs.letters:episode'.*refuses them"):
        Plugins.load(RolloutConfig(env_path="envs.letters:episode", env_args='{"env": "os:system"}'))
    with pytest.raises(ConfigError, match="--env-args='\\[1\\]': expected a JSON object"):
        RolloutConfig(env_path="envs.verifiers:episode", env_args="[1]")
    # A YAML config's mapping is the same JSON object.
    assert RolloutConfig(env_args={"driver": "envs.guess_number"}).env_args == '{"driver": "envs.guess_number"}'


def test_slimes_data_buffer_keeps_each_rollouts_groups_apart():
    """One ``data_buffer`` for the run: a rollout function's calls get only their rollout's groups (two
    rollouts may run side by side), a thread the plug-in started itself gets whichever are waiting,
    and what a rollout left untaken goes when it ends."""
    buffer = SlimeDataBuffer()

    def tasks(groups):
        return [
            Task(lease_id="l", group_index=g, index=i, prompt_index=g, prompt=f"p{g}") for g in groups for i in (0, 1)
        ]

    def keys(groups):
        return [[(s.group_index, s.index) for s in group] for group in groups]

    async def main():
        with buffer.serving(tasks([2, 3]), None):

            async def other_rollout():
                with buffer.serving(tasks([0, 1]), None):
                    return await in_daemon_thread(buffer.get_samples, 10)

            assert keys(await asyncio.create_task(other_rollout())) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
            assert keys(await in_daemon_thread(buffer.get_samples, 1)) == [[(2, 0), (2, 1)]]
            free = []

            def work():  # a thread the plug-in started: takes what waits, and puts it back (anyone's now)
                free.extend(buffer.get_samples(10))
                buffer.add_samples(free)

            worker = threading.Thread(target=work)
            worker.start()
            worker.join()
            assert keys(free) == [[(3, 0), (3, 1)]]
        assert keys(buffer.get_samples(10)) == [[(3, 0), (3, 1)]]
        with buffer.serving(tasks([4]), None):
            pass
        assert buffer.get_samples(10) == []  # untaken: gone with its rollout

    asyncio.run(main())


def test_plugin_code_runs_on_a_daemon_thread_and_its_errors_reach_the_caller():
    async def main():
        assert await in_daemon_thread(lambda x: threading.current_thread().daemon and x, 7) == 7
        with pytest.raises(ZeroDivisionError):
            await in_daemon_thread(lambda: 1 / 0)

    asyncio.run(main())
