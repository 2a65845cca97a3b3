"""Bootstrapping (``rollout_functions.bootstrap``) against the real proxy, engine, buffer store and
openai-agents SDK: a coached agent's success (the call forced) is played again through the agent
as its users write it, and the Sample is the chat template's render of the conversation that agent
held, token for token, with the mask 1 exactly on the model's replies. Then each stage's output is
what the next reads: stage 1's buffer file feeds a stage-2 ``inverted train`` that trains the
replayed Samples with ``sft_loss`` and evaluates both agents.

Stage 1's episodes are recorded through the proxy from a script (``Session.script``): a random tiny
model never writes a well-formed call, and the Sample's form, the forced opening on its first turn,
is the proxy's own either way.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import openai
import pytest

from envs import calculator_agent, reasoning_gym
from inverted.buffer.archive import BufferArchive
from inverted.buffer.datasets import PromptRecord
from inverted.buffer.store import SQLiteStore
from inverted.hf_checkpoint import load_tokenizer
from inverted.plugins import RolloutContext
from inverted.rollout.config import RolloutConfig
from inverted.rollout.proxy.client import ProxyClient
from inverted.types import Sample, Task
from rollout_functions import bootstrap
from tests.harnesses.checks import as_sampled
from tests.harnesses.sent import conversation
from tests.job.test_train_job import check, inverted, metrics_rows

CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+"]}
FORCED = '<tool_call>\n{"name": "calculator", "arguments":'


def rows(count: int) -> list[dict]:
    return json.loads(json.dumps(reasoning_gym.rows("basic_arithmetic", CONFIG, count, 0)))  # tuples as JSON has them


def coached_replies(tokenizer, row: dict, answer: str | None = None) -> list[list[int]]:
    """What the coached agent's model writes after the forced opening, then its answer (right by default)."""
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    expression = row["metadata"]["entry"]["metadata"]["expression"]
    call = f' {{"expression": "{expression}"}}}}\n</tool_call>'
    return [tokenizer.encode(call) + end, tokenizer.encode(answer or row["label"]) + end]


def tasks_of(store: SQLiteStore, count: int) -> list[Task]:
    return [
        Task(**{k: v for k, v in t.items() if k in Task.__dataclass_fields__})
        for t in store.lease(count, "stage-1", 60.0)
    ]


async def record_stage_1(proxy_url: str, tasks: list[Task], scripts: list[list[list[int]]]) -> list[Sample]:
    """The coached agent's episodes, each model call answered from its script; reward as the job's."""
    samples = []
    async with ProxyClient(proxy_url, api_key="admin-key") as proxy:
        for task, script in zip(tasks, scripts):
            session = await proxy.create_session(task.new_sample(), {"max_tokens": 64}, script)
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.token)
            reward = await calculator_agent.episode(task, client, coached=True)
            (sample,) = await proxy.finish(session.session_id, reward, only_last=True)
            samples.append(sample)
    return samples


def stage_1_buffer(path: Path, proxy_url: str, tokenizer, records: list[dict], wrong: set[int] = frozenset()) -> None:
    """A run's buffer file as stage 1 leaves it: the prompts, and one coached episode per prompt (a wrong
    answer for the rows in ``wrong``)."""
    store = SQLiteStore(
        str(path),
        n_samples_per_prompt=1,
        prompts=[PromptRecord(prompt=r["input"], label=r["label"], metadata=r["metadata"]) for r in records],
    )
    tasks = tasks_of(store, len(records))
    scripts = [coached_replies(tokenizer, r, "0" if i in wrong else None) for i, r in enumerate(records)]
    samples = asyncio.run(record_stage_1(proxy_url, tasks, scripts))
    assert [s.reward for s in samples] == [0.0 if i in wrong else 1.0 for i in range(len(records))]
    assert all(s.metadata["turns"][0]["forced"] == FORCED for s in samples)  # the opening, said on the turn
    store.submit([(t.lease_id, s) for t, s in zip(tasks, samples)])
    store.close()


