"""Asynchronous training and fault tolerance, end to end: the real job, real processes, real kills.

- ``--async-mode`` with one-step-off staleness, partial rollouts and a whole-job ``kill -9`` after
  a checkpoint, then ``--load``: every trained Sample is within the bound token by token, mixed
  versions are recorded exactly (the trainer's log-probs equal the rollout's on every token of the
  current version), nothing is trained twice and the groups left waiting in the buffer are trained
  after the resume.
- A rollout server killed mid-run is replaced: the run finishes, the replacement serves the
  current weights under the current version, and every task ends as exactly one trained,
  filtered or failed group.
- The proxy, the buffer service and the router killed mid-run start again at their addresses; the
  episodes the proxy took down are played again from their tasks, and nothing is trained twice.
- A trainer rank killed mid-run is restarted in place from the state it keeps for that, and trains
  the steps since again, to the weights the servers hold.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from envs import long_tail
from envs.datasets import write_dataset
from inverted.train.shared_memory import shared_buckets
from inverted.types import Sample, version_number
from tests.job.test_train_job import ROOT, metrics_rows, stored_samples

# Whole jobs (left out of make test-fast) whose checks need the machine to themselves: a kill that must
# land between two moments, a weight update that must cut into a running call.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

RUN = [
    "--num-engines",
    "2",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--lr",
    "1e-3",
    "--env-path",
    "envs.long_tail:episode",
    "--log-level",
    "warning",
]


def long_tail_data(path: Path, count: int, short_s: float, long_s: float) -> Path:
    """The long-tail dataset with the test's own latencies (short and long episodes)."""
    write_dataset(long_tail.rows, path, count=count)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row["metadata"]["latency_s"] = long_s if row["metadata"]["latency_s"] > long_tail.SHORT_S else short_s
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def start_job(*args: str, log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """``inverted train`` in its own session, so that the whole job can be killed at once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "inverted.cli", "train", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )


def wait_for(condition, job: subprocess.Popen, log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None, f"the job exited early ({job.returncode}):\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def finish(job: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    assert job.wait(timeout) == 0, f"exit {job.returncode}\n{log.read_text()[-6000:]}"


def processes_with(text: str) -> list[int]:
    """Pids of the processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def freeze(group: int, timeout: float = 30.0) -> None:
    """SIGSTOP a process group and wait until every thread of every process in it has stopped.

    A thread stops only on its way back from the kernel: one inside a system call (the buffer's
    SQLite commit, say) finishes it first, so without the wait its write could land after a look.
    """
    os.killpg(group, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for entry in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
            try:
                fields = entry.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group:
                states.append(fields[0])
        if all(state in "TtZX" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process group {group} did not stop within {timeout} s")


def own_model(tiny_model, tmp_path: Path) -> Path:
    """A private copy of the tiny model: its path names this test's engine processes."""
    return Path(shutil.copytree(tiny_model(), tmp_path / "model"))


def latest_checkpoint(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().removeprefix("iter_")) if latest.exists() else 0


def group_states(run_dir: Path, *, read_only: bool = True) -> dict[int, str]:
    """The buffer's groups and their states, read from its file (read-only: the job may be running)."""
    return buffer_query(run_dir, "SELECT group_index, state FROM groups", read_only=read_only)


def buffer_query(run_dir: Path, query: str, *, read_only: bool = True) -> dict:
    database = f"file:{run_dir / 'buffer.db'}{'?mode=ro' if read_only else ''}"
    with closing(sqlite3.connect(database, uri=True)) as db:
        return dict(db.execute(query))


def durable_states(run_dir: Path, scratch: Path) -> tuple[dict[int, str], dict[str, int]]:
    """The group states and task counts by state that a kill would leave: a copy of the database and
    its WAL, opened without the live WAL index. A commit whose WAL write had returned but whose index
    update had not (the writer stopped in between) is invisible to a reader of the live index, yet
    survives the kill."""
    scratch.mkdir(exist_ok=True)
    for suffix in ("", "-wal"):
        if (run_dir / f"buffer.db{suffix}").exists():
            shutil.copyfile(run_dir / f"buffer.db{suffix}", scratch / f"buffer.db{suffix}")
    (scratch / "buffer.db-shm").unlink(missing_ok=True)
    try:  # its first reader rebuilds the index from the WAL
        return (
            group_states(scratch, read_only=False),
            buffer_query(scratch, "SELECT state, COUNT(*) FROM tasks GROUP BY state", read_only=False),
        )
    finally:
        for suffix in ("", "-wal", "-shm"):
            (scratch / f"buffer.db{suffix}").unlink(missing_ok=True)


def test_async_one_step_off_with_partial_rollouts_survives_a_job_kill(tiny_model, tmp_path):
    model, run_dir = own_model(tiny_model, tmp_path), tmp_path / "run"
    data = long_tail_data(tmp_path / "long_tail.jsonl", count=64, short_s=0.05, long_s=1.0)
    args = [
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--output-dir",
        str(run_dir),
        "--async-mode",
        "--max-weight-staleness",
        "1",
        "--partial-rollout",
        "--pause-mode",
        "abort",
        "--rollout-max-response-len",
        "128",
        "--save-interval",
        "1",
        "--save-debug-rollout-data",
        str(run_dir / "trained" / "{rollout_id}.jsonl"),
        *RUN,
    ]

    shared_before = shared_buckets()
    # More rollouts than it will reach: it is killed at the first look that finds a finished group
    # waiting (from step 3 on; on a fast machine that can take a few steps), and the resumed job
    # then runs 6 steps past the checkpoint. 64 prompts of 2 per rollout last 32 rollouts.
    first = start_job(*args, "--num-rollout", "32", log=tmp_path / "first.log")
    try:
        # After a checkpoint, at a moment when finished groups wait in the buffer for the trainer:
        # the job is frozen (SIGSTOP) to look, so that what is seen is what the kill leaves.
        while True:
            wait_for(lambda: latest_checkpoint(run_dir) >= 3, first, tmp_path / "first.log")
            freeze(first.pid)
            groups, tasks = durable_states(run_dir, tmp_path / "look")
            if "complete" in groups.values():
                break
            assert latest_checkpoint(run_dir) < 20, "no moment with a finished group waiting for the trainer was seen"
            os.killpg(first.pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the whole job: controller, services, servers, Ray
        first.wait()
    deadline = time.monotonic() + 60
    while processes_with(str(model)) and time.monotonic() < deadline:  # servers go when their Ray worker does
        time.sleep(0.5)
    assert processes_with(str(model)) == []  # nothing of the killed job lives on
    left = shared_buckets() - shared_before  # a killed trainer cannot unlink its buckets ...
    resumed_at = latest_checkpoint(run_dir)
    end = resumed_at + 6
    waiting = {g for g, state in group_states(run_dir).items() if state == "complete"}
    rows_before = len(metrics_rows(run_dir))

    second = start_job(
        *args, "--num-rollout", str(end), "--load", str(run_dir / "checkpoints"), log=tmp_path / "second.log"
    )
    finish(second, tmp_path / "second.log")
    assert left and shared_buckets() <= shared_before  # ... the resumed job did

    resumed = metrics_rows(run_dir)[rows_before:]
    assert [m["step"] for m in resumed] == list(range(resumed_at, end))  # on from the step after the checkpoint
    trained: dict[tuple[int, int], int] = {}
    mixed = 0
    for step in range(end):
        for line in (run_dir / "trained" / f"{step}.jsonl").read_text().splitlines():
            sample = Sample.from_json(json.loads(line))
            key = (sample.group_index, sample.index)
            assert key not in trained, f"{key} trained at steps {trained[key]} and {step}"
            trained[key] = step
            versions = [version_number(v) for v in sample.weight_versions]
            assert versions == sorted(versions)  # a sample only ever moves on to newer weights
            assert step - min(versions) <= 1, (step, sample.weight_versions)  # the bound, token by token
            mixed += len(set(versions)) > 1
    # What the crash left waiting in the buffer is trained after the resume, unless it had become
    # too stale for the resumed policy (then the buffer counts it as dropped).
    trained_after = {g for (g, _), step in trained.items() if step >= resumed_at}
    final = group_states(run_dir)
    assert waiting & trained_after, (waiting, trained_after)
    assert all(g in trained_after or final[g] == "dropped_stale" for g in waiting), (waiting, trained_after, final)

    # A batch the buffer served past the last checkpoint is not lost: the resumed job trains that step on it.
    assert {g for g, state in final.items() if state == "consumed"} == {g for g, _ in trained}

    rows = metrics_rows(run_dir)
    assert all(m["async/staleness_max"] <= 1 for m in rows)
    assert sum(m["rollout/resumed_calls"] for m in rows) > 0 and mixed  # updates cut into running calls ...
    fresh = [m["train/fresh_logprob_abs_diff"] for m in rows if m.get("train/fresh_logprob_abs_diff") is not None]
    assert fresh and max(fresh) < 1e-4  # ... and each token's recorded version is the one that sampled it
    # The killed run's leases went back at once (whether episodes held any depends on the moment).
    assert rows[-1]["buffer/leases_released"] >= tasks.get("leased", 0)


def first_line_time(log: Path) -> float:
    """Seconds of the day at a log's first timed line (``HH:MM:SS [role] ...``)."""
    stamp = next(m for line in log.read_text().splitlines() if (m := re.match(r"(\d\d):(\d\d):(\d\d) ", line)))
    return int(stamp[1]) * 3600 + int(stamp[2]) * 60 + int(stamp[3])


def test_killed_engines_are_replaced_side_by_side_with_the_current_weights(tiny_model, tmp_path):
    model, run_dir = own_model(tiny_model, tmp_path), tmp_path / "run"
    data = long_tail_data(tmp_path / "long_tail.jsonl", count=32, short_s=0.5, long_s=0.5)
    log = tmp_path / "job.log"
    job = start_job(
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--output-dir",
        str(run_dir),
        "--num-rollout",
        "14",
        "--rollout-max-response-len",
        "64",
        *RUN,
        log=log,
    )
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics_rows(run_dir)) >= 1, job, log)
        engines = processes_with(f"serve-engine --model {model} ")
        assert len(engines) == 2
        # Ray starts its workers at nice 15; the engines it launches must run at the job's priority.
        assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in engines} == {os.getpriority(os.PRIO_PROCESS, job.pid)}
        # Their weight and control routes take only the job's own key (the weight syncs below used it),
        # which is on no command line (a pipe brought it: processes.Secret).
        argv = Path(f"/proc/{engines[1]}/cmdline").read_bytes().split(b"\0")
        url = f"http://127.0.0.1:{int(argv[argv.index(b'--port') + 1])}"
        assert not any(b"api-key" in arg for arg in argv), argv
        assert httpx.post(url + "/update_weights_from_disk", json={"model_path": str(model)}).status_code == 401
        for pid in engines:  # both: no server is left, and the calls wait for the replacements
            os.kill(pid, signal.SIGKILL)
        finish(job, log)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)

    rows = metrics_rows(run_dir)
    # Steps take ~1 s, a replacement ~5-10 s to start: both are back well before the last steps,
    # started side by side (one after the other, the second would wait for the first to be healthy).
    assert rows[-1]["faults/engine_deaths"] == rows[-1]["faults/engine_restarts"] == 2
    started = [first_line_time(run_dir / "logs" / f"engine-{i}.log") for i in (2, 3)]
    assert rows[-1]["sync/servers"] == 2 and abs(started[0] - started[1]) < 3.0, started
    assert sum(m["rollout/failed"] for m in rows) == 0  # the dead servers' calls waited and went on
    # The replacement got the current weights before serving: every token of rollout r carries
    # version r (the groups of rollout r are 2r and 2r+1), and the trainer's log-probs equal them.
    for (group, _), sample in stored_samples(run_dir).items():
        if sample.status != Sample.Status.FAILED:
            assert {version_number(v) for v in sample.weight_versions} == {group // 2}, (group, sample.weight_versions)
    assert max(m.get("train/fresh_logprob_abs_diff", 0.0) for m in rows) < 1e-4
    # Accounting: every task done, every group trained, filtered or failed, and trained exactly once.
    states = group_states(run_dir)
    assert len(states) == 28 and set(states.values()) <= {"consumed", "filtered", "failed"}
    with sqlite3.connect(run_dir / "buffer.db") as db:
        assert db.execute("SELECT DISTINCT state FROM tasks").fetchall() == [("done",)]
    assert sum(m["rollout/trained_samples"] for m in rows) == 2 * list(states.values()).count("consumed")


def test_killed_services_start_again_at_their_address_and_lost_episodes_are_played_again(tiny_model, tmp_path):
    """SIGKILL the proxy, the buffer service and the router of a running job, one after the other:
    each is started again at its own address, the episodes the proxy took down come back aborted and
    their tasks are played again, and every task still ends as exactly one trained, filtered or
    failed group."""
    model, run_dir = own_model(tiny_model, tmp_path), tmp_path / "run"
    data = long_tail_data(tmp_path / "long_tail.jsonl", count=64, short_s=1.0, long_s=1.0)
    log = tmp_path / "job.log"
    job = start_job(
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--output-dir",
        str(run_dir),
        "--num-rollout",
        "16",
        "--rollout-max-response-len",
        "8",
        *RUN,
        log=log,
    )
    commands = {
        "proxy": f"inverted.cli proxy --config {run_dir}/services/proxy.yaml",
        "buffer": f"inverted.cli buffer --config {run_dir}/services/buffer.yaml",
        "router": "sglang::router",
    }  # sgl-router names its process so
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics_rows(run_dir)) >= 1, job, log)
        for restarts, (name, command) in enumerate(commands.items(), 1):
            (pid,) = [p for p in processes_with(command) if os.getsid(p) == job.pid]  # the job's own
            if name == "proxy":  # mid-rollout: episodes are in flight (each takes a second)
                rows = len(metrics_rows(run_dir))
                wait_for(lambda: len(metrics_rows(run_dir)) > rows, job, log)
                time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: log.read_text().count(" is back at ") >= restarts, job, log, timeout=120)
            wait_for(lambda: [p for p in processes_with(command) if os.getsid(p) == job.pid and p != pid], job, log)
        finish(job, log)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)

    rows = metrics_rows(run_dir)
    assert rows[-1]["faults/service_restarts"] == 3 and rows[-1]["faults/engine_deaths"] == 0
    aborted = sum(m["rollout/aborted"] for m in rows)
    assert aborted >= 1 and sum(m["rollout/failed"] for m in rows) == 0  # lost, not failed: played again
    assert buffer_query(run_dir, "SELECT name, value FROM counters")["samples_requeued_aborted"] == aborted
    # Accounting: every group trained or filtered (none failed), and trained exactly once; a task the
    # proxy lost went back to the queue, so the last steps may leave a group open with queued tasks.
    states = group_states(run_dir)
    assert set(states.values()) <= {"consumed", "filtered", "open"}, states
    tasks = buffer_query(run_dir, "SELECT group_index || '/' || sample_index, state FROM tasks")
    assert set(tasks.values()) <= {"done", "queued"}
    assert {int(key.split("/")[0]) for key, state in tasks.items() if state == "queued"} <= {
        group for group, state in states.items() if state == "open"
    }
    assert sum(m["rollout/trained_samples"] for m in rows) == 2 * list(states.values()).count("consumed")


