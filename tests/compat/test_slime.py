"""slime's plug-in API: the Sample view converts exactly, args are slime's names, slime's module paths
resolve here (and stay slime's where slime is installed), and wrong plug-ins are refused by signature."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from inverted.buffer.config import BufferConfig
from inverted.compat import slime
from inverted.config import plugin_flags, to_flags
from inverted.errors import PluginError, SampleError
from inverted.plugins import load_forms, load_plugin
from inverted.rollout.config import RolloutConfig
from inverted.types import Sample


def full_sample() -> Sample:
    """Every field off its default; per-token versions that change mid-response."""
    return Sample(
        group_index=3,
        index=7,
        prompt=[{"role": "user", "content": "2+2?"}],
        tokens=[1, 2, 3, 4, 5, 6],
        response_length=4,
        loss_mask=[1, 0, 1, 1],
        rollout_log_probs=[-0.5, 0.0, -1.25, -2.0],
        weight_versions=["4", "4", "5", "5"],
        reward={"correct": 1.0, "format": 0.5},
        status=Sample.Status.TRUNCATED,
        label="4",
        session_id="s-1",
        metadata={"task": "add"},
        rollout_routed_experts=base64.b64encode(np.arange(5 * 2 * 2, dtype="<i4").tobytes()).decode(),
        remove_sample=True,
        teacher_log_probs=[-0.25, -1.0, -0.5, -0.75],
    )


def test_every_field_converts_exactly_both_ways():
    ours = full_sample()
    view = slime.from_inverted(ours)
    assert (view.group_index, view.index, view.prompt, view.tokens, view.response_length, view.label) == (
        3,
        7,
        ours.prompt,
        [1, 2, 3, 4, 5, 6],
        4,
        "4",
    )
    assert (view.remove_sample, view.teacher_log_probs) == (True, [-0.25, -1.0, -0.5, -0.75])  # typed on both sides
    assert (view.response, view.rollout_id) == ("", None)  # the response's text needs the tokenizer (args)
    assert view.metadata == {"task": "add"} and view.session_id == "s-1"
    assert view.status is slime.Sample.Status.TRUNCATED and view.reward == {"correct": 1.0, "format": 0.5}
    assert view.weight_versions == ["4", "5"]  # slime's meaning: one per generate call
    assert view.loss_mask == [1, 0, 1, 1] and view.rollout_log_probs == [-0.5, 0.0, -1.25, -2.0]
    assert slime.to_inverted(view) == ours  # and back, per-token versions included

    fresh = slime.Sample(
        group_index=1,
        index=2,
        rollout_id=5,
        prompt="p",
        tokens=[9, 8, 7],
        response="xy",
        response_length=2,
        label=1,
        reward=0.25,
        loss_mask=[1, 1],
        weight_versions=["3"],
        rollout_log_probs=[-1.0, -2.0],
        status=slime.Sample.Status.COMPLETED,
        metadata={"k": "v"},
        remove_sample=True,
        session_id="s",
    )
    back = slime.from_inverted(slime.to_inverted(fresh))
    back.response, back.rollout_id = "xy", 5  # slime's own: the text, the fan-out's id, which ours has no use for
    assert back == fresh
    assert slime.to_inverted(fresh).weight_versions == ["3", "3"]

    # slime's rollout keeps routed experts as an int32 array [tokens - 1, layers, top_k]
    fresh.rollout_routed_experts = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2)
    assert slime.to_inverted(fresh).rollout_routed_experts == ours.rollout_routed_experts


def test_defaults_and_slime_shortcuts():
    view = slime.Sample(tokens=[1, 2, 3], response_length=2, rollout_log_probs=[-1.0, -1.0], weight_versions=["2"])
    ours = slime.to_inverted(view)
    assert (
        ours.loss_mask == [1, 1] and ours.metadata == {} and ours.weight_versions == ["2", "2"]
    )  # None mask: all trained
    ours.validate()
    # no log-probs, no versions (a generate function that calls its server its own way): valid slime; the
    # versions are the rollout's serving one, marked inferred where rollouts overlap training
    plain = slime.Sample(tokens=[1, 2, 3], response_length=2, status=slime.Sample.Status.COMPLETED)
    with pytest.raises(SampleError, match="cannot tell which"):
        slime.to_inverted(plain)
    exact = slime.to_inverted(plain, serving=slime.Serving("3"))
    assert (exact.rollout_log_probs, exact.weight_versions, exact.metadata) == (None, ["3", "3"], {})
    exact.validate()
    inferred = slime.to_inverted(plain, serving=slime.Serving("3", inferred=True))
    assert inferred.weight_versions == ["3", "3"] and inferred.metadata == {"weight_versions_inferred": True}
    assert Sample.from_json(inferred.to_json()) == inferred  # and it travels as JSON


def test_each_token_gets_the_version_of_the_call_that_sampled_it():
    mask = [1, 1, 0, 0, 1, 1, 1]
    view = slime.Sample(
        tokens=list(range(9)),
        response_length=7,
        loss_mask=mask,
        rollout_log_probs=[0.0] * 7,
        weight_versions=["1", "2"],
    )
    calls = [slime.GenerateCall((5, 6), "1"), slime.GenerateCall((7, 8, 9), "2")]
    expected = ["1", "1", "1", "1", "2", "2", "2"]  # tool output takes the version of the call before it
    assert slime.to_inverted(view, calls).weight_versions == expected
    assert slime.to_inverted(view).weight_versions == expected  # no recorded calls: one trainable run per call
    view.weight_versions = ["1", "2", "3"]
    with pytest.raises(SampleError, match="cannot tell which"):
        slime.to_inverted(view)


def test_args_are_slimes_namespace_with_slimes_defaults():
    args = slime.SlimeArgs.of(
        plugin_flags(RolloutConfig(rollout_max_response_len=77), BufferConfig()) | {"loss_aggregation": "token_mean"},
        router_url="http://127.0.0.1:4321",
    )
    assert (args.rollout_max_response_len, args.n_samples_per_prompt, args.rollout_temperature) == (77, 1, 1.0)
    assert (args.sglang_router_ip, args.sglang_router_port) == ("127.0.0.1", 4321)
    # slime's flags that were not given, at slime's defaults: our token_mean is no per-token loss in slime's terms
    assert (args.calculate_per_token_loss, args.use_wandb, args.rm_type, args.use_rollout_logprobs) == (
        False,
        False,
        None,
        False,
    )
    assert "rm_type" in args and hasattr(args, "num_layers")
    with pytest.raises(AttributeError, match="args.no_such_flag: not a flag of slime's train.py nor of inverted"):
        args.no_such_flag
    args.rollout_max_response_len = 1  # a plug-in may set attributes on its copy, as slime's do
    assert args.rollout_max_response_len == 1


def test_slime_module_paths_resolve_here():
    from inverted.compat import modules

    assert modules.install()
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.http_utils import post
    from slime.utils.types import Sample as SlimeSample

    assert (SlimeSample, post, GenerateState, DynamicFilterOutput) == (
        slime.Sample,
        slime.post,
        slime.GenerateState,
        slime.DynamicFilterOutput,
    )
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy  # lazily, from the trainer

    from inverted.compat.slime_loss import get_log_probs_and_entropy as ours

    assert get_log_probs_and_entropy is ours


def test_an_installed_slime_is_left_alone(tmp_path):
    """With the real slime on the path its modules are used; our conversions work on its Sample by field name."""
    package = tmp_path / "slime" / "utils"
    package.mkdir(parents=True)
    (tmp_path / "slime" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "types.py").write_text(
        textwrap.dedent("""
        import enum
        from dataclasses import dataclass, field

        @dataclass
        class Sample:
            class Status(enum.Enum):
                PENDING = "pending"; COMPLETED = "completed"; TRUNCATED = "truncated"
                ABORTED = "aborted"; FAILED = "failed"
            group_index: int = None; index: int = None; rollout_id: int = None; prompt: object = ""
            tokens: list = field(default_factory=list); response: str = ""; response_length: int = 0
            label: object = None
            reward: object = None; loss_mask: list = None; weight_versions: list = field(default_factory=list)
            rollout_log_probs: list = None; status: Status = Status.PENDING
            metadata: dict = field(default_factory=dict)
            remove_sample: bool = False; session_id: str = None; train_metadata: dict = None
    """)
    )
    script = textwrap.dedent("""
        from inverted.compat import modules, slime
        from tests.compat.test_slime import full_sample
        assert not modules.install()
        import slime.utils.types as real
        assert not getattr(real, "__inverted__", False)
        assert type(slime.from_inverted(full_sample())) is real.Sample
        view = slime.from_inverted(full_sample(), real.Sample)
        assert isinstance(view, real.Sample) and view.status is real.Sample.Status.TRUNCATED
        assert slime.to_inverted(view) == full_sample()
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": f"{tmp_path}:{sys.path[0]}", "PATH": "/usr/bin:/bin"},
        cwd=sys.path[0],
    )
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


