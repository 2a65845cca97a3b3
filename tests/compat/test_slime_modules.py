"""slime's rollout-side modules (``inverted/compat/slime_rollout.py``) under their own paths: the rule-based
reward models against answers worked out by hand, the loss masks against the chat template itself (and
against slime's own ``mask_utils.py`` where slime's source is at hand), the SFT rollout, and the
default generate-and-reward path in a real job."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from slime.rollout import rm_hub  # noqa: E402  (slime's path, resolved by compat: tests/conftest.py registers it)
from slime.utils.mask_utils import MultiTurnLossMaskGenerator, get_response_lengths  # noqa: E402
from transformers import AutoTokenizer

from envs.calculator import rows as calculator_rows
from envs.datasets import write_dataset
from inverted.compat import slime
from inverted.processes import free_port
from inverted.types import Sample
from tests.job.test_train_job import SMALL_RUN, check, inverted

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "times 4?"},
    {"role": "assistant", "content": "20", "step_loss_mask": 0},
    {"role": "user", "content": "minus 1?"},
    {"role": "assistant", "content": "19"},
]


def graded(rm_type: str, response: str, label, metadata=None):
    args = slime.SlimeArgs({"rm_type": rm_type})
    sample = slime.Sample(response=response, label=label, metadata=metadata or {})
    return asyncio.run(rm_hub.async_rm(args, sample))


def test_the_rule_based_reward_models_grade_as_slimes_do():
    assert graded("math", "so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1
    assert graded("math", "\\boxed{3}", "\\boxed{4}") == 0 and graded("math", "no box: 4", "4") == 0
    assert graded("deepscaler", "<think>maybe 7</think> It is \\boxed{12}.", "12") == 1
    assert graded("deepscaler", "It is \\boxed{12}.", "12") == 0  # no end of thinking: slime gives 0
    assert graded("dapo", "work...\nAnswer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert graded("dapo", "Answer: 41", "42")["score"] == -1.0
    assert graded("f1", "The Eiffel tower", "eiffel tower") == 1.0
    assert graded("f1", "Paris France", "Paris") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert graded("gpqa", "<think>A? no</think> The answer is (C)", "C") == 1.0
    assert graded("gpqa", "answer: B", "blue", {"choices": ["red", "blue"]}) == 1.0
    assert graded("boxed_f1", "\\boxed{Marie Curie} it was", "marie curie") == 1.0
    assert graded("random", "", "") in (0, 1)
    with pytest.raises(NotImplementedError, match="IFBench's instruction registry"):
        graded("ifbench", "x", "y")


def test_remote_rm_posts_prompt_response_and_label():
    from aiohttp import web

    seen = []

    async def handle(request):
        seen.append(await request.json())
        return web.json_response({"score": 0.75})

    port = free_port()

    async def main():
        app = web.Application()
        app.router.add_post("/rm", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            args = slime.SlimeArgs({"rm_type": "remote_rm", "rm_url": f"http://127.0.0.1:{port}/rm"})
            return await rm_hub.async_rm(args, slime.Sample(prompt="p", response="r", label="l"))
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == {"score": 0.75} and seen == [{"prompt": "p", "response": "r", "label": "l"}]


@pytest.fixture
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model("qwen2"))


def test_loss_masks_cover_what_each_assistant_message_says(tokenizer):
    ids, mask = MultiTurnLossMaskGenerator(tokenizer, "qwen").get_loss_mask(CHAT)
    assert ids == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    trained = MultiTurnLossMaskGenerator(tokenizer).get_text_from_loss_mask(ids, mask)
    assert trained == ["5<|im_end|>\n", "19<|im_end|>\n"]  # the header is not trained, nor step_loss_mask 0's turn
    assert get_response_lengths([mask]) == [len(mask) - mask.index(1)]


@pytest.mark.skipif(not os.environ.get("SLIME_SOURCE"), reason="slime's source is not at hand (SLIME_SOURCE=checkout)")
def test_loss_masks_equal_slimes_own(tokenizer):
    spec = importlib.util.spec_from_file_location(
        "slime_mask_utils", Path(os.environ["SLIME_SOURCE"]) / "slime" / "utils" / "mask_utils.py"
    )
    theirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs)
    for kind in ("qwen", "qwen3", "distill_qwen"):
        chat = CHAT if kind != "distill_qwen" else CHAT[1:3]
        assert MultiTurnLossMaskGenerator(tokenizer, kind).get_loss_mask(chat) == theirs.MultiTurnLossMaskGenerator(
            tokenizer, kind
        ).get_loss_mask(chat), kind


def test_the_sft_rollout_fills_samples_from_conversations(tokenizer, tiny_model):
    from slime.rollout.sft_rollout import generate_rollout

    from inverted.compat.slime_forms import SlimeDataBuffer
    from inverted.types import Task

    tasks = [Task(lease_id="l", group_index=g, index=0, prompt_index=g, prompt=CHAT) for g in range(2)]
    args = slime.SlimeArgs(
        {
            "hf_checkpoint": str(tiny_model("qwen2")),
            "rollout_batch_size": 2,
            "loss_mask_type": "qwen",
            "n_samples_per_prompt": 1,
            "rollout_concurrency": 4,
        }
    )
    buffer = SlimeDataBuffer()
    buffer.add_tasks(tasks, args)
    groups = generate_rollout(args, 0, buffer)
    ids, mask = MultiTurnLossMaskGenerator(tokenizer).get_loss_mask(CHAT)
    first = mask.index(1)
    for (sample,) in groups:
        assert (sample.tokens, sample.loss_mask, sample.response_length, sample.reward) == (
            ids,
            mask[first:],
            len(mask) - first,
            0,
        )


@pytest.mark.slow  # a whole job: left out of make test-fast
def test_slimes_generate_and_rm_group_in_a_job(tiny_model, tmp_path):
    """A rollout function of slime's shape that leaves generation and reward to slime's own default
    path, ``generate_and_rm_group``, with ``--rm-type``: every Sample is generated through the router
    and scored by the rule-based reward model."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 4)
    data = tmp_path / "rollout_{rollout_id}.jsonl"
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--rollout-function-path",
            "tests.compat.slime_plugins.rollout_by_slimes_default_path",
            "--rm-type",
            "random",
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(tmp_path / "run"),
            "--num-rollout",
            "1",
            *SMALL_RUN,
        )
    )
    saved = [Sample.from_json(json.loads(line)) for line in (tmp_path / "rollout_0.jsonl").read_text().splitlines()]
    assert len(saved) == 4
    for sample in saved:
        sample.validate()
        assert sample.reward in (0, 1) and sample.response_length > 0 and all(sample.loss_mask)
        assert sample.rollout_log_probs and len(set(sample.weight_versions)) == 1  # from the router's answers