def sync_job_args(tiny_model: Path, tmp_path: Path, save_interval: int) -> tuple[list[str], Path, Path]:
    """A sync job's flags that save every ``save_interval`` steps and write what each step trained:
    the flags, the run's directory and the pattern of the trained files."""
    model, run_dir = own_model(tiny_model, tmp_path), tmp_path / "run"
    data = long_tail_data(tmp_path / "long_tail.jsonl", count=64, short_s=0.3, long_s=0.3)
    trained_at = run_dir / "trained" / "{rollout_id}.jsonl"
    args = [
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--output-dir",
        str(run_dir),
        "--rollout-max-response-len",
        "8",
        "--save-interval",
        str(save_interval),
        "--save-debug-rollout-data",
        str(trained_at),
        *RUN,
    ]
    return args, run_dir, trained_at


def resume_and_check(args: list[str], run_dir: Path, trained_at: Path, tmp_path: Path, first: int) -> None:
    """Start the killed job again with ``--load`` for 6 steps: the steps from ``first`` (its checkpoint's)
    train what the dead job was served for them, nothing else, and every consumed group is in exactly
    one surviving step's training, as the buffer itself records."""
    dead_steps = [m["step"] for m in metrics_rows(run_dir)]
    served = {step: Path(str(trained_at).format(rollout_id=step)).read_text() for step in dead_steps if step >= first}
    assert served, dead_steps

    second = start_job(*args, "--num-rollout", "6", "--load", str(run_dir / "checkpoints"), log=tmp_path / "second.log")
    finish(second, tmp_path / "second.log")

    assert "training the batch the killed run was served for this step" in (tmp_path / "second.log").read_text()
    for step, text in served.items():
        assert Path(str(trained_at).format(rollout_id=step)).read_text() == text, step
    trained: dict[tuple[int, int], int] = {}
    for step in range(6):
        for line in Path(str(trained_at).format(rollout_id=step)).read_text().splitlines():
            sample = Sample.from_json(json.loads(line))
            key = (sample.group_index, sample.index)
            assert key not in trained, f"{key} trained at steps {trained[key]} and {step}"
            trained[key] = step
    consumed = {g for g, state in group_states(run_dir).items() if state == "consumed"}
    assert consumed == {g for g, _ in trained}  # every served group trained, once, in a surviving step
    # ... and the buffer says so itself: each group's recorded step is the surviving step that trained it
    recorded = buffer_query(run_dir, "SELECT group_index, trained_step FROM groups WHERE state = 'consumed'")
    assert recorded == {g: step for (g, _), step in trained.items()}