def test_signatures_are_recognised_and_wrong_ones_refused():
    path = "tests.compat.slime_plugins"
    assert (
        load_forms(
            f"{path}:group_rm", flag="--custom-rm-path", forms={"ours": ["sample"], "slime": ["args", "sample"]}
        )[0]
        == "slime"
    )
    with pytest.raises(
        PluginError,
        match=r"signature \(args, rollout_id, buffer.*does not match def newest_groups_first\(rollout_id, args",
    ):
        load_plugin(
            f"{path}:newest_groups_first",
            flag="--custom-rollout-log-function-path",
            params=["rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"],
        )
    with pytest.raises(PluginError, match="cannot load it"):
        load_plugin(f"{path}:no_such_function", flag="--buffer-filter-path", params=["args"])


def test_slime_dynamic_sampling_filters_keep_groups_by_their_output():
    from inverted.buffer.filters import load_group_filter

    keep = load_group_filter(
        BufferConfig(dynamic_sampling_filter_path="tests.compat.slime_plugins:keep_differing_rewards")
    )
    group = [full_sample(), full_sample()]
    group[0].reward, group[1].reward = 1.0, 0.0
    assert keep(group)
    group[1].reward = 1.0
    assert not keep(group)


def test_in_a_lora_run_slime_post_names_the_policy_adapter_on_generate():
    """A slime plug-in written for full fine-tuning calls /generate without lora_path: in a LoRA run
    ``post`` adds the policy's, over real HTTP; a name it gives, and other routes, are left alone."""
    import asyncio

    from fastapi import FastAPI

    from tests.conftest import serving

    app = FastAPI()

    @app.post("/generate")
    @app.post("/other")
    async def echo(body: dict) -> dict:
        return body

    async def calls(url: str) -> list:
        plain = {"input_ids": [1, 2]}
        outside = await slime.post(f"{url}/generate", plain)
        with slime.generating_with("policy"):
            inside = await asyncio.gather(
                slime.post(f"{url}/generate", plain),
                slime.post(f"{url}/other", plain),
                slime.post(f"{url}/generate", {**plain, "lora_path": "mine"}),
            )
        return [outside, *inside]

    with serving(app) as url:
        answers = asyncio.run(calls(url))
    assert [a.get("lora_path") for a in answers] == [None, "policy", None, "mine"]


