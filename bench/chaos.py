"""Kill the processes of a running job at random and count what the run kept. Prints JSON.

The job is ``make demo``'s: the tiny random model learns the letters task, so groups really train
and their rewards vary. ``--kills`` times, at a random moment (``--gap`` seconds apart at most), the
bench sends SIGKILL to one of the job's own processes, found by its command line in the job's
session, of a random kind:

- ``engine``, ``router``, ``proxy``, ``buffer``, ``trainer`` (a rank, the Ray actor): the job heals
  them itself (a replacement server; the service again at its address; a new trainer from the
  state the trainer keeps every step, which trains again the batches served since); the recovery
  is the time until the job's log says so;
- ``job``: the whole process group; the bench resumes it with ``--load``, and the resumed job
  trains again the steps since its checkpoint (every ``--save-interval`` steps, 4 by default).

A resume's recovery is the time from the kill until the resumed job logs a step. A job that stops
with no kill to stop it is a bug: the report lists each such stop (its exit code and the end of its
log) under ``crashes``, and the bench resumes it; a kill it could not make is listed under
``skipped``. At the end it reads the buffer's file and what each step trained
(``--save-debug-rollout-data``, one file per step, written again by a resumed step) and reports each
task's outcome: the rollout that played it, and its group trained (in the step the buffer recorded,
checked against the files), filtered, failed, dropped as stale, or left queued or waiting; the
Samples trained in two surviving steps; the Samples served to a step but in no surviving step's
training (lost); the aborted episodes played again; and the shared memory (RAM) that killed
trainers' weight buckets left behind. Then it runs the same job undisturbed, with the same seed, and
compares the final held-out reward.

    python bench/chaos.py                       # 20 kills of the six kinds, 100 rollouts
    python bench/chaos.py --kills 6 --rollouts 40 --gap 3 --no-baseline   # the suite's short version
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("engine", "router", "proxy", "buffer", "trainer", "job")
# How each kind shows on a command line (sgl-router names its process ``sglang::router``).
COMMANDS = {
    "engine": "serve-engine",
    "router": "sglang::router",
    "proxy": "inverted.cli proxy",
    "buffer": "inverted.cli buffer",
    "trainer": "ray::TrainActor",
}
# What the job logs once it has healed each kind itself.
HEALED = {
    "engine": " replaces ",
    "router": "the router is back at",
    "proxy": "the proxy is back at",
    "buffer": "the buffer is back at",
    "trainer": "the trainer is back at step",
}


def session_pids(sid: int, text: str) -> list[int]:
    """The job's own processes (its session) whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (
                os.getsid(int(entry.name)) == sid
                and text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def victims(sid: int, kind: str, timeout: float = 10.0) -> list[int]:
    """The job's processes of ``kind``; one being started again (a replaced server, a service at its
    address again) is back within seconds."""
    if kind == "job":
        return [sid]
    deadline = time.monotonic() + timeout
    while not (pids := session_pids(sid, COMMANDS[kind])) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def metrics_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class Job:
    """``inverted train`` in its own session; started again with ``--load`` after it died."""

    def __init__(self, args: argparse.Namespace, work: Path, name: str):
        self.run, self.log, self.args = work / name, work / f"{name}.log", args
        self.flags = [
            "--config",
            str(ROOT / "examples/demo.yaml"),
            "--hf-checkpoint",
            str(work / "model"),
            "--prompt-data",
            str(work / "letters.jsonl"),
            "--eval-prompt-data",
            str(work / "letters-eval.jsonl"),
            "--output-dir",
            str(self.run),
            "--num-rollout",
            str(args.rollouts),
            "--eval-interval",
            str(args.rollouts),
            "--save-interval",
            str(args.save_interval),
            "--seed",
            str(args.seed),
            "--log-level",
            "warning",
            # what each step trained, one file per step: a resumed step writes its file again
            "--save-debug-rollout-data",
            str(self.run / "trained" / "{rollout_id}.jsonl"),
        ]
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        resume = ["--load", str(self.run / "checkpoints")] if self.starts else []
        out = self.log.open("a")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inverted.cli", "train", *self.flags, *resume],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.starts += 1

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def crashed(self) -> dict:
        """What the job's own exit left: its code, its step, the end of its log."""
        tail = self.log.read_text(errors="replace").splitlines()[-30:]
        return {"exit": self.process.returncode, "at_step": self.steps(), "log_tail": "\n".join(tail)}

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def steps(self) -> int:
        return len([r for r in metrics_rows(self.run) if "rollout/samples" in r])