def test_a_sync_job_killed_past_its_checkpoint_trains_each_served_batch_once_after_resume(tiny_model, tmp_path):
    """A sync job checkpoints every second step and is killed after a step past the checkpoint was
    served and trained: the resumed job trains the batches the dead one was served for those steps
    (no rollout), so every consumed group is in exactly one surviving step's training."""
    args, run_dir, trained_at = sync_job_args(tiny_model, tmp_path, save_interval=2)
    first = start_job(*args, "--num-rollout", "32", log=tmp_path / "first.log")
    try:
        while True:  # frozen to look: step 2 trained, its checkpoint (after step 3) not yet written
            wait_for(
                lambda: (run_dir / "metrics.jsonl").exists() and len(metrics_rows(run_dir)) >= 3,
                first,
                tmp_path / "first.log",
            )
            freeze(first.pid)
            if latest_checkpoint(run_dir) == 2:
                break
            assert latest_checkpoint(run_dir) < 20, "never caught between a trained step and its checkpoint"
            os.killpg(first.pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    resume_and_check(args, run_dir, trained_at, tmp_path, first=2)


def test_a_sync_job_killed_before_its_first_save_resumes_from_the_start_with_the_same_command(tiny_model, tmp_path):
    """Killed before any save finished (``--save-interval 0``: only at the end), the job is started again
    with ``--load`` all the same, as slime's users do: no checkpoint to load, so the trainer starts from
    the HF weights at step 0 and trains the batches the dead job was served, each once."""
    args, run_dir, trained_at = sync_job_args(tiny_model, tmp_path, save_interval=0)
    first = start_job(*args, "--num-rollout", "32", log=tmp_path / "first.log")
    try:
        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and len(metrics_rows(run_dir)) >= 2,
            first,
            tmp_path / "first.log",
        )
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert not (run_dir / "checkpoints" / "latest").exists()
    resume_and_check(args, run_dir, trained_at, tmp_path, first=0)
    assert "no save has finished there" in (tmp_path / "second.log").read_text()