def test_a_sample_grows_through_append_response_tokens_as_in_slime():
    """slime's current ``Sample`` API (``slime/utils/types.py``, August 2026): the policy's tokens with
    their logprobs and SGLang's ``meta_info``; a tool's with ``trainable=False`` (mask 0, logprob 0.0)."""
    sample = slime.Sample(tokens=[1, 2, 3])
    meta = {
        "finish_reason": {"type": "length", "length": 2},
        "weight_version": "3",
        "cached_tokens": 2,
        "prompt_tokens": 3,
        "completion_tokens": 2,
    }
    sample.append_response_tokens(None, tokens=[4, 5], log_probs=[-0.1, -0.2], text="ab", meta_info=meta)
    sample.append_response_tokens(tokens=[6, 7], trainable=False, text="cd")
    assert (sample.tokens, sample.response_length, sample.loss_mask) == ([1, 2, 3, 4, 5, 6, 7], 4, [1, 1, 0, 0])
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0] and sample.response == "abcd"
    assert sample.status == slime.Sample.Status.TRUNCATED and sample.weight_versions == ["3"]
    assert sample.prefix_cache_info.prefix_cache_hit_rate == 2 / 3 and sample.effective_response_length == 2
    for bad, message in [
        ({"tokens": [8]}, "require rollout log probabilities"),
        ({"tokens": [8], "trainable": False, "log_probs": [-1.0]}, "should not pass"),
        ({"tokens": [8, 9], "log_probs": [-1.0]}, "log_probs length 1 != tokens length 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            sample.append_response_tokens(None, **bad)
    # and it travels: our Sample keeps every token's version, slime's response text, the status
    ours = slime.to_inverted(sample, [slime.GenerateCall((4, 5), "3")])
    assert ours.weight_versions == ["3"] * 4 and ours.loss_mask == [1, 1, 0, 0]
    copy = slime.Sample.from_dict(sample.to_dict() | {"extra_key": 1})
    assert copy.tokens == sample.tokens and copy.prefix_cache_info == sample.prefix_cache_info and copy.extra_key == 1


def test_slime_reward_values_and_its_nonzero_std_filters():
    args = slime.SlimeArgs.of(to_flags(BufferConfig(reward_key="score")))
    from slime.rollout.filter_hub.dynamic_sampling_filters import (
        check_reward_nonzero_std,  # noqa: F401
        check_reward_nonzero_std_with_fallback,
    )

    group = [slime.Sample(reward={"score": 1.0, "parsed": "4", "ok": True}), slime.Sample(reward={"score": 0.0})]
    assert [s.get_reward_value(args) for s in group] == [1.0, 0.0]
    assert check_reward_nonzero_std(args, group).keep
    group[1].reward = {"score": 1.0, "parsed": None}
    refused = check_reward_nonzero_std_with_fallback(args, group)
    assert not refused.keep and refused.reason == "zero_std_1.0" and refused.keep_when_insufficient
    # a reward dict with any JSON values is a valid Sample; the trainer reads --reward-key's number
    sample = full_sample()
    sample.reward = {"score": 0.5, "parsed": "4", "ok": True, "trace": [1, 2]}
    sample.validate()
    assert sample.scalar_reward("score") == 0.5 and sample.scalar_reward() == 0.5  # the sum of its numbers
    with pytest.raises(SampleError, match="reward\\['parsed'\\] \\(--reward-key\\) is '4', not a number"):
        sample.scalar_reward("parsed")


def test_slime_rollout_outputs_and_misc_helpers():
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
    from slime.utils.misc import SingletonMeta, group_by, load_function

    def legacy(args, rollout_id, data_buffer, evaluation=False):
        return {"set": {"rewards": [1.0]}} if evaluation else [[slime.Sample()]]

    assert isinstance(call_rollout_fn(legacy, None, 0, None, evaluation=False), RolloutFnTrainOutput)
    assert call_rollout_fn(legacy, None, 0, None, evaluation=True) == RolloutFnEvalOutput(
        data={"set": {"rewards": [1.0]}}
    )
    assert load_function("inverted.compat.slime.group_by") is group_by
    assert group_by([1, 2, 3, 4], key=lambda x: x % 2) == {1: [1, 3], 0: [2, 4]}

    class One(metaclass=SingletonMeta):
        pass

    assert One() is One()


def test_with_the_jobs_args_a_sample_reads_as_slimes_rollout_gives_it(tiny_model):
    """``index`` counts across the dataset, ``response`` is the response's text (a reward function that
    reads it graded nothing before), ``--apply-chat-template`` renders a chat prompt; back, our place
    in the group returns."""
    from transformers import AutoTokenizer

    model = str(tiny_model("qwen2"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = tokenizer("It is 5.", add_special_tokens=False)["input_ids"]
    ours = Sample(
        group_index=3,
        index=1,
        prompt=chat,
        tokens=[7, 8, *reply],
        response_length=len(reply),
        loss_mask=[1] * len(reply),
        rollout_log_probs=[-0.5] * len(reply),
        weight_versions=["1"] * len(reply),
    )
    args = slime.SlimeArgs({"hf_checkpoint": model, "n_samples_per_prompt": 4})
    view = slime.from_inverted(ours, args=args)
    assert (view.index, view.response, view.prompt) == (3 * 4 + 1, "It is 5.", chat)
    assert slime.to_inverted(view).index == 1
    args.apply_chat_template = True
    assert slime.from_inverted(ours, args=args).prompt == tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert slime.from_inverted(ours).response == "" and slime.from_inverted(ours).index == 1  # no args: as stored


def test_append_response_tokens_grows_the_lists_in_place():
    """slime's ``+=``: retool keeps ``loss_masks = sample.loss_mask`` and assigns it back at the end."""
    sample = slime.Sample(tokens=[1, 2], loss_mask=[], rollout_log_probs=None)
    masks = sample.loss_mask
    sample.append_response_tokens(None, tokens=[3, 4], log_probs=[-0.1, -0.2])
    sample.append_response_tokens(None, tokens=[5], trainable=False)
    sample.loss_mask = masks
    assert masks == [1, 1, 0] and sample.rollout_log_probs == [-0.1, -0.2, 0.0] and sample.tokens == [1, 2, 3, 4, 5]


SAME_AS_SLIMES = """
import dataclasses, json, sys
from slime.utils.types import Sample as Theirs
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std as their_filter
from inverted import compat
from inverted.compat import slime as ours
compat.register()

fields = lambda cls: {f.name for f in dataclasses.fields(cls)}
assert fields(Theirs) <= fields(ours.Sample), sorted(fields(Theirs) - fields(ours.Sample))

def script(cls):
    s = cls(tokens=[1, 2], prompt="p")
    s.append_response_tokens(None, tokens=[3, 4], log_probs=[-0.5, -0.25], text="ab",
                             meta_info={"finish_reason": {"type": "stop"}, "weight_version": "7", "cached_tokens": 1,
                                        "prompt_tokens": 2})
    s.append_response_tokens(None, tokens=[5], trainable=False, text="c")
    s.reward = {"score": 1.0, "ok": True}
    return s

class Args:
    reward_key = "score"

a, b = script(Theirs), script(ours.Sample)
for name in ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs", "weight_versions"):
    assert getattr(a, name) == getattr(b, name), name
assert a.status.value == b.status.value and a.effective_response_length == b.effective_response_length
assert a.get_reward_value(Args) == b.get_reward_value(Args) == 1.0
assert a.prefix_cache_info.prefix_cache_hit_rate == b.prefix_cache_info.prefix_cache_hit_rate
assert json.dumps(a.to_dict(), sort_keys=True, default=str) == json.dumps(
    {k: v for k, v in b.to_dict().items() if k in a.to_dict()}, sort_keys=True, default=str)
group = [script(Theirs), script(Theirs)]
group[1].reward = {"score": 0.0}
for reward in ({"score": 0.0}, {"score": 1.0}):
    mine = [script(ours.Sample), script(ours.Sample)]
    mine[1].reward = group[1].reward = reward
    theirs, mine = their_filter(Args, group), ours.check_reward_nonzero_std(Args, mine)
    assert (theirs.keep, theirs.reason) == (mine.keep, mine.reason), (theirs, mine)

# rollout dumps, in the test's folder: ours read by slime's own reader (its --load-debug-rollout-data, forge_load),
# and its writer's read here
from slime.observability.rollout_data_utils import load_debug_rollout_data, save_debug_rollout_data
from inverted.controller.rollouts import save_rollout_data
from inverted.train.offline import read_rollout_data
from inverted.types import Sample as Mine

work = sys.argv[1]
sample = Mine(group_index=0, index=1, prompt="p", tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 0],
              rollout_log_probs=[-0.5, 0.0], weight_versions=["3", "3"], reward=1.0, status=Mine.Status.COMPLETED)
save_rollout_data(work + "/ours_{rollout_id}.pt", 0, [sample], {})
theirs = load_debug_rollout_data(work + "/ours_{rollout_id}.pt", rollout_id=0)
assert isinstance(theirs[0], Theirs) and (theirs[0].tokens, theirs[0].loss_mask, theirs[0].rollout_log_probs,
                                          theirs[0].reward) == ([1, 2, 3, 4], [1, 0], [-0.5, 0.0], 1.0)
save_debug_rollout_data(work + "/theirs_{rollout_id}.pt", theirs, rollout_id=0, evaluation=False)
assert read_rollout_data(work + "/theirs_{rollout_id}.pt", 0) == [sample]
print("same")
"""


@pytest.mark.skipif(not os.environ.get("SLIME_SOURCE"), reason="slime's source is not at hand (SLIME_SOURCE=checkout)")
def test_our_sample_and_filter_behave_as_slimes_own(tmp_path):
    """Against slime's own ``Sample``, ``check_reward_nonzero_std`` and rollout-dump reader and writer,
    imported from its source (they need only torch): the same fields, the same
    ``append_response_tokens``, rewards and filter, and dumps each side reads."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["SLIME_SOURCE"], str(Path(__file__).parents[2])])}
    result = subprocess.run(
        [sys.executable, "-c", SAME_AS_SLIMES, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.stdout.strip() == "same", result.stderr[-3000:]


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo ran > ran.txt",))


def test_a_slime_dump_is_read_without_running_code(tmp_path, monkeypatch):
    """``--load-debug-rollout-data X.pt`` reads slime's dump with ``weights_only``: a pickle that would
    run code, or a file that is no dump, is a clear error."""
    from inverted.train.offline import read_rollout_data

    monkeypatch.chdir(tmp_path)
    torch.save({"rollout_id": 0, "samples": [_RunsCode()]}, tmp_path / "0.pt")
    with pytest.raises(SampleError, match="not a slime rollout dump"):
        read_rollout_data(str(tmp_path / "{rollout_id}.pt"), 0)
    assert not (tmp_path / "ran.txt").exists()
    torch.save([1, 2], tmp_path / "1.pt")
    with pytest.raises(SampleError, match="not a slime rollout dump"):
        read_rollout_data(str(tmp_path / "{rollout_id}.pt"), 1)
    view = slime.from_inverted(full_sample(), cls=slime.Sample)
    torch.save({"rollout_id": 2, "samples": [view.to_dict()]}, tmp_path / "2.pt")
    assert read_rollout_data(str(tmp_path / "{rollout_id}.pt"), 2) == [full_sample()]


def fill_without_versions(args, rollout_id, data_buffer, evaluation=False):
    """A slime rollout function that samples nothing itself (its tokens come from elsewhere): no
    log-probs, no versions."""
    groups = data_buffer.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            sample.tokens, sample.response_length, sample.reward = [5, 6, 7, 8], 2, 1.0
            sample.status = Sample.Status.COMPLETED
    return groups


@pytest.mark.parametrize("async_mode", [False, True])
def test_where_a_plugin_records_no_versions_the_serving_one_is_taken(async_mode):
    """Each token's version is the one serving when the rollout started: exact when training waits for
    the rollout, marked as inferred in the Sample where rollouts overlap training (``--async-mode``)."""
    import asyncio

    from inverted.plugins import RolloutContext, load_rollout_function
    from inverted.types import Task

    fn = load_rollout_function(f"{__name__}:fill_without_versions")
    tasks = [Task(lease_id="l", group_index=g, index=g, prompt_index=g, prompt="p") for g in range(2)]
    ctx = RolloutContext(
        rollout_id=4,
        config=RolloutConfig(),
        proxy_url="",
        proxy_api_key=None,
        router_url="",
        hf_checkpoint="",
        sampling={},
        flags={"rollout_batch_size": 2},
        weight_version="4",
        async_mode=async_mode,
    )
    for sample in asyncio.run(fn(ctx, tasks)):
        sample.validate()
        assert (sample.rollout_log_probs, sample.weight_versions) == (None, ["4", "4"])
        assert sample.metadata.get("weight_versions_inferred", False) is async_mode


# slime's own evaluation contract (tests/plugin_contracts/ in THUDM/slime, written here as slime's tests
# write them, with slime's types from our compat module): an eval function reads its own data and answers
# per dataset, with any number of Samples.


def _contract_sample(index: int, reward: float = 1.0) -> slime.Sample:
    return slime.Sample(
        index=index,
        prompt=f"prompt-{index}",
        response=f"response-{index}",
        label=f"label-{index}",
        tokens=[100 + index, 200 + index],
        response_length=2,
        reward=reward,
        status=slime.Sample.Status.COMPLETED,
        metadata={},
    )


def valid_eval_function(args, rollout_id, data_source, evaluation=False):
    assert evaluation is True
    sample = _contract_sample(rollout_id, reward=0.5)
    return slime.RolloutFnEvalOutput(
        data={"eval_contract": {"rewards": [sample.reward], "truncated": [False], "samples": [sample]}},
        metrics={"source": "contract"},
    )


def legacy_rollout_function(args, rollout_id, data_source, evaluation=False):
    if evaluation:
        sample = _contract_sample(1, reward=0.5)
        return {"legacy_eval": {"rewards": [sample.reward], "truncated": [False], "samples": [sample]}}
    return [[_contract_sample(1)]]


def one_sample_short(args, rollout_id, data_source, evaluation=False):
    """Not slime's form of an answer: groups, one Sample fewer than the tasks."""
    return [[_contract_sample(0)]]


@pytest.mark.parametrize(
    "function, dataset", [("valid_eval_function", "eval_contract"), ("legacy_rollout_function", "legacy_eval")]
)
def test_slimes_eval_functions_answer_per_dataset_and_are_logged_as_slime_logs_them(function, dataset):
    """One Sample for a dataset of four tasks is slime's answer, not a missing one: it is logged per
    dataset (``eval/NAME``, ``eval/NAME-truncated_ratio``) with the function's numeric metrics, and a
    ``--custom-eval-rollout-log-function-path`` sees slime's own data."""
    import argparse
    import asyncio

    from inverted.config import add_flags, build_section
    from inverted.controller.config import JobConfig
    from inverted.controller.evaluation import eval_metrics, log_evaluation
    from inverted.controller.rollouts import run_evaluation
    from inverted.plugins import EvalResults, Plugins, RolloutContext, load_rollout_function
    from inverted.types import Task

    evaluate = load_rollout_function(f"{__name__}:{function}", "--eval-function-path")
    seen = []
    plugins = Plugins(rollout=evaluate, evaluate=evaluate, eval_log=lambda *call: seen.append(call) and False)
    tasks = [Task(lease_id="eval", group_index=g, index=g, prompt_index=g, prompt="p") for g in range(4)]
    ctx = RolloutContext(
        rollout_id=1,
        config=RolloutConfig(eval_function_path=function),
        proxy_url="",
        proxy_api_key=None,
        router_url="",
        hf_checkpoint="",
        sampling={},
        evaluation=True,
        flags={"rollout_batch_size": 4, "n_samples_per_eval_prompt": 1},
    )
    answer = asyncio.run(run_evaluation(ctx, plugins, tasks))

    assert isinstance(answer, EvalResults) and list(answer.datasets) == [dataset]
    assert [s.tokens for s in answer.datasets[dataset].samples] == [[101, 201]]
    metrics = eval_metrics("eval", None, answer)
    assert metrics == {
        "eval/reward_mean": 0.5,
        "eval/pass_rate": 0.0,
        "eval/failed": 0.0,
        f"eval/{dataset}": 0.5,
        f"eval/{dataset}-truncated_ratio": 0.0,
    }  # "source": "contract" is no number: not a metric
    parser = argparse.ArgumentParser()
    add_flags(parser, JobConfig)
    cfg = build_section(JobConfig, parser.parse_args(["--hf-checkpoint", "/m", "--prompt-data", "p.jsonl"]))
    assert log_evaluation(cfg, plugins, 1, answer, metrics) == metrics
    ((rollout_id, data, logged),) = seen
    assert rollout_id == 1 and logged == metrics
    assert data == {dataset: {"rewards": [0.5], "truncated": [False], "samples": answer.datasets[dataset].samples}}


def test_an_eval_function_answering_samples_still_answers_every_task():
    import asyncio

    from inverted.controller.rollouts import run_evaluation
    from inverted.plugins import Plugins, RolloutContext, load_rollout_function
    from inverted.types import Task

    evaluate = load_rollout_function(f"{__name__}:one_sample_short", "--eval-function-path")
    tasks = [Task(lease_id="eval", group_index=g, index=g, prompt_index=g, prompt="p") for g in range(2)]
    ctx = RolloutContext(
        rollout_id=0,
        config=RolloutConfig(eval_function_path="one_sample_short"),
        proxy_url="",
        proxy_api_key=None,
        router_url="",
        hf_checkpoint="",
        sampling={},
        evaluation=True,
        flags={"rollout_batch_size": 2},
    )
    with pytest.raises(
        PluginError, match=r"--eval-function-path one_sample_short: expected one Sample per task \(2\), got 1"
    ):
        asyncio.run(run_evaluation(ctx, Plugins(rollout=evaluate, evaluate=evaluate), tasks))