def wait(condition, timeout: float) -> float | None:
    """Seconds until ``condition()``, or None after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():
            return time.monotonic() - started
        time.sleep(0.2)
    return None


def make_inputs(work: Path) -> None:
    from envs import letters
    from envs.datasets import write_dataset
    from inverted.config import TinyModelConfig
    from inverted.tiny_model import make_tiny_model

    make_tiny_model(TinyModelConfig(out=str(work / "model"), arch="qwen2", preset="tiny", seed=0))
    write_dataset(letters.rows, work / "letters.jsonl", count=256, seed=0)
    write_dataset(letters.rows, work / "letters-eval.jsonl", count=32, seed=1)


def chaos(args: argparse.Namespace, work: Path) -> dict:
    rng = random.Random(args.seed)
    job = Job(args, work, "chaos")
    job.start()
    recoveries: list[dict] = []
    skipped: list[dict] = []  # kills not made, and why: a short run must still kill every kind
    crashes: list[dict] = []  # the job stopped with no kill to stop it: a bug, noted, then resumed past
    plan = [KINDS[i % len(KINDS)] for i in range(args.kills)]  # every kind, then again, in a random order
    rng.shuffle(plan)
    for kind in plan:
        wait(lambda: job.steps() >= 1 or not job.running, 600)
        time.sleep(rng.uniform(0.5, args.gap))
        if not job.running and job.process.returncode != 0:
            crashes.append(job.crashed())
            job.start()
            wait(lambda: job.steps() > crashes[-1]["at_step"] or not job.running, 600)
        if not job.running:
            skipped.append({"kind": kind, "at_step": job.steps(), "why": "the run had ended"})
            continue
        sid, steps, healed = job.process.pid, job.steps(), job.log.read_text().count(HEALED.get(kind, "\0"))
        pids = victims(sid, kind)
        if not pids:
            skipped.append({"kind": kind, "at_step": steps, "why": f"the job had no process {COMMANDS[kind]!r}"})
            continue
        victim = rng.choice(pids)
        killed_at = time.monotonic()
        if kind == "job":
            job.kill()
        else:
            os.kill(victim, signal.SIGKILL)
        if kind in HEALED:  # the job heals it: until its log says so
            recovered = wait(lambda: job.log.read_text().count(HEALED[kind]) > healed or not job.running, 300)
            if not job.running and job.process.returncode == 0:
                skipped.append({"kind": kind, "at_step": steps, "why": "the run ended before it healed"})
                continue
        stopped = None
        if kind not in HEALED or not job.running:  # it stopped (a kind it could not heal): resume it
            if kind in HEALED:  # it should have healed this one: keep why it stopped instead
                kind, stopped = kind + " (stopped the job)", job.crashed()
            job.start()
            recovered = wait(lambda: job.steps() > steps, 600)
        recoveries.append(
            {
                "kind": kind,
                "at_step": steps,
                "recovery_s": None if recovered is None else round(time.monotonic() - killed_at, 1),
            }
            | ({"stopped": stopped} if stopped else {})
        )
    while job.process.wait() != 0 and job.starts <= args.kills + 3:  # after the last recovery: a crash too
        crashes.append(job.crashed())
        job.start()
    report = {"recoveries": recoveries, "skipped": skipped, "crashes": crashes, "exit": job.process.returncode}
    return report | outcomes(job.run)


def outcomes(run: Path) -> dict:
    """Each task's outcome from the buffer's file, and what each step trained from its file (a step
    a kill undid is written again by the resumed job, so each file holds the training that survived)."""
    with closing(sqlite3.connect(f"file:{run / 'buffer.db'}?mode=ro", uri=True)) as db:
        tasks = dict(db.execute("SELECT state, COUNT(*) FROM tasks GROUP BY state"))
        groups = dict(db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state"))
        counters = dict(db.execute("SELECT name, value FROM counters"))
        consumed = {
            key
            for key in db.execute(
                "SELECT group_index, sample_index FROM samples JOIN groups USING (group_index) WHERE state = 'consumed'"
            )
        }
        samples_per_task = db.execute(
            "SELECT MAX(n) FROM (SELECT COUNT(*) n FROM samples GROUP BY group_index, sample_index)"
        ).fetchone()[0]
        trained_steps = dict(db.execute("SELECT group_index, trained_step FROM groups WHERE state = 'consumed'"))
        unplayed = db.execute("SELECT COUNT(*) FROM samples WHERE rollout_id IS NULL").fetchone()[0]
    trained: dict[tuple[int, int], int] = {}
    twice = 0
    for path in sorted((run / "trained").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            key = (sample["group_index"], sample["index"])
            twice += key in trained
            trained[key] = int(path.stem)
    rows = [r for r in metrics_rows(run) if "rollout/samples" in r]
    final_eval = [r for r in metrics_rows(run) if "eval/reward_mean" in r]
    return {
        "tasks": tasks,
        "groups": groups,
        "samples_per_task_max": samples_per_task,
        "samples_trained": len(trained),
        "samples_trained_twice": twice,
        "served_never_trained": len(consumed - trained.keys()),
        "trained_never_served": len(trained.keys() - consumed),
        # the buffer's own record (each served group's training step) against the surviving training
        "buffer_disagrees_with_training": sum(trained_steps.get(g) != step for (g, _), step in trained.items())
        + sum(step is None for step in trained_steps.values()),
        "samples_without_their_rollout": unplayed,  # the buffer names the rollout that played each task
        "steps": len({r["step"] for r in rows}),  # the job's --num-rollout, unless it ended early
        "steps_written_again": len(rows) - len({r["step"] for r in rows}),
        "aborted_played_again": counters.get("samples_requeued_aborted", 0),
        "leases_released": counters.get("leases_released", 0),
        "final_eval_reward": final_eval[-1]["eval/reward_mean"] if final_eval else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--rollouts", type=int, default=100, help="the job's --num-rollout")
    parser.add_argument("--gap", type=float, default=6.0, help="most seconds from a recovery to the next kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-interval", type=int, default=4, help="the job's --save-interval")
    parser.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    parser.add_argument("--out", help="write the JSON here too")
    parser.add_argument("--work", help="keep the runs and their logs here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        make_inputs(work)
        from inverted.train.shared_memory import orphaned_buckets, shared_buckets

        started, shared_before = time.monotonic(), shared_buckets()
        report = {"kills": args.kills, "rollouts": args.rollouts, **chaos(args, work)}
        # A killed trainer's weight buckets are RAM until someone unlinks them: the job must. (Orphaned
        # only: another job on this machine may hold live buckets meanwhile.)
        report["shared_memory_left_mib"] = round(
            sum(f.stat().st_size for f in orphaned_buckets() - shared_before) / 2**20
        )
        report["kinds_killed"] = sorted({r["kind"].split()[0] for r in report["recoveries"]})
        report["chaos_run_s"] = round(time.monotonic() - started, 1)
        if not args.no_baseline:
            calm = Job(args, work, "calm")
            calm.start()
            calm.process.wait()
            report["undisturbed_eval_reward"] = outcomes(calm.run)["final_eval_reward"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