def test_slimes_in_tree_plugins_import_from_a_checkout(tmp_path):
    """With ``INVERTED_SLIME_SOURCE``, a module of slime's that inverted does not provide (an in-tree
    plug-in) imports from the checkout's file, and it gets inverted's modules for slime's others."""
    plugin = tmp_path / "slime" / "rollout" / "my_rollout.py"
    plugin.parent.mkdir(parents=True)
    plugin.write_text(
        "from slime.rollout.sglang_rollout import generate_and_rm_group\n"
        "def generate_rollout(args, rollout_id, data_buffer, evaluation=False):\n    return []\n"
    )
    code = (
        "from inverted import compat\ncompat.register()  # as the command line does\n"
        "from inverted.plugins import load_rollout_function\n"
        "from inverted.compat import slime_rollout\n"
        "load_rollout_function('slime.rollout.my_rollout.generate_rollout')\n"
        "import slime.rollout.my_rollout as m\n"
        "assert m.generate_and_rm_group is slime_rollout.generate_and_rm_group\nprint('ok')"
    )
    env = {**os.environ, "INVERTED_SLIME_SOURCE": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
    without = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "INVERTED_SLIME_SOURCE": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "cannot load it (No module named 'slime.rollout.my_rollout')" in without.stderr


def test_slimes_small_helpers_behave_as_slimes(tiny_model):
    from slime.observability.trace_utils import build_sglang_meta_trace_attrs, trace_function, trace_span
    from slime.utils.async_utils import run
    from slime.utils.http_utils import get_rollout_num_engines
    from slime.utils.processing_utils import build_processor_kwargs, load_processor, load_tokenizer

    assert load_tokenizer(str(tiny_model("qwen2"))).encode("hi") == AutoTokenizer.from_pretrained(
        tiny_model("qwen2")
    ).encode("hi")
    assert load_processor(str(tiny_model("qwen2"))) is None  # text models only
    assert build_processor_kwargs() == {
        "text_kwargs": {"return_tensors": None, "return_mm_token_type_ids": False},
        "audio_kwargs": {"return_tensors": "pt"},
        "images_kwargs": {"return_tensors": "pt"},
        "videos_kwargs": {"return_tensors": "pt"},
    }

    async def twice(x):
        return 2 * x

    assert run(twice(21)) == 42 and run(twice(1)) == 2  # one background loop, reused
    assert get_rollout_num_engines(slime.SlimeArgs({"rollout_num_gpus": 0, "num_engines": 3})) == 3
    assert get_rollout_num_engines(slime.SlimeArgs({"rollout_num_gpus": 8, "rollout_num_gpus_per_engine": 2})) == 4
    with trace_span(None, "x") as span:  # tracing: no effect here
        span.update({"a": 1})
    assert trace_function("x")(twice) is twice
    assert build_sglang_meta_trace_attrs({"prompt_tokens": 3, "weight_version": "1"}) == {"prompt_tokens": 3}


@pytest.mark.slow  # a whole job: left out of make test-fast
def test_slimes_sft_rollout_trains_with_sft_loss_in_a_job(tiny_model, tmp_path):
    """slime's SFT recipe, unchanged: its ``sft_rollout`` turns conversations into Samples with no
    logprobs, and ``--loss-type sft_loss`` trains on them; the NLL falls."""
    rows = [
        {"input": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(8)
    ]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(tmp_path / "sft.jsonl"),
            "--rollout-function-path",
            "slime.rollout.sft_rollout.generate_rollout",
            "--loss-type",
            "sft_loss",
            "--loss-mask-type",
            "qwen",
            "--n-samples-per-prompt",
            "1",
            "--rollout-batch-size",
            "4",
            "--num-rollout",
            "4",
            "--num-engines",
            "1",
            "--lr",
            "1e-2",
            "--output-dir",
            str(tmp_path / "run"),
            "--log-level",
            "warning",
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    assert len(losses) == 4 and losses[-1] < 0.6 * losses[0], losses
    assert all(row["rollout/trained_samples"] == 4 for row in rows if "rollout/trained_samples" in row)
