"""A real two-node Ray cluster on this machine, started as Ray documents it (``ray start --head``,
then ``ray start --address``), each node offering its own custom resource: the job joins it with
``--ray-address``, puts its trainer on one node and its rollout servers on the other, and when the
rollout node dies it stops with a clear message instead of hanging.

Both nodes share this machine's loopback address (see ``docs/deployment.md`` for what changes when
they do not).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from inverted.processes import free_port
from tests.job.test_async_and_faults import RUN, long_tail_data, own_model, processes_with, start_job, wait_for
from tests.job.test_train_job import metrics_rows

RAY = str(Path(sys.executable).parent / "ray")


def ray(*args: str, env: dict[str, str]) -> None:
    subprocess.run([RAY, *args], check=True, env=env, capture_output=True, timeout=120)


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    """Head (offering ``train_node``) and a second node (offering ``rollout_node``); stopped after.

    ``ray start --head`` turns on Ray's token authentication (2.5x): whoever joins, the second node
    and the job's driver alike, runs with ``RAY_AUTH_MODE=token`` and reads the head's token file.
    """
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    # Its own short temp dir (Unix socket paths are short): the processes of this cluster, and only
    # they, carry it on their command lines, so stopping it touches no other Ray on the machine.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    port = free_port()
    try:
        ray("start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
            "--resources", json.dumps({"train_node": 1}), "--include-dashboard=false", "--temp-dir", temp, env=env)
        ray("start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
            "--resources", json.dumps({"rollout_node": 1}), "--temp-dir", temp, env=env)
        yield f"127.0.0.1:{port}"
    finally:
        for pid in processes_with(temp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def raylet_offering(resource: str) -> int:
    (pid,) = [p for p in processes_with("raylet") if resource in Path(f"/proc/{p}/cmdline").read_text()
              and "/raylet" in Path(f"/proc/{p}/cmdline").read_text().split("\0")[0]]
    return pid


def test_trainer_and_servers_go_to_their_nodes_and_losing_the_rollout_node_stops_the_job_clearly(
        cluster, tiny_model, tmp_path):
    model, run_dir = own_model(tiny_model, tmp_path), tmp_path / "run"
    data = long_tail_data(tmp_path / "long_tail.jsonl", count=64, short_s=0.3, long_s=0.3)
    log = tmp_path / "job.log"
    job = start_job("--hf-checkpoint", str(model), "--prompt-data", str(data), "--output-dir", str(run_dir),
                    "--num-rollout", "30", "--rollout-max-response-len", "32", "--ray-address", cluster,
                    "--actor-node-resource", "train_node", "--rollout-node-resource", "rollout_node",
                    "--startup-timeout", "25", *RUN, log=log)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics_rows(run_dir)) >= 1, job, log)
        rollout_raylet, train_raylet = raylet_offering("rollout_node"), raylet_offering("train_node")
        engines = processes_with(f"serve-engine --model {model} ")
        assert len(engines) == 2 and all(rollout_raylet in ancestors(pid) for pid in engines)
        trainers = processes_with("ray::TrainActor")
        assert trainers and all(train_raylet in ancestors(pid) for pid in trainers)

        os.kill(rollout_raylet, signal.SIGKILL)  # the rollout node is gone, its servers with it
        started = time.monotonic()
        code = job.wait(240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = log.read_text()
    assert code != 0 and time.monotonic() - started < 200, text[-4000:]
    assert "no Ray node took rollout server" in text and "rollout_node" in text, text[-4000:]
    deadline = time.monotonic() + 30
    while processes_with(f"serve-engine --model {model} ") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_with(f"serve-engine --model {model} ")  # nothing left behind