def test_a_killed_trainer_rank_restarts_in_place_from_its_own_saved_state_and_trains_the_steps_since_again(
    tiny_model, tmp_path
):
    """SIGKILL the trainer's rank twice in a running sync job that keeps no checkpoint (``--save-interval``
    at its default, 0) but keeps the trainer's own state every third step (``--restart-save-interval
    3``, in the background): each time the job starts a new trainer from that state, trains again the
    batches the buffer served since, and goes on without a resume. The restarted trainer stands where
    the dead one stood: its log-probs of every later batch equal the servers', whose weights the dead
    trainer pushed; and every served group is recorded trained in exactly one step."""
    model, run_dir = own_model(tiny_model, tmp_path), tmp_path / "run"
    data = long_tail_data(tmp_path / "long_tail.jsonl", count=64, short_s=0.3, long_s=0.3)
    trained_at = run_dir / "trained" / "{rollout_id}.jsonl"
    log = tmp_path / "job.log"
    job = start_job(
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--output-dir",
        str(run_dir),
        "--num-rollout",
        "12",
        "--rollout-max-response-len",
        "8",
        "--restart-save-interval",
        "3",
        "--save-debug-rollout-data",
        str(trained_at),
        *RUN,
        log=log,
    )
    killed = []
    try:
        for restarts, steps in enumerate((5, 8), 1):  # two steps past a saved state (after steps 3 and 6)
            wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics_rows(run_dir)) >= steps, job, log)
            (pid,) = [p for p in processes_with("ray::TrainActor") if os.getsid(p) == job.pid]  # the job's own rank
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            wait_for(lambda: log.read_text().count("the trainer is back at step") >= restarts, job, log, timeout=180)
        finish(job, log)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)

    rows, text = metrics_rows(run_dir), log.read_text()
    assert rows[-1]["faults/trainer_restarts"] == 2 and len({r["step"] for r in rows if "rollout/samples" in r}) == 12
    assert text.count(f"restarting the trainer from {run_dir / 'restart'}") == 2  # its own state, not the model's
    replays = [
        (int(start), int(count)) for start, count in re.findall(r"from step (\d+), (\d+) batches trained again", text)
    ]
    assert len(replays) == 2 and all(count >= 1 for _, count in replays), replays  # the steps since that state
    # The restarted trainer reproduced the dead one's weights: the servers kept those, and the
    # trainer's log-probs of what they sampled next equal theirs (a trainer at the saved state's weights,
    # or the model's, would differ by the lost steps' updates).
    assert max(r["train/fresh_logprob_abs_diff"] for r in rows if "train/fresh_logprob_abs_diff" in r) < 1e-4
    # Every served group was trained in exactly one step, the one the buffer recorded.
    trained: dict[int, int] = {}
    for step in range(12):
        for line in Path(str(trained_at).format(rollout_id=step)).read_text().splitlines():
            group = json.loads(line)["group_index"]
            assert trained.setdefault(group, step) == step, f"group {group} in steps {trained[group]} and {step}"
    recorded = buffer_query(run_dir, "SELECT group_index, trained_step FROM groups WHERE state = 'consumed'")
    assert recorded == trained
    assert not any(shared_buckets(pid) for pid in killed)  # the dead ranks' weight buckets were freed
    # The final checkpoint supersedes the restart state, which goes.
    assert latest_checkpoint(run_dir) == 12 and not (run_dir / "restart").exists()