def test_a_coached_success_replayed_through_the_users_agent_is_the_render_of_its_conversation(
    tiny_model, procs, tmp_path
):
    model = tiny_model()
    engine = procs.engine(model, "--log-requests")
    proxy = procs.proxy(engine.url, model, "--proxy-api-key", "admin-key")
    tokenizer = load_tokenizer(model)
    records = rows(2)
    stage_1_buffer(tmp_path / "buffer.db", proxy.url, tokenizer, records, wrong={1})

    sent: list[dict] = []

    async def capture(request: httpx.Request) -> None:
        sent.append({"path": request.url.path, "body": json.loads(request.content)})

    async def users_agent(task: Task, client) -> float:  # the agent as its users write it, its requests kept
        seen = client.with_options(http_client=httpx.AsyncClient(event_hooks={"request": [capture]}))
        return await calculator_agent.episode(task, seen)

    tasks = [
        Task(
            lease_id="l",
            group_index=i,
            index=i,
            prompt_index=i,
            prompt=r["input"],
            label=r["label"],
            metadata=r["metadata"],
        )
        for i, r in enumerate(records)
    ]
    ctx = RolloutContext(
        rollout_id=0,
        config=RolloutConfig(bootstrap_from=str(tmp_path)),
        proxy_url=proxy.url,
        proxy_api_key="admin-key",
        router_url=engine.url,
        hf_checkpoint=str(model),
        sampling={"max_tokens": 64},
        env=users_agent,
    )
    generated = len(engine.log_path.read_text().split(" request {"))
    replayed, unsolved = asyncio.run(bootstrap.generate_rollout(ctx, tasks))

    assert unsolved.status == Sample.Status.FAILED and "no successful episode" in unsolved.metadata["error"]
    assert replayed.status == Sample.Status.COMPLETED and replayed.reward == 1.0, replayed.metadata.get("error")
    assert len(engine.log_path.read_text().split(" request {")) == generated  # no call reached the engine
    # What the agent sent on its last call, read from the Responses API's documented shapes: its own
    # instructions (no example), the tool, the call it made, the tool's result; no tool_choice.
    last = sent[-1]["body"]
    assert "tool_choice" not in last and last["instructions"] == calculator_agent.INSTRUCTIONS
    messages, tools = conversation(sent[-1])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"]) == {
        "expression": records[0]["metadata"]["entry"]["metadata"]["expression"]
    }
    script = bootstrap.replies(stage_1_success(tmp_path / "buffer.db"), tokenizer, frozenset(tokenizer.all_special_ids))
    texts = [tokenizer.decode(reply) for reply in script]
    assert texts[0].startswith(FORCED)  # the forced opening is the model's own reply now
    # The Sample: the template's render of that conversation with the model's replies, token for token.
    spoken = as_sampled(messages, texts) + [{"role": "assistant", "content": texts[1].removesuffix("<|im_end|>")}]
    whole = tokenizer.encode(tokenizer.apply_chat_template(spoken, tools=tools, tokenize=False))
    assert (
        replayed.tokens == whole[: len(replayed.tokens)]
        and tokenizer.decode(whole[len(replayed.tokens) :]).strip() == ""
    )
    # The mask: 1 exactly on the replies (each where the template's generation prompt ends), 0 elsewhere.
    mask = [0] * len(replayed.tokens)
    for i, reply in zip((2, 4), script):
        start = len(
            tokenizer.encode(
                tokenizer.apply_chat_template(spoken[:i], tools=tools, tokenize=False, add_generation_prompt=True)
            )
        )
        assert replayed.tokens[start : start + len(reply)] == reply
        mask[start : start + len(reply)] = [1] * len(reply)
    prompt_len = len(replayed.tokens) - replayed.response_length
    assert replayed.loss_mask == mask[prompt_len:] and sum(replayed.loss_mask) == sum(map(len, script))
    assert replayed.rollout_log_probs is None and replayed.metadata["scripted"] is True
    assert set(replayed.weight_versions) == {"script"}


