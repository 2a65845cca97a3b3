"""``inverted train`` end to end, as a user runs it: the real CLI, Ray, sgl-router, engines, proxy, buffer and trainer.

Each test starts the whole job as a subprocess on the tiny model with a handful of episodes, then
checks what it left behind: ``metrics.jsonl``, the buffer's SQLite file (every stored Sample with
its per-token weight versions), the saved rollout data, checkpoints and the Hugging Face export.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from envs.calculator import rows as calculator_rows
from envs.datasets import write_dataset
from envs.letters import rows as letter_rows
from inverted.train.shared_memory import orphaned_buckets, orphaned_manager_dirs, shared_buckets
from inverted.types import Sample

pytestmark = pytest.mark.slow  # whole jobs: left out of make test-fast

ROOT = Path(__file__).resolve().parents[2]
SMALL_RUN = [
    "--num-engines",
    "2",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--rollout-max-response-len",
    "6",
    "--lr",
    "1e-3",
    "--log-level",
    "warning",
]
ONE_ENGINE_RUN = [*SMALL_RUN[2:], "--num-engines", "1"]  # a rollout path end to end, at the least cost


def inverted(*args: str, timeout: float = 300, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pythonpath or ""), str(ROOT)]))}
    return subprocess.run(
        [sys.executable, "-m", "inverted.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def check(result: subprocess.CompletedProcess) -> None:
    """A job that failed shows its last Python traceback from its start (a torch error's C++ frames
    would fill any tail) and the end of its log."""
    at = result.stderr.rfind("Traceback (most recent call last)")
    head = f"{result.stderr[at : at + 4000]}\n[...]\n" if 0 <= at < len(result.stderr) - 6000 else ""
    assert result.returncode == 0, f"exit {result.returncode}\n{head}{result.stderr[-6000:]}"


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stored_samples(run_dir: Path) -> dict[tuple[int, int], Sample]:
    with sqlite3.connect(run_dir / "buffer.db") as db:
        return {
            (g, i): Sample.from_json(blob)
            for g, i, blob in db.execute("SELECT group_index, sample_index, sample FROM samples")
        }


@dataclass
class ResumedRun:
    run_dir: Path
    refused: subprocess.CompletedProcess
    resumed: subprocess.CompletedProcess
    buckets_left: set  # the weight buckets' shared memory the first run did not give back
    managers_left: set  # and the folders of torch's shared-memory manager it left in the temporary folder

    @property
    def steps(self) -> list[dict]:
        return [m for m in metrics_rows(self.run_dir) if "rollout/reward_mean" in m]


@pytest.fixture(scope="module")
def resumed_run(tiny_model, tmp_path_factory) -> ResumedRun:
    """Two rollouts (the second after a resume with --load), two engines behind the router, agent
    rollout, calculator tool env (one episode's env raises, another's reward is NaN), evaluation.

    The trainer is two pipeline stages (two Ray actors). With ``--colocate`` the engines release
    their memory while the trainer trains and get the new weights, assembled from both stages,
    after resuming. One job for every test of this group: each checks one thing it left behind.
    """
    tmp_path = tmp_path_factory.mktemp("resumed")
    (tmp_path / "flaky_env.py").write_text(
        textwrap.dedent("""
        from envs.calculator import episode as calculator_episode

        async def episode(task, client):
            if task.metadata.get("fail"):
                raise RuntimeError("the environment broke")
            reward = await calculator_episode(task, client)
            return float("nan") if task.metadata.get("nan") else reward
    """)
    )
    data = write_dataset(calculator_rows, tmp_path / "calculator.jsonl", count=8)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[1]["metadata"] = {"nan": True}  # one group per rollout fails (a bad reward, then an exception);
    rows[2]["metadata"] = {"fail": True}  # the other group of the rollout trains
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir, eval_data = tmp_path / "run", write_dataset(calculator_rows, tmp_path / "eval.jsonl", count=2, seed=1)
    args = [
        *("train", "--hf-checkpoint", str(tiny_model()), "--prompt-data", str(data), "--env-path", "flaky_env:episode"),
        *("--output-dir", str(run_dir), "--eval-interval", "2", "--eval-prompt-data", str(eval_data), "--colocate"),
        *("--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2", *SMALL_RUN),
    ]
    shared_before, managers_before = shared_buckets(), orphaned_manager_dirs()
    check(inverted(*args, "--num-rollout", "1", pythonpath=tmp_path))
    # orphaned: the test beside this one on the other worker may hold buckets of its own meanwhile
    left, managers_left = orphaned_buckets() - shared_before, orphaned_manager_dirs() - managers_before
    refused = inverted(*args, "--num-rollout", "2", pythonpath=tmp_path)  # the same directory, not resumed
    # Resume: the trainer continues from its checkpoint, the buffer from its file, the fresh servers get
    # the checkpoint's weights first (rollout 1's tokens must carry version 1).
    resumed = inverted(*args, "--num-rollout", "2", "--load", str(run_dir / "checkpoints"), pythonpath=tmp_path)
    check(resumed)
    return ResumedRun(run_dir, refused, resumed, left, managers_left)


def test_a_job_gives_back_the_shared_memory_of_its_weight_buckets(resumed_run):
    assert resumed_run.buckets_left == set()
    assert resumed_run.managers_left == set()


def test_a_second_run_in_the_same_directory_is_refused_unless_it_resumes(resumed_run):
    refused, run_dir = resumed_run.refused, resumed_run.run_dir
    assert refused.returncode == 2
    assert f"--output-dir {run_dir} holds an earlier run: resume it with --load" in refused.stderr
    assert f"inverted view {run_dir}" in resumed_run.resumed.stdout  # the resumed job says how to browse it


def test_the_resumed_job_goes_on_from_its_checkpoints_step_and_weights(resumed_run):
    steps = resumed_run.steps
    assert [m["step"] for m in steps] == [0, 1]
    assert [m["weight_version"] for m in steps] == [1, 2]
    for m in steps:
        for key in ("rollout/reward_mean", "train/loss", "time/rollout_s", "time/train_s", "time/sync_s"):
            assert m.get(key) is not None, key
        assert m["sync/servers"] == 2 and m["sync/buckets_s"] is not None and m["sync/total_s"] is not None
    # Rollout 0 ran on the starting weights; rollout 1 on the weights synced after step 0.
    for (group, _), sample in stored_samples(resumed_run.run_dir).items():
        if sample.status != Sample.Status.FAILED:
            assert set(sample.weight_versions) == ({"default"} if group < 2 else {"1"}), (group, sample.weight_versions)


def test_colocated_servers_hold_the_weights_both_pipeline_stages_synced_exactly(resumed_run):
    assert resumed_run.steps[1]["train/train_rollout_logprob_abs_diff"] < 1e-4


def test_a_failing_environment_and_a_nan_reward_fail_their_own_group_only(resumed_run):
    steps, samples = resumed_run.steps, stored_samples(resumed_run.run_dir)
    assert steps[0]["rollout/failed"] == steps[1]["rollout/failed"] == 2  # both samples of the failing prompt
    assert steps[0]["rollout/trained_samples"] == steps[1]["rollout/trained_samples"] == 2
    assert len(samples) == 8
    errors = {
        1: "SampleError: reward: expected a finite number or a dict, got nan",
        2: "RuntimeError: the environment broke",
    }
    for (group, _), sample in samples.items():
        if sample.status == Sample.Status.FAILED:
            assert sample.metadata["error"].startswith(errors[group])


def test_evaluation_runs_before_the_first_step_every_interval_and_after_the_last(resumed_run):
    evaluations = [m for m in metrics_rows(resumed_run.run_dir) if "eval/reward_mean" in m]
    # Evaluated before any update, after the first run's last step, and after rollout 1 (--eval-interval 2);
    # an evaluation's step counts the updates its policy had.
    assert [m["step"] for m in evaluations] == [0, 1, 2] and [m["weight_version"] for m in evaluations] == [0, 1, 2]
    assert all(m["eval/failed"] == 0 and 0 <= m["eval/pass_rate"] <= 1 for m in evaluations)


def test_multi_turn_episodes_train_the_models_tokens_only(resumed_run):
    for sample in stored_samples(resumed_run.run_dir).values():
        if sample.status == Sample.Status.FAILED:
            continue
        assert len(sample.metadata["turns"]) >= 2  # multi-turn: tool results or feedback between the model's turns
        mask = sample.loss_mask
        assert mask[0] == 1 and 0 in mask[mask.index(1) :]  # environment tokens inside the response are masked
        assert sum(mask) == sum(t["completion_tokens"] for t in sample.metadata["turns"])


def test_the_run_is_viewable_plotted_checkpointed_and_exported(resumed_run):
    run_dir = resumed_run.run_dir
    check_viewable(run_dir, stored_samples(run_dir))
    assert (run_dir / "reward.png").stat().st_size > 0
    assert list((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "hf")  # the final export loads


def check_viewable(run_dir: Path, samples: dict) -> None:
    """What ``inverted view`` reads of a real job: every stored Sample, the trainer's rows for the trained
    ones (written by the trainer's two pipeline stages, across the resume), the multi-turn episodes."""
    from inverted.view.config import ViewConfig
    from inverted.view.index import SampleQuery
    from inverted.view.service import open_run

    index, _ = open_run(ViewConfig(run_dir=str(run_dir)))
    index.refresh()
    rows = index.page(SampleQuery(page_size=100))["rows"]
    assert len(rows) == len(samples)
    trained = [r for r in rows if r["mismatch"] is not None]
    assert sorted(r["step"] for r in trained) == [0, 0, 1, 1]  # rollout/trained_samples: 2 each
    assert all(r["mismatch"] < 1e-4 for r in trained if r["step"] == 1)  # as train/train_rollout_logprob_abs_diff
    group, sample_index = next(key for key, s in samples.items() if s.status != Sample.Status.FAILED)
    page = index.trajectory(group, sample_index, 0)
    assert page["tokens"] == samples[group, sample_index].tokens and len(page["turns"]) >= 2
    tokenizer = index.tokenizer
    # each token's own text; an id the tokenizer has no token for (a random model's, past its vocabulary) as <id>
    assert page["text"] == [tokenizer.decode([t]) if t < len(tokenizer) else f"<{t}>" for t in page["tokens"]]
    # together, the sequence's (the runs between ids past the vocabulary decoded whole): but where a random
    # model split a character over tokens, which no token's text can show (each half decodes to a replacement mark)
    if not any("\ufffd" in text for text in page["text"]):
        runs = itertools.groupby(page["tokens"], key=lambda t: t < len(tokenizer))
        assert "".join(page["text"]) == "".join(
            tokenizer.decode(list(run)) if known else "".join(f"<{t}>" for t in run) for known, run in runs
        )
    index.close()


AGENT = """
import json, sys
from openai import OpenAI  # configured only by OPENAI_BASE_URL and OPENAI_API_KEY

client = OpenAI()
reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Name a color."}],
                                       logprobs=True, max_tokens=5)
choice = reply.choices[0]
with open(sys.argv[1] + "/" + client.base_url.path.split("/")[2], "w") as out:
    json.dump({"content": choice.message.content, "logprobs": [t.logprob for t in choice.logprobs.content]}, out)
"""


def test_subprocess_agent_then_debug_train_only(tiny_model, tmp_path):
    """An unchanged OpenAI-SDK program is recorded exactly; its saved rollouts then train with no servers."""
    (tmp_path / "agent.py").write_text(AGENT)
    seen = tmp_path / "seen"
    seen.mkdir()
    prompts = write_dataset(lambda n, rng: [{"input": "unused: the agent brings its own"}] * n, tmp_path / "p.jsonl", 4)
    model, data = tiny_model(), tmp_path / "rollouts" / "rollout_{rollout_id}.jsonl"
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(model),
            "--prompt-data",
            str(prompts),
            "--rollout-function-path",
            "rollout_functions.subprocess_agent:generate_rollout",
            "--agent-command",
            f"{sys.executable} {tmp_path / 'agent.py'} {seen}",
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(tmp_path / "rollout-run"),
            "--num-rollout",
            "2",
            *SMALL_RUN,
        )
    )

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    saved = [
        Sample.from_json(json.loads(line))
        for i in range(2)
        for line in Path(str(data).format(rollout_id=i)).read_text().splitlines()
    ]
    assert len(saved) == 8
    for sample in saved:
        assert sample.reward == 1.0  # exit status 0
        agent_saw = json.loads((seen / sample.session_id).read_text())
        assert sample.rollout_log_probs == agent_saw["logprobs"]
        assert tokenizer.decode(sample.response_tokens, skip_special_tokens=True) == agent_saw["content"]
        assert sample.loss_mask == [1] * sample.response_length

    run_dir = tmp_path / "train-run"
    check(
        inverted(
            "train",
            "--debug-train-only",
            "--hf-checkpoint",
            str(model),
            "--load-debug-rollout-data",
            str(data),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
        )
    )
    assert [m["step"] for m in metrics_rows(run_dir)] == [0, 1]


