"""A real two-node Ray cluster on this machine, started as Ray documents it (``ray start --head``,
then ``ray start --address``), each node offering its own custom resource: the job joins it with
``--ray-address``, puts its trainer on one node and its rollout servers on the other, and when the
rollout node dies it stops with a clear message instead of hanging.

Where the machine allows it (root and ``ip netns``), the second node lives in a network namespace
of its own, joined by a veth pair: its own address, no shared loopback, so the servers' binding,
their admin key and the weight-sync transport (``distributed``: gloo across hosts) are exercised
as on two hosts. Elsewhere both nodes share this machine's loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inverted.processes import free_port
from tests.job.test_async_and_faults import long_tail_data, own_model, processes_with, start_job, wait_for
from tests.job.test_train_job import metrics_rows

RAY = str(Path(sys.executable).parent / "ray")


def ray(*args: str, env: dict[str, str], prefix: list[str] | None = None) -> None:
    subprocess.run([*(prefix or []), RAY, *args], check=True, env=env, capture_output=True, timeout=120)


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


@dataclass
class Cluster:
    address: str  # the head's, for --ray-address
    namespace: str | None  # the second node's network namespace, if it has one
    head_ip: str
    node_ip: str


def make_namespace(tag: str) -> tuple[str, str, str] | None:
    """A network namespace joined to this one by a veth pair: (its name, this side's address, its
    address); None where the machine does not allow it."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    ns, here, there = f"inv-{tag}", f"10.211.{int(tag[:2], 16)}.1", f"10.211.{int(tag[:2], 16)}.2"
    steps = [["netns", "add", ns], ["link", "add", f"vh{tag}", "type", "veth", "peer", "name", f"vn{tag}"],
             ["link", "set", f"vn{tag}", "netns", ns], ["addr", "add", f"{here}/24", "dev", f"vh{tag}"],
             ["link", "set", f"vh{tag}", "up"], ["-n", ns, "addr", "add", f"{there}/24", "dev", f"vn{tag}"],
             ["-n", ns, "link", "set", f"vn{tag}", "up"], ["-n", ns, "link", "set", "lo", "up"]]
    for step in steps:
        if subprocess.run(["ip", *step], capture_output=True).returncode:
            remove_namespace(ns, tag)
            return None
    return ns, here, there


def remove_namespace(ns: str, tag: str) -> None:
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", f"vh{tag}"], capture_output=True)


@pytest.fixture
def cluster(monkeypatch):
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
    tag = secrets.token_hex(3)
    namespace = make_namespace(tag)
    ns, head_ip, node_ip = namespace or (None, "127.0.0.1", "127.0.0.1")
    inside = ["ip", "netns", "exec", ns] if ns else []
    port = free_port(head_ip)
    try:
        ray("start", "--head", "--port", str(port), "--node-ip-address", head_ip, "--num-cpus", "2",
            "--resources", json.dumps({"train_node": 1}), "--include-dashboard=false", "--temp-dir", temp, env=env)
        ray("start", "--address", f"{head_ip}:{port}", "--node-ip-address", node_ip, "--num-cpus", "2",
            "--resources", json.dumps({"rollout_node": 1}), "--temp-dir", temp, env=env, prefix=inside)
        yield Cluster(f"{head_ip}:{port}", ns, head_ip, node_ip)
    finally:
        for pid in processes_with(temp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if ns:
            remove_namespace(ns, tag)
        shutil.rmtree(temp, ignore_errors=True)


def net_namespace(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


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
                    "--num-rollout", "30", "--rollout-max-response-len", "32", "--ray-address", cluster.address,
                    "--actor-node-resource", "train_node", "--rollout-node-resource", "rollout_node",
                    "--startup-timeout", "25", "--num-engines", "2", "--rollout-batch-size", "2",
                    "--n-samples-per-prompt", "2", "--lr", "1e-3", "--env-path", "envs.long_tail:episode", log=log)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics_rows(run_dir)) >= 2, job, log)
        rollout_raylet, train_raylet = raylet_offering("rollout_node"), raylet_offering("train_node")
        engines = processes_with(f"serve-engine --model {model} ")
        assert len(engines) == 2 and all(rollout_raylet in ancestors(pid) for pid in engines)
        trainers = processes_with("ray::TrainActor")
        assert trainers and all(train_raylet in ancestors(pid) for pid in trainers)
        argv = Path(f"/proc/{engines[0]}/cmdline").read_bytes().split(b"\0")
        engine_url = f"http://{cluster.node_ip}:{int(argv[argv.index(b'--port') + 1])}"
        if cluster.namespace:  # two hosts in all but the kernel: own address, reached over the veth
            assert {net_namespace(pid) for pid in engines} == {os.stat(f"/run/netns/{cluster.namespace}").st_ino}
            assert {net_namespace(pid) for pid in trainers} == {net_namespace("self")}
            assert argv[argv.index(b"--host") + 1].decode() == cluster.node_ip
            assert "over distributed" in log.read_text()  # no shared memory across hosts: gloo
        # the servers' weight routes take only the job's key, from anywhere
        assert httpx.post(engine_url + "/update_weights_from_disk", json={"model_path": str(model)}).status_code == 401

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