def test_the_short_chaos_bench_kills_each_kind_and_nothing_is_lost_or_trained_twice(tmp_path):
    """``bench/chaos.py``'s short version: six random SIGKILLs, one of each kind (engine, router,
    proxy, buffer, trainer, the whole job), in a job that trains (``make demo``'s task)."""
    out = tmp_path / "chaos.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos.py"),
            "--kills",
            "6",
            "--rollouts",
            "40",
            "--gap",
            "3",
            "--no-baseline",
            "--seed",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["crashes"] == [] and report["steps"] == 40  # it stopped only when killed, and ran to its end
    assert report["exit"] == 0 and report["kinds_killed"] == sorted(
        ["engine", "router", "proxy", "buffer", "trainer", "job"]
    ), {key: report[key] for key in ("recoveries", "skipped")}
    assert all(r["recovery_s"] is not None and r["recovery_s"] <= 90 for r in report["recoveries"]), report[
        "recoveries"
    ]
    # every kind but the job healed in place (a recovery that stopped the job carries its log's tail)
    assert not any("stopped the job" in r["kind"] for r in report["recoveries"]), report["recoveries"]
    assert report["samples_trained_twice"] == report["served_never_trained"] == report["trained_never_served"] == 0
    assert report["samples_per_task_max"] == 1 and set(report["tasks"]) <= {"done", "queued"}, report
    assert report["buffer_disagrees_with_training"] == 0  # the buffer's trained steps are the surviving training
    assert report["samples_without_their_rollout"] == 0
    assert report["shared_memory_left_mib"] == 0  # a killed trainer's weight buckets are RAM: none is left behind