def stage_1_success(path: Path) -> Sample:
    """Stage 1's first Sample (its success), as the archive reads it."""
    archive = BufferArchive(path)
    (_, blob), _ = archive.episodes()
    archive.close()
    return Sample.from_json(json.loads(blob))


def test_a_scripted_session_refuses_what_it_cannot_answer_and_says_why(tiny_model, procs):
    model = tiny_model()
    engine = procs.engine(model)
    proxy = procs.proxy(engine.url, model, "--proxy-api-key", "admin-key")
    ask = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}

    async def play() -> None:
        async with ProxyClient(proxy.url, api_key="admin-key") as client:
            session = await client.create_session(script=[[5, 6, 7]])
            sdk = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.token, max_retries=0)
            with pytest.raises(openai.BadRequestError, match="one reply per call"):
                await sdk.chat.completions.create(**ask, n=2)
            cut = await sdk.chat.completions.create(**ask, max_tokens=2)  # cut as a server cuts a reply
            assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 2
            with pytest.raises(openai.ConflictError, match="more calls than the recorded episode"):
                await sdk.chat.completions.create(**ask)
            for script, says in (([[]], "a reply holds 1 to"), ([[10**9]], "token ids lie in")):
                with pytest.raises(Exception, match=says):
                    await client.create_session(script=script)

    asyncio.run(play())


@pytest.mark.slow  # a whole job: left out of make test-fast
def test_stage_2_reads_stage_1s_buffer_trains_the_replays_and_evaluates_both_agents(tiny_model, procs, tmp_path):
    model = tiny_model()
    engine = procs.engine(model)
    proxy = procs.proxy(engine.url, model, "--proxy-api-key", "admin-key")
    records = rows(2)
    stage_1 = tmp_path / "stage-1"
    stage_1.mkdir()
    stage_1_buffer(stage_1 / "buffer.db", proxy.url, load_tokenizer(model), records, wrong={1})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = tmp_path / "stage-2"
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(model),
            "--prompt-data",
            str(data),
            "--metadata-key",
            "metadata",
            "--env-path",
            "envs.calculator_agent:episode",
            "--rollout-function-path",
            "rollout_functions.bootstrap:generate_rollout",
            "--bootstrap-from",
            str(stage_1),
            "--loss-type",
            "sft_loss",
            "--output-dir",
            str(run),
            "--num-rollout",
            "1",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rollout-max-response-len",
            "64",
            "--num-engines",
            "1",
            "--log-level",
            "warning",
            "--save-debug-rollout-data",
            str(run / "replayed.jsonl"),
            "--eval-interval",
            "1",
            "--eval-prompt-data",
            str(data),
            "--eval-max-response-len",
            "4",
            "--eval-function-path",
            "rollout_functions.agent:generate_rollout",
            "--eval-variants",
            json.dumps({"coached": {"coached": True}}),
        )
    )
    trained = [Sample.from_json(json.loads(line)) for line in (run / "replayed.jsonl").read_text().splitlines()]
    # the solved prompt's two tasks replay its success; the other prompt has none, and nothing of it trains
    assert len(trained) == 2 and all(s.reward == 1.0 and s.rollout_log_probs is None for s in trained)
    assert {s.prompt[-1]["content"] if isinstance(s.prompt, list) else s.prompt for s in trained} == {
        records[0]["input"]
    }
    step = next(r for r in metrics_rows(run) if "train/loss" in r)
    assert step["rollout/trained_samples"] == 2 and step["rollout/failed"] == 2 and math.isfinite(step["train/loss"])
    evaluations = [r for r in metrics_rows(run) if "eval/pass_rate" in r]
    assert [r["step"] for r in evaluations] == [0, 1]
    for row in evaluations:  # the user's agent, and the coached one beside it
        assert {"eval/tool_call_rate", "eval/coached/pass_rate", "eval/coached/tool_call_rate"} <= row.keys()