SLIME_STYLE = '''
import httpx

def generate_rollout(args, rollout_id, data_buffer, evaluation=False):
    """slime's signature, from outside the package: raw /generate on the router, like slime does."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    groups = data_buffer.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            prompt = [5, 6, 7]
            # the job's router takes its key alone (slime's own plug-ins call it through http_utils.post,
            # which sends it): an HTTP client of the plug-in's own sends it itself
            out = httpx.post(url, headers={"Authorization": f"Bearer {args.router_api_key}"},
                             json={"input_ids": prompt, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 3, "temperature": 1.0,
                                                       "ignore_eos": True}}).json()
            meta = out["meta_info"]
            sample.tokens = prompt + out["output_ids"]
            sample.response_length = len(out["output_ids"])
            sample.loss_mask = [1] * sample.response_length
            sample.rollout_log_probs = [lp for lp, _, _ in meta["output_token_logprobs"]]
            sample.weight_versions = [meta["weight_version"]] * sample.response_length
            sample.reward = float(len(out["output_ids"]))
            sample.status = sample.Status.COMPLETED
            sample.metadata["made_by"] = "my_rollout"
    return groups
'''


def test_a_rollout_function_from_outside_the_package(tiny_model, tmp_path):
    (tmp_path / "my_rollout.py").write_text(SLIME_STYLE)
    prompts = write_dataset(lambda n, rng: [{"input": "x"}] * n, tmp_path / "p.jsonl", 4)
    data = tmp_path / "out.jsonl"
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--rollout-function-path",
            "my_rollout.generate_rollout",
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(tmp_path / "run"),
            "--num-rollout",
            "1",
            *SMALL_RUN,
            pythonpath=tmp_path,
        )
    )
    saved = [Sample.from_json(json.loads(line)) for line in data.read_text().splitlines()]
    assert len(saved) == 4 and {s.metadata["made_by"] for s in saved} == {"my_rollout"}
    assert {s.reward for s in saved} == {3.0}


def test_bfloat16_engines_record_what_they_sampled_and_tis_weighs_the_fp32_trainer(tiny_model, tmp_path):
    """``--sglang-dtype bfloat16`` (slime's spelling; ``--engine-dtype`` is ours) on the embedded engines: they
    hold bf16 weights, every sync casts the fp32 trainer's into them, the rollout log-probs are the bf16
    policy's as sampled, and ``--use-tis`` weighs the trainer's ratios. The gap is bf16's at every step,
    after a sync too (fp32 engines: <= 1e-5); before, the flag was ignored on the embedded engines."""
    data = write_dataset(letter_rows, tmp_path / "letters.jsonl", count=8)
    run_dir = tmp_path / "run"
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(data),
            "--env-path",
            "envs.letters:episode",
            "--sglang-dtype",
            "bfloat16",
            "--use-tis",
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
            *ONE_ENGINE_RUN,
        )
    )
    steps = [r for r in metrics_rows(run_dir) if "rollout/reward_mean" in r]
    assert [r["weight_version"] for r in steps] == [1, 2]
    for row in steps:
        assert 1e-4 < row["train/fresh_logprob_abs_diff"] < 0.1, row
        assert 0.5 < row["train/tis_mean"] < 1.5, row


def leftover_processes(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and pid != str(os.getpid()):
            found.append(cmdline)
    return found


@pytest.mark.parametrize(
    "args, message",
    [
        (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag"),
        ([], "--rollout-function-path rollout_functions.agent:generate_rollout needs --env-path"),
        (["--env-path", "no_such_module:episode"], "--env-path='no_such_module:episode': cannot load it"),
        (["--env-path", "envs.letters:first_character"], "does not match def first_character(task, client)"),
        (["--env-path", "envs.letters:score"], "expected 'async def score(task, client) -> reward'"),
        (
            ["--env-path", "envs.letters:episode", "--input-key", "question"],
            "has no text or messages under --input-key 'question'",
        ),
    ],
)
def test_bad_input_fails_fast_with_a_clear_message(tiny_model, tmp_path, args, message):
    prompts = write_dataset(lambda n, rng: [{"input": "hi", "label": "abcde"}] * n, tmp_path / "p.jsonl", 2)
    result = inverted(
        "train",
        "--hf-checkpoint",
        str(tiny_model()),
        "--prompt-data",
        str(prompts),
        "--output-dir",
        str(tmp_path / "run"),
        *args,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / "buffer.db").exists()  # refused before anything started


def test_a_broken_rollout_function_stops_the_job_and_leaves_no_process(tiny_model, tmp_path):
    (tmp_path / "broken.py").write_text("async def generate_rollout(ctx, tasks):\n    return []\n")
    model = tmp_path / "model"  # a private copy: its path marks this job's processes
    shutil.copytree(tiny_model(), model)
    prompts = write_dataset(lambda n, rng: [{"input": "hi"}] * n, tmp_path / "p.jsonl", 2)
    result = inverted(
        "train",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(prompts),
        "--rollout-function-path",
        "broken:generate_rollout",
        "--output-dir",
        str(tmp_path / "run"),
        *SMALL_RUN,
        pythonpath=tmp_path,
    )
    assert result.returncode == 2
    assert "--rollout-function-path broken:generate_rollout: expected one Sample per task (4), got 0" in result.stderr
    assert leftover_processes(str(model)) == [] and leftover_processes(str(tmp_path / "run")) == []


RAY_DAEMONS = ("gcs_server", "raylet")


def is_rays(process) -> bool:
    """Ray's own processes: its binaries, its Python daemons and its workers (``ray::…``)."""
    name = process.name()
    return name in RAY_DAEMONS or name.startswith("ray::") or "/site-packages/ray/" in " ".join(process.cmdline())


def test_every_socket_a_job_opens_is_deliberate(tiny_model, tmp_path):
    """Every listening socket of a running job, found in its process tree from start-up to shut-down:
    the job's own services (buffer, proxy, router and its metrics, engines, the trainer's store)
    listen on loopback only, and refuse a caller without the job's key; what listens on other
    addresses is Ray's, run in token mode (docs/deployment.md, "Network and keys")."""
    import time

    import httpx
    import psutil

    from tests.job.test_async_and_faults import start_job

    log, run_dir = tmp_path / "job.log", tmp_path / "run"
    data = write_dataset(calculator_rows, tmp_path / "calculator.jsonl", count=8)
    job = start_job(
        "--hf-checkpoint",
        str(tiny_model()),
        "--prompt-data",
        str(data),
        "--env-path",
        "envs.calculator:episode",
        "--output-dir",
        str(run_dir),
        "--num-rollout",
        "3",
        *ONE_ENGINE_RUN,
        log=log,
    )
    seen: dict[tuple[str, int], tuple[str, bool]] = {}  # address -> (command line, Ray's)
    refused: dict[str, int] = {}  # our services' keyed routes, called without the key
    ray_token_mode = []
    routes = {
        "inverted.cli buffer": "/tasks/lease",
        "inverted.cli proxy": "/sessions",
        "serve-engine": "/update_weights_from_disk",
    }
    root = psutil.Process(job.pid)
    while job.poll() is None:
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error, httpx.HTTPError):
                for conn in process.net_connections(kind="inet"):
                    address = (conn.laddr.ip, conn.laddr.port)
                    if conn.status != psutil.CONN_LISTEN or address in seen:
                        continue
                    # the controller opens no socket itself: what its process listens on is Ray's driver
                    cmdline, rays = " ".join(process.cmdline()), is_rays(process) or process.pid == job.pid
                    seen[address] = (cmdline, rays)
                    if process.name() == "gcs_server":
                        ray_token_mode.append(process.environ().get("RAY_AUTH_MODE"))
                    for role, route in routes.items():
                        if role in cmdline and not rays:
                            refused[role] = httpx.post(f"http://{address[0]}:{address[1]}{route}", json={}).status_code
        time.sleep(0.1)
    check(subprocess.CompletedProcess(job.args, job.returncode, "", log.read_text()))
    ours = {address: cmdline for address, (cmdline, rays) in seen.items() if not rays}
    assert {ip for ip, _ in ours} == {"127.0.0.1"}, [(a, c[:80]) for a, c in ours.items() if a[0] != "127.0.0.1"]
    assert len([a for a, cmdline in ours.items() if "sglang::router" in cmdline]) == 2  # its API and its metrics
    assert refused == {role: 401 for role in routes}, refused
    beyond = {cmdline.split()[0] for (ip, _), (cmdline, rays) in seen.items() if not ip.startswith("127.")}
    assert beyond and ray_token_mode == ["token"], (beyond, ray_token_mode)  # Ray's, with its token on
